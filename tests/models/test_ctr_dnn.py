"""CTRDNN: shapes, logits (no sigmoid inside), clear errors for bad dims, golden first losses."""

from __future__ import annotations

import pytest
import torch

from models import CTRDNN

# The first 5 training losses of `model=ctr_dnn ps=local trainer.threads=1` on the tiny world
# of conftest.py (batch 256). Checked equal across two runs before they were frozen here.
GOLDEN = [0.694537, 0.687035, 0.681888, 0.679021, 0.668691]


def test_forward_shapes_and_layers(tiny):
    torch.manual_seed(0)
    model = CTRDNN(tiny.collection(), dense_in_features=13)
    dense, kjt, _ = tiny.batch()
    assert model(dense, kjt).shape == (4,)
    linears = [m for m in model.over_arch if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [
        (3 * 9 + 13, 512), (512, 256), (256, 128), (128, 32), (32, 1)]


def test_hidden_sizes_and_no_dense_inputs(tiny):
    model = CTRDNN(tiny.collection(dims=(4, 4, 4)), dense_in_features=0, hidden=(8,))
    dense, kjt, _ = tiny.batch(dense=0)
    assert model(dense, kjt).shape == (4,)
    assert [m.in_features for m in model.over_arch if isinstance(m, torch.nn.Linear)] == [12, 8]


def test_returns_logits_not_probabilities(tiny):
    """The head is linear: moving its bias by c moves every output by exactly c."""
    torch.manual_seed(0)
    model = CTRDNN(tiny.collection(), dense_in_features=13)
    dense, kjt, _ = tiny.batch(b=64)
    with torch.no_grad():
        before = model(dense, kjt)
        model.over_arch[-1].bias += 3.0
        after = model(dense, kjt)
    torch.testing.assert_close(after - before, torch.full_like(before, 3.0))
    assert after.min() > 1.0  # no probability is above 1


def test_tables_of_different_dims_are_refused(tiny):
    with pytest.raises(ValueError, match=r"CTRDNN: embedding tables have dims \[8, 9\].*same embedding_dim"):
        CTRDNN(tiny.collection(dims=(9, 8, 9)), dense_in_features=13)


def test_dense_width_mismatch_names_both_widths(tiny):
    model = CTRDNN(tiny.collection(), dense_in_features=13)
    dense, kjt, _ = tiny.batch(dense=12)
    with pytest.raises(ValueError, match=r"CTRDNN: dense input has shape \(4, 12\) but the model was built with dense_in_features=13"):
        model(dense, kjt)


def test_collection_without_configs_is_refused():
    with pytest.raises(TypeError, match=r"CTRDNN: the injected collection Linear has neither"):
        CTRDNN(torch.nn.Linear(2, 2), dense_in_features=13)


def test_first_losses_are_deterministic_and_golden(first_losses):
    losses = first_losses("ctr_dnn")
    assert losses == first_losses("ctr_dnn")  # bitwise: one thread, same seed
    assert losses == pytest.approx(GOLDEN, abs=1e-5)
