"""Per-request cost of a RAM-only sparse table's verbs, to compare two checkouts of recps.

Run it once per checkout, alternating, and compare the medians: a change to the table (issue 31's
disk tier) must leave the RAM-only path as fast. `--src` imports recps from another source tree
(e.g. `git archive main recps | tar -x -C /tmp/main_src`) instead of the editable install.

One table of `--rows` rows of dim 8 with row-wise Adagrad, with and without the CTR accessor;
requests of the distinct keys among 4,096 Zipf(1.1) draws: pull, push of unique keys (the
client's pushes; without accessor the compiled update), and push with duplicates (a sync step of
two workers whose keys overlap). One thread.

    python -m benchmarks.table_path_bench --rows 1000000 --repeats 200 [--src /tmp/main_src]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import sys

import numpy as np
import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--src", default=None, help="a folder holding the recps package to measure")
    args = p.parse_args()
    if args.src:  # ahead of the editable install's finder, which would win over sys.path
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__name__.lower()]
        sys.path.insert(0, args.src)
        for name in [m for m in sys.modules if m == "recps" or m.startswith("recps.")]:
            del sys.modules[name]
    import recps
    from recps.ps.table import CtrAccessor, RowWiseAdagradRule, SparseTable
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    perm = rng.permutation(args.rows)

    def batch() -> torch.Tensor:
        r = rng.zipf(1.1, 8192)
        r = r[r <= args.rows][:4096] - 1
        return torch.from_numpy(np.unique(perm[r]))

    batches = [batch() for _ in range(args.repeats)]
    out = {"source": os.path.dirname(recps.__file__), "rows": args.rows, "loadavg": os.getloadavg()}
    for accessor in (None, CtrAccessor()):
        table = SparseTable(dim=8, optimizer=RowWiseAdagradRule(lr=0.05), accessor=accessor, capacity=args.rows)
        for s in range(0, args.rows, 1 << 16):
            table.pull(torch.arange(s, min(args.rows, s + (1 << 16))))
        tag = "ctr" if accessor is not None else "plain"
        times: dict[str, list[float]] = {"pull": [], "push_unique": [], "push_duplicates": []}
        for k in batches:
            n = k.numel()
            extra = dict(shows=torch.ones(n), clicks=torch.zeros(n)) if accessor is not None else {}
            t = time.perf_counter()
            table.pull(k)
            times["pull"].append(time.perf_counter() - t)
            grads = torch.full((n, 8), 1e-3)
            t = time.perf_counter()
            table.push(k, grads, unique=True, **extra)
            times["push_unique"].append(time.perf_counter() - t)
            dup = torch.cat([k, k[: n // 2]])  # two workers' keys, overlapping
            extra2 = {name: torch.cat([v, v[: n // 2]]) for name, v in extra.items()}
            t = time.perf_counter()
            table.push(dup, torch.full((dup.numel(), 8), 1e-3), **extra2)
            times["push_duplicates"].append(time.perf_counter() - t)
        for verb, ts in times.items():
            out[f"{tag}_{verb}_median_us"] = round(statistics.median(ts) * 1e6, 1)
    out["loadavg_after"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
