"""The funnel on real data (issue 16 point 4b): `python -m recps.train pipeline=movielens_funnel` on MovieLens
latest-small (datasets/movielens_latest_small, redistributable: PROVENANCE.txt there).

Checked: the data as the funnel sees it against an independent recomputation from the CSV files (the
catalogue is every movie, each user's last 20% of ratings held out, a held-out rating >= 4 a positive, every
training rating an exposure labelled rating >= 4 / >= 4.5); end to end through the CLI on the first 150
users, every stage trained in its own mode, every held-out request evaluated, and what the measured numbers
show against most-popular (see test_movielens_funnel_end_to_end's docstring)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from recps.config import PROJECT_ROOT, compose_config
from tests.helpers.cli import recps_train

DATA = PROJECT_ROOT / "datasets" / "movielens_latest_small"
USERS = 150
SMALL = [
    "pipeline=movielens_funnel", f"pipeline.world.max_users={USERS}",
    "pipeline.stages.recall.keep=300", "pipeline.stages.coarse.keep=100", "pipeline.stages.fine.keep=30",
    "pipeline.stages.recall.trainer.epochs=10", "pipeline.stages.coarse.trainer.epochs=2",
    "pipeline.stages.fine.trainer.epochs=2",
    # the default's design (fine and fusion on the validation period, reading item_cf, scores standardised per
    # request); the period's 145 requests give fusion 8,700 rows: 20 epochs (chosen on the tune split of these
    # users: NDCG@10 0.1003 against 0.0540 with 2, recall alone 0.0972; benchmarks/RESULTS.md)
    "pipeline.stages.fusion.trainer.epochs=20",
    "pipeline.baselines.ease.max_items=1500",  # EASE (item_cf and the baseline) over the slice's 1,500 most rated
]
# Each stage keeps its mode, but its staleness no longer depends on how the machine schedules threads: recall's
# GEO deltas sync on the training thread (not a background thread), and coarse and fine (async) push before their
# next pull (no prefetch, at most one push unapplied). With the background defaults the funnel's NDCG@10 moved
# with the machine's load: 0.0724-0.0842 over 9 runs beside other jobs (mean 0.0774, sd 0.0036), and 0.0685 once
# in CI, below the bound 0.0709; with these, see test_movielens_funnel_end_to_end.
SETTLED = [
    "pipeline.stages.recall.ps.background_sync=false",
    *(f"pipeline.stages.{s}.ps.{k}" for s in ("coarse", "fine") for k in ("max_pending=1", "prefetch=false")),
]
STAGES = {"recall": "geo", "coarse": "async", "fine": "async", "fusion": "sync"}


def _expected(users: int) -> dict:
    """The split recomputed with pandas from the CSV files, for the first `users` users."""
    ratings = pd.read_csv(DATA / "ratings.csv")
    movies = pd.read_csv(DATA / "movies.csv")
    ratings = ratings[ratings["userId"].isin(np.sort(ratings["userId"].unique())[:users])]
    ratings = ratings.sort_values(["userId", "timestamp"], kind="stable")
    n = ratings.groupby("userId")["movieId"].transform("size")
    rank = ratings.groupby("userId").cumcount()
    held = np.maximum(1, np.floor(n * 0.2)).astype(int)
    test = ratings[rank >= n - held]
    train = ratings[rank < n - held]
    liked = test[test["rating"] >= 4.0]
    return {"items": np.union1d(movies["movieId"], ratings["movieId"]), "train": train,
            "positives": {u: set(g["movieId"]) for u, g in liked.groupby("userId")}}


def test_movielens_data_as_the_funnel_sees_it():
    from recps.pipeline.runner import load_world

    want = _expected(USERS)
    data = load_world(compose_config(SMALL))
    assert data.num_items == want["items"].size == 9742  # every movie of movies.csv: recall retrieves over all
    assert data.num_users == USERS
    ids = want["items"]  # item index i is movie ids[i]; user index u is the (u+1)-th smallest userId
    users = np.sort(pd.read_csv(DATA / "ratings.csv")["userId"].unique())[:USERS]
    train = want["train"]
    assert data.train_user.numel() == len(train)
    got = set(zip(users[data.train_user.numpy()], ids[data.train_item.numpy()],
                  data.train_labels[:, 0].numpy(), data.train_labels[:, 1].numpy()))
    assert got == set(zip(train["userId"], train["movieId"], (train["rating"] >= 4.0).astype(np.float32),
                          (train["rating"] >= 4.5).astype(np.float32)))
    positives = {int(users[u]): set(ids[data.test_positives.rows(torch.tensor([r])).items.numpy()].tolist())
                 for r, u in enumerate(data.test_users.tolist())}
    assert positives == want["positives"]
    # A held-out positive is never an item the user rated in training (recall's seen filter cannot hide it).
    seen = {(int(u), int(i)) for u, i in zip(data.seen.row_ids(), data.seen.items)}
    assert not any((u, i) in seen for r, u in enumerate(data.test_users.tolist())
                   for i in data.test_positives.rows(torch.tensor([r])).items.tolist())


@pytest.mark.e2e
def test_movielens_funnel_end_to_end(tmp_path):
    """The first 150 users (9,742 movies, 17,898 training ratings, 147 held-out requests), keep
    300 -> 100 -> 30 -> 10, through the real CLI (1 server, 1 worker), in the default's design. What holds,
    measured: the whole funnel beats recall alone and most-popular on NDCG@10 (issue 29's small-slice test),
    each ranker passes more held-out positives than its chance level."""
    run = tmp_path / "run"
    done = recps_train(*SMALL, *SETTLED, f"hydra.run.dir={run}", timeout=600)
    # the server and the worker forked from the launcher's preloaded image (up at once, not importing anew)
    assert done.output.count(") forked from this image") == 2, done.output[-3000:]
    metrics = done.metrics()
    assert {s: sorted(set(t.values())) for s, t in metrics["server_tables"].items()} == {
        s: [m] for s, m in STAGES.items()}
    assert metrics["requests"] == len(_expected(USERS)["positives"]) == 147
    funnel, base = metrics["funnel"], metrics["baselines"]
    print(json.dumps({"funnel": funnel, "baselines": base, "recall": metrics["stages"]["recall"]}))
    assert metrics["stages"]["recall"]["recall@300"] > 0.4, metrics["stages"]["recall"]  # measured 0.425
    # measured with SETTLED, 8 runs beside other jobs (load 6-14): funnel 0.0845-0.0951 (mean 0.0900, sd 0.0032),
    # recall alone 0.0590 in every run, most-popular 0.0675; the bounds below are 0.0708 and 0.0709
    assert funnel["ndcg@10"] > 1.2 * base["recall_alone"]["ndcg@10"], (funnel, base)
    assert funnel["ndcg@10"] > 1.05 * base["most_popular"]["ndcg@10"], (funnel, base)
    assert funnel["hr@10"] > 0.3, funnel
    for name, stage in metrics["stages"].items():  # fine 0.60 against 0.30, fusion 0.43 against 0.33
        assert stage["pass_through_low95"] <= stage["pass_through"] <= stage["pass_through_high95"], stage
        if name in ("fine", "fusion"):
            assert stage["pass_through"] > 1.2 * stage["chance"], (name, stage)
