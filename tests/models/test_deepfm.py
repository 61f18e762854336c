"""DeepFM: the three terms add up as the paper says, logits, clear errors, golden first losses."""

from __future__ import annotations

import pytest
import torch

from models import DeepFM

# The first 5 training losses of `model=deepfm ps=local trainer.threads=1` on the tiny world
# of conftest.py (batch 256). Checked equal across two runs before they were frozen here.
GOLDEN = [0.622289, 0.596663, 0.519957, 0.618896, 0.563351]

def test_forward_shapes_and_layers(tiny):
    torch.manual_seed(0)
    model = DeepFM(tiny.collection(dims=11), dense_in_features=13)
    dense, kjt, _ = tiny.batch()
    assert model(dense, kjt).shape == (4,)
    assert model.factor_dim == 10
    linears = [m for m in model.over_arch if isinstance(m, torch.nn.Linear)]
    # The DNN reads every factor vector and the dense inputs; the FM reads the factors only.
    assert [(m.in_features, m.out_features) for m in linears] == [(3 * 10 + 13, 400), (400, 400), (400, 400), (400, 1)]


def test_logits_are_first_order_plus_fm_plus_dnn(tiny):
    """Recomputed by hand from the table rows: Σw + w_dense·x + b + Σ_{i<j} <v_i, v_j> + DNN([v, x])."""
    torch.manual_seed(0)
    ebc = tiny.collection(dims=11)
    model = DeepFM(ebc, dense_in_features=13, hidden=(8,))
    with torch.no_grad():
        model.bias.fill_(0.25)
    dense, kjt, ids = tiny.batch(b=6)
    rows = tiny.rows(ebc, ids)  # (B, F, E)
    w, v = rows[:, :, 0], rows[:, :, 1:]
    pairs = sum((v[:, i] * v[:, j]).sum(1) for i in range(3) for j in range(i + 1, 3))
    first = w.sum(1) + model.dense_linear(dense).squeeze(1) + 0.25
    deep = model.over_arch(torch.cat([v.flatten(1), dense], 1)).squeeze(1)
    torch.testing.assert_close(model(dense, kjt), first + pairs + deep)


def test_without_dense_inputs(tiny):
    model = DeepFM(tiny.collection(dims=(3, 3, 3)), dense_in_features=0, hidden=(4,))
    dense, kjt, _ = tiny.batch(dense=0)
    assert model(dense, kjt).shape == (4,)
    assert model.dense_linear is None
    assert model.over_arch[0].in_features == 3 * 2


def test_returns_logits_not_probabilities(tiny):
    """Moving the bias by c moves every output by exactly c: no sigmoid inside."""
    torch.manual_seed(0)
    model = DeepFM(tiny.collection(dims=11), dense_in_features=13)
    dense, kjt, _ = tiny.batch(b=64)
    with torch.no_grad():
        before = model(dense, kjt)
        model.bias += 3.0
        after = model(dense, kjt)
    torch.testing.assert_close(after - before, torch.full_like(before, 3.0))
    assert after.min() > 1.0


def test_row_width_below_two_is_refused(tiny):
    with pytest.raises(ValueError, match=r"DeepFM: embedding_dim=1; rows hold 1 first-order weight \+ D factors"):
        DeepFM(tiny.collection(dims=(1, 1, 1)), dense_in_features=13)


def test_tables_of_different_dims_are_refused(tiny):
    with pytest.raises(ValueError, match=r"DeepFM: embedding tables have dims \[9, 11\]"):
        DeepFM(tiny.collection(dims=(11, 9, 11)), dense_in_features=13)


def test_dense_width_mismatch_names_both_widths(tiny):
    model = DeepFM(tiny.collection(dims=11), dense_in_features=13)
    dense, kjt, _ = tiny.batch(dense=14)
    with pytest.raises(ValueError, match=r"DeepFM: dense input has shape \(4, 14\) but the model was built "
                                         r"with dense_in_features=13"):
        model(dense, kjt)


def test_first_losses_are_deterministic_and_golden(first_losses):
    losses = first_losses("deepfm")
    assert losses == first_losses("deepfm")  # bitwise: one thread, same seed
    assert losses == pytest.approx(GOLDEN, abs=1e-5)
