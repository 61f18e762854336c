"""Issue 33.1: a frame injected into a live CURVE connection costs a reconnect, not the job.

An attacker on the path (tests.helpers.onpath.OnPathProxy, a TCP proxy on 127.0.0.1) sends one
already-delivered frame again ("replay": its nonce is spent) or one forged frame with a higher nonce
("forge": its box does not open) into a client -> server stream past its handshake. libzmq 4.3.5
then stops reading that connection without closing it; the ZMTP heartbeats drop it within
HEARTBEAT_TIMEOUT_S + HEARTBEAT_IVL_S (was: never), the server counts it ("handshake"), ZeroMQ
reconnects, and the client resends what was in flight, which the server runs at most once.

- transport: pushes that add to a counter, through a proxy that replays then forges: every push
  counted exactly once, none fails, both connections dropped by the server and counted;
- transport: a REQUEST_ONCE resent after it ran gets its first reply, its handler ran once;
- e2e, `python -m recps.train` as a server0 process and a worker0 process whose links to server 0
  and to the coordinator go through a proxy each (a replay and a forge on each link): both exit 0,
  every injected connection is dropped by the server and counted, the worker resends, and every
  row of the counting model equals its key's occurrences.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import pytest
import torch
import zmq

from recps.cluster.launch import free_port
from recps.ps.roles import UserDefinedRoleMaker
from recps.ps.transport import TransportClient, TransportServer, security, wire
from tests.helpers.cli import child_env, output_excerpt
from tests.helpers.onpath import ONPATH_ENV, OnPathProxy
from tests.helpers.threads import wait_until

pytestmark = pytest.mark.timeout(600)

TOKEN = "injection-test-token"
DROP_S = security.HEARTBEAT_IVL_S + security.HEARTBEAT_TIMEOUT_S  # an unread connection is dropped within this
BOUND_S = 4 * DROP_S + 10.0  # a bound for one drop on a crowded machine, not an expectation


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _dropped_by_server(proxy: OnPathProxy, timeout: float) -> list[int]:
    """The connections that had an injection, each waited for until the server closed it."""
    injected = [int(m.group(1)) for e in proxy.events if (m := re.search(r"inject (\d+)", e))]
    for n in injected:
        proxy.wait_for(rf"closed {n} by server", timeout)
    return injected


def test_injected_frames_cost_a_reconnect_and_every_push_counts_once():
    """Pushes that add their value to a counter (not idempotent), through a proxy that replays one
    frame on the first busy connection and forges one on the next: all 200 pushes answer, the counter
    is their exact sum, the server dropped both connections and counted two "handshake" rejections."""
    total = {"sum": 0}
    lock = threading.Lock()

    def add(verb, table, fields, meta):
        with lock:
            total["sum"] += int(fields[0].sum())
            return [torch.tensor([total["sum"]])]

    server = TransportServer(add, token=TOKEN).start()
    proxy = OnPathProxy(("127.0.0.1", _port(server.endpoint)), ["replay", "forge"], after=40)
    client = TransportClient([proxy.endpoint], token=TOKEN, timeout_s=BOUND_S)
    try:
        for i in range(1, 201):
            client.call(0, "push", "counter", [torch.tensor([i])])
            if i == 100:  # the second injection lands on the reconnected connection's traffic
                proxy.wait_for("inject .* replay", BOUND_S)
        proxy.wait_for("inject .* forge", BOUND_S)
        client.call(0, "push", "counter", [torch.tensor([0])])  # answered after both drops
        assert total["sum"] == 200 * 201 // 2
        assert len(_dropped_by_server(proxy, BOUND_S)) == 2
        wait_until(lambda: server.rejections.get("handshake", 0) >= 2, BOUND_S, "two handshake rejections counted")
        assert server.rejections == {"handshake": 2}
        assert client.resends >= 1  # what was in flight on a dropped connection was sent again
        assert server.resends <= client.resends
    finally:
        client.close()
        proxy.close()
        server.stop()


def test_a_request_resent_after_it_ran_gets_its_first_reply():
    """The same REQUEST_ONCE (same request id) sent twice, as a client resends it on a new connection:
    the handler runs once and both answers are its reply; a plain REQUEST (a read) runs again."""
    calls = {"n": 0}

    def count(verb, table, fields, meta):
        calls["n"] += 1
        return [torch.tensor([calls["n"]])]

    server = TransportServer(count, token=TOKEN, curve=False).start()
    ctx = zmq.Context()
    try:
        answers = {}
        for kind in (wire.REQUEST_ONCE, wire.REQUEST):
            frames = wire.encode(kind, 77 + kind, verb="push", text="t", token_digest=wire.token_digest(TOKEN))
            for attempt in range(2):
                sock = ctx.socket(zmq.DEALER)  # a new connection each time, as after a drop
                sock.linger = 0
                sock.connect(server.endpoint)
                sock.send_multipart(frames)
                assert sock.poll(10_000), "no answer within 10 s"
                answers[kind, attempt] = wire.decode(sock.recv_multipart()).tensors[0].tolist()
                sock.close()
        assert answers[wire.REQUEST_ONCE, 0] == answers[wire.REQUEST_ONCE, 1] == [1]
        assert (answers[wire.REQUEST, 0], answers[wire.REQUEST, 1]) == ([2], [3])
        assert calls["n"] == 3 and server.resends == 1
    finally:
        ctx.destroy(linger=0)
        server.stop()


def test_the_at_most_once_log_waits_answers_again_and_forgets_in_bounds():
    """A resend of a running request waits for its reply, of an ended one gets it; an ended entry is
    forgotten after retain_s, or earlier (counted) beyond max_entries, a running one never."""
    from recps.ps.transport.server import ONCE_REPLY_BYTES, _OnceLog

    clock = {"now": 0.0}
    log = _OnceLog(retain_s=10.0, max_entries=3, clock=lambda: clock["now"])
    assert log.begin(1, b"a") == (True, None)
    assert log.begin(1, b"b") == (False, None)  # running: b waits
    reply = wire.encode(wire.REPLY, 1)
    assert log.end(1, reply) == [b"b"]
    assert log.begin(1, b"c") == (False, reply) and log.resends == 2
    big = wire.encode(wire.REPLY, 2, tensors=[torch.zeros(ONCE_REPLY_BYTES // 4 + 1)])
    log.begin(2, b"a")
    log.end(2, big)
    (kept,) = log.begin(2, b"d")[1]  # too large to keep: an error that says it ran
    assert "ran already" in wire.decode([kept]).text
    log.begin(3, b"a")  # running
    log.begin(4, b"a")  # the 4th entry: the oldest ended one (1) goes early
    assert log.forgotten_early == 1
    assert log.begin(1, b"e") == (True, None)  # (a resend would run again: the price of the bound)
    log.end(4, reply)
    clock["now"] = 11.0  # retain_s passed: 4 (ended) goes, 3 and 1 (running) stay
    assert log.begin(5, b"a") == (True, None)
    assert log.begin(4, b"f") == (True, None)
    assert log.begin(3, b"g") == (False, None)


# ------------------------------------------------------------------------------------------- a job


def _handshake_counts(log: str, port: int) -> int:
    """The "handshake" rejections a server on `port` logged (its RejectionLog lines, summed)."""
    lines = re.findall(rf"server tcp://127\.0\.0\.1:{port}: rejected \d+ .*?\(([^)]*)\); last", log)
    return sum(int(m.group(1)) for line in lines if (m := re.search(r"handshake: (\d+)", line)))


@pytest.mark.e2e
def test_a_job_survives_frames_injected_into_its_links_to_a_server_and_the_coordinator(tmp_path):
    from recps.config import compose_config
    from recps.job.build import prepare_dataset
    from tests.helpers.counting import COUNTING_TASK, assert_exact_counts

    overrides = ["model=lr", f"task._target_={COUNTING_TASK}", "ps=async", "ps.table.init_std=0",
                 "ps.table.optimizer.name=sgd", "ps.table.optimizer.lr=1", "metrics=off", "progress=false",
                 "trainer.threads=1", "cluster.workers=1", "trainer.batch_size=16", "cluster.dead_after_s=10",
                 f"dataset.dir={tmp_path / 'data'}", "dataset.generate.train_rows=16000", "dataset.generate.test_rows=500",
                 "dataset.generate.vocab=500"]
    cfg = compose_config(overrides)
    prepare_dataset(cfg.dataset, seed=int(cfg.seed))  # a cluster of processes does not generate it
    run = tmp_path / "run"
    coordinator, server_port = free_port(), free_port()
    ps_proxy = OnPathProxy(("127.0.0.1", server_port), ["replay", "forge"], after=150)
    coordinator_proxy = OnPathProxy(("127.0.0.1", coordinator), ["replay", "forge"], after=6)
    routes = (f"tcp://127.0.0.1:{server_port}={ps_proxy.endpoint},"
              f"tcp://127.0.0.1:{coordinator}={coordinator_proxy.endpoint}")
    procs: dict[str, subprocess.Popen] = {}
    try:
        for kind in ("server", "worker"):
            role = UserDefinedRoleMaker(kind, 0, 1, 1, coordinator=f"127.0.0.1:{coordinator}", token=TOKEN,
                                        server_endpoints=[f"127.0.0.1:{server_port}"]).role()
            module = ["recps.train"] if kind == "server" else ["tests.helpers.onpath", "recps.train"]
            log = open(tmp_path / f"{role.name}.log", "wb")
            procs[role.name] = subprocess.Popen(
                [sys.executable, "-m", *module, *overrides, f"hydra.run.dir={run}"],
                env=child_env({**role.to_env(), ONPATH_ENV: routes, "PYTHONUNBUFFERED": "1"}),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
        codes = {name: p.wait(timeout=400) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(10)
        ps_proxy.close()
        coordinator_proxy.close()
    logs = {name: (tmp_path / f"{name}.log").read_text(errors="replace") for name in procs}
    assert codes == {"server0": 0, "worker0": 0}, {n: output_excerpt(logs[n].splitlines(keepends=True)) for n in procs}
    for proxy in (ps_proxy, coordinator_proxy):  # each link: a replay and a forge, each connection dropped
        assert [a for e in proxy.events for a in re.findall(r"inject \d+ (\w+)", e)] == ["replay", "forge"], proxy.events
        assert len(_dropped_by_server(proxy, 0.1)) == 2, proxy.events
    assert _handshake_counts(logs["server0"], server_port) >= 2, output_excerpt(logs["server0"].splitlines(keepends=True))
    assert _handshake_counts(logs["server0"], coordinator) >= 2, output_excerpt(logs["server0"].splitlines(keepends=True))
    assert re.search(r"server0 at \S+: the connection dropped; \d+ requests? in flight sent again", logs["worker0"])
    assert assert_exact_counts(overrides, run / "checkpoint") > 400
