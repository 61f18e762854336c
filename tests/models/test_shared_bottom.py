"""SharedBottom: shapes, one shared bottom and independent towers, logits out, clear errors, a real run."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from models import SharedBottom


def collection(names=("C1", "C2", "C3"), dims=(8, 8, 8), rows=50) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t_{n}", embedding_dim=d, num_embeddings=rows, feature_names=[n])
        for n, d in zip(names, dims)])


def batch(names=("C1", "C2", "C3"), b=16, dense=5, rows=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=list(names), values=torch.randint(0, rows, (len(names) * b,), generator=g),
        lengths=torch.ones(len(names) * b, dtype=torch.int64))
    return torch.randn(b, dense, generator=g), kjt


def test_shapes_and_layer_sizes():
    torch.manual_seed(0)
    model = SharedBottom(collection(), dense_in_features=5, num_tasks=3, bottom=(32, 16), tower=(8,))
    dense, kjt = batch()
    assert model(dense, kjt).shape == (16, 3)
    assert [(m.in_features, m.out_features) for m in model.bottom if isinstance(m, torch.nn.Linear)] == [
        (3 * 8 + 5, 32), (32, 16)]
    assert len(model.towers) == 3
    assert [(m.in_features, m.out_features) for m in model.towers[0] if isinstance(m, torch.nn.Linear)] == [
        (16, 8), (8, 1)]


def test_towers_share_the_bottom_only():
    """Each task's logit is its tower over the same bottom output; a tower's loss reaches the
    bottom and the embeddings but no other tower."""
    torch.manual_seed(0)
    model = SharedBottom(collection(), dense_in_features=5, bottom=(16,), tower=(8,))
    dense, kjt = batch()
    logits = model(dense, kjt)
    with torch.no_grad():
        shared = model.bottom(torch.cat([model.sparse_arch(kjt).values(), dense], dim=1))
        torch.testing.assert_close(logits[:, 1], model.towers[1](shared).squeeze(1))
    logits[:, 0].sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in model.towers[1].parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.bottom.parameters())


def test_returns_logits_not_probabilities():
    torch.manual_seed(0)
    model = SharedBottom(collection(), dense_in_features=5, bottom=(16,), tower=(8,))
    dense, kjt = batch(b=32)
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
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SharedBottom(collection(), dense_in_features=5, **kwargs)


def test_tables_of_different_dims_are_refused():
    with pytest.raises(ValueError, match=r"SharedBottom: embedding tables have dims \[4, 8\]"):
        SharedBottom(collection(dims=(8, 4, 8)), dense_in_features=5)


@pytest.mark.slow
def test_real_local_run_is_deterministic_and_learns(first_losses):
    args = ("shared_bottom", "task=multitask", "dataset=synthetic_multitask")
    losses = first_losses(*args)
    assert losses == first_losses(*args)
    assert abs(losses[0] - 2 * 0.6931) < 0.1  # two untrained BCEs
    assert losses[-1] < losses[0]
