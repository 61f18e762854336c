"""DCN-v2: Deep & Cross Network with matrix (optionally low-rank) cross layers.

Paper: Wang et al., "DCN V2: Improved Deep & Cross Network and Practical Lessons for
Web-scale Learning to Rank Systems", WWW 2021, https://arxiv.org/abs/2008.13535 —
cross layer x_{l+1} = x0 ⊙ (W_l x_l + b_l) + x_l, W_l full-rank or U_l V_lᵀ (rank r).
The cross layers are torchrec's `CrossNet` / `LowRankCrossNet`.

Shapes: B batch, F sparse features, D embedding dim, I dense inputs, N = F*D + I.

    x0 = [SparseArch(KJT) (B, F*D) | dense (B, I)]  (B, N)
      stacked:  x0 ─► CrossNet ─► (B, N) ─► MLP ─► Linear ─► logits (B,)
      parallel: x0 ─┬► CrossNet ─► (B, N) ─┐
                    └► MLP ──────► (B, H) ─┴► Linear ─► logits (B,)

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100,
    ...                        feature_names=[f"C{i}"]) for i in (1, 2)])
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["C1", "C2"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    >>> DCNv2(ebc, dense_in_features=13, hidden=(16,), low_rank=4)(torch.randn(2, 13), kjt).shape
    torch.Size([2])
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.modules.crossnet import CrossNet, LowRankCrossNet
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import check_dense, collection_layout, mlp

__all__ = ["DCNv2"]


class DCNv2(nn.Module):
    """DCN-v2 with `cross_layers` matrix cross layers; `low_rank` > 0 uses rank-r factors.

    Args:
        structure: "parallel" (cross and deep side by side) or "stacked" (cross, then deep).
    """

    def __init__(self, embedding_bag_collection: nn.Module, dense_in_features: int,
                 cross_layers: int = 3, low_rank: int = 0, hidden: Sequence[int] = (400, 400),
                 structure: str = "parallel", dropout: float = 0.0) -> None:
        super().__init__()
        if structure not in ("parallel", "stacked"):
            raise ValueError(f"DCNv2: structure={structure!r}; use 'parallel' or 'stacked'")
        names, dim = collection_layout(embedding_bag_collection, "DCNv2")
        width = len(names) * dim + dense_in_features
        self.structure = structure
        self.dense_in_features = int(dense_in_features)
        self.sparse_arch = embedding_bag_collection
        self.cross_arch = (LowRankCrossNet(width, cross_layers, low_rank) if low_rank > 0
                           else CrossNet(width, cross_layers))
        self.deep_arch = mlp(width, hidden, dropout=dropout)
        deep_out = hidden[-1] if hidden else width
        self.over_arch = nn.Linear(deep_out if structure == "stacked" else width + deep_out, 1)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        check_dense(dense, self.dense_in_features, "DCNv2")
        x0 = torch.cat([self.sparse_arch(sparse).values(), dense], dim=1)  # (B, N)
        crossed = self.cross_arch(x0)  # (B, N)
        if self.structure == "stacked":
            top = self.deep_arch(crossed)  # (B, H)
        else:
            top = torch.cat([crossed, self.deep_arch(x0)], dim=1)  # (B, N + H)
        return self.over_arch(top).squeeze(1)  # (B,)
