"""Start-up time of a PS run: from `python -m recps.train ps=async cluster.workers=2` to its first step.

    python -m benchmarks.startup_bench --runs 3                               # this checkout
    python -m benchmarks.startup_bench --runs 3 --tree before=/tmp/recps-before   # and an older one, alternating
    python -m benchmarks.startup_bench --runs 3 --variant exec:RECPS_LAUNCH_FORK=0

Each run is the real command (plus `trainer.max_steps`, `checkpoint.save=false` and a fresh
hydra.run.dir under /tmp, which do not touch start-up), started here as a new process; the clock
starts right before it is started. Configurations alternate run by run (A B A B ...), so a load
that changes during the benchmark weighs on each the same way. The phases come from the run's own
log lines and their timestamps (the launcher's and every cluster process's; nothing is added to
the command):

    launcher      the launcher's "start-up" line: python, imports, Hydra's composition, config checks,
                  and when it starts the cluster ("starting 1 server(s) and 2 worker(s)")
    <role> up     "<role> up X s after its process started": a process's python, imports and config
    server        "server0 serving on ...": the server joined the coordinator
    data          worker 0's data set: from "synthetic data in" to "dataset ...: N train rows"
    joined        worker 0 joined the cluster ("worker0: async mode, ...")
    first step    worker 0's "first training step done": the figure of issue 17 (target <= 6 s)

Times are seconds from the start of the command, except `<role> up` (seconds from that process's
own start) and `data` (a duration). The 1-minute load average before each run is recorded (the
machine is shared). An older checkout (`--tree NAME=PATH`, e.g. `git archive <commit> | tar -x
-C PATH`) runs with PATH as its working directory and on PYTHONPATH, with this checkout's data
sets (datasets/generated is linked there when missing).

Writes one JSON line per run to --jsonl and prints a Markdown table (median per configuration,
and each configuration's ratio to the first one, run for run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["run_one", "phases", "main", "markdown"]

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["-m", "recps.train", "ps=async", "cluster.workers=2"]
_RUN_TIMEOUT_S = 300.0

# "[worker0] 2026-12-05 18:06:38,834 INFO recps...: message" (a cluster process, forwarded) or
# "[2026-12-05 18:06:24,841][recps.cluster][INFO] - message" (the launcher, Hydra's format).
_CHILD = re.compile(r"^\[(\w+)\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ [\w.]+: (.*)$")
_LAUNCHER = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[[\w.]+\]\[\w+\] - (.*)$")
_STARTUP = re.compile(r"start-up ([\d.]+) s: python ([\d.-]+) s, imports ([\d.]+) s, Hydra's composition ([\d.]+) s, "
                      r"config checks ([\d.]+) s")


def _stamp(text: str) -> float:
    return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def phases(lines: list[str], t0: float) -> dict[str, Any]:
    """The start-up phases a run's output shows (see the module docstring); t0: the command's start (epoch s)."""
    out: dict[str, Any] = {}
    for line in lines:
        if m := _LAUNCHER.match(line):
            at, text = _stamp(m.group(1)) - t0, m.group(2)
            if s := _STARTUP.search(text):
                out["launcher"] = dict(zip(("age", "python", "imports", "hydra", "checks"), map(float, s.groups())))
            elif "starting" in text and "server(s)" in text:
                out.setdefault("cluster_start", round(at, 3))
            continue
        m = _CHILD.match(line)
        if not m:
            continue
        name, at, text = m.group(1), _stamp(m.group(2)) - t0, m.group(3)
        if up := re.match(rf"{name} up ([\d.]+) s after its process started", text):
            out.setdefault("up", {})[name] = float(up.group(1))
            out.setdefault("up_at", {})[name] = round(at, 3)
        elif name == "server0" and re.match(r"server0 serving on ", text):
            out.setdefault("server", round(at, 3))
        elif name == "worker0" and text.startswith("synthetic data in "):
            out.setdefault("_data_from", at)
        elif name == "worker0" and re.match(r"dataset \S+: \d+ train rows", text):
            out.setdefault("data_done", round(at, 3))
            if "_data_from" in out:
                out["data"] = round(at - out["_data_from"], 3)
        elif name == "worker0" and text.startswith("worker0: ") and " mode, " in text:
            out.setdefault("joined", round(at, 3))
        elif name == "worker0" and text.startswith("first training step done"):
            out.setdefault("first_step", round(at, 3))
    out.pop("_data_from", None)
    return out


def run_one(tree: Path, env: dict[str, str], max_steps: int) -> dict[str, Any]:
    """One run of the command in `tree` with `env` added; its phases, exit code and wall time."""
    run_dir = tempfile.mkdtemp(prefix="startup-", dir="/tmp")
    command = [sys.executable, *COMMAND, f"trainer.max_steps={max_steps}", "checkpoint.save=false",
               f"hydra.run.dir={run_dir}"]
    environ = {**os.environ, **env, "PYTHONPATH": str(tree)}
    load = os.getloadavg()[0]
    t0 = time.time()
    proc = subprocess.run(command, cwd=tree, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=_RUN_TIMEOUT_S)
    wall = time.time() - t0
    lines = proc.stdout.splitlines()
    record = {"returncode": proc.returncode, "wall_s": round(wall, 3), "load_1m": round(load, 2), "run_dir": run_dir,
              **phases(lines, t0)}
    if proc.returncode != 0 or "first_step" not in record:
        record["tail"] = lines[-15:]
    return record


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def markdown(records: list[dict[str, Any]], names: list[str]) -> str:
    """Medians per configuration; the ratio of each configuration's first step to the first configuration's,
    taken pairwise (runs of the same round) and then the median."""
    cols = ["first_step", "cluster_start", "server", "data_done", "data", "joined"]
    head = ("| configuration | runs | load (1 min) | first step (s) | launcher: python / imports / Hydra / checks (s) "
            "| cluster start | children up (own s) | server serving | data parsed (dur) | worker0 joined "
            "| first step / first config |")
    lines = [head, "|" + "---|" * 11]
    base = [r for r in records if r["config"] == names[0]]
    for name in names:
        mine = [r for r in records if r["config"] == name and "first_step" in r]
        med = {c: _median([r[c] for r in mine if c in r]) for c in cols}
        launcher = [r["launcher"] for r in mine if "launcher" in r]
        lparts = "/".join(str(_median([x[k] for x in launcher])) for k in ("python", "imports", "hydra", "checks"))
        ups = {}
        for r in mine:
            for role, age in (r.get("up") or {}).items():
                ups.setdefault(role, []).append(age)
        up = ", ".join(f"{role} {_median(v)}" for role, v in sorted(ups.items()))
        ratios = [r["first_step"] / b["first_step"] for r, b in zip(mine, base) if "first_step" in b]
        lines.append(f"| {name} | {len(mine)} | {_median([r['load_1m'] for r in mine])} | {med['first_step']} | {lparts} "
                     f"| {med['cluster_start']} | {up} | {med['server']} | {med['data_done']} ({med['data']}) "
                     f"| {med['joined']} | {_median(ratios) if name != names[0] else 1.0} |")
    return "\n".join(lines)


def _parse_config(spec: str, kind: str) -> tuple[str, Any]:
    name, sep, value = spec.partition("=" if kind == "tree" else ":")
    if not sep or not name or not value:
        raise SystemExit(f"--{kind} {spec!r}: write NAME={'PATH' if kind == 'tree' else ''}"
                         f"{'' if kind == 'tree' else ':VAR=VALUE[,VAR=VALUE]'}")
    if kind == "tree":
        return name, Path(value).resolve()
    return name, dict(item.split("=", 1) for item in value.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per configuration (default 3)")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                        help="another checkout to run, alternating with this one")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:VAR=VALUE",
                        help="this checkout with environment variables set")
    parser.add_argument("--max-steps", type=int, default=20, help="trainer.max_steps of each run (default 20)")
    parser.add_argument("--jsonl", default=None, help="append one JSON line per run here")
    args = parser.parse_args(argv)
    configs: list[tuple[str, Path, dict[str, str]]] = [("this", ROOT, {})]
    for spec in args.tree:
        name, path = _parse_config(spec, "tree")
        if not (path / "datasets" / "generated").exists():
            (path / "datasets" / "generated").symlink_to(ROOT / "datasets" / "generated")
        configs.append((name, path, {}))
    for spec in args.variant:
        name, env = _parse_config(spec, "variant")
        configs.append((name, ROOT, env))
    records = []
    for i in range(args.runs):
        for name, tree, env in configs:
            record = {"config": name, "round": i, **run_one(tree, env, args.max_steps)}
            records.append(record)
            print(json.dumps(record), flush=True)
            if args.jsonl:
                with open(args.jsonl, "a", encoding="utf-8") as f:  # appended line by line: a log, not a result file
                    f.write(json.dumps(record) + "\n")
    print()
    print(markdown(records, [c[0] for c in configs]))
    return 0 if all(r["returncode"] == 0 and "first_step" in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
