"""The training loop's own contract: step counts over Hogwild threads."""

from __future__ import annotations

import threading

import pytest

from recps.config import compose_config
from recps.observer import TrainObserver
from recps.run import build_job


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
