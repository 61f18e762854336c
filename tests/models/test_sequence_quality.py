"""Quality on real data: GRU4Rec and SASRec on rsc15 (RecSys Challenge 2015, GRU4Rec's 100k-click
preparation) beat the most-popular baseline by at least 2x on recall@20.

Each model trains through the real CLI (`python -m recps.train`, ps=local, the conf/ defaults
plus the overrides below) on train_full and is evaluated on the test split with GRU4Rec's
protocol (every next click of every test session from its prefix; items unseen in training
dropped). The baseline ranks items by training clicks, through the same evaluation code.
Each training takes about a minute on two cores. The figures are in models/README.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from recps.config import PROJECT_ROOT
from tests.helpers.cli import recps_train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RSC15 = PROJECT_ROOT.parent / "shared" / "data" / "rsc15_yoochoose"
TRAIN, TEST = RSC15 / "yoochoose-clicks-100k_train_full.txt", RSC15 / "yoochoose-clicks-100k_test.txt"
if not (TRAIN.is_file() and TEST.is_file()):
    pytest.skip(f"rsc15 is not at {RSC15} (../shared/data next to the checkout; not redistributable)",
                allow_module_level=True)

# The commands of models/README.md (plus output folders): two passes, 128 lanes / sessions per batch.
COMMANDS = {
    "gru4rec": ["model=gru4rec", "ps=local", "trainer.batch_size=128", "trainer.epochs=2", "optimizer.lr=0.003",
                "ps.table.optimizer.lr=0.1"],
    "sasrec": ["model=sasrec", "ps=local", "trainer.batch_size=128", "trainer.epochs=2",
               "ps.table.optimizer.lr=0.1"],
}


@pytest.fixture(scope="module")
def baseline() -> dict[str, float]:
    import torch

    from recps.data.sessions import prepare_sessions
    from recps.tasks.next_item import MostPopular, NextItemTask

    data = prepare_sessions("rsc15", [TRAIN], [TEST])
    counts = data.train_sessions.item_counts(data.num_embeddings)
    with torch.no_grad():
        return NextItemTask().evaluate(MostPopular(counts), data.test, 1024)


def train(model: str, out: Path) -> dict:
    return recps_train(*COMMANDS[model], "progress=false", "checkpoint.save=false", f"hydra.run.dir={out}",
                       env={"HYDRA_FULL_ERROR": "1"}, timeout=800).metrics()


def test_baseline_is_the_known_most_popular_figure(baseline):
    assert baseline["predictions"] == 10152  # 13,568 test clicks in 3,416 sessions
    assert baseline["recall@20"] == pytest.approx(908 / 10152)  # the top 20 items cover 908 next clicks


@pytest.mark.e2e
@pytest.mark.parametrize("model", sorted(COMMANDS))
def test_model_beats_most_popular_twice_on_recall_at_20(model, baseline, tmp_path):
    got = train(model, tmp_path / model)
    print(f"\n{model} on rsc15 test: recall@20 {got['recall@20']:.4f}, mrr@20 {got['mrr@20']:.4f} "
          f"({got['train_seconds']:.0f} s training); most popular: recall@20 {baseline['recall@20']:.4f}, "
          f"mrr@20 {baseline['mrr@20']:.4f}")
    assert got["predictions"] == baseline["predictions"]
    assert got["recall@20"] >= 2 * baseline["recall@20"], (got, baseline)
    assert got["mrr@20"] >= 2 * baseline["mrr@20"], (got, baseline)
