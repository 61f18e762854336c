"""LR: logits = Σ sparse weights + dense linear + bias, recomputed by hand; errors; golden first losses."""

from __future__ import annotations

import pytest
import torch

from models import LR

# The first 5 training losses of `model=lr ps=local trainer.threads=1` on the tiny world
# of conftest.py (batch 256). Checked equal across two runs before they were frozen here.
GOLDEN = [0.667895, 0.617789, 0.547426, 0.655847, 0.595086]


def test_forward_shape_and_layers(tiny):
    model = LR(tiny.collection(dims=1), dense_in_features=13)
    batch = tiny.batch()
    assert model(batch.dense, batch.sparse).shape == (4,)
    assert (model.dense_linear.in_features, model.dense_linear.out_features) == (13, 1)
    assert model.bias.shape == ()


def test_logits_are_weights_plus_dense_linear_plus_bias(tiny):
    torch.manual_seed(0)
    ebc = tiny.collection(dims=1)
    model = LR(ebc, dense_in_features=13)
    with torch.no_grad():
        model.bias.fill_(0.25)
    batch = tiny.batch(b=6)
    w = tiny.rows(ebc, batch.ids)[:, :, 0]  # (B, F)
    dense_term = batch.dense @ model.dense_linear.weight[0] + model.dense_linear.bias[0]  # (B,)
    torch.testing.assert_close(model(batch.dense, batch.sparse), w.sum(1) + dense_term + 0.25)


def test_a_bag_of_keys_adds_every_weight(tiny):
    """Two ids in one feature of one example: both weights enter the sum (sum pooling)."""
    from torchrec import KeyedJaggedTensor

    ebc = tiny.collection(names=("C1",), dims=1)
    model = LR(ebc, dense_in_features=0)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["C1"], values=torch.tensor([3, 7, 5]),
                                              lengths=torch.tensor([2, 1]))
    w = ebc.embedding_bags["t_C1"].weight[:, 0]
    torch.testing.assert_close(model(torch.zeros(2, 0), kjt), torch.stack([w[3] + w[7], w[5]]))


def test_without_dense_inputs(tiny):
    ebc = tiny.collection(dims=1)
    model = LR(ebc, dense_in_features=0)
    batch = tiny.batch(dense=0)
    assert model.dense_linear is None
    torch.testing.assert_close(model(batch.dense, batch.sparse), tiny.rows(ebc, batch.ids)[:, :, 0].sum(1))


def test_returns_logits_not_probabilities(tiny):
    model = LR(tiny.collection(dims=1), dense_in_features=13)
    before, after = tiny.bias_shift(model, model.bias, tiny.batch(b=64))
    torch.testing.assert_close(after - before, torch.full_like(before, 3.0))


def test_rows_wider_than_one_weight_are_refused(tiny):
    with pytest.raises(ValueError, match=r"LR: embedding_dim=4; LR's rows are single weights, set embedding_dim=1"):
        LR(tiny.collection(dims=4), dense_in_features=13)


def test_tables_of_different_dims_are_refused(tiny):
    with pytest.raises(ValueError, match=r"LR: embedding tables have dims \[1, 2\].*same embedding_dim"):
        LR(tiny.collection(dims=(1, 2, 1)), dense_in_features=13)


def test_dense_width_mismatch_names_both_widths(tiny):
    tiny.refuses_dense_width(LR(tiny.collection(dims=1), dense_in_features=13), "LR", width=12)


def test_first_losses_are_deterministic_and_golden(repeatable_losses):
    assert repeatable_losses("lr") == pytest.approx(GOLDEN, abs=1e-5)
