"""The pause a mid-run PS checkpoint imposes on training, on file:// and on the real HDFS.

    python -m benchmarks.pause_bench --rows 10000000 --fs file hdfs --repeat 2 --jsonl out.jsonl
    python -m benchmarks.pause_bench --rows 300000 --fs file hdfs --repeat 1    # a small check

A real training run each time: `python -m recps.train ps=async model=deepfm` with --servers (2)
server processes and one worker of 2 threads (recps.launch), on synthetic Criteo-schema data
whose 26 slots draw uniformly (zipf_a=0) from V keys each, V and the number of training rows
chosen so that one epoch creates about --rows rows in the PS table (the data set is generated
once, under --dir, and shared by every run). `ps.checkpoint_every_steps` is set so that the one
mid-run checkpoint falls at about 95% of the epoch, where the table holds nearly --rows rows;
`checkpoint.dir` is a fresh folder on the file system measured. From the run's metrics.json
("checkpoints", worker 0's own measure): pause_s, the seconds training stood still (drain of
the communicators, progress records, two barriers, the servers' save and the commit), and
save_s, the save and commit alone; overhead_s = pause_s - save_s. The rows saved are read back
from the committed checkpoint (the shards' manifests), and the checkpoint's bytes (fs.du).
Runs alternate between the file systems (file, hdfs, file, hdfs, ...). HDFS is one real
Hadoop 2.7.3 (tests/hdfs/start_hdfs.sh), started and stopped by the benchmark.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.checkpoint_bench import _Hdfs

__all__ = ["run_one", "main", "markdown"]

SLOTS = 26  # Criteo's categorical slots: each is one row space in the PS table
BATCH = 512
_RUN_TIMEOUT_S = 1800


def plan(rows: int) -> tuple[int, int]:
    """(keys per slot V, training rows N) so that N rows create about `rows` PS rows: with V = N,
    each slot holds V (1 - 1/e) distinct keys after one epoch."""
    vocab = math.ceil(rows / SLOTS / (1 - math.exp(-1)))
    return vocab, vocab


def _checkpoint_rows(url: str) -> tuple[int, int]:
    """(rows of the sparse tables, bytes) of the committed PS checkpoint at `url`."""
    from recps import fs as rfs

    manifest = json.loads(rfs.read_bytes(rfs.join(url, "manifest.json")))
    fs, root = rfs.resolve(url)
    rows = 0
    for rel in manifest["files"]:
        if rel.endswith("/manifest.json"):
            shard = json.loads(fs.cat_file(f"{root.rstrip('/')}/{rel}"))
            if shard.get("kind") == "sparse":
                rows += int(shard["rows"])
    return rows, int(fs.du(root))


def run_one(rows: int, url: str, run_dir: Path, data_dir: Path, servers: int, emit) -> dict[str, Any]:
    vocab, train_rows = plan(rows)
    steps = train_rows // BATCH
    every = int(steps * 0.95)
    cmd = [sys.executable, "-m", "recps.train", "ps=async", "model=deepfm", f"cluster.servers={servers}",
           "cluster.workers=1", "trainer.threads=2", "trainer.epochs=1", f"trainer.batch_size={BATCH}",
           f"dataset.dir={data_dir}", f"dataset.generate.train_rows={train_rows}",
           "dataset.generate.test_rows=20000", f"dataset.generate.vocab={vocab}", "+dataset.generate.zipf_a=0",
           f"ps.checkpoint_every_steps={every}", f"checkpoint.dir={url}", f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_RUN_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    if len(metrics.get("checkpoints", [])) != 1:
        raise RuntimeError(f"{run_dir}/metrics.json: expected one mid-run checkpoint, got {metrics.get('checkpoints')}")
    ckpt = metrics["checkpoints"][0]
    saved_rows, saved_bytes = _checkpoint_rows(ckpt["folder"])
    record = {"rows": rows, "fs": url.split("://")[0] if "://" in url else "file", "saved_rows": saved_rows,
              "checkpoint_mb": round(saved_bytes / 1e6, 1), "steps": ckpt["steps"], "pause_s": ckpt["pause_s"],
              "save_s": ckpt["save_s"], "overhead_s": round(ckpt["pause_s"] - ckpt["save_s"], 3),
              "train_seconds": round(metrics["train_seconds"], 2), "examples_per_sec": round(metrics["examples_per_sec"]),
              "run_seconds": round(time.perf_counter() - start, 1)}
    emit(record)
    return record


def _runs(values: list[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in values) + f" ({format(statistics.median(values), fmt)})"


def markdown(records: list[dict[str, Any]]) -> str:
    lines = ["| rows asked | file system | rows saved | checkpoint, MB | pause, s | save + commit, s | rest of the pause, s |",
             "|---|---|---|---|---|---|---|"]
    for (rows, fs_name) in dict.fromkeys((r["rows"], r["fs"]) for r in records if "pause_s" in r):
        rs = [r for r in records if r.get("rows") == rows and r.get("fs") == fs_name and "pause_s" in r]
        lines.append(f"| {rows:,} | {fs_name}:// | {_runs([r['saved_rows'] for r in rs], ',.0f')} "
                     f"| {_runs([r['checkpoint_mb'] for r in rs], ',.0f')} | {_runs([r['pause_s'] for r in rs], '.2f')} "
                     f"| {_runs([r['save_s'] for r in rs], '.2f')} | {_runs([r['overhead_s'] for r in rs], '.2f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000_000])
    parser.add_argument("--fs", nargs="+", choices=("file", "hdfs", "webhdfs"), default=["file", "hdfs"])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where the data, the runs, file:// checkpoints and the HDFS go")
    parser.add_argument("--jsonl", default=None, help="also append every record to this file")
    parser.add_argument("--markdown", nargs="+", default=None, metavar="JSONL", help="only print the summary table")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
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

    work = Path(tempfile.mkdtemp(prefix="recps-pause-bench-", dir=args.dir))
    hdfs = None
    try:
        if set(args.fs) & {"hdfs", "webhdfs"}:
            hdfs = _Hdfs(work / "hdfs")
        for rows in args.rows:
            data_dir = work / f"data-{rows}"
            for i in range(args.repeat):
                for fs_name in args.fs:
                    name = f"run-{rows}-{fs_name}-{i}"
                    url = str(work / "ckpt" / name) if fs_name == "file" else f"{hdfs.url(fs_name)}/pause-bench/{name}"
                    run_one(rows, url, work / name, data_dir, args.servers, emit)
                    if fs_name == "file":
                        shutil.rmtree(work / "ckpt" / name, ignore_errors=True)
                    else:
                        from recps import fs as rfs

                        fs, root = rfs.resolve(url)
                        fs.rm(root, recursive=True)
    finally:
        try:
            if hdfs is not None:
                hdfs.stop()
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(markdown(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
