"""FM: first order + pairwise term equal an explicit loop over field pairs; errors; golden first losses."""

from __future__ import annotations

import pytest
import torch

from models import FM

# The first 5 training losses of `model=fm ps=local trainer.threads=1` on the tiny world
# of conftest.py (batch 256). Checked equal across two runs before they were frozen here.
GOLDEN = [0.622949, 0.601697, 0.524173, 0.614307, 0.569835]


def test_forward_shape_and_layers(tiny):
    model = FM(tiny.collection(dims=11), dense_in_features=13)
    batch = tiny.batch()
    assert model(batch.dense, batch.sparse).shape == (4,)
    assert (model.num_features, model.factor_dim) == (3, 10)
    assert (model.dense_linear.in_features, model.dense_linear.out_features) == (13, 1)


def test_logits_are_first_order_plus_pairwise_dots(tiny):
    """Σw + w_dense·x + b + Σ_{i<j} <v_i, v_j>, the pair sum as the paper writes it (a double loop)."""
    torch.manual_seed(0)
    ebc = tiny.collection(names=("C1", "C2", "C3", "C4"), dims=5)
    model = FM(ebc, dense_in_features=13)
    with torch.no_grad():
        model.bias.fill_(0.25)
    batch = tiny.batch(names=("C1", "C2", "C3", "C4"), b=6)
    rows = tiny.rows(ebc, batch.ids, names=("C1", "C2", "C3", "C4"))  # (B, F, E)
    w, v = rows[:, :, 0], rows[:, :, 1:]
    pairs = sum((v[:, i] * v[:, j]).sum(1) for i in range(4) for j in range(i + 1, 4))
    first = w.sum(1) + model.dense_linear(batch.dense).squeeze(1) + 0.25
    torch.testing.assert_close(model(batch.dense, batch.sparse), first + pairs)


def test_dense_inputs_enter_the_linear_term_only(tiny):
    """Zeroing the dense linear weights leaves outputs that no dense value can move."""
    model = FM(tiny.collection(dims=5), dense_in_features=13)
    with torch.no_grad():
        model.dense_linear.weight.zero_()
    batch = tiny.batch()
    torch.testing.assert_close(model(batch.dense, batch.sparse), model(batch.dense * 7.0 + 1.0, batch.sparse))


def test_without_dense_inputs(tiny):
    model = FM(tiny.collection(dims=3), dense_in_features=0)
    batch = tiny.batch(dense=0)
    assert model.dense_linear is None
    assert model(batch.dense, batch.sparse).shape == (4,)


def test_returns_logits_not_probabilities(tiny):
    model = FM(tiny.collection(dims=11), dense_in_features=13)
    before, after = tiny.bias_shift(model, model.bias, tiny.batch(b=64))
    torch.testing.assert_close(after - before, torch.full_like(before, 3.0))


def test_row_width_below_two_is_refused(tiny):
    with pytest.raises(ValueError, match=r"FM: embedding_dim=1; rows hold 1 weight \+ D factors, set it to at least 2"):
        FM(tiny.collection(dims=1), dense_in_features=13)


def test_tables_of_different_dims_are_refused(tiny):
    with pytest.raises(ValueError, match=r"FM: embedding tables have dims \[9, 11\]"):
        FM(tiny.collection(dims=(11, 9, 11)), dense_in_features=13)


def test_dense_width_mismatch_names_both_widths(tiny):
    tiny.refuses_dense_width(FM(tiny.collection(dims=11), dense_in_features=13), "FM", width=14)


def test_first_losses_are_deterministic_and_golden(repeatable_losses):
    assert repeatable_losses("fm") == pytest.approx(GOLDEN, abs=1e-5)
