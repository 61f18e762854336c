"""The counting model of the recovery tests: with models.LR (logits = the sum of the example's rows
+ a dense part), SGD at lr 1 on rows that start at 0 (ps.table.init_std=0), loss = sum of the
logits gives each row the gradient 1 per occurrence of its key, so after training every row holds
-(its key's occurrences in the data trained): an update lost or applied twice shows in its value.

Named by `task._target_=tests.helpers.counting.CountingTask` (COUNTING_TASK): the processes that
recps.train starts run from the checkout with it on PYTHONPATH (tests.helpers.cli.child_env), so
`tests` imports there as a namespace package."""

from __future__ import annotations

from pathlib import Path

import torch

from recps.config import compose_config
from recps.data.batch import Batch
from recps.job.build import prepare_dataset
from recps.job.checkpoint import read_ps_checkpoint
from recps.ps.embedding import salted_keys
from recps.tasks import BinaryTask

__all__ = ["COUNTING_TASK", "CountingTask", "assert_exact_counts"]

COUNTING_TASK = "tests.helpers.counting.CountingTask"


class CountingTask(BinaryTask):
    """BinaryTask's evaluation; the loss is the sum of the logits (d loss / d row = 1 per occurrence)."""

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        return logits.sum()


def assert_exact_counts(overrides: list[str], checkpoint: Path) -> int:
    """Every row of the final checkpoint's embedding_d1 equals -(its key's occurrences in the training
    split) x trainer.epochs; returns the number of rows."""
    cfg = compose_config(overrides)
    data = prepare_dataset(cfg.dataset, seed=int(cfg.seed))
    keys = []
    for batch in data.train.batches(int(cfg.trainer.batch_size), 0, 1, 0):
        for feature in batch.sparse.keys():
            keys.append(salted_keys(batch.sparse[feature].values(), f"t_{feature}"))
    expected_keys, counts = torch.unique(torch.cat(keys), return_counts=True)  # ascending, as the checkpoint's
    counts *= int(cfg.trainer.epochs)
    rows = read_ps_checkpoint(str(checkpoint), tables=["embedding_d1"])["embedding_d1"]
    assert torch.equal(rows.keys, expected_keys), f"{len(rows)} rows for {expected_keys.numel()} keys"
    got = -rows.values[:, 0]
    wrong = (got != counts.to(got.dtype)).nonzero().flatten()
    assert wrong.numel() == 0, (f"{wrong.numel()} of {len(rows)} rows miscounted, e.g. key {int(rows.keys[wrong[0]])}: "
                                f"{float(got[wrong[0]])} updates applied for {int(counts[wrong[0]])} occurrences")
    return len(rows)
