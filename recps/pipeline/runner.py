"""`python -m recps.train pipeline=video_funnel`: every stage of the funnel on one set of parameter servers.

The launcher (recps.cluster.driver.run_distributed) checks the pipeline config and the data before any process
starts, then starts `cluster.servers` servers and `cluster.workers` workers; each worker runs
`funnel_work`:

    one Fleet; every stage's collection registered with its own mode (tables `<stage>_d<D>`, tagged with
    the mode on the servers), the first stage's mode the strategy's; a feature in a stage's
    `inputs.share` reads the owner stage's table, frozen (recps.pipeline.funnel.SharedBagCollection)
    for each group of `pipeline.schedule` (default: one stage per group, in order; the stages of a group
    are independent -- none reads another's candidates, scores or table -- and train at the same time,
    each on its own thread of every worker with its own communicator in its own mode), for each stage:
        its training data: recall, the clicked exposures; a ranker, the exposures with their labels plus
            `candidates_per_user` unexposed candidates of its upstream (label 0), as production funnels
            train, and/or (`validation`) what its upstream keeps for the validation period's requests,
            labelled by that period; `scores` stages' probabilities of each pair as dense inputs
        its dense table `<stage>_dense` (created by every worker, the first one's values win), a trainer
            whose updater is the stage mode's; this worker's shard of the data; sync: equal steps
        flush the stage's communicator (geo: the last deltas), barrier
        export what the servers hold for it (read-only view): worker 0 writes <run dir>/funnel/<stage>.pt;
            every worker loads the same export (the next stage's candidates come from it)
        recall: item vectors -> the item index (worker 0 writes <run dir>/funnel/items.ann)
    with a validation stage (pipeline.validation_fraction), every stage trains on the exposures before each
    user's validation period (recps.pipeline.data.validation_period); then the stages of `pipeline.refresh`
    train again on all training exposures and are exported (and indexed) again
    every worker evaluates the funnel on its share of the held-out requests (recps.pipeline.held_out); the
    metrics merge through the servers (recps.metrics.ps_merger); worker 0 writes <run dir>/metrics.json and
    <run dir>/funnel/final_lists.json (its requests' lists); the launcher prints each stage's metrics and
    the funnel's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from recps import fs as rfs
from recps.data.dataset import ExamplesSource
from recps.data.sharding import WorkerShards
from recps.errors import ConfigError, PSTimeoutError
from recps.job.build import seed_everything
from recps.job.loop import Trainer, dense_parameters
from recps.job.settings import node_settings
from recps.metrics.ps_merger import PSMerger
from recps.ps.fleet import DistributedStrategy, tier_line
from recps.pipeline.stages import (StageSpec, check_data, eval_settings, item_cf_settings, pipeline_specs,
                                  refresh_epochs, schedule, validation_fraction)
from recps.pipeline.data import (HISTORY_FEATURES, FunnelData, ValidationPeriod, load_world, pair_examples,
                                 validation_period)
from recps.pipeline.counts import COUNTS_EXPORT, COUNTS_TRAIN_EXPORT, count_exposures, counts_table, counts_to_bytes, read_counts
from recps.pipeline.ease import fit_ease
from recps.pipeline.held_out import evaluate_funnel, hits
from recps.pipeline.funnel import (EXPORT_DIR, ITEM_CF_EXPORT, Funnel, build_index, build_stage_model, candidate_times, dense_width,
                                   export_stage, load_stage, pair_times, stage_collection)

__all__ = ["run_pipeline", "funnel_work", "load_world", "training_examples", "summary_lines"]

log = logging.getLogger("recps.pipeline")

_EVAL_TIMEOUT_S = 3600.0  # how long a worker waits for the others' evaluation of the funnel (its merge rounds)


def run_pipeline(cfg: DictConfig, out_dir: Path) -> float:
    """recps.pipeline.run_pipeline's entry with pipeline != none and no stream: launch the cluster (or be one of its processes), then
    print and write the funnel's metrics; returns pipeline.objective (NaN in the cluster's processes)."""
    from recps.cluster.driver import run_distributed  # deferred: the cluster layer sits beside the pipeline, not below

    if cfg.ps.name not in ("sync", "async", "geo"):
        raise ConfigError(f"pipeline={cfg.pipeline.name} trains on the parameter server; ps={cfg.ps.name!r}: "
                          "drop ps=local (each stage's mode is pipeline.stages.<stage>.ps)")
    specs = pipeline_specs(cfg)  # a bad stage fails here, in the launcher, before any process starts

    def before_launch(c, mode, d) -> None:
        data = load_world(c)
        check_data(specs, data)

    metrics = run_distributed(cfg, out_dir, work=funnel_work, before_launch=before_launch)
    if metrics is None:
        return float("nan")
    rfs.write_atomic(str(Path(out_dir) / "metrics.json"), json.dumps(metrics, indent=2, sort_keys=True, default=str)
                     + "\n", overwrite=True)
    for line in summary_lines(metrics):
        print(f"[recps] {line}")  # entry point: the lines a user reads
    print(f"[recps] metrics: {Path(out_dir) / 'metrics.json'}")
    objective = str(cfg.pipeline.get("objective") or "ndcg@10")
    value = metrics.get("funnel", {}).get(objective)
    return float(value) if isinstance(value, (int, float)) else float("nan")


# ------------------------------------------------------------------------------------- the worker


def training_examples(spec: StageSpec, specs, data: FunnelData, funnel: Funnel | None, seed: int,
                      period: ValidationPeriod | None = None):
    """The stage's training Examples (see the module docstring); `data` is what the stages train on
    (`period.fit` when a stage trains on the validation period)."""
    if spec.is_retrieval:
        clicked = data.train_labels[:, 0] > 0
        users, items = data.train_user[clicked], data.train_item[clicked]
        counts = torch.bincount(items, minlength=data.num_items).to(torch.float64)  # (I,)
        log_q = torch.log((counts + 1.0) / (counts.sum() + data.num_items)).to(torch.float32)  # (I,)
        labels = torch.stack([torch.ones(users.numel()), log_q[items]], 1)  # (N, 2): label, log Q(item)
        times = None  # a query tower that reads history: as of each click (strictly before it)
        if any(f in HISTORY_FEATURES for f in spec.features):
            times = pair_times(spec, data, users, data.train_time[clicked])
        return pair_examples(data, spec.features, users, items, labels=labels, times=times)
    users, items, labels, times = [], [], [], []  # times: as of when history features are read (funnel.pair_times)
    if "exposures" in spec.train_on:
        times.append(data.train_time)
        users.append(data.train_user)
        items.append(data.train_item)
        labels.append(data.train_labels)
    if "candidates" in spec.train_on and spec.candidates_per_user > 0:
        train_users = torch.unique(data.train_user)
        if spec.candidate_users and train_users.numel() > spec.candidate_users:
            pick_users = torch.randperm(train_users.numel(), generator=torch.Generator().manual_seed(seed))
            train_users = torch.sort(train_users[pick_users[: spec.candidate_users]]).values
        kept = []
        for part in train_users.split(64):
            kept.append(funnel.run(part, until=spec.upstream).kept[spec.upstream])  # (B, K) unseen candidates
        kept = torch.cat(kept)  # (U', K)
        g = torch.Generator().manual_seed(seed)
        pick = torch.rand(kept.shape, generator=g).argsort(1)[:, : spec.candidates_per_user]  # (U', c)
        cand = kept.gather(1, pick)
        owner = train_users.unsqueeze(1).expand_as(cand)
        valid = cand >= 0
        users.append(owner[valid])
        items.append(cand[valid])
        labels.append(torch.zeros(int(valid.sum()), data.train_labels.shape[1]))
        times.append(candidate_times(data, owner[valid], seed))
    if "validation" in spec.train_on:  # what the funnel so far keeps for the period's requests, labelled
        requests = period.fit.test_users  # (R,)
        kept = torch.cat([funnel.run(part, until=spec.upstream).kept[spec.upstream] for part in requests.split(64)])
        valid = kept >= 0  # (R, K)
        owner = requests.unsqueeze(1).expand_as(kept)
        users.append(owner[valid])
        items.append(kept[valid])
        labels.append(torch.stack([hits(kept, csr, data.num_items)[valid] for csr in period.labels], 1).float())
        times.append(data.request_times(owner[valid]))
    if "validation_exposures" in spec.train_on:  # what the period showed its requests, labelled by it
        shown = period.shown
        owner = period.fit.test_users[shown.row_ids()]  # (P,)
        users.append(owner)
        items.append(shown.items)
        lists = shown.padded()  # (R, longest), -1 after each request's end: its entries in shown's order
        labels.append(torch.stack([hits(lists, csr, data.num_items)[lists >= 0] for csr in period.labels],
                                  1).float())
        times.append(data.request_times(owner))
    users, items, labels = torch.cat(users), torch.cat(items), torch.cat(labels)
    times = None if any(t is None for t in times) else torch.cat(times)
    dense = funnel.dense_inputs(spec, users, items, times) if spec.reads_dense else None
    return pair_examples(data, spec.features, users, items, labels=labels, dense=dense,
                         times=pair_times(spec, data, users, times))


def _train_stage(fleet, spec: StageSpec, model, collection, examples, role, timeout_s: float,
                 phase: str = "") -> dict[str, Any]:
    task_cfg = OmegaConf.to_container(spec.task, resolve=True)
    task_cfg.pop("objective", None)
    task = instantiate(task_cfg, _convert_="all")
    dense = [p for _, p in dense_parameters(model, collection)]
    optimizer = instantiate(spec.optimizer)(dense)
    named = {f"param{i}": p for i, p in enumerate(dense)}
    table = f"{spec.name}_dense"
    mode = spec.mode
    fleet.create_dense_table(table, {n: p.detach() for n, p in named.items()},
                             optimizer=mode.dense_rule(optimizer), mode=mode.name)
    fleet.wait_for_workers(f"pipeline.{spec.name}{phase}.tables", timeout=timeout_s)
    fleet.pull_dense_into(table, dense, timeout_s)  # every worker starts equal
    communicator = collection.communicator
    updater = mode.dense_updater(named, optimizer, communicator, table)
    trainer = Trainer(model, collection, task, updater, threads=spec.threads, prefetch=mode.prefetches)
    source = WorkerShards(ExamplesSource(examples, shuffle=True, seed=spec.index), role.index, role.num_workers)
    per_thread = -1
    if mode.name == "sync":  # every thread of every worker takes the same steps
        per_thread = min(source.shard_batches(spec.batch_size, spec.threads))
    start = time.perf_counter()
    stats = trainer.fit(source, spec.batch_size, epochs=spec.epochs, max_steps=spec.max_steps, progress=False,
                        thread_steps_per_epoch=per_thread)
    communicator.flush()  # what is queued goes out (geo: the last deltas); a refresh may train it again
    fleet.wait_for_workers(f"pipeline.{spec.name}{phase}.trained", timeout=timeout_s)
    fleet.pull_dense_into(table, dense, timeout_s)  # the servers' values
    seconds = time.perf_counter() - start
    log.info("%s: stage %s trained in %s mode: %d steps, %d examples, %.0f examples/s, loss %.4f", role.name,
             spec.name, mode.name, stats.steps, stats.examples, stats.examples_per_sec, stats.last_loss)
    return {"mode": mode.name, "steps": stats.steps, "examples": stats.examples, "train_rows": len(examples),
            "examples_per_sec": stats.examples_per_sec, "seconds": seconds, "loss": stats.last_loss}


def _concurrently(jobs: dict, role, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Run each stage's training job, one on this thread when alone, else each on its own thread at the
    same time (every worker trains every stage of the group: a sync stage's step waits for all W workers,
    so the workers cannot be split among stages). Each result gets its wall-clock `started`/`finished`
    (time.time()). The first failure is raised once every thread ended; a thread still running after
    `timeout_s` raises PSTimeoutError naming its stage."""
    results: dict[str, dict[str, Any]] = {}
    errors: list[tuple[str, BaseException]] = []

    def run(name: str) -> None:
        started = time.time()
        try:
            results[name] = jobs[name]()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors.append((name, exc))
            return
        results[name].update(started=started, finished=time.time())

    if len(jobs) == 1:
        for name in jobs:
            run(name)
    else:
        log.info("%s: training stages %s concurrently, each on its own thread and communicator", role.name,
                 ", ".join(jobs))
        threads = [threading.Thread(target=run, args=(name,), name=f"stage-{name}", daemon=True) for name in jobs]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        late = [t.name[len("stage-"):] for t in threads if t.is_alive()]
        if late:
            raise PSTimeoutError(f"{role.name}: stage(s) {late} still training after {timeout_s:g} s (trained "
                                 f"concurrently with {list(jobs)}); see the servers' and workers' logs")
    for name, exc in errors[1:]:
        log.error("%s: stage %s failed too: %s", role.name, name, exc)
    if errors:
        raise errors[0][1]
    return results


def _export(s: StageSpec, specs, fleet, models, collections, world, role, export_dir: str, stages: dict) -> None:
    """What the servers hold for the trained stage: worker 0 writes <run dir>/funnel/<stage>.pt; every worker
    loads the same export (the next stages' candidates come from it)."""
    with fleet.reading_servers():
        blob = export_stage(s, models[s.name], collections[s.name], world, dense_width(s, specs))
    if role.index == 0:
        rfs.write_atomic(rfs.join(export_dir, f"{s.name}.pt"), blob, overwrite=True)
    stages[s.name] = load_stage(s, blob)


def _index(cfg, s: StageSpec, stages: dict, world, role=None, export_dir: str = "", trained: dict | None = None):
    """The recall stage's item vectors over `world`'s item features -> the item index. With `role`, the index
    the funnel serves: timed into `trained`, and worker 0 writes it to <export_dir>/items.ann."""
    t = time.perf_counter()
    vectors = stages[s.name].vectors(world, items=torch.arange(world.num_items))  # (I, E)
    index = build_index(vectors, OmegaConf.to_container(cfg.pipeline.index, resolve=True))
    if role is not None:
        trained[s.name]["index_seconds"] = time.perf_counter() - t
        if role.index == 0:
            index.save(rfs.join(export_dir, "items.ann"), overwrite=True)
    return index


def funnel_work(cfg: DictConfig, role, out_dir: Path, data=None, observers=()) -> dict[str, Any] | None:
    """A worker of the funnel job; see the module docstring. Worker 0 returns the metrics."""
    from recps.cluster.process import fleet_for, on_this_machine  # deferred: as run_distributed, a sibling layer

    specs = pipeline_specs(cfg)
    world = data if isinstance(data, FunnelData) else load_world(cfg)
    fraction = validation_fraction(cfg, specs)
    refresh = refresh_epochs(cfg, specs)
    period = validation_period(world, fraction) if fraction is not None else None
    train_world = period.fit if period is not None else world  # every stage trains on the period's past
    item_cf = train_cf = None
    cf_settings = item_cf_settings(cfg, specs)
    if cf_settings is not None:  # a stage reads item_cf: EASE of the period's past for training, of all for serving
        top_n = int(cfg.pipeline.top_n)
        train_cf = fit_ease(train_world, cf_settings, top_n, "item_cf for training (the period's past)")
        item_cf = fit_ease(world, cf_settings, top_n, "item_cf for serving and the EASE baseline (all training rows)")
    seed = int(cfg.seed)
    seed_everything(seed)
    if on_this_machine(role):  # the workers and the servers share the cores: one share is a worker's
        # (2 cores, 1 worker, load 12.7: 100,000 fine pairs scored in 1.5-2.1 s on 1 thread, 4.0-8.2 s on 2)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (role.num_workers + 1)))
    threads = specs[0].threads
    timeout_s = max(float(s.mode.timeout_s) for s in specs) * 10
    collections = {s.name: stage_collection(s) for s in specs}
    models = {s.name: build_stage_model(s, collections[s.name], dense_width(s, specs)) for s in specs}
    export_dir = rfs.join(str(Path(out_dir).resolve()), EXPORT_DIR)
    trained: dict[str, Any] = {}
    if item_cf is not None and role.index == 0:  # what serving scores item_cf with (recps.pipeline.recommend)
        rfs.write_atomic(rfs.join(export_dir, ITEM_CF_EXPORT), item_cf.to_bytes(), overwrite=True)
    with fleet_for(node_settings(cfg), role) as fleet:
        for s in specs:
            fleet.add_collection(collections[s.name], mode=s.mode)
        fleet.init_worker(DistributedStrategy(mode=specs[0].mode, threads=threads))
        counted = [s for s in specs if s.counts]
        train_counts = counts = {}
        if counted:  # counting features: the period's past counted on the servers, read back before training
            for s in counted:
                fleet.create_counting_table(counts_table(s.name), s.mode.table.accessor, timeout=timeout_s)
            fleet.wait_for_workers("pipeline.counts.tables", timeout=timeout_s)
            past = torch.arange(train_world.train_user.numel())
            count_exposures(fleet, counted, train_world, past, role.index, role.num_workers, timeout_s,
                            "pipeline.counts.past")
            train_counts = {s.name: read_counts(fleet, s, train_world, timeout_s) for s in counted}
            if role.index == 0:  # what the validation stages train with (tests recount it)
                rfs.write_atomic(rfs.join(export_dir, COUNTS_TRAIN_EXPORT), counts_to_bytes(train_counts),
                                 overwrite=True)
        stages: dict = {}
        index = train_index = None
        for group in schedule(cfg, specs):  # one stage after another, or a group's stages at the same time
            funnel = Funnel(specs, stages, train_index, train_world, train_cf, train_counts) if stages else None
            examples = {}
            for s in group:  # the group's stages read only earlier groups' exports (config.schedule checked it)
                t = time.perf_counter()
                examples[s.name] = training_examples(s, specs, train_world, funnel, seed + s.index, period)
                trained[s.name] = {"prepare_seconds": time.perf_counter() - t}
            jobs = {s.name: (lambda s=s: _train_stage(fleet, s, models[s.name], collections[s.name], examples[s.name],
                                                      role, timeout_s)) for s in group}
            for name, result in _concurrently(jobs, role, timeout_s * 2).items():
                trained[name].update(result)
            for s in group:
                _export(s, specs, fleet, models, collections, world, role, export_dir, stages)
                if s.is_retrieval:
                    index = train_index = _index(cfg, s, stages, world, role, export_dir, trained)
                    if period is not None:  # the training funnel retrieves over the period's item features
                        train_index = _index(cfg, s, stages, train_world)
        if counted:  # the validation period counted too: the held-out requests and serving see every exposure
            count_exposures(fleet, counted, world, period.rows, role.index, role.num_workers, timeout_s,
                            "pipeline.counts.period")
            counts = {s.name: read_counts(fleet, s, world, timeout_s) for s in counted}
            if role.index == 0:
                rfs.write_atomic(rfs.join(export_dir, COUNTS_EXPORT),
                                 counts_to_bytes(counts), overwrite=True)
        for s in (x for x in specs if x.name in refresh):  # trained on the period's past: now on all of it
            t = time.perf_counter()
            again = dataclasses.replace(s, epochs=refresh[s.name])
            rows = training_examples(again, specs, world, Funnel(specs, stages, index, world, item_cf, counts),
                                     seed + s.index)
            result = _train_stage(fleet, again, models[s.name], collections[s.name], rows, role, timeout_s, ".refresh")
            trained[s.name]["refresh"] = {**result, "prepare_seconds": time.perf_counter() - t - result["seconds"]}
            _export(s, specs, fleet, models, collections, world, role, export_dir, stages)
            if s.is_retrieval:
                index = _index(cfg, s, stages, world, role, export_dir, trained)
        fleet.close_communicators()  # every stage trained: what is queued goes out, the threads stop
        tables = {s.name: {t: fleet.table_mode(t) for t in [*collections[s.name].table_dims(),
                                                                          f"{s.name}_dense"]} for s in specs}
        # the disk tiers as training left them (before the evaluation's reads promote rows); worker 0 writes them
        tiers = fleet.tier_stats(timeout=timeout_s) if role.index == 0 else {}

        # every worker evaluates its share of the held-out requests; the tallies merge through the servers
        merger = PSMerger(fleet.channel(), prefix="recps.pipeline.eval", timeout_s=max(timeout_s, _EVAL_TIMEOUT_S))
        metrics = evaluate_funnel(Funnel(specs, stages, index, world, item_cf, counts), eval_settings(cfg),
                                  merger=merger, worker=role.index, workers=role.num_workers)
        lists = metrics.pop("final_lists")  # <run dir>/funnel/final_lists.json: what recommend must return
        log.info("%s: funnel evaluated: %d of the %d requests evaluated here in %.1f s, merged through the servers",
                 role.name, len(lists["users"]), metrics["requests"], metrics["eval_seconds"])
        if role.index != 0:
            metrics = None
        else:  # worker 0's requests' lists; it writes the metrics (every worker holds the same merged ones)
            rfs.write_atomic(rfs.join(export_dir, "final_lists.json"), json.dumps(lists), overwrite=True)
            metrics["stages_trained"] = trained
            metrics["server_tables"] = tables  # the mode each table is tagged with on the servers
            if tiers:  # tables with a disk tier (ps.table.memory_budget)
                metrics["disk_tier"] = tiers
            metrics["shared_tables"] = {s.name: collections[s.name].shared_tables() for s in specs if s.share}
            metrics["pipeline"] = str(cfg.pipeline.name)
            metrics["stage_order"] = [s.name for s in specs]
            metrics["workers"], metrics["servers"] = role.num_workers, role.num_servers
            if period is not None:
                metrics["validation_period"] = {
                    "fraction": period.fraction, "requests": int(period.fit.test_users.numel()),
                    "clicks": int(period.labels[0].items.numel()),
                    "earlier_exposures": int(period.fit.train_user.numel())}
            metrics.update(metrics["funnel"])  # flat too: a sweep's table reads `objective=ndcg@10` from the top level
            rfs.write_atomic(str(Path(out_dir) / "metrics.json"),
                             json.dumps(metrics, indent=2, sort_keys=True, default=str) + "\n", overwrite=True)
        fleet.barrier("pipeline.evaluated", timeout=max(timeout_s, _EVAL_TIMEOUT_S))
        return metrics


# ------------------------------------------------------------------------------------ the report


def _fmt(value) -> str:
    """A metric as a user reads it: a count (a whole number >= 2, e.g. hits) as an integer, a rate to 4 places."""
    if isinstance(value, float) and math.isfinite(value):
        return str(int(value)) if value.is_integer() and abs(value) >= 2 else f"{value:.4f}"
    return str(value)



def _requests(metrics: dict[str, Any]) -> str:
    """How many held-out requests the funnel was evaluated on, and of how many (pipeline.eval_users).

    >>> _requests({"requests": 500, "requests_held_out": 2000}), _requests({"requests": 300, "requests_held_out": 300})
    ('500 of the 2000 held-out requests: pipeline.eval_users=500', '300 held-out requests')
    """
    evaluated, held_out = int(metrics.get("requests", 0)), metrics.get("requests_held_out")
    if isinstance(held_out, int) and held_out > evaluated:
        return f"{evaluated} of the {held_out} held-out requests: pipeline.eval_users={evaluated}"
    return f"{evaluated} held-out requests"

def summary_lines(metrics: dict[str, Any]) -> list[str]:
    """Each stage's metrics, the funnel's, the baselines' (see recps.pipeline.held_out)."""
    lines = []
    trained = metrics.get("stages_trained", {})
    stages = metrics.get("stages") or {}
    for name in metrics.get("stage_order") or list(stages):
        stage = stages[name]
        t = trained.get(name, {})
        head = f"stage {name} ({t.get('mode', '?')}, keep {stage.get('keep')}):"
        shown = " ".join(f"{k}={_fmt(v)}" for k, v in stage.items() if k != "keep")
        train = (f" | trained {t.get('steps')} steps, {t.get('examples')} examples, "
                 f"{round(float(t.get('examples_per_sec', 0.0))):,} ex/s" if t else "")
        lines.append(f"{head} {shown}{train}")
    funnel = metrics.get("funnel") or {}
    lines.append(f"funnel ({_requests(metrics)}): " + " ".join(f"{k}={_fmt(v)}" for k, v in funnel.items()))
    for name, values in (metrics.get("baselines") or {}).items():
        lines.append(f"baseline {name}: " + " ".join(f"{k}={_fmt(v)}" for k, v in values.items()))
    tiers = [tier_line(name, t) for name, t in sorted((metrics.get("disk_tier") or {}).items())]
    return lines + list(metrics.get("verdicts") or ()) + tiers  # "funnel beats ease: no (...)" (recps.pipeline.held_out)
