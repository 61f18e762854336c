"""From a dataset config to in-memory train and test sources.

A dataset config names a schema, train and test files, and optionally a `generate`
block (a generator creates the files on first use: `generator`, by default
recps.data.synthetic's) or a `test_fraction`
(a deterministic split of the train files when there is no test file).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from recps.data.batch import Batch
from recps.data.reader import Examples, TensorBatches, load_tensors
from recps.data.schema import Schema
from recps.errors import ConfigError

__all__ = ["ExamplesSource", "PreparedData", "ensure_generated", "prepare_data", "split_examples"]

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


DEFAULT_GENERATOR = "recps.data.synthetic.ensure_split"


def ensure_generated(cfg: Mapping[str, Any]) -> Any:
    """Creates a dataset's generated files on first use; returns the test split's info (None
    without a `generate` block).

    `cfg.generator` names the `ensure_split(dir, train_rows, test_rows, seed=, **generate)`
    to call (default: recps.data.synthetic's; recps.data.synthetic_multitask has its own).
    """
    if not cfg.get("generate"):
        return None
    from hydra.utils import get_object

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


def prepare_data(cfg: Mapping[str, Any], seed: int = 0) -> PreparedData:
    """Generates (if configured), parses and splits the data a dataset config names."""
    schema = Schema.from_config(cfg["schema"])
    best_auc = best_aucs = None
    test_info = ensure_generated(cfg)
    if test_info is not None:
        best_auc = float(test_info.best_auc)
        best_aucs = dict(getattr(test_info, "best_aucs", None) or {}) or None  # per label, multi-label generators
        log.info("synthetic data in %s: best reachable test AUC %s", cfg["dir"], best_aucs or round(best_auc, 4))
    budget = cfg.get("error_budget", 0.01)
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
    shuffle = bool(cfg.get("shuffle", True))
    return PreparedData(schema, ExamplesSource(train, shuffle, seed), ExamplesSource(test, False, seed), best_auc,
                        best_aucs)
