"""SharedBottom: shapes, one shared bottom and independent towers, logits out, clear errors, a real run."""

from __future__ import annotations

import pytest
import torch

from models import SharedBottom


def test_shapes_and_layer_sizes(tiny_mt):
    torch.manual_seed(0)
    model = SharedBottom(tiny_mt.collection(), dense_in_features=5, num_tasks=3, bottom=(32, 16), tower=(8,))
    dense, kjt = tiny_mt.batch()
    assert model(dense, kjt).shape == (16, 3)
    assert [(m.in_features, m.out_features) for m in model.bottom if isinstance(m, torch.nn.Linear)] == [
        (3 * 8 + 5, 32), (32, 16)]
    assert len(model.towers) == 3
    assert [(m.in_features, m.out_features) for m in model.towers[0] if isinstance(m, torch.nn.Linear)] == [
        (16, 8), (8, 1)]


def test_towers_share_the_bottom_only(tiny_mt):
    """Each task's logit is its tower over the same bottom output; a tower's loss reaches the
    bottom and the embeddings but no other tower."""
    torch.manual_seed(0)
    model = SharedBottom(tiny_mt.collection(), dense_in_features=5, bottom=(16,), tower=(8,))
    dense, kjt = tiny_mt.batch()
    logits = model(dense, kjt)
    with torch.no_grad():
        shared = model.bottom(torch.cat([model.sparse_arch(kjt).values(), dense], dim=1))
        torch.testing.assert_close(logits[:, 1], model.towers[1](shared).squeeze(1))
    logits[:, 0].sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in model.towers[1].parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.bottom.parameters())


def test_returns_logits_not_probabilities(tiny_mt):
    torch.manual_seed(0)
    model = SharedBottom(tiny_mt.collection(), dense_in_features=5, bottom=(16,), tower=(8,))
    dense, kjt = tiny_mt.batch(b=32)
    with torch.no_grad():
        before = model(dense, kjt)
        model.towers[0][-1].bias += 4.0
        after = model(dense, kjt)
    torch.testing.assert_close(after[:, 0] - before[:, 0], torch.full((32,), 4.0))
    torch.testing.assert_close(after[:, 1], before[:, 1])
    assert after[:, 0].min() > 1.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_tasks=0), r"SharedBottom: num_tasks=0; set it to the number of label columns"),
    (dict(bottom=()), r"SharedBottom: bottom=\[\] is empty; give the shared MLP at least one layer"),
])
def test_bad_arguments_are_named(tiny_mt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SharedBottom(tiny_mt.collection(), dense_in_features=5, **kwargs)


def test_tables_of_different_dims_are_refused(tiny_mt):
    with pytest.raises(ValueError, match=r"SharedBottom: embedding tables have dims \[4, 8\]"):
        SharedBottom(tiny_mt.collection(dims=(8, 4, 8)), dense_in_features=5)


@pytest.mark.slow
def test_real_local_run_is_deterministic_and_learns(repeatable_losses):
    losses = repeatable_losses("shared_bottom", "task=multitask", "dataset=synthetic_multitask")
    assert abs(losses[0] - 2 * 0.6931) < 0.1  # two untrained BCEs
    assert losses[-1] < losses[0]
