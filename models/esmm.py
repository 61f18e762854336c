"""ESMM: entire-space multi-task model for post-click conversion (CVR) estimation.

Paper: Ma et al., "Entire Space Multi-Task Model: An Effective Approach for Estimating
Post-Click Conversion Rate", SIGIR 2018, https://arxiv.org/abs/1804.07931

Shapes: B batch, F sparse features, D embedding dim, I dense inputs, N = F*D + I.

    sparse KJT ─► SparseArch (shared) ─► (B, F*D) ─┐                 ┌─► CTR tower ─► ctr (B, 1) ─┐
                                                   ├─► x (B, N) ─────┤                            ├─► logits (B, 2)
    dense (B, I) ──────────────────────────────────┘                 └─► CVR tower ─► cvr (B, 1) ─┘

    pCTR = σ(ctr), pCVR = σ(cvr), pCTCVR = pCTR · pCVR   (computed by the task, not here)

Both towers share the embeddings and see every impression (the entire space), so the CVR
tower is not trained on clicked rows only (the paper's sample-selection bias) and its
sparse conversion signal borrows the CTR task's embeddings. The CVR tower has no loss of
its own: recps.tasks.multitask.MultiTask(esmm=True) trains σ(ctr) on clicks and the product
pCTCVR on click-and-convert labels.

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100,
    ...                        feature_names=[f"C{i}"]) for i in (1, 2)])
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["C1", "C2"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    >>> ESMM(ebc, dense_in_features=3, tower=(8,))(torch.randn(2, 3), kjt).shape
    torch.Size([2, 2])
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import collection_layout, mlp

__all__ = ["ESMM"]


class ESMM(nn.Module):
    """CTR and CVR towers over shared embeddings; logits (B, 2) = [ctr, cvr].

    Args:
        embedding_bag_collection: pools each sparse feature to (B, D); shared by both towers.
        dense_in_features: I.
        tower: each tower's hidden sizes before its 1-unit linear head (the paper: 200, 80).
    """

    num_tasks = 2

    def __init__(self, embedding_bag_collection: nn.Module, dense_in_features: int,
                 tower: Sequence[int] = (200, 80)) -> None:
        super().__init__()
        names, dim = collection_layout(embedding_bag_collection, "ESMM")
        width = len(names) * dim + dense_in_features
        self.sparse_arch = embedding_bag_collection
        self.ctr_tower = mlp(width, tower, out_features=1)
        self.cvr_tower = mlp(width, tower, out_features=1)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        x = torch.cat([self.sparse_arch(sparse).values(), dense], dim=1)  # (B, N)
        return torch.cat([self.ctr_tower(x), self.cvr_tower(x)], dim=1)  # (B, 2): [ctr, cvr] logits
