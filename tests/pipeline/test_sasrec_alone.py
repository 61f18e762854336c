"""recps.pipeline.sasrec_alone: SASRec on its own beats most-popular where the next item follows the last,
the epochs are chosen on the training data alone (the held-out requests are never read), lists are the
catalogue's top n without seen items, and bad settings fail naming pipeline.baselines.sasrec.<key>."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from recps.errors import ConfigError
from recps.metrics import funnel as fm
from recps.pipeline.data import Csr, FunnelData, csr_from_pairs
from recps.pipeline.held_out import most_popular
from recps.pipeline.sasrec_alone import SASREC_DEFAULTS, _windows, fit_sasrec, sasrec_settings

# tiny: ~1 s a fit on one core
TINY = {"max_len": 8, "embedding_dim": 16, "num_blocks": 1, "num_heads": 2, "dropout": 0.0, "lr": 0.01,
        "batch_size": 16, "max_epochs": 15, "patience": 3, "seed": 0}


def chain_world(users: int = 96, items: int = 100, length: int = 15, test: int = 3, seed: int = 0) -> FunnelData:
    """User u rates items s_u, s_u + 1, ... (mod items) at times 0, 1, ...; all clicks. The last `test` of
    each user are its held-out positives, the rest its training rows (listed in a shuffled row order:
    only train_time says which comes first). Popularity says nothing of the next item."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, items, (users, 1), generator=g)
    step = torch.arange(length).unsqueeze(0)  # (1, T)
    item = (start + step) % items  # (U, T)
    train = length - test
    user = torch.arange(users).unsqueeze(1).expand(users, train).reshape(-1)  # (N,)
    rows = torch.randperm(user.numel(), generator=g)
    train_item, train_time = item[:, :train].reshape(-1)[rows], step[:, :train].expand(users, train).reshape(-1)[rows]
    user = user[rows]
    positives = csr_from_pairs(torch.arange(users).repeat_interleave(test), item[:, train:].reshape(-1), users)
    return FunnelData(name="chain", user_features={"user_id": torch.arange(users)},
                      item_features={"item_id": torch.arange(items)}, train_user=user, train_item=train_item,
                      train_labels=torch.ones(user.numel(), 2), seen=csr_from_pairs(user, train_item, users),
                      test_users=torch.arange(users), test_positives=positives, train_time=train_time)


def ndcg(lists: torch.Tensor, positives: Csr, k: int = 10) -> float:
    pair = fm.ndcg_at_k(lists, positives.offsets, positives.items, k)[f"ndcg@{k}"]
    return float(pair[0] / pair[1])


@pytest.fixture(scope="module")
def world() -> FunnelData:
    return chain_world()


@pytest.fixture(scope="module")
def fitted(world):
    return fit_sasrec(world, TINY, k=10)


def test_sasrec_alone_beats_most_popular_where_the_next_item_follows_the_last(world, fitted):
    """The next items are s+12, s+13, s+14 after ..., s+11: SASRec lists them near the top (NDCG@10 > 0.7; 0.76 to
    0.86 over 3 worlds x 2 seeds); most-popular cannot know them (< 0.2; 0.07 to 0.13): a margin of 0.5."""
    users = world.test_users
    mine = ndcg(fitted.lists(world, users, 10), world.test_positives)
    popular = ndcg(most_popular(types.SimpleNamespace(data=world), users, 10), world.test_positives)
    assert mine > 0.7 and popular < 0.2 and mine - popular > 0.5, (mine, popular)
    assert fitted.epochs == max(fitted.validation, key=lambda e: (fitted.validation[e], -e))
    assert fitted.validation[fitted.epochs] > 0.9  # the validation rows follow the chain too


def test_the_held_out_requests_are_never_read_by_the_fit(world, fitted):
    """With test_users and test_positives that raise on any use, the fit is the same, bit for bit: the same
    validation NDCG of every epoch, the same epochs, the same weights."""

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the fit read the held-out requests ({name})")

        def __len__(self):
            raise AssertionError("the fit read the held-out requests (len)")

    blind = dataclasses.replace(world, test_users=Untouchable(), test_positives=Untouchable())
    again = fit_sasrec(blind, TINY, k=10)
    assert again.validation == fitted.validation and again.epochs == fitted.epochs
    mine, theirs = fitted.model.state_dict(), again.model.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[key], theirs[key]) for key in mine)


def test_lists_exclude_seen_items_and_pad_users_without_history(world, fitted):
    """Every user's list: n distinct items, none it saw in training; a user with no training row gets -1s;
    a list longer than the unseen catalogue ends in -1 pads."""
    users = torch.tensor([0, 5, 7])
    lists = fitted.lists(world, users, 10)  # (3, 10)
    assert lists.shape == (3, 10) and lists.dtype == torch.int64
    seen = world.seen.rows(users)
    assert not bool(fm.hits(lists, seen.offsets, seen.items).any())
    assert all(len(set(row.tolist())) == 10 for row in lists)
    whole = fitted.lists(world, users, world.num_items)  # 100 asked, 88 unseen items each
    assert bool((whole[:, 88:] == -1).all()) and bool((whole[:, :88] >= 0).all())
    nothing = Csr(torch.zeros(world.num_users + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    no_history = dataclasses.replace(fitted, history=nothing)
    assert bool((no_history.lists(dataclasses.replace(world, seen=nothing), users, 5) == -1).all())


def test_windows_cover_every_transition_once_latest_first():
    """Rows of 1, 2, 7 and 12 items with max_len 5: 0, 1, 2 (5 + 1) and 3 (5 + 5 + 1) windows; the inputs
    of a user's windows are each of its transitions exactly once."""
    offsets = torch.tensor([0, 1, 3, 10, 22])
    begin, lengths = _windows(Csr(offsets, torch.arange(22)), 5)
    assert begin.tolist() == [1, 4, 3, 16, 11, 10] and lengths.tolist() == [1, 5, 1, 5, 5, 1]
    inputs = torch.cat([torch.arange(b, b + n) for b, n in zip(begin.tolist(), lengths.tolist())])
    transitions = torch.cat([torch.arange(offsets[u], offsets[u + 1] - 1) for u in range(4)])
    assert torch.equal(torch.sort(inputs).values, transitions)


@pytest.mark.parametrize("given, message", [
    ({"max_lenght": 50}, r"pipeline\.baselines\.sasrec\.max_lenght=50 is read by nothing; use one of enabled, "),
    ({"validation_fraction": 0.0}, r"pipeline\.baselines\.sasrec\.validation_fraction=0\.0; use a value in \(0, 1\)"),
    ({"validation_fraction": 1.5}, r"pipeline\.baselines\.sasrec\.validation_fraction=1\.5; use a value in \(0, 1\)"),
    ({"max_len": 0}, r"pipeline\.baselines\.sasrec\.max_len=0; use an integer >= 1"),
    ({"max_len": 2.5}, r"pipeline\.baselines\.sasrec\.max_len=2\.5; use an integer >= 1"),
    ({"interactions": "views"}, r"pipeline\.baselines\.sasrec\.interactions='views'; use exposures .* or clicks"),
    ({"embedding_dim": 10, "num_heads": 4}, r"pipeline\.baselines\.sasrec\.num_heads=4 does not divide "
                                            r"embedding_dim=10; pick a divisor"),
    ({"lr": 0}, r"pipeline\.baselines\.sasrec\.lr=0; use a learning rate > 0"),
])
def test_bad_settings_name_the_key_the_value_and_the_fix(world, given, message):
    with pytest.raises(ConfigError, match=message) as caught:
        fit_sasrec(world, given, k=10)
    assert "\n" not in str(caught.value)


def test_settings_default_to_sasrec_defaults():
    assert sasrec_settings(None) == SASREC_DEFAULTS
    assert sasrec_settings({"max_len": 20})["max_len"] == 20
