"""The one batch type every reader produces and every model consumes.

Shape letters: B batch, I dense inputs, F sparse features, T tasks (label columns).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["Batch"]


@dataclass
class Batch:
    """A mini-batch.

    Attributes:
        dense: (B, I) float32 dense features (I may be 0).
        sparse: KeyedJaggedTensor with F keys (the sparse and sequence columns, in schema
            order); values are int64 feature keys, lengths (F*B,).
        labels: (B, T) float32, one column per label column of the schema.
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(torch.device(device), non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
        )
