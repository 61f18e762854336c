"""Funnel stages that read behaviour history, and EASE as a baseline of every funnel run (issue 29 points 2, 6).

Checked: a DIN stage (an unpooled PS-backed collection, history features as of each example's time) trains
in its mode, exports and serves through load_stage / recommend with the evaluation's own lists; EASE is in
the run's metrics with its L2 weight chosen on a validation split of the training rows (the held-out
requests changed, the choice does not); bad input fails before any process starts, naming the stage and
the key (a history-reading model whose features the stage or the data lacks, a history length < 1)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from recps.config import compose_config
from recps.errors import ConfigError
from tests.helpers.cli import recps_train

USERS = 60
SMALL = [
    "pipeline=movielens_funnel", f"pipeline.world.max_users={USERS}", "pipeline.world.history_length=20",
    "pipeline.stages.recall.keep=300", "pipeline.stages.coarse.keep=100", "pipeline.stages.fine.keep=30",
    "pipeline.stages.recall.trainer.epochs=2", "pipeline.stages.coarse.trainer.epochs=1",
    "pipeline.stages.fine.trainer.epochs=1", "pipeline.stages.fusion.trainer.epochs=1",
    "pipeline.baselines.ease.max_items=500",
]


def _cfg(*extra: str):
    return compose_config([*SMALL, *extra])


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("override, stage_key, fix", [
    # the movielens funnel's fine stage is DIN: its history features must be among the stage's inputs
    (["pipeline.stages.fine.inputs.features=[user_id,item_id,category,exposures]"],
     "pipeline.stages.fine.model.history_features", "add them there"),
    (["pipeline.stages.fine.model.history_flags=[history_long_view]"],
     "pipeline.stages.fine.model.history_flags", "add them there"),
    (["+pipeline.stages.fine.inputs.share={item_id:recall}"], "pipeline.stages.fine.inputs.share", "drop inputs.share"),
    (["pipeline.baselines.ease.grid=[0.0]"], "pipeline.baselines.ease.grid", "L2 weights > 0"),
    (["pipeline.baselines.ease.validation_fraction=1.0"], "pipeline.baselines.ease.validation_fraction",
     "TRAINING rows"),
    # training on the validation period (fine and fusion do by default): its fraction, the refresh, never the test
    (["pipeline.validation_fraction=null"], "pipeline.validation_fraction=None", "e.g. +pipeline.validation_fraction"),
    (["pipeline.validation_fraction=1.0"], "pipeline.validation_fraction=1.0", "set it in (0, 1)"),
    (["pipeline.stages.fusion.inputs.train_on=[test]"], "pipeline.stages.fusion.inputs.train_on", "use validation"),
    (["+pipeline.refresh.fine=2"], "pipeline.refresh.fine", "refresh only the stages trained on the period's past"),
    (["pipeline.refresh={recall:0}"], "pipeline.refresh.recall=0", "an integer >= 1"),
    (["+pipeline.refresh.ranker=1"], "pipeline.refresh.ranker", "the stages are"),
    (["+pipeline.baselines.sasrec.max_len=0"], "pipeline.baselines.sasrec.max_len=0", "an integer >= 1"),
    (["+pipeline.baselines.sasrec.epochs=3"], "pipeline.baselines.sasrec.epochs=3", "is read by nothing"),
    (["pipeline.stages.fine.inputs.train_on=[exposures,candidates]", "pipeline.stages.fine.inputs.scores=[recall,coarse]",
      "pipeline.stages.fusion.inputs.train_on=[exposures,candidates]",
      "pipeline.stages.fusion.inputs.scores=[recall,coarse,fine]"], "pipeline.refresh=", "drop pipeline.refresh"),
    # item_cf (EASE of the training rows) is read as of the period: never by a stage trained on exposures
    (["pipeline.stages.fusion.inputs.scores=[recall,coarse,fine,item_cf]",
      "pipeline.stages.fusion.inputs.train_on=[exposures,candidates]"], "pipeline.stages.fusion.inputs.scores reads "
     "item_cf but train_on", "trains on [validation] only"),
    (["pipeline.stages.fusion.inputs.scores=[recall,ranker]"], "pipeline.stages.fusion.inputs.scores: 'ranker'",
     "nor item_cf"),
])
def test_bad_history_stage_config_fails_before_any_process_starts(tmp_path, override, stage_key, fix):
    from recps.pipeline import run_pipeline

    with pytest.raises(ConfigError) as info:
        run_pipeline(_cfg(*override), tmp_path)
    message = str(info.value)
    assert stage_key in message and fix in message, message
    assert not any(tmp_path.iterdir()), "nothing may be written (no process started) before the config is checked"


def test_history_length_below_one_fails_in_the_launcher_before_any_process(tmp_path):
    from recps.pipeline import run_pipeline

    with pytest.raises(ConfigError) as info:  # when the config is composed or, at the latest, in the launcher
        run_pipeline(_cfg("pipeline.world.history_length=0"), tmp_path / "run")
    assert "pipeline.world.history_length=0" in str(info.value), info.value
    assert not (tmp_path / "run" / "cluster.log").exists() and not (tmp_path / "run" / "recps-job.yaml").exists()


def test_a_history_model_on_data_without_history_names_the_stage_and_key():
    """Data without exposure times has no history features: the launcher's check_data names the stage."""
    from recps.pipeline.data import load_world
    from recps.pipeline.stages import check_data, pipeline_specs

    cfg = _cfg()
    data = load_world(cfg)
    check_data(pipeline_specs(cfg), data)  # the shipped config: fine
    bare = dataclasses.replace(data, train_time=None, history=None)
    with pytest.raises(ConfigError) as info:
        check_data(pipeline_specs(cfg), bare)
    message = str(info.value)
    assert "pipeline.stages.fine.inputs.features" in message and "history_item_id" in message, message


# ------------------------------------------------------------------------------ EASE


def test_ease_lambda_is_chosen_on_the_training_rows_only():
    """fit_ease reads the training rows only: other held-out requests give the same lambda and validation
    figures; the lambda is the grid's best on validation; its lists never hold a training-seen item."""
    from recps.pipeline.data import Csr, load_world
    from recps.pipeline.ease import fit_ease
    from recps.pipeline.stages import ease_settings

    cfg = _cfg()
    data = load_world(cfg)
    settings = ease_settings(cfg)
    assert settings["grid"] == [100.0, 300.0, 1000.0] and settings["max_items"] == 500
    first = fit_ease(data, settings, 10)
    assert first.l2 in settings["grid"] and set(first.validation) == set(settings["grid"])
    assert first.validation[first.l2] == max(first.validation.values())
    other = dataclasses.replace(data, test_users=data.test_users[:5],
                                test_positives=Csr(torch.tensor([0, 1, 2, 3, 4, 5]), torch.arange(5)))
    second = fit_ease(other, settings, 10)
    assert second.l2 == first.l2 and second.validation == first.validation
    lists = first.lists(data, data.test_users, 10)  # (R, 10)
    seen = data.seen.rows(data.test_users)
    for r in range(lists.shape[0]):
        assert not set(lists[r].tolist()) & set(seen.rows(torch.tensor([r])).items.tolist())


def test_ease_off_and_in_a_stream_by_default():
    from recps.pipeline.stages import ease_settings

    assert ease_settings(_cfg("pipeline.baselines.ease.enabled=false")) is None
    with pytest.raises(ConfigError, match=r"pipeline.baselines.ease.lambda is read by nothing"):
        ease_settings(_cfg("+pipeline.baselines.ease.lambda=3"))


# ------------------------------------------------------------------------------ end to end


@pytest.mark.e2e
def test_din_stage_trains_and_serves_the_evaluations_lists_and_ease_is_a_baseline(tmp_path):
    """The movielens funnel (fine = DIN over the unpooled PS collection) on 60 users through the CLI:
    every stage trains; recommend, from the run folder with no cluster, returns the evaluation's final
    lists and the fine stage's scores equal a fresh load_stage's; EASE is in metrics.json with its lambda
    chosen on validation, and a verdict line per baseline is printed."""
    from recps.pipeline.data import load_world, validation_period
    from recps.pipeline.funnel import load_stage
    from recps.pipeline.recommend import load_funnel, recommend

    run = tmp_path / "run"
    proc = recps_train(*SMALL, f"hydra.run.dir={run}", timeout=900)
    metrics = proc.metrics()
    assert metrics["stages_trained"]["fine"]["steps"] > 0
    # fine and fusion trained on the validation period (each user's latest 20% of training ratings), recall and
    # coarse on the ratings before it, then again on all of them (pipeline.refresh)
    period, trained = metrics["validation_period"], metrics["stages_trained"]
    expected = validation_period(load_world(_cfg()), 0.2)
    assert period == {"fraction": 0.2, "requests": int(expected.fit.test_users.numel()),
                      "clicks": int(expected.labels[0].items.numel()),
                      "earlier_exposures": int(expected.fit.train_user.numel())}, period
    assert 0 < period["requests"] <= USERS
    for stage, mode in (("recall", "geo"), ("coarse", "async")):
        assert trained[stage]["refresh"]["steps"] > 0 and trained[stage]["refresh"]["mode"] == mode
    assert "refresh" not in trained["fine"] and "refresh" not in trained["fusion"]
    assert 0.5 < metrics["stages"]["fine"]["auc"] <= 1.0
    ease = metrics["baselines"]["ease"]
    assert 0.0 < ease["ndcg@10"] <= 1.0 and 0.0 < ease["hr@10"] <= 1.0
    assert metrics["ease"]["l2"] in (100.0, 300.0, 1000.0) and len(metrics["ease"]["validation_ndcg@10"]) == 3
    sasrec = metrics["baselines"]["sasrec"]  # SASRec alone, its epochs chosen on the training rows' latest
    assert 0.0 <= sasrec["ndcg@10"] <= 1.0 and metrics["sasrec"]["epochs"] in map(int, metrics["sasrec"][
        "validation_ndcg@10"])
    for name in ("ease", "sasrec", "most_popular", "recall_alone"):
        assert f"funnel beats {name}: " in proc.stdout, proc.stdout
    assert any(v.startswith("funnel beats ease: ") for v in metrics["verdicts"])

    saved = json.loads((run / "funnel" / "final_lists.json").read_text())
    users = saved["users"][:30]
    funnel = load_funnel(run)  # fine and fusion read item_cf: serving scores it with the EASE the run exported
    assert funnel.item_cf is not None and (run / "funnel" / "item_cf.pt").is_file()
    assert funnel.item_cf.l2 == metrics["ease"]["l2"]  # the run's EASE baseline is that very fit
    served = recommend(funnel, torch.tensor(users))
    for row, expected in zip(served, saved["items"][:30]):
        assert row["items"] == [i for i in expected if i >= 0]
    fine = funnel.stages["fine"]
    again = load_stage(fine.spec, str(run / "funnel" / "fine.pt"))
    u = torch.tensor(users[:5]).repeat_interleave(4)
    items = torch.tensor([row["items"][:4] for row in served[:5]]).flatten()
    dense = torch.zeros(u.numel(), 3)  # fine's scores: recall, coarse, item_cf
    assert torch.equal(fine.outputs(funnel.data, u, items, dense), again.outputs(funnel.data, u, items, dense))
