"""Streaming incremental training against batch training of the same data, on file:// and hdfs://.

    python -m benchmarks.stream_bench --fs file hdfs --passes 24 --rows 20000 --repeat 2 --jsonl out.jsonl
    python -m benchmarks.stream_bench --fs file --passes 2 --rows 2000 --repeat 1        # a small check (CI)
    python -m benchmarks.stream_bench --markdown out.jsonl                                # the table again

For each file system of --fs a drifting synthetic stream (recps.data.generators.drifting) of one day
of --passes hourly splits of --rows rows is written once. Then --repeat times, alternating
(stream on file, batch on file, stream on hdfs, batch on hdfs, ...), one cluster of 1 server + 2
workers x 1 thread (async, DeepFM) runs:

- stream: `python -m recps.train stream=hourly` over the day (into a fresh stream.out): per pass
  wait, evaluate first, train, delta + checkpoint + records; at the day end shrink, base and batch
  model. From its metrics.json: examples/s while training (summed over the workers, as a batch
  job reports it), the whole day's examples per wall second of its passes, each pass's seconds,
  delta / checkpoint seconds and each delta's seconds over its pass's training seconds (the
  issue's target: <= 10%), the day end's saves, worker 0's
  RSS after each pass (first, last, max: flat when a worker holds one pass at a time);
- restart: the same command again: the launcher reads the records, finds every pass committed and
  recorded, and says so without starting a cluster: its wall seconds are what a rerun of a finished
  stream costs;
- batch: the same files as one data set (`dataset.train=[...]`, one epoch, no checkpoint):
  examples/s, for the ratio streaming / batch.

Prints one JSON line per run (also appended to --jsonl), then a markdown summary, per file
system "run1 / run2 (median)".
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["run_stream", "run_batch", "markdown", "main"]

DAY = "20261201"
COMMON = ["ps=async", "model=deepfm", "cluster.servers=1", "cluster.workers=2", "trainer.threads=1",
          "trainer.batch_size=512", "metrics.every_steps=0", "progress=false"]
TIMEOUT_S = 3600


def _train(overrides: list[str], run_dir: Path, finished: bool = False) -> tuple[dict, float]:
    """(metrics.json, wall seconds) of one `recps.train` run; `finished`: a stream with nothing left, which
    writes no metrics ({}) and must say so."""
    from recps.config import PROJECT_ROOT

    cmd = [sys.executable, "-m", "recps.train", *overrides, f"hydra.run.dir={run_dir}"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    if finished:
        if "[recps] nothing to do" not in proc.stdout:
            raise RuntimeError(f"{' '.join(cmd)}: a rerun of the finished stream did not say 'nothing to do':\n"
                               f"{proc.stdout[-3000:]}")
        return {}, wall
    return json.loads((run_dir / "metrics.json").read_text()), wall


def _stream_overrides(root: str, out: str, passes: int) -> list[str]:
    return ["stream=hourly", f"stream.root={root}", f"stream.out={out}", f"stream.start_day={DAY}",
            f"stream.end_day={DAY}", f"stream.hours={passes}", *COMMON]


def run_stream(root: str, out: str, passes: int, run_dir: Path) -> dict[str, Any]:
    """One streaming day, then its restart (see the module docstring)."""
    metrics, wall = _train(_stream_overrides(root, out, passes), run_dir / "stream")
    records = metrics["stream"]["passes"]
    day = [r for r in records if "pass" in r]
    end = next(r["day_end"] for r in day if "day_end" in r)
    # The target's measure: a delta's seconds against the training seconds of its pass.
    delta_share = [r["delta_s"] / r["train_s"] for r in day if "delta_s" in r and r["train_s"] > 0]
    rss = [r["rss_mib"] for r in day if r.get("rss_mib") is not None]
    _, restart_s = _train(_stream_overrides(root, out, passes), run_dir / "restart", finished=True)
    return {
        "kind": "stream", "passes": len(day), "examples": metrics["train_examples"],
        "examples_per_sec": round(metrics["examples_per_sec"], 1),
        "wall_examples_per_sec": round(metrics["train_examples"] / sum(r["pass_s"] for r in day), 1),
        "pass_s_median": round(statistics.median(r["pass_s"] for r in day), 3),
        "train_s_median": round(statistics.median(r["train_s"] for r in day), 3),
        "eval_s_median": round(statistics.median(r.get("eval_s", 0.0) for r in day), 3),
        "delta_s_median": round(statistics.median(r["delta_s"] for r in day if "delta_s" in r), 3),
        "delta_rows_median": statistics.median(r["delta_rows"] for r in day if "delta_rows" in r),
        "delta_share_max": round(max(delta_share), 3), "delta_share_median": round(statistics.median(delta_share), 3),
        "checkpoint_s_median": round(statistics.median(r["checkpoint_s"] for r in day if "checkpoint_s" in r), 3),
        "shrink_s": end.get("shrink_s"), "base_s": end.get("base_s"), "base_rows": end.get("base_rows"),
        "batch_model_s": end.get("batch_s"), "batch_model_rows": end.get("batch_rows"),
        "rss_first_mib": rss[0] if rss else None, "rss_last_mib": rss[-1] if rss else None,
        "rss_max_mib": max(rss) if rss else None, "wall_s": round(wall, 1), "restart_s": round(restart_s, 1),
    }


def run_batch(files: list[str], run_dir: Path) -> dict[str, Any]:
    """The same files as one data set, one epoch (see the module docstring)."""
    listed = "[" + ",".join(files) + "]"
    metrics, wall = _train([*COMMON, "dataset.generate=null", f"dataset.dir={run_dir}", f"dataset.train={listed}", f"dataset.test=[{files[-1]}]",
                            "trainer.epochs=1", "checkpoint.save=false"], run_dir)
    return {"kind": "batch", "examples": metrics["train_examples"],
            "examples_per_sec": round(metrics["examples_per_sec"], 1), "wall_s": round(wall, 1)}


def _runs(values: list, fmt: str = "{:.3g}") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    shown = " / ".join(fmt.format(v) for v in values)
    return shown + (f" ({fmt.format(statistics.median(values))})" if len(values) > 1 else "")


def markdown(records: list[dict[str, Any]]) -> str:
    """The summary table of a run's records (stream and batch lines)."""
    out = ["| fs | passes x rows | stream ex/s (training) | batch ex/s | stream / batch | stream ex/s (wall of the passes) "
           "| pass s | delta s (/ its pass's training s: median, max) | checkpoint s | base s | batch model s | worker RSS MiB first -> last (max) "
           "| restart s |", "|" + "---|" * 13]
    for fs_name in dict.fromkeys(r["fs"] for r in records):
        s = [r for r in records if r["fs"] == fs_name and r["kind"] == "stream"]
        b = [r for r in records if r["fs"] == fs_name and r["kind"] == "batch"]
        ratio = [x["examples_per_sec"] / y["examples_per_sec"] for x, y in zip(s, b)]
        rss = " / ".join(f"{x['rss_first_mib']:.0f} -> {x['rss_last_mib']:.0f} ({x['rss_max_mib']:.0f})" for x in s
                         if x["rss_first_mib"] is not None)
        out.append(
            f"| {fs_name} | {s[0]['passes']} x {s[0]['examples'] // max(1, s[0]['passes'])} | "
            f"{_runs([x['examples_per_sec'] for x in s], '{:,.0f}')} | {_runs([x['examples_per_sec'] for x in b], '{:,.0f}')} | "
            f"{_runs(ratio, '{:.2f}')} | {_runs([x['wall_examples_per_sec'] for x in s], '{:,.0f}')} | "
            f"{_runs([x['pass_s_median'] for x in s])} | {_runs([x['delta_s_median'] for x in s])} "
            f"({_runs([x['delta_share_median'] for x in s], '{:.1%}')}, {_runs([x['delta_share_max'] for x in s], '{:.1%}')}) | {_runs([x['checkpoint_s_median'] for x in s])} | "
            f"{_runs([x['base_s'] for x in s])} | {_runs([x['batch_model_s'] for x in s])} | {rss or '-'} | "
            f"{_runs([x['restart_s'] for x in s])} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stream_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--fs", nargs="+", choices=("file", "hdfs"), default=["file", "hdfs"])
    parser.add_argument("--passes", type=int, default=24, help="hourly passes of the day (1-24)")
    parser.add_argument("--rows", type=int, default=20000, help="rows per split")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where streams, models and runs go (default: a temp dir)")
    parser.add_argument("--jsonl", default=None, help="append each record as a JSON line")
    parser.add_argument("--markdown", metavar="JSONL", default=None, help="print the summary of a --jsonl file and exit")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown([json.loads(x) for x in Path(args.markdown).read_text().splitlines() if x.strip()]))
        return 0
    if not 1 <= args.passes <= 24:
        parser.error(f"--passes {args.passes}: a day holds 1 to 24 hourly passes")
    from benchmarks.checkpoint_bench import _Hdfs
    from recps.data.reader import expand_paths
    from recps.data.generators.drifting import write_stream

    work = Path(args.dir or tempfile.mkdtemp(prefix="recps-stream-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    hdfs = None
    try:
        roots = {}
        if "hdfs" in args.fs:
            hdfs = _Hdfs(work / "hdfs")
        for fs_name in args.fs:
            base = str(work / "file") if fs_name == "file" else f"{hdfs.url('hdfs')}/stream-bench"
            info = write_stream(f"{base}/clicks", days=1, hours=args.passes, rows=args.rows, start_day=DAY)
            roots[fs_name] = (base, info)
        for i in range(args.repeat):
            for fs_name in args.fs:
                base, info = roots[fs_name]
                run_dir = work / "runs" / f"{fs_name}-{i}"
                stream = run_stream(f"{base}/clicks", f"{base}/model-{i}", args.passes, run_dir)
                files = [f for folder in info.split_paths() for f in expand_paths([folder])]
                batch = run_batch(files, run_dir / "batch")
                for record in (stream, batch):
                    record.update(fs=fs_name, run=i + 1, rows_per_split=args.rows,
                                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
                    print(json.dumps(record), flush=True)
                    records.append(record)
                    if args.jsonl:
                        with open(args.jsonl, "a") as f:
                            f.write(json.dumps(record) + "\n")
    finally:
        if hdfs is not None:
            hdfs.stop()
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    print(markdown(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
