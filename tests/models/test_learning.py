"""Learning: every ranking model comes within 0.02 AUC of the best reachable on held-out generated data.

The world: Criteo's schema (26 slots, 13 dense), 200,000 training and 50,000 held-out rows, 50 keys
per slot, the generator's planted logistic truth (first-order 85%, dense 10%, pairwise C1xC2 and
C3xC4 5% of the logit's variance), whose AUC on the held-out rows is the best reachable. Each
model trains two passes (xDeepFM and AutoInt one, see EPOCHS_OF) with its conf/ defaults under
ps=local (FBGEMM tables, 2 Hogwild threads) and is evaluated on the held-out rows. Measured here:
every model ends 0.011-0.015 below the best (models/README.md). `pytest -s` prints each gap.

What the margin proves: every model learns the first-order and dense terms to the noise level of
200k rows. It does not prove that the factorised models learn the planted pairwise term: measured,
they end level with LR (on the generator's default 10% pairwise share too, where all sit ~0.018
below the best, as LR does); see models/README.md.
"""

from __future__ import annotations

import pytest

from recps.config import PROJECT_ROOT, compose_config

LEARNING_WORLD = dict(
    train_rows=200_000, test_rows=50_000, seed=0, vocab=50, zipf_a=1.2, missing=0.05, signal=1.2,
    target_ctr=0.25, interactions=[["C1", "C2"], ["C3", "C4"]], interaction_dim=4, shares=[0.85, 0.1, 0.05],
)
EPOCHS = 2
# xDeepFM's CIN and AutoInt's attention cost 5 and 2 minutes of CI for two passes on 2 cores; one
# pass each ends 0.0141 and 0.0117 below the best (measured, session 4): CI stays near 20 minutes.
EPOCHS_OF = {"xdeepfm": 1, "autoint": 1}
MARGIN = 0.02
RANKING = ("ctr_dnn", "deepfm", "lr", "fm", "wide_deep", "dcn", "dcn_v2", "xdeepfm", "autoint", "dlrm")


@pytest.fixture(scope="session")
def learning_world_dir(tmp_path_factory):
    """Generated once per pytest process: `make test` sends each test of this file on its own
    (tests/helpers/schedule.py SPLIT), so they need not run one after another on one worker."""
    return tmp_path_factory.mktemp("learning_world")


@pytest.mark.slow
@pytest.mark.parametrize("model", RANKING)
def test_reaches_best_reachable_auc_minus_margin(model, learning_world_dir, world_config):
    from recps.job.build import build_job
    from recps.job.run import evaluate

    epochs = EPOCHS_OF.get(model, EPOCHS)
    cfg = world_config([f"model={model}", "ps=local", "trainer.threads=2", f"trainer.epochs={epochs}",
                          "progress=false", "metrics.enabled=false"], learning_world_dir, LEARNING_WORLD)
    job = build_job(cfg)
    stats = job.trainer.fit(job.data.train, int(cfg.trainer.batch_size), epochs=epochs, progress=False)
    assert stats.examples == epochs * LEARNING_WORLD["train_rows"]
    got = evaluate(job)
    best = job.data.best_auc
    print(f"learning {model}: {epochs} pass(es), auc {got['auc']:.4f}, best {best:.4f}, gap {best - got['auc']:.4f}")
    assert 0.77 < best < 0.79  # the world above; a generator change shows here first
    assert got["auc"] >= best - MARGIN, (model, got["auc"], best)


CRITEO_TINY = PROJECT_ROOT.parent / "shared" / "data" / "criteo" / "train.tiny.csv"


@pytest.mark.slow
@pytest.mark.skipif(not CRITEO_TINY.exists(), reason=f"{CRITEO_TINY} is absent (../shared/data is not redistributed)")
@pytest.mark.parametrize("model", RANKING)
def test_trains_and_evaluates_on_criteo_tiny(model):
    """Real Criteo rows (1,999; 80/20 split), one pass (more overfits 1,600 rows): held-out logloss below the first training loss, AUC above 0.5.

    400 test rows hold ~100 clicks, so the AUC is reported (models/README.md), not bounded."""
    from recps.job.build import build_job
    from recps.job.run import evaluate

    cfg = compose_config([f"model={model}", "dataset=criteo_tiny", "ps=local", "trainer.threads=1",
                          "trainer.batch_size=64", "progress=false", "metrics.enabled=false"])
    job = build_job(cfg)
    stats = job.trainer.fit(job.data.train, 64, epochs=1, progress=False)
    assert stats.examples == 1999 - 400
    got = evaluate(job)
    assert 0.5 < got["auc"] < 1.0, (model, got)
    assert got["logloss"] < stats.first_losses[0], (model, got, stats.first_losses)  # held out, below the start
    print(f"criteo_tiny {model}: auc={got['auc']:.4f} logloss={got['logloss']:.4f}")
