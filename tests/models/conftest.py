"""Shared by the model tests: tiny tables and batches built in memory (fixture `tiny`), a tiny
generated world and the first losses of a real local run (fixture `first_losses`)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import pytest
import torch
from omegaconf import OmegaConf, open_dict
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from recps.config import compose_config as recps_compose_config

# Every field of the world is spelled out, so that a change of the generator's defaults
# cannot move the golden losses; a change of its algorithm (bytes) or of the readers'
# key hashing will, and then the golden values are refreshed deliberately.
TINY_WORLD = dict(
    train_rows=2048, test_rows=256, seed=0, vocab=100, zipf_a=1.2, missing=0.05, signal=1.2,
    target_ctr=0.25, interactions=[["C1", "C2"], ["C3", "C4"]], interaction_dim=4, shares=[0.8, 0.1, 0.1],
)
GOLDEN_BATCH = 256
GOLDEN_STEPS = 5


def compose_config(overrides: Sequence[str], data_dir: Path, world: dict) -> OmegaConf:
    """The training config `python -m recps.train <overrides>` would run, on a generated world."""
    cfg = recps_compose_config(overrides)
    with open_dict(cfg):
        cfg.dataset.dir = str(data_dir)
        cfg.dataset.generate = dict(world)
    return cfg


@pytest.fixture(scope="session")
def tiny_world_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_world")


@pytest.fixture(scope="session")
def first_losses(tiny_world_dir) -> Callable[..., list[float]]:
    """first_losses(model_name, *overrides) -> the first GOLDEN_STEPS training losses.

    A real local job (conf/ defaults, ps=local, FBGEMM tables, the model's dense
    optimizer) on the tiny world, one training thread, so the sequence is deterministic.
    """
    from recps.run import build_job

    def run(model: str, *overrides: str) -> list[float]:
        cfg = compose_config([f"model={model}", "ps=local", "trainer.threads=1", "progress=false", *overrides],
                             tiny_world_dir, TINY_WORLD)
        job = build_job(cfg)
        intra_op = torch.get_num_threads()
        torch.set_num_threads(1)  # same losses as with 2 (checked); 5x faster on a busy CI runner
        try:
            stats = job.trainer.fit(job.data.train, GOLDEN_BATCH, epochs=1, max_steps=GOLDEN_STEPS, progress=False)
        finally:
            torch.set_num_threads(intra_op)
        assert stats.steps == GOLDEN_STEPS
        return stats.first_losses

    return run


@pytest.fixture(scope="session")
def world_config() -> Callable[[Sequence[str], Path, dict], OmegaConf]:
    """world_config(overrides, data_dir, world) -> the training config on a generated world."""
    return compose_config


class TinyBatch(NamedTuple):
    """One in-memory batch: dense (B, I), a KJT with one key per example and feature, ids (F, B)."""

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    ids: torch.Tensor


class Tiny:
    """Builders for hand-checkable model inputs: `tiny.collection()`, `tiny.batch()`, `tiny.rows(...)`."""

    names = ("C1", "C2", "C3")

    @staticmethod
    def collection(names: Sequence[str] = names, dims: int | Sequence[int] = 9,
                   rows: int = 50) -> EmbeddingBagCollection:
        """One table `t_<name>` per feature; `dims` is one width for all or one per table."""
        dims = [dims] * len(names) if isinstance(dims, int) else list(dims)
        return EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t_{n}", embedding_dim=d, num_embeddings=rows, feature_names=[n])
            for n, d in zip(names, dims)])

    @staticmethod
    def batch(names: Sequence[str] = names, b: int = 4, dense: int = 13, rows: int = 50,
              seed: int = 0) -> TinyBatch:
        """B examples with exactly one id per feature (so sum pooling is the row itself)."""
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, rows, (len(names), b), generator=g)  # (F, B)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(names), values=ids.flatten(),
                                                  lengths=torch.ones(len(names) * b, dtype=torch.int64))
        return TinyBatch(torch.randn(b, dense, generator=g), kjt, ids)

    @staticmethod
    def rows(collection: EmbeddingBagCollection, ids: torch.Tensor,
             names: Sequence[str] = names) -> torch.Tensor:
        """The table rows a batch looks up, read straight from the weights: (B, F, E)."""
        tables = [collection.embedding_bags[f"t_{n}"].weight for n in names]
        return torch.stack([t[i] for t, i in zip(tables, ids)], dim=1)  # (B, F, E)

    @staticmethod
    def bias_shift(model: torch.nn.Module, bias: torch.Tensor, batch: TinyBatch,
                   c: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs before and after adding c to the head's bias (in place, no grad)."""
        with torch.no_grad():
            before = model(batch.dense, batch.sparse)
            bias += c
            after = model(batch.dense, batch.sparse)
        return before, after


@pytest.fixture(scope="session")
def tiny() -> type[Tiny]:
    return Tiny
