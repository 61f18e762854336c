"""MMoE: multi-gate mixture of experts for multi-task learning.

Paper: Ma et al., "Modeling Task Relationships in Multi-task Learning with Multi-gate
Mixture-of-Experts", KDD 2018, https://doi.org/10.1145/3219819.3220007

Shapes: B batch, F sparse features, D embedding dim, I dense inputs, N = F*D + I input
width, X experts, H expert width, T tasks.

    x = [SparseArch(KJT) (B, F*D) | dense (B, I)]  (B, N)
    x ─► expert_1..expert_X (MLPs) ─► E (B, X, H)
    x ─► gate_t = softmax(W_t x) ─► G (B, T, X)          one gate per task, rows sum to 1
    G @ E ─► (B, T, H) ─► tower_t on row t ─► (B, 1) each ─► logits (B, T)

As in the paper (eq. 5-6), a gate is a bias-free linear map of the input followed by a
softmax over the experts, and every task's input is its gate's convex mix of all experts.

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100,
    ...                        feature_names=[f"C{i}"]) for i in (1, 2)])
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["C1", "C2"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    >>> model = MMoE(ebc, dense_in_features=3, num_experts=3, expert=(16,), tower=(8,))
    >>> model(torch.randn(2, 3), kjt).shape, model.gate_weights(torch.randn(2, 3), kjt).shape
    (torch.Size([2, 2]), torch.Size([2, 2, 3]))
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import collection_layout, mlp

__all__ = ["MMoE"]


class MMoE(nn.Module):
    """`num_experts` shared experts, one softmax gate and one tower per task; logits (B, T).

    Args:
        embedding_bag_collection: pools each sparse feature to (B, D).
        dense_in_features: I.
        num_tasks: T.
        num_experts: X, experts shared by every task.
        expert: each expert MLP's layer sizes (at least one; the last is H).
        tower: each tower's hidden sizes before its 1-unit linear head (may be empty).
    """

    def __init__(self, embedding_bag_collection: nn.Module, dense_in_features: int, num_tasks: int = 2,
                 num_experts: int = 4, expert: Sequence[int] = (256, 128), tower: Sequence[int] = (64,)) -> None:
        super().__init__()
        names, dim = collection_layout(embedding_bag_collection, "MMoE")
        if num_tasks < 1:
            raise ValueError(f"MMoE: num_tasks={num_tasks}; set it to the number of label columns (>= 1)")
        if num_experts < 1:
            raise ValueError(f"MMoE: num_experts={num_experts}; the gates need at least 1 expert to mix")
        if not expert:
            raise ValueError("MMoE: expert=[] is empty; give each expert at least one layer, e.g. [128]")
        width = len(names) * dim + dense_in_features
        self.num_tasks = int(num_tasks)
        self.sparse_arch = embedding_bag_collection
        self.experts = nn.ModuleList(mlp(width, expert) for _ in range(num_experts))
        self.gates = nn.ModuleList(nn.Linear(width, num_experts, bias=False) for _ in range(num_tasks))
        self.towers = nn.ModuleList(mlp(expert[-1], tower, out_features=1) for _ in range(num_tasks))

    def _gates(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.softmax(gate(x), dim=1) for gate in self.gates], dim=1)  # (B, T, X)

    def gate_weights(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Each task's weights over the experts (B, T, X); every (b, t) row sums to 1."""
        return self._gates(torch.cat([self.sparse_arch(sparse).values(), dense], dim=1))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        x = torch.cat([self.sparse_arch(sparse).values(), dense], dim=1)  # (B, N)
        experts = torch.stack([e(x) for e in self.experts], dim=1)  # (B, X, H)
        mixed = torch.bmm(self._gates(x), experts)  # (B, T, H)
        return torch.cat([tower(mixed[:, t]) for t, tower in enumerate(self.towers)], dim=1)  # (B, T)
