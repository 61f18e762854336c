"""Counting features from the PS (issue 29.3): a ranker's `inputs.counts` (the item's and the user x category's
shows and clicks) are the servers' accessor statistics as of the previous pass, as dense inputs.

Checked: bad input fails before any process starts, naming the stage, the key and the fix (a counting feature
on a stage whose tables have no accessor, on a batch stage trained on exposures, an unknown feature, recall);
the dense columns follow their formula; end to end through the CLI, the statistics the batch funnel's
validation stages trained with equal a recount (pandas) of the exposures before the validation period, and
those it serves with a recount of every training exposure (recommend serves the evaluation's lists with them); on a file:// stream of three passes, each pass read
the counts of the passes before it (the first: none) and the servers end with every pass counted."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from recps.config import compose_config
from recps.errors import ConfigError
from tests.helpers.cli import recps_train

COUNTS = ["pipeline.stages.fine.inputs.counts=[item_id,user_category]",
          "pipeline.stages.fusion.inputs.counts=[item_id]",
          "pipeline.stages.fine.ps.table.accessor={}", "pipeline.stages.fusion.ps.table.accessor={}"]
TINY_MOVIELENS = [
    "pipeline=movielens_funnel", "pipeline.world.max_users=60",
    "pipeline.stages.recall.keep=200", "pipeline.stages.coarse.keep=60", "pipeline.stages.fine.keep=20",
    "pipeline.stages.recall.trainer.epochs=2", "pipeline.stages.coarse.trainer.epochs=1",
    "pipeline.stages.fine.trainer.epochs=1", "pipeline.stages.fusion.trainer.epochs=1",
    "pipeline.refresh={recall:1,coarse:1}", "pipeline.baselines.ease.max_items=500",
    "pipeline.baselines.ease.grid=[300.0]", "pipeline.baselines.sasrec.enabled=false",
]


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("extra, key, fix", [
    (["pipeline.stages.fine.inputs.counts=[item_id]"],
     "pipeline.stages.fine.inputs.counts=['item_id']: counting features are the statistics of the CTR accessor",
     "give it one, e.g. 'pipeline.stages.fine.ps.table.accessor={}'"),
    (["+pipeline.stages.coarse.inputs.counts=[item_id]", "pipeline.stages.coarse.ps.table.accessor={}"],
     "pipeline.stages.coarse.inputs.counts=['item_id'] but train_on=['exposures', 'candidates']",
     "trains on [validation] and/or [validation_exposures] only"),
    (["pipeline.stages.fine.inputs.counts=[item_id,creator_id]", "pipeline.stages.fine.ps.table.accessor={}"],
     "pipeline.stages.fine.inputs.counts=['item_id', 'creator_id']: ['creator_id']",
     "the counting features are ['item_id', 'user_category']"),
    (["+pipeline.stages.recall.inputs.counts=[item_id]", "pipeline.stages.recall.ps.table.accessor={}"],
     "pipeline.stages.recall.inputs.counts=['item_id']: the recall stage", "give counting features to a ranker"),
    (["pipeline.stages.fine.inputs.counts=[item_id]", "pipeline.stages.fine.ps.table.accessor={}",
      "+pipeline.stages.fine.inputs.count_prior=-1"], "pipeline.stages.fine.inputs.count_prior=-1", ">= 0"),
])
def test_bad_counting_features_fail_before_any_process_starts(tmp_path, extra, key, fix):
    from recps.pipeline import run_pipeline

    with pytest.raises(ConfigError) as info:
        run_pipeline(compose_config(["pipeline=movielens_funnel", *extra]), tmp_path / "run")
    assert key in str(info.value) and fix in str(info.value), str(info.value)
    assert not (tmp_path / "run").exists()


def test_columns_are_the_smoothed_ctr_and_log_counts_of_each_pair():
    """Counts.columns against the formula written out per pair: ctr = (c + m p) / (s + m), p the feature's
    clicks / shows over every key, log1p of shows and clicks; user_category's key is user x C + category."""
    from types import SimpleNamespace

    from recps.pipeline.counts import Counts

    data = SimpleNamespace(num_users=2, num_items=3, item_features={"category": torch.tensor([0, 2, 1])})
    shows = {"item_id": torch.tensor([4.0, 0.0, 10.0]), "user_category": torch.tensor([1.0, 0, 0, 0, 3, 2])}
    clicks = {"item_id": torch.tensor([1.0, 0.0, 5.0]), "user_category": torch.tensor([1.0, 0, 0, 0, 0, 1])}
    counts = Counts(shows, clicks, prior=4.0)
    users, items = torch.tensor([0, 1, 1]), torch.tensor([0, 1, 2])
    got = counts.columns(data, ["item_id", "user_category"], users, items)
    want = []
    for u, i in zip(users.tolist(), items.tolist()):
        row = []
        for f, key in (("item_id", i), ("user_category", u * 3 + [0, 2, 1][i])):
            s, c = float(shows[f][key]), float(clicks[f][key])
            p = float(clicks[f].sum()) / float(shows[f].sum())
            row += [(c + 4.0 * p) / (s + 4.0), np.log1p(s), np.log1p(c)]
        want.append(row)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32))
    assert got.shape == (3, 6)


# ------------------------------------------------------------------------------ end to end


def _recount(users: np.ndarray, items: np.ndarray, clicks: np.ndarray, category: np.ndarray, num_users: int,
             num_items: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{feature: (shows, clicks)} by pandas group counts of exposures (user, item, click)."""
    frame = pd.DataFrame({"item": items, "uc": users * (int(category.max()) + 1) + category[items],
                          "click": clicks})
    out = {}
    for f, col, size in (("item_id", "item", num_items), ("user_category", "uc", num_users * (int(category.max()) + 1))):
        g = frame.groupby(col)["click"].agg(["size", "sum"])
        shows, hits = np.zeros(size, np.float32), np.zeros(size, np.float32)
        shows[g.index.to_numpy()] = g["size"].to_numpy()
        hits[g.index.to_numpy()] = g["sum"].to_numpy()
        out[f] = (shows, hits)
    return out


def _assert_counts(saved, want: dict, stage: str, features, what: str) -> None:
    for f in features:
        np.testing.assert_array_equal(saved[stage].shows[f].numpy(), want[f][0], err_msg=f"{what}: {stage} {f} shows")
        np.testing.assert_array_equal(saved[stage].clicks[f].numpy(), want[f][1], err_msg=f"{what}: {stage} {f} clicks")


@pytest.mark.e2e
@pytest.mark.slow
def test_batch_funnel_counts_equal_a_recount_of_the_exposures_before_the_period_and_of_all(tmp_path):
    from recps.pipeline.counts import counts_from_bytes
    from recps.pipeline.data import validation_period
    from recps.pipeline.runner import load_world

    run = recps_train(*TINY_MOVIELENS, *COUNTS, f"hydra.run.dir={tmp_path / 'run'}", timeout=600)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["server_tables"]["fine"]["fine_dense"] == "async", run.output[-2000:]
    world = load_world(compose_config([*TINY_MOVIELENS, *COUNTS]))
    period = validation_period(world, 0.2)
    cat = world.item_features["category"].numpy()
    fit = period.fit
    past = _recount(fit.train_user.numpy(), fit.train_item.numpy(), fit.train_labels[:, 0].numpy(), cat,
                    world.num_users, world.num_items)
    every = _recount(world.train_user.numpy(), world.train_item.numpy(), world.train_labels[:, 0].numpy(), cat,
                     world.num_users, world.num_items)
    assert past["item_id"][0].sum() == fit.train_user.numel() < every["item_id"][0].sum() == world.train_user.numel()
    trained = counts_from_bytes((tmp_path / "run" / "funnel" / "counts_train.pt").read_bytes())
    served = counts_from_bytes((tmp_path / "run" / "funnel" / "counts.pt").read_bytes())
    assert sorted(trained) == sorted(served) == ["fine", "fusion"]
    for stage, features in (("fine", ["item_id", "user_category"]), ("fusion", ["item_id"])):
        _assert_counts(trained, past, stage, features, "as of the validation period's start")
        _assert_counts(served, every, stage, features, "as of the end of training")
    # the counts are dense inputs: fine reads recall's, coarse's and item_cf's scores, then 2 x 3 count columns
    from recps.pipeline.funnel import load_stage
    from recps.pipeline.stages import pipeline_specs

    specs = {s.name: s for s in pipeline_specs(compose_config([*TINY_MOVIELENS, *COUNTS]))}
    assert load_stage(specs["fine"], str(tmp_path / "run" / "funnel" / "fine.pt")).model is not None
    saved = torch.load(tmp_path / "run" / "funnel" / "fine.pt", weights_only=True)
    assert saved["num_dense"] == 3 + 6 and torch.load(tmp_path / "run" / "funnel" / "fusion.pt",
                                                      weights_only=True)["num_dense"] == 4 + 3
    # recommend (no cluster) reads funnel/counts.pt and returns the evaluation's lists
    from recps.pipeline.recommend import load_funnel, recommend

    lists = json.loads((tmp_path / "run" / "funnel" / "final_lists.json").read_text())
    served = recommend(load_funnel(tmp_path / "run", data=world), torch.tensor(lists["users"][:20]))
    assert [row["items"] for row in served] == [[i for i in x if i >= 0] for x in lists["items"][:20]]


@pytest.mark.e2e
@pytest.mark.slow
def test_stream_pass_reads_the_counts_of_the_passes_before_it(tmp_path):
    """Three hourly passes of one day (no day end between them): pass p's rankers read the statistics of passes
    1..p-1 (pass 1: all zeros), recounted from the pass files; after the stream the servers hold all three."""
    from recps.pipeline.counts import counts_from_bytes
    from recps.pipeline.incremental import read_pass, write_world_passes
    from recps.pipeline.runner import load_world
    from recps.stream.source import pass_files
    from tests.helpers.funnels import DAY, TINY

    stream = [*TINY, "stream.hours=3", f"stream.end_day={DAY}", f"pipeline.world.dir={tmp_path / 'world'}",
              f"stream.root=file://{tmp_path}/impressions", f"stream.out=file://{tmp_path}/out",
              "+pipeline.stages.fine.inputs.counts=[item_id,user_category]"]
    world = load_world(compose_config(stream))  # generates the world
    write_world_passes(str(tmp_path / "world"), f"file://{tmp_path}/impressions", DAY, days=1, hours=3)
    run = recps_train(*stream, f"hydra.run.dir={tmp_path / 'run'}", timeout=600)
    exports = tmp_path / "run" / "funnel"
    folders = sorted((tmp_path / "impressions" / DAY).iterdir())
    assert len(folders) == 3, run.output[-2000:]
    cat = world.item_features["category"].numpy()
    seen = [np.zeros(0, np.int64)] * 2 + [np.zeros(0, np.float32)]
    for p, folder in enumerate(folders, start=1):
        read = counts_from_bytes((exports / f"pass-{p:05d}" / "counts.pt").read_bytes())
        want = _recount(seen[0], seen[1], seen[2], cat, world.num_users, world.num_items)
        _assert_counts(read, want, "fine", ["item_id", "user_category"], f"pass {p}")
        imp = read_pass(pass_files([f"file://{folder}"]), world.num_users, world.num_items)
        seen = [np.concatenate([seen[0], imp.users.numpy()]), np.concatenate([seen[1], imp.items.numpy()]),
                np.concatenate([seen[2], imp.labels[:, 0].numpy()])]
    assert seen[0].size > 0
    final = counts_from_bytes((exports / "counts.pt").read_bytes())
    _assert_counts(final, _recount(*seen, cat, world.num_users, world.num_items), "fine",
                   ["item_id", "user_category"], "after the last pass")
    records = [json.loads(x) for x in (tmp_path / "run" / "stream_metrics.jsonl").read_text().splitlines()]
    assert [r["stages"]["fine"]["mode"] for r in records if "pass" in r] == ["async"] * 3


@pytest.mark.e2e
@pytest.mark.slow
def test_stream_restart_reads_the_counts_the_checkpoint_holds(tmp_path):
    """A stream stopped after day 1 and resumed for day 2 (another process, the servers started afresh):
    day 2's pass reads the counts of day 1's impressions, loaded with the pass checkpoint (decayed once by
    the day end's shrink, the accessor's show_click_decay_rate; rows below its delete_threshold deleted)."""
    from recps.pipeline.counts import counts_from_bytes
    from recps.pipeline.incremental import read_pass, write_world_passes
    from recps.pipeline.runner import load_world
    from recps.stream.source import pass_files
    from tests.helpers.funnels import DAY, DAY2, TINY

    stream = [*TINY, f"pipeline.world.dir={tmp_path / 'world'}", f"stream.root=file://{tmp_path}/impressions",
              f"stream.out=file://{tmp_path}/out", "+pipeline.stages.fine.inputs.counts=[item_id]",
              "stream.shrink=true", "stream.hours=1"]
    world = load_world(compose_config(stream))
    write_world_passes(str(tmp_path / "world"), f"file://{tmp_path}/impressions", DAY, days=2, hours=1)
    recps_train(*stream, f"stream.end_day={DAY}", f"hydra.run.dir={tmp_path / 'run1'}", timeout=600)
    run = recps_train(*stream, f"stream.end_day={DAY2}", f"hydra.run.dir={tmp_path / 'run2'}", timeout=600)
    assert "resumes the streaming funnel" in run.output, run.output[-3000:]
    day1 = read_pass(pass_files([f"file://{p}" for p in sorted((tmp_path / "impressions" / DAY).iterdir())]),
                     world.num_users, world.num_items)
    cat = world.item_features["category"].numpy()
    shows, clicks = _recount(day1.users.numpy(), day1.items.numpy(), day1.labels[:, 0].numpy(), cat,
                             world.num_users, world.num_items)["item_id"]
    decay, delete = 0.98, 0.8  # stream=hourly's accessor (conf/stream/hourly.yaml)
    shows, clicks = shows * np.float32(decay), clicks * np.float32(decay)
    kept = 0.1 * (shows - clicks) + 1.0 * clicks >= delete  # the accessor's score after the decay
    read = [counts_from_bytes(p.read_bytes()) for p in sorted((tmp_path / "run2" / "funnel").glob("pass-*/counts.pt"))]
    assert len(read) == 1, sorted((tmp_path / "run2" / "funnel").iterdir())
    np.testing.assert_allclose(read[0]["fine"].shows["item_id"].numpy(), np.where(kept, shows, 0), rtol=1e-6)
    np.testing.assert_allclose(read[0]["fine"].clicks["item_id"].numpy(), np.where(kept, clicks, 0), rtol=1e-6)
    assert kept.sum() > 10 and (~kept & (shows > 0)).sum() > 0  # both cases occur
