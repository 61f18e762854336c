"""Running a built job: the fit with its observers, the evaluation, the metrics every body reports.

    train(job, out_dir, fit, client=, rank=)   one fit of the loop (recps.job.loop.Trainer.fit) with the
                                               training observers job.settings asks for attached (global
                                               metrics, the debug dump) and closed after it
    evaluate(job)                              the task's metrics on the held-out split
    run_local(job, out_dir)                    a local run: resume, train, evaluate, checkpoint
    base_metrics(job, stats)                   the metrics.json fields every trained job writes

The hooks of a body are the loop's (recps.job.loop): `Fit` (which batches, how many epochs and steps,
where a resume starts, pauses for mid-run checkpoints), the trainer's updater and prefetch (a PS
worker's communicator), its `on_step` (a worker's progress line) and observers.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from recps.debug.dump import build_dump
from recps.job.checkpoint import load_checkpoint, save_checkpoint
from recps.job.loop import Pauses, TrainStats
from recps.metrics.groups import evaluate_pointwise
from recps.metrics.reporter import MetricsReporter, build_reporter

if TYPE_CHECKING:
    from recps.job.parts import Job

__all__ = ["Fit", "train", "evaluate", "training_observers", "run_local", "base_metrics"]

log = logging.getLogger("recps.run")  # the name its log lines had (recps/run.py)


@dataclass
class Fit:
    """One fit of a job: `source` (a BatchSource: the data set, a worker's shards, a pass), `epochs`
    passes or `max_steps` steps over all threads; a resume's `first_epoch` and per-thread `skip`;
    sync's equal steps per thread (`thread_steps_per_epoch`); `pauses` (mid-run checkpoints)."""

    source: Any
    epochs: int
    max_steps: int = -1
    first_epoch: int = 0
    skip: Sequence[int] | None = None
    thread_steps_per_epoch: int = -1
    pauses: Pauses | None = None
    progress: bool = False


@dataclass
class Trained:
    stats: TrainStats
    reports: list | None  # the metrics reporter's (None: metrics off)
    cpu_seconds: float


def evaluate(job: Job) -> dict[str, float]:
    """The task's metrics on the held-out split (a task may evaluate itself: ranking, retrieval)."""
    # gauc / pnr among task.metrics group by metrics.group_key (recps.metrics.groups)
    group_key = job.settings.group_key
    batch_size = job.settings.trainer.eval_batch_size
    if hasattr(job.task, "evaluate"):
        grouping = {"group_key": group_key} if getattr(job.task, "evaluates_groups", False) else {}
        return job.task.evaluate(job.model, job.data.test, batch_size, **grouping)
    probs, targets = job.trainer.predict(job.data.test, batch_size)
    return evaluate_pointwise(list(job.task.metrics), probs, targets, job.data.test, batch_size, group_key=group_key)


@contextmanager
def training_observers(job: Job, out_dir: Path, *, client: Any = None, rank: int = 0) -> Iterator[MetricsReporter | None]:
    """Attaches the training observers job.settings asks for to job.trainer for the block: global
    metrics every N steps and each pass (conf/metrics) and the debug dump (conf/debug, off by
    default); closes and detaches them after it. Yields the reporter (None when metrics are off).

    client: a PS worker's PSClient (metrics merge over the workers through the servers).
    rank: the worker's index: its dump files carry it; only rank 0 writes metric files."""
    settings = job.settings
    reporter = build_reporter(settings.metrics, task=job.task, threads=settings.trainer.threads,
                              out_dir=out_dir if rank == 0 else None, client=client, step_base=job.steps_done,
                              device=settings.device,
                              feature_names=getattr(getattr(job.data, "schema", None), "feature_names", None))
    dump = build_dump(settings.debug, out_dir, task=job.task, collection=job.collection, rank=rank,
                      step_base=job.steps_done)
    extra = list(job.trainer.observers)  # trainer.observers (build_job)
    job.trainer.observers = [*extra, *(o for o in (reporter, dump) if o is not None)]
    try:
        yield reporter
    finally:
        for observer in job.trainer.observers:
            observer.close()
        job.trainer.observers = []


def train(job: Job, out_dir: Path, fit: Fit, *, client: Any = None, rank: int = 0) -> Trained:
    """One fit of `job` with its training observers (see training_observers)."""
    batch_size = job.settings.trainer.batch_size
    with training_observers(job, out_dir, client=client, rank=rank) as reporter:
        cpu = time.process_time()
        stats = job.trainer.fit(fit.source, batch_size, epochs=fit.epochs, max_steps=fit.max_steps,
                                progress=fit.progress, first_epoch=fit.first_epoch,
                                thread_steps_per_epoch=fit.thread_steps_per_epoch, skip=fit.skip, pauses=fit.pauses)
        cpu = time.process_time() - cpu
    return Trained(stats, reporter.reports if reporter is not None else None, cpu)


def base_metrics(job: Job, trained: Trained) -> dict[str, Any]:
    """The fields of metrics.json every batch job writes beside the evaluation's (a PS worker 0 then
    replaces the throughput with the sum over the workers). `step`: the job's step count when the fit
    ended (its steps before it, a resumed checkpoint's, included: call it after adding the fit's)."""
    stats = trained.stats
    metrics: dict[str, Any] = dict(
        examples_per_sec=stats.examples_per_sec, train_examples=stats.examples, train_steps=stats.steps,
        step=job.steps_done,
        train_seconds=stats.seconds, train_loss=stats.last_loss, first_losses=stats.first_losses,
        model=job.settings.model_target, ps=job.settings.ps, threads=job.settings.trainer.threads)
    if trained.reports is not None:
        metrics["train_metrics"] = trained.reports
    return metrics


def data_metrics(job: Job) -> dict[str, Any]:
    """What a data set knows of itself: the best reachable AUC (per label) of a generated one; which
    split the run evaluated on when it is not the test split (`evaluated_on`: "validation", a session
    data set's dataset.valid_days)."""
    out: dict[str, Any] = {}
    if (split := getattr(job.data, "evaluated_on", None)) not in (None, "test"):
        out["evaluated_on"] = split
    if best := getattr(job.data, "best_auc", None):
        out["best_reachable_auc"] = best
    if best_per_label := getattr(job.data, "best_aucs", None):  # multi-label generators: one per label
        out["best_reachable_aucs"] = dict(best_per_label)
    return out


def run_local(job: Job, out_dir: Path) -> dict[str, Any]:
    """A local run (ps=local): resume (trainer.resume), train, evaluate, save `out_dir/checkpoint`;
    returns the metrics dict."""
    t = job.settings.trainer
    if t.resume:
        load_checkpoint(job, t.resume)
        log.info("resumed from %s at epoch %d, step %d", t.resume, job.epochs_done, job.steps_done)
    trained = train(job, out_dir, Fit(job.data.train, t.epochs, t.max_steps, first_epoch=job.epochs_done,
                                      progress=t.progress))
    job.epochs_done += t.epochs
    job.steps_done += trained.stats.steps
    metrics: dict[str, Any] = evaluate(job)
    metrics.update(base_metrics(job, trained))
    metrics.update(data_metrics(job))
    if job.settings.checkpoint.save:
        path = save_checkpoint(job, job.settings.checkpoint.folder(out_dir))
        metrics["checkpoint"] = str(path)
    return metrics
