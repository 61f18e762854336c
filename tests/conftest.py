"""Suite-wide fixtures: `hdfs`, a real Apache Hadoop 2.7.3 HDFS on 127.0.0.1 (tests/hdfs/), and
`in_process_cluster`, a PS job's server 0 and worker 0 in this process, and `device` ("cpu", "cuda")."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_HDFS_SCRIPTS = Path(__file__).resolve().parent / "hdfs"
# start_hdfs.sh waits at most RECPS_HDFS_TIMEOUT (120 s) for the cluster and 480 s for the
# one-time jar download; this bound stays under the suite's 600 s pytest-timeout.
_START_TIMEOUT_S = 570
_STOP_TIMEOUT_S = 60
_ADMIN_TIMEOUT_S = 60


@dataclasses.dataclass(frozen=True)
class HdfsCluster:
    """A running one-NameNode, one-DataNode HDFS started by tests/hdfs/start_hdfs.sh."""

    host: str
    rpc_port: int
    http_port: int
    work_dir: Path
    info: dict  # start_hdfs.sh's cluster.json: pids, logs, startup_s, ...

    @property
    def url(self) -> str:
        return f"hdfs://{self.host}:{self.rpc_port}"

    @property
    def webhdfs_url(self) -> str:
        return f"webhdfs://{self.host}:{self.http_port}"

    def admin(self, *args: str) -> str:
        """`hdfs dfsadmin ARGS` (Hadoop's DFSAdmin on the cluster's classpath): -safemode enter,
        -setSpaceQuota 2m /path, ...; returns its output, fails the test on an error exit."""
        proc = subprocess.run([self.info["java"], "-Xmx128m", "-cp", self.info["classpath"],
                               "org.apache.hadoop.hdfs.tools.DFSAdmin", "-fs", self.url, *args],
                              capture_output=True, text=True, timeout=_ADMIN_TIMEOUT_S, check=False)
        if proc.returncode != 0:
            pytest.fail(f"dfsadmin {' '.join(args)} failed (exit {proc.returncode}): {proc.stderr[-2000:]}",
                        pytrace=False)
        return proc.stdout


def _stop(work_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(_HDFS_SCRIPTS / "stop_hdfs.sh"), str(work_dir)],
        capture_output=True,
        text=True,
        timeout=_STOP_TIMEOUT_S,
        check=False,
    )


@contextlib.contextmanager
def started_hdfs(work_dir: Path) -> Iterator[HdfsCluster]:
    """A new HDFS in `work_dir`, stopped (by pid) when the block ends. Where Java, Jersey or the
    Hadoop jars cannot be had it skips with the reason, or fails with it when RECPS_REQUIRE_HDFS=1
    (CI). A cluster that does not come up fails either way."""
    env = dict(os.environ, PYTHON=sys.executable, RECPS_HDFS_WATCH_PID=str(os.getpid()))
    try:
        proc = subprocess.run(
            ["bash", str(_HDFS_SCRIPTS / "start_hdfs.sh"), str(work_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=_START_TIMEOUT_S,
        )
    except BaseException:  # a timeout or an interrupt mid-start: stop what was started
        _stop(work_dir)
        raise
    if proc.returncode == 3:
        lines = proc.stderr.strip().splitlines() or ["start_hdfs.sh: exit 3"]
        reason = lines[-1]
        if os.environ.get("RECPS_REQUIRE_HDFS") == "1":
            pytest.fail(f"RECPS_REQUIRE_HDFS=1 and {reason}", pytrace=False)
        pytest.skip(reason)
    if proc.returncode != 0:
        _stop(work_dir)
        pytest.fail(
            f"tests/hdfs/start_hdfs.sh {work_dir} failed (exit {proc.returncode}):\n{proc.stderr}",
            pytrace=False,
        )
    try:
        info = json.loads((work_dir / "cluster.json").read_text())
        cluster = HdfsCluster(
            host=info["host"],
            rpc_port=info["rpc_port"],
            http_port=info["http_port"],
            work_dir=work_dir,
            info=info,
        )
    except BaseException:
        _stop(work_dir)
        raise
    try:
        yield cluster
    finally:
        stopped = _stop(work_dir)
    if stopped.returncode != 0:
        raise RuntimeError(f"stop_hdfs.sh {work_dir} failed: {stopped.stderr}")


@pytest.fixture(scope="session")
def hdfs(tmp_path_factory) -> Iterator[HdfsCluster]:
    """One HDFS for the whole test run (see started_hdfs)."""
    with started_hdfs(tmp_path_factory.mktemp("hdfs")) as cluster:
        yield cluster


@pytest.fixture
def private_hdfs(tmp_path_factory) -> Iterator[HdfsCluster]:
    """An HDFS of the test's own, for a test that stops, stalls or breaks it."""
    with started_hdfs(tmp_path_factory.mktemp("private-hdfs")) as cluster:
        yield cluster


_CLUSTER_TIMEOUT_S = 300


def _run_in_process(cfg, out_dir: Path, token: str = "in-process", **worker_kwargs) -> dict:
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
        thread.join(_CLUSTER_TIMEOUT_S)  # worker 0 stops the server when it leaves
    assert not thread.is_alive(), "server 0 did not stop after worker 0 left"
    assert not errors, errors
    return metrics


@pytest.fixture
def in_process_cluster() -> Callable[..., dict]:
    """`run(cfg, out_dir, token=..., data=..., observers=[...]) -> metrics` (see _run_in_process)."""
    return _run_in_process


@contextlib.contextmanager
def _ps_cluster(num_servers: int, token: str):
    """`num_servers` PSServers on threads of this process (every mode's server half) and a
    PSClient to them: yields (servers, client); every server stopped at the end."""
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


@pytest.fixture
def ps_cluster() -> Callable[..., contextlib.AbstractContextManager]:
    """`with ps_cluster(num_servers, token) as (servers, client):` servers in this process."""
    return _ps_cluster


def follow_launch(proc: subprocess.Popen, pattern: str, lines: list[str], pids: dict[str, int], deadline: float,
                  count: int = 1) -> set[str]:
    """Read a launched job's output (recps.launch's) line by line into `lines` until `count`
    distinct matches of `pattern` (its first group, else the whole match) were seen, noting each
    'started NAME (pid N)' in `pids`; returns the matches. The test fails naming the pattern when
    the output ends or `deadline` (time.monotonic()) passes first."""
    import re
    import time

    seen: set[str] = set()
    while len(seen) < count and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if m := re.search(r"started (\w+) \(pid (\d+)\)", line):
            pids[m.group(1)] = int(m.group(2))
        if m := re.search(pattern, line):
            seen.add(m.group(1) if m.groups() else m.group(0))
    if len(seen) < count:
        pytest.fail(f"never saw {pattern!r} {count} time(s) (saw {sorted(seen)}):\n" + "".join(lines[-60:]))
    return seen


@pytest.fixture
def launch_output() -> Callable[..., set[str]]:
    """follow_launch, for tests that read a launched job's output as it runs."""
    return follow_launch



# ------------------------------------------------------------------------------------ device

CUDA_SKIP_REASON = "no CUDA device: torch.cuda.is_available() is False"


@pytest.fixture(params=["cpu", "cuda"])
def device(request) -> str:
    """"cpu", then "cuda": a test that takes it runs its device-dependent lines on both (issue 17:
    every such line runs on the CPU in CI). The cuda half skips, with CUDA_SKIP_REASON, only where
    torch sees no GPU; RECPS_REQUIRE_CUDA=1 (a GPU machine's run) turns that skip into a failure."""
    if request.param == "cuda":
        import torch

        if not torch.cuda.is_available():
            if os.environ.get("RECPS_REQUIRE_CUDA") == "1":
                pytest.fail(f"RECPS_REQUIRE_CUDA=1 but {CUDA_SKIP_REASON} (torch {torch.__version__}); "
                            "run the suite with .venv-gpu/bin/python on the GPU machine (make setup-gpu)")
            pytest.skip(CUDA_SKIP_REASON)
    return request.param
