"""The streaming funnel (issue 16 point 7): `python -m recps.train pipeline=video_funnel stream=hourly ...`.

Every stage of the funnel trains pass by pass from time-partitioned impressions (HDFS or any recps.fs URL),
each stage in its own PS mode, on ONE set of servers for the whole stream. The pass loop is the stream's
(recps.stream.pass_loop.PassLoop: waits for the splits' donefiles, Paddle's save modes, donefiles, day ends,
exactly-once restarts); this module gives it the funnel's three steps:

    read     the pass's impression files (user_id, item_id, time, click, long_view; `write_world_passes`
             writes a generated world's train impressions in that layout), every worker the whole pass
    evaluate the whole funnel as trained up to the previous pass on the world's held-out requests (seen
             items and item statistics from the passes before this one), every worker its share, the
             metrics merged through the servers (recps.pipeline.held_out). The first pass of a fresh stream has no model yet: nothing is
             evaluated. Each pass's record in <run dir>/stream_metrics.jsonl holds the metrics flat
             (ndcg@10, stage/<stage>/pass_through, most_popular/ndcg@10, ...) and `evaluated_model`, the
             pass whose exports were evaluated with their sha256
    train    first the stages that train on a validation period (`validation`, `validation_exposures`: fusion in
             video_funnel.yaml): a stream's period is the pass itself (`pass_period`), scored by the stages,
             index, counts and item_cf as of the end of the previous pass, as its evaluation read them
             (out-of-sample, as a held-out request gets them); a fresh stream's first pass has no earlier
             model, so they train from the second pass on (pass 1 exports them untrained).
             Then each other stage in order on the pass's impressions (its `trainer.epochs` epochs over the
             pass) (a ranker also on its upstream's candidates from this pass's freshly trained upstream, as
             recps.pipeline.runner). Each stage: its own mode's communicator
             flushed (not closed: it trains again next pass), a barrier; then the stage is exported from
             what the servers hold (<run dir>/funnel/pass-NNNNN/<stage>.pt, and the latest in
             <run dir>/funnel/ for recps.pipeline.recommend) and, for recall, the item index rebuilt

A pass's checkpoint, delta, base and day model (saved by PassLoop on worker 0 after every worker's
pushes are applied) hold every stage's tables: `<stage>_<feature>` sparse tables and `<stage>_dense`
dense tables live on the same servers, so one checkpoint covers the funnel and a restart of the same
command resumes after the last recorded pass with every stage's rows, dense values and GEO replicas.
What only a worker holds goes into its state file of the pass checkpoint (<checkpoint>/workers/
worker-XXXXX.pt, recorded with its sha256 by the manifest): the GEO replicas' keys and accumulators
(Fleet.worker_state) and, under "stages", each stage's local dense state (`_StageTrainer.local_state`:
a GEO stage's dense optimizer, e.g. Adam's moments and step counts; sync and async stages have none, their
servers hold the dense optimizer's state and save it with the dense table). A resume loads them back
(`_load_stage_states`); a GEO stage's replica starts from the servers' dense values, counted as synced,
as the single-model stream's (with one worker these are its values after the pass's final sync).

Item statistics (the `exposures` feature) and the seen filter come from the passes read so far: what a
production funnel knows at that time. Counting features (a ranker's `inputs.counts`, recps.pipeline.counts) are
the servers' statistics in the stage's counting table `<stage>_counts`: each pass reads them as of the end of
the previous pass (its evaluation and its training alike; <run dir>/funnel/pass-NNNNN/counts.pt), and counts
its own impressions once every stage trained on it (<run dir>/funnel/counts.pt, for recommend: as of the end
of the latest pass). The counting tables are saved, loaded and shrunk (day end: decayed) with the others.
The item_cf score (a validation stage's `scores`) is EASE fitted on the passes read so far, refitted after each
pass (`FunnelLoop._item_cf`: <run dir>/funnel/pass-NNNNN/item_cf.pt what the pass read, <run dir>/funnel/
item_cf.pt for recommend), its L2 weight chosen on the job's first fit and kept.
Shapes: N impressions, U users, I items.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from recps import quiet_libraries
from recps import fs as rfs
from recps.cluster.checkpoint import merge_worker_states
from recps.cluster.process import fleet_for, on_this_machine
from recps.config import compose_config
from recps.data.dataset import ExamplesSource
from recps.data.generators.video_world import load
from recps.data.partitions import split_path
from recps.data.sharding import WorkerShards
from recps.errors import ConfigError, DataError
from recps.job.build import seed_everything
from recps.job.checkpoint import read_recorded, verify_ps_checkpoint
from recps.job.loop import Trainer, dense_parameters
from recps.job.settings import JobSettings, NodeSettings
from recps.metrics.ps_merger import PSMerger
from recps.pipeline.counts import COUNTS_EXPORT, count_exposures, counts_table, counts_to_bytes, read_counts
from recps.pipeline.stages import StageSpec
from recps.pipeline.data import (FunnelData, History, ValidationPeriod, csr_from_pairs, exposure_bucket,
                                 period_requests, video_world_dir)
from recps.pipeline.ease import fit_ease
from recps.pipeline.funnel import (EXPORT_DIR, ITEM_CF_EXPORT, Funnel, build_index, build_stage_model, dense_width,
                                   export_stage, load_stage, stage_collection)
from recps.pipeline.runner import load_world, training_examples
from recps.ps.fleet import DistributedStrategy, tier_line
from recps.stream import PassLoop, StreamConfig, resume_point
from recps.stream.plan import StreamPlan, next_day, parse_day
from recps.stream.source import pass_files, wait_for_splits

__all__ = ["Impressions", "FunnelLoop", "FunnelStreamWork", "write_world_passes", "read_pass", "funnel_view",
           "pass_period", "VALIDATION_EXAMPLES", "funnel_stream_work", "flat_metrics", "summary_lines", "main"]

log = logging.getLogger("recps.pipeline")

PASS_FILE = "part-00000.parquet"
# <run dir>/funnel/pass-NNNNN/validation_<stage>.pt: the rows a validation stage trained on that pass (its
# features' keys, dense inputs and labels; worker 0 writes them, tests recompute them)
VALIDATION_EXAMPLES = "validation_{stage}.pt"
COLUMNS = ("user_id", "item_id", "time", "click", "long_view")
_EVAL_TIMEOUT_S = 3600.0  # how long a worker waits for the others to merge a pass's evaluation


# ------------------------------------------------------------------------------ the pass files


@dataclass(frozen=True)
class Impressions:
    """Impressions: users (N,), items (N,) int64, labels (N, 2) float32 (click, long_view), times (N,) int64
    (the world's seconds; what a pass's history features are taken as of)."""

    users: torch.Tensor
    items: torch.Tensor
    labels: torch.Tensor
    times: torch.Tensor

    @staticmethod
    def empty() -> "Impressions":
        none = torch.zeros(0, dtype=torch.int64)
        return Impressions(none, none, torch.zeros(0, 2), none)

    def __len__(self) -> int:
        return int(self.users.numel())

    def __add__(self, other: "Impressions") -> "Impressions":
        return Impressions(*(torch.cat([a, b]) for a, b in ((self.users, other.users), (self.items, other.items),
                                                            (self.labels, other.labels), (self.times, other.times))))


def write_world_passes(world_dir: str, root: str, start_day: str, days: int, hours: int, split_interval: int = 60,
                       layout: str = "hhmm", donefile: str = "_SUCCESS", overwrite: bool = False) -> dict[str, Any]:
    """A generated video world's train impressions (recps.data.generators.video_world, under `world_dir`) as a stream:
    `days` days from `start_day`, each day's first `hours` hours in splits of `split_interval` minutes, split
    s holding the impressions of the s-th of as many equal time windows over the world's train period (its
    30 days compressed into the stream's splits, in time order). Each split folder gets PASS_FILE (parquet,
    COLUMNS) and then its `donefile`, both written atomically. Raises FileExistsError before writing
    anything when a split is complete already (unless `overwrite`). Returns {"splits": [...], "rows": [...]}."""
    day = parse_day(start_day, "start_day")
    if days < 1 or not 1 <= hours <= 24 or split_interval < 1 or (60 * hours) % split_interval:
        raise ConfigError(f"write_world_passes: days={days}, hours={hours}, split_interval={split_interval}; give "
                          "days >= 1, hours in [1, 24] and a split_interval dividing the day's minutes")
    folders = []
    for _ in range(days):
        folders += [split_path(root, day, m, layout) for m in range(0, 60 * hours, split_interval)]
        day = next_day(day)
    done = [f for f in folders if rfs.exists(rfs.join(f, donefile))]
    if done and not overwrite:
        raise FileExistsError(f"stream split {done[0]} is complete (its {donefile} exists); it is never "
                              "overwritten: write elsewhere or pass overwrite=True (--overwrite)")
    train = load(world_dir).train
    times = train["time"].to_numpy(np.int64)
    lo, span = int(times.min()), int(times.max()) - int(times.min()) + 1
    split = (times - lo) * len(folders) // span  # (N,) the split of each impression
    order = np.argsort(split, kind="stable")
    bounds = np.searchsorted(split[order], np.arange(len(folders) + 1))
    frame = train[list(COLUMNS)].iloc[order]
    rows = []
    for s, folder in enumerate(folders):
        part = frame.iloc[bounds[s]:bounds[s + 1]]
        buffer = io.BytesIO()
        part.to_parquet(buffer, index=False)
        rfs.write_atomic(rfs.join(folder, PASS_FILE), buffer.getvalue(), overwrite=True)
        rfs.write_atomic(rfs.join(folder, donefile), b"", overwrite=True)  # last: the split is ready
        rows.append(len(part))
    log.info("stream of %s: %d splits under %s, %d impressions (%d to %d a split)", world_dir, len(folders), root,
             sum(rows), min(rows), max(rows))
    return {"splits": folders, "rows": rows}


def read_pass(files: Sequence[str], num_users: int, num_items: int) -> Impressions:
    """The impressions of a pass's files (parquet with COLUMNS); ids outside the world are a DataError
    naming the file."""
    parts = []
    for f in files:
        try:
            frame = pd.read_parquet(io.BytesIO(rfs.read_bytes(f)), columns=list(COLUMNS))
        except (ValueError, KeyError, OSError) as exc:
            raise DataError(f"stream file {f}: not a funnel impressions file with columns {list(COLUMNS)} ({exc}); "
                            "write the passes with recps.pipeline.incremental.write_world_passes") from exc
        users, items = frame["user_id"].to_numpy(np.int64), frame["item_id"].to_numpy(np.int64)
        bad = (users < 0) | (users >= num_users) | (items < 0) | (items >= num_items)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise DataError(f"stream file {f} row {i}: user {users[i]}, item {items[i]} outside the world's "
                            f"{num_users} users and {num_items} items; stream.root holds another world's passes "
                            "than pipeline.world: write them from this world")
        labels = np.stack([frame["click"].to_numpy(np.float32), frame["long_view"].to_numpy(np.float32)], 1)
        parts.append(Impressions(torch.from_numpy(users), torch.from_numpy(items), torch.from_numpy(labels),
                                 torch.from_numpy(frame["time"].to_numpy(np.int64))))
    out = Impressions.empty()
    for p in parts:
        out = out + p
    return out


def funnel_view(world: FunnelData, history: Impressions, current: Impressions | None = None) -> FunnelData:
    """The world as the funnel knows it at a pass: seen items, the `exposures` item statistics and the
    users' behaviour history (the history features, `History`) from `history` (+ `current`), training
    impressions `current` (None: `history`, what evaluation's most-popular baseline counts). A training
    row's history holds what came strictly before its time; a held-out request's, everything read so far:
    never a later pass. Users, items, held-out requests and the world's ideal are the world's."""
    known = history if current is None else history + current
    train = history if current is None else current
    item_features = dict(world.item_features)
    if "exposures" in item_features:
        item_features["exposures"] = exposure_bucket(known.items, world.num_items)
    return replace(world, item_features=item_features, train_user=train.users, train_item=train.items,
                   train_labels=train.labels, seen=csr_from_pairs(known.users, known.items, world.num_users),
                   train_time=train.times,
                   history=History.of(known.users, known.items, known.times, known.labels, world.num_users))


def pass_period(world: FunnelData, history: Impressions, current: Impressions) -> ValidationPeriod:
    """A pass as the stream's validation period (what the batch funnel's recps.pipeline.data.validation_period
    is for the training data): `fit` is the world as the funnel knew it before the pass (`funnel_view` of
    `history`: seen items, item statistics and behaviour histories of the passes before it), its requests
    (`fit.test_users`) the users with a click in the pass, their clicks `fit.test_positives`; `labels` and
    `shown` over those requests from the pass's impressions (`current`); `rows` index `current`. A stage that
    trains on it reads the stages as of the end of the previous pass: out-of-sample scores, as a held-out
    request gets them."""
    requests, positives, labels, shown = period_requests(current.users, current.items, current.labels)
    fit = replace(funnel_view(world, history), name=f"{world.name} (before the pass)", test_users=requests,
                  test_positives=positives, logged_positives=None, test_shown=None)
    return ValidationPeriod(fit, labels, None, torch.arange(len(current)), shown)


def flat_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """evaluate_funnel's metrics as one flat dict of numbers: the funnel's as they are (ndcg@10),
    `stage/<stage>/<metric>`, `<baseline>/<metric>`, `requests`, `positives`."""
    out: dict[str, float] = {}
    for k, v in (metrics.get("funnel") or {}).items():
        out[k] = float(v)
    for stage, row in (metrics.get("stages") or {}).items():
        out.update({f"stage/{stage}/{k}": float(v) for k, v in row.items() if isinstance(v, (int, float))})
    for name, row in (metrics.get("baselines") or {}).items():
        out.update({f"{name}/{k}": float(v) for k, v in row.items() if isinstance(v, (int, float))})
    for k in ("requests", "positives", "eval_seconds"):
        if isinstance(metrics.get(k), (int, float)):
            out[k] = float(metrics[k])
    return out


@dataclass(frozen=True)
class FunnelStreamWork:
    """What a streaming funnel's worker takes, typed (recps.pipeline.incremental_entry builds it from the
    composed config, after filling the stages' accessors).

    `config`: conf `stream:`; `specs`: the stages (recps.pipeline.stages.pipeline_specs); `settings`: the
    job's (what its checkpoints record, config.yaml; the trainer's threads and batch size, the seed,
    conf `metrics:`); `node`: the cluster's settings; `pipeline`: pipeline.name; `top_n`: pipeline.top_n;
    `index`: pipeline.index (plain), the recall stage's item index; `load_world()`: the world (called
    once the resume point is read); `evaluate(funnel, merger=, worker=, workers=)`:
    recps.pipeline.held_out.evaluate_funnel with the config's EvalSettings; `item_cf`: the EASE settings of
    the item_cf score (recps.pipeline.stages.item_cf_settings) when a stage reads it, else None."""

    config: StreamConfig
    specs: list[StageSpec]
    settings: JobSettings
    node: NodeSettings
    pipeline: str
    top_n: int
    index: dict | None
    load_world: Callable[[], FunnelData]
    evaluate: Callable[..., dict[str, Any]]
    item_cf: dict[str, Any] | None = None


# ------------------------------------------------------------------------------------ a stage


class _StageTrainer:
    """One stage's model, dense table `<stage>_dense` and trainer, kept for the whole stream."""

    def __init__(self, fleet, spec: StageSpec, specs: Sequence[StageSpec], role, timeout_s: float) -> None:
        self.fleet, self.spec, self.role, self.timeout_s = fleet, spec, role, timeout_s
        self.collection = stage_collection(spec)
        self.num_dense = dense_width(spec, specs)
        self.model = build_stage_model(spec, self.collection, self.num_dense)
        task_cfg = OmegaConf.to_container(spec.task, resolve=True)
        task_cfg.pop("objective", None)
        self.task = instantiate(task_cfg, _convert_="all")
        self.dense = [p for _, p in dense_parameters(self.model, self.collection)]
        self.optimizer = instantiate(spec.optimizer)(self.dense)
        self.named = {f"param{i}": p for i, p in enumerate(self.dense)}
        self.table = f"{spec.name}_dense"
        self.trainer = None
        self.updater = None  # mode.dense_updater (start)

    def create_table(self) -> None:
        """The stage's dense table on the servers (every worker; the first one's values win)."""
        self.fleet.create_dense_table(self.table, {n: p.detach() for n, p in self.named.items()},
                                      optimizer=self.spec.mode.dense_rule(self.optimizer), mode=self.spec.mode.name)

    def start(self) -> None:
        """After the tables exist (and a resumed checkpoint was loaded): the servers' dense values, the
        stage mode's updater, the trainer."""
        mode = self.spec.mode
        self.fleet.pull_dense_into(self.table, self.dense, self.timeout_s)  # every worker starts equal
        self.updater = mode.dense_updater(self.named, self.optimizer, self.collection.communicator, self.table)
        self.trainer = Trainer(self.model, self.collection, self.task, self.updater, threads=self.spec.threads,
                               prefetch=mode.prefetches)

    @property
    def has_local_state(self) -> bool:
        """Whether this worker's dense updater holds state the servers do not (geo's local optimizer)."""
        return hasattr(self.updater, "state_dict")

    def local_state(self) -> dict | None:
        """What this worker holds of the stage that the servers do not, for a pass checkpoint: geo's
        {"mode", "optimizer" (its class name), "dense_optimizer" (its state_dict)}; None for sync and
        async (the servers step the dense table and save its optimizer state). Between steps, after a flush."""
        if not self.has_local_state:
            return None
        return {"mode": self.spec.mode.name, "optimizer": type(self.optimizer).__name__,
                "dense_optimizer": self.updater.state_dict()}

    def load_local_state(self, state: dict, source: str) -> None:
        """A `local_state` (read from `source`, named in errors) into this worker's dense updater, before
        training. Raises ConfigError for another optimizer class or other parameters than the stage's."""
        name, have = self.spec.name, type(self.optimizer).__name__
        if state.get("optimizer") != have:
            raise ConfigError(f"stage {name}: {source} holds the state of a {state.get('optimizer')} dense optimizer, "
                              f"pipeline.stages.{name}.optimizer is {have}; resume with the optimizer the stream "
                              "was trained with, or give another stream.out for a fresh stream")
        try:
            self.updater.load_state_dict(state["dense_optimizer"])
        except (ValueError, KeyError, RuntimeError) as exc:
            raise ConfigError(f"stage {name}: {source}: its dense optimizer state does not fit the stage's "
                              f"{len(self.dense)} dense parameters ({exc}); resume with the model the stream was "
                              "trained with, or give another stream.out for a fresh stream") from exc

    def fit(self, examples, seed: int, pass_name: str) -> dict[str, Any]:
        """One pass of the stage on `examples` (this worker's shard), every push applied, all workers met."""
        s, mode = self.spec, self.spec.mode
        if mode.name != "geo":  # sync / async: the servers hold the dense values (geo: the local replica trains on)
            self.fleet.pull_dense_into(self.table, self.dense, self.timeout_s)
        source = WorkerShards(ExamplesSource(examples, shuffle=True, seed=seed), self.role.index, self.role.num_workers)
        per_thread = -1
        if mode.name == "sync":  # every thread of every worker takes the same steps (all read the same pass)
            per_thread = min(source.shard_batches(s.batch_size, s.threads))
        start = time.perf_counter()
        steps = examples_n = 0
        loss = float("nan")
        if per_thread != 0:
            stats = self.trainer.fit(source, s.batch_size, epochs=s.epochs, max_steps=s.max_steps, progress=False,
                                     thread_steps_per_epoch=per_thread)
            steps, examples_n, loss = stats.steps, stats.examples, stats.last_loss
        else:
            log.warning("stream pass %s: stage %s has fewer than %d batches of %d rows: not trained on it (sync)",
                        pass_name, s.name, s.threads * self.role.num_workers, s.batch_size)
        self.collection.communicator.flush()  # every push applied (geo: the last deltas); it trains again next pass
        self.fleet.wait_for_workers(f"pipeline.stream.{pass_name}.{s.name}.trained", timeout=self.timeout_s)
        seconds = time.perf_counter() - start
        log.info("%s: pass %s stage %s (%s): %d steps, %d examples, loss %.4f", self.role.name, pass_name, s.name,
                 mode.name, steps, examples_n, loss)
        return {"mode": mode.name, "steps": steps, "examples": examples_n, "train_rows": len(examples),
                "seconds": round(seconds, 3), "loss": loss}

    def export(self, view: FunnelData) -> bytes:
        """The stage as the servers hold it now (rows and dense values); this worker's own dense values
        stay (geo's replica trains on from them)."""
        own = [p.detach().clone() for p in self.dense]
        self.fleet.pull_dense_into(self.table, self.dense, self.timeout_s)
        try:
            with self.fleet.reading_servers():
                return export_stage(self.spec, self.model, self.collection, view, self.num_dense)
        finally:
            with torch.no_grad():
                for p, value in zip(self.dense, own):
                    p.copy_(value)


# ------------------------------------------------------------------------ the workers' local state

_STAGES_KEY = "stages"  # a worker state file's entry: {stage: _StageTrainer.local_state()}


class _FunnelFleet:
    """The fleet as the pass loop sees it: `worker_state` (what recps.cluster.checkpoint.write_progress saves in this
    worker's state file of a pass checkpoint) adds the stages' local state under "stages"; everything
    else is the fleet's."""

    def __init__(self, fleet, trainers: dict[str, "_StageTrainer"]) -> None:
        self._fleet, self._trainers = fleet, trainers

    def __getattr__(self, name: str):
        return getattr(self._fleet, name)

    def worker_state(self) -> dict:
        state = self._fleet.worker_state()  # the GEO replicas' keys and accumulators (every stage's tables)
        stages = {n: t.local_state() for n, t in self._trainers.items() if t.has_local_state}
        if stages:
            state[_STAGES_KEY] = stages
        return state


def _read_worker_states(folder: str, manifest: dict, files: Sequence[str]) -> list[dict]:
    """The worker state files `files` of the checkpoint `folder`, each checked against its manifest."""
    return [torch.load(io.BytesIO(read_recorded(folder, manifest, rel)), map_location="cpu", weights_only=True)
            for rel in files]


def _load_stage_states(trainers: dict[str, "_StageTrainer"], states: list[dict], files: Sequence[str],
                       folder: str, role) -> list[str]:
    """Each stage's local state (geo's dense optimizer) from the checkpoint's worker `states` (read from
    `files` under `folder`: this worker's own on a resume onto as many workers, else every worker's,
    merged by recps.cluster.checkpoint.merge_worker_states: the moments' means). Returns the stages loaded.

    A checkpoint whose state files hold no "stages" entry was written before the streaming funnel saved
    them (or while no stage kept local state): each GEO stage's optimizer restarts from fresh state, with
    a warning naming it. One that holds the entry but not a GEO stage's state is refused (ConfigError
    naming the stage, the file and the fix): the stage trained in another mode when it was written."""
    stateful = [t for t in trainers.values() if t.has_local_state]
    if not stateful:
        return []
    if not states or not any(_STAGES_KEY in s for s in states):
        for t in stateful:
            log.warning("%s: checkpoint %s holds no local dense optimizer state of stage %s (%s; written before the "
                        "streaming funnel saved it): its %s restarts from fresh state (moments, step counts)",
                        role.name, folder, t.spec.name, t.spec.mode.name, type(t.optimizer).__name__)
        return []
    loaded = []
    for t in stateful:
        name = t.spec.name
        entries = [s.get(_STAGES_KEY, {}).get(name) for s in states]
        for rel, s, e in zip(files, states, entries):
            if e is None:
                raise ConfigError(
                    f"stage {name} ({t.spec.mode.name}): {rfs.join(folder, rel)} holds the local state of stages "
                    f"{sorted(s.get(_STAGES_KEY, {}))} but none of {name}: it trained in another PS mode (sync or "
                    f"async keep no local state) when the checkpoint was written; resume with that mode "
                    f"(ps@pipeline.stages.{name}.ps=...), or give another stream.out for a fresh stream")
        if len(entries) == 1:
            state = entries[0]
        else:
            merged = merge_worker_states([{"dense_optimizer": e["dense_optimizer"]} for e in entries])
            state = {**entries[0], "dense_optimizer": merged["dense_optimizer"]}
        t.load_local_state(state, rfs.join(folder, files[0]) if len(files) == 1 else f"{folder} ({list(files)})")
        loaded.append(name)
    return loaded


# ------------------------------------------------------------------------------------ the loop


@dataclass
class _Tables:
    """What PassLoop reads of a job's collection: the sparse tables it saves, counts and shrinks."""

    dims: dict[str, int]

    def table_dims(self) -> dict[str, int]:
        return self.dims


@dataclass
class _FunnelJob:
    collection: _Tables
    steps_done: int = 0
    trainer: Any = None


@dataclass
class _PassData:
    impressions: Impressions
    files: list[str] = field(default_factory=list)


@dataclass
class _PassStats:  # what PassLoop.run reads of a pass's training (recps.job.loop.TrainStats' fields)
    steps: int
    examples: int
    seconds: float
    last_loss: float
    positions: list

    @property
    def examples_per_sec(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else 0.0


class FunnelLoop(PassLoop):
    """PassLoop with the funnel's read, evaluate and train (see the module docstring)."""

    def __init__(self, work: FunnelStreamWork, role, out_dir: Path, fleet, strategy, resume, tables, *, world,
                 trainers: dict[str, _StageTrainer], history: Impressions, steps: int) -> None:
        sparse = [*tables["sparse"], *tables["counts"]]  # saved, counted and shrunk at day end alike
        super().__init__(work.settings, role, out_dir, _FunnelJob(_Tables({t: 0 for t in sparse}), steps),
                         _FunnelFleet(fleet, trainers), strategy, work.config, resume, [*sparse, *tables["dense"]])
        self.work = work
        self.specs, self.world, self.trainers = work.specs, world, trainers
        self.history = history
        self.counted = [s for s in self.specs if s.counts]
        # the stages trained on the stream's validation period, each pass's impressions (`_train_validation`)
        self.validating = [s for s in self.specs if s.validates]
        self.item_cf = None  # EASE of the passes read so far, for the stages reading item_cf (`_item_cf`)
        self.item_cf_rows = -1  # ... fitted on that many impressions
        self.item_cf_l2: float | None = None  # λ chosen on this job's first fit, then kept
        # stage -> Counts as of the end of the previous pass (recps.pipeline.counts); None: not read since the
        # servers' statistics last changed (a pass counted its impressions, a day end shrank, a restart)
        self.counts: dict[str, Any] | None = None
        self.stages: dict[str, Any] = {}
        self.index = None
        self.model_pass: str | None = None  # the pass whose training the current exports hold
        self.model_sha: dict[str, str] = {}
        self.model_from: str | None = None  # the checkpoint a resumed job's first evaluated model was loaded from
        self.pending: dict[str, Any] = {}  # worker 0: what this pass's record gets beside PassLoop's fields
        self.export_root = rfs.join(str(Path(out_dir).resolve()), EXPORT_DIR)
        self.funnel_merger = None  # one worker: nothing to merge
        if role.num_workers > 1:
            self.funnel_merger = PSMerger(fleet.channel(), prefix="recps.pipeline.stream.eval",
                                          timeout_s=max(self.timeout_s, _EVAL_TIMEOUT_S))

    # -- the three steps ----------------------------------------------------------------------------

    def _share(self, p):
        c = self.config
        folders = self.plan.split_folders(p)
        waited = wait_for_splits(folders, c.data_donefile, sleep_s=c.data_sleep_second, timeout_s=c.wait_timeout_s)
        files = pass_files(folders)
        return _PassData(read_pass(files, self.world.num_users, self.world.num_items), files), waited, len(files)

    def _evaluate(self, source: _PassData) -> dict[str, float]:
        """The whole funnel as trained up to the previous pass, on the held-out requests: every worker its
        share (requests w, w + W, ...), merged through the servers (recps.pipeline.held_out); worker 0 keeps
        the metrics for the pass's record."""
        if not self.stages and self.resume.folder:
            self.refresh()  # a resumed job (after PassLoop redid a day end cut short): the servers' model
        if not self.stages:
            self.pending = {"evaluated_model": None}  # a fresh stream's first pass: no model yet
            return {}
        view = funnel_view(self.world, self.history)
        funnel = Funnel(self.specs, self.stages, self.index, view, item_cf=self._item_cf(),
                        counts=self._read_counts(view))
        metrics = self.work.evaluate(funnel, merger=self.funnel_merger, worker=self.role.index,
                                     workers=self.role.num_workers)
        if self.role.index != 0:
            return {}
        metrics.pop("final_lists", None)
        out = flat_metrics(metrics)
        self.pending = {"evaluated_model": {"pass": self.model_pass, "sha256": dict(self.model_sha),
                                            "loaded_from": self.model_from}}
        self.model_from = None
        top = self.work.top_n
        log.info("stream funnel, pass %d before training: ndcg@%d %.4f, hit_rate %.4f (the model of pass %s)",
                 self.passes_done + 1, top, out.get(f"ndcg@{top}", float("nan")), out.get("hit_rate", float("nan")),
                 self.model_pass)
        return out

    def _read_counts(self, view: FunnelData) -> dict[str, Any]:
        """The counting stages' statistics as the servers hold them: the end of the previous pass (this pass
        counts its impressions only after every stage trained on it). Read once a pass: its evaluation and
        its training share them."""
        if self.counts is None:
            self.counts = {s.name: read_counts(self.fleet, s, view, self.timeout_s) for s in self.counted}
        return self.counts

    def _item_cf(self):
        """The item_cf score's EASE (when a stage reads it): fitted on the passes read so far (`history`), once
        per pass: what this pass's evaluation and validation stages read (their requests come after every
        impression it saw) and, written to <run dir>/funnel/item_cf.pt once a pass is trained, what recommend
        serves. λ is chosen from pipeline.baselines.ease.grid on this job's first fit and kept (a choice fits
        EASE once per grid value: ~30 s at the default size under load, a fit with λ given ~8 s)."""
        if self.work.item_cf is None or not len(self.history):
            return None
        if self.item_cf_rows != len(self.history):
            what = (f"item_cf of the stream's {len(self.history)} impressions read so far"
                    + (f" (l2 chosen on this job's first fit, {self.item_cf_l2:g})" if self.item_cf_l2 else ""))
            self.item_cf = fit_ease(funnel_view(self.world, self.history), self.work.item_cf, self.work.top_n, what,
                                    l2=self.item_cf_l2)
            self.item_cf_l2, self.item_cf_rows = self.item_cf.l2, len(self.history)
        return self.item_cf

    def _train_validation(self, current: Impressions, counts: dict[str, Any], pass_name: str, folder: str,
                          view: FunnelData, trained: dict[str, Any]) -> dict[str, Any]:
        """The validation stages first (before any stage trains on the pass): each on the pass as its validation
        period (`pass_period`), scored by the stages, index, item_cf and counts as of the end of the previous
        pass, as the pass's held-out requests were evaluated. A fresh stream's first pass has no earlier model:
        they do not train on it (steps 0), their export is untrained (the dense parameters as initialised; no
        embedding row was created: they read as zeros), and the second pass evaluates that. Returns their
        StageModels."""
        if not self.validating:
            return {}
        period = funnel = None
        if self.stages:
            period = pass_period(self.world, self.history, current)
            funnel = Funnel(self.specs, self.stages, self.index, period.fit, item_cf=self._item_cf(), counts=counts)
        else:
            log.info("stream pass %s: no model before it, so stage(s) %s do not train on it: a stream's validation "
                     "period is a pass scored by the stages of the previous one; they train from pass %d on (their "
                     "export of this pass is untrained: dense parameters as initialised, no embedding rows)", pass_name,
                     ", ".join(s.name for s in self.validating), self.passes_done + 2)
        out = {}
        for s in self.validating:
            seed = self.settings.seed + s.index + 1000 * self.passes_done
            if period is None:
                trained[s.name] = {"mode": s.mode.name, "steps": 0, "examples": 0, "train_rows": 0, "seconds": 0.0,
                                   "loss": float("nan"), "prepare_seconds": 0.0, "validation": None}
            else:
                t = time.perf_counter()
                examples = training_examples(s, self.specs, period.fit, funnel, seed, period)
                prepare_s = time.perf_counter() - t
                if self.role.index == 0:  # what it trains on (tests recompute it)
                    buffer = io.BytesIO()
                    torch.save({"features": list(examples.feature_names), "keys": examples.keys,
                                "dense": examples.dense, "labels": examples.labels}, buffer)
                    rfs.write_atomic(rfs.join(folder, VALIDATION_EXAMPLES.format(stage=s.name)), buffer.getvalue(),
                                     overwrite=True)
                trained[s.name] = self.trainers[s.name].fit(examples, seed, pass_name)
                trained[s.name]["prepare_seconds"] = round(prepare_s, 3)
                trained[s.name]["validation"] = {"requests": int(period.fit.test_users.numel()),
                                                 "clicks": int(period.labels[0].items.numel()),
                                                 "rows": len(examples), "model": self.model_pass}
            out[s.name] = self._export_stage(s, view, folder, trained[s.name])
        return out

    def _export_stage(self, s: StageSpec, view: FunnelData, folder: str, record: dict[str, Any]):
        """Stage `s` exported from what the servers hold (its sha256 into `record`), written by worker 0 into the
        pass's folder and as the latest export; returns it loaded (a StageModel)."""
        blob = self.trainers[s.name].export(view)
        record["export_sha256"] = hashlib.sha256(blob).hexdigest()
        if self.role.index == 0:
            rfs.write_atomic(rfs.join(folder, f"{s.name}.pt"), blob, overwrite=True)
            rfs.write_atomic(rfs.join(self.export_root, f"{s.name}.pt"), blob, overwrite=True)
        return load_stage(s, blob)

    def _train(self, source: _PassData) -> _PassStats:
        current = source.impressions
        pass_name = f"{self.passes_done + 1}"
        view = funnel_view(self.world, self.history, current)
        counts = self._read_counts(view)  # as of the end of the previous pass: what the evaluation read
        seed = self.settings.seed
        stages: dict[str, Any] = {}
        index = None
        trained: dict[str, Any] = {}
        folder = rfs.join(self.export_root, f"pass-{self.passes_done + 1:05d}")
        if counts and self.role.index == 0:  # what this pass's rankers read (tests recount it)
            rfs.write_atomic(rfs.join(folder, COUNTS_EXPORT), counts_to_bytes(counts), overwrite=True)
        if self.validating and not self.stages and self.resume.folder:
            self.refresh()  # a resumed job that evaluated nothing (stream.eval_before_train false): the model read
        if self.validating and self.stages and self._item_cf() is not None and self.role.index == 0:
            # the item_cf its evaluation and validation stages read (tests refit it)
            rfs.write_atomic(rfs.join(folder, ITEM_CF_EXPORT), self.item_cf.to_bytes(), overwrite=True)
        validated = self._train_validation(current, counts, pass_name, folder, view, trained)
        for s in self.specs:
            if s.name in validated:  # trained first, on the pass scored by the previous pass's stages
                stages[s.name] = validated[s.name]
                continue
            funnel = Funnel(self.specs, stages, index, view, counts=counts) if stages else None
            t = time.perf_counter()
            examples = training_examples(s, self.specs, view, funnel, seed + s.index + 1000 * self.passes_done)
            prepare_s = time.perf_counter() - t
            trained[s.name] = self.trainers[s.name].fit(examples, seed + s.index + 1000 * self.passes_done, pass_name)
            trained[s.name]["prepare_seconds"] = round(prepare_s, 3)
            stages[s.name] = self._export_stage(s, view, folder, trained[s.name])
            if s.is_retrieval:
                vectors = stages[s.name].vectors(view, items=torch.arange(view.num_items))  # (I, E)
                index = build_index(vectors, self.work.index)
                if self.role.index == 0:
                    index.save(rfs.join(self.export_root, "items.ann"), overwrite=True)
        if self.counted:  # the pass's impressions counted once every stage trained on them: the next pass reads them
            count_exposures(self.fleet, self.counted, view, torch.arange(len(current)), self.role.index,
                            self.role.num_workers, self.timeout_s, f"pipeline.stream.{pass_name}.counted")
            self.counts = None  # changed: the next pass reads them again (after any day-end shrink)
            if self.role.index == 0:  # serving (recommend) reads the counts as of the end of this pass
                latest = {s.name: read_counts(self.fleet, s, view, self.timeout_s) for s in self.counted}
                rfs.write_atomic(rfs.join(self.export_root, COUNTS_EXPORT), counts_to_bytes(latest), overwrite=True)
        self.history = self.history + current
        self.stages, self.index = stages, index
        if self._item_cf() is not None and self.role.index == 0:  # what recommend serves: EASE of every pass so far
            rfs.write_atomic(rfs.join(self.export_root, ITEM_CF_EXPORT), self.item_cf.to_bytes(), overwrite=True)
        trained = {s.name: trained[s.name] for s in self.specs}  # the stages' order (validation ones trained first)
        self.model_sha = {n: t["export_sha256"] for n, t in trained.items()}
        self.pending["stages"] = trained
        self.pending["exports"] = folder
        steps = sum(t["steps"] for t in trained.values())
        examples = sum(t["examples"] for t in trained.values())
        seconds = sum(t["seconds"] for t in trained.values())
        losses = [trained[s.name]["loss"] for s in self.specs if trained[s.name]["steps"]]  # the last that trained
        return _PassStats(steps, examples, seconds, losses[-1] if losses else float("nan"),
                          [(self.passes_done, 0)] * self.specs[0].threads)

    def _log(self, record: dict) -> None:
        record.update(self.pending)
        self.model_pass = f"{record['day']}/{record['pass']}"
        self.pending = {}
        super()._log(record)

    def refresh(self) -> None:
        """A resumed job (every worker, before its first pass's evaluation): every stage exported from what
        the servers loaded, so that the evaluation reads the model of the last recorded pass."""
        view = funnel_view(self.world, self.history)
        for s in self.specs:
            blob = self.trainers[s.name].export(view)
            self.model_sha[s.name] = hashlib.sha256(blob).hexdigest()
            self.stages[s.name] = load_stage(s, blob)
            if s.is_retrieval:
                vectors = self.stages[s.name].vectors(view, items=torch.arange(view.num_items))
                self.index = build_index(vectors, self.work.index)
        self.model_pass = "/".join(str(self.resume.folder).rstrip("/").split("/")[-2:])  # <day>/<pass>
        self.model_from = self.resume.folder


# ---------------------------------------------------------------------------------- the processes


def _stage_tables(specs: Sequence[StageSpec]) -> dict[str, list[str]]:
    """The stages' sparse tables (their collections'), counting tables (recps.pipeline.counts; saved, loaded
    and shrunk with the others) and dense tables."""
    sparse = [t for s in specs for t in stage_collection(s).table_dims()]
    return {"sparse": sparse, "counts": [counts_table(s.name) for s in specs if s.counts],
            "dense": [f"{s.name}_dense" for s in specs]}


def _passes_before(config, stop) -> list:
    """The stream's passes from its first one up to `stop` (excluded; None: all, up to stream.end_day)."""
    plan, out = StreamPlan(config), []
    for day in plan.days(config.start_day):
        for p in plan.passes_of_day(day):
            if stop is not None and p == stop:
                return out
            out.append(p)
    return out


def funnel_stream_work(work: FunnelStreamWork, role, out_dir: Path) -> dict[str, Any] | None:
    """A worker of the streaming funnel (recps.pipeline.incremental_entry binds it to the composed config
    for recps.cluster.driver.run_role); worker 0 returns the metrics."""
    config, specs = work.config, work.specs
    resume = resume_point(config)  # before init_worker's barrier: worker 0 appends records only after it
    world = work.load_world()
    seed_everything(work.settings.seed)
    if on_this_machine(role):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // role.num_workers))
    tables = _stage_tables(specs)
    timeout_s = max(float(s.mode.timeout_s) for s in specs) * 10
    manifest = None
    if resume.folder:
        manifest = verify_ps_checkpoint(resume.folder, needed=[*tables["sparse"], *tables["counts"], *tables["dense"]],
                                        worker_states=False)
    history = Impressions.empty()
    plan = StreamPlan(config)
    for p in _passes_before(config, resume.next) if resume.folder else ():  # seen items, item statistics
        history = history + read_pass(pass_files(plan.split_folders(p)), world.num_users, world.num_items)
    with fleet_for(work.node, role) as fleet:
        trainers = {s.name: _StageTrainer(fleet, s, specs, role, timeout_s) for s in specs}
        for s in specs:
            fleet.add_collection(trainers[s.name].collection, mode=s.mode)
        strategy = DistributedStrategy(mode=specs[0].mode, threads=specs[0].threads)
        fleet.init_worker(strategy, load_from=resume.folder)  # every stage's sparse tables, loaded if resumed
        for t in trainers.values():
            t.create_table()
        for s in specs:
            if s.counts:
                fleet.create_counting_table(counts_table(s.name), s.mode.table.accessor, timeout=timeout_s)
        fleet.wait_for_workers("pipeline.stream.tables", timeout=timeout_s)
        if manifest is not None:
            if role.index == 0:  # the stages' dense and counting tables of the checkpoint (init_worker: the others)
                fleet.load(resume.folder, tables=[*tables["dense"], *tables["counts"]], timeout=timeout_s)
            fleet.wait_for_workers("pipeline.stream.loaded", timeout=timeout_s)
        for t in trainers.values():
            t.start()
        if manifest is not None:
            workers = manifest["progress"].get("workers") or []
            same = len(workers) == role.num_workers
            files = [w["state_file"] for w in (workers[role.index:role.index + 1] if same else workers)
                     if w.get("state_file")]
            states = _read_worker_states(resume.folder, manifest, files)
            if states:  # geo: the replicas' keys and accumulators (recps.cluster.checkpoint.load_worker_state's)
                fleet.load_worker_state(states[0] if len(states) == 1 else merge_worker_states(states))
            loaded = _load_stage_states(trainers, states, files, resume.folder, role)  # geo: the dense optimizers
            log.info("%s resumes the streaming funnel %s from %s (local dense state of %s); next pass %s", role.name,
                     config.root, resume.folder, loaded or "no stage", resume.next.name if resume.next else "none")
        loop = FunnelLoop(work, role, out_dir, fleet, strategy, resume, tables, world=world, trainers=trainers,
                          history=history, steps=resume.steps)
        records = loop.run()
        fleet.close_communicators()
        server_tables = {s.name: {t: fleet.table_mode(t)
                                  for t in [*trainers[s.name].collection.table_dims(), f"{s.name}_dense"]}
                         for s in specs}
        fleet.barrier("pipeline.stream.done", timeout=loop.timeout_s)
        if role.index != 0:
            return None
        passes = [r for r in records if "pass" in r]
        metrics: dict[str, Any] = {"stream": {"root": config.root, "out": config.out, "passes": records,
                                              "resumed_from": resume.folder},
                                   "pipeline": work.pipeline, "stage_order": [s.name for s in specs],
                                   "server_tables": server_tables, "workers": role.num_workers,
                                   "servers": role.num_servers,
                                   "train_steps": sum(r["steps"] for r in passes),
                                   "train_examples": sum(r["examples"] for r in passes)}
        if tiers := fleet.tier_stats(timeout=loop.timeout_s):  # tables with a disk tier (ps.table.memory_budget)
            metrics["disk_tier"] = tiers
        evaluated = [r for r in passes if r.get("eval")]
        if evaluated:
            metrics["funnel"] = evaluated[-1]["eval"]  # the last pass's, before training on it
            metrics.update(evaluated[-1]["eval"])  # flat too: a sweep's objective
        rfs.write_atomic(str(Path(out_dir) / "metrics.json"),
                         json.dumps(metrics, indent=2, sort_keys=True, default=str) + "\n", overwrite=True)
        return metrics


def summary_lines(metrics: dict[str, Any], top_n: int = 10) -> list[str]:
    """A line per pass: its funnel metrics before training, then each stage's mode and steps."""
    lines = []
    order = list(metrics.get("stage_order") or ())
    for r in (metrics.get("stream") or {}).get("passes") or ():
        if "pass" not in r:
            continue
        e = r.get("eval") or {}
        head = f"pass {r['day']}/{r['pass']}: "
        if e:
            head += (f"before training (model of {(r.get('evaluated_model') or {}).get('pass')}) "
                     f"ndcg@{top_n}={e.get(f'ndcg@{top_n}', float('nan')):.4f} "
                     f"hit_rate={e.get('hit_rate', float('nan')):.4f} "
                     f"most_popular ndcg@{top_n}={e.get(f'most_popular/ndcg@{top_n}', float('nan')):.4f}; ")
        else:
            head += "no model before it; "
        stages = r.get("stages") or {}
        head += ", ".join(f"{n} {stages[n].get('mode')} {stages[n].get('steps')} steps"
                          for n in [*(o for o in order if o in stages), *(n for n in stages if n not in order)])
        lines.append(head + f" ({r.get('pass_s', float('nan'))} s)")
    return lines + [tier_line(name, t) for name, t in sorted((metrics.get("disk_tier") or {}).items())]


# ------------------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> int:
    """python -m recps.pipeline.incremental --root URL --start-day YYYYMMDD [--days N --hours H] [OVERRIDES ...]

    The world of the training command's own overrides (pipeline=video_funnel pipeline.world.users=...:
    generated under pipeline.world.dir if it is not there yet) written as the stream's passes."""
    p = argparse.ArgumentParser(prog="python -m recps.pipeline.incremental",
                                description="Write a generated video world's train impressions as hourly passes.")
    p.add_argument("--root", required=True, help="the stream's root (stream.root), any recps.fs URL")
    p.add_argument("--start-day", required=True, help="YYYYMMDD (stream.start_day)")
    p.add_argument("--days", type=int, default=1)
    p.add_argument("--hours", type=int, default=24, help="stream.hours")
    p.add_argument("--split-interval", type=int, default=60, help="stream.split_interval (minutes)")
    p.add_argument("--layout", default="hhmm", help="stream.layout")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("overrides", nargs="*", help="the training command's overrides: pipeline=video_funnel "
                   "pipeline.world.users=... (the world they name is generated if needed)")
    a = p.parse_args(argv)
    quiet_libraries()  # the libraries' import-time lines a user cannot act on
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = compose_config(a.overrides)
        world = cfg.get("pipeline", {}).get("world") or {}
        if world.get("_target_") != "recps.pipeline.data.video_world":
            raise ConfigError(f"pipeline.world._target_={world.get('_target_')!r}: the passes are written from a "
                              "generated video world; give pipeline=video_funnel (and its pipeline.world.* overrides)")
        load_world(cfg)  # generates it under pipeline.world.dir when it is not there
        settings = {k: v for k, v in OmegaConf.to_container(world, resolve=True).items() if k != "_target_"}
        home = video_world_dir(**settings)  # pipeline.world.dir, or its sibling if that holds another world
        out = write_world_passes(home, a.root, a.start_day, a.days, a.hours, a.split_interval, a.layout,
                                 overwrite=a.overwrite)
    except (ConfigError, DataError, FileExistsError) as e:
        p.error(str(e))
    print(json.dumps({"world": home, "splits": len(out["splits"]), "rows": out["rows"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
