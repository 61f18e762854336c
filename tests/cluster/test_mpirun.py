"""`mpirun` (Open MPI, Debian's openmpi-bin) starts a recps job as it starts an MPI job: each rank
finds its role in OMPI_COMM_WORLD_RANK / _SIZE (the first cluster.servers ranks serve) and the
coordinator in RECPS_COORDINATOR, with no recps.launch supervising them. CI installs mpirun
(.ci/run) and sets RECPS_REQUIRE_MPI=1: there a missing mpirun fails instead of skipping."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from recps.config import PROJECT_ROOT
from recps.cluster.launch import free_port

pytestmark = pytest.mark.slow


def mpirun() -> str:
    exe = shutil.which("mpirun")
    if exe is None:
        reason = "mpirun is not installed (Debian: apt-get install openmpi-bin)"
        if os.environ.get("RECPS_REQUIRE_MPI") == "1":
            pytest.fail(f"RECPS_REQUIRE_MPI=1 and {reason}", pytrace=False)
        pytest.skip(reason)
    return exe


def test_a_training_job_under_mpirun(tmp_path):
    run = tmp_path / "run"
    # Open MPI refuses root without --allow-run-as-root; 3 ranks on 2 cores need --oversubscribe.
    cmd = [mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", "3",
           "-x", "RECPS_CLUSTER_TOKEN=mpirun-test-token", "-x", f"RECPS_COORDINATOR=127.0.0.1:{free_port()}",
           "-x", "PATH", sys.executable, "-m", "recps.train", "ps=async", "cluster.servers=1", "cluster.workers=2",
           "trainer.max_steps=30", "progress=false", f"dataset.dir={tmp_path / 'data'}", f"hydra.run.dir={run}"]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert (metrics["servers"], metrics["workers"], metrics["train_steps"]) == (1, 2, 30)
    assert 0.4 < metrics["auc"] < 1.0
    assert "worker1 trained: 30 steps" in proc.stdout + proc.stderr


def test_mpirun_without_a_coordinator_is_refused_naming_the_variable(tmp_path):
    cmd = [mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "RECPS_CLUSTER_TOKEN=t",
           sys.executable, "-m", "recps.train", "ps=async", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {k: v for k, v in os.environ.items() if k != "RECPS_COORDINATOR"}
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    assert "$RECPS_COORDINATOR is not set" in proc.stdout + proc.stderr
