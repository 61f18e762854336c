"""DLRM: bottom MLP for dense inputs, pairwise dot-product interactions, top MLP.

Paper: Naumov et al., "Deep Learning Recommendation Model for Personalization and
Recommendation Systems", 2019, https://arxiv.org/abs/1906.00091
Built on torchrec's reference `torchrec.models.dlrm.DLRM` (DenseArch, SparseArch,
InteractionArch, OverArch); this class only returns logits (B,) like the rest of the zoo.

Shapes: B batch, F sparse features, D embedding dim (= the bottom MLP's last size), I dense inputs.

    dense (B, I) ─► DenseArch (bottom MLP) ─► (B, D) ─┐
    sparse KJT ─► SparseArch ─► (B, F, D) ────────────┴─► InteractionArch: [dense | pairwise dots]
        (B, D + F(F+1)/2) ─► OverArch (top MLP, last layer linear) ─► logits (B,)

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100,
    ...                        feature_names=[f"C{i}"]) for i in (1, 2)])
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["C1", "C2"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    >>> DLRM(ebc, dense_in_features=13, bottom=(16, 8), top=(16,))(torch.randn(2, 13), kjt).shape
    torch.Size([2])
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.models.dlrm import DLRM as _TorchrecDLRM
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import check_dense, collection_layout

__all__ = ["DLRM"]


class DLRM(nn.Module):
    """DLRM; `bottom[-1]` must equal the embedding dim (the dense vector joins the dots)."""

    def __init__(self, embedding_bag_collection: nn.Module, dense_in_features: int,
                 bottom: Sequence[int] = (512, 256, 16), top: Sequence[int] = (512, 256)) -> None:
        super().__init__()
        _, dim = collection_layout(embedding_bag_collection, "DLRM")
        if not bottom or bottom[-1] != dim:
            raise ValueError(f"DLRM: bottom={list(bottom)} must end in the embedding dim {dim}; "
                             f"set model.bottom=[..., {dim}] or embedding_dim={bottom[-1] if bottom else '?'}")
        self.dense_in_features = int(dense_in_features)
        self.dlrm = _TorchrecDLRM(embedding_bag_collection, dense_in_features, list(bottom), [*top, 1])

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        check_dense(dense, self.dense_in_features, "DLRM")
        return self.dlrm(dense, sparse).squeeze(1)  # (B,)
