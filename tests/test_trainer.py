"""The training loop's own contract: step counts over Hogwild threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from recps.config import PROJECT_ROOT, compose_config
from recps.errors import ConfigError
from recps.observer import TrainObserver
from recps.run import build_job
from recps.trainer import planned_steps


class CountSteps(TrainObserver):
    def __init__(self) -> None:
        self.steps, self.lock = 0, threading.Lock()

    def on_batch(self, thread, step, epoch, batch, logits, loss) -> None:
        with self.lock:
            self.steps += 1


@pytest.mark.parametrize("threads", [2, 3])
def test_max_steps_is_exact_with_several_threads(tmp_path, threads):
    """`trainer.max_steps=50` trains 50 steps over all threads, not 50 plus the steps the other
    threads were in the middle of when the 50th ended (each thread reserves its step first)."""
    cfg = compose_config(["ps=local", "model=ctr_dnn", "model.hidden=[8]", f"trainer.threads={threads}",
                          f"dataset.dir={tmp_path}", "dataset.generate.train_rows=20000",
                          "dataset.generate.test_rows=1000", "dataset.generate.vocab=100", "metrics=off"])
    job = build_job(cfg)
    for _ in range(3):
        counter = CountSteps()
        job.trainer.observers = [counter]
        stats = job.trainer.fit(job.data.train, 32, epochs=1, max_steps=50, progress=False)
        assert (stats.steps, counter.steps, stats.examples) == (50, 50, 50 * 32)


def test_max_steps_is_exact_from_the_command_line(tmp_path):
    """The command of issue 18 point 7: `python -m recps.train trainer.max_steps=50 trainer.threads=2
    ps=local` trained 51 steps (metrics.json's train_steps and train_examples)."""
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "recps.train", "trainer.max_steps=50", "trainer.threads=2", "ps=local",
         "model=ctr_dnn", "model.hidden=[8]", "trainer.batch_size=32", "metrics=off", "progress=false",
         "checkpoint.save=false", f"dataset.dir={tmp_path / 'data'}", "dataset.generate.train_rows=6000",
         "dataset.generate.test_rows=500", "dataset.generate.vocab=100", f"hydra.run.dir={run}"],
        cwd=PROJECT_ROOT, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert (metrics["train_steps"], metrics["train_examples"]) == (50, 50 * 32)


def ps_run(tmp_path, in_process_cluster, mode: str, *overrides: str) -> tuple[dict, int]:
    """One server and one worker (recps.cluster's processes, in this process): (metrics, steps seen)."""
    cfg = compose_config([f"ps={mode}", "cluster.workers=1", "model=ctr_dnn", "model.hidden=[8]",
                          "trainer.batch_size=32", "metrics=off", "progress=false", "checkpoint.save=false",
                          f"dataset.dir={tmp_path / 'data'}", "dataset.generate.train_rows=6000",
                          "dataset.generate.test_rows=500", "dataset.generate.vocab=100", *overrides])
    counter = CountSteps()
    out = tmp_path / "run"
    out.mkdir(parents=True)
    metrics = in_process_cluster(cfg, out, token=f"steps-{mode}", observers=[counter])
    return metrics, counter.steps


@pytest.mark.parametrize("mode,threads", [("async", 2), ("async", 3), ("geo", 2), ("sync", 2)])
def test_max_steps_is_exact_under_the_ps_modes(tmp_path, in_process_cluster, mode, threads):
    """The same count on a parameter server: max_steps over the worker's threads (sync: the threads
    take max_steps / threads steps each, every step waits for all of them)."""
    metrics, seen = ps_run(tmp_path, in_process_cluster, mode, f"trainer.threads={threads}", "trainer.max_steps=50")
    assert (metrics["train_steps"], seen, metrics["train_examples"]) == (50, 50, 50 * 32)


def test_sync_max_steps_is_exact_or_refused(tmp_path, in_process_cluster):
    # 6,000 rows, 2 threads of 94 batches an epoch: 250 steps need the second epoch.
    metrics, seen = ps_run(tmp_path, in_process_cluster, "sync", "trainer.threads=2", "trainer.epochs=2",
                           "trainer.max_steps=250")
    assert (metrics["train_steps"], seen) == (250, 250)
    with pytest.raises(ConfigError, match="trainer.max_steps=51"):
        ps_run(tmp_path / "odd", in_process_cluster, "sync", "trainer.threads=2", "trainer.max_steps=51")


class EveryN:
    """recps.trainer.Pauses every `n` steps (and one at `extra`, if given); records what it saw."""

    def __init__(self, n: int, limit: int, fail_at: int | None = None) -> None:
        self.n, self.limit, self.fail_at = n, limit, fail_at
        self.seen: list[tuple[int, list[tuple[int, int]]]] = []
        self.pausing = False

    def first(self):
        return self.n if self.n < self.limit else None

    def pause(self, steps, positions):
        self.pausing = True
        try:
            if steps == self.fail_at:
                raise RuntimeError(f"pause failed at {steps}")
            self.seen.append((steps, positions))
            time.sleep(0.02)  # a thread that does not wait would start a step now
        finally:
            self.pausing = False
        following = steps + self.n
        return following if following < self.limit else None


class NoStepDuringPause(TrainObserver):
    def __init__(self, pauses: EveryN) -> None:
        self.pauses, self.violations = pauses, 0

    def after_backward(self, thread) -> None:
        self.violations += self.pauses.pausing


def small_job(tmp_path, threads: int):
    cfg = compose_config(["ps=local", "model=ctr_dnn", "model.hidden=[8]", f"trainer.threads={threads}",
                          f"dataset.dir={tmp_path}", "dataset.generate.train_rows=6000",
                          "dataset.generate.test_rows=500", "dataset.generate.vocab=100", "metrics=off"])
    return build_job(cfg)


def thread_batches(job, threads: int) -> list[int]:
    """Batches per epoch of each thread's shard (every threads-th example, batches of 32)."""
    return [-(-len(range(t, len(job.data.train), threads)) // 32) for t in range(threads)]


@pytest.mark.parametrize("threads", [1, 3])
def test_pauses_stop_every_thread_at_exact_step_counts(tmp_path, threads):
    """Each pause runs once every thread stands between two steps, at exactly the step count asked
    for (over all threads), with where each thread stopped; no step runs during a pause."""
    job = small_job(tmp_path, threads)
    batches = thread_batches(job, threads)
    total = planned_steps(batches, 2)
    pauses = EveryN(25, total)
    guard = NoStepDuringPause(pauses)
    job.trainer.observers = [guard]
    stats = job.trainer.fit(job.data.train, 32, epochs=2, progress=False, pauses=pauses)
    assert stats.steps == total
    assert [s for s, _ in pauses.seen] == list(range(25, total, 25))
    for steps, positions in pauses.seen:  # every step counted in exactly one thread's position
        assert sum(e * batches[t] + n for t, (e, n) in enumerate(positions)) == steps
    assert guard.violations == 0


def test_a_pause_past_the_last_step_runs_at_the_end(tmp_path):
    """A pause the threads cannot reach (their batches run out first) runs when they stopped."""
    job = small_job(tmp_path, 2)
    pauses = EveryN(10_000, 10_001)  # one pause, at step 10,000 of a fit of fewer steps
    stats = job.trainer.fit(job.data.train, 32, epochs=1, progress=False, pauses=pauses)
    assert [s for s, _ in pauses.seen] == [stats.steps]
    assert sum(n for _, n in pauses.seen[0][1]) == stats.steps


def test_a_failing_pause_stops_training_with_its_error(tmp_path):
    job = small_job(tmp_path, 2)
    with pytest.raises(RuntimeError, match="pause failed at 20"):
        job.trainer.fit(job.data.train, 32, epochs=1, progress=False, pauses=EveryN(10, 60, fail_at=20))


def test_planned_steps_is_what_fit_takes(tmp_path):
    job = small_job(tmp_path, 2)
    batches = thread_batches(job, 2)
    for kwargs in ({"epochs": 2}, {"epochs": 1, "skip": [5, 9]}, {"epochs": 2, "thread_steps_per_epoch": 40},
                   {"epochs": 3, "max_steps": 77}):
        stats = job.trainer.fit(job.data.train, 32, progress=False, **kwargs)
        assert stats.steps == planned_steps(batches, kwargs["epochs"], kwargs.get("max_steps", -1),
                                            kwargs.get("thread_steps_per_epoch", -1), kwargs.get("skip")), kwargs
