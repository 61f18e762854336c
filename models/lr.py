"""LR: logistic regression over hashed sparse features and dense inputs.

Reference: McMahan et al., "Ad Click Prediction: a View from the Trenches", KDD 2013
(the production baseline every CTR model is compared with).

Shapes: B batch, F sparse features, I dense inputs. Table rows are one weight wide.

    sparse KJT ─► SparseArch (rows of width 1) ─► (B, F) ─► Σ ─┐
    dense (B, I) ─► Linear ─► (B,) ────────────────────────────┴─► + bias ─► logits (B,)

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name=f"t{i}", embedding_dim=1, num_embeddings=100,
    ...                        feature_names=[f"C{i}"]) for i in (1, 2)])
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["C1", "C2"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    >>> LR(ebc, dense_in_features=13)(torch.randn(2, 13), kjt).shape
    torch.Size([2])
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import check_dense, collection_layout

__all__ = ["LR"]


class LR(nn.Module):
    """Logistic regression; the injected collection's rows are the sparse weights (D = 1)."""

    def __init__(self, embedding_bag_collection: nn.Module, dense_in_features: int) -> None:
        super().__init__()
        _, dim = collection_layout(embedding_bag_collection, "LR")
        if dim != 1:
            raise ValueError(f"LR: embedding_dim={dim}; LR's rows are single weights, set embedding_dim=1")
        self.dense_in_features = int(dense_in_features)
        self.sparse_arch = embedding_bag_collection
        self.dense_linear = nn.Linear(dense_in_features, 1) if dense_in_features else None
        self.bias = nn.Parameter(torch.zeros(()))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        check_dense(dense, self.dense_in_features, "LR")
        logits = self.sparse_arch(sparse).values().sum(dim=1) + self.bias  # (B,)
        if self.dense_linear is not None:
            logits = logits + self.dense_linear(dense).squeeze(1)  # (B,)
        return logits
