"""FM: factorization machine (first-order weights + factorized pairwise interactions).

Paper: Rendle, "Factorization Machines", ICDM 2010, https://doi.org/10.1109/ICDM.2010.127

Shapes: B batch, F sparse features, D factor dim, E = D+1 row width, I dense inputs.
Each row holds [w | v] (first-order weight, then the factor), as in DeepFM; the dense
inputs get a linear term only. Projected to one more factor field they dominated the
pairwise sum (the values are unnormalised log1p counts), as measured for DeepFM.

    sparse KJT ─► SparseArch ─► (B, F, E) ─┬─ w ─► Σ w ───────────────────────────┐
                                           └─ v (B, F, D) ─► ½((Σv)² − Σv²) ──────┼─► logits (B,)
    dense (B, I) ─► Linear ─► (B,) ───────────────────────────────────────────────┘

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name=f"t{i}", embedding_dim=5, num_embeddings=100,
    ...                        feature_names=[f"C{i}"]) for i in (1, 2)])
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["C1", "C2"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    >>> FM(ebc, dense_in_features=13)(torch.randn(2, 13), kjt).shape
    torch.Size([2])
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import check_dense, collection_layout

__all__ = ["FM"]


class FM(nn.Module):
    """Second-order factorization machine over rows [w | v]."""

    def __init__(self, embedding_bag_collection: nn.Module, dense_in_features: int) -> None:
        super().__init__()
        names, width = collection_layout(embedding_bag_collection, "FM")
        if width < 2:
            raise ValueError(f"FM: embedding_dim={width}; rows hold 1 weight + D factors, set it to at least 2")
        self.num_features = len(names)
        self.factor_dim = width - 1
        self.dense_in_features = int(dense_in_features)
        self.sparse_arch = embedding_bag_collection
        self.dense_linear = nn.Linear(dense_in_features, 1) if dense_in_features else None
        self.bias = nn.Parameter(torch.zeros(()))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        check_dense(dense, self.dense_in_features, "FM")
        rows = self.sparse_arch(sparse).values()  # (B, F*E)
        rows = rows.view(rows.shape[0], self.num_features, self.factor_dim + 1)  # (B, F, E)
        logits = rows[:, :, 0].sum(dim=1) + self.bias  # (B,)
        v = rows[:, :, 1:]  # (B, F, D)
        if self.dense_linear is not None:
            logits = logits + self.dense_linear(dense).squeeze(1)  # (B,)
        pair = 0.5 * (v.sum(dim=1).pow(2) - v.pow(2).sum(dim=1)).sum(dim=1)  # (B,)
        return logits + pair
