"""Suite-wide fixtures: `hdfs`, a real Apache Hadoop 2.7.3 HDFS on 127.0.0.1 (tests/hdfs/); the PS
clusters of tests/helpers/cluster.py: `in_process_cluster` (a PS job's server 0 and worker 0 in this
process), `ps_cluster` (servers on threads and a client); `launch_output`; and `device` ("cpu", "cuda"). Helpers that are not fixtures
live in tests/helpers/ (`from tests.helpers.cli import recps_train`, ...); no test imports another.

The `e2e` marker: every test that starts a process (a CLI run, a cluster of processes, HDFS,
torchrun, mpirun) carries it; `make test-fast` runs the others (-m "not e2e")."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# The checkout first on sys.path: `tests.helpers` (the suite's shared helpers, tests/helpers/) imports
# as a namespace package whatever the cwd, and under the name the processes tests start use for it
# (task._target_=tests.helpers.counting.CountingTask).
_CHECKOUT = str(Path(__file__).resolve().parents[1])
if _CHECKOUT not in sys.path:
    sys.path.insert(0, _CHECKOUT)

from tests.helpers.cli import follow_launch  # noqa: E402 - after the sys.path entry above
from tests.helpers.cluster import ps_servers, run_in_process  # noqa: E402
from tests.helpers.schedule import LongestFirstLoadFile, unit_seconds  # noqa: E402

# ------------------------------------------------------------------------------ scheduling

_TEST_SECONDS: dict[str, float] = {}
_SKIPPED: set[str] = set()


def pytest_addoption(parser):
    parser.addoption("--record-durations", metavar="PATH", default=None,
                     help="write this run's seconds per scheduling unit (tests/helpers/schedule.py) to PATH, "
                          "as tests/durations.json holds them")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile sends the longest files first (tests/helpers/schedule.py); other modes are xdist's."""
    if config.getvalue("dist") == "loadfile":
        return LongestFirstLoadFile(config, log)
    return None


def pytest_configure(config):
    """An xdist worker uses its share of the cores for torch's intra-op threads (2 cores, 2 workers:
    1 each). With torch's default (every core in each worker) the two workers' OpenMP teams contend
    for the same cores: measured, a 2-second Trainer.fit test took 10-14 s beside a busy 2-thread
    process, 2.5 s with 1 thread. Processes a test starts set their own thread counts."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):  # a skip's seconds say nothing of the test's run
        _SKIPPED.add(report.nodeid)
        return
    _TEST_SECONDS[report.nodeid] = _TEST_SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    path = session.config.getoption("record_durations", None)
    if path and not hasattr(session.config, "workerinput"):  # the controller: every worker's reports
        ran = {nodeid: s for nodeid, s in _TEST_SECONDS.items() if nodeid not in _SKIPPED}
        Path(path).write_text(json.dumps(unit_seconds(ran), indent=0) + "\n")

# ------------------------------------------------------------------------------------ e2e

_SPAWNED: list[str] = []
_PROCESS_FIXTURES = {"hdfs", "private_hdfs", "launch_output"}
_SAVED_STARTS = pytest.StashKey[list]()


# Library probes that are not a test starting a process: ctypes.util.find_library runs
# `/sbin/ldconfig -p` (when recps.ps.table._memory is first imported).
_PROBES = {"ldconfig", "gcc", "cc", "ld", "objdump", "uname", "lscpu"}  # and what find_library or platform may run


def _noting(what: str, start):
    def spawn(*args, **kwargs):
        argv = args[0] if args and isinstance(args[0], (list, tuple)) else ()
        program = os.path.basename(os.fsdecode(argv[0])) if argv else ""
        if program not in _PROBES:
            _SPAWNED.append(what if not program else f"{what}: {program}")
        return start(*args, **kwargs)
    return spawn


def _watch_spawns() -> list[tuple[object, str, object]]:
    """Note every process this test process starts (subprocess and multiprocessing both end in one
    of these) while a test not marked e2e runs; returns what to restore."""
    import _posixsubprocess

    patched = [(subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"), (os, "fork"), (os, "posix_spawn"),
               (os, "posix_spawnp")]
    saved = [(mod, name, getattr(mod, name)) for mod, name in patched if hasattr(mod, name)]
    for mod, name, start in saved:
        setattr(mod, name, _noting(f"{getattr(mod, '__name__', mod)}.{name}", start))
    return saved


def pytest_collection_modifyitems(config, items):
    """A test marked slow (an end-to-end run: a whole job trained, a quality figure) is e2e as well,
    whether it starts a process or runs its cluster on threads: make test-fast skips it too."""
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.e2e)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("e2e") is None:
        item.stash[_SAVED_STARTS] = _watch_spawns()
        _SPAWNED.clear()
        used = _PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if used:
            pytest.fail(f"{item.nodeid} uses {', '.join(sorted(used))} (processes): mark it e2e", pytrace=False)
    return (yield)


def _stop_watching(item) -> list[str]:
    """Restore what _watch_spawns patched; returns what `item` started meanwhile."""
    saved = item.stash.get(_SAVED_STARTS, None)
    if saved is None:
        return []
    del item.stash[_SAVED_STARTS]
    for mod, name, start in saved:
        setattr(mod, name, start)
    spawned, _SPAWNED[:] = sorted(set(_SPAWNED)), []
    return spawned


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    # The last test of a module (or of the run) also tears down module- and session-scoped fixtures, which
    # an earlier e2e test may have used (the session's HDFS is stopped by a script): not this test's processes.
    spawned = _stop_watching(item) if nextitem is None or nextitem.path != item.path else []  # (doctests: no .module)
    try:
        return (yield)
    finally:
        spawned += _stop_watching(item)
        if spawned:
            pytest.fail(f"{item.nodeid} started a process ({', '.join(spawned)}) but is not marked e2e: "
                        "add @pytest.mark.e2e (make test-fast runs -m 'not e2e')", pytrace=False)


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


@pytest.fixture(autouse=True)
def _launcher_preparation_in_process(request, monkeypatch):
    """A test that starts no process (not marked e2e) stays one: a launcher it drives in-process (its
    bad-input checks) prepares its data in this process, not in a child forked for it
    (recps.cluster.launch.run_in_fork forks only where that is safe, which depends on the threads earlier
    tests left, so it would fork in one run and not in the next)."""
    if request.node.get_closest_marker("e2e") is None:
        monkeypatch.setenv("RECPS_LAUNCH_FORK", "0")


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


@pytest.fixture
def in_process_cluster() -> Callable[..., dict]:
    """`run(cfg, out_dir, token=..., data=..., observers=[...]) -> metrics` (tests.helpers.cluster.run_in_process)."""
    return run_in_process


@pytest.fixture
def ps_cluster() -> Callable[..., contextlib.AbstractContextManager]:
    """`with ps_cluster(num_servers, token) as (servers, client):` servers in this process
    (tests.helpers.cluster.ps_servers)."""
    return ps_servers


@pytest.fixture
def launch_output() -> Callable[..., set[str]]:
    """follow_launch (tests.helpers.cli), for tests that read a launched job's output as it runs."""
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
