"""What `python -m recps.train` prints (issue 18, points 4 and 5), on the captured output of real runs.

Quiet by default: none of the library lines a user cannot act on (fbgemm's "Successfully loaded"
and its embedding tables' argument dump, torch.fx's is_fx_tracing notice, the PS collection's
prefetch warning for next-item models); the training reports and results stay. The numbers say
what they are: the held-out test split, the baseline beside the model on the same split, the
task's own objective, and TensorBoard holds the test metrics.

Three short runs (each ~5-15 s): DeepFM ps=local on generated data, GRU4Rec under ps=async on
the rsc15 sample, the two-tower retrieval model ps=local on MovieLens (../shared/data).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from recps.config import PROJECT_ROOT
from tests.helpers.cli import recps_train

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SHARED = PROJECT_ROOT.parent / "shared" / "data"
# What no run may print: none of it is something the user can act on.
NOISE = ("Successfully loaded", "SplitTableBatchedEmbeddingBagsCodegen", "[TBE=", "is_fx_tracing",
         "prefetch is off", "is not a metric of this run", "Traceback")


def train(run: Path, *overrides: str) -> tuple[str, dict]:
    """Runs recps.train; returns its stdout + stderr and the metrics.json it wrote."""
    proc = recps_train(*overrides, "progress=false", "checkpoint.save=false", f"hydra.run.dir={run}",
                       env={"HYDRA_FULL_ERROR": "0"}, timeout=500)
    return proc.output, proc.metrics()


@pytest.fixture(scope="module")
def ranking(tmp_path_factory) -> tuple[str, dict, Path]:
    run = tmp_path_factory.mktemp("deepfm") / "run"
    output, metrics = train(run, "ps=local", "trainer.max_steps=4", "metrics.tensorboard=true",
                            f"dataset.dir={run.parent / 'data'}", "dataset.generate.train_rows=5000",
                            "dataset.generate.test_rows=1000", "dataset.generate.vocab=100")
    return output, metrics, run


@pytest.fixture(scope="module")
def next_item(tmp_path_factory) -> tuple[str, dict]:
    if not (SHARED / "rsc15_yoochoose").is_dir():
        pytest.skip(f"{SHARED / 'rsc15_yoochoose'} absent")
    output, metrics = train(tmp_path_factory.mktemp("gru4rec") / "run", "model=gru4rec", "ps=async",
                            "trainer.max_steps=6")
    return output, metrics


@pytest.fixture(scope="module")
def retrieval(tmp_path_factory) -> tuple[str, dict]:
    if not (SHARED / "movielens_latest_small").is_dir():
        pytest.skip(f"{SHARED / 'movielens_latest_small'} absent")
    return train(tmp_path_factory.mktemp("two_tower") / "run", "model=two_tower", "ps=local", "trainer.max_steps=5")


def test_a_run_prints_nothing_the_user_cannot_act_on(ranking, next_item, retrieval):
    for output in (ranking[0], next_item[0], retrieval[0]):
        for noise in NOISE:
            assert noise not in output, (noise, output[-4000:])
        assert max(len(line) for line in output.splitlines()) < 400, output  # no 4 KB argument dumps
    # ... and what they can stays: the training reports and the workers' own lines.
    assert "[worker 0] pass metrics, step 4, pass 0, 2048 examples: auc=" in ranking[0]
    assert "[worker0] " in next_item[0] and "INFO recps.cluster: worker0 trained: 6 steps" in next_item[0]


def test_the_last_lines_say_the_metrics_are_the_held_out_splits(ranking):
    output, metrics, _ = ranking
    lines = output.splitlines()
    results = lines.index(next(line for line in lines if line.startswith("[recps] ")))
    assert lines[results:] == [
        f"[recps] held-out test split: auc={metrics['auc']:.4f} logloss={metrics['logloss']:.4f} "
        f"accuracy={metrics['accuracy']:.4f} (the data's best reachable auc={metrics['best_reachable_auc']:.4f})",
        f"[recps] trained 4 steps, 2048 examples, {metrics['examples_per_sec']:.0f} examples/s",
        f"[recps] metrics: {ranking[2] / 'metrics.json'}",
    ]
    assert "pass metrics" in "\n".join(lines[:results])  # the training-pass AUC comes before, labelled as such


def test_the_retrieval_baseline_is_printed_beside_the_model(retrieval):
    output, metrics = retrieval
    names = ("auc", "recall@10", "recall@50", "ndcg@10", "ndcg@50", "mrr")
    model = " ".join(f"{n}={metrics[n]:.4f}" for n in names)
    baseline = " ".join(f"{n}={metrics['most_popular/' + n]:.4f}" for n in names)
    assert f"[recps] held-out test split ({int(metrics['queries'])} queries): {model}\n" in output, output
    assert f"[recps] baseline on the same split, most popular items: {baseline}\n" in output, output


def test_a_next_item_run_prints_its_baselines_beside_the_model(next_item):
    """Issue 32.11: GRU4Rec / SASRec printed no baseline; retrieval runs printed most-popular."""
    output, metrics = next_item
    for prefix, what in (("most_popular", "most popular items"),
                         ("session_items", "the session's own items, most recent first, then popular")):
        values = " ".join(f"{k}={metrics[f'{prefix}/{k}']:.4f}" for k in ("recall@20", "mrr@20"))
        assert f"[recps] baseline on the same split, {what}: {values}\n" in output, output[-3000:]
    # the session's own items are a strong baseline on session logs (repeat clicks): above most popular
    assert metrics["session_items/recall@20"] > metrics["most_popular/recall@20"]


@pytest.fixture(scope="module")
def validation(tmp_path_factory) -> tuple[str, dict]:
    if not (SHARED / "rsc15_yoochoose").is_dir():
        pytest.skip(f"{SHARED / 'rsc15_yoochoose'} absent")
    return train(tmp_path_factory.mktemp("sasrec-valid") / "run", "model=sasrec", "ps=local", "trainer.max_steps=4",
                 "dataset.valid_days=1")


def test_a_validation_split_is_evaluated_instead_of_the_test_split(validation):
    """Issue 32.11: dataset.valid_days holds the last days of the training clicks out, so that settings are
    chosen without the test split."""
    output, metrics = validation
    assert metrics["evaluated_on"] == "validation"
    assert "dataset rsc15: the validation split is the last 1 days of the training clicks" in output
    assert (f"[recps] held-out validation split ({int(metrics['predictions'])} predictions): "
            f"recall@20={metrics['recall@20']:.4f}") in output, output[-3000:]
    assert "held-out test split" not in output


def test_next_item_and_retrieval_runs_return_their_own_objective(next_item, retrieval):
    """No `objective=auc is not a metric` warning (NOISE): the task config names its objective."""
    predictions = int(next_item[1]["predictions"])
    assert (f"[recps] held-out test split ({predictions} predictions): recall@20={next_item[1]['recall@20']:.4f} "
            "mrr@20=") in next_item[0]
    for output, _ in (next_item, retrieval):
        assert "objective" not in output, output


def test_tensorboard_holds_the_test_metrics(ranking):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, metrics, run = ranking
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "pass/auc" in tags  # the training reports' own
    for name in ("auc", "logloss", "accuracy", "best_reachable_auc"):
        (scalar,) = events.Scalars(f"test/{name}")
        assert scalar.step == 4 and scalar.value == pytest.approx(metrics[name], abs=1e-6), name
