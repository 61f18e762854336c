"""The job builder: the composed config, once, into a `Job` of typed objects.

    build_job(cfg, data=None) -> Job     data, collection, model, task, optimizer, trainer (the loop),
                                         observers, and `Job.settings` (JobSettings: the trainer's,
                                         the checkpoint's and the observers' settings, the config's
                                         YAML that checkpoints record)
    run_training(cfg, out_dir)           a local run: build_job, then recps.job.run.run_local

With recps.job.settings, the only module of recps.job that reads the composed config; the rest takes the Job. Called by the
entry points (recps.train, recps.evaluate), the cluster's driver for a worker's body (recps.cluster.work:
its process re-enters through recps.train with recps-job.yaml; `worker_data`: its own rows) and the
stream's, and by tests.
"""

from __future__ import annotations

import inspect
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from recps.config import MODEL_ENGINE_KEYS, MODEL_INJECTED, TASK_ENGINE_KEYS, check_target_args
from recps.data.dataset import ExamplesSource, PreparedData, prepare_data, worker_parses_its_shards
from recps.data.reader import empty_examples
from recps.data.schema import Schema
from recps.debug.dump import check_debug_config
from recps.device import check_device
from recps.embeddings import LocalEmbeddingBagCollection, LocalEmbeddingCollection
from recps.errors import ConfigError
from recps.job.loop import LocalDenseUpdater, Trainer, dense_parameters
from recps.job.parts import Job
from recps.job.settings import CheckpointSettings, JobSettings, TrainerSettings, build_settings
from recps.job.precision import check_precision
from recps.job.run import run_local
from recps.metrics.groups import check_evaluation_groups
from recps.metrics.reporter import check_metrics_config
from recps.ps.embedding import PSEmbeddingBagCollection, PSEmbeddingCollection
from torchrec.modules.embedding_configs import EmbeddingConfig

__all__ = ["Job", "JobSettings", "TrainerSettings", "CheckpointSettings", "MODEL_ENGINE_KEYS", "MODEL_INJECTED",
           "build_job", "build_settings", "build_observers", "prepare_dataset", "run_training", "seed_everything",
           "schema_data", "worker_data"]

log = logging.getLogger("recps.run")  # the name its log lines had (recps/run.py)

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
    return prepare_data(OmegaConf.to_container(cfg, resolve=True), seed=seed)  # the readers take plain values


def worker_data(cfg: DictConfig, role) -> PreparedData | None:
    """A PS worker's data: its training rows only, parsed by it (recps.data.dataset.WorkerExamplesSource: the
    same batches as every row's source gives its threads), and the test rows where it evaluates (worker 0;
    every worker with trainer.observers, which may read them); None where the data set or the task
    needs every row (a dataset _target_, a test_fraction split, a task that binds the data)."""
    ds = OmegaConf.to_container(cfg.dataset, resolve=True)
    if not worker_parses_its_shards(ds) or hasattr(get_object(str(cfg.task._target_)), "bind"):
        return None
    threads = int(cfg.trainer.threads)
    return prepare_data(ds, seed=int(cfg.seed), worker=(role.index, role.num_workers, threads),
                        test=role.index == 0 or bool(cfg.trainer.get("observers")))


def schema_data(cfg: DictConfig) -> PreparedData:
    """The data set's schema with no rows: a stream job's data (each pass brings its rows)."""
    schema = Schema.from_config(cfg.dataset.schema)
    empty = ExamplesSource(empty_examples(schema), False, int(cfg.seed))
    return PreparedData(schema, empty, empty)


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
    job = Job(build_settings(cfg), data, collection, model, task, optimizer, trainer)
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


def run_training(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """A local run (ps=local): trains per cfg, evaluates, saves `out_dir/checkpoint`; returns the metrics."""
    return run_local(build_job(cfg), Path(out_dir))
