"""Scale: one sparse table of N keys over S server processes, built and used by W worker processes.

    python -m benchmarks.scale_bench --keys 100000000 --dim 8 --servers 2 --workers 2 [--save]
    python -m benchmarks.scale_bench --keys 200000 --seconds 2          # a small check

Straight on recps.ps.node (PSServer / PSClient over TCP loopback, no training): the servers run
in their own processes; the table (dim D, row-wise Adagrad, capacity reserved for N rows) is
created once; then every worker at once
1. builds: pulls its 1/W of the keys 0..N-1 in batches of `build_batch` new keys (rows are created
   on first pull) -> build time (first start to last finish) and rows/s;
2. pulls batches of `batch` existing keys drawn uniformly (the client de-duplicates) for
   `seconds` -> keys/s summed over the workers;
3. pushes (K, D) gradients for such batches for `seconds` -> keys/s summed over the workers.
Then RSS (VmRSS) and peak RSS (VmHWM) of every server, bytes per row (the servers' RSS growth
from before the table was created, over the rows), and with `--save` a full
checkpoint of the table (written under --save-dir, then deleted): seconds and size.
Prints one JSON line; `run(...)` returns the same dict.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.procmon import peak_rss_mib

__all__ = ["run", "main"]

TABLE = "scale"
_TOKEN = "scale-bench"


def _serve(index: int, num_servers: int, ready, stop) -> None:
    from recps.ps.modes import server_halves
    from recps.ps.node import PSServer

    with PSServer(index, num_servers, token=_TOKEN, halves=server_halves()) as server:
        ready.put((index, server.endpoint))
        stop.wait(24 * 3600)


def _work(index: int, workers: int, endpoints: list[str], cfg: dict, barrier, results) -> None:
    import torch

    from recps.ps.node import PSClient

    torch.set_num_threads(1)
    out: dict[str, Any] = {"worker": index}
    timeout = float(cfg["timeout_s"])
    g = torch.Generator().manual_seed(index)
    with PSClient(endpoints, token=_TOKEN, timeout_s=timeout) as client:
        keys, per = int(cfg["keys"]), -(-int(cfg["keys"]) // workers)
        lo, hi = index * per, min(keys, (index + 1) * per)
        barrier.wait(timeout)
        start = time.time()
        for first in range(lo, hi, int(cfg["build_batch"])):
            batch = torch.arange(first, min(hi, first + int(cfg["build_batch"])), dtype=torch.int64)  # (K,) new
            client.pull(TABLE, batch, assume_unique=True).wait(timeout)
        out.update(build_start=start, build_end=time.time(), built=hi - lo)
        for phase in ("pull", "push"):
            barrier.wait(timeout)
            done, start = 0, time.perf_counter()
            while time.perf_counter() - start < float(cfg["seconds"]):
                batch = torch.randint(0, keys, (int(cfg["batch"]),), generator=g)  # (K,) with repeats
                if phase == "pull":
                    client.pull(TABLE, batch).wait(timeout)  # (K, D)
                else:
                    client.push(TABLE, batch, torch.full((batch.numel(), int(cfg["dim"])), 1e-3)).wait(timeout)
                done += batch.numel()
            out[f"{phase}_keys_per_s"] = done / (time.perf_counter() - start)
    results.put(out)


def _memory(pids: list[int]) -> list[dict[str, float]]:
    out = []
    for pid in pids:
        hwm, rss = peak_rss_mib(pid) or (float("nan"), float("nan"))
        out.append({"rss_gib": round(rss / 1024, 3), "peak_rss_gib": round(hwm / 1024, 3)})
    return out


def run(keys: int, dim: int = 8, servers: int = 2, workers: int = 2, batch: int = 100_000,
        build_batch: int = 1_000_000, seconds: float = 20.0, save: bool = False,
        save_dir: str | os.PathLike | None = None, timeout_s: float = 600.0) -> dict[str, Any]:
    """Runs the benchmark (see the module docstring); returns its figures."""
    import torch

    from recps.ps.node import PSClient

    cfg = {"keys": keys, "dim": dim, "servers": servers, "workers": workers, "batch": batch,
           "build_batch": build_batch, "seconds": seconds, "timeout_s": timeout_s, "optimizer": "rowwise_adagrad"}
    ctx = mp.get_context("spawn")
    ready, stop, results = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_serve, args=(i, servers, ready, stop), daemon=True) for i in range(servers)]
    for p in procs:
        p.start()
    worker_procs = []
    try:
        endpoints = [e for _, e in sorted(ready.get(timeout=timeout_s) for _ in procs)]
        with PSClient(endpoints, token=_TOKEN, timeout_s=timeout_s) as client:
            base = _memory([p.pid for p in procs])  # before the table: the servers' own footprint
            client.create_sparse_table(TABLE, dim=dim, optimizer={"name": "rowwise_adagrad", "lr": 0.05},
                                       capacity=keys, mode="async")  # pushes: the rule on arrival
            barrier = ctx.Barrier(workers)
            worker_procs = [ctx.Process(target=_work, args=(w, workers, endpoints, cfg, barrier, results), daemon=True)
                        for w in range(workers)]
            for p in worker_procs:
                p.start()
            per = [results.get(timeout=timeout_s + 2 * seconds + keys / 1e5) for _ in worker_procs]
            for p in worker_procs:
                p.join(timeout=60)
            built = _memory([p.pid for p in procs])
            rows = client.stats(timeout=timeout_s)["tables"][TABLE]["rows"]
            out: dict[str, Any] = {"config": cfg, "rows": rows}
            build_s = max(r["build_end"] for r in per) - min(r["build_start"] for r in per)
            out.update(build_s=round(build_s, 2), build_rows_per_s=round(rows / build_s),
                       pull_keys_per_s=round(sum(r["pull_keys_per_s"] for r in per)),
                       push_keys_per_s=round(sum(r["push_keys_per_s"] for r in per)),
                       servers=[{**b, "rss_at_start_gib": s["rss_gib"]} for b, s in zip(built, base)])
            grown = sum(b["rss_gib"] - s["rss_gib"] for b, s in zip(built, base))
            out["bytes_per_row"] = round(grown * 2**30 / max(1, rows), 1)
            if save:
                folder = Path(tempfile.mkdtemp(prefix="recps-scale-save-", dir=save_dir))
                try:
                    start = time.perf_counter()
                    client.save(str(folder / "checkpoint"), mode="full", tables=[TABLE], timeout=max(timeout_s, keys / 1e5))
                    out["save_s"] = round(time.perf_counter() - start, 2)
                    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
                    out["save_gib"] = round(size / 2**30, 3)
                finally:
                    shutil.rmtree(folder, ignore_errors=True)
            out["torch_threads_per_worker"] = 1
            out["load_1min"] = round(os.getloadavg()[0], 2)
            return out
    finally:
        stop.set()
        for p in [*worker_procs, *procs]:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000_000)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=100_000, help="keys per pull / push request in the timed phases")
    parser.add_argument("--build-batch", type=int, default=1_000_000, help="new keys per pull while building")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the pull and of the push phase")
    parser.add_argument("--save", action="store_true", help="also time a full checkpoint of the table (then deleted)")
    parser.add_argument("--save-dir", default=None, help="where the checkpoint is written (default: the temp dir)")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.keys, args.dim, args.servers, args.workers, args.batch, args.build_batch,
                         args.seconds, args.save, args.save_dir)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
