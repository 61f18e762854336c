"""`torchrun` starts a recps job as it starts any torch job: S + W processes, each finding its role
in torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR; the first cluster.servers ranks serve),
with no recps.launch supervising them. The real torchrun of the installed torch, on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from recps.config import PROJECT_ROOT
from tests.helpers.cli import CliRun, run_command, torchrun_command

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def torchrun(nproc: int, *args: str, env: dict | None = None) -> CliRun:
    cmd, ports = torchrun_command(nproc, *args)
    return run_command(cmd, env={**ports, **(env or {})}, timeout=600)


def test_a_training_job_under_torchrun(tmp_path):
    run = tmp_path / "run"
    proc = torchrun(3, "-m", "recps.train", "ps=async", "cluster.servers=1", "cluster.workers=2",
                    "trainer.max_steps=30", "progress=false", f"dataset.dir={tmp_path / 'data'}",
                    f"hydra.run.dir={run}", env={"RECPS_CLUSTER_TOKEN": "torchrun-test-token"})
    metrics = proc.metrics()
    assert (metrics["servers"], metrics["workers"], metrics["train_steps"]) == (1, 2, 30)
    assert 0.4 < metrics["auc"] < 1.0
    assert (run / "checkpoint" / "manifest.json").is_file()
    out = proc.stdout + proc.stderr
    assert "worker1 trained: 30 steps" in out
    # the closing lines a plain run prints, once: worker 0's rank prints them (issue 32.1: nobody did)
    assert out.count("[recps] held-out test split: auc=") == 1, out[-3000:]
    assert out.count(f"[recps] metrics: {run / 'metrics.json'}") == 1, out[-3000:]


def test_the_fleet_example_under_torchrun(tmp_path):
    """The Fleet example unchanged: rank 0 serves (RECPS_NUM_SERVERS=1), ranks 1-2 train; the first
    worker prints its evaluation as a JSON line."""
    proc = torchrun(3, str(PROJECT_ROOT / "examples" / "train_fleet.py"), "--mode", "async",
                    env={"RECPS_CLUSTER_TOKEN": "torchrun-test-token", "RECPS_NUM_SERVERS": "1"})
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 1 and 0.6 < results[0]["auc"] < 1.0, proc.stdout[-2000:]
