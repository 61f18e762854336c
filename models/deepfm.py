"""DeepFM: a factorization machine and a DNN sharing one embedding per feature.

Paper: Guo et al., "DeepFM: A Factorization-Machine based Neural Network for CTR
Prediction", IJCAI 2017, https://arxiv.org/abs/1703.04247

Shapes: B batch, F sparse features, E = D+1 embedding row width, D factor dim, I dense inputs.
Each table row holds [w | v]: column 0 is the feature's first-order weight w, columns 1..D
its factor vector v, so one lookup per feature serves the first-order term, the FM and the DNN.

    sparse KJT ─► SparseArch ─► (B, F, E) ─┬─ w (B, F)    ─► first order Σ w ─────────────────┐
                                           └─ v (B, F, D) ─┬─► FM: ½((Σv)² − Σv²) (B,) ────────┤
                                                           └─ flatten (B, F·D) ─┐              ├─► Σ ─► logits (B,)
    dense (B, I) ─┬─ Linear ─► first order (B,) ─────────────────────────────── │ ─────────────┤
                  └──────────────────────────────── concat (B, F·D + I) ◄───────┘              │
                                                        └─► OverArch: MLP ─► (B,) ────────────┘

Dense inputs enter the first-order term and the DNN, not the FM (DeepCTR's convention).
The FM interacts the sparse fields only: dense values here are unnormalised (log1p counts
reach ~20), and as one projected FM field (torchrec's DeepFM) or as x_j·v_j fields
(PaddleRec, whose reader first min-max scales them to [0, 1]) they dominated the pairwise
sum; measured on the generated Criteo world (200k rows, 26 slots × 100 keys) the projected
field cost 0.02 AUC against the same model without it (0.738 against 0.757 after 2 epochs).

The logits are pre-sigmoid: losses apply the sigmoid (no double sigmoid).

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name=f"t{i}", embedding_dim=9, num_embeddings=100,
    ...                        feature_names=[f"C{i}"]) for i in (1, 2)])
    >>> model = DeepFM(ebc, dense_in_features=13, hidden=(32, 16))
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["C1", "C2"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    >>> model(torch.randn(2, 13), kjt).shape
    torch.Size([2])
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import check_dense, collection_layout, mlp

__all__ = ["DeepFM"]


class DeepFM(nn.Module):
    """DeepFM over an injected embedding-bag collection whose rows are [w | v].

    Args:
        embedding_bag_collection: pools each sparse feature to (B, D+1).
        dense_in_features: I; the dense inputs get a first-order linear term and feed the DNN.
        hidden: DNN layer sizes.
        dropout: dropout after each DNN layer.
    """

    def __init__(
        self,
        embedding_bag_collection: nn.Module,
        dense_in_features: int,
        hidden: Sequence[int] = (400, 400, 400),
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        names, width = collection_layout(embedding_bag_collection, "DeepFM")
        if width < 2:
            raise ValueError(
                f"DeepFM: embedding_dim={width}; rows hold 1 first-order weight + D factors, "
                "set embedding_dim to at least 2"
            )
        self.num_features = len(names)
        self.factor_dim = width - 1
        self.dense_in_features = int(dense_in_features)
        self.sparse_arch = embedding_bag_collection
        self.dense_linear = nn.Linear(dense_in_features, 1) if dense_in_features else None
        self.over_arch = mlp(self.num_features * self.factor_dim + dense_in_features, hidden,
                             out_features=1, dropout=dropout)
        self.bias = nn.Parameter(torch.zeros(()))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Returns logits (B,) for dense (B, I) and a KJT of the F sparse features."""
        check_dense(dense, self.dense_in_features, "DeepFM")
        rows = self.sparse_arch(sparse).values()  # (B, F*E)
        rows = rows.view(rows.shape[0], self.num_features, self.factor_dim + 1)  # (B, F, E)
        first = rows[:, :, 0].sum(dim=1) + self.bias  # (B,)
        v = rows[:, :, 1:]  # (B, F, D)
        deep_in = v.flatten(1)  # (B, F*D)
        if self.dense_linear is not None:
            first = first + self.dense_linear(dense).squeeze(1)  # (B,)
            deep_in = torch.cat([deep_in, dense], dim=1)  # (B, F*D + I)
        summed = v.sum(dim=1)  # (B, D)
        fm = 0.5 * (summed.pow(2) - v.pow(2).sum(dim=1)).sum(dim=1)  # (B,)
        deep = self.over_arch(deep_in).squeeze(1)  # (B,)
        return first + fm + deep  # (B,)
