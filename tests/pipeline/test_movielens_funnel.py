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
    "pipeline.stages.fine.trainer.epochs=2", "pipeline.stages.fusion.trainer.epochs=2",
    # the rankers on the labelled ratings plus unrated candidates, every stage on all training ratings: the
    # design the default's validation period replaced (tests/pipeline/test_funnel_history.py runs that one;
    # on 150 users its 145 period requests are too few: NDCG@10 0.043, recall alone 0.060, most-popular 0.068)
    "pipeline.stages.fine.inputs.train_on=[exposures,candidates]", "+pipeline.stages.fine.inputs.candidates_per_user=30",
    "pipeline.stages.fusion.inputs.train_on=[exposures,candidates]",
    "+pipeline.stages.fusion.inputs.candidates_per_user=20", "pipeline.validation_fraction=null", "pipeline.refresh=null",
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
    300 -> 100 -> 30 -> 10, through the real CLI (1 server, 1 worker). What holds, measured: recall alone
    beats most-popular on NDCG@10; the whole funnel's NDCG@10 is at most-popular's here and below it at the
    default size (its HR@10 and recall@10 above): when it is not above, an xfail naming the gap."""
    run = tmp_path / "run"
    metrics = recps_train(*SMALL, f"hydra.run.dir={run}", timeout=600).metrics()
    assert {s: sorted(set(t.values())) for s, t in metrics["server_tables"].items()} == {
        s: [m] for s, m in STAGES.items()}
    assert metrics["requests"] == len(_expected(USERS)["positives"]) == 147
    funnel, base = metrics["funnel"], metrics["baselines"]
    print(json.dumps({"funnel": funnel, "baselines": base, "recall": metrics["stages"]["recall"]}))
    # Recall (GEO, one worker: the same numbers in two runs) beats most-popular: NDCG@10 0.0795 vs 0.0675.
    assert base["recall_alone"]["ndcg@10"] > 1.1 * base["most_popular"]["ndcg@10"], base
    assert metrics["stages"]["recall"]["recall@300"] > 0.4, metrics["stages"]["recall"]  # measured 0.458
    assert 0.0 < funnel["ndcg@10"] <= 1.0 and funnel["hr@10"] > 0.2, funnel  # measured 0.286 / 0.299
    if funnel["ndcg@10"] <= base["most_popular"]["ndcg@10"]:
        pytest.xfail(f"the whole funnel's NDCG@10 {funnel['ndcg@10']:.4f} is below most-popular's "
                     f"{base['most_popular']['ndcg@10']:.4f} and recall alone's {base['recall_alone']['ndcg@10']:.4f} "
                     "(measured 0.0613-0.0672 vs 0.0675 here with the rankers on exposures and candidates; the "
                     "default's validation period has too few requests at this size, and at the full size it gives "
                     "0.1015-0.1043 vs 0.0784 / 0.0926-0.0933: benchmarks/RESULTS.md)")
