"""benchmarks.serve_bench's reading of its sources, without a process: wrk's result line, the server's
log lines of served exports (times, commit-to-served), windows classified against applications, and
the tables of a recorded run."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from benchmarks import serve_bench

LOG = """\
2026-12-07 21:25:37,100 INFO recps.serve: serve: model models.deepfm.DeepFM, 13 dense inputs, sparse features [...]
2026-12-07 21:25:38,056 INFO recps.serve: serve: serving 20261201/1 base 1796678727+1 (delta /o/20261201/delta-1 \
applied in 0.30 s, committed 0.5 s ago; rows {'embedding_d11': 102805})
2026-12-07 21:25:44,986 INFO recps.serve: serve: serving 20261201/2 base 1796678800+0 (base /o/20261202/base \
applied in 0.36 s, committed 1.2 s ago; rows {'embedding_d11': 158508})
"""


def test_wrk_line_log_lines_and_windows():
    out = 'Running 2s test\nRECPS-WRK {"requests": 200, "duration_us": 2000000, "non_2xx": 3, "connect_errors": 0, ' \
          '"read_errors": 1, "write_errors": 0, "timeouts": 2, "p50_us": 4500, "p90_us": 9000, "p99_us": 15500, ' \
          '"max_us": 30000}\n'
    w = serve_bench.parse_wrk(out)
    assert w == {"requests": 200, "seconds": 2.0, "rps": 100.0, "non_2xx": 3, "errors": 3, "p50_ms": 4.5,
                 "p90_ms": 9.0, "p99_ms": 15.5, "max_ms": 30.0}
    apps = serve_bench.applications(LOG)
    assert [(a["kind"], a["folder"], a["apply_s"], a["commit_to_served_s"]) for a in apps] == [
        ("delta", "/o/20261201/delta-1", 0.30, 0.5), ("base", "/o/20261202/base", 0.36, 1.2)]
    served = datetime(2026, 12, 7, 21, 25, 38, 56000).astimezone().timestamp()  # the log's local time
    assert abs(apps[0]["end_unix"] - served) < 1e-3 and abs(apps[0]["start_unix"] - (served - 0.30)) < 1e-3
    windows = [{"start_unix": served - 2.0, "end_unix": served - 0.5},  # before the application
               {"start_unix": served - 0.5, "end_unix": served + 1.5},  # overlaps it
               {"start_unix": served + 1.5, "end_unix": served + 3.5}]
    during, quiet = serve_bench.classify(windows, apps[:1])
    assert during == windows[1:2] and quiet == [windows[0], windows[2]]


def test_the_recorded_run_prints_its_tables(capsys):
    path = Path(serve_bench.__file__).parent / "results" / "serve_bench_2026-12-07.jsonl"
    assert serve_bench.main(["--markdown", str(path)]) == 0
    out = capsys.readouterr().out
    record = json.loads(path.read_text().splitlines()[0])
    assert f"| exports served (deltas) | {record['exports_served']} ({record['deltas_served']}) |" in out
    assert "overload: 256 connections" in out
