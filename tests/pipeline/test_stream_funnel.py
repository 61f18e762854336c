"""The streaming funnel (issue 16 point 7): `python -m recps.train pipeline=video_funnel stream=hourly` on the
real HDFS of tests/hdfs/, a tiny generated world written as a 2-pass stream (1 day x 2 hourly splits).

Checked: bad combinations fail before any process starts naming the key and the fix; each pass's record
holds the whole funnel's metrics before its training (none before the first: no model yet); every stage
trained on every pass in its own mode (the servers' tags) and its tables changed between the two pass
checkpoints on HDFS (each checkpoint holds every stage's tables); pass 2's evaluation is pass 1's model:
the metrics recomputed here from pass 1's exports equal the recorded ones; the donefile records one
checkpoint per pass; rerunning the finished command trains nothing and records nothing twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recps import fs as rfs
from recps.config import PROJECT_ROOT, compose_config
from recps.errors import ConfigError

pytestmark = pytest.mark.slow

DAY = "20261201"
STAGES = {"recall": "geo", "coarse": "async", "fine": "async", "fusion": "sync"}
TINY = [
    "pipeline=video_funnel", "stream=hourly", "cluster.workers=1",
    "pipeline.world.users=120", "pipeline.world.items=600", "pipeline.world.creators=60",
    "pipeline.world.metric_users=40", "pipeline.world.impressions_per_user=30",
    "pipeline.stages.recall.keep=80", "pipeline.stages.coarse.keep=30", "pipeline.stages.fine.keep=15",
    "pipeline.stages.coarse.inputs.candidates_per_user=10", "pipeline.stages.fine.inputs.candidates_per_user=10",
    "pipeline.stages.fusion.inputs.candidates_per_user=5",
    *(f"pipeline.stages.{s}.inputs.candidate_users=0" for s in ("coarse", "fine", "fusion")),
    *(f"pipeline.stages.{s}.trainer.batch_size=128" for s in STAGES),
    "pipeline.stages.recall.trainer.epochs=3", "pipeline.stages.coarse.trainer.epochs=1",
    "pipeline.stages.fine.trainer.epochs=1", "pipeline.stages.fusion.trainer.epochs=1",
    "pipeline.eval_users=0", "pipeline.eval_batch_users=128",
    f"stream.start_day={DAY}", f"stream.end_day={DAY}", "stream.hours=2", "stream.data_sleep_second=0.2",
    "stream.wait_timeout_s=60",
]


def _world_size() -> list[str]:
    """The world's random bucket (when the world has one) within its tiny catalogue."""
    world = compose_config(["pipeline=video_funnel"]).pipeline.world
    return ["pipeline.world.random_items_per_user=100"] if "random_items_per_user" in world else []


def _overrides(world: Path, root: str, out: str, run: Path, *extra: str) -> list[str]:
    return [*TINY, *_world_size(), f"pipeline.world.dir={world}", f"stream.root={root}", f"stream.out={out}",
            *extra, f"hydra.run.dir={run}"]


def _train(args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "recps.train", *args], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=400, env=dict(os.environ, PYTHONPATH=str(PROJECT_ROOT)))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.parametrize("extra, key, fix", [
    (["cluster.checkpoint_every=50"], "cluster.checkpoint_every", "drop cluster.checkpoint_every"),
    (["trainer.resume=/tmp/x"], "trainer.resume=/tmp/x", "drop trainer.resume"),
    (["stream.split_interval=7"], "stream.split_interval=7", "pick a divisor"),
    (["pipeline.stages.fine.keep=100"], "pipeline.stages.fine.keep=100 is larger than its input",
     "lower pipeline.stages.fine.keep"),
])
def test_bad_combinations_fail_before_any_process_starts(tmp_path, extra, key, fix):
    from recps.pipeline import run_pipeline

    cfg = compose_config(_overrides(tmp_path / "world", str(tmp_path / "root"), str(tmp_path / "out"),
                                    tmp_path / "run", *extra)[:-1])
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


def test_streaming_funnel_on_hdfs_two_passes(tmp_path, hdfs):
    from recps.pipeline.evaluate import evaluate_funnel
    from recps.pipeline.config import pipeline_specs
    from recps.pipeline.funnel import Funnel, build_index, load_stage
    from recps.pipeline.runner import load_world
    from recps.pipeline.stream import flat_metrics, funnel_view, read_pass, write_world_passes

    base = f"{hdfs.url}/funnel-stream-{os.getpid()}-{tmp_path.name}"
    root, out = f"{base}/impressions", f"{base}/model"
    world_dir, run = tmp_path / "world", tmp_path / "run"
    args = _overrides(world_dir, root, out, run)
    cfg = compose_config(args[:-1])
    world = load_world(cfg)  # generates the world (the launcher finds it there)
    written = write_world_passes(str(world_dir), root, DAY, days=1, hours=2)
    assert len(written["splits"]) == 2 and sum(written["rows"]) == world.train_user.numel()

    proc = _train(args)
    records = [json.loads(line) for line in (run / "stream_metrics.jsonl").read_text().splitlines()]
    assert [(r["day"], r["pass"]) for r in records] == [(DAY, 1), (DAY, 2)]
    first, second = records
    # The whole funnel evaluated before each pass's training: nothing to evaluate before the first.
    assert first["eval"] == {} and first["evaluated_model"] is None
    e = second["eval"]
    for key in ("ndcg@10", "hr@10", "hit_rate", "stage/recall/pass_through", "stage/fine/auc",
                "most_popular/ndcg@10", "recall_alone/ndcg@10", "ideal/ndcg@10"):
        assert key in e and 0.0 <= e[key] <= 1.0, (key, e.get(key))
    assert e["requests"] > 0
    assert "before training (model of 20261201/1)" in proc.stdout
    # Every stage trained on both passes, in its own mode, on one set of servers.
    for r in records:
        assert {n: t["mode"] for n, t in r["stages"].items()} == STAGES
        assert all(t["steps"] > 0 for t in r["stages"].values()), r["stages"]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["servers"] == 1
    assert {s: sorted(set(t.values())) for s, t in metrics["server_tables"].items()} == {
        s: [m] for s, m in STAGES.items()}
    # A checkpoint per pass on HDFS, each holding every stage's tables, each changed by pass 2.
    lines = rfs.read_bytes(f"{out}/donefile.txt").decode().splitlines()
    passes = [line.split("\t") for line in lines if line.split("\t")[3] != "-1"]
    assert [(p[0], p[3]) for p in passes] == [(DAY, "1"), (DAY, "2")]
    ck1, ck2 = f"{out}/{DAY}/1", f"{out}/{DAY}/2"
    for stage in STAGES:
        for table in metrics["server_tables"][stage]:  # <stage>_d<D> (sparse), <stage>_dense
            k1, v1 = _table(ck1, table)
            k2, v2 = _table(ck2, table)
            assert v1.numel() > 0, table
            if k1.numel():  # sparse: the rows of pass 1's keys moved
                common = torch.isin(k2, k1)
                assert not torch.equal(v2[common], v1[torch.isin(k1, k2)]), f"{table} unchanged by pass 2"
            else:
                assert not torch.equal(v1, v2), f"{table} unchanged by pass 2"
    # Pass 2 was evaluated with pass 1's model: recomputed here from pass 1's exports, the same metrics.
    assert second["evaluated_model"]["pass"] == f"{DAY}/1"
    assert second["evaluated_model"]["sha256"] == {n: t["export_sha256"] for n, t in first["stages"].items()}
    specs = pipeline_specs(cfg)
    stages = {s.name: load_stage(s, str(run / "funnel" / "pass-00001" / f"{s.name}.pt")) for s in specs}
    history = read_pass([f"{written['splits'][0]}/part-00000.parquet"], world.num_users, world.num_items)
    view = funnel_view(load_world(cfg), history)
    index = build_index(stages["recall"].vectors(view, items=torch.arange(view.num_items)),
                        dict(cfg.pipeline.index))
    again = flat_metrics(evaluate_funnel(Funnel(specs, stages, index, view), cfg))
    for key in ("ndcg@10", "hit_rate", "stage/coarse/auc", "most_popular/ndcg@10"):
        assert again[key] == pytest.approx(e[key], abs=1e-6), key
    # Exactly once: the same command again finds every pass recorded, trains nothing, records nothing twice.
    rerun = tmp_path / "rerun"
    _train(_overrides(world_dir, root, out, rerun))
    assert rfs.read_bytes(f"{out}/donefile.txt").decode().splitlines() == lines
    assert json.loads((rerun / "metrics.json").read_text())["train_steps"] == 0
