"""A server stopped cleanly by SIGTERM mid-run (Kubernetes evicting a pod, an operator's kill) tells
the coordinator it is leaving: every worker's call in flight fails at once (within one heartbeat),
naming "server1 at tcp://... left before the job finished: it got SIGTERM", as for a dead server,
not after its request timeout. The other servers exit non-zero (the job did not finish). When the
SIGTERMed server is server 0 (the coordinator's host), it serves its coordinator until the peers
heard it, so they fail naming it too, not a lease later with "coordinator lost".

Processes are started as torchrun / Kubernetes would (each with its role's environment, nobody
watching them): tests.helpers.cluster.RoleProcesses, with its worker script (push + pull in a loop).
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.helpers.cluster import DEAD_AFTER_S, HEARTBEAT_S, RoleProcesses as Cluster, role_processes

pytestmark = pytest.mark.e2e  # every test here starts a process


@pytest.fixture
def cluster(tmp_path):
    """S servers and W workers started as torchrun would, every worker joined (tests.helpers.cluster)."""
    with role_processes(tmp_path) as make:
        yield make


def _failure(c: Cluster, name: str, timeout: float) -> tuple[float, str]:
    m = c.wait_for(name, r"FAILED (\d+\.\d+) (.*)", timeout)
    return float(m.group(1)), m.group(2)


@pytest.mark.slow
def test_sigterm_of_a_server_fails_the_workers_at_once_naming_it(cluster):
    c = cluster(servers=2, workers=1)
    sent = time.time()
    os.kill(c.procs["server1"].pid, signal.SIGTERM)
    failed_at, message = _failure(c, "worker0", DEAD_AFTER_S + 5.0)
    took = failed_at - sent
    print(f"server1 SIGTERM: worker0 failed {took:.2f} s after the signal")
    # Heard with the worker's next heartbeat: well within dead_after_s, and nowhere near the 60 s timeout.
    assert took < HEARTBEAT_S + 1.5 < DEAD_AFTER_S, message
    assert re.search(r"server1 at tcp://127\.0\.0\.1:\d+ left before the job finished: it got SIGTERM", message), message
    assert "did not answer" not in message  # failed, not timed out
    assert c.exit_code("worker0", 10) == 1
    assert c.exit_code("server1", 10) == 0, c.log("server1")  # it was asked to stop, and it did
    assert c.exit_code("server0", 15) == 1, c.log("server0")  # the job did not finish
    assert "server1 at tcp://" in c.log("server0")


@pytest.mark.slow
def test_sigterm_of_server0_fails_everyone_naming_server0_not_a_lost_coordinator(cluster):
    c = cluster(servers=2, workers=1)
    sent = time.time()
    os.kill(c.procs["server0"].pid, signal.SIGTERM)
    failed_at, message = _failure(c, "worker0", DEAD_AFTER_S + 5.0)
    took = failed_at - sent
    print(f"server0 SIGTERM: worker0 failed {took:.2f} s after the signal")
    assert took < HEARTBEAT_S + 1.5, message
    assert re.search(r"server0 at tcp://127\.0\.0\.1:\d+ left before the job finished: it got SIGTERM", message), message
    assert c.exit_code("worker0", 10) == 1
    assert c.exit_code("server1", 10) == 1, c.log("server1")
    assert re.search(r"server0 at tcp://\S+ left before the job finished", c.log("server1")), c.log("server1")
    assert c.exit_code("server0", 2 * HEARTBEAT_S + 5.0) == 0, c.log("server0")  # it leaves within two heartbeats


@pytest.mark.slow
def test_a_stop_from_a_worker_is_the_normal_end_nobody_is_told_anything(cluster):
    """The `stop` worker 0 sends after the last barrier ends the job: the servers leave without a
    reason, and everyone exits 0."""
    c = cluster(servers=2, workers=1)
    c.stop_file.touch()
    assert c.exit_code("worker0", 30) == 0, c.log("worker0")
    for name in ("server0", "server1"):
        assert c.exit_code(name, 15) == 0, c.log(name)
        assert "left before the job finished" not in c.log(name), c.log(name)
