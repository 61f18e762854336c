"""The fault table: faults x PS modes on a small counting `python -m recps.train` job, on 127.0.0.1.

Each cell starts the job (recps.launch under recps.train: 2 servers, 2 workers of 1 thread), waits
for its first committed checkpoint, injects one fault into one process and records:

    detect_s   seconds from the fault to the first line of the job's output that reports it (the
               launcher's "was killed by" / "exited with code", a peer's "is dead" / "left before" /
               "dead or stalled" / "declared dead", a "restart N of"); for a killed launcher, the
               seconds until its last child process was gone
    outcome    finished (the fault changed nothing), recovered (N restarts, exit 0), failed (the
               job's own last error line, `recps.train: ...`), hung (still running at the bound)
    names_role whether a failed job's error names the process the fault hit (server1, worker1,
               server0); the launcher's own faults have no role to name
    rows       a job that exited 0: every row of the final checkpoint's embedding table equals
               minus its key's occurrences in the training data (the counting setup below),
               "exact N" or "WRONG k of N"; a failed job leaves no final tables: "-"
    orphans    processes of the job (marked by an environment variable every child inherits) still
               alive 5 s after the job ended (after a launcher kill -9: 30 s); none expected

Faults (server = server1, coordinator = server0, which hosts it; worker = worker1; launcher =
the recps.train process that supervises them):

    kill9_<role>   SIGKILL
    stop20_<role>  SIGSTOP, SIGCONT 20 s later (--stop-s)
    port_blocked   server1's port stops answering for good: emulated by SIGSTOP of server1, never
                   continued by the bench (no iptables here; a stopped process's port accepts TCP in
                   the kernel and never answers, its heartbeats stop too); the launcher's SIGCONT +
                   SIGTERM at the end releases it

Counting setup (as tests/helpers/counting.py): models.LR, rows starting at 0, SGD lr 1, loss = the sum of
the logits, so each row's gradient is 1 per occurrence of its key (sync applies the mean of the 2
workers' gradients and GEO scales deltas by 1 / workers: there a row ends at -count / 2, exact too); cluster.checkpoint_every=40
steps (recovery resumes from the last committed checkpoint). cluster.dead_after_s=3 (--dead-after).

    python -m benchmarks.fault_bench                          # every fault x sync, async, GEO, restarts 0
    python -m benchmarks.fault_bench --restarts 1             # the recovery column
    python -m benchmarks.fault_bench --faults kill9_server --modes async --no-md

Each cell is one JSON line appended to benchmarks/results/fault_bench_<UTC date>.jsonl (--jsonl);
the RESULTS.md section (between <!-- BEGIN fault_bench --> and <!-- END fault_bench -->) is built
from every line of that file, the latest per (fault, mode, restarts).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

__all__ = ["FAULTS", "MODES", "run_cell", "markdown", "main"]

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- BEGIN fault_bench -->", "<!-- END fault_bench -->"
MARKER = "RECPS_FAULT_BENCH_CELL"
FAULTS = {  # name -> (target, action)
    "kill9_server": ("server1", "kill"),
    "kill9_worker": ("worker1", "kill"),
    "kill9_coordinator": ("server0", "kill"),
    "kill9_launcher": ("launcher", "kill"),
    "stop20_server": ("server1", "stop"),
    "stop20_worker": ("worker1", "stop"),
    "stop20_coordinator": ("server0", "stop"),
    "stop20_launcher": ("launcher", "stop"),
    "port_blocked": ("server1", "block"),
}
MODES = ("sync", "async", "geo")
BATCH = 16
EVERY = 40
COMMITTED = re.compile(r"\[worker0\].*committed \S+/(step-\d+)")
# A decision that a process is lost (not a first symptom such as a heartbeat that went unanswered).
DETECTED = re.compile(r"was killed by|exited with code|is dead|left before the job finished|dead or stalled|"
                      r"declared dead|restart \d+ of \d+|LaunchError")


def counting_overrides(data: Path, mode: str, restarts: int, dead_after_s: float, rows: int) -> list[str]:
    extra = ["ps.k_steps=5"] if mode == "geo" else []
    return ["model=lr", "task._target_=tests.helpers.counting.CountingTask", f"ps={mode}", *extra, "ps.table.init_std=0",
            "ps.table.optimizer.name=sgd", "ps.table.optimizer.lr=1", "metrics=off", "progress=false",
            "trainer.threads=1", "cluster.servers=2", "cluster.workers=2", f"trainer.batch_size={BATCH}",
            f"cluster.checkpoint_every={EVERY}", f"cluster.dead_after_s={dead_after_s:g}", f"cluster.restarts={restarts}",
            f"dataset.dir={data}", f"dataset.generate.train_rows={rows}", "dataset.generate.test_rows=500",
            "dataset.generate.vocab=500"]


def _marked(marker: str) -> list[int]:
    """Live (not zombie) processes whose environment carries MARKER=marker."""
    found = []
    needle = f"{MARKER}={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def exact_counts(overrides: list[str], checkpoint: Path, mode: str) -> str:
    """'exact N' when every row of the last committed checkpoint's embedding_d1 equals -(its key's
    occurrences in the training split), divided by the 2 workers under sync (its servers apply the
    mean of the workers' gradients of a step) and GEO (deltas are scaled by 1 / workers, Paddle's
    averaging), else 'WRONG k of N'."""
    import torch

    from recps.job.checkpoint import read_ps_checkpoint
    from recps.config import compose_config
    from recps.ps.embedding import salted_keys
    from recps.job.build import prepare_dataset

    cfg = compose_config(overrides)
    data = prepare_dataset(cfg.dataset, seed=int(cfg.seed))
    keys = [salted_keys(batch.sparse[f].values(), f"t_{f}") for batch in data.train.batches(BATCH, 0, 1, 0)
            for f in batch.sparse.keys()]
    expected, counts = torch.unique(torch.cat(keys), return_counts=True)
    rows = read_ps_checkpoint(str(checkpoint), tables=["embedding_d1"])["embedding_d1"]
    if not torch.equal(rows.keys, expected):
        return f"WRONG keys: {len(rows)} rows for {expected.numel()} keys"
    expected_values = counts.to(rows.values.dtype) / (2 if mode in ("sync", "geo") else 1)  # 2 workers; halves are exact
    wrong = int((-rows.values[:, 0] != expected_values).sum())
    return f"exact {len(rows)}" if wrong == 0 else f"WRONG {wrong} of {len(rows)}"


class _Job:
    """The launched job, its output read on a thread: (monotonic time, line), and pids by role."""

    def __init__(self, cmd: list[str], env: dict, cwd: str) -> None:
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.pids: dict[str, int] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            now = time.monotonic()
            with self._lock:
                self.lines.append((now, line))
                if m := re.search(r"started (\w+) \(pid (\d+)\)", line):
                    self.pids[m.group(1)] = int(m.group(2))

    def wait_for(self, pattern: re.Pattern, deadline: float) -> bool:
        seen = 0
        while time.monotonic() < deadline:
            with self._lock:
                new = self.lines[seen:]
                seen = len(self.lines)
            if any(pattern.search(line) for _, line in new):
                return True
            if self.proc.poll() is not None and not self._reader.is_alive():
                return False
            time.sleep(0.05)
        return False

    def first_after(self, t0: float, pattern: re.Pattern) -> tuple[float, str] | None:
        with self._lock:
            for t, line in self.lines:
                if t >= t0 and pattern.search(line):
                    return t - t0, line.strip()
        return None

    def text(self) -> str:
        self._reader.join(10)
        with self._lock:
            return "".join(line for _, line in self.lines)


def run_cell(fault: str, mode: str, restarts: int, folder: Path, dead_after_s: float = 3.0, stop_s: float = 20.0,
             rows: int = 12000, timeout_s: float = 300.0) -> dict:
    """Run one cell (see the module docstring); returns its record."""
    if fault not in FAULTS:
        raise ValueError(f"fault_bench: fault {fault!r} is not one of {sorted(FAULTS)}")
    if mode not in MODES:
        raise ValueError(f"fault_bench: mode {mode!r} is not one of {MODES}")
    from recps.config import PROJECT_ROOT

    target, action = FAULTS[fault]
    cell = f"{fault}-{mode}-r{restarts}"
    run = folder / cell
    overrides = counting_overrides(folder / "data", mode, restarts, dead_after_s, rows)
    marker = f"{cell}-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, MARKER: marker, "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    job = _Job([sys.executable, "-m", "recps.train", *overrides, f"hydra.run.dir={run}"], env, str(PROJECT_ROOT))
    record = {"fault": fault, "mode": mode, "restarts": restarts, "target": target, "dead_after_s": dead_after_s,
              "run_dir": str(run), "rows_setting": rows,
              "stop_s": stop_s if action == "stop" else None, "load_avg_before": round(os.getloadavg()[0], 2)}
    stopped_pid = None
    orphans: list[int] = []
    try:
        deadline = started + timeout_s
        if not job.wait_for(COMMITTED, deadline):
            record.update(outcome="no checkpoint before the fault (not run)", detect_s=None, rows="-", orphans=None)
            return record
        time.sleep(0.2)
        pid = job.proc.pid if target == "launcher" else job.pids[target]
        t0 = time.monotonic()
        record["fault_at_s"] = round(t0 - started, 1)
        record["fault_unix"] = round(time.time(), 3)
        if action == "kill":
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGSTOP)
            stopped_pid = pid
            if action == "stop":
                end = time.monotonic() + stop_s
                while time.monotonic() < end and job.proc.poll() is None:
                    time.sleep(0.1)
                if target != "launcher" or job.proc.poll() is None:
                    _signal(pid, signal.SIGCONT)
                stopped_pid = None
        if target == "launcher" and action == "kill":
            # Nobody supervises now: its children must go by themselves (PDEATHSIG, lost peers).
            gone_by = t0 + 30.0
            while time.monotonic() < gone_by and _marked(marker):
                time.sleep(0.1)
            left = _marked(marker)
            record["detect_s"] = round(time.monotonic() - t0, 2) if not left else None
            record["detect_line"] = "every child of the killed launcher exited" if not left else f"{len(left)} still alive"
            job.proc.wait(10)
            orphans = left
            record.update(outcome="failed: the launcher was killed (no supervisor; its children stopped)",
                          exit_code=job.proc.returncode, names_role=None, rows="-")
        else:
            try:
                job.proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if stopped_pid is not None:  # the blocked server, if the launcher left it stopped
                _signal(stopped_pid, signal.SIGCONT)
            hung = job.proc.poll() is None
            out = job.text() if not hung else "".join(line for _, line in job.lines)
            first = job.first_after(t0, DETECTED)
            record["detect_s"] = round(first[0], 2) if first else None
            record["detect_line"] = first[1][-300:] if first else None
            restarted = re.findall(r"restart (\d+) of \d+ in \d+ s: (\w+) \(pid \d+\) ([^;:\n]*)(.*)", out)
            record["restarts_used"] = len(restarted)
            record["restart_causes"] = [f"{who} {how}" for _, who, how, _ in restarted]
            restart_lines = [f"{who} {how}{rest}" for _, who, how, rest in restarted]
            errors = [line for line in out.splitlines() if line.startswith("recps.train:")]
            if hung:
                record.update(outcome=f"hung (still running {timeout_s:g} s after the start)", exit_code=None, rows="-")
            elif job.proc.returncode == 0:
                record["outcome"] = f"recovered ({len(restarted)} restart{'s' * (len(restarted) != 1)})" if restarted \
                    else "finished (no effect)"
                record["exit_code"] = 0
                try:
                    record["rows"] = exact_counts(overrides, run / "checkpoint", mode)
                except Exception as e:  # noqa: BLE001 - recorded, the table shows it
                    record["rows"] = f"not checked: {type(e).__name__}: {e}"[:300]
            else:
                cause = errors[-1] if errors else (out.strip().splitlines() or ["(no output)"])[-1]
                record.update(outcome=f"failed: {cause[:400]}", exit_code=job.proc.returncode, rows="-")
            if target != "launcher" and not record["outcome"].startswith(("finished", "recovered")):
                record["names_role"] = bool(re.search(rf"\b{target}\b", record["outcome"]))
            elif restarted:  # the first restart's cause (the process that ended, and why) names the role
                record["names_role"] = bool(re.search(rf"\b{target}\b", restart_lines[0]))
            else:
                record["names_role"] = None
            time.sleep(5.0)  # the job ended: give stragglers the launcher's grace before counting them
            orphans = _marked(marker)
        record["orphans"] = len(orphans)
        record["wall_s"] = round(time.monotonic() - started, 1)
        (run.parent / f"{cell}.log").write_text(job.text() if job.proc.poll() is not None else "")
        return record
    finally:
        if job.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.proc.pid, signal.SIGKILL)
            job.proc.wait(10)
        for pid in _marked(marker):  # whatever was left (already counted above): never leave it running
            _signal(pid, signal.SIGCONT)
            _signal(pid, signal.SIGKILL)


def _latest(records: list[dict]) -> dict[tuple, dict]:
    out = {}
    for r in records:
        out[(r["fault"], r["mode"], r["restarts"])] = r
    return out


def _cell(r: dict | None) -> str:
    if r is None:
        return "not run"
    detect = "-" if r.get("detect_s") is None else f"{r['detect_s']:.1f} s"
    outcome = r["outcome"]
    if outcome.startswith("failed: recps.train: "):
        outcome = "failed: " + outcome[len("failed: recps.train: "):]
    outcome = re.sub(r" \(pid \d+\)|; its output is in \S+", "", outcome)
    outcome = re.sub(r"tcp://127\.0\.0\.1:\d+", "tcp://…", outcome).replace("|", "/")
    outcome = outcome if len(outcome) <= 220 else outcome[:217] + "..."
    named = {True: "yes", False: "**no**", None: "-"}[r.get("names_role")]
    return f"{detect} | {outcome} | {named} | {r.get('rows', '-')} | {r.get('orphans', '-')}"


def markdown(records: list[dict], command: str) -> str:
    latest = _latest(records)
    restarts = sorted({k[2] for k in latest})
    dead = sorted({r["dead_after_s"] for r in records})
    loads = [r["load_avg_before"] for r in records if "load_avg_before" in r]
    lines = [
        "## Fault table (issue 15)",
        "",
        f"Cells from `{command}`, on 127.0.0.1, {os.cpu_count()} CPUs shared with other runs (1-minute load average at the cells' "
        f"starts {min(loads):.1f}-{max(loads):.1f}). Job: `python -m recps.train` counting setup (models.LR, rows from 0, SGD lr 1, "
        f"loss = sum of logits: gradient 1 per occurrence; sync averages the 2 workers' gradients and GEO scales deltas by "
        f"1/2, so there a row ends at -count/2), 2 servers + 2 workers x 1 thread, batch {BATCH}, "
        f"a committed checkpoint every {EVERY} steps, cluster.dead_after_s={'/'.join(f'{d:g}' for d in dead)}; the fault "
        "is injected after the first committed checkpoint. server = server1, coordinator = server0 (hosts it), worker = "
        "worker1, launcher = the recps.train process. port_blocked: server1 SIGSTOPped and never continued by the bench "
        "(no iptables here). Cells: detection | outcome | error names the role | rows (exit 0 only: every row of the final "
        "checkpoint = -(its key's occurrences), exact) | orphans (job processes alive 5 s after it ended).",
        "",
    ]
    for r in restarts:
        cells = [rec for k, rec in latest.items() if k[2] == r]
        kinds = {}
        for rec in cells:
            kind = rec["outcome"].split(" ", 1)[0].rstrip(":")
            kinds[kind] = kinds.get(kind, 0) + 1
        detect = [rec["detect_s"] for rec in cells if rec.get("detect_s") is not None]
        lines += [f"### cluster.restarts={r}", "",
                  f"{len(cells)} cells: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) +
                  f"; detection {min(detect):.1f}-{max(detect):.1f} s where something was detected; "
                  f"error names the role: {sum(rec.get('names_role') is True for rec in cells)} yes, "
                  f"{sum(rec.get('names_role') is False for rec in cells)} no; rows exact in "
                  f"{sum(str(rec.get('rows', '')).startswith('exact') for rec in cells)} of "
                  f"{sum(rec.get('exit_code') == 0 for rec in cells)} runs that exited 0; orphans: "
                  f"{sum(rec.get('orphans') or 0 for rec in cells)}.", "", "| fault | mode | detection | outcome | names role | rows | orphans |",
                  "|---|---|---|---|---|---|---|"]
        for fault in FAULTS:
            for mode in MODES:
                rec = latest.get((fault, mode, r))
                if rec is not None:
                    lines.append(f"| {fault} | {mode} | {_cell(rec)} |")
        lines.append("")
    return "\n".join(lines)


def write_section(path: Path, text: str) -> None:
    """`text` between the markers in `path` (appended with them if absent), written atomically;
    the file is re-read just before, so other sections written meanwhile are kept."""
    from recps import fs as rfs

    old = path.read_text()
    block = f"{BEGIN}\n{text.rstrip()}\n{END}\n"
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END) + r"\n?", re.S)
    new = pattern.sub(lambda _: block, old, count=1) if pattern.search(old) else old.rstrip() + "\n\n" + block
    rfs.write_atomic(str(path), new, overwrite=True)


def _names(text: str, known, what: str) -> list:
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit(f"fault_bench: --{what} {','.join(bad)}: not one of {', '.join(known)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fault_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--restarts", default="0", help="comma-separated cluster.restarts values (e.g. 0,1)")
    parser.add_argument("--dead-after", type=float, default=3.0, help="cluster.dead_after_s")
    parser.add_argument("--stop-s", type=float, default=20.0, help="seconds a stop20_* fault holds SIGSTOP")
    parser.add_argument("--rows", type=int, default=12000,  # 3,000 (before the forked cluster) could end before the fault
                        help="training rows of the generated data: the job must still train when the fault comes")
    parser.add_argument("--timeout", type=float, default=300.0, help="bound on one cell's job (s)")
    parser.add_argument("--dir", default=None, help="work folder (default: a new one under /tmp); --recheck: folders, "
                        "comma-separated, searched for each cell's run")
    parser.add_argument("--jsonl", default=None, help="cells are appended here (default benchmarks/results/fault_bench_<date>.jsonl)")
    parser.add_argument("--results-md", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--no-md", action="store_true")
    parser.add_argument("--recheck", action="store_true", help="recount the rows of every exit-0 cell in --jsonl not yet "
                        "found exact, from its run folder (--dir/<cell> when the record has none), rewrite the file, and write the table")
    args = parser.parse_args(argv)
    faults = _names(args.faults, list(FAULTS), "faults")
    modes = _names(args.modes, MODES, "modes")
    try:
        restarts = [int(x) for x in args.restarts.split(",") if x]
    except ValueError:
        raise SystemExit(f"fault_bench: --restarts {args.restarts!r}: give comma-separated integers (0,1)") from None
    folder = Path(args.dir.split(",")[0]) if args.dir else Path(f"/tmp/recps-fault-bench-{uuid.uuid4().hex[:8]}")
    folder.mkdir(parents=True, exist_ok=True)
    jsonl = Path(args.jsonl) if args.jsonl else HERE / "results" / f"fault_bench_{time.strftime('%Y-%m-%d', time.gmtime())}.jsonl"
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.fault_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.recheck:
        from recps import fs as rfs

        records = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()]
        for rec in records:
            if rec.get("exit_code") == 0 and not str(rec.get("rows", "")).startswith("exact"):
                cell = f"{rec['fault']}-{rec['mode']}-r{rec['restarts']}"
                ran_in = re.search(r"--dir (\S+)", rec.get("command", ""))  # the folder its own command named
                dirs = ([ran_in.group(1)] if ran_in else []) + (args.dir or "").split(",")
                run = Path(rec["run_dir"]) if rec.get("run_dir") else next(
                    (Path(d) / cell for d in dirs if d and (Path(d) / cell).is_dir()), folder / cell)
                overrides = counting_overrides(run.parent / "data", rec["mode"], rec["restarts"], rec["dead_after_s"],
                                               rec.get("rows_setting", args.rows))
                rec["rows"] = exact_counts(overrides, run / "checkpoint", rec["mode"])
                print(rec["fault"], rec["mode"], rec["restarts"], rec["rows"], flush=True)
        rfs.write_atomic(str(jsonl), "".join(json.dumps(r) + "\n" for r in records), overwrite=True)
    records = []
    for r in restarts if not args.recheck else []:
        for fault in faults:
            for mode in modes:
                rec = run_cell(fault, mode, r, folder, args.dead_after, args.stop_s, args.rows, args.timeout)
                rec["command"] = command
                rec["date_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
                records.append(rec)
                print(json.dumps(rec), flush=True)
                with open(jsonl, "a") as f:  # one line per cell, appended whole (the file is a log)
                    f.write(json.dumps(rec) + "\n")
    if not args.no_md:
        everything = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()]
        commands = sorted({r.get("command", "?") for r in everything})
        write_section(Path(args.results_md), markdown(everything, "`, `".join(commands)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
