"""Binary click-through-rate task: sigmoid cross-entropy on one label column."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recps.data.batch import Batch
from recps.tasks.base import TaskBase, check_label_range

__all__ = ["BinaryTask"]


class BinaryTask(TaskBase):
    """Loss and predictions for a model that returns logits (B,).

    Args:
        label_index: which column of `Batch.labels` (B, T) is the target.
        metrics: metric names reported by evaluation (see recps.metrics).
        label_range: the label values it trains on, [lo, hi]: [0, 1] (clicks; soft labels in
            between); the tabular readers skip a row whose label lies outside (a 7) as a bad row.
    """

    def __init__(self, label_index: int = 0, metrics: tuple[str, ...] = ("auc", "logloss"),
                 label_range: tuple[float, float] | None = (0.0, 1.0)) -> None:
        self.label_index = int(label_index)
        self.metrics = tuple(metrics)
        self.label_range = check_label_range(label_range)

    def target(self, batch: Batch) -> torch.Tensor:
        return batch.labels[:, self.label_index]  # (B,)

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Mean sigmoid cross-entropy; the sigmoid is applied here, once."""
        return F.binary_cross_entropy_with_logits(logits, self.target(batch))

    def predict(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(logits)  # (B,) probs
