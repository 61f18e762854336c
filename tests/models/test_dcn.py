"""DCN: L vector cross layers x_{l+1} = x0 (x_l·w_l) + b_l + x_l next to an MLP, recomputed by hand;
errors; golden first losses."""

from __future__ import annotations

import pytest
import torch

from models import DCN

# The first 5 training losses of `model=dcn ps=local trainer.threads=1` on the tiny world
# of conftest.py (batch 256). Checked equal across two runs before they were frozen here.
GOLDEN = [0.704204, 0.631757, 0.566503, 0.583103, 0.537195]


def test_forward_shape_and_layers(tiny):
    """Config defaults: 3 cross layers, hidden [400, 400]; N = F*D + I = 3*8 + 13."""
    model = DCN(tiny.collection(dims=8), dense_in_features=13)
    batch = tiny.batch()
    assert model(batch.dense, batch.sparse).shape == (4,)
    assert [tuple(k.shape) for k in model.cross_arch.kernels] == [(37, 1)] * 3
    assert [tuple(b.shape) for b in model.cross_arch.bias] == [(37, 1)] * 3
    assert [(m.in_features, m.out_features) for m in model.deep_arch if isinstance(m, torch.nn.Linear)] == [
        (37, 400), (400, 400)]
    assert (model.over_arch.in_features, model.over_arch.out_features) == (37 + 400, 1)


def test_cross_layer_count_follows_the_config(tiny):
    model = DCN(tiny.collection(dims=4), dense_in_features=2, cross_layers=5, hidden=(8,))
    assert len(model.cross_arch.kernels) == 5


def test_logits_are_cross_and_deep_through_a_linear_head(tiny):
    torch.manual_seed(0)
    ebc = tiny.collection(dims=4)
    model = DCN(ebc, dense_in_features=2, cross_layers=2, hidden=(8, 5))
    with torch.no_grad():
        for b in model.cross_arch.bias:  # zeros at init: make them count
            b.normal_()
    batch = tiny.batch(b=6, dense=2)
    x0 = torch.cat([tiny.rows(ebc, batch.ids).flatten(1), batch.dense], 1)  # (B, N)
    x = x0
    for w, b in zip(model.cross_arch.kernels, model.cross_arch.bias):
        x = x0 * (x @ w) + b.squeeze(1) + x  # (B, N): x0 times the scalar x·w, per example
    deep = model.deep_arch(x0)  # (B, H)
    expected = torch.cat([x, deep], 1) @ model.over_arch.weight[0] + model.over_arch.bias[0]
    torch.testing.assert_close(model(batch.dense, batch.sparse), expected)


def test_without_hidden_layers_the_head_reads_x0_twice(tiny):
    model = DCN(tiny.collection(dims=4), dense_in_features=2, hidden=())
    batch = tiny.batch(dense=2)
    assert model.over_arch.in_features == 2 * (3 * 4 + 2)
    assert model(batch.dense, batch.sparse).shape == (4,)


def test_returns_logits_not_probabilities(tiny):
    model = DCN(tiny.collection(dims=8), dense_in_features=13, hidden=(16,))
    before, after = tiny.bias_shift(model, model.over_arch.bias, tiny.batch(b=64))
    torch.testing.assert_close(after - before, torch.full_like(before, 3.0))


def test_tables_of_different_dims_are_refused(tiny):
    with pytest.raises(ValueError, match=r"DCN: embedding tables have dims \[4, 8\].*same embedding_dim"):
        DCN(tiny.collection(dims=(8, 4, 8)), dense_in_features=13)


def test_dense_width_mismatch_names_both_widths(tiny):
    tiny.refuses_dense_width(DCN(tiny.collection(dims=8), dense_in_features=13, hidden=(4,)), "DCN", width=12)


def test_first_losses_are_deterministic_and_golden(repeatable_losses):
    assert repeatable_losses("dcn") == pytest.approx(GOLDEN, abs=1e-5)
