"""A worker's role body for a batch job (`python -m recps.train ps=sync|async|geo`): `work`.

It takes the job built over a PS-backed embedding collection (recps.cluster.driver builds it from the
composed config: recps.job.build), joins through `recps.ps.fleet.Fleet`,
trains `trainer.threads` Hogwild threads on shards worker * T + thread of W * T (resumed where a
checkpoint stopped, pausing for mid-run checkpoints: recps.cluster.checkpoint), sends what is
queued and waits for the others; worker 0 then evaluates on the held-out split with the servers'
values, has the servers save their shards under <run dir>/checkpoint and writes
<run dir>/metrics.json (with "disk_tier": each tiered table's statistics after training, when a table
has a disk tier). `ProgressLog` is worker 0's progress line (also the stream's).
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

from recps import fs as rfs
from recps.cluster.checkpoint import CheckpointPauses, load_worker_state, read_progress, resume_point, write_progress
from recps.cluster.launch import process_age, restart_count
from recps.cluster.process import fleet_for, on_this_machine
from recps.data.sharding import WorkerShards
from recps.job.checkpoint import commit_ps_checkpoint
from recps.job.loop import left_of_target, planned_steps
from recps.job.parts import Job
from recps.job.settings import NodeSettings
from recps.job.run import Fit, base_metrics, data_metrics, evaluate, train
from recps.ps.fleet import DENSE_TABLE, DistributedStrategy

__all__ = ["work", "ProgressLog", "STATS_TABLE"]

log = logging.getLogger("recps.cluster")

STATS_TABLE = "recps_stats"  # [examples, examples/s, seconds, CPU seconds] summed over workers (a GEO-mode table: pushes add)
_PROGRESS_EVERY_S = 5.0


class ProgressLog:
    """A log line every few seconds from worker 0 (a tqdm bar does not survive line forwarding), and one
    at its first step (with the process's age: benchmarks/startup_bench.py reads it).

    Its `step` is the job's (`job.steps_done`, what the job trained before this fit, plus the fit's
    steps: continuous across resumes, restarts and a stream's passes, as the metrics records'); its rate
    is this worker's since the current fit's first step (a fit numbers its steps from 1), as the fit's
    own "examples/s" when it ends."""

    def __init__(self, batch_size: int, threads: int, job=None) -> None:
        self.batch_size, self.threads, self.job = batch_size, threads, job
        self.start = self.last = time.perf_counter()
        self.lock = threading.Lock()
        self.first = True

    def __call__(self, thread: int, step: int, loss: float) -> None:
        now = time.perf_counter()
        if step == 1:  # a fit's first step: its rate counts from here (a stream runs one fit per pass), its
            with self.lock:  # first line comes a whole interval later (a rate over a few steps says little)
                self.start = self.last = now
                first, self.first = self.first, False
            if first:
                age = process_age()
                log.info("first training step done (loss %.4f)%s", loss,
                         f", {age:.2f} s after this process started" if age is not None else "")
            return
        if now - self.last < _PROGRESS_EVERY_S:
            return
        with self.lock:
            if now - self.last < _PROGRESS_EVERY_S:
                return
            self.last = now
            start = self.start
        base = self.job.steps_done if self.job is not None else 0
        log.info("step %d, %.0f examples/s on this worker, loss %.4f", base + step,
                 (step - 1) * self.batch_size / max(now - start, 1e-9), loss)


def _step_range(step: int, steps: int) -> str:
    """" (steps 393-784)" when the fit of `steps` steps ending at the job's step `step` continued a job; else "".

    >>> _step_range(784, 392), _step_range(392, 392)
    (' (steps 393-784)', '')
    """
    return f" (steps {step - steps + 1}-{step})" if step > steps and steps > 0 else ""


def work(job: Job, mode, node: NodeSettings, role, out_dir: Path, observers: Sequence = ()) -> dict[str, Any] | None:
    """A worker of a batch job (see the module docstring); worker 0 returns the metrics it wrote.

    `job`: built from the composed config (recps.job.build.build_job; this worker's rows where it can:
    worker_data); `mode`: the PS mode (recps.config.ps_mode); `node`: the cluster's settings;
    `observers` join the job's own."""
    job.trainer.observers = [*job.trainer.observers, *observers]
    strategy = DistributedStrategy(mode, threads=job.settings.trainer.threads)
    return _train(job, strategy, lambda: fleet_for(node, role), role, Path(out_dir))


def _train(job: Job, strategy: DistributedStrategy, open_fleet, role, out_dir: Path) -> dict[str, Any] | None:
    """The worker's part of the job, from the typed objects `work` built (see the module docstring);
    `open_fleet()`: this worker's Fleet, joined once the resume point is known."""
    t = job.settings.trainer
    threads, batch_size, epochs, max_steps = t.threads, t.batch_size, t.epochs, t.max_steps
    ckpt = job.settings.checkpoint.folder(out_dir)
    source = WorkerShards(job.data.train, role.index, role.num_workers)
    if on_this_machine(role):  # W workers share this machine's cores: no oversubscribed OpenMP pools
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // role.num_workers))
    resume = resume_point(job, role, threads, batch_size) if t.resume else None
    first_epoch, skip = (resume["epoch"], resume["skip"]) if resume else (0, None)
    # Where this job began (epoch, steps): (0, 0), or the checkpoint a user resumed; its checkpoints record it.
    # A restart that resumes one of them continues the same job: it trains what is left of it, not that much more.
    origin = {"epoch": first_epoch, "steps": job.steps_done}
    if resume and restart_count() > 0 and str(resume["folder"]).startswith(ckpt.rstrip("/") + "/"):
        origin = resume["manifest"]["progress"].get("origin") or {"epoch": 0, "steps": 0}
        epochs, max_steps = left_of_target(epochs, max_steps, (int(origin["epoch"]), int(origin["steps"])),
                                           first_epoch, job.steps_done)
        log.info("%s: the job began at epoch %d, step %d; left to train: %s", role.name, origin["epoch"],
                 origin["steps"], f"{max_steps} steps" if max_steps > 0 else f"{epochs} epoch(s)")
    per_thread = -1
    if strategy.mode.name == "sync":
        # Every thread of every worker takes the same number of steps (each step waits for all).
        per_thread = min(source.shard_batches(batch_size, threads))
        if skip is not None:
            skip = [min(skip)] * threads  # equal steps for every thread
        if max_steps > 0 and skip is not None:  # a resumed run: the steps left of one epoch
            per_thread, epochs, max_steps = min(per_thread, skip[0] + max(1, max_steps // threads)), 1, -1
        # Else the trainer stops at exactly max_steps, a multiple of the threads (check_cluster_config):
        # each step waits for every thread, so each takes max_steps / threads.

    with open_fleet() as fleet:
        fleet.add_collection(job.collection)
        dist = fleet.distributed_optimizer(job.optimizer, strategy)
        fleet.init_worker(load_from=resume["folder"] if resume else None)
        if resume and resume["state_files"]:
            load_worker_state(resume["folder"], resume["manifest"], resume["state_files"], fleet)
        job.trainer.updater = dist.updater
        job.trainer.prefetch = strategy.mode.prefetches
        fleet.create_dense_table(STATS_TABLE, 4, mode="geo")  # GEO's server half adds what arrives
        job.trainer.on_step = ProgressLog(batch_size, threads, job) if role.index == 0 else None
        tables = [*job.collection.table_dims(), DENSE_TABLE]  # named: the servers hold other tables too
        pauses = None
        if strategy.mode.checkpoint_every_steps or strategy.mode.checkpoint_every_seconds:
            mine = source.shard_batches(batch_size, threads)[role.index * threads:(role.index + 1) * threads]
            planned = planned_steps(mine, epochs, max_steps, per_thread, skip)
            pauses = CheckpointPauses(fleet, job, strategy.mode, ckpt, tables, planned, origin=origin)
        # Global metrics (merged over every worker and thread through the servers; worker 0
        # logs and writes them) and the debug dump (each worker's threads write their own files).
        trained = train(job, out_dir, Fit(source, epochs, max_steps, first_epoch=first_epoch, skip=skip,
                                          thread_steps_per_epoch=per_thread, pauses=pauses),
                        client=fleet.channel(), rank=role.index)
        stats, cpu = trained.stats, trained.cpu_seconds
        # Everything is sent (geo: the last deltas) and nothing more will be: worker 0 below
        # overwrites its dense params with the servers' values, which must not count as a delta.
        fleet.close_communicators()
        fleet.push_dense(STATS_TABLE, torch.tensor(
            [float(stats.examples), stats.examples_per_sec, stats.seconds, cpu])).wait()
        job.steps_done += stats.steps
        log.info("%s trained: %d steps%s, %d examples, %.0f examples/s", role.name, stats.steps,
                 _step_range(job.steps_done, stats.steps), stats.examples, stats.examples_per_sec)
        if job.settings.checkpoint.save:  # where every thread stopped, for a resume
            write_progress(ckpt, role, job.steps_done, stats.positions, fleet)
        fleet.barrier("recps.trained")
        if role.index != 0:
            return None
        # Worker 0: the disk tiers as training left them (before the evaluation's reads promote rows),
        # then evaluate what the servers hold (every worker's pushes / deltas are in).
        tiers = fleet.tier_stats(tables, timeout=strategy.mode.timeout_s)
        fleet.read_servers()
        metrics: dict[str, Any] = evaluate(job)
        total_examples, total_rate, _, total_cpu = fleet.pull_dense(STATS_TABLE).tolist()
        metrics.update(base_metrics(job, trained))
        metrics.update(examples_per_sec=total_rate, train_examples=int(total_examples), worker_cpu_seconds=total_cpu,
                       servers=role.num_servers, workers=role.num_workers)
        if strategy.mode.name == "geo":
            metrics["k_steps"] = strategy.mode.k_steps
        metrics.update(data_metrics(job))
        if pauses is not None:
            metrics["checkpoints"] = pauses.records
        if tiers:  # tables with a disk tier (ps.table.memory_budget): rows per tier, hit rate, moves, bytes
            metrics["disk_tier"] = tiers
        if job.settings.checkpoint.save:
            progress = read_progress(ckpt, role.num_workers)
            commit_ps_checkpoint(ckpt, tables, job.settings, {"steps": job.steps_done, "workers": progress,
                                                     "origin": origin},
                                 save=lambda: fleet.save(ckpt, mode="full", tables=tables,
                                                                timeout=max(strategy.mode.timeout_s, 600.0)))
            metrics["checkpoint"] = ckpt
        rfs.write_atomic(str(out_dir / "metrics.json"), json.dumps(metrics, indent=2, sort_keys=True) + "\n",
                         overwrite=True)
        return metrics
