"""The streaming funnel (issue 16 point 7): `python -m recps.train pipeline=video_funnel stream=hourly` on the
real HDFS of tests/hdfs/, a tiny generated world written as a 2-pass stream (2 days x 1 hourly split),
trained in two runs: day 1 on one worker, then the same stream resumed for day 2 on two.

Checked: bad combinations fail before any process starts naming the key and the fix; each pass's record
holds the whole funnel's metrics before its training (none before the first: no model yet); every stage
trained on every pass in its own mode (the servers' tags) and its tables changed between the two pass
checkpoints on HDFS (each checkpoint holds every stage's tables); pass 2's evaluation is pass 1's model:
after the restart, the exports of the reloaded model are pass 1's byte for byte and the metrics recomputed
here in one process from pass 1's exports equal those the two workers merged; Paddle's donefiles record
each pass and day once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from recps import fs as rfs
from recps.config import compose_config
from recps.errors import ConfigError
from tests.helpers.cli import CliRun, recps_train
from tests.helpers.funnels import DAY, DAY2, DAY3, STAGES, TINY

pytestmark = pytest.mark.slow


def _overrides(world: Path, root: str, out: str, run: Path, *extra: str) -> list[str]:
    return [*TINY, f"pipeline.world.dir={world}", f"stream.root={root}", f"stream.out={out}", *extra,
            f"hydra.run.dir={run}"]


def _train(args: list[str]) -> CliRun:
    return recps_train(*args, timeout=400)


@pytest.mark.parametrize("extra, key, fix", [
    (["cluster.checkpoint_every=50"], "cluster.checkpoint_every", "drop cluster.checkpoint_every"),
    (["trainer.resume=/tmp/x"], "trainer.resume=/tmp/x", "drop trainer.resume"),
    (["stream.end_day=20261130"], "stream.end_day=20261130 is before stream.start_day", "stream.end_day"),
    (["pipeline.stages.fine.keep=100"], "pipeline.stages.fine.keep=100 is larger than its input",
     "lower pipeline.stages.fine.keep"),
    # a stream's validation period is the pass: its exposures a second time are refused
    (["pipeline.stages.fusion.inputs.train_on=[exposures,validation_exposures]"],
     "pipeline.stages.fusion.inputs.train_on=['exposures', 'validation_exposures'] with stream.enabled",
     "use ['validation_exposures'] or ['exposures']"),
    (["pipeline.world.tune=true"], "pipeline.world.tune=true with stream.enabled", "drop pipeline.world.tune"),
])
def test_bad_combinations_fail_before_any_process_starts(tmp_path, extra, key, fix):
    from recps.pipeline import run_pipeline

    days = [] if any(x.startswith("stream.end_day=") for x in extra) else [f"stream.end_day={DAY}"]
    cfg = compose_config(_overrides(tmp_path / "world", str(tmp_path / "root"), str(tmp_path / "out"),
                                    tmp_path / "run", *days, *extra)[:-1])
    with pytest.raises(ConfigError) as info:
        run_pipeline(cfg, tmp_path / "run")
    assert key in str(info.value) and fix in str(info.value), str(info.value)
    assert not (tmp_path / "run").exists() and not (tmp_path / "world").exists()


def _table(folder: str, table: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted keys, rows) of a sparse table saved in `folder`; (no keys, the flat values) of a dense one."""
    from recps.ps.table.checkpoint import read_table

    saved = read_table(rfs.join(folder, table))
    if isinstance(saved, dict):
        return torch.zeros(0, dtype=torch.int64), torch.cat([v.reshape(-1) for v in saved.values()])
    return saved.keys, saved.values


@pytest.mark.e2e
def test_streaming_funnel_on_hdfs_two_passes_across_a_restart(tmp_path, hdfs):
    """Pass 1 (day 1) in one run, pass 2 (day 2) in a second run of the same stream, which resumes from
    pass 1's checkpoint on HDFS: pass 2's evaluation is the model pass 1 trained, bit for bit."""
    from recps.pipeline.stages import eval_settings, pipeline_specs
    from recps.pipeline.held_out import evaluate_funnel
    from recps.pipeline.counts import COUNTS_EXPORT, counts_from_bytes
    from recps.pipeline.ease import EaseBaseline
    from recps.pipeline.funnel import ITEM_CF_EXPORT, Funnel, build_index, load_stage
    from recps.pipeline.runner import load_world
    from recps.pipeline.incremental import flat_metrics, funnel_view, read_pass, write_world_passes

    base = f"{hdfs.url}/funnel-stream-{os.getpid()}-{tmp_path.name}"
    root, out = f"{base}/impressions", f"{base}/model"
    world_dir, run1, run2 = tmp_path / "world", tmp_path / "run1", tmp_path / "run2"
    cfg = compose_config(_overrides(world_dir, root, out, run1)[:-1])
    world = load_world(cfg)  # generates the world (the launcher finds it there)
    written = write_world_passes(str(world_dir), root, DAY, days=2, hours=1)
    assert len(written["splits"]) == 2 and sum(written["rows"]) == world.train_user.numel()

    _train(_overrides(world_dir, root, out, run1, f"stream.end_day={DAY}"))
    # The same stream, resumed after pass 1 onto 2 workers (their evaluation merged through the servers).
    proc = _train(_overrides(world_dir, root, out, run2, f"stream.end_day={DAY2}", "cluster.workers=2"))
    # its processes forked from the launcher's preloaded image (which checked the stream on HDFS in a child)
    assert proc.output.count(") forked from this image") == 3, proc.output[-3000:]
    first = json.loads((run1 / "stream_metrics.jsonl").read_text())
    records = [json.loads(line) for line in (run2 / "stream_metrics.jsonl").read_text().splitlines()]
    assert [(r.get("day"), r.get("pass")) for r in records if "pass" in r] == [(DAY2, 1)]
    second = records[-1]
    # The whole funnel evaluated before each pass's training: nothing to evaluate before the first.
    assert (first["day"], first["pass"], first["eval"], first["evaluated_model"]) == (DAY, 1, {}, None)
    e = second["eval"]
    for key in ("ndcg@10", "hr@10", "hit_rate", "stage/recall/pass_through", "stage/fine/auc",
                "most_popular/ndcg@10", "recall_alone/ndcg@10", "ideal/ndcg@10"):
        assert key in e and 0.0 <= e[key] <= 1.0, (key, e.get(key))
    assert e["requests"] > 0
    assert f"pass {DAY2}/1: before training (model of {DAY}/1)" in proc.stdout
    # Every stage trained on both passes, in its own mode, on one set of servers; fusion, trained on each pass as
    # its validation period scored by the previous pass's stages, from the second (tests/pipeline/
    # test_stream_validation.py)
    for r in (first, second):
        assert {n: t["mode"] for n, t in r["stages"].items()} == STAGES
        assert all(t["steps"] > 0 for n, t in r["stages"].items() if r is second or n != "fusion"), r["stages"]
    assert first["stages"]["fusion"]["steps"] == 0
    metrics = json.loads((run2 / "metrics.json").read_text())
    assert (metrics["servers"], metrics["workers"]) == (1, 2)
    assert metrics["stream"]["resumed_from"] == f"{out}/{DAY}/1"
    assert {s: sorted(set(t.values())) for s, t in metrics["server_tables"].items()} == {
        s: [m] for s, m in STAGES.items()}
    # Paddle's records, each pass once: its checkpoint, then the day model; a delta and a base per day.
    lines = [line.split("\t") for line in rfs.read_bytes(f"{out}/donefile.txt").decode().splitlines()]
    assert [(x[0], x[3]) for x in lines] == [(DAY, "1"), (DAY2, "-1"), (DAY2, "1"), (DAY3, "-1")]
    assert len(rfs.read_bytes(f"{out}/patch_donefile.txt").decode().splitlines()) == 2
    assert len(rfs.read_bytes(f"{out}/base_donefile.txt").decode().splitlines()) == 2
    # Each pass checkpoint holds every stage's tables, and pass 2 changed every one of them.
    ck1, ck2 = f"{out}/{DAY}/1", f"{out}/{DAY2}/1"
    for stage in STAGES:
        for table in metrics["server_tables"][stage]:  # <stage>_d<D> (sparse), <stage>_dense
            k1, v1 = _table(ck1, table)
            k2, v2 = _table(ck2, table)
            if stage == "fusion" and table != "fusion_dense":  # pass 1 did not train it: no row yet
                assert k1.numel() == 0 < k2.numel(), table
                continue
            assert v1.numel() > 0, table
            if k1.numel():  # sparse: the rows of pass 1's keys moved
                assert not torch.equal(v2[torch.isin(k2, k1)], v1[torch.isin(k1, k2)]), f"{table} unchanged"
            else:
                assert not torch.equal(v1, v2), f"{table} unchanged by pass 2"
    # Pass 2 evaluated pass 1's model, reloaded from its checkpoint: the same exports byte for byte, and the
    # metrics recomputed here in one process from pass 1's exports are the ones the 2 workers merged.
    model = second["evaluated_model"]
    assert model["pass"] == f"{DAY}/1" and model["loaded_from"] == ck1
    assert model["sha256"] == {n: t["export_sha256"] for n, t in first["stages"].items()}
    specs = pipeline_specs(cfg)
    stages = {s.name: load_stage(s, str(run1 / "funnel" / "pass-00001" / f"{s.name}.pt")) for s in specs}
    history = read_pass([f"{written['splits'][0]}/part-00000.parquet"], world.num_users, world.num_items)
    view = funnel_view(world, history)
    index = build_index(stages["recall"].vectors(view, items=torch.arange(view.num_items)),
                        dict(cfg.pipeline.index))
    read = run2 / "funnel" / "pass-00002"  # what pass 2's evaluation read beside the exports: item_cf, counts
    item_cf = EaseBaseline.from_bytes((read / ITEM_CF_EXPORT).read_bytes())
    counts = counts_from_bytes((read / COUNTS_EXPORT).read_bytes())
    again = flat_metrics(evaluate_funnel(Funnel(specs, stages, index, view, item_cf, counts), eval_settings(cfg)))
    assert {k: again[k] for k in e if k != "eval_seconds"} == pytest.approx(
        {k: v for k, v in e.items() if k != "eval_seconds"}, abs=1e-6)
