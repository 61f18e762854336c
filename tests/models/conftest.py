"""Shared by the model tests: a tiny generated world and the first losses of a real local run."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from recps.config import PROJECT_ROOT, register_resolvers

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
    register_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
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
        stats = job.trainer.fit(job.data.train, GOLDEN_BATCH, epochs=1, max_steps=GOLDEN_STEPS, progress=False)
        assert stats.steps == GOLDEN_STEPS
        return stats.first_losses

    return run
