"""xDeepFM: CIN layers of the configured sizes, the CIN equal to the paper's sums over (h, m),
linear + CIN + DNN add up, errors, golden first losses."""

from __future__ import annotations

import pytest
import torch

from models import XDeepFM

# The first 5 training losses of `model=xdeepfm ps=local trainer.threads=1` on the tiny world
# of conftest.py (batch 256). Checked equal across two runs before they were frozen here.
GOLDEN = [1.34071, 0.739662, 0.617433, 0.69324, 0.666078]


def test_forward_shape_and_layers(tiny):
    """Config defaults: CIN [100, 100], hidden [400, 400]; M = 3 fields + 1 dense field, D = 10."""
    model = XDeepFM(tiny.collection(dims=11), dense_in_features=13)
    batch = tiny.batch()
    assert model(batch.dense, batch.sparse).shape == (4,)
    assert [(c.in_channels, c.out_channels) for c in model.cin.convs] == [(4 * 4, 100), (100 * 4, 100)]
    assert (model.cin_out.in_features, model.cin_out.out_features) == (200, 1)
    assert [(m.in_features, m.out_features) for m in model.deep_arch if isinstance(m, torch.nn.Linear)] == [
        (4 * 10, 400), (400, 400), (400, 1)]
    assert (model.dense_arch.in_features, model.dense_arch.out_features) == (13, 10)


def cin_by_hand(x0: torch.Tensor, convs) -> torch.Tensor:
    """X^k_j = relu(Σ_h Σ_m W^k_{j,h,m} (X^{k-1}_h ∘ x0_m) + b^k_j), then Σ over D per map."""
    batch, fields, dim = x0.shape
    xk, pooled = x0, []
    for conv in convs:
        w = conv.weight.squeeze(2).view(conv.out_channels, xk.shape[1], fields)  # (H_k, H_{k-1}, M)
        nxt = torch.zeros(batch, conv.out_channels, dim)
        for j in range(conv.out_channels):
            acc = conv.bias[j].expand(batch, dim).clone()
            for h in range(xk.shape[1]):
                for m in range(fields):
                    acc = acc + w[j, h, m] * xk[:, h] * x0[:, m]  # (B, D)
            nxt[:, j] = torch.relu(acc)
        xk = nxt
        pooled.append(xk.sum(2))  # (B, H_k)
    return torch.cat(pooled, 1)


def test_logits_are_linear_plus_cin_plus_dnn(tiny):
    torch.manual_seed(0)
    ebc = tiny.collection(dims=5)
    model = XDeepFM(ebc, dense_in_features=2, cin_layers=(2, 3), hidden=(8,))
    with torch.no_grad():
        model.bias.fill_(0.25)
    batch = tiny.batch(b=6, dense=2)
    rows = tiny.rows(ebc, batch.ids)  # (B, F, E)
    x0 = torch.cat([rows[:, :, 1:], model.dense_arch(batch.dense).unsqueeze(1)], 1)  # (B, M, D)
    cin = cin_by_hand(x0, model.cin.convs)
    torch.testing.assert_close(model.cin(x0), cin)
    linear = rows[:, :, 0].sum(1) + model.dense_linear(batch.dense).squeeze(1) + 0.25
    expected = linear + model.cin_out(cin).squeeze(1) + model.deep_arch(x0.flatten(1)).squeeze(1)
    torch.testing.assert_close(model(batch.dense, batch.sparse), expected)


def test_without_dense_inputs_the_fields_are_the_sparse_features(tiny):
    model = XDeepFM(tiny.collection(dims=3), dense_in_features=0, cin_layers=(4,), hidden=(4,))
    batch = tiny.batch(dense=0)
    assert model.dense_arch is None and model.dense_linear is None
    assert model.cin.convs[0].in_channels == 3 * 3
    assert model(batch.dense, batch.sparse).shape == (4,)


def test_returns_logits_not_probabilities(tiny):
    model = XDeepFM(tiny.collection(dims=11), dense_in_features=13, cin_layers=(4, 4), hidden=(16,))
    before, after = tiny.bias_shift(model, model.bias, tiny.batch(b=64))
    torch.testing.assert_close(after - before, torch.full_like(before, 3.0))


def test_row_width_below_two_is_refused(tiny):
    with pytest.raises(ValueError, match=r"XDeepFM: embedding_dim=1; rows hold 1 weight \+ D, set it to at least 2"):
        XDeepFM(tiny.collection(dims=1), dense_in_features=13)


def test_tables_of_different_dims_are_refused(tiny):
    with pytest.raises(ValueError, match=r"XDeepFM: embedding tables have dims \[9, 11\]"):
        XDeepFM(tiny.collection(dims=(11, 9, 11)), dense_in_features=13)


def test_dense_width_mismatch_names_both_widths(tiny):
    model = XDeepFM(tiny.collection(dims=11), dense_in_features=13, cin_layers=(4,), hidden=(4,))
    batch = tiny.batch(dense=12)
    with pytest.raises(ValueError, match=r"XDeepFM: dense input has shape \(4, 12\) but the model was built "
                                         r"with dense_in_features=13"):
        model(batch.dense, batch.sparse)


def test_first_losses_are_deterministic_and_golden(first_losses):
    losses = first_losses("xdeepfm")
    assert losses == first_losses("xdeepfm")  # bitwise: one thread, same seed
    assert losses == pytest.approx(GOLDEN, abs=1e-5)
