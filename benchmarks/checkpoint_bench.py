"""PS table checkpoints: write and read seconds and MB/s on file://, hdfs:// and webhdfs://.

    python -m benchmarks.checkpoint_bench --rows 1000000 10000000 --fs file hdfs --repeat 2 --jsonl out.jsonl
    python -m benchmarks.checkpoint_bench --rows 200000 --fs file hdfs webhdfs --repeat 1   # a small check
    python -m benchmarks.checkpoint_bench --markdown out.jsonl                            # the table again

Straight on recps.ps.node, with benchmarks.scale_bench's building blocks (its server and worker
processes, PSServer / PSClient over TCP loopback). For each N of --rows: --servers (2) server
processes get one sparse table of N keys (dim 8, rowwise_adagrad, capacity N), created by
--workers (2) worker processes pulling new keys (scale_bench's build; its timed pull / push
phases are skipped). Then --repeat times, for each file system of --fs in turn (file, hdfs,
file, hdfs, ...):

1. save: `PSClient.save(url, mode="full", tables=[table])` on the servers holding the table ->
   seconds; bytes = the size of the checkpoint folder (every shard's arrays and manifest, and the
   table spec; fs.du); MB/s = bytes / 1e6 / seconds. file:// shards are fsynced by the writer
   (recps.ps.table.checkpoint.ShardWriter); HDFS's DataNode acknowledges blocks it has not synced.
2. the checkpoint's bytes are dropped from the page cache (fdatasync, then posix_fadvise
   DONTNEED, on the checkpoint files for file://, on the DataNode's block files for hdfs:// and
   webhdfs://; not timed), so the load reads them from the disk (each server reads every shard,
   so the second reader of a file may find it cached by the first).
3. the servers holding the table are stopped and a fresh set started (no table: only one set's
   memory is resident at a time); load: `PSClient.load(url, tables=[table])` -> seconds, MB/s =
   checkpoint bytes / 1e6 / seconds. The table is created from the saved spec; its rows after
   the load (`client.stats()`) must equal N, else the benchmark fails. Recorded with it: each
   loading server's peak RSS (VmHWM: the load's peak, the processes being fresh) and the bytes
   the servers passed through read(2)-like calls during the load (rchar of /proc/PID/io; counts
   file reads, not necessarily socket reads).
4. the checkpoint is deleted (on HDFS too); the fresh servers hold the table for the next save.

file:// checkpoints go under --dir (default: the temp dir). hdfs:// (hdfs-native, RPC) and
webhdfs:// (HTTP) use one real HDFS (Hadoop 2.7.3, tests/hdfs/start_hdfs.sh) started in a
folder under --dir and stopped (tests/hdfs/stop_hdfs.sh) and deleted at the end. A size runs
only when MemAvailable >= --min-available-gib x N / 1e8; otherwise a "skipped" line says why.
Prints one JSON line per build and per save + load (also appended to --jsonl), then a markdown
summary: per size and file system "run1 / run2 (median)".
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.procmon import peak_rss_mib
from benchmarks.scale_bench import TABLE, _TOKEN, _serve, _work

__all__ = ["run", "main", "markdown"]

FILE_SYSTEMS = ("file", "hdfs", "webhdfs")
_HDFS_SCRIPTS = Path(__file__).resolve().parent.parent / "tests" / "hdfs"
_HDFS_START_TIMEOUT_S = 570  # the script waits 120 s for the cluster, 480 s for a first jar download
_HDFS_STOP_TIMEOUT_S = 60
_JOIN_TIMEOUT_S = 30


class _Servers:
    """`num` server processes (scale_bench._serve) on loopback and a PSClient to them."""

    def __init__(self, ctx, num: int, timeout_s: float) -> None:
        from recps.ps.node import PSClient

        self.ready, self.stop_event = ctx.Queue(), ctx.Event()
        self.procs = [ctx.Process(target=_serve, args=(i, num, self.ready, self.stop_event), daemon=True)
                      for i in range(num)]
        self.client = None
        for p in self.procs:
            p.start()
        try:
            self.endpoints = [e for _, e in sorted(self.ready.get(timeout=timeout_s) for _ in self.procs)]
            self.client = PSClient(self.endpoints, token=_TOKEN, timeout_s=timeout_s)
        except BaseException:
            self.close()
            raise

    def rows(self, timeout_s: float) -> int:
        return int(self.client.stats(timeout=timeout_s)["tables"].get(TABLE, {}).get("rows", 0))

    def rchar(self) -> int:
        total = 0
        for p in self.procs:
            with open(f"/proc/{p.pid}/io") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
        return total

    def peak_rss_gib(self) -> list[float]:
        return [round((peak_rss_mib(p.pid) or (float("nan"), 0.0))[0] / 1024, 3) for p in self.procs]

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        self.stop_event.set()
        for p in self.procs:
            p.join(timeout=_JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join(timeout=_JOIN_TIMEOUT_S)


def _build(ctx, servers: _Servers, rows: int, workers: int, build_batch: int, timeout_s: float) -> float:
    """scale_bench's build: `workers` processes pull their share of keys 0..rows-1 -> seconds."""
    servers.client.create_sparse_table(TABLE, dim=8, optimizer={"name": "rowwise_adagrad", "lr": 0.05},
                                       capacity=rows, mode="async", timeout=timeout_s)
    cfg = {"keys": rows, "dim": 8, "batch": 1, "build_batch": build_batch, "seconds": 0.0, "timeout_s": timeout_s}
    barrier, results = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=_work, args=(w, workers, servers.endpoints, cfg, barrier, results), daemon=True)
             for w in range(workers)]
    for p in procs:
        p.start()
    try:
        per = [results.get(timeout=timeout_s) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=_JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
    return max(r["build_end"] for r in per) - min(r["build_start"] for r in per)


def _evict(root: str) -> None:
    """Drop every file under `root` from the page cache (synced first: dirty pages would stay)."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class _Hdfs:
    """One HDFS started by tests/hdfs/start_hdfs.sh in `work_dir`, stopped by its stop script."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        env = dict(os.environ, PYTHON=sys.executable, RECPS_HDFS_WATCH_PID=str(os.getpid()))
        try:
            proc = subprocess.run(["bash", str(_HDFS_SCRIPTS / "start_hdfs.sh"), str(work_dir)], env=env,
                                  capture_output=True, text=True, timeout=_HDFS_START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        if proc.returncode != 0:
            self.stop()
            raise RuntimeError(f"start_hdfs.sh {work_dir} failed (exit {proc.returncode}):\n{proc.stderr}")
        self.info = json.loads((work_dir / "cluster.json").read_text())

    def url(self, fs_name: str) -> str:
        return self.info["url"] if fs_name == "hdfs" else self.info["webhdfs_url"]

    def evict(self) -> None:
        _evict(str(self.work_dir / "data" / "data"))  # the DataNode's block files

    def stop(self) -> None:
        proc = subprocess.run(["bash", str(_HDFS_SCRIPTS / "stop_hdfs.sh"), str(self.work_dir)],
                              capture_output=True, text=True, timeout=_HDFS_STOP_TIMEOUT_S, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"stop_hdfs.sh {self.work_dir} failed: {proc.stderr}")


def _available_gib() -> float:
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return kib / 2**20


def run(rows: int, fs_names: list[str], repeat: int = 2, servers: int = 2, workers: int = 2,
        build_batch: int = 1_000_000, local_dir: str | None = None, hdfs: _Hdfs | None = None,
        timeout_s: float = 1800.0, emit=lambda record: print(json.dumps(record))) -> list[dict[str, Any]]:
    """Build one table of `rows` keys, then save + load it `repeat` x per file system (see the
    module docstring); `emit` gets each record as it is measured. Returns the records."""
    from recps import fs as rfs

    ctx = mp.get_context("spawn")
    records: list[dict[str, Any]] = []
    local = tempfile.mkdtemp(prefix="recps-checkpoint-bench-", dir=local_dir)
    holder = _Servers(ctx, servers, timeout_s)
    try:
        build_s = _build(ctx, holder, rows, workers, build_batch, timeout_s)
        built = holder.rows(timeout_s)
        if built != rows:
            raise RuntimeError(f"the build made {built} rows, not {rows}")
        records.append({"rows": rows, "servers": servers, "build_s": round(build_s, 2)})
        emit(records[-1])
        for run_index in range(1, repeat + 1):
            for fs_name in fs_names:
                name = f"ckpt-{rows}-{fs_name}-{run_index}"
                url = Path(local, name).as_uri() if fs_name == "file" else f"{hdfs.url(fs_name)}/recps-checkpoint-bench/{name}"
                fs, root = rfs.resolve(url)
                try:
                    start = time.perf_counter()
                    holder.client.save(url, mode="full", tables=[TABLE], timeout=timeout_s)
                    save_s = time.perf_counter() - start
                    size = int(fs.du(root, total=True))
                    if fs_name == "file":
                        _evict(root)
                    else:
                        hdfs.evict()
                    holder.close()
                    holder = _Servers(ctx, servers, timeout_s)
                    rchar = holder.rchar()
                    start = time.perf_counter()
                    holder.client.load(url, tables=[TABLE], timeout=timeout_s)
                    load_s = time.perf_counter() - start
                    read = holder.rchar() - rchar
                    loaded = holder.rows(timeout_s)
                    if loaded != rows:
                        raise RuntimeError(f"{url}: {loaded} rows loaded, not {rows}")
                finally:
                    if fs.exists(root):
                        fs.rm(root, recursive=True)
                records.append({
                    "rows": rows, "fs": fs_name, "run": run_index, "servers": servers,
                    "save_s": round(save_s, 3), "bytes": size, "save_mb_per_s": round(size / 1e6 / save_s, 1),
                    "load_s": round(load_s, 3), "load_mb_per_s": round(size / 1e6 / load_s, 1),
                    "loaded_rows": loaded, "load_peak_rss_gib": holder.peak_rss_gib(),
                    "load_rchar_mb": round(read / 1e6, 1), "load_1min": round(os.getloadavg()[0], 2),
                })
                emit(records[-1])
    finally:
        holder.close()
        shutil.rmtree(local, ignore_errors=True)
    return records


def _runs(values: list[float], fmt: str) -> str:
    cells = " / ".join(format(v, fmt) for v in values)
    return f"{cells} ({format(statistics.median(values), fmt)})" if len(values) > 1 else cells


def markdown(records: list[dict[str, Any]]) -> str:
    """Per size and file system: the save and load figures of every run, "run1 / run2 (median)"."""
    lines = ["| rows | file system | checkpoint, MB | save, s | save, MB/s | load, s | load, MB/s | "
             "load peak RSS per server, GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "skipped" in r:
            lines.append(f"| {r['rows']:,} | {r.get('fs', 'all')} | not measured: {r['skipped']} |  |  |  |  |  |")
    groups: dict[tuple[int, str], list[dict]] = {}
    for r in records:
        if "save_s" in r:
            groups.setdefault((r["rows"], r["fs"]), []).append(r)
    for (rows, fs_name), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], FILE_SYSTEMS.index(kv[0][1]))):
        peak = [max(r["load_peak_rss_gib"]) for r in rs]
        lines.append(
            f"| {rows:,} | {fs_name}:// | {_runs([r['bytes'] / 1e6 for r in rs], ',.0f')} "
            f"| {_runs([r['save_s'] for r in rs], '.2f')} | {_runs([r['save_mb_per_s'] for r in rs], ',.0f')} "
            f"| {_runs([r['load_s'] for r in rs], '.2f')} | {_runs([r['load_mb_per_s'] for r in rs], ',.0f')} "
            f"| {_runs(peak, '.2f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000, 100_000_000])
    parser.add_argument("--fs", nargs="+", choices=FILE_SYSTEMS, default=["file", "hdfs"],
                        help="file systems, measured in this order within each repeat")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="processes building the table")
    parser.add_argument("--build-batch", type=int, default=1_000_000, help="new keys per pull while building")
    parser.add_argument("--dir", default=None, help="where file:// checkpoints and the HDFS go (default: the temp dir)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed for each build, save and load")
    parser.add_argument("--min-available-gib", type=float, default=14.0,
                        help="MemAvailable needed per 100M rows (scaled to each size) to run it")
    parser.add_argument("--jsonl", default=None, help="also append every record to this file")
    parser.add_argument("--markdown", nargs="+", default=None, metavar="JSONL",
                        help="only print the summary table of these record files")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill PID` still stops the servers and HDFS
    if args.markdown:
        print(markdown([json.loads(line) for p in args.markdown for line in Path(p).read_text().splitlines() if line]))
        return 0
    records: list[dict[str, Any]] = []

    def emit(record: dict[str, Any]) -> None:
        records.append(record)
        print(json.dumps(record), flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(record) + "\n")

    hdfs = None
    hdfs_dir = None
    try:
        if set(args.fs) & {"hdfs", "webhdfs"}:
            hdfs_dir = Path(tempfile.mkdtemp(prefix="recps-checkpoint-bench-hdfs-", dir=args.dir))
            hdfs = _Hdfs(hdfs_dir)
        for rows in args.rows:
            need, have = args.min_available_gib * rows / 1e8, _available_gib()
            if have < need:
                emit({"rows": rows, "skipped": f"MemAvailable {have:.1f} GiB < {need:.1f} GiB"})
                continue
            run(rows, args.fs, args.repeat, args.servers, args.workers, args.build_batch, args.dir, hdfs,
                args.timeout, emit)
    finally:
        try:
            if hdfs is not None:
                hdfs.stop()
        finally:
            if hdfs_dir is not None:
                shutil.rmtree(hdfs_dir, ignore_errors=True)
    print(markdown(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
