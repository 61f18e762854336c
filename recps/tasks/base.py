"""The Task protocol: how the trainer turns a batch into a loss and an evaluation.

Tasks own the losses and the evaluation; models only return logits. The trainer calls
`forward(model, batch)` then `loss(output, batch)`; `recps.run.evaluate` calls the task's
own `evaluate(model, source, batch_size)` when it has one (ranking and retrieval tasks
score whole candidate sets), else `predict`/`target` over the test split with the
pointwise metrics named in `metrics`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from recps.data.batch import Batch

__all__ = ["Task", "TaskBase"]


class Task(Protocol):
    metrics: tuple[str, ...]

    def forward(self, model: nn.Module, batch: Batch) -> Any: ...

    def loss(self, output: Any, batch: Batch) -> torch.Tensor: ...

    def predict(self, output: Any) -> torch.Tensor: ...

    def target(self, batch: Batch) -> torch.Tensor: ...


class TaskBase:
    """Default forward: `model(batch.dense, batch.sparse)`, the zoo's ranking signature."""

    metrics: tuple[str, ...] = ()
    # forward() hands batch.sparse to the model as it is: a PS collection may prefetch its rows
    # (recps.trainer.Trainer(prefetch=True)). A task whose forward builds other features says False.
    passes_batch_sparse = True

    def forward(self, model: nn.Module, batch: Batch) -> Any:
        return model(batch.dense, batch.sparse)
