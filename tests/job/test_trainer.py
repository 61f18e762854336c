"""The training loop's own contract: step counts over Hogwild threads."""

from __future__ import annotations

import threading
import time

import pytest

from recps.config import compose_config
from recps.errors import ConfigError
from recps.job.observer import TrainObserver
from recps.job.build import build_job
from recps.job.loop import planned_steps
from tests.helpers.cli import recps_train


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


@pytest.mark.e2e
def test_max_steps_is_exact_from_the_command_line(tmp_path):
    """The command of issue 18 point 7: `python -m recps.train trainer.max_steps=50 trainer.threads=2
    ps=local` trained 51 steps (metrics.json's train_steps and train_examples)."""
    run = tmp_path / "run"
    metrics = recps_train(
        "trainer.max_steps=50", "trainer.threads=2", "ps=local",
        "model=ctr_dnn", "model.hidden=[8]", "trainer.batch_size=32", "metrics=off", "progress=false",
        "checkpoint.save=false", f"dataset.dir={tmp_path / 'data'}", "dataset.generate.train_rows=6000",
        "dataset.generate.test_rows=500", "dataset.generate.vocab=100", f"hydra.run.dir={run}", timeout=300).metrics()
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
    """recps.job.loop.Pauses every `n` steps (and one at `extra`, if given); records what it saw."""

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


class FusedFlags(TrainObserver):
    """What the dense optimizer's step is set to, and what a checkpoint would record, mid-fit."""

    def __init__(self, optimizer) -> None:
        self.optimizer, self.seen = optimizer, set()

    def after_backward(self, thread) -> None:
        self.seen.add((self.optimizer.param_groups[0]["fused"],
                       self.optimizer.state_dict()["param_groups"][0]["fused"]))


@pytest.mark.parametrize("threads", [1, 2])
def test_hogwild_threads_take_the_fused_dense_step_and_one_thread_the_users(tmp_path, monkeypatch, threads):
    """With several threads the Adam step is torch's fused kernel (the updater's lock is held for
    less); one thread keeps the user's step (its runs stay bit for bit what they were); either way a
    checkpoint records the user's setting and the fit leaves it as it found it."""
    import torch

    calls = []
    fused_adam = torch._fused_adam_
    monkeypatch.setattr(torch, "_fused_adam_", lambda *a, **k: calls.append(1) or fused_adam(*a, **k))
    job = small_job(tmp_path, threads)
    flags = FusedFlags(job.optimizer)
    job.trainer.observers = [flags]
    stats = job.trainer.fit(job.data.train, 32, epochs=1, max_steps=20, progress=False)
    assert stats.steps == 20
    assert flags.seen == ({(True, None)} if threads > 1 else {(None, None)})
    assert len(calls) == (20 if threads > 1 else 0)
    assert job.optimizer.param_groups[0]["fused"] is None


def test_fused_dense_steps_only_where_the_user_left_the_choice_open():
    import torch
    from torch import nn

    from recps.job.loop import LocalDenseUpdater, fused_dense_steps

    class MyAdam(torch.optim.Adam):
        pass

    def flags(make):
        p = nn.Parameter(torch.ones(3))
        opt = make([p])
        with fused_dense_steps(LocalDenseUpdater([p], opt)):
            return opt.param_groups[0].get("fused")

    assert flags(lambda ps: torch.optim.Adam(ps)) is True
    assert flags(lambda ps: torch.optim.Adagrad(ps)) is True
    assert flags(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)) is True
    assert flags(lambda ps: torch.optim.Adam(ps, fused=False)) is False  # the user's choice
    assert flags(lambda ps: torch.optim.Adam(ps, foreach=True)) is None  # foreach and fused exclude each other
    assert flags(lambda ps: MyAdam(ps)) is None  # a subclass may step otherwise
    assert flags(lambda ps: torch.optim.RMSprop(ps)) is None  # no fused step


@pytest.mark.parametrize("name", ["Adam", "AdamW", "Adagrad", "SGD"])
def test_the_fused_dense_step_is_the_same_rule(name):
    """Ten steps of the fused kernel land within float rounding of torch's loop."""
    import torch
    from torch import nn

    from recps.job.loop import LocalDenseUpdater, fused_dense_steps

    g = torch.Generator().manual_seed(0)
    start = [torch.randn(64, 33, generator=g), torch.randn(64, generator=g)]
    grads = [[torch.randn_like(t) for t in start] for _ in range(10)]
    kwargs = {"SGD": {"lr": 0.1, "momentum": 0.9}}.get(name, {"lr": 0.01})
    results = []
    for fused in (False, True):
        params = [nn.Parameter(t.clone()) for t in start]
        updater = LocalDenseUpdater(params, getattr(torch.optim, name)(params, **kwargs))
        with fused_dense_steps(updater, enabled=fused):
            for step in grads:
                updater.apply([t.clone() for t in step])
        results.append(torch.cat([p.detach().flatten() for p in params]))
    assert (results[0] - torch.cat([t.flatten() for t in start])).abs().max() > 1e-3  # the steps moved them
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)
