"""benchmarks.fault_bench cannot rot: two real cells of the fault table on the counting recps.train
job (2 servers, 2 workers), and the table it writes.

- kill -9 of worker1 under async with cluster.restarts=0: the job fails at once, its error names
  worker1, and no process of the job is left;
- kill -9 of server1 under GEO with cluster.restarts=1: the job recovers from its last committed
  checkpoint and exits 0, and every row of the final tables equals its exact count (halved: GEO
  scales the deltas of the 2 workers by 1/2).
"""

from __future__ import annotations

import json

import pytest

from benchmarks import fault_bench

pytestmark = pytest.mark.slow


def test_two_cells_and_their_table(tmp_path):
    jsonl, results = tmp_path / "cells.jsonl", tmp_path / "RESULTS.md"
    results.write_text("# results\n\n## Another section\n\nkept\n")
    common = ["--dir", str(tmp_path / "work"), "--jsonl", str(jsonl), "--results-md", str(results)]
    assert fault_bench.main(["--faults", "kill9_worker", "--modes", "async", "--restarts", "0", *common]) == 0
    assert fault_bench.main(["--faults", "kill9_server", "--modes", "geo", "--restarts", "1", *common]) == 0
    failed, recovered = [json.loads(x) for x in jsonl.read_text().splitlines()]

    assert failed["outcome"].startswith("failed: recps.train: LaunchError: worker1 (pid"), failed
    assert failed["names_role"] is True and failed["orphans"] == 0 and failed["exit_code"] != 0, failed
    assert 0 <= failed["detect_s"] < 3.0, failed  # the launcher sees its child die (dead_after_s=3 is the outer bound)

    assert recovered["outcome"] == "recovered (1 restart)", recovered
    assert recovered["restart_causes"] == ["server1 was killed by SIGKILL"] and recovered["names_role"] is True, recovered
    assert recovered["rows"].startswith("exact ") and int(recovered["rows"].split()[1]) > 500, recovered
    assert recovered["orphans"] == 0 and recovered["exit_code"] == 0, recovered

    text = results.read_text()
    assert "## Another section\n\nkept" in text and text.count(fault_bench.BEGIN) == 1
    assert "### cluster.restarts=0" in text and "### cluster.restarts=1" in text
    assert "| kill9_worker | async | " in text and "| kill9_server | geo | " in text and "recovered (1 restart)" in text


def test_unknown_fault_or_mode_fails_naming_it(tmp_path):
    with pytest.raises(SystemExit, match=r"--faults kill9_printer: not one of kill9_server"):
        fault_bench.main(["--faults", "kill9_printer", "--dir", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"--modes fast: not one of sync, async, geo"):
        fault_bench.main(["--modes", "fast", "--dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"fault 'x' is not one of"):
        fault_bench.run_cell("x", "async", 0, tmp_path)
