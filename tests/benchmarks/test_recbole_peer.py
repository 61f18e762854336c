"""benchmarks/recbole_peer.py writes recps' own split for RecBole: the atomic files hold exactly the funnel data's
training rows, the validation rows are the latest share of those (never a held-out row), the test rows and
requests are the held-out ones, and RecBole's scores come back as lists with recps' exclusions. RecBole itself
is not installed here (it runs in its own virtualenv: `python -m benchmarks.recbole_peer`)."""

from __future__ import annotations

import argparse
from collections import Counter

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from benchmarks import recbole_peer as peer
from benchmarks.sasrec_alone_bench import list_metrics
from recps.config import PROJECT_ROOT
from recps.pipeline.ease import holdout_latest

ML = PROJECT_ROOT / "datasets" / "movielens_latest_small"


@pytest.fixture
def small(tmp_path):
    """6 users x 15 movies, 10-14 ratings each (ties in time included), as MovieLens latest's CSVs."""
    rng = np.random.default_rng(0)
    rows = []
    for user in range(1, 7):
        count = 10 + user % 5
        items = rng.choice(np.arange(1, 16) * 10, size=count, replace=False)
        stamps = np.sort(rng.integers(1000, 1000 + 3 * count, size=count))  # repeats: ties in time
        rows += [(user, int(i), float(rng.choice([2.0, 3.5, 4.0, 5.0])), int(t)) for i, t in zip(items, stamps)]
    ratings = pd.DataFrame(rows, columns=["userId", "movieId", "rating", "timestamp"])
    ratings.to_csv(tmp_path / "ratings.csv", index=False)
    movies = pd.DataFrame({"movieId": np.arange(1, 17) * 10, "title": [f"m{i}" for i in range(16)],
                           "genres": ["Drama|Comedy", "Action", "(no genres listed)", "Drama"] * 4})
    movies.to_csv(tmp_path / "movies.csv", index=False)
    return peer.load_split(str(tmp_path / "ratings.csv"), str(tmp_path / "movies.csv"))


def pairs(users, items) -> Counter:
    return Counter(zip((int(u) for u in users), (int(i) for i in items)))


def file_pairs(path) -> Counter:
    cols = peer.read_inter(path)
    return pairs(cols["user_id"], cols["item_id"])


def test_general_export_is_recps_split(small, tmp_path):
    data = small
    out = peer.export(data, tmp_path / "general", "general")
    train = pairs(data.train_user.tolist(), data.train_item.tolist())
    assert file_pairs(out.folder / "all" / "all.train.inter") == train
    users, items, clicked = peer._ordered(data)
    (eu, ei), (vu, vi) = holdout_latest(users, items, peer.VALIDATION_FRACTION, keep=clicked)
    early = file_pairs(out.folder / "select" / "select.train.inter")
    valid = file_pairs(out.folder / "select" / "select.valid.inter")
    assert early == pairs(eu, ei) and valid == pairs(vu, vi) and len(valid) > 0
    assert not (early & valid) and early + valid <= train  # valid is a part of the training rows, never held out
    p = data.test_positives
    held = pairs(data.test_users[p.row_ids()], p.items)
    assert not (held & train)
    for name in ("select", "all"):
        assert file_pairs(out.folder / name / f"{name}.test.inter") == held
        assert file_pairs(out.folder / name / f"{name}.valid.inter") == valid
    # each user's validation rows are the latest of its training rows (time order, ties in the file's order)
    position = {(int(u), int(i)): k for k, (u, i) in enumerate(zip(users, items))}
    for user in {u for u, _ in valid}:
        last_early = max(position[key] for key in early if key[0] == user)
        assert all(position[key] > last_early for key in valid if key[0] == user)
    requests = peer.read_inter(out.requests)  # the held-out requests: whole history in, data.seen excluded
    assert [int(u) for u in requests["user"]] == data.test_users.tolist()
    seen = data.seen.rows(data.test_users)
    for r, (u, history, exclude) in enumerate(zip(requests["user"], requests["history"], requests["exclude"])):
        assert [int(i) for i in history.split(" ")] == items[users == int(u)].tolist()
        assert [int(i) for i in exclude.split(" ")] == seen.items[seen.offsets[r]:seen.offsets[r + 1]].tolist()
    assert out.trained_items.nonzero().flatten().tolist() == sorted({i for _, i in train})
    assert out.early_items.nonzero().flatten().tolist() == sorted({i for _, i in early})
    asked = peer.read_inter(out.valid)  # the validation users: earlier rows in and excluded
    assert [int(u) for u in asked["user"]] == out.valid_users.tolist() == sorted({u for u, _ in valid})
    for row, (u, history, exclude) in enumerate(zip(asked["user"], asked["history"], asked["exclude"])):
        assert [int(i) for i in history.split(" ")] == ei[eu == int(u)].tolist()
        assert {int(i) for i in exclude.split(" ")} == set(ei[eu == int(u)].tolist())
        got = out.valid_positives.items[out.valid_positives.offsets[row]:out.valid_positives.offsets[row + 1]]
        assert sorted(got.tolist()) == sorted(i for v, i in valid if v == int(u))


def test_sequential_export_reads_only_earlier_training_items(small, tmp_path):
    data = small
    out = peer.export(data, tmp_path / "seq", "sequential")
    users, items, clicked = peer._ordered(data)
    whole = {int(u): items[users == u].tolist() for u in users.unique()}
    rows = peer.read_inter(out.folder / "all" / "all.train.inter")
    got = Counter(zip(rows["user_id"], rows["item_id_list"], rows["item_id"]))
    want = Counter((str(u), " ".join(map(str, s[max(0, p - peer.MAX_LEN):p])), str(s[p]))
                   for u, s in whole.items() for p in range(1, len(s)))
    assert got == want
    assert sum(got.values()) == data.train_user.numel() - len(whole)  # every training row after a user's first
    test = peer.read_inter(out.folder / "all" / "all.test.inter")
    p = data.test_positives
    held = pairs(data.test_users[p.row_ids()], p.items)
    assert Counter(zip(map(int, test["user_id"]), map(int, test["item_id"]))) == held
    for u, seq in zip(test["user_id"], test["item_id_list"]):
        assert seq == " ".join(map(str, whole[int(u)][-peer.MAX_LEN:]))  # the whole training history, no test item
    (eu, ei), (vu, vi) = holdout_latest(users, items, peer.VALIDATION_FRACTION, keep=clicked)
    valid = peer.read_inter(out.folder / "select" / "select.valid.inter")
    assert Counter(zip(map(int, valid["user_id"]), map(int, valid["item_id"]))) == pairs(vu, vi)
    for u, seq in zip(valid["user_id"], valid["item_id_list"]):
        assert seq == " ".join(map(str, ei[eu == int(u)].tolist()[-peer.MAX_LEN:]))
    early = peer.read_inter(out.folder / "select" / "select.train.inter")
    assert Counter(zip(map(int, early["user_id"]), map(int, early["item_id"]))) <= pairs(eu, ei)


def test_movielens_export_has_the_funnels_requests(tmp_path):
    data = peer.load_split(max_users=40)  # movielens_funnel.yaml's world, the first 40 users
    assert (data.name, data.num_items) == ("movielens", 9742)
    out = peer.export(data, tmp_path / "ml", "general")
    assert file_pairs(out.folder / "all" / "all.train.inter") == pairs(data.train_user, data.train_item)
    assert [int(u) for u in peer.read_inter(out.requests)["user"]] == data.test_users.tolist()


def test_lists_are_checked_and_scored_with_recps_metrics(small, tmp_path):
    data = small
    out = peer.export(data, tmp_path / "general", "general")
    seen = data.seen.rows(data.test_users)
    p = data.test_positives
    r, n = data.test_users.numel(), 3
    reachable = [[i for i in p.items[p.offsets[k]:p.offsets[k + 1]].tolist() if out.trained_items[i]][:n]
                 for k in range(r)]
    lists = np.array([row + [-1] * (n - len(row)) for row in reachable], dtype=np.int64)  # (R, n) the positives
    top = peer.check_lists(lists, data.test_users, seen, out.trained_items, n)
    metrics = list_metrics(top, data, n)  # recps' held-out NDCG / HR over every request
    share = sum(bool(row) for row in reachable) / r
    assert 0 < share and metrics[f"hr@{n}"] == pytest.approx(share)
    assert peer.validation_ndcg(top[:, :n], p, n) == pytest.approx(metrics[f"ndcg@{n}"])
    bad = lists.copy()
    bad[0, 0] = int(seen.items[0])  # a training-rated item of request 0
    with pytest.raises(RuntimeError, match="excluded or untrained"):
        peer.check_lists(bad, data.test_users, seen, out.trained_items, n)
    untrained = int((~out.trained_items).nonzero()[0])
    bad = lists.copy()
    bad[1, 0] = untrained
    with pytest.raises(RuntimeError, match="excluded or untrained"):
        peer.check_lists(bad, data.test_users, seen, out.trained_items, n)
    with pytest.raises(RuntimeError, match="expected"):
        peer.check_lists(lists[:-1], data.test_users, seen, out.trained_items, n)


def test_bad_input_is_one_line_before_anything_heavy(monkeypatch, tmp_path, capsys):
    def heavy(*_, **__):
        raise AssertionError("started before the arguments were checked")

    monkeypatch.setattr(peer, "load_split", heavy)
    monkeypatch.setattr(peer, "ensure_venv", heavy)
    with pytest.raises(SystemExit) as missing:
        peer.main(["--ratings", str(tmp_path / "nope.csv"), "--out-dir", str(tmp_path / "o")])
    message = str(missing.value)
    assert "--ratings" in message and "nope.csv" in message and "no such file" in message and "\n" not in message
    with pytest.raises(SystemExit) as unknown:
        peer.main(["--models", "bpr,lightgcn", "--out-dir", str(tmp_path / "o")])
    assert str(unknown.value) == ("recbole_peer: --models 'bpr,lightgcn': unknown model 'lightgcn'; use a "
                                  "comma-separated list of bpr, sasrec")
    assert not (tmp_path / "o").exists()


def test_models_state_their_settings_and_share_the_evaluation_config(tmp_path):
    assert set(peer.MODELS) == {"bpr", "sasrec"}
    for spec in peer.MODELS.values():
        assert spec["grid"] and spec["max_epochs"] > 0
        base = peer.base_config(spec["kind"], tmp_path)
        assert base["benchmark_filename"] == ["train", "valid", "test"] and base["valid_metric"] == "NDCG@10"
    assert peer.base_config("sequential", tmp_path)["alias_of_item_id"] == ["item_id_list"]
    funnel = OmegaConf.load(peer.FUNNEL_CONF)  # the validation share recps' funnel and baselines use
    assert funnel.validation_fraction == funnel.baselines.ease.validation_fraction == peer.VALIDATION_FRACTION
    args = peer.parse_args([])
    assert (args.models, args.threads, args.epochs) == ("bpr,sasrec", 1, 0)
    assert peer.check_args(argparse.Namespace(models="SASRec", ratings=None, movies=None, epochs=0, max_minutes=1,
                                              threads=1)) == ["sasrec"]
    assert torch.get_num_threads() >= 1
