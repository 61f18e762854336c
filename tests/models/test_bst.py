"""BST: shapes, padding that changes nothing (key mask, zeroed slots), recency positions, clear
errors, golden first losses, and a history-dependent world where BST beats DeepFM without history."""

from __future__ import annotations

import pytest
import torch
from torchrec import KeyedJaggedTensor

from models import BST, DeepFM

# The first 5 losses of `BehaviourWorld.train` (rows 512, seed 0; batch 64, Adam 0.01, one thread) for
# BST(collection(), flags, max_len=10, num_heads=2, hidden=(32, 16)) built after torch.manual_seed(0)
# (dropout 0.1 on: its draws follow the same seed). Checked equal across two runs before they were frozen.
GOLDEN = [0.742421, 0.671775, 0.580372, 0.392358, 0.570461]


@pytest.fixture
def bst(behaviour_world):
    """bst(**kwargs) -> a BST over `behaviour_world.collection()` (flags on), layers after manual_seed(0), eval mode."""

    def build(**kwargs) -> BST:
        w = behaviour_world
        torch.manual_seed(0)
        args = dict(target_features=w.target, history_features=w.history, history_flags=w.flags,
                    max_len=w.max_len, num_heads=2, hidden=(32, 16))
        return BST(w.collection(), **{**args, **kwargs}).eval()

    return build


def rows(*histories, target=(5, 5), user=0):
    """A KJT of one row per history (a list of (item, category, click), oldest first), one target for all."""
    keys = ["user_id", "item_id", "category", "history_item_id", "history_category", "history_click"]
    b = len(histories)
    cols = [[user] * b, [target[0]] * b, [target[1]] * b,
            [h[0] for s in histories for h in s], [h[1] for s in histories for h in s],
            [h[2] for s in histories for h in s]]
    lengths = [1] * 3 * b + [len(s) for s in histories] * 3
    return KeyedJaggedTensor.from_lengths_sync(keys, torch.tensor([v for c in cols for v in c]), torch.tensor(lengths))


A, B_, C = (3, 5, 1), (7, 2, 0), (9, 5, 0)  # (item, category, click) of history positions


def test_shapes_and_layer_widths(bst):
    m = bst(dense_in_features=3)
    assert m(torch.randn(3, 3), rows([A, B_], [C], [])).shape == (3,)
    assert m.features.others == ["user_id"]
    e = 2 * 8  # item + category fields
    assert m.positions.weight.shape == (11, e)  # rank 0 (the target) .. max_len
    assert m.over_arch[0].in_features == 8 + 11 * e + 3  # [user, every slot's output, dense]
    assert len(m.blocks) == 1 and m.blocks[0].self_attn.num_heads == 2


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_padding_changes_nothing(bst, training):
    """Rows padded to the batch's longest history score as they do alone (eval: the fused
    Transformer path; train, dropout 0: the plain one)."""
    m = bst(dropout=0.0).train(training)
    histories = ([A, B_, C, A], [C], [], [B_, B_])
    together = m(torch.zeros(4, 0), rows(*histories))
    alone = torch.cat([m(torch.zeros(1, 0), rows(h)) for h in histories])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_encode_ignores_padded_content_and_extra_padding(bst):
    m = bst()
    g = torch.Generator().manual_seed(0)
    target, history = torch.randn(3, 16, generator=g), torch.randn(3, 4, 16, generator=g)
    mask = torch.arange(4)[None, :] < torch.tensor([4, 1, 0])[:, None]  # (3, 4)
    base = m.encode(target, history * mask.unsqueeze(2), mask)  # (3, 11*16)
    garbage = torch.where(mask.unsqueeze(2), history, torch.randn(3, 4, 16, generator=g) * 100)
    torch.testing.assert_close(m.encode(target, garbage, mask), base)
    longer = torch.cat([garbage, torch.randn(3, 3, 16, generator=g)], dim=1)  # 3 more padded columns
    torch.testing.assert_close(m.encode(target, longer, torch.cat([mask, torch.zeros(3, 3, dtype=torch.bool)], 1)),
                               base)
    slots = base.view(3, 11, 16)
    assert bool((slots[1, 2:] == 0).all()) and bool((slots[2, 1:] == 0).all())  # padded slots are 0
    assert bool((slots[1, :2] != 0).any(1).all())  # the target and the one behaviour are not


def test_slots_are_ranked_by_recency(bst):
    """Without Transformer layers the slots are the inputs: [t, latest, ..., oldest] + position[rank],
    then zeros; and order matters to the whole model (unlike DIN)."""
    m = bst(num_blocks=0)
    g = torch.Generator().manual_seed(2)
    target, history = torch.randn(1, 16, generator=g), torch.randn(1, 3, 16, generator=g)  # oldest first
    slots = m.encode(target, history, torch.ones(1, 3, dtype=torch.bool)).view(11, 16)
    pos = m.positions.weight
    expected = torch.cat([target + pos[0], history[0].flip(0) + pos[1:4], torch.zeros(7, 16)])
    torch.testing.assert_close(slots, expected)
    full = bst()
    assert not torch.allclose(full(torch.zeros(1, 0), rows([A, B_])), full(torch.zeros(1, 0), rows([B_, A])))


def test_flags_and_history_matter(bst):
    m = bst()
    base = m(torch.zeros(1, 0), rows([A, B_]))
    assert not torch.allclose(base, m(torch.zeros(1, 0), rows([B_])))
    assert not torch.allclose(base, m(torch.zeros(1, 0), rows([(3, 5, 0), B_])))  # A's click flag


def test_errors_name_the_setting(bst):
    with pytest.raises(ValueError, match=r"BST: num_heads=3 does not divide the model width 16 \(= 2 target "
                                         r"fields x embedding_dim 8\)"):
        bst(num_heads=3)
    with pytest.raises(ValueError, match=r"BST: a row of 4 history positions exceeds max_len=3.*"
                                         r"dataset.history_length"):
        bst(max_len=3)(torch.zeros(1, 0), rows([A, B_, C, A]))
    with pytest.raises(ValueError, match=r"BST: features \['clicks'\] are not served"):
        bst(history_flags=["clicks"])
    with pytest.raises(ValueError, match=r"BST: max_len=0"):
        bst(max_len=0)


def test_first_losses_are_golden(bst, behaviour_world):
    world = behaviour_world(512, seed=0)
    losses = world.train(bst(), 5, batch=64)
    assert losses == world.train(bst(), 5, batch=64)  # bitwise: one thread, same seeds
    assert losses == pytest.approx(GOLDEN, abs=1e-5)


@pytest.mark.slow  # ~23 s on the shared 2-core machine
def test_bst_beats_deepfm_without_history(bst, behaviour_world):
    """The world of test_din's quality test (the label is decided by the clicked history): same
    rows, steps (800 x 256), Adam 0.01 and seeds for BST and DeepFM. BST learns the match more
    slowly than DIN (softmax attention must find it; DIN is handed h * t): measured BST 0.695 here
    (0.73 at 900 steps, 0.67 at 600) against DeepFM 0.506; the true probabilities 0.746."""
    w = behaviour_world
    train, held_out = w(60_000, seed=0), w(4_000, seed=1)
    model = bst(num_heads=1, hidden=(64, 32))
    train.train(model, 800)
    torch.manual_seed(0)
    deepfm = DeepFM(w.bag_collection(), dense_in_features=0, hidden=(64, 32))
    train.train(deepfm, 800, history=False)
    got, baseline, best = held_out.auc(model), held_out.auc(deepfm, history=False), held_out.best_auc()
    print(f"held-out AUC: BST {got:.4f}, DeepFM without history {baseline:.4f}, true probabilities {best:.4f}")
    assert got > baseline + 0.10, (got, baseline)
