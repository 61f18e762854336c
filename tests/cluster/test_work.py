"""recps.cluster.work.ProgressLog: worker 0's progress line counts the job's steps (issue 32.3: `step 144`
beside metrics at step 600 after a resume) and its rate since the current fit's first step (issue 32.7: a
stream's second pass said "step 1, 26 examples/s" beside a pass line of 11,861 examples/s)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from recps.cluster import work


@pytest.fixture
def clock(monkeypatch):
    """recps.cluster.work's perf_counter, set by the test; a line at most every second (not 5)."""
    now = [100.0]
    monkeypatch.setattr(work.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(work, "_PROGRESS_EVERY_S", 1.0)
    return now


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "recps.cluster"]


def test_the_progress_line_counts_the_jobs_steps_and_the_fits_rate(clock, caplog):
    job = SimpleNamespace(steps_done=392)  # resumed at step 392
    progress = work.ProgressLog(batch_size=100, threads=1, job=job)
    clock[0] = 1000.0  # long after the log was made (a stream's later pass)
    with caplog.at_level(logging.INFO, logger="recps.cluster"):
        progress(0, 1, 0.5)
        progress(0, 2, 0.5)  # at once: no line (it said "step 2, 739907 examples/s" over 1 step)
        clock[0] = 1002.0
        progress(0, 21, 0.4)  # 20 steps of 100 since the first: 1000 examples/s
    assert lines(caplog)[0].startswith("first training step done (loss 0.5000)")
    assert lines(caplog)[1] == "step 413, 1000 examples/s on this worker, loss 0.4000"
    # The next fit (the stream's next pass): the job's count went on, the rate starts again.
    job.steps_done = 450
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="recps.cluster"):
        clock[0] = 2000.0
        progress(0, 1, 0.3)
        clock[0] = 2001.0
        progress(0, 11, 0.3)
    assert lines(caplog) == ["step 461, 1000 examples/s on this worker, loss 0.3000"]
