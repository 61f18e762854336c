"""DLRM: bottom/top MLPs of the configured sizes, the interaction equal to the pairwise dots of
[bottom output, embeddings] computed by hand; errors; golden first losses."""

from __future__ import annotations

import pytest
import torch

from models import DLRM

# The first 5 training losses of `model=dlrm ps=local trainer.threads=1` on the tiny world
# of conftest.py (batch 256). Checked equal across two runs before they were frozen here.
GOLDEN = [0.685785, 0.664948, 0.610993, 0.583563, 0.56121]


def linears(module: torch.nn.Module) -> list[tuple[int, int]]:
    return [(m.in_features, m.out_features) for m in module.modules() if isinstance(m, torch.nn.Linear)]


def test_forward_shape_and_layers(tiny):
    """Config defaults: bottom [512, 256, 16], top [512, 256] + a 1-wide head; F = 3 gives 16 + 3*4/2 inputs."""
    model = DLRM(tiny.collection(dims=16), dense_in_features=13)
    batch = tiny.batch()
    assert model(batch.dense, batch.sparse).shape == (4,)
    assert linears(model.dlrm.dense_arch) == [(13, 512), (512, 256), (256, 16)]
    assert linears(model.dlrm.over_arch) == [(16 + 6, 512), (512, 256), (256, 1)]


def test_logits_are_the_top_mlp_over_dense_and_pairwise_dots(tiny):
    torch.manual_seed(0)
    ebc = tiny.collection(dims=4)
    model = DLRM(ebc, dense_in_features=2, bottom=(8, 4), top=(6,))
    batch = tiny.batch(b=6, dense=2)
    bottom = model.dlrm.dense_arch(batch.dense)  # (B, D)
    vectors = [bottom] + list(tiny.rows(ebc, batch.ids).unbind(1))  # F + 1 vectors of (B, D)
    dots = [(vectors[i] * vectors[j]).sum(1) for i in range(4) for j in range(i + 1, 4)]  # 6 pairs
    assert model.dlrm.inter_arch(bottom, tiny.rows(ebc, batch.ids)).shape == (6, 4 + 6)
    torch.testing.assert_close(model.dlrm.inter_arch(bottom, tiny.rows(ebc, batch.ids)),
                               torch.cat([bottom, torch.stack(dots, 1)], 1))
    expected = model.dlrm.over_arch(torch.cat([bottom, torch.stack(dots, 1)], 1)).squeeze(1)
    torch.testing.assert_close(model(batch.dense, batch.sparse), expected)


def test_returns_logits_not_probabilities(tiny):
    model = DLRM(tiny.collection(dims=4), dense_in_features=13, bottom=(8, 4), top=(8,))
    head = model.dlrm.over_arch.model[-1]
    assert isinstance(head, torch.nn.Linear)  # no activation after the head
    before, after = tiny.bias_shift(model, head.bias, tiny.batch(b=64))
    torch.testing.assert_close(after - before, torch.full_like(before, 3.0))


def test_bottom_mlp_must_end_in_the_embedding_dim(tiny):
    with pytest.raises(ValueError, match=r"DLRM: bottom=\[32, 8\] must end in the embedding dim 16; "
                                         r"set model.bottom=\[..., 16\] or embedding_dim=8"):
        DLRM(tiny.collection(dims=16), dense_in_features=13, bottom=(32, 8))


def test_tables_of_different_dims_are_refused(tiny):
    with pytest.raises(ValueError, match=r"DLRM: embedding tables have dims \[8, 16\]"):
        DLRM(tiny.collection(dims=(16, 8, 16)), dense_in_features=13)


def test_dense_width_mismatch_names_both_widths(tiny):
    model = DLRM(tiny.collection(dims=4), dense_in_features=13, bottom=(8, 4), top=(8,))
    batch = tiny.batch(dense=12)
    with pytest.raises(ValueError, match=r"DLRM: dense input has shape \(4, 12\) but the model was built "
                                         r"with dense_in_features=13"):
        model(batch.dense, batch.sparse)


def test_first_losses_are_deterministic_and_golden(first_losses):
    losses = first_losses("dlrm")
    assert losses == first_losses("dlrm")  # bitwise: one thread, same seed
    assert losses == pytest.approx(GOLDEN, abs=1e-5)
