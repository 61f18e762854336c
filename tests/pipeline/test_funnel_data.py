"""recps.pipeline.data: behaviour history as a point-in-time feature of the funnel's data (issue 29.1).

The leakage test: a world whose label is "the item is shown again in the user's next request" (a leaked
future makes "target in history" an AUC ~ 1 score) must score at the no-leak level (0.5)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from recps.config import PROJECT_ROOT
from recps.data.generators.ctr import _exact_auc
from recps.errors import ConfigError, DataError
from recps.pipeline.data import (HELD_OUT, HISTORY_FEATURES, Csr, FunnelData, History, csr_from_pairs, movielens,
                                 pair_examples, validation_period, video_world)

ML = next((p for p in (PROJECT_ROOT.parent / "shared" / "data" / "movielens_latest_small",
                       PROJECT_ROOT / "datasets" / "movielens_latest_small") if (p / "ratings.csv").exists()), None)


def _leak_world(users: int = 400, requests: int = 12, size: int = 5, items: int = 40, seed: int = 0,
                length: int = 50) -> FunnelData:
    """Each user: `requests` requests of `size` distinct uniform items at times 100·r (+ the user id, so users'
    clocks differ); label click = 1 iff the item is shown again in the user's NEXT request (the last request's
    rows: 0). Rows are shuffled, so no order of the arrays can stand in for time."""
    g = np.random.default_rng(seed)
    shown = np.argsort(g.random((users, requests, items)), axis=2)[:, :, :size]  # (U, R, S) distinct per request
    nxt = np.zeros((users, requests, size), bool)
    nxt[:, :-1] = (shown[:, :-1, :, None] == shown[:, 1:, None, :]).any(-1)  # in request r + 1
    user = np.broadcast_to(np.arange(users)[:, None, None], shown.shape).ravel()
    time = (100 * np.broadcast_to(np.arange(requests)[None, :, None], shown.shape) + np.arange(users)[:, None, None]
            ).ravel()
    perm = g.permutation(user.size)
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x[perm]).astype(np.int64))  # noqa: E731
    labels = torch.from_numpy(np.stack([nxt.ravel(), np.zeros(user.size, bool)], 1)[perm].astype(np.float32))
    return FunnelData(
        name="leak", user_features={"user_id": torch.arange(users)},
        item_features={"item_id": torch.arange(items), "category": torch.arange(items) % 7},
        train_user=t(user), train_item=t(shown.ravel()), train_labels=labels,
        seen=csr_from_pairs(t(user), t(shown.ravel()), users), test_users=torch.arange(users),
        test_positives=Csr(torch.zeros(users + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)),
        train_time=t(time), history_length=length)


def _target_in_history(data: FunnelData, times: torch.Tensor) -> np.ndarray:
    """(N,) 1 where the exposure's own item is among its history's items (as of `times`; its own row, were it
    there, not counted): a model-free score."""
    lengths, entries = data.history.at(data.train_user, times, data.history_length)
    rows = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    match = (data.history.item[entries] == data.train_item[rows]) & (data.history.time[entries] != data.train_time[rows])
    hit = torch.zeros(lengths.numel(), dtype=torch.int64).index_add_(0, rows, match.long())
    return (hit > 0).numpy().astype(np.float64)


def test_a_leaked_future_would_score_auc_one_the_point_in_time_history_scores_chance():
    """L = 5 = a request: the leaky history (as of one request later) is the next request itself."""
    data = _leak_world(length=5)
    label = data.train_labels[:, 0].numpy()
    assert 0.05 < label.mean() < 0.5
    leaky = _exact_auc(_target_in_history(data, data.train_time + 150), label)  # one request into the future
    honest = _exact_auc(_target_in_history(data, data.train_time), label)
    assert leaky > 0.95, leaky  # the test can see a leak: the future holds the label
    assert abs(honest - 0.5) < 0.03, honest  # measured 0.50x: past repeats say nothing of the next request


def test_the_streams_history_grows_pass_by_pass_and_never_sees_a_later_pass():
    """The streaming funnel's view of a pass (recps.pipeline.incremental.funnel_view): its training rows'
    history is what came strictly before each row (earlier passes and this pass's earlier requests), so the
    leak world scores at chance; evaluation before a pass sees every earlier pass and nothing of it."""
    from recps.pipeline.incremental import Impressions, funnel_view

    world = _leak_world(users=90, length=5)  # times 100 r + u, u < 90: request r of every user inside [100 r, 100 r + 90)
    rows = lambda m: Impressions(world.train_user[m], world.train_item[m], world.train_labels[m],  # noqa: E731
                                 world.train_time[m])
    first, second = rows(world.train_time < 600), rows(world.train_time >= 600)  # requests 0-5, then 6-11
    view = funnel_view(world, first, second)
    assert torch.equal(view.train_time, second.times)
    label = view.train_labels[:, 0].numpy()
    leaky = _exact_auc(_target_in_history(view, view.train_time + 150), label)
    honest = _exact_auc(_target_in_history(view, view.train_time), label)
    assert leaky > 0.95 and abs(honest - 0.5) < 0.05, (leaky, honest)
    lengths, entries = view.history.at(view.train_user, view.train_time, 5)
    assert (lengths == 5).all()  # request 6's history is request 5, from the first pass
    assert (view.history.time[entries] < torch.repeat_interleave(view.train_time, lengths)).all()
    before = funnel_view(world, first)  # evaluation before the second pass: the first pass only
    users = torch.arange(90)
    held = before.history_at(users, before.request_times(users), ["history_item_id"])["history_item_id"][0]
    assert (held == 5).all() and int(before.history.time.max()) < 600


def test_no_history_entry_is_at_or_after_its_exposure_and_none_is_its_own_row():
    data = _leak_world(length=7)
    lengths, entries = data.history.at(data.train_user, data.train_time, 7)
    rows = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)  # (V,)
    assert (data.history.time[entries] < data.train_time[rows]).all()  # strictly before: not its own request
    # every earlier interaction up to L = 7, the latest ones, oldest first
    u, tm = data.train_user.numpy(), data.train_time.numpy()
    earlier = np.array([(tm[u == u[n]] < tm[n]).sum() for n in range(0, u.size, 97)])
    np.testing.assert_array_equal(lengths.numpy()[::97], np.minimum(earlier, 7))
    got_t = data.history.time[entries]
    same_row = rows[1:] == rows[:-1]
    assert (got_t[1:][same_row] >= got_t[:-1][same_row]).all()
    # the flags are the interactions' own labels
    key = lambda uu, ii, ttt: (uu * 1000 + ii) * 10_000 + ttt  # noqa: E731
    order = np.argsort(key(u, data.train_item.numpy(), tm))
    pos = np.searchsorted(key(u, data.train_item.numpy(), tm)[order],
                          key(u[rows], data.history.item[entries].numpy(), got_t.numpy()))
    np.testing.assert_array_equal(data.history.click[entries].numpy(), data.train_labels[order[pos], 0].numpy())


def test_held_out_history_is_the_whole_training_history_and_examples_carry_it():
    data = _leak_world(users=30, requests=4, length=50)
    users = torch.tensor([3, 0, 29])
    ex = pair_examples(data, ["user_id", "history_item_id", "item_id", "history_click", "history_category"],
                       users, torch.tensor([1, 2, 3]), times=data.request_times(users))
    assert ex.feature_names == ("user_id", "item_id", "history_item_id", "history_click", "history_category")
    assert ex.keys.tolist() == [[3, 1], [0, 2], [29, 3]]
    np.testing.assert_array_equal(ex.seq_lengths[0].numpy(), [20, 20, 20])  # 4 requests x 5: all of them
    for q in range(3):
        assert torch.equal(ex.seq_lengths[q], ex.seq_lengths[0])
    mine = data.train_user == 3
    order = np.lexsort((data.train_item[mine].numpy(), data.train_time[mine].numpy()))
    np.testing.assert_array_equal(ex.seq_values[0][:20].numpy(), data.train_item[mine].numpy()[order])
    np.testing.assert_array_equal(ex.seq_values[2].numpy(), (ex.seq_values[0] % 7).numpy())  # the items' category
    assert int(HELD_OUT) == torch.iinfo(torch.int64).max
    with pytest.raises(ValueError, match="pass train_time\\[rows\\] for exposures"):
        pair_examples(data, ["item_id", "history_item_id"], users, torch.tensor([1, 2, 3]))


def test_history_length_is_validated_and_stages_may_name_the_history_features():
    data = _leak_world(users=10, requests=3)
    data.check_features("fine", ["user_id", "item_id", *HISTORY_FEATURES])
    with pytest.raises(ConfigError, match=r"\['history_colour'\] are not features"):
        data.check_features("fine", ["history_colour"])
    for bad in (0, -3):
        with pytest.raises(ConfigError, match=rf"^pipeline.world.history_length={bad}; use an integer >= 1"):
            _leak_world(users=10, requests=3, length=bad)


def test_video_world_history_is_point_in_time(tmp_path):
    data = video_world(str(tmp_path / "w"), users=80, items=2000, creators=200, metric_users=20,
                       impressions_per_user=60, history_length=15, seed=2)
    assert data.history_length == 15
    lengths, entries = data.history.at(data.train_user, data.train_time, 15)
    rows = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    assert (data.history.time[entries] < data.train_time[rows]).all()
    # a user's items are distinct in the world: an exposure's own item never in its history
    assert not (data.history.item[entries] == data.train_item[rows]).any()
    assert int(lengths.max()) == 15 and int(lengths.min()) == 0  # first requests: empty
    # held out: the last 15 training exposures, never a test-period item
    held = data.history_at(data.test_users, data.request_times(data.test_users), ["history_item_id"])
    hl, hv = held["history_item_id"]
    assert (hl == 15).all()
    seen = data.seen.rows(data.test_users)
    hrows = torch.repeat_interleave(torch.arange(hl.numel()), hl)
    assert torch.isin(data.test_users[hrows] * 10_000 + hv, data.test_users[seen.row_ids()] * 10_000 + seen.items).all()
    with pytest.raises(ConfigError, match=r"^pipeline.world.history_length=0; use an integer >= 1"):
        video_world(str(tmp_path / "w"), users=80, items=2000, creators=200, metric_users=20,
                    impressions_per_user=60, history_length=0, seed=2)


def test_video_world_tune_holds_out_inside_the_training_impressions(tmp_path):
    """pipeline.world.tune=true: the funnel data of generators.video_world.tune_split (each user's last train
    request held out, a random bucket of its own), never the world's test requests or random bucket."""
    kw = dict(users=80, items=2000, creators=200, metric_users=20, impressions_per_user=60, random_items_per_user=400,
              seed=2)
    data = video_world(str(tmp_path / "w"), **kw)
    tuned = video_world(str(tmp_path / "w"), tune=True, **kw)
    assert (data.name, tuned.name) == ("video_world", "video_world (tune)")
    assert tuned.train_user.numel() == 80 * 50 and data.train_user.numel() == 80 * 60
    # its training rows are the world's, without each user's last request; its requests come after them
    last = torch.zeros(80, dtype=torch.int64).scatter_reduce(0, data.train_user, data.train_time, "amax")
    assert (tuned.train_time < last[tuned.train_user]).all()
    assert ((data.train_time == last[data.train_user]).sum() == 80 * 10)
    # the held-out positives are its own bucket's clicks: unseen in its training, not the world's bucket
    rows = tuned.test_positives.row_ids()
    pairs = tuned.test_users[rows] * 2000 + tuned.test_positives.items
    seen = tuned.seen.rows(torch.arange(80))
    assert not torch.isin(pairs, seen.row_ids() * 2000 + seen.items).any()
    world_pairs = data.test_users[data.test_positives.row_ids()] * 2000 + data.test_positives.items
    assert torch.isin(pairs, world_pairs).float().mean() < 0.5
    assert tuned.utility_ndcg(tuned.test_users[:5], tuned.ideal(tuned.test_users[:5], 10, tuned.seen)).allclose(
        torch.ones(5, dtype=torch.float64))


@pytest.mark.skipif(ML is None, reason="MovieLens latest-small is not here (datasets/movielens_latest_small)")
def test_movielens_history_uses_timestamps_and_never_a_same_second_row():
    data = movielens(str(ML / "ratings.csv"), str(ML / "movies.csv"), max_users=60, history_length=30)
    lengths, entries = data.history.at(data.train_user, data.train_time, 30)
    rows = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    assert (data.history.time[entries] < data.train_time[rows]).all()  # never the same second
    # MovieLens users rate many movies in the same second: those never see each other
    key = data.train_user * (1 << 40) + data.train_time
    _, counts = torch.unique(key, return_counts=True)
    assert int(counts.max()) > 1  # there are same-second rows to guard against
    # deterministic whatever the rows' order: the same histories from a permuted log
    perm = torch.from_numpy(np.random.default_rng(0).permutation(data.train_user.numel()))
    again = History.of(data.train_user[perm], data.train_item[perm], data.train_time[perm], data.train_labels[perm],
                       data.num_users)
    l2, e2 = again.at(data.train_user, data.train_time, 30)
    assert torch.equal(l2, lengths) and torch.equal(again.item[e2], data.history.item[entries])
    assert torch.equal(again.click[e2], data.history.click[entries])
    # the click flag is rating >= 4 of the interaction itself; held-out requests see the whole train history
    held = data.history_at(data.test_users, data.request_times(data.test_users), ["history_click"])["history_click"]
    per_user = torch.bincount(data.train_user, minlength=data.num_users)[data.test_users]
    assert torch.equal(held[0], per_user.clamp(max=30))


def test_the_validation_period_is_each_users_latest_exposures_and_the_fit_view_never_sees_it():
    data = _leak_world(users=50, requests=10, size=5, length=50)  # 50 rows a user, times 100·r + user
    period = validation_period(data, 0.2)
    fit = period.fit
    per_user = torch.bincount(fit.train_user, minlength=data.num_users)
    assert (per_user == 40).all()  # floor(50 · 0.2) = 10 of each user's rows are the period's
    # the period is each user's latest: every fit row is at or before the user's earliest period row
    u, tm = data.train_user.numpy(), data.train_time.numpy()
    fit_key = set(zip(fit.train_user.tolist(), fit.train_item.tolist(), fit.train_time.tolist()))
    is_period = np.array([(a, b, c) not in fit_key for a, b, c in zip(u, data.train_item.tolist(), tm)])
    for user in range(data.num_users):
        mine = u == user
        assert tm[mine & ~is_period].max() <= tm[mine & is_period].min()
    # its requests: the users with a click in it; positives and labels[0]: those clicks, nothing else
    clicks = {(a, b) for a, b, p, c in zip(u, data.train_item.tolist(), is_period, data.train_labels[:, 0].tolist())
              if p and c > 0}
    assert fit.test_users.tolist() == sorted({a for a, _ in clicks})
    got = {(int(fit.test_users[r]), int(i)) for r, i in zip(period.labels[0].row_ids(), period.labels[0].items)}
    assert got == clicks and torch.equal(fit.test_positives.items, period.labels[0].items)
    # shown: every period row of those requests, clicked or not (validation_exposures trains on them)
    asked = set(fit.test_users.tolist())
    rows = {(a, b) for a, b, p in zip(u, data.train_item.tolist(), is_period) if p and a in asked}
    assert {(int(fit.test_users[r]), int(i)) for r, i in zip(period.shown.row_ids(), period.shown.items)} == rows
    assert len(rows) > len(clicks)
    # the fit view: seen items, exposure buckets and every history (a request's too) hold no period row
    assert len({(int(a), int(b)) for a, b in zip(fit.seen.row_ids(), fit.seen.items)}) == len(
        set(zip(fit.train_user.tolist(), fit.train_item.tolist())))
    held = fit.history_at(fit.test_users, fit.request_times(fit.test_users), ["history_item_id"])["history_item_id"]
    assert (held[0] == torch.bincount(fit.train_user, minlength=data.num_users)[fit.test_users].clamp(max=50)).all()
    assert int(fit.history.time.max()) <= int(data.train_time.max())
    assert fit.history.item.numel() == fit.train_user.numel()
    # the held-out requests are never read: other test positives, the same period
    other = dataclasses.replace(data, test_positives=csr_from_pairs(torch.arange(5), torch.arange(5), data.num_users),
                                history=None)
    again = validation_period(other, 0.2)
    assert torch.equal(again.fit.train_item, fit.train_item) and torch.equal(again.labels[0].items, period.labels[0].items)
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ConfigError, match=rf"^pipeline.validation_fraction={bad}; use a value in \(0, 1\)"):
            validation_period(data, bad)


@pytest.mark.skipif(ML is None, reason="MovieLens latest-small is not here (datasets/movielens_latest_small)")
def test_movielens_files_in_another_layout_give_the_same_funnel_data(tmp_path):
    """Issue 29.7: the ratings as a TAB-separated file without a header and the movies as '|'-separated genre
    flags (MovieLens-100K's layout) read through pipeline.world.*_layout equal the CSVs' data; the default
    layout on them fails naming pipeline.world.ratings_layout, the key the funnel reads."""
    import pandas as pd

    ratings = pd.read_csv(ML / "ratings.csv")
    movies = pd.read_csv(ML / "movies.csv")
    ratings.to_csv(tmp_path / "u.data", sep="\t", header=False, index=False)
    genres = sorted({g for row in movies["genres"] for g in row.split("|") if g != "(no genres listed)"})
    flags = pd.DataFrame({g: movies["genres"].str.split("|").apply(lambda gs, g=g: int(g in gs)) for g in genres})
    pd.concat([movies[["movieId", "title"]].assign(title="t"), flags], axis=1).to_csv(
        tmp_path / "u.item", sep="|", header=False, index=False)
    ratings_layout = {"separator": "\t", "header": False, "columns": ["userId", "movieId", "rating", "timestamp"]}
    movies_layout = {"separator": "|", "header": False, "columns": ["movieId", "title", *genres], "genres_key": None,
                     "genre_columns": genres}
    want = movielens(str(ML / "ratings.csv"), str(ML / "movies.csv"), max_users=80)
    got = movielens(str(tmp_path / "u.data"), str(tmp_path / "u.item"), max_users=80, ratings_layout=ratings_layout,
                    movies_layout=movies_layout)
    for name in ("train_user", "train_item", "train_labels", "train_time", "test_users"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.test_positives.items, want.test_positives.items)
    assert got.num_items == want.num_items == 9742
    for f in ("category", "exposures"):
        assert torch.equal(got.item_features[f], want.item_features[f]), f
    with pytest.raises(DataError, match=r"pipeline\.world\.ratings_layout"):
        movielens(str(tmp_path / "u.data"), str(tmp_path / "u.item"), max_users=80, movies_layout=movies_layout)
