"""CTR-DNN: PaddleRec's baseline click-through-rate DNN.

Paper/reference: PaddleRec `models/rank/dnn` (the model of Paddle's parameter-server
examples): pooled slot embeddings concatenated with the dense features, then an MLP.
PaddleRec's dnn config: 26 slots, embedding dim 9, 13 dense features, MLP 512-256-128-32, Adam.

Shapes: B batch, F sparse features, D embedding dim, I dense inputs.

    sparse KJT ──► SparseArch (injected EmbeddingBagCollection) ──► (B, F*D) ─┐
                                                                              ├─ concat (B, F*D+I)
    dense (B, I) ─────────────────────────────────────────────────────────────┘
                                                  │
                                OverArch: MLP 512-256-128-32 ──► Linear ──► logits (B,)

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name=f"t{i}", embedding_dim=9, num_embeddings=100,
    ...                        feature_names=[f"C{i}"]) for i in (1, 2)])
    >>> model = CTRDNN(ebc, dense_in_features=13)
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

__all__ = ["CTRDNN"]


class CTRDNN(nn.Module):
    """PaddleRec's CTR-DNN over an injected embedding-bag collection.

    Args:
        embedding_bag_collection: pools each sparse feature to (B, D); torchrec's
            EmbeddingBagCollection or recps' PS-backed one.
        dense_in_features: I, the number of dense inputs.
        hidden: MLP layer sizes.
    """

    def __init__(
        self,
        embedding_bag_collection: nn.Module,
        dense_in_features: int,
        hidden: Sequence[int] = (512, 256, 128, 32),
    ) -> None:
        super().__init__()
        names, dim = collection_layout(embedding_bag_collection, "CTRDNN")
        self.dense_in_features = int(dense_in_features)
        self.sparse_arch = embedding_bag_collection
        self.over_arch = mlp(len(names) * dim + dense_in_features, hidden, out_features=1)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Returns logits (B,) for dense (B, I) and a KJT of the F sparse features."""
        check_dense(dense, self.dense_in_features, "CTRDNN")
        pooled = self.sparse_arch(sparse).values()  # (B, F*D)
        x = torch.cat([pooled, dense], dim=1)  # (B, F*D + I)
        return self.over_arch(x).squeeze(1)  # (B,)
