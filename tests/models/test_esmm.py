"""ESMM: two towers over shared embeddings, [ctr, cvr] logits, the towers' independence, a real run."""

from __future__ import annotations

import pytest
import torch

from models import ESMM
from recps.data.batch import Batch
from recps.tasks.multitask import MultiTask


def test_shapes_and_towers(tiny_mt):
    torch.manual_seed(0)
    model = ESMM(tiny_mt.collection(), dense_in_features=5, tower=(16, 8))
    dense, kjt = tiny_mt.batch()
    assert model(dense, kjt).shape == (16, 2)
    for tower in (model.ctr_tower, model.cvr_tower):
        assert [(m.in_features, m.out_features) for m in tower if isinstance(m, torch.nn.Linear)] == [
            (3 * 8 + 5, 16), (16, 8), (8, 1)]


def test_columns_are_ctr_then_cvr_tower(tiny_mt):
    torch.manual_seed(0)
    model = ESMM(tiny_mt.collection(), dense_in_features=5, tower=(8,))
    dense, kjt = tiny_mt.batch()
    with torch.no_grad():
        x = torch.cat([model.sparse_arch(kjt).values(), dense], dim=1)
        torch.testing.assert_close(model(dense, kjt), torch.cat([model.ctr_tower(x), model.cvr_tower(x)], dim=1))


def test_cvr_tower_learns_only_through_pctcvr(tiny_mt):
    """The CTR term alone leaves the CVR tower untouched; ESMM's loss (its CTCVR term) reaches
    both towers and the shared embeddings."""
    torch.manual_seed(0)
    model = ESMM(tiny_mt.collection(), dense_in_features=5, tower=(8,))
    dense, kjt = tiny_mt.batch()
    logits = model(dense, kjt)
    torch.nn.functional.binary_cross_entropy_with_logits(logits[:, 0], torch.ones(16)).backward(retain_graph=True)
    assert all(p.grad is None or not p.grad.any() for p in model.cvr_tower.parameters())
    model.zero_grad(set_to_none=True)
    labels = torch.stack([torch.ones(16), (torch.arange(16) % 2).float()], dim=1)
    loss = MultiTask(esmm=True).loss(logits, Batch(dense=dense, sparse=kjt, labels=labels))
    loss.backward()
    for part in (model.ctr_tower, model.cvr_tower, model.sparse_arch):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in part.parameters())


def test_returns_logits_not_probabilities(tiny_mt):
    torch.manual_seed(0)
    model = ESMM(tiny_mt.collection(), dense_in_features=5, tower=(8,))
    dense, kjt = tiny_mt.batch(b=32)
    with torch.no_grad():
        before = model(dense, kjt)
        model.cvr_tower[-1].bias += 3.0
        after = model(dense, kjt)
    torch.testing.assert_close(after[:, 1] - before[:, 1], torch.full((32,), 3.0))
    torch.testing.assert_close(after[:, 0], before[:, 0])
    assert after[:, 1].min() > 1.0


def test_tables_of_different_dims_are_refused(tiny_mt):
    with pytest.raises(ValueError, match=r"ESMM: embedding tables have dims \[4, 8\]"):
        ESMM(tiny_mt.collection(dims=(8, 4, 8)), dense_in_features=5)


def test_plain_multitask_loss_is_refused_for_a_wrong_width(tiny_mt):
    """A three-label plain task on ESMM's two columns fails with the fix in the message."""
    model = ESMM(tiny_mt.collection(), dense_in_features=5, tower=(8,))
    dense, kjt = tiny_mt.batch()
    b = Batch(dense=dense, sparse=kjt, labels=torch.zeros(16, 3))
    with pytest.raises(Exception, match=r"ESMM returned logits of shape \(16, 2\) but the task has 3 label columns"):
        MultiTask(label_indices=(0, 1, 2)).forward(model, b)


@pytest.mark.slow
def test_real_local_run_is_deterministic_and_learns(repeatable_losses):
    losses = repeatable_losses("esmm", "task=multitask_esmm", "dataset=synthetic_multitask")
    assert losses[-1] < losses[0]
