"""`Job`: the built parts of one job (recps.job.build makes it), what the loop, the checkpoint and the
bodies take."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recps.data.dataset import PreparedData
    from recps.job.loop import Trainer
    from recps.job.settings import JobSettings

__all__ = ["Job"]


class Job:
    """Everything one training run holds: data, collection, model, task, optimizer, trainer, settings.

    `epochs_done` / `steps_done`: what the job had trained before this process (a resumed checkpoint).
    A plain class, not a dataclass: Hydra's instantiate (observers given `job=`) would read a dataclass
    as a structured config and evaluate its annotations."""

    def __init__(self, settings: JobSettings, data: PreparedData, collection: Any, model: Any, task: Any,
                 optimizer: Any, trainer: Trainer, epochs_done: int = 0, steps_done: int = 0) -> None:
        self.settings = settings
        self.data = data
        self.collection = collection
        self.model = model
        self.task = task
        self.optimizer = optimizer
        self.trainer = trainer
        self.epochs_done = epochs_done
        self.steps_done = steps_done
