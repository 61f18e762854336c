"""Throughput and memory of one SparseTable shard (recps.ps.table), single process.

A table of --rows rows (dim --dim, row-wise Adagrad, CTR accessor) is built by pulls of
--build-batch new keys. Then batches of --batch keys drawn Zipf(--zipf) over the existing
rows are timed for:

    index lookups/s    KeyIndex.lookup only (key -> slot)
    pull keys/s        lookup + gather of the values (all keys exist)
    upserts/s          pull with creation, 10% of each batch new keys (lookup, admit,
                       initialize, insert, gather); room is reserved before, and the
                       time of that resize is reported as reserve_s
    push rows/s        row-wise Adagrad push: duplicates merged, rows gathered, updated,
                       scattered (reported per key pushed and per distinct row updated)
    bytes/row          (RSS after build - RSS before) / rows, against the raw payload
                       (key + value + optimizer state + show/click/unseen/delta_score)

    python -m benchmarks.table_bench                                   # 10M rows, dim 16 (issue 3)
    python -m benchmarks.table_bench --rows 100000000 --dim 8 --reserve --build-only
    python -m benchmarks.table_bench --compare-maps                    # FBGEMM vs pandas vs dict
    python -m benchmarks.table_bench --quick                           # 1M rows, a few seconds

Prints one JSON object and, with --markdown, a Markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import time

import numpy as np
import torch

from recps.ps.table import CtrAccessor, Initializer, KeyIndex, RowWiseAdagradRule, SparseTable
from recps.ps.table.hashing import splitmix64


def trim() -> None:
    """Return freed heap memory to the OS so RSS counts live memory only."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # pragma: no cover - non-glibc
        pass


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def key_of(ids: torch.Tensor) -> torch.Tensor:
    """Row id -> a well-spread int64 key (covers negatives and values above 2^62)."""
    return splitmix64(ids)


def zipf_ids(rng: np.random.Generator, a: float, n_rows: int, size: int) -> torch.Tensor:
    """Zipf(a) ranks truncated to [0, n_rows)."""
    out = np.empty(0, dtype=np.int64)
    while out.size < size:
        draw = rng.zipf(a, size * 2) - 1
        out = np.concatenate([out, draw[draw < n_rows]])
    return torch.from_numpy(out[:size].astype(np.int64))


CPU_SECONDS: dict[str, float] = {}


def timed(fn, batches, name: str = "") -> float:
    """Wall seconds for fn over every batch (after one warm-up call). The process CPU
    seconds go to CPU_SECONDS[name]: on a shared machine, items per CPU-second with one
    torch thread is the figure an idle machine would show as items per second."""
    fn(batches[0])
    start, cpu = time.perf_counter(), time.process_time()
    for b in batches:
        fn(b)
    if name:
        CPU_SECONDS[name] = time.process_time() - cpu
    return time.perf_counter() - start


def build(table: SparseTable, rows: int, batch: int) -> float:
    start = time.perf_counter()
    for lo in range(0, rows, batch):
        table.pull(key_of(torch.arange(lo, min(lo + batch, rows))))
    return time.perf_counter() - start


def compare_maps(n: int, batch: int, batches: int) -> dict:
    """Lookups/s and upserts/s of candidate key -> slot maps at n keys."""
    import pandas._libs.hashtable as pdh

    rng = np.random.default_rng(0)
    keys = key_of(torch.arange(n))
    queries = [key_of(zipf_ids(rng, 1.1, n, batch)) for _ in range(batches)]
    fresh = [key_of(torch.arange(n + i * batch, n + (i + 1) * batch)) for i in range(batches)]
    out = {}

    index = KeyIndex()
    t = time.perf_counter()
    for chunk in keys.split(1 << 20):
        index.insert(chunk, torch.arange(chunk.numel()))
    out["fbgemm_keyindex_insert_per_s"] = n / (time.perf_counter() - t)
    out["fbgemm_keyindex_lookup_per_s"] = batch * batches / timed(index.lookup, queries, "fbgemm_lookup")

    def upsert(b):
        missing = b[index.lookup(b) < 0]
        index.insert(missing, torch.arange(missing.numel()))

    out["fbgemm_keyindex_upsert_per_s"] = batch * batches / timed(upsert, fresh, "fbgemm_upsert")
    del index
    gc.collect()

    table = pdh.Int64HashTable(n)
    t = time.perf_counter()
    table.map_locations(keys.numpy())
    out["pandas_insert_per_s"] = n / (time.perf_counter() - t)
    q_np = [q.numpy() for q in queries]
    out["pandas_lookup_per_s"] = batch * batches / timed(table.lookup, q_np, "pandas_lookup")
    del table
    gc.collect()

    small = min(n, 1_000_000)  # a dict of 10M ints costs ~1 GB and minutes to build
    d = dict(zip(keys[:small].tolist(), range(small)))
    qs = [key_of(zipf_ids(rng, 1.1, small, batch)).tolist() for _ in range(3)]
    out["python_dict_lookup_per_s"] = batch * 3 / timed(lambda q: [d.get(k, -1) for k in q], qs, "dict_lookup")
    for name in ("fbgemm_lookup", "fbgemm_upsert", "pandas_lookup"):
        out[f"{name}_per_cpu_s"] = batch * batches / CPU_SECONDS[name]
    out["dict_lookup_per_cpu_s"] = batch * 3 / CPU_SECONDS["dict_lookup"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=100_000)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--build-batch", type=int, default=1_000_000)
    p.add_argument("--new-fraction", type=float, default=0.1)
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the key popularity")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--reserve", action="store_true", help="pass capacity=--rows (reserve up front)")
    p.add_argument("--build-only", action="store_true", help="build, report RSS and time, stop")
    p.add_argument("--compare-maps", action="store_true", help="also time pandas' Int64HashTable and a dict")
    p.add_argument("--quick", action="store_true", help="1M rows, 5 batches")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.rows, args.batches = 1_000_000, 5
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)

    result: dict = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch threads {args.threads}",
        "load_average_at_start": os.getloadavg(),
        "rows": args.rows,
        "dim": args.dim,
        "batch": args.batch,
        "zipf": args.zipf,
        "reserve": args.reserve,
    }
    # Batches are drawn before the baseline so their memory is not charged to the table.
    n_new = int(args.batch * args.new_fraction)
    if not args.build_only:
        hits = [key_of(zipf_ids(rng, args.zipf, args.rows, args.batch)) for _ in range(args.batches)]
        upserts = []
        for i in range(args.batches):
            old = key_of(zipf_ids(rng, args.zipf, args.rows, args.batch - n_new))
            new = key_of(torch.arange(args.rows + i * n_new, args.rows + (i + 1) * n_new))
            upserts.append(torch.cat([old, new])[torch.from_numpy(rng.permutation(args.batch))])
        grads = torch.randn(args.batch, args.dim)
    trim()
    base_rss = rss_bytes()

    table = SparseTable(
        args.dim,
        optimizer=RowWiseAdagradRule(lr=0.05),
        initializer=Initializer("uniform", low=-0.01, high=0.01),
        accessor=CtrAccessor(),
        capacity=args.rows if args.reserve else 0,
    )
    cpu = time.process_time()
    result["build_s"] = build(table, args.rows, args.build_batch)
    result["build_cpu_s"] = time.process_time() - cpu
    result["build_rows_per_s"] = args.rows / result["build_s"]
    trim()
    rss = rss_bytes()
    result["rss_gib"] = rss / 2**30
    result["peak_rss_gib"] = rss_bytes("VmHWM") / 2**30
    result["bytes_per_row"] = (rss - base_rss) / args.rows
    state_cols = table.rule.state_width(args.dim)
    raw = 8 + 4 * args.dim + 4 * state_cols + 16  # key + value + state + show/click/unseen/delta_score
    result["raw_payload_bytes_per_row"] = raw
    result["bytes_per_row_over_raw"] = result["bytes_per_row"] / raw
    result["bucket_capacity"] = table._index.capacity
    assert len(table) == args.rows

    if not args.build_only:
        b = args.batch * args.batches
        result["index_lookups_per_s"] = b / timed(table._index.lookup, hits, "index_lookups")
        result["pull_keys_per_s"] = b / timed(table.pull, hits, "pull_keys")
        distinct = sum(int(torch.unique(h).numel()) for h in hits)
        result["distinct_fraction"] = distinct / b
        shows, clicks = torch.ones(args.batch), torch.zeros(args.batch)  # a batch's statistics (the accessor needs them)
        result["push_keys_per_s"] = b / timed(lambda k: table.push(k, grads, shows=shows, clicks=clicks), hits, "push_keys")
        result["push_distinct_rows_per_s"] = result["push_keys_per_s"] * distinct / b
        # Make room for the new rows first: a resize inside a 20-batch window would charge
        # one whole-table copy to it (amortized over ~500 such windows in steady state).
        start = time.perf_counter()
        table.reserve(len(table) + (args.batches + 1) * n_new)
        result["reserve_s"] = time.perf_counter() - start
        before = len(table)
        result["upserts_per_s"] = b / timed(table.pull, upserts, "upserts")
        result["rows_created"] = len(table) - before
        for name, cpu in CPU_SECONDS.items():
            result[f"{name}_per_cpu_s"] = b / cpu
    if args.compare_maps:
        del table
        gc.collect()
        result["maps"] = compare_maps(min(args.rows, 10_000_000), args.batch, args.batches)
    result["load_average_at_end"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    if args.markdown:
        print()
        print("| metric | value |")
        print("| --- | --- |")
        for k, v in result.items():
            if isinstance(v, float):
                v = f"{v / 1e6:.2f} M" if v > 1e5 else f"{v:.3g}"
            print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
