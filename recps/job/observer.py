"""The hooks the training loop calls around every step: `TrainObserver`.

What observes training (recps.metrics.reporter, recps.debug.dump, benchmarks) implements these
hooks without importing the loop it observes (recps.job.loop).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from recps.data.batch import Batch

__all__ = ["TrainObserver"]


class TrainObserver:
    """Hooks the trainer calls around every step (metrics, debug dumps); all are no-ops here.

    Called from the training threads (`thread` is the index, `step` the fit's step count over
    all threads, `epoch` the pass); an observer keeps per-thread state and locks what it
    shares. `on_fit_start` and `on_fit_end` run in the caller's thread.
    """

    def on_fit_start(self, replicas: Sequence[nn.Module]) -> None:
        """Before any thread starts; replicas[t] is thread t's model (shares the collection)."""

    def on_thread_start(self, thread: int) -> None:
        """First thing in training thread `thread`."""

    def after_backward(self, thread: int) -> None:
        """Gradients of the thread's replica are in `.grad`, not yet applied."""

    def on_batch(self, thread: int, step: int, epoch: int, batch: Batch, logits: torch.Tensor,
                 loss: float) -> None:
        """After the update of `step`; logits (B,) still carry the graph: detach them."""

    def on_epoch_end(self, thread: int, epoch: int) -> None:
        """Thread `thread` has no more batches in `epoch` (not called when stopped early)."""

    def on_checkpoint(self, folder: str, steps: int, client) -> None:
        """(PS worker 0) A checkpoint of the running job was committed at `folder` after `steps`
        steps of each worker; every worker is stopped until this returns, the servers hold what
        the checkpoint holds: `client` (the worker's PSClient) may read them, never push."""

    def on_fit_end(self, failed: bool) -> None:
        """After every thread joined; `failed`: a thread raised (skip collectives then)."""

    def close(self) -> None:
        """The run is over (recps.job.run.training_observers): release files and threads."""
