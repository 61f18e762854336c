"""The stream job: `python -m recps.train stream=hourly stream.root=URL stream.out=URL ps=async ...`.

The launcher (recps.cluster) starts the servers and workers as for a batch job; each worker runs
the pass loop below instead of one fit over the data set. Every worker walks the same passes in
the same order (recps.stream.plan), in Paddle's online trainer's order:

    wait for the pass's splits (their data donefiles; bounded)
    read this worker's share of the pass's files (async/geo: its files; sync: its rows)
    evaluate the current model on the pass first (what the servers hold; global metrics merged
        over the workers: worker 0 appends them to <run dir>/stream_metrics.jsonl, TensorBoard)
    train one epoch on it
    drain (every push applied), barrier; worker 0 saves, the others wait at a second barrier:
        a delta (mode 1) <out>/<day>/delta-<pass>/, committed (manifest), then its
            patch_donefile.txt record (a follower such as recps.serve applies it from then on)
        a checkpoint (mode 0) <out>/<day>/<pass>/, committed, then its donefile.txt record
    at the day's end: shrink, a base (mode 2) <out>/<day+1>/base/ and its base_donefile.txt
        record, a batch model (mode 3) <out>/<day+1>/0/ and its donefile.txt record (pass -1)

Restarts (the same command, any number of servers) are exactly once (`resume_point`): the job
loads the last recorded checkpoint and continues with the pass after it. Its delta, committed
before it, is published now if the crash came between the two. A delta published before a crash
cut its pass's checkpoint short stays as it is (a published folder is never written again): the
pass is trained again, exports no second delta and records the published one as its own; what
that training changed goes out with the next delta (the export that reset those rows' delta
statistics was the lost run's). A day end cut short is done
again from that pass's state (what it had already published is saved again aside, into a
scratch folder that is then removed, only so that the statistics it resets and ages are the
same: published records are never written twice). A pass after the last checkpoint was never
published, so training it again publishes it once. A checkpoint committed without its record
(a crash between the two) is taken as it is.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from recps import fs as rfs
from recps.cluster.checkpoint import load_worker_state, read_progress, write_progress
from recps.cluster.process import fleet_for, on_this_machine
from recps.data.sharding import WorkerShards
from recps.errors import ConfigError
from recps.job.checkpoint import commit_ps_checkpoint, is_committed, verify_ps_checkpoint
from recps.job.settings import JobSettings, NodeSettings
from recps.metrics import MetricCollection
from recps.metrics.collection import build_metric
from recps.metrics.groups import update_collection
from recps.metrics.ps_merger import PSMerger
from recps.metrics.reporter import ExampleCount, LocalMerger
from recps.ps.fleet import DENSE_TABLE, DistributedStrategy
from recps.stream.donefile import BASE_DONEFILE, DAY_MODEL_PASS, MODEL_DONEFILE, PATCH_DONEFILE, Donefiles, ModelRecord
from recps.stream.plan import Pass, StreamConfig, StreamPlan, next_day

if TYPE_CHECKING:
    from recps.job.parts import Job

__all__ = ["StreamWork", "stream_work", "resume_point", "Resume", "PassLoop", "check_stream_out", "nothing_left"]

log = logging.getLogger("recps.stream")

METRICS_FILE = "stream_metrics.jsonl"
_EVAL_DEFAULT = ("auc", "logloss", "actual_ctr", "predicted_ctr", "copc")


@dataclass(frozen=True)
class StreamWork:
    """What a stream job's worker takes, typed (recps.train builds it from the composed config).

    `config`: conf `stream:`; `mode`: the PS mode (recps.config.ps_mode); `node`: the cluster's settings;
    `build_job()`: the job (recps.job.build), called once the resume point is read: over the dataset's
    schema with no rows (each pass brings its rows), or the rows an in-process cluster gave;
    `shuffle`, `error_budget`: conf `dataset:`'s, how a pass's rows are read (its files are not)."""

    config: StreamConfig
    mode: Any
    node: NodeSettings
    build_job: Callable[[], "Job"]
    shuffle: bool = True
    error_budget: float = 0.01


def _check_out(config: StreamConfig) -> None:
    """Before any process starts: the donefiles parse, the resume point is consistent, the root is there
    (the launcher checked the tables' CTR accessor: recps.train)."""
    resume = resume_point(config)
    if not config.follow and not rfs.exists(config.root):
        raise ConfigError(f"stream.root={config.root} does not exist; give the folder holding the <YYYYMMDD>/ day "
                          "folders, or stream.follow=true to wait for it")
    where = f"pass {resume.next.name}" if resume.next else "nothing (every pass is committed)"
    log.info("stream %s -> %s: %s; starts at %s", config.root, config.out,
             f"resumes {resume.folder}" if resume.folder else "a fresh start", where)


# -------------------------------------------------------------------------------- the resume point


@dataclass
class Resume:
    """Where a job starts: the checkpoint to load (None: fresh), the pass to train next (None: the
    stream is done), what to finish first (the delta to publish; the day end to redo, and how much of
    it was published), the base key, steps so far."""

    folder: str | None
    next: Pass | None
    base_key: int
    steps: int = 0
    publish_delta: str | None = None
    day_end: Pass | None = None  # the day whose end is (re)done before `next`
    day_end_published: tuple[bool, bool] = (False, False)  # (base record, day model record)
    adopt: ModelRecord | None = None  # a committed checkpoint without its record: record it
    passes_done: int = 0
    published_delta: str | None = None  # `next`'s delta, published before a crash cut its checkpoint short


def _pass_folder(config: StreamConfig, p: Pass) -> str:
    return rfs.join(config.out, p.day, str(p.index))


def _delta_folder(config: StreamConfig, p: Pass) -> str:
    return rfs.join(config.out, p.day, f"delta-{p.index}")


def _day_folders(config: StreamConfig, day: str) -> tuple[str, str]:
    """(base, batch model) folders of the end of `day`: under the next day, as Paddle's."""
    following = next_day(day)
    return rfs.join(config.out, following, "base"), rfs.join(config.out, following, "0")


def _following(plan: StreamPlan, p: Pass | None) -> Pass | None:
    """The pass after `p` (None: the first of start_day), or None past end_day."""
    if p is None:
        day, index = plan.config.start_day, 1
    elif p.last:
        day, index = next_day(p.day), 1
    else:
        day, index = p.day, p.index + 1
    if plan.config.end_day is not None and day > plan.config.end_day:
        return None
    return plan.passes_of_day(day)[index - 1]


def resume_point(config: StreamConfig) -> Resume:
    """The Resume of `config.out`'s records (see the module docstring); raises ConfigError for a
    history that goes back in time or does not match the stream's passes. Records win over
    stream.start_day: a stream begun earlier goes on after its last record."""
    plan = StreamPlan(config)
    done = Donefiles(config.out)
    records = done.models()
    passes = [r for r in records if r.pass_id != DAY_MODEL_PASS]
    for a, b in zip(passes, passes[1:]):
        if (b.day, b.pass_id) <= (a.day, a.pass_id):
            raise ConfigError(f"{done.url('donefile.txt')}: pass {b.day}/{b.pass_id} is recorded after {a.day}/"
                              f"{a.pass_id}: the stream went back in time; repair the donefile or give another stream.out")
    last: Pass | None = None
    if passes:
        r = passes[-1]
        day_passes = plan.passes_of_day(r.day)
        if not 1 <= r.pass_id <= len(day_passes):
            raise ConfigError(f"{done.url('donefile.txt')}: pass {r.day}/{r.pass_id} is not a pass of this stream "
                              f"({len(day_passes)} a day with stream.hours={config.hours}, split_interval="
                              f"{config.split_interval}, split_per_pass={config.split_per_pass}); resume with the "
                              "stream settings that wrote it, or give another stream.out")
        last = day_passes[r.pass_id - 1]
    elif any(r.pass_id == DAY_MODEL_PASS for r in records):
        raise ConfigError(f"{done.url('donefile.txt')} records a day model but no pass checkpoint; it was not written "
                          "by a recps stream job: give another stream.out")
    folder = _pass_folder(config, last) if last else None
    base_key = passes[-1].base_key if passes else int(time.time())
    adopt = None
    # A checkpoint committed after the last record (a crash before its record): taken as it is.
    # (One at most: a record is appended right after each commit.)
    candidate = _following(plan, last)
    if candidate is not None and is_committed(_pass_folder(config, candidate)):
        manifest = json.loads(rfs.read_bytes(rfs.join(_pass_folder(config, candidate), "manifest.json")))
        base_key = int(manifest["progress"]["stream"]["base_key"])
        last, folder = candidate, _pass_folder(config, candidate)
        adopt = ModelRecord(last.day, base_key, folder, last.index)
    if last is not None and last.day > (config.end_day or last.day):
        raise ConfigError(f"{config.out} holds pass {last.name}, after stream.end_day={config.end_day}: the stream "
                          "would go back in time; raise stream.end_day or give another stream.out")
    resume = Resume(folder=folder, next=_following(plan, last), base_key=base_key, adopt=adopt)
    if resume.next is not None and done.published(PATCH_DONEFILE, _delta_folder(config, resume.next)):
        resume.published_delta = _delta_folder(config, resume.next)
    if folder is not None:
        manifest = json.loads(rfs.read_bytes(rfs.join(folder, "manifest.json")))
        state = manifest["progress"]["stream"]
        resume.steps = int(manifest["progress"].get("steps", 0))
        resume.passes_done = int(state.get("passes_done", 0))
        if state.get("delta") and not done.published(PATCH_DONEFILE, state["delta"]):
            resume.publish_delta = state["delta"]
        if last.last:
            base, batch = _day_folders(config, last.day)
            day_models = {(r.day, r.path.rstrip("/")) for r in records if r.pass_id == DAY_MODEL_PASS}
            published = (done.published(BASE_DONEFILE, base), (next_day(last.day), batch.rstrip("/")) in day_models)
            resume.day_end, resume.day_end_published = last, published
            if published[0]:  # the base's key, which the day model and the next day's records carry
                resume.base_key = int(done.record_of(BASE_DONEFILE, base)["key"])
    return resume


def nothing_left(config: StreamConfig) -> str | None:
    """What a user reads when `config.out`'s records hold the whole stream up to stream.end_day (every pass
    committed and recorded, its last delta and day end published): nothing is left to train. None when
    something is (always without an end_day: the stream waits for its next pass)."""
    if config.end_day is None or not rfs.exists(rfs.join(config.out, MODEL_DONEFILE)):
        return None  # waits for its next pass, or a fresh stream
    resume = resume_point(config)
    if resume.next is not None or resume.publish_delta or resume.adopt is not None or resume.folder is None:
        return None
    if resume.day_end is not None and resume.day_end_published != (True, True):
        return None
    day, index = resume.folder.rstrip("/").split("/")[-2:]
    return (f"nothing to do: every pass of {config.out} up to {day}/{index} (stream.end_day={config.end_day}) is "
            "committed and recorded; raise stream.end_day to train on")


# ------------------------------------------------------------------------------------- the worker


def _eval_collection(metrics: dict | None):
    """The pass's evaluation metrics: conf `metrics:`'s (resolved, JobSettings.metrics), else _EVAL_DEFAULT."""
    specs: Any = metrics.get("metrics") if metrics is not None and bool(metrics.get("enabled", True)) else None
    specs = specs if specs is not None else list(_EVAL_DEFAULT)
    pairs = [(str(k), dict(v or {})) for k, v in specs.items()] if isinstance(specs, dict) else [(str(m), {}) for m in specs]
    return MetricCollection([*(build_metric(name, **kw) for name, kw in pairs if name != "examples"), ExampleCount()])


class _Loop:
    """One worker's pass loop (see the module docstring).

    `settings`: the job's (recps.job.settings: what its checkpoints record, config.yaml and the model;
    the trainer's threads and batch sizes, the seed, conf `metrics:`); `shuffle`, `error_budget`: how a
    pass's rows are read (StreamWork's)."""

    def __init__(self, settings: JobSettings, role, out_dir: Path, job, fleet, strategy, config: StreamConfig,
                 resume: Resume, tables: Sequence[str], *, shuffle: bool = True, error_budget: float = 0.01) -> None:
        self.role, self.out_dir, self.job, self.fleet = role, out_dir, job, fleet
        self.settings = settings
        self.shuffle, self.error_budget = shuffle, error_budget
        self.strategy, self.config, self.resume = strategy, config, resume
        self.plan = StreamPlan(config)
        self.done = Donefiles(config.out)
        self.tables = list(tables)
        self.sparse_tables = list(job.collection.table_dims())
        self.threads, self.batch_size = settings.trainer.threads, settings.trainer.batch_size
        self.timeout_s = max(float(strategy.mode.timeout_s), 600.0)
        self.merger = PSMerger(fleet.channel(), prefix="recps.stream.eval", timeout_s=self.timeout_s) \
            if role.num_workers > 1 else LocalMerger()
        self.base_key = resume.base_key
        self.published_delta = resume.published_delta
        self.passes_done = resume.passes_done
        self.records: list[dict] = []
        self.tb = None
        if role.index == 0 and settings.metrics is not None and bool(settings.metrics.get("tensorboard", False)):
            from torch.utils.tensorboard import SummaryWriter  # deferred: tensorboard is optional, asked for

            self.tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))

    # -- what worker 0 commits -------------------------------------------------------------------

    def _clear_leftovers(self) -> None:
        """Worker 0 at the start: remove what an earlier run wrote after its last record and never
        published (a crash mid-save), so that no stale shard mixes into a save; refuse a published one."""
        r, folders = self.resume, []
        if r.next is not None:
            folders += [_pass_folder(self.config, r.next), _delta_folder(self.config, r.next)]
        if r.day_end is not None:
            base, batch = _day_folders(self.config, r.day_end.day)
            folders += [f for f, published in zip((base, batch), r.day_end_published) if not published]
        recorded = {x.path.rstrip("/") for x in self.done.models()}
        for folder in folders:
            fs, path = rfs.resolve(folder)
            if folder == r.published_delta or not fs.exists(path):
                continue
            if (folder.rstrip("/") in recorded or self.done.published(PATCH_DONEFILE, folder)
                    or self.done.published(BASE_DONEFILE, folder)):
                raise ConfigError(f"{folder} is published, yet after the last record this job resumes from; it is "
                                  f"never overwritten: is another job writing to stream.out={self.config.out}?")
            log.info("stream: removing %s, left unpublished by an earlier run", folder)
            fs.rm(path, recursive=True)

    def _export(self, folder: str, mode: str, p: Pass, extra: dict | None = None) -> tuple[int, float]:
        """Servers save `mode` into `folder`, committed by its manifest; (rows, seconds)."""
        t = time.perf_counter()
        state = {"day": p.day, "pass": p.index, "mode": mode, "base_key": self.base_key, **(extra or {})}

        def save() -> None:  # runs before the manifest is written: its row count goes in
            saved = self.fleet.save(folder, mode=mode, tables=self.tables, timeout=self.timeout_s)
            state["rows"] = sum(v for k, v in saved.items() if k in self.sparse_tables)

        commit_ps_checkpoint(folder, self.tables, self.settings, {"steps": self.job.steps_done, "stream": state}, save=save)
        return int(state["rows"]), time.perf_counter() - t

    def _scratch(self, mode: str, p: Pass) -> float:
        """A save whose only purpose is its effect on the statistics (a replay); removed after."""
        folder = rfs.join(self.config.out, ".replay", f"{p.day}-{p.index}-{mode}-{os.getpid()}")
        t = time.perf_counter()
        self.fleet.save(folder, mode=mode, tables=self.tables, timeout=self.timeout_s)
        fs, path = rfs.resolve(folder)
        fs.rm(path, recursive=True)
        return time.perf_counter() - t

    def _checkpoint(self, p: Pass, delta: str | None) -> float:
        folder = _pass_folder(self.config, p)
        t = time.perf_counter()
        progress = {"steps": self.job.steps_done, "workers": read_progress(folder, self.role.num_workers),
                    "stream": {"day": p.day, "pass": p.index, "base_key": self.base_key, "delta": delta,
                               "passes_done": self.passes_done}}
        commit_ps_checkpoint(folder, self.tables, self.settings, progress,
                             save=lambda: self.fleet.save(folder, mode="full", tables=self.tables,
                                                                 timeout=self.timeout_s))
        self.done.add_model(ModelRecord(p.day, self.base_key, folder, p.index))
        return time.perf_counter() - t

    def _day_end(self, p: Pass, published: tuple[bool, bool] = (False, False)) -> dict:
        """shrink, base, batch model of day p.day (worker 0); `published`: what a replay finds recorded."""
        out: dict[str, Any] = {}
        t = time.perf_counter()
        if self.config.shrink:
            out["shrunk_rows"] = self.fleet.shrink(tables=self.sparse_tables, timeout=self.timeout_s)
        out["shrink_s"] = round(time.perf_counter() - t, 3)
        base, batch = _day_folders(self.config, p.day)
        following = next_day(p.day)
        if published[0]:
            out["base_s"] = round(self._scratch("base", p), 3)
        else:
            # A new key for every base, above the one before: int(time.time()) alone gave two day ends
            # within a second the same key, and a follower then applied the older day's deltas (the
            # records of that key) on the newer base.
            self.base_key = max(int(time.time()), self.base_key + 1)
            rows, seconds = self._export(base, "base", p)
            self.done.add_export(BASE_DONEFILE, base, self.base_key, rows=rows, data_path=self.config.root,
                                 monitor={}, workers=self.role.num_workers)
            out.update(base=base, base_rows=rows, base_s=round(seconds, 3))
        if published[1]:
            out["batch_s"] = round(self._scratch("batch", p), 3)
        else:
            rows, seconds = self._export(batch, "batch", p)
            self.done.add_model(ModelRecord(following, self.base_key, batch, DAY_MODEL_PASS))
            out.update(batch_model=batch, batch_rows=rows, batch_s=round(seconds, 3))
        return out

    @staticmethod
    def _log_day_end(day: str, out: dict) -> None:
        """The day end's line (after its last pass's line: `_log`), from `_day_end`'s record."""
        parts = [f"shrink deleted {out['shrunk_rows']} rows" if "shrunk_rows" in out else "no shrink"]
        for what, key, name in (("base", "base", "base"), ("batch model", "batch_model", "batch")):
            if key in out:
                parts.append(f"{what} {out[f'{name}_rows']} rows -> {out[key]} ({out[f'{name}_s']:.2f} s)")
            else:  # recorded by the run that crashed after it: saved aside, only for its statistics
                parts.append(f"{what} published before (its statistics replayed in {out[f'{name}_s']:.2f} s)")
        log.info("stream: day %s ended: %s", day, "; ".join(parts))

    # -- every worker ------------------------------------------------------------------------------

    def _share(self, p: Pass):
        # deferred: pandas, pyarrow (the readers); the stream's launcher imports this module and never reads rows
        from recps.data.dataset import ExamplesSource
        from recps.stream.source import load_share, pass_files, wait_for_splits, worker_files

        c = self.config
        folders = self.plan.split_folders(p)
        waited = wait_for_splits(folders, c.data_donefile, sleep_s=c.data_sleep_second, timeout_s=c.wait_timeout_s)
        files = pass_files(folders)
        whole = self.strategy.mode.name == "sync"  # every thread of every worker takes as many steps
        mine, shard, shards = worker_files(files, self.role.index, self.role.num_workers, whole)
        examples = load_share(mine, self.job.data.schema, self.error_budget)
        source = ExamplesSource(examples, self.shuffle, self.settings.seed)
        return WorkerShards(source, shard, shards), waited, len(files)

    def _evaluate(self, source) -> dict[str, float]:
        """Global metrics of the current model (the servers' values) on the pass, before training."""
        from recps.data.dataset import ExamplesSource  # deferred: pandas, pyarrow (as _share's)

        collection, t = _eval_collection(self.settings.metrics), self.settings.trainer
        mine = source.source.examples
        if source.num_workers > 1:  # sync: this worker's rows of the whole pass
            mine = mine.select(torch.arange(source.worker_index, len(mine), source.num_workers))
        if len(mine):
            with self.fleet.reading_servers():
                probs, targets = self.job.trainer.predict(ExamplesSource(mine, False), t.eval_batch_size)
            update_collection(collection, probs, targets, ExamplesSource(mine, False),  # gauc/pnr: groups by metrics.group_key
                              t.eval_batch_size, self.settings.group_key)
        merged = self.merger.merge(collection)
        return {name: float(v) for name, v in merged.compute().items()}

    def _train(self, source) -> Any:
        from recps.job.loop import TrainStats  # deferred: the readers (pandas, pyarrow), as _share's

        per_thread = -1
        if self.strategy.mode.name == "sync":
            per_thread = min(source.shard_batches(self.batch_size, self.threads))
            if per_thread == 0:  # a thread of some worker has no batch: no step for anyone (each waits for all)
                log.warning("stream: the pass has fewer than %d batches of %d rows: nothing trained on it",
                            self.threads * source.num_workers, self.batch_size)
                return TrainStats(steps=0, examples=0, seconds=0.0, last_loss=float("nan"), first_losses=[],
                                  positions=[(self.passes_done, 0)] * self.threads)
        return self.job.trainer.fit(source, self.batch_size, epochs=1, progress=False,
                                    thread_steps_per_epoch=per_thread, first_epoch=self.passes_done)

    def run(self) -> list[dict]:
        r, zero = self.resume, self.role.index == 0
        if zero:
            self._clear_leftovers()
            if r.adopt is not None:
                self.done.add_model(r.adopt)
                log.info("stream: recorded %s, committed by an earlier run before its record", r.adopt.path)
            if r.publish_delta:
                self._publish_delta(r.publish_delta, {})
        if zero and r.day_end is not None:
            out = self._day_end(r.day_end, r.day_end_published)
            self._log_day_end(r.day_end.day, out)
            self.records.append({"day_end": r.day_end.day, "replayed": list(r.day_end_published), **out})
        self.fleet.barrier("recps.stream.resumed", timeout=self.timeout_s)  # nobody trains before that
        p = r.next
        while p is not None:
            t0 = time.perf_counter()
            source, waited, files = self._share(p)
            record: dict[str, Any] = {"day": p.day, "pass": p.index, "files": files, "wait_s": round(waited, 3)}
            if self.config.eval_before_train:
                t = time.perf_counter()
                record["eval"] = self._evaluate(source)
                record["eval_s"] = round(time.perf_counter() - t, 3)
            stats = self._train(source)
            self.job.steps_done += stats.steps
            self.passes_done += 1
            # This worker's steps, examples and rate; "eval" holds the pass's examples over every worker.
            record.update(step=self.job.steps_done, steps=stats.steps, examples=stats.examples, train_s=round(stats.seconds, 3),
                          examples_per_sec=round(stats.examples_per_sec, 1), loss=stats.last_loss)
            checkpoint, delta = self.plan.saves(p)
            self.fleet.flush()  # every push of this worker applied (geo: its deltas added)
            if checkpoint:
                write_progress(_pass_folder(self.config, p), self.role, self.job.steps_done, stats.positions, self.fleet)
            self.fleet.barrier(f"recps.stream.{p.day}.{p.index}.trained", timeout=self.timeout_s)
            if zero:
                record.update(self._saves(p, checkpoint, delta, record.get("eval", {})))
            self.fleet.barrier(f"recps.stream.{p.day}.{p.index}.saved", timeout=self.timeout_s)
            record["pass_s"] = round(time.perf_counter() - t0, 3)
            del source  # a worker holds one pass at a time
            _release_freed_memory()
            record["rss_mib"] = _rss_mib()
            if zero:
                self._log(record)
            self.records.append(record)
            p = _following(self.plan, p)
        if self.tb is not None:
            self.tb.close()
        return self.records

    def _publish_delta(self, folder: str, monitor: dict) -> None:
        manifest = json.loads(rfs.read_bytes(rfs.join(folder, "manifest.json")))
        rows = int(manifest["progress"]["stream"].get("rows", 0))
        self.done.add_export(PATCH_DONEFILE, folder, self.base_key, rows=rows, data_path=self.config.root,
                             monitor=monitor, workers=self.role.num_workers)

    def _saves(self, p: Pass, checkpoint: bool, delta: bool, monitor: dict) -> dict:
        out: dict[str, Any] = {}
        folder = None
        if delta and self.published_delta == _delta_folder(self.config, p):
            # published by a run that died before this pass's checkpoint: never written again; the rows
            # this training changed go out in the next delta (the statistics its export reset were lost)
            folder = self.published_delta
            out.update(delta=folder, delta_kept=True)
        elif delta:  # first: the checkpoint after it holds the statistics the delta reset
            folder = _delta_folder(self.config, p)
            rows, seconds = self._export(folder, "delta", p)
            t = time.perf_counter()
            # published at once, not after the checkpoint: a follower serves it a checkpoint's save sooner
            self._publish_delta(folder, monitor)
            out.update(delta=folder, delta_rows=rows, delta_s=round(seconds, 3),
                       delta_publish_s=round(time.perf_counter() - t, 3))
        self.published_delta = None
        if checkpoint:
            out["checkpoint"] = _pass_folder(self.config, p)
            out["checkpoint_s"] = round(self._checkpoint(p, folder), 3)
        if p.last:
            out["day_end"] = self._day_end(p)
        return out

    def _log(self, record: dict) -> None:
        e = record.get("eval", {})
        shown = ", ".join(f"{k} {v:.4f}" for k, v in e.items() if k in ("auc", "logloss", "copc"))
        log.info("stream pass %s/%d, step %d: %s%d examples, %.0f examples/s%s, pass %.1f s", record["day"],
                 record["pass"], record["step"], f"before training {shown}; " if shown else "", record["examples"],
                 record["examples_per_sec"], " on worker 0" if self.role.num_workers > 1 else "", record["pass_s"])
        if "day_end" in record:  # after the day's last pass line
            self._log_day_end(record["day"], record["day_end"])
        line = json.dumps({k: v for k, v in record.items()}, sort_keys=True, default=str)
        with open(self.out_dir / METRICS_FILE, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        if self.tb is not None:
            for k, v in e.items():
                self.tb.add_scalar(f"stream/{k}", v, self.passes_done)


def _release_freed_memory() -> None:
    """Hand the heap memory the pass freed back to the OS (glibc's malloc_trim; a no-op elsewhere).

    glibc keeps what a thread frees in that thread's arena, and a pass's reader and training
    threads are new every pass, so each pass could leave its data's freed memory in another arena:
    a worker's RSS rose 72 MiB over a day's 24 passes of 2,000 rows (1 worker, levelling off after
    the 12th), 12 MiB with this (at most 34 above the first pass's). It takes 3-8 ms."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
            _malloc_trim.argtypes, _malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (AttributeError, OSError):  # not glibc: nothing to trim
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None  # glibc's malloc_trim, False where there is none; looked up on first use


def _rss_mib() -> float | None:
    """This process's resident memory now (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return round(next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024, 1)
    except (OSError, StopIteration, ValueError):
        return None


def stream_work(work: StreamWork, role, out_dir: Path, observers: Sequence = ()) -> dict[str, Any] | None:
    """A stream job's worker (recps.train binds it to the composed config for recps.cluster.driver.run_role);
    worker 0 returns and writes metrics.json."""
    # deferred: the batch worker's body and the job's runner import the readers (pandas, pyarrow)
    from recps.cluster.work import STATS_TABLE, ProgressLog
    from recps.job.run import training_observers

    config = work.config
    resume = resume_point(config)  # before init_worker's barrier: worker 0 appends records only after it
    job = work.build_job()
    job.trainer.observers = [*job.trainer.observers, *observers]
    settings = job.settings
    t = settings.trainer
    strategy = DistributedStrategy(work.mode, threads=t.threads)
    if on_this_machine(role):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // role.num_workers))
    manifest = None
    if resume.folder:
        manifest = verify_ps_checkpoint(resume.folder, needed=[*job.collection.table_dims(), DENSE_TABLE],
                                        worker_states=False)
        job.steps_done = resume.steps
    with fleet_for(work.node, role) as fleet:
        fleet.add_collection(job.collection)
        dist = fleet.distributed_optimizer(job.optimizer, strategy)
        fleet.init_worker(load_from=resume.folder)
        if manifest is not None:
            workers = manifest["progress"].get("workers") or []
            same = len(workers) == role.num_workers
            files = [w["state_file"] for w in (workers[role.index:role.index + 1] if same else workers)
                     if w.get("state_file")]
            if files:
                load_worker_state(resume.folder, manifest, files, fleet)
        job.trainer.updater = dist.updater
        job.trainer.prefetch = strategy.mode.prefetches
        fleet.create_dense_table(STATS_TABLE, 4, mode="geo")
        job.trainer.on_step = ProgressLog(t.batch_size, t.threads, job) if role.index == 0 else None
        tables = [*job.collection.table_dims(), DENSE_TABLE]
        if resume.folder:
            log.info("%s resumes stream %s from %s (step %d); next pass %s", role.name, config.root, resume.folder,
                     resume.steps, resume.next.name if resume.next else "none")
        loop = _Loop(settings, role, out_dir, job, fleet, strategy, config, resume, tables, shuffle=work.shuffle,
                     error_budget=work.error_budget)
        cpu = time.process_time()
        with training_observers(job, out_dir, client=fleet.channel(), rank=role.index):
            records = loop.run()
        cpu = time.process_time() - cpu
        fleet.close_communicators()
        passes = [r for r in records if "pass" in r]
        examples, seconds = sum(r["examples"] for r in passes), sum(r["train_s"] for r in passes)
        fleet.push_dense(STATS_TABLE, torch.tensor(  # summed over the workers (a GEO-mode table)
            [float(examples), examples / seconds if seconds else 0.0, seconds, cpu])).wait()
        fleet.barrier("recps.stream.done", timeout=loop.timeout_s)
        if role.index != 0:
            return None
        total_examples, total_rate, _, total_cpu = fleet.pull_dense(STATS_TABLE).tolist()
        metrics: dict[str, Any] = {"stream": {"root": config.root, "out": config.out, "passes": records,
                                              "resumed_from": resume.folder}}
        if tiers := fleet.tier_stats(tables, timeout=loop.timeout_s):  # tables with a disk tier
            metrics["disk_tier"] = tiers
        if passes and passes[-1].get("eval"):
            metrics.update(passes[-1]["eval"])  # the last pass's before-training metrics: the objective
        metrics.update(model=settings.model_target, ps=settings.ps, servers=role.num_servers,
                       workers=role.num_workers, threads=t.threads,
                       train_examples=int(total_examples), examples_per_sec=total_rate, worker_cpu_seconds=total_cpu,
                       train_steps=sum(r["steps"] for r in passes), step=job.steps_done, train_seconds=seconds)
        rfs.write_atomic(str(out_dir / "metrics.json"),
                         json.dumps(metrics, indent=2, sort_keys=True, default=str) + "\n", overwrite=True)
        return metrics


# For pass loops over another trainer (recps.pipeline.incremental: the funnel, every stage on the same servers):
# the loop whose `_share`, `_evaluate` and `_train` a subclass replaces (its waits, saves, donefiles, day
# ends and restarts stay these), and the launcher's checks of stream.out.
PassLoop = _Loop
check_stream_out = _check_out
