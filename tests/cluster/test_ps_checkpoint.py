"""PS checkpoints of `python -m recps.train ps=sync|async|geo`: committed, evaluated, resumed.

- sync, SGD, 1 thread per worker: 4 steps, checkpoint, 4 steps after resume equal 8 straight
  through, every row and dense parameter to 1e-6;
- `recps.evaluate` of the default run's checkpoint prints the metrics the run printed;
- the same run with checkpoint.dir on the real HDFS (hdfs://) is evaluated and resumed from there;
- an uncommitted folder, a changed spec and a resume into other tables are refused naming the file
  or the table; a committed checkpoint is never overwritten.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

from recps.ps.modes import server_halves
from recps.ps.node import PSClient, PSServer
from tests.helpers.cli import CliRun, run_module

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TIMEOUT_S = 420
SMALL = ["dataset.generate.train_rows=4000", "dataset.generate.test_rows=1000", "dataset.generate.vocab=2000",
         "progress=false"]


def recps(module: str, *args: str, check: bool = True) -> CliRun:
    return run_module(module, *args, timeout=TIMEOUT_S, check=0 if check else None)


def train(run_dir: Path, *overrides: str) -> dict:
    return recps("recps.train", *overrides, f"hydra.run.dir={run_dir}").metrics()


def tables_of(folder: str) -> dict[str, torch.Tensor | dict[int, torch.Tensor]]:
    """Every table of a checkpoint, loaded by one in-process server: sparse key -> [values | state],
    dense -> flat values."""
    out = {}
    with PSServer(token="t", halves=server_halves()) as server, PSClient([server.endpoint], token="t") as client:
        client.load(folder)
        for name in server._tables:
            hosted = server._tables[name]
            if hosted.spec["kind"] == "dense":
                out[name] = client.pull_dense(name).wait()
                continue
            t = hosted.shard
            live = t._live[: t._used]
            keys = t._keys[: t._used][live]
            rows = t._rows[: t._used][live][:, : t._mcol]
            out[name] = dict(zip(keys.tolist(), rows))
    return out


def test_sync_resume_equals_straight_through(tmp_path_factory):
    data = tmp_path_factory.getbasetemp() / "ckpt-data"
    common = ["ps=sync", "cluster.workers=2", "trainer.threads=1", "trainer.batch_size=32", "model=ctr_dnn",
              "model.hidden=[16,8]", "optimizer=sgd", "optimizer.lr=0.1", "ps.table.optimizer.name=sgd",
              "ps.table.optimizer.lr=0.2", "metrics=off", f"dataset.dir={data}", *SMALL]
    straight, first, second = (tmp_path_factory.mktemp(n) for n in ("straight", "first", "second"))
    train(straight, *common, "trainer.max_steps=8")
    train(first, *common, "trainer.max_steps=4")
    resumed = train(second, *common, "trainer.max_steps=4", f"trainer.resume={first / 'checkpoint'}")
    manifest = json.loads((second / "checkpoint" / "manifest.json").read_text())
    assert manifest["progress"]["steps"] == 8 and resumed["train_steps"] == 4
    a, b = tables_of(str(straight / "checkpoint")), tables_of(str(second / "checkpoint"))
    assert sorted(a) == sorted(b)
    for name in a:
        if isinstance(a[name], torch.Tensor):
            torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0)
        else:
            assert sorted(a[name]) == sorted(b[name]), name
            for k, row in a[name].items():
                torch.testing.assert_close(b[name][k], row, atol=1e-6, rtol=0)
    # The check has teeth: the first half alone differs from both.
    half = tables_of(str(first / "checkpoint"))
    assert (half["dense"] - a["dense"]).abs().max() > 1e-3


def test_a_resumed_run_numbers_its_steps_on_from_the_checkpoint(tmp_path_factory):
    """Issue 32.3: one step counter across a resume. The first run ends at step 125 (4,000 rows of 32); the
    resumed one's metrics records, checkpoints and log lines count on from there: a report at 140 holds the
    15 steps of its pass so far (not 20 labelled 140), checkpoints fall on the multiples of 50."""
    data = tmp_path_factory.getbasetemp() / "steps-data"
    common = ["ps=async", "trainer.threads=1", "trainer.batch_size=32", "model=ctr_dnn", "model.hidden=[16,8]",
              "metrics.every_steps=20", "ps.checkpoint_every_steps=50", f"dataset.dir={data}", *SMALL]
    first, second = (tmp_path_factory.mktemp(n) for n in ("steps-first", "steps-second"))
    train(first, *common)
    run = recps("recps.train", *common, f"trainer.resume={first / 'checkpoint'}", f"hydra.run.dir={second}")
    records = [json.loads(line) for line in (second / "train_metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"], r["examples"]) for r in records] == [
        *(("step", s, (s - 125) * 32) for s in (140, 160, 180, 200, 220, 240)), ("pass", 250, 4000)]
    assert sorted(p.name for p in (second / "checkpoint").glob("step-*")) == ["step-150", "step-200"]
    metrics = json.loads((second / "metrics.json").read_text())
    assert metrics["step"] == 250 and metrics["train_steps"] == 125
    assert [c["steps"] for c in metrics["checkpoints"]] == [150, 200]
    out = run.output
    assert "checkpoints every 50 steps during training, before step 250" in out
    assert "committed " + str(second / "checkpoint" / "step-150") + " at step 150" in out
    assert "worker0 trained: 125 steps (steps 126-250), 4000 examples" in out
    assert "[recps] trained 125 steps (steps 126-250), 4000 examples" in out


def test_evaluate_a_ps_checkpoint_prints_what_the_run_printed(tmp_path_factory):
    run = tmp_path_factory.mktemp("default")
    metrics = train(run, "trainer.max_steps=60", f"dataset.dir={tmp_path_factory.getbasetemp() / 'default-data'}",
                    *SMALL)
    done = recps("recps.evaluate", str(run / "checkpoint"))
    evaluated = json.loads(done.stdout)
    # as quiet as recps.train (issue 32.4): no fbgemm_gpu import lines, torch.fx notice, or a warning about
    # the storage roots of the one-process server it starts itself
    for noise in ("Successfully loaded", "is_fx_tracing", "not confined"):
        assert noise not in done.output, (noise, done.stderr[-3000:])
    for key in ("auc", "logloss", "accuracy"):
        assert evaluated[key] == metrics[key], key
    # A folder of checkpoints resolves to its committed one; an uncommitted one is refused naming the file.
    (run / "checkpoint" / "manifest.json").rename(run / "checkpoint" / "manifest.moved")
    proc = recps("recps.evaluate", str(run / "checkpoint"), check=False)
    assert proc.returncode != 0 and "no manifest.json: the save did not finish" in proc.stderr
    (run / "checkpoint" / "manifest.moved").rename(run / "checkpoint" / "manifest.json")
    spec = run / "checkpoint" / "dense" / "spec.json"
    spec.write_text(spec.read_text().replace("adam", "sgd"))
    proc = recps("recps.evaluate", str(run / "checkpoint"), check=False)
    assert proc.returncode != 0 and "dense/spec.json does not match manifest.json" in proc.stderr
    # A committed checkpoint is never overwritten: the same run folder again is refused up front.
    proc = recps("recps.train", "trainer.max_steps=5", f"hydra.run.dir={run}", *SMALL, check=False)
    assert proc.returncode != 0 and "holds a committed checkpoint" in proc.stderr


def test_resume_into_other_tables_is_refused_naming_the_table(tmp_path_factory):
    data = tmp_path_factory.getbasetemp() / "default-data"
    first = tmp_path_factory.mktemp("tables-first")
    train(first, "trainer.max_steps=10", f"dataset.dir={data}", "metrics=off", *SMALL)
    other = tmp_path_factory.mktemp("tables-other")
    proc = recps("recps.train", "trainer.max_steps=10", f"dataset.dir={data}", "model.embedding_dim=4", *SMALL,
                 f"trainer.resume={first / 'checkpoint'}", f"hydra.run.dir={other}", check=False)
    # The workers find it (they know the tables): the launcher fails naming worker0, its log the table.
    assert proc.returncode != 0 and "has no table ['embedding_d4']" in proc.stdout, proc.stdout[-2000:]
    # Another mode (issue 32.9: it failed in the servers with "failed load on table '' ..."): refused in the
    # launcher, before any process starts, naming the mode that wrote it and what to do.
    geo = tmp_path_factory.mktemp("tables-geo")
    proc = recps("recps.train", "ps=geo", "trainer.max_steps=10", f"dataset.dir={data}", *SMALL,
                 f"trainer.resume={first / 'checkpoint'}", f"hydra.run.dir={geo}", check=False)
    assert proc.returncode == 1 and "started server0" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"recps.train: ConfigError: trainer.resume='{first / 'checkpoint'}': the checkpoint {first / 'checkpoint'} "
        f"was written by ps=async (tables ['embedding_d11', 'dense']), and this run is ps=geo; resume it with "
        "ps=async, or start afresh without trainer.resume (a checkpoint's optimizer state belongs to the mode that "
        "wrote it)"), proc.stderr[-2000:]


def test_a_run_checkpoints_to_real_hdfs_and_resumes_and_evaluates_from_it(hdfs, tmp_path_factory):
    data = tmp_path_factory.getbasetemp() / "default-data"
    base = f"{hdfs.url}/recps-tests/{uuid.uuid4().hex}"
    first = tmp_path_factory.mktemp("hdfs-first")
    metrics = train(first, "trainer.max_steps=30", f"dataset.dir={data}", f"checkpoint.dir={base}/a", *SMALL)
    assert metrics["checkpoint"] == f"{base}/a"
    evaluated = json.loads(recps("recps.evaluate", f"{base}/a").stdout)
    assert evaluated["auc"] == metrics["auc"]
    second = tmp_path_factory.mktemp("hdfs-second")
    resumed = train(second, "trainer.max_steps=30", f"dataset.dir={data}", f"trainer.resume={base}/a",
                    f"checkpoint.dir={base}/b", "cluster.servers=2", "cluster.workers=2", *SMALL)  # re-sharded
    # 4000 rows, batch 512: the first run trained its epoch (8 steps); the resumed one the next epoch
    # over 2 workers x 2 threads (worker 0: 4 steps).
    assert metrics["train_steps"] == 8 and resumed["train_steps"] == 4 and resumed["servers"] == 2
    from recps import fs as rfs

    manifest = json.loads(rfs.read_bytes(f"{base}/b/manifest.json"))
    assert manifest["progress"]["steps"] == 12 and [w["positions"] for w in manifest["progress"]["workers"]] == [
        [[1, 2], [1, 2]], [[1, 2], [1, 2]]]
