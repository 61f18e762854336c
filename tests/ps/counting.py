"""A counting task for recovery tests: with models.LR (logits = the sum of the example's rows + a
dense part), SGD at lr 1 on rows that start at 0 (ps.table.init_std=0), loss = sum of the logits
gives each row the gradient 1 per occurrence of its key, so after training every row holds
-(its key's occurrences in the data trained): an update lost or applied twice shows in its value.

Named by `task._target_=tests.ps.counting.CountingTask` from the repository root (the processes
recps.train starts run there, so `tests` imports as a namespace package).

`job_process`: how the recovery tests run such a job (or torchrun of it) and leave nothing behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Mapping

import torch

from recps.data.batch import Batch
from recps.tasks import BinaryTask

__all__ = ["CountingTask", "job_process"]


class CountingTask(BinaryTask):
    """BinaryTask's evaluation; the loss is the sum of the logits (d loss / d row = 1 per occurrence)."""

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        return logits.sum()


@contextlib.contextmanager
def job_process(cmd: list[str], env: Mapping[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """`cmd` run from the repository root in a session of its own, its output (stderr too) on a text
    pipe; when the block ends, whatever ended it (a wait that timed out, a failed assertion), the
    process group is killed if the process still runs: no launcher, server or worker outlives a test."""
    from recps.config import PROJECT_ROOT

    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=None if env is None else dict(env))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
