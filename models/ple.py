"""PLE: progressive layered extraction (task-specific and shared experts, stacked).

Paper: Tang et al., "Progressive Layered Extraction (PLE): A Novel Multi-Task Learning
(MTL) Model for Personalized Recommendations", RecSys 2020, https://doi.org/10.1145/3383313.3412236

Shapes: B batch, N = F*D + I input width, S shared experts, E experts per task, H expert
width, T tasks, L extraction levels.

    level l: inputs h_1..h_T, h_s  (each (B, ·))
      task t:  experts_t(h_t) ∪ shared(h_s) ─► gate_t(h_t) softmax over E+S ─► h_t' (B, H)
      shared:  experts of all tasks ∪ shared(h_s) ─► gate_s(h_s) over T·E+S ─► h_s' (B, H)  (not at the last level)
    tower_t(h_t) ─► logits (B, T)

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100,
    ...                        feature_names=[f"C{i}"]) for i in (1, 2)])
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["C1", "C2"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    >>> PLE(ebc, dense_in_features=3, levels=2, expert=(16,), tower=(8,))(torch.randn(2, 3), kjt).shape
    torch.Size([2, 2])
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import collection_layout, mlp

__all__ = ["PLE"]


def _mix(gate: nn.Module, selector: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
    weights = torch.softmax(gate(selector), dim=1).unsqueeze(2)  # (B, X, 1)
    return (weights * torch.stack(experts, dim=1)).sum(dim=1)  # (B, H)


class _Extraction(nn.Module):
    """One customized gate control (CGC) level."""

    def __init__(self, width: int, num_tasks: int, task_experts: int, shared_experts: int,
                 expert: Sequence[int], last: bool) -> None:
        super().__init__()
        self.task_experts = nn.ModuleList(
            nn.ModuleList(mlp(width, expert) for _ in range(task_experts)) for _ in range(num_tasks))
        self.shared_experts = nn.ModuleList(mlp(width, expert) for _ in range(shared_experts))
        self.task_gates = nn.ModuleList(nn.Linear(width, task_experts + shared_experts) for _ in range(num_tasks))
        self.shared_gate = None if last else nn.Linear(width, num_tasks * task_experts + shared_experts)

    def forward(self, task_inputs: list[torch.Tensor], shared_input: torch.Tensor):
        shared = [e(shared_input) for e in self.shared_experts]  # S × (B, H)
        per_task = [[e(x) for e in experts] for experts, x in zip(self.task_experts, task_inputs)]
        outputs = [_mix(gate, x, own + shared)
                   for gate, x, own in zip(self.task_gates, task_inputs, per_task)]  # T × (B, H)
        if self.shared_gate is None:
            return outputs, None
        everything = [h for own in per_task for h in own] + shared
        return outputs, _mix(self.shared_gate, shared_input, everything)


class PLE(nn.Module):
    """PLE with `levels` extraction levels; logits (B, T)."""

    def __init__(self, embedding_bag_collection: nn.Module, dense_in_features: int, num_tasks: int = 2,
                 levels: int = 2, task_experts: int = 2, shared_experts: int = 2,
                 expert: Sequence[int] = (256, 128), tower: Sequence[int] = (64,)) -> None:
        super().__init__()
        names, dim = collection_layout(embedding_bag_collection, "PLE")
        width = len(names) * dim + dense_in_features
        self.num_tasks = num_tasks
        self.sparse_arch = embedding_bag_collection
        self.levels = nn.ModuleList(
            _Extraction(width if level == 0 else expert[-1], num_tasks, task_experts, shared_experts,
                        expert, last=level == levels - 1) for level in range(levels))
        self.towers = nn.ModuleList(mlp(expert[-1], tower, out_features=1) for _ in range(num_tasks))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        x = torch.cat([self.sparse_arch(sparse).values(), dense], dim=1)  # (B, N)
        task_inputs, shared = [x] * self.num_tasks, x
        for level in self.levels:
            task_inputs, shared = level(task_inputs, shared)
        return torch.cat([tower(h) for tower, h in zip(self.towers, task_inputs)], dim=1)  # (B, T)
