"""MMoE: shapes, gates that sum to 1 and really mix the experts, logits out, clear errors, a real run."""

from __future__ import annotations

import pytest
import torch

from models import MMoE


def test_shapes_and_layer_sizes(tiny_mt):
    torch.manual_seed(0)
    model = MMoE(tiny_mt.collection(), dense_in_features=5, num_tasks=3, num_experts=4, expert=(32, 16), tower=(8,))
    dense, kjt = tiny_mt.batch()
    assert model(dense, kjt).shape == (16, 3)
    assert model.gate_weights(dense, kjt).shape == (16, 3, 4)
    first = [m for m in model.experts[0] if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in first] == [(3 * 8 + 5, 32), (32, 16)]
    assert all(g.in_features == 29 and g.out_features == 4 and g.bias is None for g in model.gates)  # paper: softmax(W x)
    assert [m.in_features for m in model.towers[0] if isinstance(m, torch.nn.Linear)] == [16, 8]


def test_gates_sum_to_one_and_differ_per_task(tiny_mt):
    torch.manual_seed(0)
    model = MMoE(tiny_mt.collection(), dense_in_features=5, num_tasks=2, num_experts=3, expert=(8,), tower=())
    dense, kjt = tiny_mt.batch(b=32)
    with torch.no_grad():
        gates = model.gate_weights(dense, kjt)  # (B, T, X)
    torch.testing.assert_close(gates.sum(dim=2), torch.ones(32, 2))
    assert (gates > 0).all()
    assert not torch.allclose(gates[:, 0], gates[:, 1])  # one gate per task


def test_each_task_sees_its_gates_mix_of_experts(tiny_mt):
    """With linear towers, task t's logit is tower_t(Σ_x g_tx · expert_x): recompute it by hand."""
    torch.manual_seed(0)
    model = MMoE(tiny_mt.collection(), dense_in_features=5, num_tasks=2, num_experts=3, expert=(8,), tower=())
    dense, kjt = tiny_mt.batch(b=8)
    with torch.no_grad():
        x = torch.cat([model.sparse_arch(kjt).values(), dense], dim=1)  # (B, N)
        experts = torch.stack([e(x) for e in model.experts], dim=1)  # (B, X, H)
        gates = model.gate_weights(dense, kjt)  # (B, T, X)
        expected = torch.stack([model.towers[t]((gates[:, t, :, None] * experts).sum(1)).squeeze(1)
                                for t in range(2)], dim=1)  # (B, T)
        torch.testing.assert_close(model(dense, kjt), expected)


def test_returns_logits_not_probabilities(tiny_mt):
    torch.manual_seed(0)
    model = MMoE(tiny_mt.collection(), dense_in_features=5, expert=(8,), tower=(4,))
    dense, kjt = tiny_mt.batch(b=32)
    with torch.no_grad():
        before = model(dense, kjt)
        model.towers[1][-1].bias += 5.0
        after = model(dense, kjt)
    torch.testing.assert_close(after[:, 0], before[:, 0])  # task 0's tower is untouched
    torch.testing.assert_close(after[:, 1] - before[:, 1], torch.full((32,), 5.0))
    assert after[:, 1].min() > 1.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_tasks=0), r"MMoE: num_tasks=0; set it to the number of label columns"),
    (dict(num_experts=0), r"MMoE: num_experts=0; the gates need at least 1 expert"),
    (dict(expert=()), r"MMoE: expert=\[\] is empty; give each expert at least one layer"),
])
def test_bad_arguments_are_named(tiny_mt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        MMoE(tiny_mt.collection(), dense_in_features=5, **kwargs)


def test_tables_of_different_dims_are_refused(tiny_mt):
    with pytest.raises(ValueError, match=r"MMoE: embedding tables have dims \[4, 8\]"):
        MMoE(tiny_mt.collection(dims=(8, 4, 8)), dense_in_features=5)


@pytest.mark.slow
def test_real_local_run_is_deterministic_and_learns(repeatable_losses):
    """`model=mmoe task=multitask dataset=synthetic_multitask ps=local`, one thread: the same first
    losses twice, starting near 2·ln 2 (two untrained BCEs) and falling."""
    losses = repeatable_losses("mmoe", "task=multitask", "dataset=synthetic_multitask")
    assert abs(losses[0] - 2 * 0.6931) < 0.1
    assert losses[-1] < losses[0]
