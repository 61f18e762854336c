"""One training job from a composed config: data, collection, model, trainer, metrics, checkpoint.

Called by `recps.train` (Hydra) and by tests; no Hydra state is needed here.
"""

from __future__ import annotations

import inspect
import logging
import random
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from recps.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
from recps.config import MODEL_ENGINE_KEYS, MODEL_INJECTED, TASK_ENGINE_KEYS, check_target_args
from recps.data.dataset import PreparedData, prepare_data
from recps.debug.dump import build_dump, check_debug_config
from recps.device import check_device
from recps.errors import ConfigError
from recps.job import Job  # re-exported: recps.run.Job
from recps.metrics.groups import check_evaluation_groups, evaluate_pointwise
from recps.metrics.reporter import MetricsReporter, build_reporter, check_metrics_config
from recps.embeddings import LocalEmbeddingBagCollection, LocalEmbeddingCollection
from recps.trainer import LocalDenseUpdater, Trainer, check_precision, dense_parameters

__all__ = ["Job", "MODEL_ENGINE_KEYS", "MODEL_INJECTED", "build_job", "checkpoint_dir", "build_observers", "prepare_dataset", "run_training", "evaluate", "training_observers"]

log = logging.getLogger("recps.run")

# MODEL_ENGINE_KEYS, MODEL_INJECTED (recps.config, re-exported here): what the engine reads from and
# injects into a model config; TASK_ENGINE_KEYS: what it reads from a task config (its `objective`).


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_collection(cfg: DictConfig, feature_names: list[str], embedding_dim: int, sequence: bool = False,
                     num_embeddings: int | None = None):
    """The embedding collection that `ps=` selects: local, FBGEMM fused TBE; sync / async / geo,
    a PS-backed collection that the worker binds to its communicator (recps.cluster).

    `sequence`: an EmbeddingCollection (one row per key) instead of a bag collection.
    `num_embeddings`: rows per table when the data numbers its keys 0..n-1 (else ps.num_embeddings)."""
    ps = cfg.ps
    if ps.name in ("sync", "async", "geo"):
        from recps.ps.embedding import PSEmbeddingBagCollection, PSEmbeddingCollection
        from torchrec.modules.embedding_configs import EmbeddingConfig

        if sequence:
            return PSEmbeddingCollection([EmbeddingConfig(name=f"t_{f}", embedding_dim=embedding_dim,
                                                          num_embeddings=int(num_embeddings or 2**31 - 1),
                                                          feature_names=[f]) for f in feature_names],
                                         device=cfg.device)
        return PSEmbeddingBagCollection.from_features(feature_names, embedding_dim, device=cfg.device)
    if ps.name != "local":
        raise ConfigError(f"ps={ps.name!r} is not one of local, sync, async, geo; pick one of them")
    opt = ps.table.optimizer
    local = LocalEmbeddingCollection if sequence else LocalEmbeddingBagCollection
    return local(
        feature_names, embedding_dim, int(num_embeddings or ps.num_embeddings), optimizer=opt.name,
        lr=float(opt.lr), eps=float(opt.get("eps", 1e-8)), init_std=float(ps.table.init_std),
        device=cfg.device,
    )


def prepare_dataset(cfg: DictConfig, seed: int) -> PreparedData:
    """The data a dataset config names: its `_target_` (called with the config's other keys
    and `seed`, returning PreparedData-like train/test sources), else the tabular readers."""
    if cfg.get("_target_"):
        check_target_args(cfg, "dataset", injected=("seed",))
        return instantiate(cfg, seed=seed, _convert_="all")
    return prepare_data(cfg, seed=seed)


def build_job(cfg: DictConfig, data: PreparedData | None = None) -> Job:
    """Validates `cfg`, then builds the data, model and trainer of one run."""
    check_target_args(cfg.model, "model", injected=MODEL_INJECTED, engine_keys=MODEL_ENGINE_KEYS)
    check_target_args(cfg.task, "task", engine_keys=TASK_ENGINE_KEYS)
    check_target_args(cfg.optimizer, "optimizer", injected=("params",))
    check_metrics_config(cfg.get("metrics"))
    check_debug_config(cfg.get("debug"))
    device = check_device(cfg.device)  # cuda: a CUDA build that sees a GPU, else the fix
    precision = check_precision(cfg.trainer.get("precision", "fp32"), str(cfg.device))  # before any data is read
    seed_everything(int(cfg.seed))
    data = data or prepare_dataset(cfg.dataset, seed=int(cfg.seed))
    schema = data.schema
    check_evaluation_groups(getattr(cfg.task, "metrics", None), cfg.get("metrics"), getattr(schema, "feature_names", None))
    takes = inspect.signature(get_object(cfg.model._target_)).parameters
    sequence = "embedding_collection" in takes  # sequence models embed every key, unpooled
    collection = build_collection(cfg, list(schema.feature_names), int(cfg.model.embedding_dim), sequence=sequence,
                                  num_embeddings=getattr(data, "num_embeddings", None))
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    for key in MODEL_ENGINE_KEYS:
        model_cfg.pop(key, None)
    injected: dict[str, Any] = {"embedding_collection" if sequence else "embedding_bag_collection": collection}
    if "dense_in_features" in takes:
        injected["dense_in_features"] = schema.num_dense
    model = instantiate(model_cfg, **injected, _convert_="all").to(device)  # the CPU: no copy
    task_cfg = OmegaConf.to_container(cfg.task, resolve=True)
    for key in TASK_ENGINE_KEYS:
        task_cfg.pop(key, None)
    task = instantiate(task_cfg, _convert_="all")
    if callable(getattr(task, "bind", None)):
        task.bind(data)  # e.g. retrieval: sampled negatives come from the data's item catalogue
    dense = [p for _, p in dense_parameters(model, collection)]
    optimizer = instantiate(cfg.optimizer)(dense)
    trainer = Trainer(model, collection, task, LocalDenseUpdater(dense, optimizer),
                      threads=int(cfg.trainer.threads), precision=precision, device=str(cfg.device))
    job = Job(cfg, data, collection, model, task, optimizer, trainer)
    trainer.observers = build_observers(cfg.trainer.get("observers"), job)
    return job


def build_observers(specs, job: Job) -> list:
    """Extra TrainObservers from `trainer.observers`: a list of `_target_` configs, each called
    with `job=` (e.g. benchmarks.quality.HeldOutAUC, a held-out AUC every N steps). They run in
    every process that trains (ps=local, each PS worker); `close()` is called after the fit."""
    observers = []
    for i, spec in enumerate(specs or ()):
        check_target_args(spec, f"trainer.observers[{i}]", injected=("job",))
        observers.append(instantiate(spec, job=job, _convert_="all"))
    return observers


def evaluate(job: Job) -> dict[str, float]:
    """The task's metrics on the held-out split (a task may evaluate itself: ranking, retrieval)."""
    # gauc / pnr among task.metrics group by metrics.group_key (recps.metrics.groups)
    group_key = (job.cfg.get("metrics") or {}).get("group_key")
    if hasattr(job.task, "evaluate"):
        grouping = {"group_key": group_key} if getattr(job.task, "evaluates_groups", False) else {}
        return job.task.evaluate(job.model, job.data.test, int(job.cfg.trainer.eval_batch_size), **grouping)
    probs, targets = job.trainer.predict(job.data.test, int(job.cfg.trainer.eval_batch_size))
    return evaluate_pointwise(list(job.task.metrics), probs, targets, job.data.test, int(job.cfg.trainer.eval_batch_size),
                              group_key=group_key)


@contextmanager
def training_observers(job: Job, out_dir: Path, *, client: Any = None, rank: int = 0) -> Iterator[MetricsReporter | None]:
    """Attaches the training observers job.cfg asks for to job.trainer for the block: global
    metrics every N steps and each pass (conf/metrics) and the debug dump (conf/debug, off by
    default); closes and detaches them after it. Yields the reporter (None when metrics are off).

    client: a PS worker's PSClient (metrics merge over the workers through the servers).
    rank: the worker's index: its dump files carry it; only rank 0 writes metric files."""
    cfg = job.cfg
    reporter = build_reporter(cfg.get("metrics"), task=job.task, threads=int(cfg.trainer.threads),
                              out_dir=out_dir if rank == 0 else None, client=client, step_base=job.steps_done,
                              device=str(cfg.device), feature_names=getattr(getattr(job.data, "schema", None), "feature_names", None))
    dump = build_dump(cfg.get("debug"), out_dir, task=job.task, collection=job.collection, rank=rank,
                      step_base=job.steps_done)
    extra = list(job.trainer.observers)  # trainer.observers (build_job)
    job.trainer.observers = [*extra, *(o for o in (reporter, dump) if o is not None)]
    try:
        yield reporter
    finally:
        for observer in job.trainer.observers:
            observer.close()
        job.trainer.observers = []


def run_training(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Trains per cfg, evaluates, saves `out_dir/checkpoint`; returns the metrics dict."""
    job = build_job(cfg)
    if cfg.trainer.resume:
        load_checkpoint(job, cfg.trainer.resume)
        log.info("resumed from %s at epoch %d, step %d", cfg.trainer.resume, job.epochs_done, job.steps_done)
    with training_observers(job, out_dir) as reporter:
        stats = job.trainer.fit(job.data.train, int(cfg.trainer.batch_size), epochs=int(cfg.trainer.epochs),
                                max_steps=int(cfg.trainer.max_steps), progress=bool(cfg.progress),
                                first_epoch=job.epochs_done)
    job.epochs_done += int(cfg.trainer.epochs)
    job.steps_done += stats.steps
    metrics: dict[str, Any] = evaluate(job)
    metrics.update(
        examples_per_sec=stats.examples_per_sec, train_examples=stats.examples, train_steps=stats.steps,
        train_seconds=stats.seconds, train_loss=stats.last_loss, first_losses=stats.first_losses,
        model=str(cfg.model._target_), ps=str(cfg.ps.name), threads=int(cfg.trainer.threads),
    )
    if reporter is not None:
        metrics["train_metrics"] = reporter.reports
    if data_best := job.data.best_auc:
        metrics["best_reachable_auc"] = data_best
    if best_per_label := getattr(job.data, "best_aucs", None):  # multi-label generators: one per label
        metrics["best_reachable_aucs"] = dict(best_per_label)
    if cfg.checkpoint.save:
        path = save_checkpoint(job, checkpoint_dir(cfg, out_dir))
        metrics["checkpoint"] = str(path)
    return metrics
