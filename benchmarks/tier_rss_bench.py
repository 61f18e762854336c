"""Resident memory of one process holding a sparse table, all-RAM or under a budget (issue 31).

Each configuration runs in its own child process (a fresh heap): it creates `--rows` rows (dim 8,
row-wise Adagrad, CTR accessor) by pulling every key in chunks of 65,536, then pulls and pushes
`--batches` batches of the distinct keys among 4,096 Zipf(1.1) draws, and reports its resident set
(VmRSS) and peak (VmHWM) from /proc/self/status, before the table (torch, numba and rocksdict
imported) and at the end (and after glibc's malloc_trim), with the rows per tier and the store's bytes on disk.

    python -m benchmarks.tier_rss_bench --rows 1000000 --budgets none,10000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                name, value = line.split(":")
                out[name] = int(value.split()[0]) * 1024  # kB -> bytes
    return out


def child(rows: int, budget: int | None, batches: int) -> dict:
    import importlib

    import numpy as np
    import torch

    importlib.import_module("rocksdict")  # loaded before the baseline, as a tiered server has it

    from recps.ps.table import CtrAccessor, RowWiseAdagradRule, SparseTable, warm_up_kernels

    torch.set_num_threads(1)
    warm_up_kernels()
    base = _status()
    table = SparseTable(dim=8, optimizer=RowWiseAdagradRule(lr=0.05), accessor=CtrAccessor(), memory_budget=budget)
    for start in range(0, rows, 1 << 16):
        table.pull(torch.arange(start, min(rows, start + (1 << 16))))
    rng = np.random.default_rng(0)
    perm = rng.permutation(rows)
    for _ in range(batches):
        r = rng.zipf(1.1, 8192)
        keys = torch.from_numpy(np.unique(perm[r[r <= rows][:4096] - 1]))
        table.pull(keys)
        n = keys.numel()
        table.push(keys, torch.full((n, 8), 1e-3), shows=torch.ones(n), clicks=torch.zeros(n))
    end = _status()
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what of the growth is freed memory the heap kept
    trimmed = _status()
    tier = table.tier_stats() or {}
    out = {"rows": len(table), "budget_rows": budget, "rss_base": base["VmRSS"], "rss_end": end["VmRSS"],
           "peak_end": end["VmHWM"], "rss_after_malloc_trim": trimmed["VmRSS"], "rss_growth_per_row": round((end["VmRSS"] - base["VmRSS"]) / rows, 1),
           "rows_memory": tier.get("rows_memory", len(table)), "rows_disk": tier.get("rows_disk", 0),
           "disk_bytes": tier.get("disk_bytes", 0)}
    table.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--budgets", default="none,10000", help="comma-separated: none (all-RAM) or rows")
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        budget = None if args.child == "none" else int(args.child)
        print(json.dumps(child(args.rows, budget, args.batches)))
        return
    for b in args.budgets.split(","):
        load = os.getloadavg()
        proc = subprocess.run([sys.executable, "-m", "benchmarks.tier_rss_bench", "--rows", str(args.rows),
                               "--batches", str(args.batches), "--child", b],
                              capture_output=True, text=True, timeout=1800, check=True)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["loadavg"] = [round(x, 2) for x in load]
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
