"""DCN: Deep & Cross Network (vector cross layers next to an MLP).

Paper: Wang et al., "Deep & Cross Network for Ad Click Predictions", ADKDD 2017,
https://arxiv.org/abs/1708.05123 — cross layer x_{l+1} = x0 · (x_l · w_l) + b_l + x_l.
The cross layers are torchrec's `VectorCrossNet` (the DCN-v1 formulation).

Shapes: B batch, F sparse features, D embedding dim, I dense inputs, N = F*D + I.

    sparse KJT ─► SparseArch ─► (B, F*D) ─┐
    dense (B, I) ─────────────────────────┴─► x0 (B, N) ─┬─► CrossNet (L layers) ─► (B, N) ─┐
                                                         └─► MLP ─────────────────► (B, H) ─┴─► Linear ─► logits (B,)

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100,
    ...                        feature_names=[f"C{i}"]) for i in (1, 2)])
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["C1", "C2"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    >>> DCN(ebc, dense_in_features=13, hidden=(16,))(torch.randn(2, 13), kjt).shape
    torch.Size([2])
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.modules.crossnet import VectorCrossNet
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import check_dense, collection_layout, mlp

__all__ = ["DCN"]


class DCN(nn.Module):
    """Deep & Cross Network: `cross_layers` vector cross layers in parallel with an MLP."""

    def __init__(self, embedding_bag_collection: nn.Module, dense_in_features: int,
                 cross_layers: int = 3, hidden: Sequence[int] = (400, 400), dropout: float = 0.0) -> None:
        super().__init__()
        names, dim = collection_layout(embedding_bag_collection, "DCN")
        width = len(names) * dim + dense_in_features
        self.dense_in_features = int(dense_in_features)
        self.sparse_arch = embedding_bag_collection
        self.cross_arch = VectorCrossNet(width, cross_layers)
        self.deep_arch = mlp(width, hidden, dropout=dropout)
        self.over_arch = nn.Linear(width + (hidden[-1] if hidden else width), 1)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        check_dense(dense, self.dense_in_features, "DCN")
        x0 = torch.cat([self.sparse_arch(sparse).values(), dense], dim=1)  # (B, N)
        both = torch.cat([self.cross_arch(x0), self.deep_arch(x0)], dim=1)  # (B, N + H)
        return self.over_arch(both).squeeze(1)  # (B,)
