"""The Task protocol: how the trainer turns a batch into a loss and an evaluation.

Tasks own the losses and the evaluation; models only return logits. The trainer calls
`forward(model, batch)` then `loss(output, batch)`; `recps.job.run.evaluate` calls the task's
own `evaluate(model, source, batch_size)` when it has one (ranking and retrieval tasks
score whole candidate sets), else `predict`/`target` over the test split with the
pointwise metrics named in `metrics`.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, Sequence

import torch
from torch import nn

from recps.data.batch import Batch
from recps.errors import ConfigError

__all__ = ["Task", "TaskBase", "check_label_range"]


def check_label_range(value: Sequence[float] | None, where: str = "task.label_range") -> tuple[float, float] | None:
    """`value` as (lo, hi) floats (None stays None: labels unchecked), or ConfigError naming `where`.

    A task's label range is what it trains on; the tabular readers skip rows whose label lies
    outside as bad rows (conf/dataset: `schema.label_range: ${oc.select:task.label_range,null}`).

    >>> check_label_range([0, 1])
    (0.0, 1.0)
    """
    if value is None:
        return None
    ok = (isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2
          and all(isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x) for x in value))
    if not ok or value[0] > value[1]:
        raise ConfigError(f"{where}={value!r}: give [lo, hi] with numbers lo <= hi (binary labels: [0, 1]), "
                          "or null to check only that labels are finite")
    return float(value[0]), float(value[1])


class Task(Protocol):
    metrics: tuple[str, ...]

    def forward(self, model: nn.Module, batch: Batch) -> Any: ...

    def loss(self, output: Any, batch: Batch) -> torch.Tensor: ...

    def predict(self, output: Any) -> torch.Tensor: ...

    def target(self, batch: Batch) -> torch.Tensor: ...


class TaskBase:
    """Default forward: `model(batch.dense, batch.sparse)`, the zoo's ranking signature."""

    metrics: tuple[str, ...] = ()
    # The label values the task trains on, (lo, hi) inclusive, or None (unchecked); rows outside are
    # the readers' bad rows (check_label_range).
    label_range: tuple[float, float] | None = None
    # forward() hands batch.sparse to the model as it is: a PS collection may prefetch its rows
    # (recps.job.loop.Trainer(prefetch=True)). A task whose forward builds other features says False.
    passes_batch_sparse = True

    def forward(self, model: nn.Module, batch: Batch) -> Any:
        return model(batch.dense, batch.sparse)
