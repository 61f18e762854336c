"""PLE: shapes, gates over own + shared experts that sum to 1, the paper's routing, logits out, errors, a real run."""

from __future__ import annotations

import pytest
import torch

from models import PLE


def test_shapes_gates_and_levels(tiny_mt):
    torch.manual_seed(0)
    model = PLE(tiny_mt.collection(), dense_in_features=5, num_tasks=3, levels=3, task_experts=2, shared_experts=1,
                expert=(16,), tower=(8,))
    dense, kjt = tiny_mt.batch()
    assert model(dense, kjt).shape == (16, 3)
    gates = model.gate_weights(dense, kjt)
    assert len(gates) == 3
    for level, g in enumerate(gates):
        assert g["tasks"].shape == (16, 3, 2 + 1)  # own experts, then shared
        torch.testing.assert_close(g["tasks"].sum(dim=2), torch.ones(16, 3))
        if level < 2:
            assert g["shared"].shape == (16, 3 * 2 + 1)  # every expert of the level
            torch.testing.assert_close(g["shared"].sum(dim=1), torch.ones(16))
        else:
            assert g["shared"] is None  # the last level has no shared output
    first, second = model.levels[0], model.levels[1]
    assert first.task_experts[0][0][0].in_features == 3 * 8 + 5
    assert second.task_experts[0][0][0].in_features == 16  # deeper levels read the expert width
    assert all(g.bias is None for g in first.task_gates) and first.shared_gate.bias is None


def test_single_level_is_cgc_by_hand(tiny_mt):
    """levels=1 (CGC): task t's logit = tower_t(Σ gates · [own experts(x), shared experts(x)])."""
    torch.manual_seed(0)
    model = PLE(tiny_mt.collection(), dense_in_features=5, num_tasks=2, levels=1, task_experts=2, shared_experts=2,
                expert=(8,), tower=())
    dense, kjt = tiny_mt.batch(b=8)
    with torch.no_grad():
        x = torch.cat([model.sparse_arch(kjt).values(), dense], dim=1)  # (B, N)
        level = model.levels[0]
        shared = [e(x) for e in level.shared_experts]
        gates = model.gate_weights(dense, kjt)[0]["tasks"]  # (B, T, 4)
        expected = []
        for t in range(2):
            experts = torch.stack([e(x) for e in level.task_experts[t]] + shared, dim=1)  # (B, 4, H)
            expected.append(model.towers[t]((gates[:, t, :, None] * experts).sum(1)).squeeze(1))
        torch.testing.assert_close(model(dense, kjt), torch.stack(expected, dim=1))


def test_task_experts_are_private_to_their_task(tiny_mt):
    """A task's own experts get no gradient from the other task's logit at the last level."""
    torch.manual_seed(0)
    model = PLE(tiny_mt.collection(), dense_in_features=5, num_tasks=2, levels=1, expert=(8,), tower=(4,))
    dense, kjt = tiny_mt.batch()
    model(dense, kjt)[:, 0].sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in model.levels[0].task_experts[1].parameters())
    assert all(p.grad is not None for p in model.levels[0].task_experts[0].parameters())
    assert all(p.grad is not None for p in model.levels[0].shared_experts.parameters())


def test_returns_logits_not_probabilities(tiny_mt):
    torch.manual_seed(0)
    model = PLE(tiny_mt.collection(), dense_in_features=5, expert=(8,), tower=(4,))
    dense, kjt = tiny_mt.batch(b=32)
    with torch.no_grad():
        before = model(dense, kjt)
        model.towers[0][-1].bias -= 6.0
        after = model(dense, kjt)
    torch.testing.assert_close(after[:, 0] - before[:, 0], torch.full((32,), -6.0))
    assert after[:, 0].max() < 0.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_tasks=0), r"PLE: num_tasks=0; set it to the number of label columns"),
    (dict(levels=0), r"PLE: levels=0; use at least 1 extraction level"),
    (dict(task_experts=0, shared_experts=0), r"PLE: task_experts=0, shared_experts=0; each task's gate needs"),
    (dict(task_experts=-1), r"PLE: task_experts=-1, shared_experts=2"),
    (dict(expert=()), r"PLE: expert=\[\] is empty"),
])
def test_bad_arguments_are_named(tiny_mt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        PLE(tiny_mt.collection(), dense_in_features=5, **kwargs)


def test_tables_of_different_dims_are_refused(tiny_mt):
    with pytest.raises(ValueError, match=r"PLE: embedding tables have dims \[4, 8\]"):
        PLE(tiny_mt.collection(dims=(8, 4, 8)), dense_in_features=5)


@pytest.mark.slow
def test_real_local_run_is_deterministic_and_learns(repeatable_losses):
    losses = repeatable_losses("ple", "task=multitask", "dataset=synthetic_multitask")
    assert abs(losses[0] - 2 * 0.6931) < 0.1  # two untrained BCEs
    assert losses[-1] < losses[0]
