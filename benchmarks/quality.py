"""Held-out AUC during training, and the time it takes to reach a target AUC.

    python -m recps.train model=ctr_dnn ps=local \\
        '++trainer.observers=[{_target_: benchmarks.quality.HeldOutAUC, every_steps: 40, path: /tmp/q.jsonl}]'

`HeldOutAUC` is a `recps.job.observer.TrainObserver` that `recps.job.build.build_job` builds from
`trainer.observers` (with `job=`), in every process that trains: ps=local, and each worker of a
PS cluster, where only worker `worker` (default 0) evaluates. Every `every_steps` global steps
the training thread that counts the step evaluates ITS replica of the model (the shared
embedding collection: local tables, the servers' rows (async, sync) or the GEO replica) on the
held-out split, under `torch.no_grad()` (so the PS collection pulls but never pushes), and
appends one JSON line:

    {"step", "examples", "wall_s", "eval_s", "train_s", "auc", "logloss", "best_reachable_auc"}

`train_s` = wall seconds since the fit started minus the seconds spent in evaluations: the
training clock that time-to-quality reads. An evaluation holds the observer's lock, which every
thread of the worker takes after each step, so the worker's other threads pause after the step
they are in (at most one step each overlaps an evaluation); other workers of a PS cluster keep
going (sync: they wait at the next step's barrier), so compare modes with one worker. The
held-out batches are read once, at the start of the fit.

`time_to_quality(records, target)` reads such a curve: the training seconds and examples at the
first evaluation whose AUC reaches `target` (None when none does).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from recps.errors import ConfigError
from recps.metrics import MetricCollection
from recps.job.observer import TrainObserver

__all__ = ["HeldOutAUC", "read_curve", "time_to_quality"]

log = logging.getLogger(__name__)


def _worker_index() -> int:
    """This process's worker index in a PS cluster (recps.launch's variables), 0 outside one."""
    from recps.ps.roles import INDEX_ENV, ROLE_ENV

    if os.environ.get(ROLE_ENV) == "worker":
        return int(os.environ.get(INDEX_ENV, "0"))
    return 0


class HeldOutAUC(TrainObserver):
    """AUC and logloss of the model on the held-out split every `every_steps` global steps.

    Args:
        job: the recps.job.build.Job (injected by build_job): task, collection and `data.test`.
        every_steps: evaluate when the fit's global step count reaches a multiple of this.
        path: JSON-lines file the records are appended to (the benchmark's, outside the checkout).
        rows: held-out rows evaluated (the first `rows` of the split; 0: all of it).
        batch_size: evaluation batch size.
        worker: the PS worker that evaluates (the others only count); 0 for ps=local.
        at_start: also evaluate the untrained model when the fit starts (step 0).
    """

    def __init__(self, job: Any, every_steps: int, path: str, rows: int = 0, batch_size: int = 4096,
                 worker: int = 0, at_start: bool = True) -> None:
        if int(every_steps) < 1:
            raise ConfigError(f"HeldOutAUC: every_steps={every_steps}; use a positive step count")
        self.job = job
        self.every_steps = int(every_steps)
        self.path = Path(path)
        self.rows = int(rows)
        self.batch_size = int(batch_size)
        self.active = _worker_index() == int(worker)
        self.at_start = bool(at_start)
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # one evaluation at a time; the counters below
        self._replicas: list[nn.Module] = []
        self._batches: list = []
        self._start = 0.0
        self._eval_s = 0.0
        self._examples = 0
        self._last_due = 0

    # ---- TrainObserver ----------------------------------------------------------------------

    def on_fit_start(self, replicas: Sequence[nn.Module]) -> None:
        self._replicas = list(replicas)
        if not self.active:
            return
        if not self._batches:
            self._batches = self._held_out()
        self._start = time.perf_counter()
        self._eval_s, self._examples, self._last_due = 0.0, 0, 0
        if self.at_start:
            with self._lock:
                self._evaluate(0, 0)

    def on_batch(self, thread: int, step: int, epoch: int, batch: Any, logits: torch.Tensor, loss: float) -> None:
        if not self.active:
            return
        with self._lock:
            self._examples += int(batch.batch_size)
            if step - self._last_due < self.every_steps:
                return
            self._last_due = step - step % self.every_steps
            self._evaluate(thread, step)

    def on_fit_end(self, failed: bool) -> None:
        if self.active and not failed and self._replicas:
            with self._lock:
                if self.records and self.records[-1]["examples"] < self._examples:
                    self._evaluate(0, -1)  # the model as the fit left it (step -1: after the last step)

    def close(self) -> None:
        """Nothing is held open (each record is appended as it is made)."""

    # ---- evaluation -------------------------------------------------------------------------

    def _held_out(self) -> list:
        batches, taken = [], 0
        for batch in self.job.data.test.batches(self.batch_size, 0, 1, 0):
            batches.append(batch)
            taken += batch.batch_size
            if 0 < self.rows <= taken:
                break
        if not batches:
            raise ConfigError("HeldOutAUC: the held-out split is empty; give dataset.test files or test_fraction > 0")
        return batches

    def _evaluate(self, thread: int, step: int) -> None:
        """Evaluates replica `thread` (hold self._lock); appends a record."""
        start = time.perf_counter()
        replica = self._replicas[thread]
        shared = {id(m) for m in self.job.collection.modules()}
        # eval() on this thread's own modules only: the collection is shared with the training threads.
        own = [m for m in replica.modules() if id(m) not in shared and m.training]
        for m in own:
            m.training = False
        metrics = MetricCollection(["auc", "logloss"])
        try:
            with torch.no_grad():
                for batch in self._batches:
                    logits = self.job.task.forward(replica, batch)  # (B,)
                    metrics.update(self.job.task.predict(logits), self.job.task.target(batch))
        finally:
            for m in own:
                m.training = True
        values = {k: float(v) for k, v in metrics.compute().items()}
        now = time.perf_counter()
        self._eval_s += now - start
        wall = start - self._start
        record = {"step": step, "examples": self._examples, "wall_s": round(wall, 3),
                  "eval_s": round(self._eval_s, 3), "train_s": round(wall - (self._eval_s - (now - start)), 3),
                  "auc": round(values["auc"], 5), "logloss": round(values["logloss"], 5),
                  "best_reachable_auc": self.job.data.best_auc}
        self.records.append(record)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def read_curve(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records a HeldOutAUC wrote to `path`, in order ([] if it wrote none)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def time_to_quality(records: Sequence[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """{train_s, wall_s, examples, step, auc} of the first record with auc >= target; None if none.

    >>> time_to_quality([{"auc": 0.6, "train_s": 1.0}, {"auc": 0.71, "train_s": 2.5, "wall_s": 2.6,
    ...                   "examples": 512, "step": 10}], 0.7)["train_s"]
    2.5
    >>> time_to_quality([{"auc": 0.6, "train_s": 1.0}], 0.7) is None
    True
    """
    for r in records:
        if r["auc"] is not None and r["auc"] >= target:
            return {k: r.get(k) for k in ("train_s", "wall_s", "examples", "step", "auc")}
    return None
