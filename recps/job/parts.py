"""`Job`: the built parts of one job (recps.job.build makes it), what the loop, the checkpoint and the
bodies take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recps.data.dataset import PreparedData
    from recps.job.loop import Trainer
    from recps.job.settings import JobSettings

__all__ = ["Job"]


@dataclass
class Job:
    """Everything one training run holds: data, collection, model, task, optimizer, trainer, settings.

    `epochs_done` / `steps_done`: what the job had trained before this process (a resumed checkpoint)."""

    settings: JobSettings
    data: PreparedData
    collection: Any
    model: Any
    task: Any
    optimizer: Any
    trainer: Trainer
    epochs_done: int = 0
    steps_done: int = 0
