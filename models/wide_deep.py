"""Wide & Deep: a linear (wide) part and an MLP (deep) part trained jointly.

Paper: Cheng et al., "Wide & Deep Learning for Recommender Systems", DLRS 2016,
https://arxiv.org/abs/1606.07792

Shapes: B batch, F sparse features, D embedding dim, E = D+1 row width, I dense inputs.
Rows hold [w | v]: w is the feature's wide (linear) weight, v its deep embedding.

    sparse KJT ─► SparseArch ─► (B, F, E) ─┬─ w (B, F) ─► Σ ───────────────┐
                                           └─ v (B, F*D) ─┐                 │
    dense (B, I) ─────────────────────────────────────────┴─► MLP ─► (B,) ──┼─► logits (B,)
    dense (B, I) ─► Linear (wide) ─► (B,) ──────────────────────────────────┘

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name=f"t{i}", embedding_dim=9, num_embeddings=100,
    ...                        feature_names=[f"C{i}"]) for i in (1, 2)])
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["C1", "C2"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    >>> WideDeep(ebc, dense_in_features=13, hidden=(16, 8))(torch.randn(2, 13), kjt).shape
    torch.Size([2])
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import check_dense, collection_layout, mlp

__all__ = ["WideDeep"]


class WideDeep(nn.Module):
    """Wide (linear) + deep (MLP over embeddings and dense inputs) over rows [w | v]."""

    def __init__(self, embedding_bag_collection: nn.Module, dense_in_features: int,
                 hidden: Sequence[int] = (400, 400, 400), dropout: float = 0.0) -> None:
        super().__init__()
        names, width = collection_layout(embedding_bag_collection, "WideDeep")
        if width < 2:
            raise ValueError(f"WideDeep: embedding_dim={width}; rows hold 1 wide weight + D, set it to at least 2")
        self.num_features = len(names)
        self.deep_dim = width - 1
        self.dense_in_features = int(dense_in_features)
        self.sparse_arch = embedding_bag_collection
        self.wide_dense = nn.Linear(dense_in_features, 1) if dense_in_features else None
        self.over_arch = mlp(self.num_features * self.deep_dim + dense_in_features, hidden, 1, dropout)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        check_dense(dense, self.dense_in_features, "WideDeep")
        rows = self.sparse_arch(sparse).values()  # (B, F*E)
        rows = rows.view(rows.shape[0], self.num_features, self.deep_dim + 1)  # (B, F, E)
        wide = rows[:, :, 0].sum(dim=1)  # (B,)
        if self.wide_dense is not None:
            wide = wide + self.wide_dense(dense).squeeze(1)  # (B,)
        deep_in = torch.cat([rows[:, :, 1:].flatten(1), dense], dim=1)  # (B, F*D + I)
        return wide + self.over_arch(deep_in).squeeze(1)  # (B,)
