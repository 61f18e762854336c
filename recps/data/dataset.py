"""From a dataset config to in-memory train and test sources.

A dataset config names a schema, train and test files, and optionally a `generate`
block (a generator creates the files on first use: `generator`, by default
recps.data.generators.ctr's) or a `test_fraction`
(a deterministic split of the train files when there is no test file).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from hydra.utils import get_object

from recps.data.batch import Batch
from recps.data.reader import Examples, TabularReader, TensorBatches, empty_examples, load_tensors
from recps.data.schema import Schema
from recps.errors import ConfigError

__all__ = ["ExamplesSource", "LazyExamplesSource", "WorkerExamplesSource", "PreparedData", "ensure_generated", "prepare_data", "split_examples",
           "worker_parses_its_shards"]

log = logging.getLogger(__name__)


class ExamplesSource:
    """A `BatchSource` over pre-parsed examples; shuffles per (seed, shard, epoch) if asked."""

    def __init__(self, examples: Examples, shuffle: bool = True, seed: int = 0) -> None:
        self.examples = examples
        self.shuffle = shuffle
        self.seed = seed

    def __len__(self) -> int:
        return len(self.examples)

    def batches(self, batch_size: int, shard_index: int, num_shards: int, epoch: int) -> Iterator[Batch]:
        batches = TensorBatches(self.examples, batch_size, shard_index=shard_index, num_shards=num_shards,
                                shuffle=self.shuffle, seed=self.seed)
        batches.epoch = epoch
        return iter(batches)


class LazyExamplesSource(ExamplesSource):
    """An ExamplesSource whose rows `load()` parses on first use (thread-safe): a PS worker's held-out
    rows, read when it evaluates after training rather than before its first step."""

    def __init__(self, load: Callable[[], Examples], shuffle: bool = False, seed: int = 0) -> None:
        self._load, self._examples, self._lock = load, None, threading.Lock()
        self.shuffle, self.seed = shuffle, seed

    @property
    def examples(self) -> Examples:
        with self._lock:
            if self._examples is None:
                self._examples = self._load()
            return self._examples


class WorkerExamplesSource(ExamplesSource):
    """The training rows of one worker only, parsed by it alone: worker w of W with T threads trains
    shards wT .. wT+T-1 of W*T (recps.data.sharding.WorkerShards), i.e. the rows r with
    (r // T) % W == w. Its batches are those an ExamplesSource over every row gives for those shards,
    bit for bit: thread t's rows are its local shard t of T in the same order, shuffled with the
    global shard's seed. `len()` is every worker's rows (the files' total), as the shard plans need."""

    def __init__(self, examples: Examples, total_rows: int, worker: int, workers: int, threads: int,
                 shuffle: bool = True, seed: int = 0) -> None:
        super().__init__(examples, shuffle, seed)
        self.total_rows, self.worker, self.workers, self.threads = total_rows, worker, workers, threads

    def __len__(self) -> int:
        return self.total_rows

    def batches(self, batch_size: int, shard_index: int, num_shards: int, epoch: int) -> Iterator[Batch]:
        t, w = self.threads, self.worker
        if num_shards != self.workers * t or not w * t <= shard_index < (w + 1) * t:
            raise ConfigError(f"shard {shard_index} of {num_shards}: this source holds worker {w} of {self.workers}'s "
                              f"rows only (shards {w * t}..{(w + 1) * t - 1} of {self.workers * t}); a layout of "
                              "other workers or threads reads the data set again (recps.cluster does)")
        batches = TensorBatches(self.examples, batch_size, shard_index=shard_index - w * t, num_shards=t,
                                shuffle=self.shuffle, seed=self.seed, seed_shard=shard_index)
        batches.epoch = epoch
        return iter(batches)


def worker_parses_its_shards(cfg: Mapping[str, Any]) -> bool:
    """Whether a PS worker may parse only its own training rows of this dataset config (prepare_data's
    `worker=`): tabular files with test files of their own (a test_fraction splits every row first)."""
    return not cfg.get("_target_") and bool(cfg.get("test")) and not float(cfg.get("test_fraction") or 0.0)


@dataclass
class PreparedData:
    schema: Schema
    train: ExamplesSource
    test: ExamplesSource
    best_auc: float | None = None
    best_aucs: dict[str, float] | None = None  # per label (name -> best reachable test AUC), when known


def split_examples(examples: Examples, test_fraction: float, seed: int) -> tuple[Examples, Examples]:
    """A deterministic random split: `test_fraction` of the rows go to the test side."""
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"dataset.test_fraction={test_fraction}; use a value in (0, 1) or give dataset.test files")
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed))
    n_test = max(1, int(round(len(examples) * test_fraction)))
    return examples.select(order[n_test:]), examples.select(order[:n_test])


DEFAULT_GENERATOR = "recps.data.generators.ctr.ensure_split"


def ensure_generated(cfg: Mapping[str, Any]) -> Any:
    """Creates a dataset's generated files on first use; returns the test split's info (None
    without a `generate` block).

    `cfg.generator` names the `ensure_split(dir, train_rows, test_rows, seed=, **generate)`
    to call (default: recps.data.generators.ctr's; recps.data.generators.multitask has its own).
    """
    if not cfg.get("generate"):
        return None
    name = cfg.get("generator") or DEFAULT_GENERATOR
    try:
        ensure_split = get_object(name)
    except Exception as exc:  # hydra raises ImportError/AttributeError variants
        raise ConfigError(f"dataset.generator={name!r} cannot be imported ({exc}); name an ensure_split "
                          f"function, e.g. {DEFAULT_GENERATOR}") from exc
    gen = dict(cfg["generate"])
    _, test_info = ensure_split(cfg["dir"], int(gen.pop("train_rows")), int(gen.pop("test_rows")),
                                seed=int(gen.pop("seed", 0)), **gen)
    return test_info


def prepare_data(cfg: Mapping[str, Any], seed: int = 0, worker: tuple[int, int, int] | None = None,
                 test: bool = True) -> PreparedData:
    """Generates (if configured), parses and splits the data a dataset config names.

    worker=(w, W, T): parse only worker w's training rows (of W workers with T threads each;
    a WorkerExamplesSource; `worker_parses_its_shards(cfg)` must hold), and the test rows when first
    used (a LazyExamplesSource); test=False: none (a worker that does not evaluate)."""
    schema = Schema.from_config(cfg["schema"])
    best_auc = best_aucs = None
    test_info = ensure_generated(cfg)
    if test_info is not None:
        best_auc = float(test_info.best_auc)
        best_aucs = dict(getattr(test_info, "best_aucs", None) or {}) or None  # per label, multi-label generators
        log.info("synthetic data in %s: best reachable test AUC %s", cfg["dir"], best_aucs or round(best_auc, 4))
    budget = cfg.get("error_budget", 0.01)
    shuffle = bool(cfg.get("shuffle", True))
    if worker is not None:
        if not worker_parses_its_shards(cfg):
            raise ConfigError(f"dataset {cfg.get('name')!r}: a worker's own rows need tabular train and test files "
                              "(no _target_, no test_fraction); read the whole data set instead")
        w, workers, threads = worker
        reader = TabularReader(list(cfg["train"]), schema, batch_size=1, shard_index=w, num_shards=workers,
                               shard_width=threads, error_budget=budget)
        parts = [part.row_major() for part in reader.chunks()]
        mine = Examples.cat(parts) if parts else empty_examples(schema)
        source = WorkerExamplesSource(mine, reader.stats.all_rows, w, workers, threads, shuffle, seed)
        if test:  # parsed when it is evaluated, after training
            held_out = LazyExamplesSource(lambda: load_tensors(list(cfg["test"]), schema, error_budget=budget), False, seed)
        else:
            held_out = ExamplesSource(empty_examples(schema), False, seed)
        log.info("dataset %s: %d train rows (worker %d's %d of %d), test rows %s", cfg.get("name"), len(source), w,
                 len(mine), len(source), "read when evaluated" if test else "none (worker 0 evaluates)")
        return PreparedData(schema, source, held_out, best_auc, best_aucs)
    train = load_tensors(list(cfg["train"]), schema, error_budget=budget)
    test_paths = list(cfg.get("test") or [])
    fraction = float(cfg.get("test_fraction") or 0.0)
    if test_paths:
        test = load_tensors(test_paths, schema, error_budget=budget)
    elif fraction > 0:
        train, test = split_examples(train, fraction, seed)
    else:
        raise ConfigError(f"dataset {cfg.get('name')!r} has no test files and test_fraction=0; "
                          "set dataset.test or dataset.test_fraction")
    log.info("dataset %s: %d train rows, %d test rows", cfg.get("name"), len(train), len(test))
    return PreparedData(schema, ExamplesSource(train, shuffle, seed), ExamplesSource(test, False, seed), best_auc,
                        best_aucs)
