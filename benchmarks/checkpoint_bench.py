"""PS table checkpoints: write and read seconds and MB/s on file://, hdfs:// and webhdfs://.

    python -m benchmarks.checkpoint_bench --rows 1000000 10000000 --fs file hdfs --repeat 2 --jsonl out.jsonl
    python -m benchmarks.checkpoint_bench --rows 200000 --fs file hdfs webhdfs --repeat 1   # a small check
    python -m benchmarks.checkpoint_bench --markdown out.jsonl                            # the table again
    python -m benchmarks.checkpoint_bench --rows 1000000 10000000 --fs file hdfs --modes full delta base --accessor --repeat 2

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

`--modes` (default: full) are the save modes measured, in this order, for each file system of
each repeat. Only full is loaded; a delta, base or batch save is timed, sized (rows written, as
`PSClient.save` returns them; bytes; MB/s) and deleted. Before each delta save the benchmark
"trains an hour": it pushes zero gradients (rowwise_adagrad leaves values and state as they
are) to --touched x N distinct keys drawn uniformly, so that the delta is an hourly one. When
delta is measured, an untimed base save (deleted) right after the build starts the delta chain.

`--accessor` creates the table with Paddle's CTR accessor values (CtrAccessorParameter:
nonclk_coeff 0.1, click_coeff 1, base_threshold 1.5, delta_threshold 0.25, delta_keep_days 16)
and gives every row statistics after the build: one push of all N keys with shows drawn from a
power law, P(show >= x) = x^-0.7 (at most 1e5), and clicks ~ Binomial(show, 0.05): ~20% of the
rows reach score >= 1.5. An hour's push carries such shows and clicks for its keys: ~30% of them
enter the delta (score >= 1.5 and the hour's score >= 0.25), ~1.5% of N at --touched 0.05. The
benchmark mirrors the statistics it pushed (4 float32 per row in its own process) and fails
unless every save wrote exactly the rows `CtrAccessor.save_selects` picks from them (without an
accessor: N, and --touched x N for a delta).

file:// checkpoints go under --dir (default: the temp dir). hdfs:// (hdfs-native, RPC) and
webhdfs:// (HTTP) use one real HDFS (Hadoop 2.7.3, tests/hdfs/start_hdfs.sh) started in a
folder under --dir and stopped (tests/hdfs/stop_hdfs.sh) and deleted at the end. A size runs
only when MemAvailable >= --min-available-gib x N / 1e8; otherwise a "skipped" line says why.
Prints one JSON line per build and per save + load (also appended to --jsonl), then a markdown
summary: per size and file system (and mode, once --modes or --accessor is given) "run1 / run2 (median)".
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

import torch

from benchmarks.procmon import peak_rss_mib
from benchmarks.scale_bench import TABLE, _TOKEN, _serve, _work
from recps.ps.table import SAVE_MODES
from recps.ps.table.accessor import CtrAccessor

__all__ = ["run", "main", "markdown"]

FILE_SYSTEMS = ("file", "hdfs", "webhdfs")
_HDFS_SCRIPTS = Path(__file__).resolve().parent.parent / "tests" / "hdfs"
_HDFS_START_TIMEOUT_S = 570  # the script waits 120 s for the cluster, 480 s for a first jar download
_HDFS_STOP_TIMEOUT_S = 60
_JOIN_TIMEOUT_S = 30
# Paddle's CtrAccessorParameter values (the fields Paddle's examples set; the rest CtrAccessor's defaults).
PADDLE_ACCESSOR = {"nonclk_coeff": 0.1, "click_coeff": 1.0, "base_threshold": 1.5, "delta_threshold": 0.25,
                   "delta_keep_days": 16.0}
_SHOW_ALPHA = 0.7  # P(show >= x) = x^-alpha: ~20% of rows reach score 1.5 with _CTR
_MAX_SHOWS = 1e5
_CTR = 0.05
_SEED = 0


class _Servers:
    """`num` server processes (scale_bench._serve) on loopback and a PSClient to them."""

    def __init__(self, ctx, num: int, timeout_s: float) -> None:
        self.ctx, self.num, self.timeout_s = ctx, num, timeout_s
        self.client, self.procs = None, []
        self._start()

    def _start(self) -> None:
        from recps.ps.node import PSClient

        ctx, num, timeout_s = self.ctx, self.num, self.timeout_s
        self.ready, self.stop_event = ctx.Queue(), ctx.Event()
        self.procs = [ctx.Process(target=_serve, args=(i, num, self.ready, self.stop_event), daemon=True)
                      for i in range(num)]
        for p in self.procs:
            p.start()
        try:
            self.endpoints = [e for _, e in sorted(self.ready.get(timeout=timeout_s) for _ in self.procs)]
            self.client = PSClient(self.endpoints, token=_TOKEN, timeout_s=timeout_s)
        except BaseException:
            self.close()
            raise

    def restart(self) -> None:
        """Stop these servers, then start as many fresh ones (no table) in their place."""
        self.close()
        self._start()

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


def _build(ctx, servers: _Servers, rows: int, workers: int, build_batch: int, timeout_s: float,
           accessor: dict | None = None) -> float:
    """scale_bench's build: `workers` processes pull their share of keys 0..rows-1 -> seconds."""
    servers.client.create_sparse_table(TABLE, dim=8, optimizer={"name": "rowwise_adagrad", "lr": 0.05},
                                       accessor=accessor, capacity=rows, mode="async", timeout=timeout_s)
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


class _Statistics:
    """What the benchmark pushed, mirrored: (N,) float32 show, click, unseen_days and delta_score
    of keys 0..N-1 (with an accessor), or the (N,) dirty flags (without); `expected(mode)` is the
    rows a save of `mode` writes, `saved(mode)` applies its statistics updates (SparseTable.save)."""

    def __init__(self, rows: int, accessor: dict | None, delta: bool) -> None:
        self.rows, self.accessor = rows, CtrAccessor(**accessor) if accessor else None
        self.gen = torch.Generator().manual_seed(_SEED)
        self.dirty = None  # kept only where a delta is measured: full, base and batch write N rows
        if self.accessor is None and delta:
            self.dirty = torch.ones(rows, dtype=torch.bool)  # rows created by pulls are dirty
        elif self.accessor is not None:
            self.show, self.click, self.unseen, self.delta_score = (torch.zeros(rows) for _ in range(4))  # (N,) each

    def draw(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n,) shows from the power law, (n,) clicks ~ Binomial(show, _CTR)."""
        u = torch.rand(n, generator=self.gen).clamp_min_(1e-12)  # (n,)
        shows = u.pow_(-1.0 / _SHOW_ALPHA).floor_().clamp_max_(_MAX_SHOWS)  # (n,) >= 1
        return shows, torch.binomial(shows, torch.full_like(shows, _CTR), generator=self.gen)

    def push(self, client, keys: torch.Tensor, batch: int, timeout_s: float) -> None:
        """Push zero gradients to (K,) distinct keys in batches, with drawn shows and clicks (accessor)."""
        for first in range(0, keys.numel(), batch):
            part = keys[first : first + batch]  # (B,)
            zeros = torch.zeros(part.numel(), 8)  # (B, D)
            if self.accessor is None:
                client.push(TABLE, part, zeros, assume_unique=True).wait(timeout_s)
                if self.dirty is not None:
                    self.dirty[part] = True
                continue
            shows, clicks = self.draw(part.numel())  # (B,) (B,)
            client.push(TABLE, part, zeros, shows=shows, clicks=clicks, assume_unique=True).wait(timeout_s)
            self.show[part] += shows
            self.click[part] += clicks
            self.unseen[part] = 0.0
            self.delta_score[part] += self.accessor.score(shows, clicks)

    def _selects(self, mode: str) -> torch.Tensor:
        if self.accessor is None:
            return self.dirty.clone() if mode == "delta" else torch.ones(self.rows, dtype=torch.bool)
        return self.accessor.save_selects(mode, self.show, self.click, self.unseen, self.delta_score)  # (N,)

    def expected(self, mode: str) -> int:
        if self.accessor is None and mode != "delta":
            return self.rows
        return int(self._selects(mode).sum())

    def saved(self, mode: str) -> None:
        if mode in ("delta", "base") and self.accessor is not None:
            self.delta_score[self._selects(mode)] = 0.0
        elif mode in ("delta", "base") and self.dirty is not None:
            self.dirty.zero_()  # every dirty row was written (base: every row)
        elif mode == "batch" and self.accessor is not None:
            self.unseen += 1.0


def _save(client, url: str, mode: str, stats: _Statistics, timeout_s: float) -> tuple[float, int]:
    """client.save of `mode` -> (seconds, rows written), checked against the mirrored statistics."""
    expected = stats.expected(mode)
    start = time.perf_counter()
    written = int(client.save(url, mode=mode, tables=[TABLE], timeout=timeout_s)[TABLE])
    save_s = time.perf_counter() - start
    if written != expected:
        raise RuntimeError(f"{url}: the {mode} save wrote {written} rows; the statistics pushed select {expected}")
    stats.saved(mode)
    return save_s, written


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
        timeout_s: float = 1800.0, emit=lambda record: print(json.dumps(record)), *,
        modes: tuple[str, ...] = ("full",), accessor: bool = False, touched: float = 0.05) -> list[dict[str, Any]]:
    """Build one table of `rows` keys, then save (+ load, for full) it in each of `modes`, `repeat` x
    per file system (see the module docstring); `emit` gets each record as it is measured. Returns
    the records."""
    for mode in modes:
        if mode not in SAVE_MODES:
            raise ValueError(f"checkpoint_bench: mode {mode!r}; use some of {SAVE_MODES}")
    if "delta" in modes and not 0.0 < touched <= 1.0:
        raise ValueError(f"checkpoint_bench: touched={touched}; the hour's share of the keys must be in (0, 1]")
    extended = accessor or tuple(modes) != ("full",)  # else the records and names are the original ones
    ctx = mp.get_context("spawn")
    records: list[dict[str, Any]] = []
    local = tempfile.mkdtemp(prefix="recps-checkpoint-bench-", dir=local_dir)
    holder = _Servers(ctx, servers, timeout_s)
    try:
        build_s = _build(ctx, holder, rows, workers, build_batch, timeout_s, PADDLE_ACCESSOR if accessor else None)
        built = holder.rows(timeout_s)
        if built != rows:
            raise RuntimeError(f"the build made {built} rows, not {rows}")
        records.append({"rows": rows, "servers": servers, "build_s": round(build_s, 2)})
        stats = _Statistics(rows, PADDLE_ACCESSOR if accessor else None, "delta" in modes)
        if accessor:
            start = time.perf_counter()
            stats.push(holder.client, torch.arange(rows, dtype=torch.int64), build_batch, timeout_s)
            records[-1].update(accessor=PADDLE_ACCESSOR, statistics_s=round(time.perf_counter() - start, 2),
                               base_rows=stats.expected("base"))
        if "delta" in modes:  # the day's base, which the hourly deltas follow (untimed)
            _, records[-1]["chain_base_rows"] = _save(holder.client, Path(local, "chain-base").as_uri(), "base",
                                                      stats, timeout_s)
            shutil.rmtree(Path(local, "chain-base"))
        emit(records[-1])
        hour = max(1, round(touched * rows))
        for run_index in range(1, repeat + 1):
            for fs_name in fs_names:
                for mode in modes:
                    name = f"ckpt-{rows}-{fs_name}-{run_index}" + (f"-{mode}" if extended else "")
                    url = Path(local, name).as_uri() if fs_name == "file" else f"{hdfs.url(fs_name)}/recps-checkpoint-bench/{name}"
                    record = _measure(holder, url, mode, stats, hour, build_batch, hdfs, timeout_s)
                    head = {"rows": rows, "fs": fs_name, "run": run_index, "servers": servers}
                    if extended:
                        head.update(mode=mode, rows_written=record.pop("rows_written"))
                    else:
                        del record["rows_written"]
                    records.append({**head, **record, "load_1min": round(os.getloadavg()[0], 2)})
                    emit(records[-1])
    finally:
        holder.close()
        shutil.rmtree(local, ignore_errors=True)
    return records


def _measure(holder: _Servers, url: str, mode: str, stats: _Statistics, hour: int, batch: int,
             hdfs: _Hdfs | None, timeout_s: float) -> dict[str, Any]:
    """One save of `mode` to `url` (an hour of pushes first for a delta; after a full one, a load
    into fresh servers, `holder` restarted), then the checkpoint deleted -> the figures."""
    from recps import fs as rfs

    fs, root = rfs.resolve(url)
    record: dict[str, Any] = {}
    try:
        if mode == "delta":
            keys = torch.randperm(stats.rows, generator=stats.gen)[:hour]  # (T,) distinct
            start = time.perf_counter()
            stats.push(holder.client, keys, batch, timeout_s)
            record.update(touched=hour, train_s=round(time.perf_counter() - start, 2))
            del keys
        save_s, written = _save(holder.client, url, mode, stats, timeout_s)
        size = int(fs.du(root, total=True))
        record.update(rows_written=written, save_s=round(save_s, 3), bytes=size,
                      save_mb_per_s=round(size / 1e6 / save_s, 1))
        if mode == "full":
            if url.startswith("file:"):
                _evict(root)
            else:
                hdfs.evict()
            holder.restart()
            rchar = holder.rchar()
            start = time.perf_counter()
            holder.client.load(url, tables=[TABLE], timeout=timeout_s)
            load_s = time.perf_counter() - start
            read = holder.rchar() - rchar
            loaded = holder.rows(timeout_s)
            if loaded != stats.rows:
                raise RuntimeError(f"{url}: {loaded} rows loaded, not {stats.rows}")
            record.update(load_s=round(load_s, 3), load_mb_per_s=round(size / 1e6 / load_s, 1), loaded_rows=loaded,
                          load_peak_rss_gib=holder.peak_rss_gib(), load_rchar_mb=round(read / 1e6, 1))
    finally:
        if fs.exists(root):
            fs.rm(root, recursive=True)
    return record


def _runs(values: list[float], fmt: str) -> str:
    cells = " / ".join(format(v, fmt) for v in values)
    return f"{cells} ({format(statistics.median(values), fmt)})" if len(values) > 1 else cells


def _modes_markdown(records: list[dict[str, Any]]) -> str:
    """Per size, file system and mode: rows written, size, save (and for full, load) figures; "—":
    not loaded (delta, base and batch saves are not)."""
    lines = ["| rows | file system | mode | rows written | checkpoint, MB | save, s | save, MB/s | load, s | load, MB/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "skipped" in r:
            lines.append(f"| {r['rows']:,} | {r.get('fs', 'all')} | all | not measured: {r['skipped']} |  |  |  |  |  |")
    groups: dict[tuple[int, str, str], list[dict]] = {}
    for r in records:
        if "save_s" in r:
            groups.setdefault((r["rows"], r["fs"], r["mode"]), []).append(r)
    order = {fs_name: i for i, fs_name in enumerate(FILE_SYSTEMS)}
    for (rows, fs_name, mode), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], order[kv[0][1]],
                                                                            SAVE_MODES.index(kv[0][2]))):
        loads = (f"{_runs([r['load_s'] for r in rs], '.2f')} | {_runs([r['load_mb_per_s'] for r in rs], ',.0f')}"
                 if mode == "full" else "— | —")
        lines.append(
            f"| {rows:,} | {fs_name}:// | {mode} | {_runs([r['rows_written'] for r in rs], ',.0f')} "
            f"| {_runs([r['bytes'] / 1e6 for r in rs], ',.1f')} | {_runs([r['save_s'] for r in rs], '.3f')} "
            f"| {_runs([r['save_mb_per_s'] for r in rs], ',.0f')} | {loads} |")
    return "\n".join(lines)


def markdown(records: list[dict[str, Any]]) -> str:
    """Per size and file system: the save and load figures of every run, "run1 / run2 (median)";
    per size, file system and mode when the records have modes (--modes / --accessor)."""
    if any("mode" in r for r in records):
        return _modes_markdown(records)
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
    parser.add_argument("--modes", nargs="+", choices=SAVE_MODES, default=["full"],
                        help="save modes, measured in this order for each file system (only full is loaded)")
    parser.add_argument("--accessor", action="store_true",
                        help="Paddle's CTR accessor on the table, and shows/clicks pushed to every row after the build")
    parser.add_argument("--touched", type=float, default=0.05,
                        help="share of the N keys pushed in the hour before each delta save")
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
                args.timeout, emit, modes=tuple(args.modes), accessor=args.accessor, touched=args.touched)
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
