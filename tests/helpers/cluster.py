"""Every shape of PS cluster the tests start, in one place.

- `ps_servers(n, token)`: n PSServers on threads of this process (every mode's server half) and a
  PSClient to them; the `ps_cluster` fixture (tests/conftest.py).
- `run_in_process(cfg, out_dir)`: a PS job's server 0 on a thread and worker 0 here, as
  `cluster=local`'s processes run them (the `in_process_cluster` fixture).
- `servers_and_workers(work)`: one server node and two worker clients on threads (metric mergers).
- `RoleProcesses`: S servers (`python -m recps.ps`) and W workers started as torchrun / Kubernetes
  would (each with its role's environment, nobody watching them), for liveness and SIGTERM tests.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["ps_servers", "run_in_process", "servers_and_workers", "RoleProcesses", "LIVENESS_WORKER",
           "CLUSTER_TIMEOUT_S", "LIVENESS_TOKEN", "DEAD_AFTER_S", "HEARTBEAT_S", "REQUEST_TIMEOUT_S", "role_processes"]

CLUSTER_TIMEOUT_S = 300
START_TIMEOUT_S = 180.0  # a role process up and joined (imports torch; slow on a crowded machine)

# RoleProcesses' settings (the liveness and SIGTERM tests' timings are stated in them)
LIVENESS_TOKEN = "liveness-token"
DEAD_AFTER_S = 5.0  # heartbeat_s = 1.0
HEARTBEAT_S = DEAD_AFTER_S / 5
REQUEST_TIMEOUT_S = 60.0  # a pull or push must never wait this long for a dead server


@contextlib.contextmanager
def ps_servers(num_servers: int = 1, token: str = "test") -> Iterator[tuple[list, object]]:
    """`num_servers` PSServers on threads of this process (every mode's server half) and a PSClient
    to them: yields (servers, client); every server stopped at the end."""
    from recps.ps.modes import server_halves
    from recps.ps.node.client import PSClient
    from recps.ps.node.server import PSServer

    servers = [PSServer(index=i, num_servers=num_servers, token=token, halves=server_halves()).start()
               for i in range(num_servers)]
    try:
        with PSClient([s.endpoint for s in servers], token=token) as client:
            yield servers, client
    finally:
        for s in servers:
            s.stop()


def run_in_process(cfg, out_dir: Path, token: str = "in-process", **worker_kwargs) -> dict:
    """ps=sync|async|geo with one server and one worker: server 0 on a thread, worker 0 here, as
    `cluster=local`'s processes run them (recps.cluster.driver.run_role). `worker_kwargs` go to the
    worker's run_role (data=, observers=). Returns worker 0's metrics."""
    from recps.cluster.driver import run_role
    from recps.cluster.launch import free_port
    from recps.ps.roles import UserDefinedRoleMaker

    address = f"127.0.0.1:{free_port()}"
    server, worker = (UserDefinedRoleMaker(kind, 0, 1, 1, coordinator=address, token=token).role()
                      for kind in ("server", "worker"))
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            run_role(cfg, server, out_dir)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    thread = threading.Thread(target=serve, name="server0", daemon=True)
    thread.start()
    try:
        metrics = run_role(cfg, worker, out_dir, **worker_kwargs)
    finally:
        thread.join(CLUSTER_TIMEOUT_S)  # worker 0 stops the server when it leaves
    assert not thread.is_alive(), "server 0 did not stop after worker 0 left"
    assert not errors, errors
    return metrics


def servers_and_workers(work) -> None:
    """One real server node and two worker clients on threads; work(rank, client)."""
    from recps.cluster.launch import free_port
    from recps.ps.modes import server_halves
    from recps.ps.node import ServerNode, connect
    from recps.ps.roles import UserDefinedRoleMaker

    address = f"127.0.0.1:{free_port()}"
    role = lambda kind, i: UserDefinedRoleMaker(kind, i, 1, 2, coordinator=address, token="t").role()  # noqa: E731
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            with connect(role("worker", rank), timeout_s=60.0) as client:
                work(rank, client)
                client.barrier("done", timeout=60.0)  # nobody deregisters while the other still merges
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    with ServerNode(role("server", 0), halves=server_halves()).start():
        workers = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=180)
    assert not errors, errors
    assert all(not w.is_alive() for w in workers)


# A worker as a user's script would be (connect + pull/push), reporting what happened on stdout.
LIVENESS_WORKER = r"""
import os, sys, time, torch
from recps.errors import PSError
from recps.ps.node import connect
from recps.ps.roles import detect_role_maker

role = detect_role_maker().role()
client = connect(role, timeout_s=60.0, request_timeout_s=float(sys.argv[1]))
client.create_sparse_table("emb", dim=4, optimizer={"name": "sgd", "lr": 0.1}, initializer={"kind": "zeros"})
print("JOINED", flush=True)
steps = 0
gen = torch.Generator().manual_seed(role.index)
try:
    while not os.path.exists(sys.argv[2]):
        keys = torch.randint(0, 1000, (256,), generator=gen)
        client.push("emb", keys, torch.ones(256, 4)).wait()
        rows = client.pull("emb", keys).wait()
        steps += 1
        time.sleep(0.005)
    client.barrier("end", timeout=60.0)
    if role.index == 0:
        client.stop_servers(timeout=10.0)
    print(f"DONE {steps}", flush=True)
except PSError as e:
    print(f"FAILED {time.time():.3f} {type(e).__name__}: {e}", flush=True)
    client.close()
    sys.exit(1)
client.close()
"""


class RoleProcesses:
    """S servers (python -m recps.ps) and W workers (LIVENESS_WORKER) started with their role's
    variables; each one's output in folder/NAME.log."""

    def __init__(self, folder: Path, servers: int, workers: int, token: str = LIVENESS_TOKEN,
                 dead_after_s: float = DEAD_AFTER_S, request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        from recps.cluster.launch import free_port
        from recps.ps.roles import UserDefinedRoleMaker

        self.folder = folder
        self.stop_file = folder / "finish"
        coordinator = f"127.0.0.1:{free_port()}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.procs: dict[str, subprocess.Popen] = {}
        for kind, count in (("server", servers), ("worker", workers)):
            for i in range(count):
                role = UserDefinedRoleMaker(kind, i, servers, workers, coordinator=coordinator, token=token).role()
                cmd = ([sys.executable, "-m", "recps.ps", "--dead-after", str(dead_after_s), "--threads", "1"]
                       if kind == "server" else
                       [sys.executable, "-c", LIVENESS_WORKER, str(request_timeout_s), str(self.stop_file)])
                log = open(folder / f"{role.name}.log", "wb")
                self.procs[role.name] = subprocess.Popen(cmd, env={**env, **role.to_env()}, stdout=log,
                                                         stderr=subprocess.STDOUT, start_new_session=True)
                log.close()

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def wait_for(self, name: str, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if m := re.search(pattern, self.log(name)):
                return m
            if self.procs[name].poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{name} never logged {pattern!r} within {timeout} s:\n{self.log(name)[-3000:]}")

    def exit_code(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still runs after {timeout} s:\n{self.log(name)[-3000:]}") from None

    def stall(self, name: str, seconds: float) -> tuple[float, float]:
        """SIGSTOP `name` for `seconds`; returns the wall-clock times of the stop and the resume."""
        pid = self.procs[name].pid
        stopped = time.time()
        os.kill(pid, signal.SIGSTOP)
        time.sleep(seconds)
        resumed = time.time()
        os.kill(pid, signal.SIGCONT)
        return stopped, resumed

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


@contextlib.contextmanager
def role_processes(folder: Path) -> Iterator:
    """`make(servers, workers) -> RoleProcesses` with every worker joined (and every peer's heartbeat
    since); every process killed when the block ends."""
    made: list[RoleProcesses] = []

    def make(servers: int, workers: int) -> RoleProcesses:
        c = RoleProcesses(folder, servers, workers)
        made.append(c)
        for w in range(workers):  # a bound, not an expectation: at load 17 a worker printed nothing in its first 40 s
            c.wait_for(f"worker{w}", "JOINED", START_TIMEOUT_S)
        time.sleep(2 * HEARTBEAT_S)  # every peer heartbeat since all joined; requests are in flight all the time
        return c

    try:
        yield make
    finally:
        for c in made:
            c.kill_all()
