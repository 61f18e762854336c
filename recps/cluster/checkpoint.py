"""PS checkpoints of a running job and the resume from one: every record a worker writes, and where it continues.

    write_progress / read_progress   <checkpoint>/progress/worker-XXXXX.json (steps, each thread's position)
                                     and <checkpoint>/workers/worker-XXXXX.pt (Fleet.worker_state: geo)
    load_worker_state                those state files into the fleet: a worker's own, or all of them
                                     merged onto another number of workers (merge_worker_states)
    CheckpointPauses                 committed checkpoints during training (ps.checkpoint_every_*)
    resume_point                     where a worker's threads continue a checkpoint (trainer.resume)
    last_committed, restart_resume   a restarted cluster resumes from the last committed checkpoint
                                     under checkpoint.dir, so that the updates after it are replayed once

The checkpoint's format (manifest, checksums, committed folders) is recps.job.checkpoint's; the servers
write the tables (recps.ps.fleet). Streams resume from their own records (recps.stream).
"""

from __future__ import annotations

import io
import json
import logging
import time
from typing import Sequence

import torch

from recps import fs as rfs
from recps.job.checkpoint import (commit_ps_checkpoint, committed_checkpoints, find_checkpoint, is_committed,
                                  prune_step_checkpoints, read_recorded, verify_ps_checkpoint)
from recps.cluster.launch import restart_count
from recps.data.sharding import WorkerShards
from recps.errors import ConfigError
from recps.ps.fleet import DENSE_TABLE

__all__ = ["CONTROL_TABLE", "CheckpointPauses", "write_progress", "read_progress", "load_worker_state",
           "merge_worker_states", "resume_point", "last_committed", "restart_resume",
           "finished_message"]

log = logging.getLogger("recps.cluster")

# Mid-run checkpoints' meetings (a GEO-mode table: pushes add): per worker its planned steps as
# two float32-exact halves (steps >> 20, steps & (2**20 - 1)), then the steps to the next meeting.
CONTROL_TABLE = "recps_control"


def last_committed(root: str) -> str | None:
    """The committed checkpoint with the most steps under a run's checkpoint folder `root` (its step-N/
    folders, or the folder itself), or None."""
    if not committed_checkpoints(root):
        return None
    return find_checkpoint(root)[1]


def restart_resume(root: str, role, resume: str | None) -> str | None:
    """On a restart of the cluster (recps.cluster.launch's RECPS_RESTART_COUNT or torchrun's
    TORCHELASTIC_RESTART_COUNT > 0) every process resumes from the last committed checkpoint under the
    run's checkpoint folder `root`: returned (the caller sets trainer.resume to it), so that the updates
    after it are replayed exactly once; None: no restart, or none committed yet (the job starts over as
    configured, from `resume` if set). Every process of the cluster was stopped before the restart, so
    they all find the same one. A stream resumes from its own records in stream.out instead (its caller
    does not ask), the same way as a rerun of its command."""
    count = restart_count()
    if count == 0:
        return None
    found = last_committed(root)
    if found is None:
        log.warning("%s: restart %d: no committed checkpoint under %s yet; starting over%s", role.name, count,
                    root, f" from trainer.resume={resume}" if resume else "")
        return None
    if found == root:
        raise ConfigError(finished_message(f"{role.name}: restart {count}", found))
    log.warning("%s: restart %d: resuming from %s", role.name, count, found)
    return found


def finished_message(what: str, checkpoint: str) -> str:
    """A failure after the job's final checkpoint was committed: its training is done, nothing to resume."""
    return (f"{what}: the job's final checkpoint {checkpoint} was already committed (its training is complete): "
            f"nothing to restart from; evaluate it with python -m recps.evaluate {checkpoint}")



def _mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.to(torch.float64) for t in tensors]).mean(0).to(tensors[0].dtype)


def merge_worker_states(states: list[dict]) -> dict:
    """One `Fleet.worker_state` from those of another run's workers, for a resume onto another
    number of workers: a replica holds every key any of them held, with the mean of their
    accumulators for it; the local dense optimizer's state tensors are the workers' means
    (each worker applied its own steps to the same parameters); other entries: the first's."""
    merged: dict = {}
    tables = sorted({t for s in states for t in s.get("sparse", {})})
    if tables:
        merged["sparse"] = {}
        for table in tables:
            parts = [s["sparse"][table] for s in states if table in s.get("sparse", {})]
            keys = torch.cat([p["keys"] for p in parts])  # (K,)
            acc = torch.cat([p["state"] for p in parts]).to(torch.float64)  # (K, ...)
            uniq, inverse = torch.unique(keys, return_inverse=True)
            sums = torch.zeros((uniq.numel(), *acc.shape[1:]), dtype=torch.float64).index_add_(0, inverse, acc)
            counts = torch.bincount(inverse, minlength=uniq.numel()).to(torch.float64)
            mean = sums / counts.reshape(-1, *([1] * (acc.dim() - 1)))
            merged["sparse"][table] = {"keys": uniq, "state": mean.to(parts[0]["state"].dtype)}
    optimizers = [s["dense_optimizer"] for s in states if "dense_optimizer" in s]
    if optimizers:
        per_param: dict = {}
        for opt in optimizers:
            for index, entry in opt["state"].items():
                per_param.setdefault(index, []).append(entry)
        merged["dense_optimizer"] = {
            "param_groups": optimizers[0]["param_groups"],
            "state": {index: {name: _mean([e[name] for e in entries if name in e])
                              if isinstance(value, torch.Tensor) else value
                              for name, value in entries[0].items()}
                      for index, entries in per_param.items()},
        }
    return merged


_PROGRESS = "progress"
_WORKER_STATE = "workers"


def write_progress(ckpt: str, role, steps: int, positions, fleet) -> None:
    """<checkpoint>/progress/worker-XXXXX.json: this worker's steps and each thread's (epoch, batches);
    and what only the worker holds (Fleet.worker_state: geo's replica and dense optimizer state) in
    <checkpoint>/workers/worker-XXXXX.pt, named by the progress record ("state_file"), so the
    manifest records its size and sha256 (recps.job.checkpoint.commit_ps_checkpoint)."""
    record = {"worker": role.index, "num_workers": role.num_workers, "steps": steps,
              "positions": [list(p) for p in positions or ()]}
    writes = []
    state = fleet.worker_state()
    if state:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        record["state_file"] = rel = f"{_WORKER_STATE}/worker-{role.index:05d}.pt"
        writes.append(lambda: rfs.write_atomic(rfs.join(ckpt, rel), buffer.getbuffer(), overwrite=True))
    # Both are read only after the meeting's barrier, so they are written at once (rfs.concurrently).
    progress = rfs.join(ckpt, _PROGRESS, f"worker-{role.index:05d}.json")
    writes.append(lambda: rfs.write_atomic(progress, json.dumps(record), overwrite=True))
    rfs.concurrently(writes)


def load_worker_state(folder: str, manifest: dict, state_files: Sequence[str], fleet) -> None:
    """The workers' state files of a checkpoint (each checked against the manifest) into the fleet:
    this worker's own on a resume onto as many workers, else all of them merged
    (merge_worker_states)."""
    states = [torch.load(io.BytesIO(read_recorded(folder, manifest, rel)), map_location="cpu", weights_only=True)
              for rel in state_files]
    fleet.load_worker_state(states[0] if len(states) == 1 else merge_worker_states(states))


def read_progress(ckpt: str, num_workers: int) -> list[dict]:
    return [json.loads(rfs.read_bytes(rfs.join(ckpt, _PROGRESS, f"worker-{w:05d}.json")))
            for w in range(num_workers)]


class CheckpointPauses:
    """`recps.job.loop.Pauses` of ps.checkpoint_every_steps / ps.checkpoint_every_seconds: committed
    checkpoints of a running job at `<checkpoint dir>/step-N/` (N: each worker's steps, over its
    threads, since the job began: the resumed steps count). With checkpoint_every_steps=E they fall
    on the multiples of E of that count, as the metrics reports do: a run resumed at step 392 with
    E=200 checkpoints at 400, 600, ... as the run it continues would have.

    The workers agree first (one barrier) on the smallest number of steps any of them will take;
    meetings fall strictly before it (the checkpoint at the end covers the rest), so every worker
    meets the same number of times. At a meeting each worker's threads stand between two steps;
    the worker drains its communicators (async: every queued and in-flight push applied; geo: the
    deltas since the last sync sent and added; sync: nothing is pending after a step) and writes
    its progress, then at a barrier of every worker (nothing more is pushed until it ends) worker 0
    has the servers save the tables and commits the manifest. With checkpoint_every_seconds the
    first meeting, after checkpoint_check_steps steps, only measures worker 0's step rate; each
    later one is a checkpoint and worker 0 sets the steps to the next from its rate (through
    CONTROL_TABLE). `records`: per checkpoint its folder, steps, pause and save seconds (worker 0)."""

    def __init__(self, fleet, job, mode, root: str, tables: Sequence[str], planned: int,
                 origin: dict | None = None) -> None:
        self.fleet, self.job, self.root, self.tables = fleet, job, root, list(tables)
        self.origin = origin or {"epoch": 0, "steps": 0}  # where the job began, recorded in each checkpoint
        self.role = fleet.role
        self.threads = job.settings.trainer.threads
        self.unit = self.threads if mode.name == "sync" else 1  # sync: every thread takes each step
        self.every_steps, self.every_s = mode.checkpoint_every_steps, mode.checkpoint_every_seconds
        self.check_steps = int(mode.checkpoint_check_steps)
        self.timeout_s = max(float(mode.timeout_s), 600.0)
        self.records: list[dict] = []
        self.meetings = 0
        self.interval = 0  # checkpoint_every_seconds: the steps to the next meeting
        self.control = 0  # ... as CONTROL_TABLE holds them (worker 0 pushes the change)
        self.met_at = 0  # the fit's steps at the last meeting
        self.at: int | None = None
        self.clock = time.perf_counter()
        w, workers = self.role.index, self.role.num_workers
        fleet.create_dense_table(CONTROL_TABLE, 2 * workers + 1, mode="geo")
        plan = torch.zeros(2 * workers + 1)
        plan[2 * w], plan[2 * w + 1] = float(planned >> 20), float(planned & (2**20 - 1))
        fleet.push_dense(CONTROL_TABLE, plan).wait()
        fleet.barrier("recps.checkpoint.plan", timeout=self.timeout_s)
        values = [int(v) for v in fleet.pull_dense(CONTROL_TABLE).tolist()]
        self.limit = min((values[2 * i] << 20) | values[2 * i + 1] for i in range(workers))
        log.info("%s: checkpoints every %s during training, before step %d (the fewest steps of a worker)",
                 self.role.name, f"{self._round(self.every_steps)} steps" if self.every_steps else f"{self.every_s:g} s",
                 self.job.steps_done + self.limit)

    def _round(self, steps: int) -> int:
        return max(self.unit, -(-int(steps) // self.unit) * self.unit)

    def _next(self, steps: int) -> int | None:
        """The fit's step count of the meeting after the one at `steps` (None: none before the limit)."""
        if self.every_steps:  # the next multiple of the interval on the job's step count
            every, done = self._round(self.every_steps), self.job.steps_done
            at = self._round((done + steps) // every * every + every - done)
        else:
            at = steps + self._round(self.interval)
        self.at = at if at < self.limit else None
        return self.at

    def first(self) -> int | None:
        if self.every_steps:
            return self._next(0)
        self.interval = self._round(self.check_steps)
        return self._next(0)

    def pause(self, steps: int, positions: list[tuple[int, int]]) -> int | None:
        start = time.perf_counter()
        fleet, role = self.fleet, self.role
        trained_s = start - self.clock
        self.meetings += 1
        saving = bool(self.every_steps) or self.meetings > 1  # (seconds) the first meeting measures the rate
        at = self.at if self.at is not None else steps
        total = self.job.steps_done + at
        folder = rfs.join(self.root, f"step-{total}")
        fleet.flush()  # drained: everything this worker pushed is applied (geo: its deltas added)
        if saving:
            write_progress(folder, role, self.job.steps_done + steps, positions, fleet)
        fleet.barrier(f"recps.checkpoint.{self.meetings}", timeout=self.timeout_s)  # every worker drained
        save_s = 0.0
        if role.index == 0:
            if saving:
                if is_committed(folder):
                    raise ConfigError(f"{folder} holds a committed checkpoint ({folder}/manifest.json); it is never "
                                      "overwritten: give another checkpoint.dir or hydra.run.dir (or move it away)")
                t = time.perf_counter()
                progress = read_progress(folder, role.num_workers)
                commit_ps_checkpoint(folder, self.tables, self.job.settings,
                                     {"steps": self.job.steps_done + steps, "workers": progress, "origin": self.origin},
                                     save=lambda: fleet.save(folder, mode="full", tables=self.tables,
                                                              timeout=self.timeout_s))
                save_s = time.perf_counter() - t
                keep = self.job.settings.checkpoint.keep_last
                if keep is not None:
                    for old in prune_step_checkpoints(self.root, int(keep)):
                        log.info("%s: removed %s (checkpoint.keep_last=%d)", role.name, old, int(keep))
                for obs in self.job.trainer.observers:
                    if (hook := getattr(obs, "on_checkpoint", None)) is not None:
                        hook(folder, self.job.steps_done + steps, fleet.channel())
            if self.every_s:  # the steps to the next meeting, from worker 0's rate since the last one
                rate = (steps - self.met_at) / max(trained_s, 1e-3)
                interval = min(2**24, self._round(max(1.0, rate * float(self.every_s))))
                change = torch.zeros(2 * role.num_workers + 1)
                change[-1] = float(interval - self.control)
                fleet.push_dense(CONTROL_TABLE, change).wait()
        fleet.barrier(f"recps.checkpoint.{self.meetings}.done", timeout=self.timeout_s)
        if self.every_s:
            self.interval = self.control = int(fleet.pull_dense(CONTROL_TABLE)[-1])
        pause_s = time.perf_counter() - start
        if saving:
            self.records.append({"folder": folder, "steps": self.job.steps_done + steps,
                                 "pause_s": round(pause_s, 3), "save_s": round(save_s, 3)})
            log.info("%s: %s %s at step %d: training paused %.2f s%s", role.name,
                     "committed" if role.index == 0 else "checkpoint", folder, self.job.steps_done + steps, pause_s,
                     f" (save and commit {save_s:.2f} s)" if role.index == 0 else "")
        self.met_at, self.clock = steps, time.perf_counter()
        return self._next(at)


def resume_point(job, role, threads: int, batch_size: int) -> dict:
    """Where this worker's threads continue a PS checkpoint: {"folder", "epoch", "skip" per thread}.

    The same workers x threads continue exactly where each thread stopped. Another layout takes
    the fraction of the (earliest) epoch the old threads had trained, from each new shard."""
    _, folder = find_checkpoint(str(job.settings.trainer.resume))
    # Each worker reads the state files it takes (load_worker_state), not all of them.
    manifest = verify_ps_checkpoint(folder, needed=[*job.collection.table_dims(), DENSE_TABLE], worker_states=False)
    if manifest["model_target"] != job.settings.model_target:
        raise ConfigError(f"trainer.resume: {folder} holds a {manifest['model_target']} but model={job.settings.model_target}; "
                          "resume with the model config it was trained with")
    progress = manifest["progress"]
    job.steps_done = int(progress["steps"])
    workers = progress.get("workers") or []
    positions = [p for w in workers for p in w["positions"]]
    if not positions:
        return {"folder": folder, "epoch": 0, "skip": None, "manifest": manifest, "state_files": []}
    old_threads = len(workers[0]["positions"])
    old = WorkerShards(job.data.train, 0, len(workers)).shard_batches(batch_size, old_threads)
    positions = [(e + 1, 0) if n >= old[i] else (e, n) for i, (e, n) in enumerate(positions)]  # epoch done: the next
    epoch = min(e for e, _ in positions)
    # What only the workers held (geo: replica and dense optimizer state) continues on the same workers.
    same_workers = len(workers) == role.num_workers
    state_files = [w["state_file"] for w in workers if w.get("state_file")]
    if same_workers:
        state_files = [workers[role.index]["state_file"]] if workers[role.index].get("state_file") else []
    elif state_files:
        log.info("%s: %s was trained by %d workers, this run has %d: each starts from their local state (geo) "
                 "merged", role.name, folder, len(workers), role.num_workers)
    if same_workers and old_threads == threads:
        mine = positions[role.index * threads : (role.index + 1) * threads]
        skip = [n if e == epoch else old[role.index * threads + t] for t, (e, n) in enumerate(mine)]
    else:
        frac = sum(min(1.0, n / max(1, old[i]) + (e - epoch)) for i, (e, n) in enumerate(positions)) / len(positions)
        new = WorkerShards(job.data.train, role.index, role.num_workers).shard_batches(batch_size, threads)
        skip = [round(frac * new[role.index * threads + t]) for t in range(threads)]
    log.info("%s resumes %s at step %d, epoch %d, skipping %s batches per thread", role.name, folder,
             job.steps_done, epoch, skip)
    return {"folder": folder, "epoch": epoch, "skip": skip, "manifest": manifest, "state_files": state_files}
