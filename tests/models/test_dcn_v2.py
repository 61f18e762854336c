"""DCN-v2: matrix cross layers x_{l+1} = x0 ⊙ (W_l x_l + b_l) + x_l (full or rank r), stacked or
parallel with the MLP, recomputed by hand; errors; golden first losses."""

from __future__ import annotations

import pytest
import torch

from models import DCNv2

# The first 5 training losses of `model=dcn_v2 ps=local trainer.threads=1` on the tiny world
# of conftest.py (batch 256). Checked equal across two runs before they were frozen here.
GOLDEN = [0.674578, 0.557398, 0.527286, 0.622738, 0.547273]


def test_forward_shape_and_layers(tiny):
    """Config defaults: 3 low-rank (r=64) cross layers, parallel, hidden [400, 400]; N = 3*8 + 13."""
    model = DCNv2(tiny.collection(dims=8), dense_in_features=13, low_rank=64)
    batch = tiny.batch()
    assert model(batch.dense, batch.sparse).shape == (4,)
    assert [tuple(k.shape) for k in model.cross_arch.W_kernels] == [(37, 64)] * 3
    assert [tuple(k.shape) for k in model.cross_arch.V_kernels] == [(64, 37)] * 3
    assert [(m.in_features, m.out_features) for m in model.deep_arch if isinstance(m, torch.nn.Linear)] == [
        (37, 400), (400, 400)]
    assert model.over_arch.in_features == 37 + 400


def test_full_rank_and_stacked_layouts(tiny):
    model = DCNv2(tiny.collection(dims=4), dense_in_features=2, cross_layers=2, hidden=(8, 5), structure="stacked")
    assert [tuple(k.shape) for k in model.cross_arch.kernels] == [(14, 14)] * 2
    assert model.over_arch.in_features == 5  # stacked: the head reads the MLP only


def cross_by_hand(x0: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    x = x0
    for w, b in zip(weights, biases):
        x = x0 * (x @ w.T + b.flatten()) + x  # (B, N); CrossNet keeps b as (N, 1)
    return x


def randomized(model: DCNv2) -> DCNv2:
    with torch.no_grad():
        for b in model.cross_arch.bias:  # zeros at init: make them count
            b.normal_()
    return model


@pytest.mark.parametrize("structure", ["parallel", "stacked"])
def test_full_rank_cross_layers_by_hand(tiny, structure):
    torch.manual_seed(0)
    ebc = tiny.collection(dims=4)
    model = randomized(DCNv2(ebc, dense_in_features=2, cross_layers=2, hidden=(8, 5), structure=structure))
    batch = tiny.batch(b=6, dense=2)
    x0 = torch.cat([tiny.rows(ebc, batch.ids).flatten(1), batch.dense], 1)  # (B, N)
    crossed = cross_by_hand(x0, list(model.cross_arch.kernels), list(model.cross_arch.bias))
    if structure == "stacked":
        top = model.deep_arch(crossed)  # (B, H)
    else:
        top = torch.cat([crossed, model.deep_arch(x0)], 1)  # (B, N + H)
    expected = top @ model.over_arch.weight[0] + model.over_arch.bias[0]
    torch.testing.assert_close(model(batch.dense, batch.sparse), expected)


def test_low_rank_cross_layers_use_w_as_u_times_v(tiny):
    torch.manual_seed(0)
    ebc = tiny.collection(dims=4)
    model = randomized(DCNv2(ebc, dense_in_features=2, cross_layers=2, low_rank=3, hidden=(8,)))
    batch = tiny.batch(b=6, dense=2)
    x0 = torch.cat([tiny.rows(ebc, batch.ids).flatten(1), batch.dense], 1)  # (B, N)
    weights = [u @ v for u, v in zip(model.cross_arch.W_kernels, model.cross_arch.V_kernels)]  # (N, N) rank 3
    assert [int(torch.linalg.matrix_rank(w)) for w in weights] == [3, 3]
    crossed = cross_by_hand(x0, weights, list(model.cross_arch.bias))
    expected = torch.cat([crossed, model.deep_arch(x0)], 1) @ model.over_arch.weight[0] + model.over_arch.bias[0]
    torch.testing.assert_close(model(batch.dense, batch.sparse), expected)


def test_returns_logits_not_probabilities(tiny):
    model = DCNv2(tiny.collection(dims=8), dense_in_features=13, low_rank=4, hidden=(16,))
    before, after = tiny.bias_shift(model, model.over_arch.bias, tiny.batch(b=64))
    torch.testing.assert_close(after - before, torch.full_like(before, 3.0))


def test_unknown_structure_is_refused():
    with pytest.raises(ValueError, match=r"DCNv2: structure='serial'; use 'parallel' or 'stacked'"):
        DCNv2(torch.nn.Identity(), dense_in_features=13, structure="serial")


def test_tables_of_different_dims_are_refused(tiny):
    with pytest.raises(ValueError, match=r"DCNv2: embedding tables have dims \[4, 8\].*same embedding_dim"):
        DCNv2(tiny.collection(dims=(8, 4, 8)), dense_in_features=13)


def test_dense_width_mismatch_names_both_widths(tiny):
    model = DCNv2(tiny.collection(dims=8), dense_in_features=13, low_rank=4, hidden=(4,))
    batch = tiny.batch(dense=12)
    with pytest.raises(ValueError, match=r"DCNv2: dense input has shape \(4, 12\) but the model was built "
                                         r"with dense_in_features=13"):
        model(batch.dense, batch.sparse)


def test_first_losses_are_deterministic_and_golden(first_losses):
    losses = first_losses("dcn_v2")
    assert losses == first_losses("dcn_v2")  # bitwise: one thread, same seed
    assert losses == pytest.approx(GOLDEN, abs=1e-5)
