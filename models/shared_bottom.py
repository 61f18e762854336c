"""Shared-Bottom multi-task model: one shared MLP, one tower per task.

Reference: Caruana, "Multitask Learning", Machine Learning 28, 1997 (hard parameter
sharing), https://doi.org/10.1023/A:1007379606734; the baseline of MMoE and PLE.

Shapes: B batch, F sparse features, D embedding dim, I dense inputs, N = F*D + I,
H bottom width, T tasks.

    sparse KJT ─► SparseArch ─► (B, F*D) ─┐
                                          ├─► x (B, N) ─► bottom MLP ─► (B, H) ─┬─► tower_1 ─► (B, 1) ─┐
    dense (B, I) ─────────────────────────┘                                     ├─► ...                ├─► logits (B, T)
                                                                                └─► tower_T ─► (B, 1) ─┘

Every task sees the same bottom representation; the towers alone are task-specific.

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100,
    ...                        feature_names=[f"C{i}"]) for i in (1, 2)])
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["C1", "C2"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    >>> SharedBottom(ebc, dense_in_features=3, bottom=(16,), tower=(8,))(torch.randn(2, 3), kjt).shape
    torch.Size([2, 2])
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import collection_layout, mlp

__all__ = ["SharedBottom"]


class SharedBottom(nn.Module):
    """A shared bottom MLP and `num_tasks` towers; returns logits (B, T).

    Args:
        embedding_bag_collection: pools each sparse feature to (B, D).
        dense_in_features: I.
        num_tasks: T, the number of towers (logit columns).
        bottom: the shared MLP's layer sizes (at least one).
        tower: each tower's hidden sizes before its 1-unit linear head (may be empty).
    """

    def __init__(self, embedding_bag_collection: nn.Module, dense_in_features: int, num_tasks: int = 2,
                 bottom: Sequence[int] = (256, 128), tower: Sequence[int] = (64,)) -> None:
        super().__init__()
        names, dim = collection_layout(embedding_bag_collection, "SharedBottom")
        if num_tasks < 1:
            raise ValueError(f"SharedBottom: num_tasks={num_tasks}; set it to the number of label columns (>= 1)")
        if not bottom:
            raise ValueError("SharedBottom: bottom=[] is empty; give the shared MLP at least one layer, e.g. [128]")
        self.num_tasks = int(num_tasks)
        self.sparse_arch = embedding_bag_collection
        self.bottom = mlp(len(names) * dim + dense_in_features, bottom)
        self.towers = nn.ModuleList(mlp(bottom[-1], tower, out_features=1) for _ in range(num_tasks))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        x = torch.cat([self.sparse_arch(sparse).values(), dense], dim=1)  # (B, N)
        shared = self.bottom(x)  # (B, H)
        return torch.cat([tower(shared) for tower in self.towers], dim=1)  # (B, T)
