"""What freshness is worth on the drifting generated stream (issue 30, point 4; Monolith's experiment).

    python -m benchmarks.freshness_bench --jsonl benchmarks/results/freshness_bench_2026-12-07.jsonl
    python -m benchmarks.freshness_bench --quick          # 2 days x 2 passes: a check of the machinery
    python -m benchmarks.freshness_bench --markdown out.jsonl

A drifting stream (recps.data.generators.drifting) of --days x --hours passes of --rows rows is
trained once by `python -m recps.train stream=hourly` (1 server + 1 worker, async, DeepFM; a delta
every pass, a base at every day end; the accessor's default thresholds, so the exports hold what a
real stream's hold). Then, for every pass from day 2 on, three servers are replayed as they stood
right before that pass was trained, each a recps.serve Follower reading donefiles that hold what it
follows of the records published by then:

- every delta: the base and patch records published before the pass (what `python -m recps.serve`
  serves while the stream runs);
- daily bases: the base records alone (the previous day's base);
- frozen after day 1: the first base record alone (the model at the end of day 1).

Each scores the pass's rows with recps.serve's Scorer (the served model: exported rows, a key it
does not hold reads as a zero row) and its AUC on them is taken (recps.metrics' AUC). Beside them,
the AUC the stream's trainer measured on the same pass before training on it (the servers' full
tables, not an export): the upper bound of serving. AUC does not depend on timing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

__all__ = ["replay", "markdown", "main"]

DAY = "20261201"
TIMEOUT_S = 3600
SERVERS = ("every_delta", "daily_base", "frozen_day1")


def _day(offset: int) -> str:
    return datetime.fromordinal(datetime.strptime(DAY, "%Y%m%d").toordinal() + offset).strftime("%Y%m%d")


def _train(root: str, out: str, days: int, hours: int, run_dir: Path) -> list[dict]:
    from recps.config import PROJECT_ROOT

    cmd = [sys.executable, "-m", "recps.train", "stream=hourly", f"stream.root={root}", f"stream.out={out}",
           f"stream.start_day={DAY}", f"stream.end_day={_day(days - 1)}", f"stream.hours={hours}",
           "stream.data_sleep_second=0.2", "ps=async", "model=deepfm", "cluster.servers=1", "cluster.workers=1",
           "trainer.threads=1", "trainer.batch_size=512", "progress=false", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"the stream failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return [p for p in metrics["stream"]["passes"] if "pass" in p]


def _pass_of(record: dict) -> tuple[str, int]:
    """(day, pass) a base/patch record's export was saved after (its manifest's)."""
    from recps import fs as rfs
    from recps.stream.donefile import Donefiles

    manifest = json.loads(rfs.read_bytes(rfs.join(Donefiles.export_folder(record), "manifest.json")))
    state = manifest["progress"]["stream"]
    return str(state["day"]), int(state["pass"])


def replay(out: str, view: Path, bases: list[dict], patches: list[dict]):
    """The version a Follower of `out`'s exports serves once the records `bases` and `patches` are
    published: they are written as the donefiles of the folder `view` (their `input`s still name the
    folders under `out`), and a new Follower polls it once."""
    from recps import fs as rfs
    from recps.serve.versions import Follower
    from recps.stream.donefile import BASE_DONEFILE, PATCH_DONEFILE

    view.mkdir(parents=True, exist_ok=True)
    for name, records in ((BASE_DONEFILE, bases), (PATCH_DONEFILE, patches)):
        rfs.write_atomic(str(view / name), "".join(json.dumps(r) + "\n" for r in records), overwrite=True)
    follower = Follower(str(view))
    version = follower.poll()
    if follower.refusal is not None:
        raise RuntimeError(f"the replayed follower refused {follower.refusal.folder}: {follower.refusal.error}")
    return version


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import os

    import torch

    from recps import fs as rfs
    from recps.data.generators.drifting import write_stream
    from recps.data.reader import expand_paths, load_tensors
    from recps.metrics.collection import build_metric
    from recps.serve.model import Scorer
    from recps.stream.donefile import Donefiles
    from recps.stream.plan import StreamConfig, StreamPlan

    torch.set_num_threads(1)
    root, out = str(tmp / "clicks"), str(tmp / "model")
    load_before = os.getloadavg()
    write_stream(root, days=args.days, hours=args.hours, rows=args.rows, start_day=DAY)
    trained = {(p["day"], p["pass"]): p.get("eval", {}).get("auc") for p in
               _train(root, out, args.days, args.hours, tmp / "run")}
    done = Donefiles(out)
    bases = [(r, _pass_of(r)) for r in done.bases()]
    patches = [(r, _pass_of(r)) for r in done.patches()]
    plan = StreamPlan(StreamConfig(root=root, out=out, start_day=DAY, end_day=_day(args.days - 1), hours=args.hours))
    scorer = None
    rows = []
    for d in range(1, args.days):
        day = _day(d)
        for p in plan.passes_of_day(day):
            before = (day, p.index - 1) if p.index > 1 else (_day(d - 1), args.hours)  # the pass trained last
            published_b = [r for r, at in bases if at <= before]
            published_p = [r for r, at in patches if at <= before]
            versions = {"every_delta": replay(out, tmp / "view-delta", published_b, published_p),
                        "daily_base": replay(out, tmp / "view-base", published_b, []),
                        "frozen_day1": replay(out, tmp / "view-frozen", published_b[:1], [])}
            if scorer is None:
                scorer = Scorer(versions["frozen_day1"].config_yaml)
            examples = load_tensors(expand_paths(plan.split_folders(p)), scorer.schema, error_budget=0.0)
            row: dict[str, Any] = {"day": day, "pass": p.index, "rows": len(examples)}
            for name, version in versions.items():
                probs, unknown = scorer.score(version, examples)
                auc = build_metric("auc")
                auc.update(probs.reshape(-1), examples.labels.reshape(-1))
                row[name] = round(auc.compute(), 4)
                row[f"{name}_version"] = version.name
                row[f"{name}_unknown_keys"] = unknown
            row["trainer"] = None if trained.get((day, p.index)) is None else round(trained[(day, p.index)], 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
    mean = {name: round(statistics.fmean(r[name] for r in rows), 4) for name in (*SERVERS, "trainer")
            if all(r[name] is not None for r in rows)}
    return {"bench": "freshness_bench", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "days": args.days, "hours": args.hours, "rows": args.rows, "load_before": load_before,
            "load_after": os.getloadavg(), "passes": rows, "mean": mean,
            "gain_every_delta_over_daily": round(mean["every_delta"] - mean["daily_base"], 4),
            "gain_daily_over_frozen": round(mean["daily_base"] - mean["frozen_day1"], 4),
            "exports": {"bases": len(bases), "deltas": len(patches),
                        "delta_rows_median": statistics.median(
                            int(json.loads(rfs.read_bytes(rfs.join(Donefiles.export_folder(r), "manifest.json")))
                                ["progress"]["stream"]["rows"]) for r, _ in patches)}}


def markdown(record: dict[str, Any]) -> str:
    """The per-pass table of one run's record, the means and the gains."""
    lines = [f"freshness_bench {record['date']}: {record['days']} days x {record['hours']} passes of {record['rows']} rows, "
             f"DeepFM; {record['exports']['deltas']} deltas (median {record['exports']['delta_rows_median']} rows), "
             f"{record['exports']['bases']} bases", "",
             "| day/pass | every delta | daily bases | frozen after day 1 | the trainer (before training) |",
             "|---|---|---|---|---|"]
    for r in record["passes"]:
        lines.append(f"| {r['day']}/{r['pass']} | {r['every_delta']:.4f} | {r['daily_base']:.4f} | {r['frozen_day1']:.4f} | "
                     f"{'-' if r['trainer'] is None else format(r['trainer'], '.4f')} |")
    m = record["mean"]
    lines.append(f"| mean | {m['every_delta']:.4f} | {m['daily_base']:.4f} | {m['frozen_day1']:.4f} | "
                 f"{format(m['trainer'], '.4f') if 'trainer' in m else '-'} |")
    lines += ["", f"gain of following every delta over daily bases: {record['gain_every_delta_over_daily']:+.4f} AUC; "
              f"of daily bases over the model frozen after day 1: {record['gain_daily_over_frozen']:+.4f}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.freshness_bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 days x 2 passes of 2,000 rows: a check")
    p.add_argument("--days", type=int, default=4)
    p.add_argument("--hours", type=int, default=6)
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--jsonl", type=Path)
    p.add_argument("--keep", type=Path, help="keep the stream and its output here")
    p.add_argument("--markdown", type=Path, help="print the tables of this JSON-lines file's records and exit")
    args = p.parse_args(argv)
    if args.markdown:
        for line in args.markdown.read_text().splitlines():
            print(markdown(json.loads(line)) + "\n")
        return 0
    if args.quick:
        args.days, args.hours, args.rows = 2, 2, 2000
    if args.days < 2:
        p.error("--days must be at least 2: the frozen model is day 1's")
    tmp = Path(tempfile.mkdtemp(prefix="recps-freshness-")) if args.keep is None else args.keep
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        record = run(args, tmp)
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
    line = json.dumps(record, default=str)
    if args.jsonl:
        args.jsonl.parent.mkdir(parents=True, exist_ok=True)
        with open(args.jsonl, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
