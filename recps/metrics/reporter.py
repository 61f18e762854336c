"""Periodic global metrics during training: every N steps and at the end of every pass.

    training thread t ─► keeps each batch and its logits; every 32 batches it
                         updates its own MetricCollection of the pass at once (one lock per
                         thread, contended only by reports): 0.26 ms CPU per step all told
                         with the default metrics (benchmarks/metrics_overhead.py)
    a report          ─► the sum over this worker's threads
                      ─► merger: sum over workers (LocalMerger | GlooMerger | PSMerger)
                      ─► rank 0: a log line, <out_dir>/train_metrics.jsonl, `reports`
                         (run_training puts them in metrics.json), TensorBoard scalars

Grouped metrics (gauc, pnr) take each example's group from the batch's sparse feature
``group_key`` (the user or query id; ``recps.metrics.groups``) and keep the pass's
(group, pred, label) columns; a merge concatenates every worker's (through the servers:
``recps.metrics.ps_merger``; over gloo: ``recps.metrics.distributed``), so the global value
is exactly the one process's value on the union.

What a report covers: the current pass so far ("pass-to-date", as Paddle's global AUC).
A step report at global step s holds every example of its pass's steps up to s, and those of
any later step a thread had handed over when it ran (with threads=1: exactly the pass's steps
up to s); a pass report holds the whole pass, after which its states are dropped. Values are
those of ``recps.metrics`` (NaN, written as null in JSON, where undefined: one class seen so
far). A report of zero examples (every worker's) is not written.

Step reports fall on global steps that are multiples of ``every_steps``: a run resumed at step
392 with every_steps=100 reports at 400 (the 8 steps of its pass so far), 500, ... as the run it
continues would have. A thread counts its step under the trainer's lock but hands the batch over
after it, so step s+1 may arrive before step s: the thread whose batch completes the fit's steps
up to s (none of them missing any more) makes every report due up to s, in order, so each worker
makes the same sequence of reports however its threads interleave. The pass a step report covers
is the oldest pass a thread is still in; a thread that ended a pass is in the next one.

Across workers every report is a collective (all workers take part, in the same order).
Workers rarely take the same number of steps (uneven shards, async mode), so each report
is one *round*: a small header (elementwise minimum over workers) and then the summed
state. A worker whose training ended keeps answering the others' step rounds with its
states until every worker has ended; then all report the passes of the fit, in order.
With several workers, pass reports therefore come at the end of ``Trainer.fit`` (once
per epoch of the fit); with one worker, as soon as every thread finished the pass.
Header: ``[ended, pass of the step round (or BIG), -last pass touched, first pass touched]``.

    >>> import torch
    >>> from recps.tasks import BinaryTask
    >>> rep = MetricsReporter(["auc", "logloss"], BinaryTask(), threads=1, every_steps=2)
    >>> from types import SimpleNamespace as Batch
    >>> batch = Batch(labels=torch.tensor([[1.0], [0.0]]))
    >>> for step in (1, 2):
    ...     rep.on_batch(0, step, 0, batch, torch.tensor([1.0, -1.0]), 0.3)
    >>> rep.on_fit_end(failed=False)
    >>> [(r["kind"], r["step"], r["examples"], r["auc"]) for r in rep.reports]
    [('step', 2, 4, 1.0), ('pass', 2, 4, 1.0)]
"""

from __future__ import annotations

import json
import logging
import math
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import Tensor

from recps.errors import ConfigError, DataError
from recps.targets import check_target_args
from recps.metrics.base import Metric, State, prepare_pointwise
from recps.metrics.collection import MetricCollection, build_metric
from recps.metrics.distributed import allreduce_metrics
from recps.metrics.groups import batch_groups, check_group_key, feed_columns
from recps.job.observer import TrainObserver
from recps.metrics.ps_merger import PSMerger

__all__ = [
    "ExampleCount",
    "MetricMerger",
    "LocalMerger",
    "GlooMerger",
    "MetricsReporter",
    "build_merger",
    "build_reporter",
    "check_metrics_config",
]

log = logging.getLogger(__name__)

# Header entries no real pass index reaches ("no step round", "no pass touched").
_BIG = 2**62


class ExampleCount(Metric):
    """How many examples were seen (state ``count`` (), float64): the size of each report."""

    default_name = "examples"
    needs_probs = False
    needs_unit_labels = False

    def _zero_state(self) -> State:
        return {"count": torch.zeros((), dtype=torch.float64)}

    def _update(self, p: Tensor, y: Tensor, g: Tensor | None) -> None:
        self._state["count"] += p.numel()

    def compute(self) -> float:
        return float(self._state["count"])


class MetricMerger(Protocol):
    """Sums states over the workers of a job. Both verbs are collectives: every worker calls
    them in the same order; each wait is bounded (the group's or the client's timeout)."""

    rank: int
    world_size: int

    def all_min(self, values: Tensor) -> Tensor:
        """(K,) int64 -> (K,) int64: the elementwise minimum over the workers."""
        ...

    def merge(self, collection: MetricCollection) -> MetricCollection:
        """The sum of every worker's `collection` (it may be returned itself, or changed: the
        reporter passes a collection it built for this call)."""
        ...


class LocalMerger:
    """One worker: nothing to exchange."""

    rank = 0
    world_size = 1

    def all_min(self, values: Tensor) -> Tensor:
        return values.clone()

    def merge(self, collection: MetricCollection) -> MetricCollection:
        return collection  # the sum over one worker (no copy: 16 MiB with the default AUC)


class GlooMerger:
    """Over a torch.distributed group (gloo on CPU): one small all_reduce(MIN) for the header,
    one all_reduce(SUM) of ``flatten()`` for the states (``allreduce_metrics``).

    Args:
        group: the process group (None: the default group, which must be initialized).
    """

    def __init__(self, group: Any = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "metrics.merge=gloo: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group('gloo', ...) first, or use merge=local"
            )
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_min(self, values: Tensor) -> Tensor:
        buf = values.detach().to("cpu", torch.int64).clone()  # (K,)
        self._dist.all_reduce(buf, op=self._dist.ReduceOp.MIN, group=self.group)
        return buf

    def merge(self, collection: MetricCollection) -> MetricCollection:
        return allreduce_metrics(collection, self.group)


def build_merger(kind: str = "auto", *, client: Any = None, group: Any = None) -> MetricMerger:
    """The merger `metrics.merge` names.

    kind: "local" (one worker), "gloo" (torch.distributed group `group`), "ps" (the parameter
    servers through PSClient `client`, see ``recps.metrics.ps_merger``), or "auto": gloo if
    torch.distributed is initialized, else ps if a client is given, else local.
    """
    if kind == "auto":
        if dist.is_available() and dist.is_initialized():
            kind = "gloo"
        elif client is not None and getattr(client, "num_workers", 1) > 1:
            kind = "ps"
        else:
            kind = "local"
    if kind == "local":
        return LocalMerger()
    if kind == "gloo":
        return GlooMerger(group)
    if kind == "ps":
        if client is None:
            raise ConfigError("metrics.merge=ps needs a parameter-server client; this run has none (use ps=sync|async|geo or merge=local)")
        return PSMerger(client)
    raise ConfigError(f"metrics.merge={kind!r}; use auto, local, gloo or ps")


def _specs(metrics: Iterable[str] | Mapping[str, Mapping[str, Any] | None]) -> list[tuple[str, dict[str, Any]]]:
    """Metric names (or name -> kwargs) as [(name, kwargs)], as MetricCollection takes them."""
    if isinstance(metrics, str):
        raise ConfigError(f"metrics.metrics={metrics!r} is a string; write a list, e.g. [{metrics}]")
    if isinstance(metrics, Mapping):
        return [(str(k), dict(v or {})) for k, v in metrics.items()]
    specs = [(str(m), {}) for m in metrics]
    if not specs:
        raise ConfigError("metrics.metrics is empty; name at least one, e.g. [auc, logloss]")
    return specs


def _json_value(v: float) -> float | None:
    return None if isinstance(v, float) and not math.isfinite(v) else v


class MetricsReporter(TrainObserver):
    """Global training metrics every `every_steps` steps and each pass (see the module docstring).

    Args:
        metrics: pointwise metric names or a mapping name -> kwargs (as ``MetricCollection``),
            e.g. ``[auc, logloss, accuracy, copc, gauc, pnr]``; the grouped ones (gauc, pnr)
            need ``group_key``.
        group_key: the sparse feature whose key is each example's group (user or query id)
            for gauc / pnr, e.g. ``user`` (``C1`` on the synthetic data); it must hold one key
            per example. Examples without a key there are left out of gauc / pnr (not of the
            other metrics). None: no grouped metrics.
        task: converts logits to probs and gives the targets (``predict``, ``target``); a task
            with ``task_names`` (MultiTask: (B, T) probs and targets) gets every metric per
            task, reported as ``<metric>/<task>`` as evaluation names them.
        threads: the trainer's thread count.
        every_steps: report every this many global steps (0: pass reports only).
        out_dir: the run's folder: ``train_metrics.jsonl`` and ``tensorboard/`` go there
            (rank 0 only; None writes no files).
        tensorboard: also write TensorBoard event files (needs ``pip install tensorboard``).
        merger: sums over workers (default: one worker).
        step_base: global step of the first step of the next fit (resumed runs); it grows
            by the steps of each fit.
        device: where the states live.
        update_every: a thread keeps this many batches (and their logits) before it updates
            its metrics with them at once (reports flush every stash first).

    Attributes:
        reports: every report made so far, dicts ``{kind, step, pass, examples, <metric>...}``.
    """

    def __init__(
        self,
        metrics: Iterable[str] | Mapping[str, Mapping[str, Any] | None],
        task: Any,
        threads: int = 1,
        every_steps: int = 0,
        out_dir: str | Path | None = None,
        tensorboard: bool = False,
        merger: MetricMerger | None = None,
        step_base: int = 0,
        device: str | torch.device = "cpu",
        update_every: int = 32,
        group_key: str | None = None,
    ) -> None:
        if int(every_steps) < 0:
            raise ConfigError(f"metrics.every_steps={every_steps}; use 0 (pass reports only) or a positive step count")
        if int(threads) < 1:
            raise ConfigError(f"MetricsReporter: threads={threads}; set it to the trainer's thread count (>= 1)")
        specs = _specs(metrics)
        # Multi-task: one set of metrics per task column, named <metric>/<task> as evaluation does.
        self.task_names = [str(n) for n in (getattr(task, "task_names", None) or ())]
        if self.task_names:
            members = [build_metric(spec, **{**kw, "name": f"{spec}/{t}", "device": device})
                       for t in self.task_names for spec, kw in specs]
            self._columns = [[m.name for m in members[j * len(specs):(j + 1) * len(specs)]]
                             for j in range(len(self.task_names))]
        else:
            members = [build_metric(spec, **{**kw, "device": device}) for spec, kw in specs]
            self._columns = []
        template = MetricCollection(members, device=device)
        if template.kind != "pointwise":
            raise ConfigError(
                f"metrics.metrics={[spec for spec, _ in specs]}: training metrics are pointwise "
                f"(auc, logloss, accuracy, mae, rmse, actual_ctr, predicted_ctr, copc, calibration, gauc, pnr); "
                f"compute recall@K / ndcg@K in evaluation"
            )
        self._grouped = [n for n in template if not template[n].additive]
        self.group_key = None if group_key is None else str(group_key)
        check_group_key(self.group_key, None, self._grouped)
        if any(spec == "examples" for spec, _ in specs):
            raise ConfigError("metrics.metrics names 'examples'; every report carries the example count already, drop it")
        self._template = MetricCollection([*(template[n] for n in template), ExampleCount(device=device)], device=device)
        self.task = task
        self.threads = int(threads)
        self.every_steps = int(every_steps)
        self.merger: MetricMerger = merger or LocalMerger()
        self.step_base = int(step_base)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.reports: list[dict[str, Any]] = []
        self._writes = self.out_dir is not None and self.merger.rank == 0
        self._tb = None
        if tensorboard:
            _check_tensorboard()
            if self._writes:
                from torch.utils.tensorboard import SummaryWriter  # deferred: tensorboard is optional, asked for

                self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))
        # Per thread: pass -> collection, under the thread's lock. Passes every local thread
        # finished are folded into `_finished` (one collection per pass).
        self.update_every = int(update_every)
        if self.update_every < 1:
            raise ConfigError(f"MetricsReporter: update_every={update_every}; use 1 or more batches")
        self._stash: list[list[tuple[int, Tensor, Any]]] = [[] for _ in range(self.threads)]
        self._parts: list[dict[int, MetricCollection]] = [{} for _ in range(self.threads)]
        self._locks = [threading.Lock() for _ in range(self.threads)]
        self._finished: dict[int, MetricCollection] = {}
        self._state_lock = threading.Lock()  # _finished, _ended
        self._steps_lock = threading.Lock()  # _fit_steps, _complete, _early (taken every step: never held long)
        self._report_lock = threading.Lock()  # one round at a time, in order
        self._ended: dict[int, set[int]] = {}
        self._thread_pass: list[int | None] = [None] * self.threads
        self._last_due = self._last_multiple(self.step_base)
        self._fit_steps = 0
        self._complete = 0  # steps 1.._complete of this fit all handed over (under _steps_lock)
        self._early: set[int] = set()  # steps handed over after _complete + 1 (under _steps_lock)

    # ---- TrainObserver -------------------------------------------------------------------------

    def on_fit_start(self, replicas: Sequence[torch.nn.Module]) -> None:
        if len(replicas) != self.threads:
            raise ConfigError(f"MetricsReporter was built for {self.threads} threads, the trainer runs {len(replicas)}")
        self._fit_steps = 0
        self._complete, self._early = 0, set()
        self._thread_pass = [None] * self.threads
        self._last_due = max(self._last_due, self._last_multiple(self.step_base))

    def _last_multiple(self, step: int) -> int:
        """The last step report's step due at or before global step `step` (a multiple of every_steps)."""
        return step - step % self.every_steps if self.every_steps else step

    def on_batch(self, thread: int, step: int, epoch: int, batch: Any, logits: Tensor, loss: float) -> None:
        # Stash, update later: one tensor op here (detach: holding the graph could hold what
        # autograd functions keep) where ~30 small ones, each a GIL hand-off between the Hogwild
        # threads, would cost more than their arithmetic. Flushed every `update_every` batches
        # and before any report, so what a report covers is the same. The batch is kept by
        # reference: readers hand out fresh tensors per batch.
        entry = (epoch, logits.detach(), batch)
        with self._locks[thread]:
            stash = self._stash[thread]
            stash.append(entry)
            if len(stash) >= self.update_every:
                self._flush_locked(thread)
        self._thread_pass[thread] = epoch
        with self._steps_lock:
            self._fit_steps = max(self._fit_steps, step)
            self._early.add(step)
            while self._complete + 1 in self._early:  # (a handful: as many as steps in flight)
                self._complete += 1
                self._early.discard(self._complete)
            complete = self._complete
        if self.every_steps and (self.step_base + complete) - self._last_due >= self.every_steps:
            self._step_reports(self.step_base + complete)

    def on_epoch_end(self, thread: int, epoch: int) -> None:
        with self._locks[thread]:
            self._flush_locked(thread)
        # Its next pass: a step report made by another thread before this one's next batch must not
        # cover `epoch`, whose states the pass report below may drop.
        self._thread_pass[thread] = epoch + 1
        with self._state_lock:
            done = self._ended.setdefault(epoch, set())
            done.add(thread)
            complete = len(done) == self.threads
            if complete:
                del self._ended[epoch]
        if not complete:
            return
        if self.merger.world_size == 1:  # nobody to keep in step with: report now
            with self._report_lock:
                self._pass_report(epoch, self.step_base + self._fit_steps)
        else:
            self._fold(epoch)  # reported at the end of the fit; one collection until then

    def on_fit_end(self, failed: bool) -> None:
        step = self.step_base + self._fit_steps
        self.step_base = step
        if failed:  # another worker may never reach a collective: write what we have and stop
            self._flush_tb()
            return
        with self._report_lock:
            self._flush_all()
            first, last = self._end_rounds()
            for epoch in range(first, last + 1):
                self._pass_report(epoch, step)
        self._ended.clear()
        self._flush_tb()

    # ---- rounds ------------------------------------------------------------------------------

    def _step_reports(self, step: int) -> None:
        """Makes every step report due up to `step`, in order (called by the thread whose batch
        completed steps 1..`step`)."""
        with self._report_lock:
            while step - self._last_due >= self.every_steps:
                due = (self._last_due // self.every_steps + 1) * self.every_steps
                self._last_due = due
                self._flush_all()
                current = [p for p in self._thread_pass if p is not None]
                epoch = min(current) if current else 0
                header = self.merger.all_min(torch.tensor([0, epoch, *self._touched()], dtype=torch.int64))
                epoch = int(header[1])  # the oldest pass any worker is in
                merged = self.merger.merge(self._local(epoch))
                self._record("step", due, epoch, merged)

    def _end_rounds(self) -> tuple[int, int]:
        """Answers other workers' step rounds until every worker ended; the fit's pass range."""
        while True:
            header = self.merger.all_min(torch.tensor([1, _BIG, *self._touched()], dtype=torch.int64))
            if int(header[0]) == 1:
                return int(header[3]), -int(header[2])
            self.merger.merge(self._local(int(header[1])))  # our share of their step report

    def _flush_locked(self, thread: int) -> None:
        """Updates thread `thread`'s collections with its stashed batches; hold its lock."""
        stash = self._stash[thread]
        if not stash:
            return
        parts = self._parts[thread]
        with torch.no_grad():
            for epoch in sorted({e for e, _, _ in stash}):
                # predict per batch: a retrieval task's logits (B, 1 + negatives) vary in width
                probs = torch.cat([self.task.predict(lg) for e, lg, _ in stash if e == epoch])  # (N,)
                target = torch.cat([self.task.target(b) for e, _, b in stash if e == epoch])  # (N,)
                groups = None
                if self._grouped:  # (N,) int64 ids, (N,) bool: has one
                    ids, has = zip(*(batch_groups(b, self.group_key) for e, _, b in stash if e == epoch))
                    groups = (torch.cat(ids), torch.cat(has))
                part = parts.get(epoch)
                if part is None:
                    part = parts[epoch] = self._template.clone()  # zeros: the template is never updated
                self._update(part, probs, target, groups)
        stash.clear()

    def _update(self, part: MetricCollection, probs: Tensor, target: Tensor,
                groups: tuple[Tensor, Tensor] | None = None) -> None:
        """probs, target (N,) or, for a multi-task task, (N, T): each column feeds its task's metrics;
        groups: (ids (N,) int64, has (N,) bool) when there are grouped metrics."""
        if not self._columns:
            if probs.dim() > 1 and probs.shape[1:].numel() > 1:
                raise DataError(
                    f"training metrics: {type(self.task).__name__}.predict gives {tuple(probs.shape)} per batch, "
                    f"not one probability per example; ranking and retrieval tasks report in evaluation: "
                    f"set metrics=off"
                )
            if groups is None:
                part.update(probs, target)
            else:
                members = [part[n] for n in part]
                p, y, g = prepare_pointwise(
                    probs, target, groups[0], who="training metrics", device=part.device,
                    needs_probs=any(m.needs_probs for m in members),
                    needs_unit_labels=any(m.needs_unit_labels for m in members),
                )
                feed_columns(members, p, y, g, groups[1].to(p.device))
            return
        if probs.dim() != 2 or probs.shape[1] != len(self._columns) or target.shape != probs.shape:
            raise DataError(
                f"training metrics: tasks {self.task_names} need probs and targets of shape (N, {len(self._columns)}); "
                f"{type(self.task).__name__} gave {tuple(probs.shape)} and {tuple(target.shape)}"
            )
        part["examples"].update(probs[:, 0], target[:, 0])
        for j, names in enumerate(self._columns):
            members = [part[n] for n in names]
            p, y, g = prepare_pointwise(
                probs[:, j], target[:, j], None if groups is None else groups[0], who=f"task {self.task_names[j]}",
                device=part.device, needs_probs=any(m.needs_probs for m in members),
                needs_unit_labels=any(m.needs_unit_labels for m in members),
            )
            feed_columns(members, p, y, g, None if groups is None else groups[1].to(p.device))

    def _flush_all(self) -> None:
        for t in range(self.threads):
            with self._locks[t]:
                self._flush_locked(t)

    def _touched(self) -> list[int]:
        """[-last pass, first pass] with data on this worker; [BIG, BIG] (neutral for a minimum) if none."""
        with self._state_lock:
            passes = set(self._finished)
        for t in range(self.threads):
            with self._locks[t]:
                passes.update(self._parts[t])
        if not passes:
            return [_BIG, _BIG]  # neutral for both minima: last = -BIG, first = BIG
        return [-max(passes), min(passes)]

    def _local(self, epoch: int) -> MetricCollection:
        """A new collection: this worker's state of pass `epoch` (finished part + every thread's)."""
        out: MetricCollection | None = None
        with self._state_lock:
            finished = self._finished.get(epoch)
            if finished is not None:
                out = finished.clone()
        for t in range(self.threads):
            with self._locks[t]:
                part = self._parts[t].get(epoch)
                if part is not None:
                    if out is None:
                        out = part.clone()  # one copy, then adds: a report reads each state once
                    else:
                        out.merge(part)
        return out if out is not None else self._template.clone()

    def _fold(self, epoch: int) -> None:
        """Adds the threads' parts of `epoch` into its one finished collection (frees memory)."""
        with self._state_lock:  # held while adding, so a concurrent report sees all or nothing moved
            parts = [self._finished[epoch]] if epoch in self._finished else []
            for t in range(self.threads):
                with self._locks[t]:
                    part = self._parts[t].pop(epoch, None)
                if part is not None:
                    parts.append(part)
            if parts:
                for part in parts[1:]:
                    parts[0].merge(part)
                self._finished[epoch] = parts[0]

    def _pass_report(self, epoch: int, step: int) -> None:
        self._fold(epoch)
        with self._state_lock:
            local = self._finished.pop(epoch, None)
        merged = self.merger.merge(local if local is not None else self._template.clone())
        self._record("pass", step, epoch, merged)

    # ---- output ------------------------------------------------------------------------------

    def _record(self, kind: str, step: int, epoch: int, merged: MetricCollection) -> None:
        values = merged.compute()
        examples = int(values.pop("examples"))
        if examples == 0:  # every worker's merged count: all of them skip it (a pass with no data)
            log.debug("[worker %d] %s report, step %d, pass %d: no examples, not written", self.merger.rank, kind, step, epoch)
            return
        record: dict[str, Any] = {"kind": kind, "step": int(step), "pass": int(epoch), "examples": examples}
        record.update({k: _json_value(float(v)) for k, v in values.items()})
        self.reports.append(record)
        if self.merger.rank != 0:  # every worker gets the global values; rank 0 tells
            return
        text = " ".join(f"{k}={v:.6g}" for k, v in values.items())
        log.info("[worker %d] %s metrics, step %d, pass %d, %d examples: %s",
                 self.merger.rank, kind, step, epoch, examples, text)
        if self._writes:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / "train_metrics.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
        if self._tb is not None:
            tag, x = ("train", step) if kind == "step" else ("pass", epoch)
            for name, value in values.items():
                self._tb.add_scalar(f"{tag}/{name}", value, x)
            self._tb.add_scalar(f"{tag}/examples", examples, x)
            self._tb.flush()

    def _flush_tb(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Closes the TensorBoard writer (idempotent)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None


# conf/metrics keys the engine reads itself, and the arguments it passes.
_ENGINE_KEYS = ("enabled", "merge")
_INJECTED = ("task", "threads", "out_dir", "merger", "step_base", "device")


def check_metrics_config(cfg: Any) -> None:
    """Binds conf/metrics to MetricsReporter's signature (a ConfigError names unknown keys)
    and checks what can be checked before data is read: metric names, tensorboard, a
    group_key for gauc / pnr."""
    if cfg is None or not bool(cfg.get("enabled", True)):
        return
    check_target_args(cfg, "metrics", injected=_INJECTED, engine_keys=_ENGINE_KEYS)
    if str(cfg.get("merge", "auto")) not in ("auto", "local", "gloo", "ps"):
        raise ConfigError(f"metrics.merge={cfg.get('merge')!r}; use auto, local, gloo or ps")
    if bool(cfg.get("tensorboard", False)):
        _check_tensorboard()
    grouped = [name for name, _ in _specs(cfg.get("metrics"))
               if not build_metric(name).additive] if cfg.get("metrics") else []
    check_group_key(cfg.get("group_key"), None, grouped)


def build_reporter(cfg: Any, *, task: Any, threads: int, out_dir: str | Path | None, merger: MetricMerger | None = None,
                   client: Any = None, step_base: int = 0, device: str | torch.device = "cpu",
                   feature_names: Sequence[str] | None = None) -> MetricsReporter | None:
    """The reporter conf/metrics asks for, or None when ``metrics.enabled`` is false.

    ``feature_names``: the data's sparse features; with gauc/pnr, ``metrics.group_key`` must be
    one of them (checked here, before training, when given).

    ``merger`` defaults to ``build_merger(cfg.merge, client=client)``: pass the worker's
    PSClient (ps modes) or initialize torch.distributed first for a cross-worker sum.
    """
    if cfg is None or not bool(cfg.get("enabled", True)):
        return None
    check_metrics_config(cfg)
    values = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)  # a node, or plain values (recps.job.settings)
    kwargs = {k: v for k, v in values.items() if not str(k).startswith("_") and k not in _ENGINE_KEYS}
    grouped = [name for name, _ in _specs(kwargs.get("metrics") or [])
               if not build_metric(name).additive]
    check_group_key(kwargs.get("group_key"), feature_names, grouped)
    if merger is None:
        merger = build_merger(str(values.get("merge", "auto")), client=client)
    return MetricsReporter(task=task, threads=threads, out_dir=out_dir, merger=merger, step_base=step_base,
                           device=device, **kwargs)


def _check_tensorboard() -> None:
    try:
        import tensorboard  # noqa: F401  deferred: an optional package, checked when asked for (SummaryWriter needs it)
    except ImportError as exc:
        raise ConfigError(
            "metrics.tensorboard=true needs the tensorboard package, which is not installed: "
            "pip install tensorboard (or set metrics.tensorboard=false)"
        ) from exc
