"""PLE: progressive layered extraction (task-specific and shared experts, stacked).

Paper: Tang et al., "Progressive Layered Extraction (PLE): A Novel Multi-Task Learning
(MTL) Model for Personalized Recommendations", RecSys 2020, https://doi.org/10.1145/3383313.3412236

Shapes: B batch, F sparse features, D embedding dim, I dense inputs, N = F*D + I input
width, T tasks, E experts per task, S shared experts, H expert width, L extraction levels.

    level 1 inputs: h_1 = ... = h_T = h_s = x = [SparseArch(KJT) (B, F*D) | dense (B, I)]  (B, N)
    level l (a customized gate control, CGC, unit):
      task t:  experts_t(h_t) (E) ∪ shared(h_s) (S) ─► softmax(W_t h_t) over E+S ─► h_t' (B, H)
      shared:  all T·E task experts ∪ S shared ─► softmax(W_s h_s) over T·E+S ─► h_s' (B, H)
               (not at level L: nothing reads it)
    tower_t(h_t at level L) ─► (B, 1) each ─► logits (B, T)

As in the paper (eq. 2-6): task experts read their own task's previous output, shared
experts the shared one; each gate is a bias-free linear map of its selector's input and
a softmax, so a task's output is a convex mix of its own and the shared experts.

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100,
    ...                        feature_names=[f"C{i}"]) for i in (1, 2)])
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["C1", "C2"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    >>> model = PLE(ebc, dense_in_features=3, levels=2, expert=(16,), tower=(8,))
    >>> model(torch.randn(2, 3), kjt).shape
    torch.Size([2, 2])
    >>> [(tuple(g["tasks"].shape), g["shared"] is None) for g in model.gate_weights(torch.randn(2, 3), kjt)]
    [((2, 2, 4), False), ((2, 2, 4), True)]
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import collection_layout, mlp

__all__ = ["PLE"]


def _mix(gate: nn.Module, selector: torch.Tensor, experts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A gate's convex mix of experts: (mixed (B, H), weights (B, X))."""
    weights = torch.softmax(gate(selector), dim=1)  # (B, X)
    mixed = torch.bmm(weights.unsqueeze(1), torch.stack(experts, dim=1)).squeeze(1)  # (B, H)
    return mixed, weights


class _Extraction(nn.Module):
    """One customized gate control (CGC) level."""

    def __init__(self, width: int, num_tasks: int, task_experts: int, shared_experts: int,
                 expert: Sequence[int], last: bool) -> None:
        super().__init__()
        self.task_experts = nn.ModuleList(
            nn.ModuleList(mlp(width, expert) for _ in range(task_experts)) for _ in range(num_tasks))
        self.shared_experts = nn.ModuleList(mlp(width, expert) for _ in range(shared_experts))
        self.task_gates = nn.ModuleList(
            nn.Linear(width, task_experts + shared_experts, bias=False) for _ in range(num_tasks))
        self.shared_gate = None if last else nn.Linear(width, num_tasks * task_experts + shared_experts, bias=False)

    def forward(self, task_inputs: list[torch.Tensor], shared_input: torch.Tensor):
        """T task inputs and the shared input (B, ·) -> T outputs, the shared output (B, H)
        (None at the last level) and the gates' weights."""
        shared = [e(shared_input) for e in self.shared_experts]  # S × (B, H)
        per_task = [[e(x) for e in experts] for experts, x in zip(self.task_experts, task_inputs)]  # T × E × (B, H)
        mixes = [_mix(gate, x, own + shared) for gate, x, own in zip(self.task_gates, task_inputs, per_task)]
        outputs = [h for h, _ in mixes]  # T × (B, H)
        gates = {"tasks": torch.stack([w for _, w in mixes], dim=1), "shared": None}  # (B, T, E+S)
        if self.shared_gate is None:
            return outputs, None, gates
        everything = [h for own in per_task for h in own] + shared  # T·E + S × (B, H)
        shared_out, gates["shared"] = _mix(self.shared_gate, shared_input, everything)  # (B, H), (B, T·E+S)
        return outputs, shared_out, gates


class PLE(nn.Module):
    """PLE with `levels` extraction levels; logits (B, T).

    Args:
        embedding_bag_collection: pools each sparse feature to (B, D).
        dense_in_features: I.
        num_tasks: T.
        levels: L, stacked CGC levels (1 is the paper's single-level CGC).
        task_experts: E, experts owned by each task at each level.
        shared_experts: S, experts shared by all tasks at each level.
        expert: each expert MLP's layer sizes (at least one; the last is H).
        tower: each tower's hidden sizes before its 1-unit linear head (may be empty).
    """

    def __init__(self, embedding_bag_collection: nn.Module, dense_in_features: int, num_tasks: int = 2,
                 levels: int = 2, task_experts: int = 2, shared_experts: int = 2,
                 expert: Sequence[int] = (256, 128), tower: Sequence[int] = (64,)) -> None:
        super().__init__()
        names, dim = collection_layout(embedding_bag_collection, "PLE")
        if num_tasks < 1:
            raise ValueError(f"PLE: num_tasks={num_tasks}; set it to the number of label columns (>= 1)")
        if levels < 1:
            raise ValueError(f"PLE: levels={levels}; use at least 1 extraction level (1 is CGC)")
        if task_experts < 0 or shared_experts < 0 or task_experts + shared_experts < 1:
            raise ValueError(f"PLE: task_experts={task_experts}, shared_experts={shared_experts}; each task's gate "
                             f"needs at least one expert (both >= 0, sum >= 1)")
        if not expert:
            raise ValueError("PLE: expert=[] is empty; give each expert at least one layer, e.g. [128]")
        width = len(names) * dim + dense_in_features
        self.num_tasks = int(num_tasks)
        self.sparse_arch = embedding_bag_collection
        self.levels = nn.ModuleList(
            _Extraction(width if level == 0 else expert[-1], num_tasks, task_experts, shared_experts,
                        expert, last=level == levels - 1) for level in range(levels))
        self.towers = nn.ModuleList(mlp(expert[-1], tower, out_features=1) for _ in range(num_tasks))

    def _extract(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> tuple[list[torch.Tensor], list[dict]]:
        x = torch.cat([self.sparse_arch(sparse).values(), dense], dim=1)  # (B, N)
        task_inputs, shared, gates = [x] * self.num_tasks, x, []
        for level in self.levels:
            task_inputs, shared, level_gates = level(task_inputs, shared)  # T × (B, H), (B, H) | None
            gates.append(level_gates)
        return task_inputs, gates

    def gate_weights(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> list[dict[str, torch.Tensor | None]]:
        """Per level: {"tasks": (B, T, E+S), "shared": (B, T·E+S) or None at the last level};
        own experts come first in each task's row, then the shared ones; rows sum to 1."""
        return self._extract(dense, sparse)[1]

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        task_outputs, _ = self._extract(dense, sparse)
        return torch.cat([tower(h) for tower, h in zip(self.towers, task_outputs)], dim=1)  # (B, T)
