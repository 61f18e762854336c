"""Quality proofs of the retrieval zoo (issue 5): two-tower, YouTube-DNN and NCF on MovieLens.

MovieLens latest-small (../shared/data/movielens_latest_small, read in place), every rating an
implicit interaction, leave-last-out by timestamp (recps.data.interactions): 610 test queries,
each ranked against all 9,724 rated movies with the user's training items excluded. Each model
must beat the most-popular ranking on recall@50 and NDCG@10 by a clear factor (`MARGIN`);
the most-popular figures themselves are pinned (they only depend on the data and the protocol).

Each run goes through the real engine (`recps.job.build.build_job`: ps=local FBGEMM tables, the
Hogwild trainer with 2 threads, the retrieval task's softmax with the log-Q correction and
its full-catalogue evaluation), as `python -m recps.train` does with the same overrides
(`COMMANDS` below; models/README.md records the figures). `pytest -s` prints one line per run.
"""

from __future__ import annotations

import time

import pytest
from hydra import compose, initialize_config_dir

from recps.config import PROJECT_ROOT, register_resolvers
from recps.job.build import build_job
from recps.job.run import evaluate

pytestmark = pytest.mark.slow

MOVIELENS = PROJECT_ROOT.parent / "shared" / "data" / "movielens_latest_small"

# The settings each proof trains with (the rest is conf/'s defaults for the model:
# dataset=movielens, task=retrieval with in-batch negatives and the log-Q correction).
COMMON = ("ps=local", "trainer.threads=2", "progress=false", "checkpoint.save=false")
COMMANDS = {
    "two_tower": ("trainer.epochs=4", "ps.table.optimizer.lr=0.2", "optimizer.lr=0.003"),
    "youtube_dnn": ("trainer.epochs=8", "ps.table.optimizer.lr=0.2", "optimizer.lr=0.003"),
    "ncf": ("trainer.epochs=4", "trainer.batch_size=128", "ps.table.optimizer.lr=0.2", "optimizer.lr=0.003"),
}
# Each model's figure is at least this multiple of the most-popular one. Measured here the
# models reach about 2x on both; NDCG@10 over 610 queries moves by ~0.005 between Hogwild
# runs (one standard error), hence the lower bar there.
MARGIN = {"recall@50": 1.5, "ndcg@10": 1.2}
MOST_POPULAR = {"recall@50": 68 / 610, "ndcg@10": 0.019430}


def config(*overrides: str):
    register_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=[*COMMON, *overrides])


@pytest.fixture(scope="module")
def movielens():
    """PreparedData of conf/dataset/movielens.yaml, built once for the three models."""
    if not MOVIELENS.is_dir():
        pytest.skip(f"{MOVIELENS} is absent (MovieLens is read in place from ../shared/data; see its README.md)")
    from recps.job.build import prepare_dataset

    cfg = config("model=two_tower")
    return prepare_dataset(cfg.dataset, seed=int(cfg.seed))


@pytest.mark.parametrize("model", COMMANDS)
def test_beats_most_popular_on_movielens(model, movielens):
    cfg = config(f"model={model}", *COMMANDS[model])
    job = build_job(cfg, movielens)
    start = time.perf_counter()
    stats = job.trainer.fit(job.data.train, int(cfg.trainer.batch_size), epochs=int(cfg.trainer.epochs),
                            progress=False)
    seconds = time.perf_counter() - start
    got = evaluate(job)
    print(f"\n[movielens] {model}: {stats.steps} steps in {seconds:.0f} s; "
          + ", ".join(f"{k}={got[k]:.4f} (most popular {got['most_popular/' + k]:.4f})"
                      for k in ("recall@10", "recall@50", "ndcg@10", "ndcg@50", "mrr", "auc")))
    assert got["queries"] == 610
    for metric, value in MOST_POPULAR.items():
        assert got[f"most_popular/{metric}"] == pytest.approx(value, abs=1e-5)
        assert got[metric] >= MARGIN[metric] * value, (model, metric, got[metric], value)
    assert stats.first_losses[0] > stats.last_loss  # the softmax loss fell
