"""MMoE: multi-gate mixture of experts for multi-task learning.

Paper: Ma et al., "Modeling Task Relationships in Multi-task Learning with Multi-gate
Mixture-of-Experts", KDD 2018, https://doi.org/10.1145/3219819.3220007

Shapes: B batch, N = F*D + I input width, X experts, H expert width, T tasks.

    x (B, N) ─► experts ─► (B, X, H)
    x (B, N) ─► gate_t: softmax(Linear) ─► (B, X) ─► Σ_x gate·expert ─► (B, H) ─► tower_t ─► (B,)   for each task t
    logits (B, T)

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100,
    ...                        feature_names=[f"C{i}"]) for i in (1, 2)])
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["C1", "C2"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    >>> MMoE(ebc, dense_in_features=3, num_experts=3, expert=(16,), tower=(8,))(torch.randn(2, 3), kjt).shape
    torch.Size([2, 2])
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import collection_layout, mlp

__all__ = ["MMoE"]


class MMoE(nn.Module):
    """`num_experts` shared experts, one softmax gate and one tower per task; logits (B, T)."""

    def __init__(self, embedding_bag_collection: nn.Module, dense_in_features: int, num_tasks: int = 2,
                 num_experts: int = 4, expert: Sequence[int] = (256, 128), tower: Sequence[int] = (64,)) -> None:
        super().__init__()
        names, dim = collection_layout(embedding_bag_collection, "MMoE")
        width = len(names) * dim + dense_in_features
        self.sparse_arch = embedding_bag_collection
        self.experts = nn.ModuleList(mlp(width, expert) for _ in range(num_experts))
        self.gates = nn.ModuleList(nn.Linear(width, num_experts) for _ in range(num_tasks))
        self.towers = nn.ModuleList(mlp(expert[-1], tower, out_features=1) for _ in range(num_tasks))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        x = torch.cat([self.sparse_arch(sparse).values(), dense], dim=1)  # (B, N)
        experts = torch.stack([e(x) for e in self.experts], dim=1)  # (B, X, H)
        logits = []
        for gate, tower in zip(self.gates, self.towers):
            weights = torch.softmax(gate(x), dim=1).unsqueeze(2)  # (B, X, 1)
            logits.append(tower((weights * experts).sum(dim=1)))  # (B, 1)
        return torch.cat(logits, dim=1)  # (B, T)
