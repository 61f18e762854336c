"""Liveness without recps.launch: processes started the way torchrun / Kubernetes / Slurm would
(each with its role's environment, nobody watching them), paused with real SIGSTOP / SIGCONT.

- stalls shorter than dead_after_s (of the coordinator, of another server, of the worker) end
  nothing: the job finishes and every process exits 0;
- a server stalled for 2 x dead_after_s: the worker's pull/push in flight fails at once, within
  dead_after_s (+ one heartbeat) of the stall's start, naming "server1 at tcp://...", not after
  its 60 s timeout; the servers exit non-zero (the job did not finish), the stalled one as well;
- the coordinator's server (server0) stalled: the worker and server1 detect its loss within
  dead_after_s + heartbeat_s, naming server0; server0, on resume, does not declare anyone dead on
  its first tick back (its own stall is not their silence), and exits non-zero;
- a worker stalled: the others fail naming it, and the worker itself exits non-zero on resume.
Under recps.launch (`python -m recps.train`): server0 stalled for 2 x dead_after_s fails the run
within dead_after_s + 5 s of the stall's end, naming server0.
Plus the pieces in-process: a peer declared dead is told so on its next heartbeat, and
TransportClient.fail_server fails a request in flight at once.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time

import pytest
import torch
import zmq

from recps.errors import PSError
from recps.ps.node.coordinator import Coordinator, CoordinatorClient
from recps.ps.transport import TransportClient, security
from recps.ps.transport.security import curve_keys
from tests.helpers.cluster import (DEAD_AFTER_S, HEARTBEAT_S, LIVENESS_TOKEN as TOKEN, REQUEST_TIMEOUT_S,
                                   RoleProcesses as Cluster, role_processes)
from tests.helpers.threads import wait_until
from tests.helpers.cli import job_process

@pytest.fixture
def cluster(tmp_path):
    """S servers and W workers started as torchrun would, every worker joined (tests.helpers.cluster)."""
    with role_processes(tmp_path) as make:
        yield make


def _failure(c: Cluster, name: str) -> tuple[float, str]:
    m = c.wait_for(name, r"FAILED (\d+\.\d+) (.*)", 5.0)
    return float(m.group(1)), m.group(2)


@pytest.mark.e2e
@pytest.mark.slow
def test_stalls_shorter_than_dead_after_s_end_nothing(cluster):
    c = cluster(servers=2, workers=1)
    for name in ("server0", "server1", "worker0"):  # the coordinator's process, another server, the worker
        c.stall(name, 3.0)  # 3 s of dead_after_s 5 (heartbeat 1 s): more than two heartbeats missed
        time.sleep(1.5)
        assert c.procs["worker0"].poll() is None, c.log("worker0")
    c.stop_file.touch()
    assert c.exit_code("worker0", 30) == 0, c.log("worker0")
    assert re.search(r"DONE \d+", c.log("worker0"))
    assert c.exit_code("server0", 15) == 0, c.log("server0")
    assert c.exit_code("server1", 15) == 0, c.log("server1")
    for name in c.procs:
        assert "is dead" not in c.log(name), c.log(name)
    assert re.search(r"stalled for \d", c.log("server0"))  # the coordinator saw its own stall and forgave it


@pytest.mark.e2e
@pytest.mark.slow
def test_stalled_server_fails_the_workers_calls_at_once_naming_it(cluster):
    c = cluster(servers=2, workers=1)
    stopped, resumed = c.stall("server1", 2 * DEAD_AFTER_S)
    failed_at, message = _failure(c, "worker0")
    took = failed_at - stopped
    print(f"server1 stalled: worker0 failed {took:.2f} s after the SIGSTOP")
    assert DEAD_AFTER_S - 0.5 < took < DEAD_AFTER_S + HEARTBEAT_S + 1.0, message
    assert re.search(r"server1 at tcp://127\.0\.0\.1:\d+ is dead: no heartbeat for", message), message
    assert "did not answer" not in message  # the pending call was failed, not timed out
    assert c.exit_code("worker0", 10) == 1
    assert c.exit_code("server0", 15) == 1, c.log("server0")  # the job did not finish
    assert "server1 at tcp://" in c.log("server0")
    assert c.exit_code("server1", 3 * DEAD_AFTER_S) == 1, c.log("server1")  # dead, and it learns it on resume


@pytest.mark.e2e
@pytest.mark.slow
def test_stalled_coordinator_is_detected_by_everyone_naming_server0(cluster):
    c = cluster(servers=2, workers=1)
    stopped, resumed = c.stall("server0", 2 * DEAD_AFTER_S)
    failed_at, message = _failure(c, "worker0")
    took = failed_at - stopped
    print(f"server0 (coordinator) stalled: worker0 failed {took:.2f} s after the SIGSTOP")
    assert DEAD_AFTER_S - 0.5 < took < DEAD_AFTER_S + HEARTBEAT_S + 1.0, message
    assert re.search(r"server0 at tcp://127\.0\.0\.1:\d+ \(its coordinator at tcp://[\d.:]+\) is dead or stalled", message)
    assert c.exit_code("worker0", 10) == 1
    assert c.exit_code("server1", 10) == 1, c.log("server1")
    assert "server0 at tcp://" in c.log("server1")
    # Back from its stall, server0 forgives the silence its own pause caused; then the peers that
    # really left it are dead a lease later, and it exits non-zero.
    assert c.exit_code("server0", 3 * DEAD_AFTER_S) == 1, c.log("server0")
    exited = time.time()
    log0 = c.log("server0")
    assert re.search(r"coordinator: this process was stalled for (9|1\d)\.\d s", log0), log0
    assert exited - resumed > DEAD_AFTER_S, log0  # no one declared dead on the first tick back


@pytest.mark.e2e
@pytest.mark.slow
def test_stalled_worker_fails_the_others_naming_it_and_itself_on_resume(cluster):
    c = cluster(servers=1, workers=2)
    stopped, resumed = c.stall("worker1", 2 * DEAD_AFTER_S)
    failed_at, message = _failure(c, "worker0")
    took = failed_at - stopped
    print(f"worker1 stalled: worker0 failed {took:.2f} s after the SIGSTOP")
    assert took < DEAD_AFTER_S + HEARTBEAT_S + 1.0, message
    assert "worker1 is dead: no heartbeat for" in message, message
    assert c.exit_code("server0", 10) == 1, c.log("server0")
    assert c.exit_code("worker1", 3 * DEAD_AFTER_S) == 1, c.log("worker1")
    heard_at, own = _failure(c, "worker1")  # when worker1 itself failed, not when this test got to look
    assert heard_at - resumed < DEAD_AFTER_S + HEARTBEAT_S + 5.0, own


# ---------------------------------------------------------------------------------- in-process


def test_a_peer_declared_dead_is_told_so_on_its_next_heartbeat():
    # dead_after_s 2: the heartbeating server client must not starve that long on a busy machine
    with Coordinator(num_servers=1, num_workers=1, token=TOKEN, dead_after_s=2.0, heartbeat_s=0.1) as coord:
        server = CoordinatorClient(coord.endpoint, TOKEN)
        server.register("server", 0, "tcp://127.0.0.1:7000")
        worker = CoordinatorClient(coord.endpoint, TOKEN)
        worker.register("worker", 0, heartbeats=False)  # silent: a stalled process
        heard = []
        worker.on_failure(lambda names, error: heard.append((names, str(error))))
        wait_until(lambda: server.failure is not None, 15.0, "server0 to hear worker0 is dead")
        assert server.failed_peers == ("worker0",) and "worker0 is dead: no heartbeat" in str(server.failure)
        worker.start_heartbeats()  # it resumes
        wait_until(lambda: heard, 10.0, "worker0's first heartbeat reply telling it was declared dead")
        assert heard and heard[0][0] == ("worker0",)
        assert heard[0][1].startswith("worker0 was declared dead by the coordinator (no heartbeat for")
        with pytest.raises(PSError, match="worker0 was declared dead"):  # and its coordinator calls fail at once
            worker.barrier("late", timeout_s=30.0)
        for link in (server, worker):
            link.close()


def test_fail_server_fails_a_request_in_flight_at_once_and_every_later_one():
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # receives, never replies: a stalled server
    silent.linger = 0
    security.secure_server_socket(silent, curve_keys(TOKEN))
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    client = TransportClient([f"tcp://127.0.0.1:{port}"], token=TOKEN, timeout_s=REQUEST_TIMEOUT_S)
    try:
        handle = client.request(0, "pull", "emb", [torch.arange(8)])
        error = PSError("server0 at tcp://127.0.0.1:1 is dead: no heartbeat for 5.1 s")
        threading.Timer(0.3, client.fail_server, (0, error)).start()
        start = time.monotonic()
        with pytest.raises(PSError) as info:
            handle.wait()
        assert info.value is error
        assert 0.25 < time.monotonic() - start < 0.6
        with pytest.raises(PSError, match="server0 at tcp://127.0.0.1:1 is dead"):
            client.request(0, "pull", "emb", [torch.arange(8)])
        assert client.failed(0) is error
    finally:
        client.close()
        silent.close()
        ctx.term()


# ------------------------------------------------------------------------- under recps.launch


@pytest.mark.e2e
@pytest.mark.slow
def test_launched_run_fails_naming_the_stalled_server0_soon_after_the_stall(tmp_path, launch_output):
    """`python -m recps.train` (its recps.launch cluster), cluster.restarts left at none: server0 (the
    coordinator) SIGSTOPped for 2 x dead_after_s; the run fails within dead_after_s + 5 s of the
    stall's end, its error naming server0."""
    cmd = [sys.executable, "-m", "recps.train", "model=ctr_dnn", "model.hidden=[16,8]", "ps=async", "cluster.workers=2",
           "trainer.epochs=100000", "trainer.batch_size=16", f"cluster.dead_after_s={DEAD_AFTER_S}",
           f"dataset.dir={tmp_path / 'data'}", "dataset.generate.train_rows=2000", "dataset.generate.test_rows=500",
           "dataset.generate.vocab=1000", f"hydra.run.dir={tmp_path / 'run'}"]
    pids: dict[str, int] = {}
    lines: list[str] = []
    with job_process(cmd) as proc:  # its process group killed at the end, whatever ends the block
        joined = launch_output(proc, r"\[(worker\d)\].*async mode", lines, pids, time.monotonic() + 120, count=2)
        assert joined == {"worker0", "worker1"}, "".join(lines[-40:])
        time.sleep(2 * HEARTBEAT_S)
        os.kill(pids["server0"], signal.SIGSTOP)
        time.sleep(2 * DEAD_AFTER_S)
        with contextlib.suppress(ProcessLookupError):  # the launcher may have killed it already
            os.kill(pids["server0"], signal.SIGCONT)
        resumed = time.monotonic()
        rest, _ = proc.communicate(timeout=60)
        took = time.monotonic() - resumed
        lines.append(rest)
    out = "".join(lines)
    print(f"server0 stalled under recps.launch: the run ended {took:.1f} s after the stall's end")
    assert proc.returncode != 0
    assert took < DEAD_AFTER_S + 5.0, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("recps.train: LaunchError: worker"), out[-3000:]
    assert re.search(r"server0 at tcp://127\.0\.0\.1:\d+ \(its coordinator at tcp://[\d.:]+\) is dead or stalled", last), last
