"""The recall stage's item index (recps.pipeline.ann) at funnel size: build time, per-user latency,
batched users/s and recall@k against exact search (issue 16: at 10^6 items, k = 10,000, p99 <= 50 ms
per user, >= 200 users/s batched, recall >= 0.95).

Item and user vectors are drawn around --clusters Gaussian centres (what trained towers produce; the
centres' spread is 1, the points' --noise) or, with --clusters 0, from one isotropic Gaussian (no
structure: the hardest case for an approximate index). Each user has --seen already-seen items (random
catalogue items plus, half of them, items of its own exact top-k), excluded from its results.

    python -m benchmarks.ann_bench                                  # 10^6 items, d=64, k=10,000, kind=auto (ivf)
    python -m benchmarks.ann_bench --items 10000000 --dim 32 --kind hnsw --k 1000
    python -m benchmarks.ann_bench --clusters 0 --calibrate 0.95    # isotropic vectors, nprobe set for recall 0.95
    python -m benchmarks.ann_bench --quick                          # 20,000 items, seconds
    python -m benchmarks.ann_bench --markdown benchmarks/results/ann_bench_2026-12-05.jsonl

Measured per run, with the index's faiss threads = --threads:
    build_s            ItemIndex.build (k-means training + adding, or the graph) of the approximate index
    single p50/p99     one user per search call (k results, its seen items excluded), --latency-users calls
    users/s            --batch users per call over --batch-users users
    recall@k           the approximate index's ids against an exact index's (IndexFlat, same exclusions)
                       on --recall-users users (a sample: exact search of every user would dominate the run)
and the same latency and throughput for the exact index, as the baseline the approximate one must beat.
One JSON line per run is appended to --out; --markdown turns such lines into the RESULTS.md table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from recps import fs as rfs
from recps.pipeline.ann import AnnConfig, ItemIndex, Seen, recall_at_k

TARGETS = {"p99_ms": 50.0, "users_per_s": 200.0, "recall": 0.95}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def vectors(rng: np.random.Generator, n: int, centres: np.ndarray | None, dim: int, noise: float) -> np.ndarray:
    """(n, dim) float32: around random centres, or isotropic Gaussian when centres is None."""
    if centres is None:
        return rng.standard_normal((n, dim), dtype=np.float32)
    out = rng.standard_normal((n, dim), dtype=np.float32)  # (n, dim)
    out *= noise
    out += centres[rng.integers(0, len(centres), n)]
    return out


def seen_items(rng: np.random.Generator, exact: ItemIndex, users: np.ndarray, k: int, seen: int) -> Seen:
    """Per user: seen // 2 of its own exact top-k (so the filter changes the answer) + random items."""
    if seen == 0:
        return Seen(np.zeros(len(users) + 1, np.int64), np.zeros(0, np.int64))
    own = seen // 2
    top = exact.search(users, k)[0]  # (U, k)
    picks = rng.integers(0, k, (len(users), own))  # (U, own) ranks (a repeat is harmless: excluded twice)
    mine = np.take_along_axis(top, picks, axis=1)  # (U, own)
    other = rng.choice(exact.ids, (len(users), seen - own))  # (U, seen - own)
    ids = np.concatenate([mine, other], axis=1)  # (U, seen)
    return Seen(np.arange(len(users) + 1, dtype=np.int64) * seen, ids.reshape(-1))


def rows(seen: Seen, start: int, stop: int) -> Seen:
    """The CSR slice of query rows start..stop."""
    lo, hi = seen.offsets[start], seen.offsets[stop]
    return Seen(seen.offsets[start:stop + 1] - lo, seen.ids[lo:hi])


def timing(index: ItemIndex, users: np.ndarray, seen: Seen, k: int, latency_users: int, batch: int,
           batch_users: int) -> dict[str, Any]:
    """Single-user latency (ms) and batched users/s of `index` over the first users."""
    index.search(users[:1], k, exclude=rows(seen, 0, 1))  # warm-up: first-touch of the index's pages
    lat, cpu = [], []
    for u in range(latency_users):
        one = rows(seen, u, u + 1)
        t, c = time.perf_counter(), time.thread_time()  # one query runs on this thread (ItemIndex: threads <= rows)
        index.search(users[u:u + 1], k, exclude=one)
        lat.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    lat_ms, cpu_ms = 1e3 * np.asarray(lat), 1e3 * np.asarray(cpu)
    t, c = time.perf_counter(), time.process_time()
    for start in range(0, batch_users, batch):
        stop = min(batch_users, start + batch)
        index.search(users[start:stop], k, exclude=rows(seen, start, stop))
    elapsed, cpu_s = time.perf_counter() - t, time.process_time() - c
    return {"p50_ms": round(float(np.percentile(lat_ms, 50)), 2), "p99_ms": round(float(np.percentile(lat_ms, 99)), 2),
            "mean_ms": round(float(lat_ms.mean()), 2), "max_ms": round(float(lat_ms.max()), 2),
            "users_per_s": round(batch_users / elapsed, 1),
            # CPU time: what the search costs whatever else runs on the machine (wall-clock = CPU + waiting for a core)
            "cpu_p50_ms": round(float(np.percentile(cpu_ms, 50)), 2), "cpu_p99_ms": round(float(np.percentile(cpu_ms, 99)), 2),
            "users_per_cpu_s": round(batch_users / cpu_s, 1)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    load_before = os.getloadavg()
    centres = rng.standard_normal((args.clusters, args.dim), dtype=np.float32) if args.clusters else None
    t = time.perf_counter()
    items = vectors(rng, args.items, centres, args.dim, args.noise)  # (N, d)
    item_ids = rng.permutation(np.int64(4) * args.items)[:args.items]  # (N,) unordered, sparse ids
    n_users = max(args.latency_users, args.batch_users, args.recall_users)
    users = vectors(rng, n_users, centres, args.dim, args.noise)  # (U, d)
    data_s = time.perf_counter() - t
    config = AnnConfig(metric=args.metric, kind=args.kind, nlist=args.nlist, nprobe=args.nprobe, M=args.M,
                       ef_search=args.ef_search, threads=args.threads)

    t = time.perf_counter()
    exact = ItemIndex.build(items, item_ids, AnnConfig(metric=args.metric, kind="exact", threads=args.threads))
    exact_build_s = time.perf_counter() - t
    seen = seen_items(rng, exact, users, args.k, args.seen)

    t = time.perf_counter()
    index = ItemIndex.build(items, item_ids, config)
    build_s = time.perf_counter() - t
    del items
    calibration = {}
    if args.calibrate:  # on other users than the measured ones, from the same distribution
        held_out = vectors(rng, args.calibrate_users, centres, args.dim, args.noise)  # (C, d)
        t = time.perf_counter()
        reached = index.calibrate(held_out, args.k, target_recall=args.calibrate)
        calibration = {"calibrate_target": args.calibrate, "calibrate_users": args.calibrate_users,
                       "calibrate_recall": round(reached, 4), "calibrate_s": round(time.perf_counter() - t, 2),
                       "scan_factor": index.config.scan_factor, "ef_search": index.config.ef_search}

    record: dict[str, Any] = {
        "bench": "ann", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(), "cores": os.cpu_count(), "threads": args.threads,
        "items": args.items, "dim": args.dim, "k": args.k, "metric": args.metric, "seen": args.seen,
        "data": f"{args.clusters} clusters, noise {args.noise}" if args.clusters else "isotropic Gaussian",
        "kind": index.kind, "nlist": getattr(index._index, "nlist", None), "nprobe": args.nprobe, "M": args.M,
        "data_s": round(data_s, 2), "build_s": round(build_s, 2), "exact_build_s": round(exact_build_s, 2),
        "batch": args.batch, "latency_users": args.latency_users, "batch_users": args.batch_users,
        "recall_users": args.recall_users, "scan_factor": index.config.scan_factor, **calibration,
    }
    if index.kind == "ivf" and args.nprobe is None:  # the automatic nprobe for a single user's fetch
        fetch = min(args.items, args.k + args.seen)
        record["nprobe"] = min(index._index.nlist, int(np.ceil(index.config.scan_factor * fetch * index._index.nlist / args.items)))
    record["ann"] = timing(index, users, seen, args.k, args.latency_users, args.batch, args.batch_users)
    record["ann"]["fallback_rows"] = index.fallback_rows
    if not args.skip_exact_timing:
        record["exact"] = timing(exact, users, seen, args.k, args.latency_users, args.batch, args.batch_users)

    r = args.recall_users
    t = time.perf_counter()
    truth = exact.search(users[:r], args.k, exclude=rows(seen, 0, r))[0]  # (R, k)
    record["exact_recall_search_s"] = round(time.perf_counter() - t, 2)
    found = index.search(users[:r], args.k, exclude=rows(seen, 0, r))[0]  # (R, k)
    record["recall"] = round(recall_at_k(found, truth), 4)
    record["seen_returned"] = int(sum(np.isin(found[u], rows(seen, u, u + 1).ids).sum() for u in range(r)))
    record["peak_rss_mib"] = round(peak_rss_mib(), 1)
    record["load_before"] = [round(x, 2) for x in load_before]
    record["load_after"] = [round(x, 2) for x in os.getloadavg()]
    ann = record["ann"]
    record["met"] = {"p99_ms": ann["p99_ms"] <= TARGETS["p99_ms"], "users_per_s": ann["users_per_s"] >= TARGETS["users_per_s"],
                     "recall": record["recall"] >= TARGETS["recall"]}
    return record


def append_jsonl(url: str, record: dict[str, Any]) -> None:
    """Append one line to `url`, atomically (the whole file is rewritten through write_atomic)."""
    old = rfs.read_bytes(url).decode() if rfs.exists(url) else ""
    rfs.write_atomic(url, old + json.dumps(record, sort_keys=True) + "\n", overwrite=True)


def markdown(records: list[dict[str, Any]]) -> str:
    head = ("| items x d | data | k | seen | kind | build s | p50 / p99 ms per user (CPU ms) | users/s batched "
            "(per CPU-s) | recall@k | exact: p50 / p99 ms (CPU ms), users/s (per CPU-s) | peak RSS MiB | "
            "load before / after |\n|" + "---|" * 12)
    lines = [head]
    for r in records:
        a, e = r["ann"], r.get("exact")
        kind = f"{r['kind']}" + (f" nlist {r['nlist']} nprobe {r['nprobe']}" if r["kind"] == "ivf" else "")
        if "calibrate_target" in r:
            kind += f", calibrated to {r['calibrate_target']} in {r['calibrate_s']} s"
        exact = (f"{e['p50_ms']} / {e['p99_ms']} ({e['cpu_p50_ms']} / {e['cpu_p99_ms']}), {e['users_per_s']:,.0f} "
                 f"({e['users_per_cpu_s']:,.0f})") if e else "-"
        lines.append(f"| {r['items']:,} x {r['dim']} | {r['data']} | {r['k']:,} | {r['seen']} | {kind} | {r['build_s']} | "
                     f"{a['p50_ms']} / {a['p99_ms']} ({a['cpu_p50_ms']} / {a['cpu_p99_ms']}) | {a['users_per_s']:,.0f} "
                     f"({a['users_per_cpu_s']:,.0f}) | {r['recall']} ({r['recall_users']} users) | "
                     f"{exact} | {r['peak_rss_mib']:,.0f} | {r['load_before'][0]} / {r['load_after'][0]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--k", type=int, default=10_000)
    p.add_argument("--metric", default="ip")
    p.add_argument("--kind", default="auto")
    p.add_argument("--nlist", type=int, default=None)
    p.add_argument("--nprobe", type=int, default=None)
    p.add_argument("--M", type=int, default=32)
    p.add_argument("--ef-search", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--clusters", type=int, default=1000, help="0: isotropic Gaussian vectors")
    p.add_argument("--noise", type=float, default=0.5)
    p.add_argument("--seen", type=int, default=100, help="already-seen items per user, excluded")
    p.add_argument("--latency-users", type=int, default=500)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batch-users", type=int, default=512)
    p.add_argument("--recall-users", type=int, default=200)
    p.add_argument("--calibrate", type=float, default=None, metavar="RECALL",
                   help="ItemIndex.calibrate to this recall@k on --calibrate-users held-out users before measuring")
    p.add_argument("--calibrate-users", type=int, default=32)
    p.add_argument("--skip-exact-timing", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="20,000 items, k=1,000, 50 users per measure")
    p.add_argument("--out", default=None, help="JSON lines to append to (default benchmarks/results/ann_bench_<date>.jsonl)")
    p.add_argument("--markdown", default=None, metavar="JSONL", help="print the RESULTS.md table of these records and exit")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown([json.loads(x) for x in rfs.read_bytes(args.markdown).decode().splitlines() if x.strip()]))
        return 0
    if args.quick:
        args.items, args.k, args.latency_users, args.batch_users, args.recall_users = 20_000, 1_000, 50, 128, 50
        args.clusters = min(args.clusters, 100)
    record = run(args)
    out = args.out or str(Path(__file__).parent / "results" / f"ann_bench_{datetime.date.today().isoformat()}.jsonl")
    append_jsonl(out, record)
    print(json.dumps(record, indent=1))
    print(markdown([record]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
