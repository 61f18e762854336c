"""The counting model of the recovery tests: with models.LR (logits = the sum of the example's rows
+ a dense part), SGD at lr 1 on rows that start at 0 (ps.table.init_std=0), loss = sum of the
logits gives each row the gradient 1 per occurrence of its key, so after training every row holds
-(its key's occurrences in the data trained): an update lost or applied twice shows in its value.

Named by `task._target_=tests.helpers.counting.CountingTask` (COUNTING_TASK): the processes that
recps.train starts run from the checkout with it on PYTHONPATH (tests.helpers.cli.child_env), so
`tests` imports there as a namespace package."""

from __future__ import annotations

import torch

from recps.data.batch import Batch
from recps.tasks import BinaryTask

__all__ = ["COUNTING_TASK", "CountingTask"]

COUNTING_TASK = "tests.helpers.counting.CountingTask"


class CountingTask(BinaryTask):
    """BinaryTask's evaluation; the loss is the sum of the logits (d loss / d row = 1 per occurrence)."""

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        return logits.sum()
