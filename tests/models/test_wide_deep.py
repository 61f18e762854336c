"""Wide & Deep: logits = wide (Σw + dense linear) + deep MLP over [v, dense], by hand; errors; golden."""

from __future__ import annotations

import pytest
import torch

from models import WideDeep

# The first 5 training losses of `model=wide_deep ps=local trainer.threads=1` on the tiny world
# of conftest.py (batch 256). Checked equal across two runs before they were frozen here.
GOLDEN = [0.623078, 0.648185, 0.610558, 0.763441, 0.604462]


def linears(model: WideDeep) -> list[tuple[int, int]]:
    return [(m.in_features, m.out_features) for m in model.over_arch if isinstance(m, torch.nn.Linear)]


def test_forward_shape_and_layers(tiny):
    """Config default hidden [400, 400, 400]; rows [w | v] of width 9 give 8 deep dims per field."""
    model = WideDeep(tiny.collection(dims=9), dense_in_features=13)
    batch = tiny.batch()
    assert model(batch.dense, batch.sparse).shape == (4,)
    assert model.deep_dim == 8
    assert linears(model) == [(3 * 8 + 13, 400), (400, 400), (400, 400), (400, 1)]
    assert (model.wide_dense.in_features, model.wide_dense.out_features) == (13, 1)


def test_logits_are_wide_plus_deep(tiny):
    torch.manual_seed(0)
    ebc = tiny.collection(dims=5)
    model = WideDeep(ebc, dense_in_features=13, hidden=(8, 4))
    batch = tiny.batch(b=6)
    rows = tiny.rows(ebc, batch.ids)  # (B, F, E)
    wide = rows[:, :, 0].sum(1) + model.wide_dense(batch.dense).squeeze(1)
    deep = model.over_arch(torch.cat([rows[:, :, 1:].flatten(1), batch.dense], 1)).squeeze(1)
    torch.testing.assert_close(model(batch.dense, batch.sparse), wide + deep)


def test_without_dense_inputs(tiny):
    model = WideDeep(tiny.collection(dims=3), dense_in_features=0, hidden=(4,))
    batch = tiny.batch(dense=0)
    assert model.wide_dense is None
    assert linears(model) == [(3 * 2, 4), (4, 1)]
    assert model(batch.dense, batch.sparse).shape == (4,)


def test_returns_logits_not_probabilities(tiny):
    model = WideDeep(tiny.collection(dims=9), dense_in_features=13, hidden=(16,))
    before, after = tiny.bias_shift(model, model.over_arch[-1].bias, tiny.batch(b=64))
    torch.testing.assert_close(after - before, torch.full_like(before, 3.0))


def test_row_width_below_two_is_refused(tiny):
    with pytest.raises(ValueError, match=r"WideDeep: embedding_dim=1; rows hold 1 wide weight \+ D, "
                                         r"set it to at least 2"):
        WideDeep(tiny.collection(dims=1), dense_in_features=13)


def test_tables_of_different_dims_are_refused(tiny):
    with pytest.raises(ValueError, match=r"WideDeep: embedding tables have dims \[8, 9\]"):
        WideDeep(tiny.collection(dims=(9, 9, 8)), dense_in_features=13)


def test_dense_width_mismatch_names_both_widths(tiny):
    tiny.refuses_dense_width(WideDeep(tiny.collection(dims=9), dense_in_features=13, hidden=(4,)), "WideDeep", width=12)


def test_first_losses_are_deterministic_and_golden(repeatable_losses):
    assert repeatable_losses("wide_deep") == pytest.approx(GOLDEN, abs=1e-5)
