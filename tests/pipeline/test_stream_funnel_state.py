"""The streaming funnel's per-worker stage state across a restart: a GEO stage's dense parameters train on
each worker with the stage's own torch optimizer (Adam here: moments and step counts the servers never see),
so a pass checkpoint saves it in each worker's state file (under "stages") and a resume loads it back.

End to end (the real CLI, on a file:// stream of a tiny world, 1 worker, 1 thread, recall and coarse in GEO
with k_steps=1 and foreground syncs: exactly local training, deterministic): the stream stopped after pass 1
and resumed for pass 2 ends pass 2 with the same dense optimizer state (Adam's step count: pass 1's steps
plus pass 2's) and the same dense values as the same stream run through both passes at once. Without the
saved state the resumed Adam restarts at step 0 (its step count after pass 2 is pass 2's steps alone).

Without a cluster: what `_load_stage_states` does with a checkpoint written before the state was saved (a
warning naming the stage: its optimizer restarts), with one that lacks a GEO stage's state (ConfigError
naming the stage, the file and the fix) or holds another optimizer's, and how workers' states merge."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from recps.config import compose_config
from recps.errors import ConfigError
from tests.helpers.funnels import DAY, DAY2, TINY
from tests.helpers.cli import recps_train

GEO = ["recall", "coarse"]
MODES = {"recall": "geo", "coarse": "geo", "fine": "async", "fusion": "sync"}
EXACT_GEO = ["ps@pipeline.stages.coarse.ps=geo",
             *(f"pipeline.stages.{s}.ps.{k}" for s in GEO for k in ("k_steps=1", "background_sync=false"))]


def _overrides(tmp: Path, out: str, run: Path, *extra: str) -> list[str]:
    return [*TINY, *EXACT_GEO, f"pipeline.world.dir={tmp / 'world'}", f"stream.root=file://{tmp}/impressions",
            f"stream.out={out}", *extra, f"hydra.run.dir={run}"]


def _train(args: list[str]) -> str:
    return recps_train(*args).output


def _state(out: str, day: str) -> dict:
    """Worker 0's state file of the pass checkpoint <out>/<day>/1."""
    return torch.load(Path(out.removeprefix("file://")) / day / "1" / "workers" / "worker-00000.pt",
                      weights_only=True)


def _dense(out: str, day: str, stage: str) -> torch.Tensor:
    from recps.ps.table.checkpoint import read_table

    saved = read_table(f"{out}/{day}/1/{stage}_dense")
    return torch.cat([v.reshape(-1) for v in saved.values()])


def _assert_same_optimizer(a: dict, b: dict, what: str) -> None:
    assert a["param_groups"] == b["param_groups"], what
    assert sorted(a["state"]) == sorted(b["state"]), what
    for i, entry in a["state"].items():
        for k, v in entry.items():
            torch.testing.assert_close(v, b["state"][i][k], rtol=0, atol=0, msg=f"{what}: param {i} {k}")


@pytest.mark.e2e
@pytest.mark.slow
def test_geo_stage_dense_optimizer_continues_across_a_restart(tmp_path):
    import json

    from recps.pipeline.runner import load_world
    from recps.pipeline.incremental import write_world_passes

    stopped, whole = f"file://{tmp_path}/stopped", f"file://{tmp_path}/whole"
    load_world(compose_config(_overrides(tmp_path, stopped, tmp_path / "run")[:-1]))  # generates the world
    write_world_passes(str(tmp_path / "world"), f"file://{tmp_path}/impressions", DAY, days=2, hours=1)

    _train(_overrides(tmp_path, stopped, tmp_path / "run1", f"stream.end_day={DAY}"))  # pass 1, then it stops
    log = _train(_overrides(tmp_path, stopped, tmp_path / "run2", f"stream.end_day={DAY2}"))  # resumed: pass 2
    _train(_overrides(tmp_path, whole, tmp_path / "run3", f"stream.end_day={DAY2}"))  # both passes, no restart
    assert "local dense state of ['recall', 'coarse']" in log, log[-3000:]
    assert "restarts from fresh state" not in log

    steps = {}
    for run in ("run1", "run2"):
        record = [json.loads(x) for x in (tmp_path / run / "stream_metrics.jsonl").read_text().splitlines()][-1]
        assert {n: t["mode"] for n, t in record["stages"].items()} == MODES
        steps[run] = {s: record["stages"][s]["steps"] for s in GEO}
    first, resumed, uninterrupted = _state(stopped, DAY), _state(stopped, DAY2), _state(whole, DAY2)
    # Only the GEO stages keep local state (sync and async: the servers hold the dense optimizer's).
    assert sorted(first["stages"]) == sorted(resumed["stages"]) == sorted(uninterrupted["stages"]) == sorted(GEO)
    assert sorted(first["sparse"]) == ["coarse_d8", "recall_d16"]
    for s in GEO:
        saved, after = first["stages"][s], resumed["stages"][s]
        assert (saved["mode"], saved["optimizer"]) == ("geo", "Adam")
        # Adam counted pass 1's steps before the restart and went on from them after it.
        assert {int(e["step"]) for e in saved["dense_optimizer"]["state"].values()} == {steps["run1"][s]}
        assert {int(e["step"]) for e in after["dense_optimizer"]["state"].values()} == {
            steps["run1"][s] + steps["run2"][s]}
        # The same as the run that never stopped: its optimizer state and the dense values it trained.
        _assert_same_optimizer(after["dense_optimizer"], uninterrupted["stages"][s]["dense_optimizer"], s)
        torch.testing.assert_close(_dense(stopped, DAY2, s), _dense(whole, DAY2, s), rtol=0, atol=0)
    assert _state(whole, DAY)["stages"].keys() == first["stages"].keys()


# ---------------------------------------------------------------------------- without a cluster


def _stage(name: str = "recall", optimizer=torch.optim.Adam, mode: str = "geo"):
    """A _StageTrainer's local-state half: its dense parameters, optimizer and dense updater (geo's)."""
    from recps.pipeline.incremental import _StageTrainer
    from recps.ps.modes.dense import PSDenseUpdater
    from recps.ps.modes.geo import GeoDenseUpdater

    t = object.__new__(_StageTrainer)
    torch.manual_seed(0)
    t.dense = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]
    t.optimizer = optimizer(t.dense, lr=0.1)
    t.spec = SimpleNamespace(name=name, mode=SimpleNamespace(name=mode))
    t.updater = (GeoDenseUpdater(t.dense, t.optimizer, communicator=None) if mode == "geo"
                 else PSDenseUpdater(t.dense, communicator=None, table=f"{name}_dense"))
    return t


def _trained(t, steps: int = 3):
    for _ in range(steps):
        t.updater.optimizer.zero_grad()
        sum((p ** 2).sum() for p in t.dense).backward()
        t.updater.optimizer.step()
    return t


def test_local_state_round_trip_and_only_geo_keeps_one():
    from recps.pipeline.incremental import _load_stage_states

    role = SimpleNamespace(name="worker0")
    saved = _trained(_stage()).local_state()
    assert (saved["mode"], saved["optimizer"]) == ("geo", "Adam")
    fresh = _stage()
    assert fresh.optimizer.state_dict()["state"] == {}
    assert _load_stage_states({"recall": fresh}, [{"stages": {"recall": saved}}], ["workers/worker-00000.pt"],
                              "file:///ck", role) == ["recall"]
    _assert_same_optimizer(fresh.optimizer.state_dict(), saved["dense_optimizer"], "round trip")
    # sync / async: the servers hold the dense optimizer's state; the worker has none to save.
    assert not _stage(mode="async").has_local_state and _stage(mode="sync").local_state() is None
    # Onto another number of workers: every worker's state, the moments' means (merge_worker_states).
    a, b = _trained(_stage(), 2).local_state(), _trained(_stage(), 4).local_state()
    merged = _stage()
    _load_stage_states({"recall": merged}, [{"stages": {"recall": a}}, {"stages": {"recall": b}}],
                       ["workers/worker-00000.pt", "workers/worker-00001.pt"], "file:///ck", role)
    got = merged.optimizer.state_dict()["state"][0]
    torch.testing.assert_close(got["exp_avg"], (a["dense_optimizer"]["state"][0]["exp_avg"]
                                                + b["dense_optimizer"]["state"][0]["exp_avg"]) / 2)
    assert float(got["step"]) == 3.0


def test_checkpoint_without_stage_states_warns_and_restarts_the_optimizer(caplog):
    from recps.pipeline.incremental import _load_stage_states

    t = _stage()
    with caplog.at_level(logging.WARNING, logger="recps.pipeline"):
        loaded = _load_stage_states({"recall": t, "fusion": _stage("fusion", mode="sync")},
                                    [{"sparse": {}}], ["workers/worker-00000.pt"], "file:///ck/20261201/1",
                                    SimpleNamespace(name="worker0"))
    assert loaded == [] and t.optimizer.state_dict()["state"] == {}
    text = caplog.text
    assert "file:///ck/20261201/1" in text and "stage recall (geo" in text and "Adam restarts from fresh" in text
    assert "fusion" not in text  # a sync stage has nothing to restart


def test_missing_or_foreign_stage_state_is_refused_naming_stage_file_and_fix():
    from recps.pipeline.incremental import _load_stage_states

    role = SimpleNamespace(name="worker0")
    coarse = _trained(_stage("coarse")).local_state()
    with pytest.raises(ConfigError) as info:  # the checkpoint saved stage states, but not recall's
        _load_stage_states({"recall": _stage()}, [{"stages": {"coarse": coarse}}], ["workers/worker-00000.pt"],
                           "file:///ck/20261201/1", role)
    msg = str(info.value)
    assert "stage recall (geo)" in msg and "file:///ck/20261201/1/workers/worker-00000.pt" in msg, msg
    assert "['coarse']" in msg and "ps@pipeline.stages.recall.ps=" in msg and "fresh stream" in msg, msg
    with pytest.raises(ConfigError) as info:  # another optimizer class than the stage's
        _load_stage_states({"recall": _stage(optimizer=torch.optim.Adagrad)}, [{"stages": {"recall": coarse}}],
                           ["workers/worker-00000.pt"], "file:///ck/20261201/1", role)
    msg = str(info.value)
    assert "stage recall" in msg and "Adam dense optimizer" in msg and "pipeline.stages.recall.optimizer is " \
        "Adagrad" in msg and "worker-00000.pt" in msg, msg
