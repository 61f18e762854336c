"""`Job`: everything one training run holds, built by `recps.run.build_job`.

Its own module so that what takes a job (recps.checkpoint, observers given `job=`) does not
import the code that assembles one (recps.run, which imports them and re-exports `Job`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from recps.data.dataset import PreparedData
    from recps.trainer import Trainer

__all__ = ["Job"]


class Job:
    """Everything one training run holds: data, collection, model, task, optimizer, trainer."""

    def __init__(self, cfg: DictConfig, data: PreparedData, collection, model, task,
                 optimizer, trainer: Trainer) -> None:
        self.cfg = cfg
        self.data = data
        self.collection = collection
        self.model = model
        self.task = task
        self.optimizer = optimizer
        self.trainer = trainer
        self.epochs_done = 0
        self.steps_done = 0
