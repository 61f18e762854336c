"""AutoInt: interacting layers with the configured heads and widths, each equal to per-head scaled
dot-product attention + residual + ReLU computed by hand; errors; golden first losses."""

from __future__ import annotations

import math

import pytest
import torch

from models import AutoInt

# The first 5 training losses of `model=autoint ps=local trainer.threads=1` on the tiny world
# of conftest.py (batch 256). Checked equal across two runs before they were frozen here.
GOLDEN = [0.688924, 0.686089, 0.680968, 0.678993, 0.671688]


def test_forward_shape_and_layers(tiny):
    """Config defaults: 3 layers, attention_dim 32, 2 heads; M = 3 sparse + 13 dense fields of D = 16."""
    model = AutoInt(tiny.collection(dims=16), dense_in_features=13)
    batch = tiny.batch()
    assert model(batch.dense, batch.sparse).shape == (4,)
    assert len(model.interacting) == 3
    assert [layer.attention.num_heads for layer in model.interacting] == [2, 2, 2]
    assert [layer.attention.embed_dim for layer in model.interacting] == [32, 32, 32]
    assert [layer.project.in_features for layer in model.interacting] == [16, 32, 32]
    assert tuple(model.dense_fields.shape) == (13, 16)
    assert (model.over_arch.in_features, model.over_arch.out_features) == ((3 + 13) * 32, 1)


def interacting_by_hand(layer, fields: torch.Tensor, heads: int) -> torch.Tensor:
    """Paper eq. 5-8: per head softmax(q kᵀ / √d_h) v, heads concatenated, + W_res e, ReLU."""
    x = fields @ layer.project.weight.T  # (B, M, A)
    wq, wk, wv = layer.attention.in_proj_weight.chunk(3)  # (A, A) each
    q, k, v = x @ wq.T, x @ wk.T, x @ wv.T  # (B, M, A)
    d_h = x.shape[2] // heads
    out = []
    for h in range(heads):
        s = slice(h * d_h, (h + 1) * d_h)
        att = torch.softmax(q[:, :, s] @ k[:, :, s].transpose(1, 2) / math.sqrt(d_h), dim=2)  # (B, M, M)
        out.append(att @ v[:, :, s])  # (B, M, d_h)
    attended = torch.cat(out, 2) @ layer.attention.out_proj.weight.T  # (B, M, A)
    return torch.relu(attended + fields @ layer.residual.weight.T)


def test_forward_by_hand(tiny):
    torch.manual_seed(0)
    ebc = tiny.collection(dims=4)
    model = AutoInt(ebc, dense_in_features=2, layers=2, attention_dim=6, heads=3)
    batch = tiny.batch(b=5, dense=2)
    numeric = batch.dense[:, :, None] * model.dense_fields  # (B, I, D): field i is x_i · u_i
    x = torch.cat([tiny.rows(ebc, batch.ids), numeric], 1)  # (B, M, D)
    for layer in model.interacting:
        x = interacting_by_hand(layer, x, heads=3)
    expected = x.flatten(1) @ model.over_arch.weight[0] + model.over_arch.bias[0]
    torch.testing.assert_close(model(batch.dense, batch.sparse), expected)


def test_returns_logits_not_probabilities(tiny):
    model = AutoInt(tiny.collection(dims=8), dense_in_features=13, layers=1, attention_dim=8)
    before, after = tiny.bias_shift(model, model.over_arch.bias, tiny.batch(b=64))
    torch.testing.assert_close(after - before, torch.full_like(before, 3.0))


def test_attention_dim_not_divisible_by_heads_is_refused(tiny):
    with pytest.raises(ValueError, match=r"AutoInt: attention_dim=10 is not divisible by heads=3"):
        AutoInt(tiny.collection(dims=8), dense_in_features=13, attention_dim=10, heads=3)


def test_tables_of_different_dims_are_refused(tiny):
    with pytest.raises(ValueError, match=r"AutoInt: embedding tables have dims \[8, 16\]"):
        AutoInt(tiny.collection(dims=(16, 16, 8)), dense_in_features=13)


@pytest.mark.parametrize("width", [1, 12])
def test_dense_width_mismatch_names_both_widths(tiny, width):
    """Width 1 would broadcast silently against the (I, D) field vectors without the check."""
    model = AutoInt(tiny.collection(dims=8), dense_in_features=13, layers=1, attention_dim=8)
    batch = tiny.batch(dense=width)
    with pytest.raises(ValueError, match=rf"AutoInt: dense input has shape \(4, {width}\) but the model was "
                                         r"built with dense_in_features=13"):
        model(batch.dense, batch.sparse)


def test_first_losses_are_deterministic_and_golden(first_losses):
    losses = first_losses("autoint")
    assert losses == first_losses("autoint")  # bitwise: one thread, same seed
    assert losses == pytest.approx(GOLDEN, abs=1e-5)
