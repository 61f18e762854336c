"""`recps.serve` under load while a stream trains and publishes deltas (issue 30, point 3).

    python -m benchmarks.serve_bench --jsonl benchmarks/results/serve_bench_2026-12-07.jsonl
    python -m benchmarks.serve_bench --quick              # a small check of the machinery (minutes)
    python -m benchmarks.serve_bench --markdown out.jsonl # the tables again

What runs, all on this machine (127.0.0.1, free ports, every process stopped by its PID):

- a drifting generated stream (recps.data.generators.drifting) of --days x --hours passes of --rows
  rows with --vocab keys per slot, on the local disk; the accessor's thresholds make a delta hold
  every row shown since the delta before (about 10^5 rows a pass at the defaults);
- `python -m recps.serve OUT` (DeepFM, --poll-seconds, --max-queue), started before the stream;
- `python -m recps.train stream=hourly` (1 server + 1 worker, async, DeepFM) over the stream;
- wrk (Debian's `wrk`, a C load generator: a closed loop of --connections connections on one
  thread, its own cost small beside a Python generator's on a 2-core machine) POSTs one
  /v1/score body of --candidates candidates (the stream's own values) in back-to-back windows of
  --window seconds from the first served version to the stream's end;
- after the stream: the same load alone (no training) at 1, 2, 4 and 8 connections, then
  overload: --overload connections at once, the server's RSS sampled all along.

Measured: commit-to-served of every export (the server's log: `committed X s ago` when it serves
it, X = its time.time() minus the export manifest's created_unix); each window's requests/s and
wrk's latency percentiles, windows classified by whether they overlap the application of a delta
of at least --big-delta rows (from the log: the moment it was served minus its `applied in` seconds);
overload: answers by status (the server's /metrics), wrk's errors, RSS before / max / after,
whether the server still answers. Prints one JSON line (appended to --jsonl) and the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

__all__ = ["applications", "classify", "parse_wrk", "main"]

DAY = "20261201"
READY_TIMEOUT_S = 300
STREAM_TIMEOUT_S = 3600
WRK_RESULT = "RECPS-WRK "

# wrk's Lua: one POST body (read from the file $RECPS_BENCH_BODY), and one JSON line at the end.
LUA = r"""
local f = assert(io.open(os.getenv("RECPS_BENCH_BODY"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"

done = function(summary, latency, requests)
  io.write(string.format(
    'RECPS-WRK {"requests": %d, "duration_us": %d, "non_2xx": %d, "connect_errors": %d, "read_errors": %d, ' ..
    '"write_errors": %d, "timeouts": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, "max_us": %d}\n',
    summary.requests, summary.duration, summary.errors.status, summary.errors.connect, summary.errors.read,
    summary.errors.write, summary.errors.timeout, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max))
end
"""

# recps.serve.versions' line when it serves a new version
_SERVED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO recps\.serve: serve: serving (\S+) base (\d+)\+(\d+) "
                     r"\((base|delta) (\S+) applied in ([\d.]+) s, committed ([\d.]+) s ago")


# ----------------------------------------------------------------------------------- pure parts


def parse_wrk(output: str) -> dict[str, Any]:
    """The JSON line LUA's done() prints, with requests/s and milliseconds."""
    line = next((x for x in output.splitlines() if x.startswith(WRK_RESULT)), None)
    if line is None:
        raise RuntimeError(f"wrk printed no result line:\n{output[-2000:]}")
    r = json.loads(line[len(WRK_RESULT):])
    seconds = r["duration_us"] / 1e6
    out = {"requests": r["requests"], "seconds": round(seconds, 3),
           "rps": round(r["requests"] / seconds, 1) if seconds else 0.0,
           "non_2xx": r["non_2xx"], "errors": r["connect_errors"] + r["read_errors"] + r["write_errors"] + r["timeouts"]}
    out.update({f"{k}_ms": round(r[f"{k}_us"] / 1e3, 2) for k in ("p50", "p90", "p99", "max")})
    return out


def applications(log_text: str) -> list[dict[str, Any]]:
    """Every export the server served, from its log: kind, folder, the unix times its application
    started and ended, and its commit-to-served seconds."""
    out = []
    for line in log_text.splitlines():
        m = _SERVED.match(line)
        if not m:
            continue
        stamp, name, key, deltas, kind, folder, applied, committed = m.groups()
        end = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=_local_tz()).timestamp()
        out.append({"kind": kind, "folder": folder, "version": name, "end_unix": end,
                    "start_unix": end - float(applied), "apply_s": float(applied),
                    "commit_to_served_s": float(committed)})
    return out


def _local_tz():
    return datetime.now().astimezone().tzinfo  # logging's asctime is local time


def classify(windows: Sequence[dict], apps: Sequence[dict]) -> tuple[list[dict], list[dict]]:
    """(windows overlapping any of `apps`' application intervals, the others)."""
    during, quiet = [], []
    for w in windows:
        hit = any(a["start_unix"] < w["end_unix"] and w["start_unix"] < a["end_unix"] for a in apps)
        (during if hit else quiet).append(w)
    return during, quiet


def _pct(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) of `values`, nearest rank; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


# ----------------------------------------------------------------------------------- processes


@dataclass
class _Proc:
    proc: subprocess.Popen
    log: Path

    def stop(self) -> None:
        """SIGTERM by PID, SIGKILL if it has not ended within 30 s."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


def _spawn(cmd: list[str], log: Path) -> _Proc:
    from recps.config import PROJECT_ROOT

    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return _Proc(proc, log)


def _get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _metric(url: str, name: str) -> float:
    _, text = _get(url + "/metrics")
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_ready(url: str, server: _Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"recps.serve exited {server.proc.returncode}:\n{server.log.read_text()[-3000:]}")
        try:
            if _get(url + "/healthz")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"recps.serve served nothing within {timeout:.0f} s:\n{server.log.read_text()[-3000:]}")


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024


def _wrk(url: str, body: Path, lua: Path, seconds: float, connections: int, threads: int = 1,
         timeout_s: float = 5.0) -> dict[str, Any]:
    cmd = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s", f"--timeout={timeout_s:g}s",
           "-s", str(lua), url + "/v1/score"]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60,
                          env={**os.environ, "RECPS_BENCH_BODY": str(body)})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return {"start_unix": start, "end_unix": time.time(), "connections": connections, **parse_wrk(proc.stdout)}


def request_body(root: str, candidates: int) -> dict:
    """One /v1/score body from the stream's first split: the user is line 0's I1..I13 and C1..C13,
    candidate b line b+1's C14..C26."""
    from recps import fs as rfs

    folder = rfs.join(root, DAY, "0000")
    fs, path = rfs.resolve(folder)
    lines: list[list[str]] = []
    for part in sorted(p for p in fs.ls(path, detail=False) if p.rsplit("/", 1)[-1].startswith("part-")):
        lines += [x.split("\t") for x in fs.cat_file(part).decode().splitlines()[: candidates + 1]]
        if len(lines) > candidates:
            break
    user = {f"I{i}": (int(v) if v.lstrip("-").isdigit() else float(v)) if v else None
            for i, v in enumerate(lines[0][1:14], start=1)}
    user |= {f"C{i}": lines[0][13 + i] or None for i in range(1, 14)}
    return {"user": user, "candidates": [{f"C{i}": row[13 + i] or None for i in range(14, 27)}
                                         for row in lines[1: candidates + 1]]}


# ----------------------------------------------------------------------------------- the run


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from recps.cluster.launch import free_port
    from recps.data.generators.drifting import write_stream

    if shutil.which("wrk") is None:
        raise RuntimeError("wrk is not installed: apt-get install wrk (Debian's package)")
    root, out = str(tmp / "clicks"), str(tmp / "model")
    write_stream(root, days=args.days, hours=args.hours, rows=args.rows, start_day=DAY, vocab=args.vocab)
    body, lua = tmp / "body.json", tmp / "score.lua"
    body.write_text(json.dumps(request_body(root, args.candidates)))
    lua.write_text(LUA)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = _spawn([sys.executable, "-m", "recps.serve", out, "--port", str(port), "--poll-seconds",
                     str(args.poll_seconds), "--max-queue", str(args.max_queue)], tmp / "serve.log")
    end_day = datetime.strptime(DAY, "%Y%m%d").toordinal() + args.days - 1
    end_day_s = datetime.fromordinal(end_day).strftime("%Y%m%d")
    train_cmd = [sys.executable, "-m", "recps.train", "stream=hourly", f"stream.root={root}", f"stream.out={out}",
                 f"stream.start_day={DAY}", f"stream.end_day={end_day_s}", f"stream.hours={args.hours}",
                 "stream.data_sleep_second=0.2", "ps=async", "model=deepfm", "cluster.servers=1", "cluster.workers=1",
                 "trainer.threads=1", "trainer.batch_size=512", "progress=false",
                 # a delta (and a base) holds every row shown since the save before: score 0.1 a show
                 "ps.table.accessor.base_threshold=0.05", "ps.table.accessor.delta_threshold=0.05",
                 f"hydra.run.dir={tmp / 'run'}"]
    train = None
    record: dict[str, Any] = {"bench": "serve_bench", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                              "days": args.days, "hours": args.hours, "rows": args.rows, "vocab": args.vocab,
                              "candidates": args.candidates, "connections": args.connections,
                              "poll_seconds": args.poll_seconds, "max_queue": args.max_queue,
                              "load_before": os.getloadavg()}
    try:
        train = _spawn(train_cmd, tmp / "train.log")
        _wait_ready(url, server, READY_TIMEOUT_S)
        windows = []
        deadline = time.monotonic() + STREAM_TIMEOUT_S
        while train.proc.poll() is None and time.monotonic() < deadline:
            windows.append(_wrk(url, body, lua, args.window, args.connections))
        if train.proc.poll() is None:
            raise RuntimeError(f"the stream did not end within {STREAM_TIMEOUT_S} s")
        if train.proc.returncode != 0:
            raise RuntimeError(f"the stream failed:\n{train.log.read_text()[-3000:]}")
        record["load_after_stream"] = os.getloadavg()
        # the last base: its records are written once the stream ends; served within a few polls
        deadline = time.monotonic() + READY_TIMEOUT_S
        last = f"{out}/{datetime.fromordinal(end_day + 1).strftime('%Y%m%d')}/base"
        while time.monotonic() < deadline and json.loads(_get(url + "/healthz")[1])["version"]["base"] != last:
            time.sleep(0.2)
        alone = [_wrk(url, body, lua, args.alone_seconds, c) for c in (1, 2, 4, 8)]
        record["load_after_alone"] = os.getloadavg()
        # overload: many more connections than --max-queue; RSS sampled meanwhile
        rss, stop = [_rss_mib(server.proc.pid)], threading.Event()

        def sample() -> None:
            while not stop.wait(0.1):
                try:
                    rss.append(_rss_mib(server.proc.pid))
                except (OSError, StopIteration):
                    return

        before = {c: _metric(url, f'recps_requests_total{{code="{c}",route="/v1/score"}}') for c in ("200", "503")}
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        over = _wrk(url, body, lua, args.alone_seconds, args.overload, threads=2, timeout_s=10.0)
        stop.set()
        sampler.join(timeout=5)
        after = {c: _metric(url, f'recps_requests_total{{code="{c}",route="/v1/score"}}') for c in ("200", "503")}
        alive = server.proc.poll() is None and _get(url + "/healthz")[0] == 200
        record["overload"] = {**over, "answered_200": int(after["200"] - before["200"]),
                              "answered_503": int(after["503"] - before["503"]),
                              "rss_before_mib": round(rss[0], 1), "rss_max_mib": round(max(rss), 1),
                              "rss_after_mib": round(_rss_mib(server.proc.pid), 1), "server_alive": alive}
    finally:
        for p in (train, server):
            if p is not None:
                p.stop()
    record["load_after"] = os.getloadavg()
    apps = applications(server.log.read_text())
    delta_rows = _delta_rows(out)
    for a in apps:
        a["rows"] = delta_rows.get(a["folder"].rstrip("/"))
    big = [a for a in apps if a["kind"] == "delta" and (a["rows"] or 0) >= args.big_delta]
    during, quiet = classify(windows, big)
    metrics = json.loads((tmp / "run" / "metrics.json").read_text())
    passes = [p for p in metrics["stream"]["passes"] if "pass" in p]
    c2s = [a["commit_to_served_s"] for a in apps]
    record.update(
        exports_served=len(apps), deltas_served=sum(a["kind"] == "delta" for a in apps),
        commit_to_served_p50_s=_pct(c2s, 0.5), commit_to_served_p99_s=_pct(c2s, 0.99),
        commit_to_served_max_s=max(c2s) if c2s else None,
        delta_rows_median=_delta_rows_median(apps),
        apply_s_median=statistics.median(a["apply_s"] for a in big) if big else None,
        checkpoint_s_median=statistics.median(p["checkpoint_s"] for p in passes if "checkpoint_s" in p),
        pass_s_median=statistics.median(p["pass_s"] for p in passes),
        windows=windows, big_deltas=len(big), alone=alone, applications=apps,
        windows_during_delta=len(during), windows_quiet=len(quiet),
        quiet_p99_ms_median=statistics.median(w["p99_ms"] for w in quiet) if quiet else None,
        quiet_rps_median=statistics.median(w["rps"] for w in quiet) if quiet else None,
        during_p99_ms_median=statistics.median(w["p99_ms"] for w in during) if during else None,
        during_p99_ms_max=max(w["p99_ms"] for w in during) if during else None,
        during_rps_median=statistics.median(w["rps"] for w in during) if during else None,
        non_2xx_while_training=sum(w["non_2xx"] + w["errors"] for w in windows))
    return record


def _delta_rows(out: str) -> dict[str, int]:
    """Each published export's rows (its manifest's)."""
    from recps import fs as rfs
    from recps.stream.donefile import Donefiles

    done, rows = Donefiles(out), {}
    for r in done.patches() + done.bases():
        folder = Donefiles.export_folder(r)
        rows[folder] = int(json.loads(rfs.read_bytes(rfs.join(folder, "manifest.json")))["progress"]["stream"]["rows"])
    return rows


def _delta_rows_median(apps: Sequence[dict]) -> float | None:
    rows = [a["rows"] for a in apps if a["kind"] == "delta" and a.get("rows") is not None]
    return statistics.median(rows) if rows else None


def markdown(record: dict[str, Any]) -> str:
    """The tables of one run's record."""
    f = lambda v, fmt="{:.3g}": "-" if v is None else fmt.format(v)  # noqa: E731
    load = lambda k: "/".join(f"{x:.1f}" for x in record.get(k, ()))  # noqa: E731
    lines = [f"serve_bench {record['date']}: {record['days']} days x {record['hours']} passes of {record['rows']} rows "
             f"(vocab {record['vocab']}), /v1/score of {record['candidates']} candidates, DeepFM, "
             f"--poll-seconds {record['poll_seconds']}; load (1/5/15 min) before {load('load_before')}, after the stream "
             f"{load('load_after_stream')}, after the load alone {load('load_after_alone')}", "",
             "| while the stream trains | value |", "|---|---|",
             f"| exports served (deltas) | {record['exports_served']} ({record['deltas_served']}) |",
             f"| commit-to-served p50 / p99 / max, s | {f(record['commit_to_served_p50_s'])} / "
             f"{f(record['commit_to_served_p99_s'])} / {f(record['commit_to_served_max_s'])} |",
             f"| delta rows (median) | {f(_delta_rows_median(record['applications']), '{:.0f}')} |",
             f"| a delta's application, s (median) | {f(record['apply_s_median'])} |",
             f"| the pass's checkpoint, s (median; the wait the record had before) | {f(record['checkpoint_s_median'])} |",
             f"| {record['connections']}-connection windows: quiet (p99 ms median, req/s median) | {record['windows_quiet']}: "
             f"{f(record['quiet_p99_ms_median'])} ms, {f(record['quiet_rps_median'], '{:.0f}')} |",
             f"| windows overlapping a >= 10^5-row delta's application (p99 ms median / max, req/s) | "
             f"{record['windows_during_delta']}: {f(record['during_p99_ms_median'])} / {f(record['during_p99_ms_max'])} ms, "
             f"{f(record['during_rps_median'], '{:.0f}')} |",
             f"| non-2xx or errors while training | {record['non_2xx_while_training']} |", "",
             "| alone (no training): connections | req/s | p50 ms | p90 ms | p99 ms | max ms | non-2xx |",
             "|---|---|---|---|---|---|---|"]
    for w in record["alone"]:
        lines.append(f"| {w['connections']} | {w['rps']:.0f} | {w['p50_ms']} | {w['p90_ms']} | {w['p99_ms']} | "
                     f"{w['max_ms']} | {w['non_2xx']} |")
    o = record["overload"]
    lines += ["", f"overload: {o['connections']} connections for {o['seconds']} s: {o['requests']} answers "
              f"({o['answered_200']} x 200, {o['answered_503']} x 503, wrk errors {o['errors']}), p99 {o['p99_ms']} ms; "
              f"server RSS {o['rss_before_mib']} -> max {o['rss_max_mib']} -> {o['rss_after_mib']} MiB; "
              f"still answering: {o['server_alive']}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 day x 2 passes of 3,000 rows, 1 s windows: a check")
    p.add_argument("--days", type=int, default=2)
    p.add_argument("--hours", type=int, default=6)
    p.add_argument("--rows", type=int, default=30_000)
    p.add_argument("--vocab", type=int, default=20_000)
    p.add_argument("--candidates", type=int, default=100)
    p.add_argument("--connections", type=int, default=2)
    p.add_argument("--window", type=float, default=2.0, help="seconds of each wrk window while the stream trains")
    p.add_argument("--alone-seconds", type=float, default=10.0)
    p.add_argument("--overload", type=int, default=256, help="connections of the overload run")
    p.add_argument("--poll-seconds", type=float, default=0.5)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--big-delta", type=int, default=100_000, help="rows of a delta whose application is watched")
    p.add_argument("--jsonl", type=Path)
    p.add_argument("--keep", type=Path, help="keep the stream, its output and the logs here")
    p.add_argument("--markdown", type=Path, help="print the tables of this JSON-lines file's records and exit")
    args = p.parse_args(argv)
    if args.markdown:
        for line in args.markdown.read_text().splitlines():
            print(markdown(json.loads(line)) + "\n")
        return 0
    if args.quick:
        args.days, args.hours, args.rows, args.window, args.alone_seconds = 1, 2, 3000, 1.0, 2.0
    tmp = Path(tempfile.mkdtemp(prefix="recps-serve-bench-")) if args.keep is None else args.keep
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        record = run(args, tmp)
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
    line = json.dumps(record, default=str)
    print(line)
    if args.jsonl:
        args.jsonl.parent.mkdir(parents=True, exist_ok=True)
        with open(args.jsonl, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
