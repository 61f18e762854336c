"""Batches on the device the model computes on: the trainer's loader stage.

`BatchPlacement(device, sparse_device)` wraps the batches a training thread reads
(`placement(batches)`). On the CPU (device and sparse_device both "cpu") it returns them as they
are: the same objects, no copy, no extra step. On a GPU it is a prefetching loader: when the
reader hands over batch i+1, its tensors are pinned and copied up on a side CUDA stream
(non-blocking), then batch i is handed to the step; the step's stream waits for batch i's copy
(an event, not the host), so the copy of batch i+1 overlaps step i's kernels.

Where each part goes:
    dense (B, I), labels (B, T)   -> device (the dense layers and the loss compute there)
    sparse (KJT)                  -> sparse_device: the embedding collection's `input_device`:
                                     ps=local's TBE reads its keys on the device; a PS collection
                                     on the host (its keys are hashed there and pulled from the
                                     servers; it copies the pulled rows up itself, recps.ps.embedding)

Example (CPU: the batches themselves):

    >>> from recps.data.batch import Batch
    >>> from torchrec import KeyedJaggedTensor
    >>> b = Batch(torch.zeros(2, 1), KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([1, 2]), torch.tensor([1, 1])),
    ...           torch.ones(2, 1))
    >>> placement = BatchPlacement("cpu")
    >>> batches = [b]
    >>> placement(batches) is batches, placement.moves
    (True, False)
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from recps.data.batch import Batch
from recps.device import same_device, to_device

__all__ = ["BatchPlacement"]


class BatchPlacement:
    """Puts batches where a step reads them (see the module docstring).

    Args:
        device: where the model computes ("cpu", "cuda", "cuda:N" or a torch.device).
        sparse_device: where the embedding collection reads the batch's KJT (None: `device`).
    """

    def __init__(self, device: str | torch.device = "cpu", sparse_device: str | torch.device | None = None) -> None:
        self.device = torch.device(device)
        self.sparse_device = self.device if sparse_device is None else torch.device(sparse_device)
        self.moves = not (self.device.type == "cpu" and self.sparse_device.type == "cpu")

    def __call__(self, batches: Iterable[Batch]) -> Iterable[Batch]:
        """`batches` placed: themselves on the CPU, else a prefetching iterator over them."""
        if not self.moves:
            return batches
        return self._prefetching(iter(batches))

    def place(self, batch: Batch) -> Batch:
        """One batch's tensors where they go (non-blocking host -> GPU copies from pinned memory)."""
        sparse = batch.sparse
        if not same_device(sparse.device(), self.sparse_device):
            if self.sparse_device.type == "cuda" and sparse.device().type == "cpu":
                sparse = sparse.pin_memory()
            sparse = sparse.to(self.sparse_device, non_blocking=True)
        return Batch(dense=to_device(batch.dense, self.device), sparse=sparse,
                     labels=to_device(batch.labels, self.device))

    def _prefetching(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        if self.device.type != "cuda":
            for batch in batches:  # another device type: plain copies, in order
                yield self.place(batch)
            return
        copies = torch.cuda.Stream(device=self.device)
        pending = None  # (placed batch, its copy's event)
        for batch in batches:
            with torch.cuda.stream(copies):
                placed = self.place(batch)
                copied = torch.cuda.Event()
                copied.record(copies)
            if pending is not None:
                yield self._ready(*pending)  # batch i's step runs while batch i+1's copy is in flight
            pending = (placed, copied)
        if pending is not None:
            yield self._ready(*pending)

    def _ready(self, batch: Batch, copied) -> Batch:
        """`batch` for the consuming thread's current stream: it waits for the copy (on the GPU,
        not here), and the copies' memory is not reused before that stream is done with it."""
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(copied)
        for t in (batch.dense, batch.labels):
            if t.device.type == "cuda":
                t.record_stream(stream)
        if batch.sparse.device().type == "cuda":
            batch.sparse.record_stream(stream)
        return batch
