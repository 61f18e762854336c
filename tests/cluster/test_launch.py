"""The launcher end to end with tiny Python children: roles, exit codes, stopping, no process left behind."""

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from recps.errors import ConfigError
from recps.cluster.launch import LaunchError, free_port, launch, main
from recps.ps.roles import EnvRoleMaker
from tests.helpers.cli import PROJECT_ROOT, child_env, run_module

pytestmark = pytest.mark.timeout(90)

# argv: out-dir mode [grandchild]. Records its RECPS_* variables and pids in out-dir/<name>.json, then
# behaves as `mode` says. Servers sleep "forever" (600 s) unless stopped: a launcher that fails to
# stop them makes the test time out.
CHILD = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    out, mode = sys.argv[1], sys.argv[2]
    role, index = os.environ["RECPS_ROLE"], int(os.environ["RECPS_INDEX"])
    name = f"{role}{index}"
    record = {k: v for k, v in os.environ.items() if k.startswith("RECPS_") or k == "EXTRA"}
    record.update(pid=os.getpid(), pgid=os.getpgid(0))
    if "grandchild" in sys.argv[3:]:
        record["grandchild"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid
    if mode == "stubborn" and role == "server":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        json.dump(record, f)
    os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name + ".json"))
    print(f"hello from {name}")
    print(f"to stderr from {name}", file=sys.stderr)

    def wait_for_everyone():  # so that every process has recorded its pids before anything ends
        names = [f"server{i}" for i in range(int(os.environ["RECPS_NUM_SERVERS"]))]
        names += [f"worker{j}" for j in range(int(os.environ["RECPS_NUM_WORKERS"]))]
        deadline = time.monotonic() + 30
        while not all(os.path.exists(os.path.join(out, f"{name}.json")) for name in names):
            if time.monotonic() > deadline:
                sys.exit(99)
            time.sleep(0.02)

    def wait_for_servers_to_exit():  # exited = gone or a zombie the launcher has not reaped yet
        n = int(os.environ["RECPS_NUM_SERVERS"])
        pids = [json.load(open(os.path.join(out, f"server{i}.json")))["pid"] for i in range(n)]
        deadline = time.monotonic() + 30
        while True:
            states = []
            for pid in pids:
                try:
                    states.append(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0])
                except FileNotFoundError:
                    states.append("Z")
            if set(states) <= {"Z", "X"}:
                return
            if time.monotonic() > deadline:
                sys.exit(98)
            time.sleep(0.02)

    if role == "server":
        if mode == "server_fails" and index == 1:
            sys.exit(5)
        if mode == "server_exits_0":
            sys.exit(0)
        if mode == "server_stops_itself":
            os.kill(os.getpid(), signal.SIGSTOP)  # stalled: only SIGCONT (or SIGKILL) moves it on
        time.sleep(600)
    else:
        wait_for_everyone()
        if mode == "server_stops_itself":  # fail once the server stands stopped
            pid = json.load(open(os.path.join(out, "server0.json")))["pid"]
            deadline = time.monotonic() + 30
            while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
                if time.monotonic() > deadline:
                    sys.exit(97)
                time.sleep(0.02)
            sys.exit(3)
        if mode == "worker1_fails_first_start" and index == 1:
            sys.exit(3 if os.environ["RECPS_RESTART_COUNT"] == "0" else 0)
        if mode == "worker_fails" and index == 1:
            sys.exit(3)
        if mode == "server_exits_0":
            wait_for_servers_to_exit()
        if mode == "worker_killed" and index == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode in ("worker_fails", "worker_killed", "server_fails", "sleep"):
            time.sleep(600)
        sys.exit(0)
    """
)


@pytest.fixture
def child(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = tmp_path / "out"
    out.mkdir()

    def command(mode, *flags):
        return [sys.executable, str(script), str(out), mode, *flags]

    command.out = out
    return command


def records(out):
    return {path.stem: json.loads(path.read_text()) for path in sorted(out.glob("*.json"))}


def alive(pid):
    """True while `pid` runs; a zombie (exited, not yet reaped by its new parent) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def all_pids(out):
    pids = []
    for record in records(out).values():
        pids.append(record["pid"])
        if "grandchild" in record:
            pids.append(record["grandchild"])
    return pids


def assert_all_gone(pids, within=5.0):
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if alive(p)] == []


# ------------------------------------------------------------------------------------------ success


@pytest.mark.e2e
def test_every_process_gets_its_role_and_servers_are_stopped_after_workers_succeed(child):
    output = io.StringIO()
    result = launch(child("ok"), servers=2, workers=3, env={"EXTRA": "x"}, token="tok", timeout=60, grace=2, output=output)
    assert result.ok and result.exit_code == 0 and result.failed is None
    assert list(result.returncodes) == ["server0", "server1", "worker0", "worker1", "worker2"]
    assert [result.returncodes[f"worker{j}"] for j in range(3)] == [0, 0, 0]
    assert [result.returncodes[f"server{i}"] for i in range(2)] == [-signal.SIGTERM] * 2
    assert result.stopped == ("server0", "server1")
    assert result.check() is result

    seen = records(child.out)
    assert sorted(seen) == ["server0", "server1", "worker0", "worker1", "worker2"]
    host, port = result.coordinator.split(":")
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    for name, record in seen.items():
        role = EnvRoleMaker(record).role()
        assert (role.name, role.num_servers, role.num_workers) == (name, 2, 3)
        assert (role.coordinator, role.host, role.token, role.server_endpoints) == (result.coordinator, "127.0.0.1", "tok", None)
        assert record["EXTRA"] == "x"
        assert record["pid"] == result.pids[name] == record["pgid"]  # each child leads its own process group
    lines = output.getvalue().splitlines()
    for name in seen:
        assert f"[{name}] hello from {name}" in lines
        assert f"[{name}] to stderr from {name}" in lines
    assert_all_gone(all_pids(child.out), within=0)


@pytest.mark.e2e
def test_inherited_role_variables_do_not_leak_and_token_comes_from_the_environment(child, monkeypatch):
    monkeypatch.setenv("RECPS_CLUSTER_TOKEN", "from-env")
    monkeypatch.setenv("RECPS_SERVER_ENDPOINTS", "10.0.0.1:1")  # from some other cluster
    monkeypatch.setenv("RECPS_ROLE", "server")
    result = launch(child("ok"), servers=1, workers=1, timeout=60, grace=2, output=io.StringIO())
    assert result.ok
    worker = records(child.out)["worker0"]
    assert worker["RECPS_CLUSTER_TOKEN"] == "from-env"
    assert worker["RECPS_ROLE"] == "worker"
    assert "RECPS_SERVER_ENDPOINTS" not in worker


@pytest.mark.e2e
def test_random_token_when_none_is_given(child, monkeypatch):
    monkeypatch.delenv("RECPS_CLUSTER_TOKEN", raising=False)
    launch(child("ok"), servers=1, workers=1, timeout=60, grace=2, output=io.StringIO()).check()
    tokens = {r["RECPS_CLUSTER_TOKEN"] for r in records(child.out).values()}
    assert len(tokens) == 1 and len(tokens.pop()) == 32


@pytest.mark.e2e
def test_a_server_that_exits_0_on_its_own_is_not_a_failure(child):
    result = launch(child("server_exits_0"), servers=2, workers=1, timeout=60, grace=2, output=io.StringIO())
    assert result.ok and result.returncodes == {"server0": 0, "server1": 0, "worker0": 0}
    assert result.stopped == ()


@pytest.mark.e2e
def test_log_dir_gets_one_file_per_process(child, tmp_path):
    log_dir = tmp_path / "logs"
    result = launch(child("ok"), servers=1, workers=2, timeout=60, grace=2, log_dir=log_dir)
    assert result.ok and result.log_dir == str(log_dir)
    assert sorted(p.name for p in log_dir.iterdir()) == ["server0.log", "worker0.log", "worker1.log"]
    for name in ("server0", "worker0", "worker1"):
        assert (log_dir / f"{name}.log").read_text().splitlines() == [f"hello from {name}", f"to stderr from {name}"]


# ------------------------------------------------------------------------------------------ failure


@pytest.mark.e2e
def test_a_failing_worker_stops_everyone_quickly_and_is_named(child):
    started = time.monotonic()
    result = launch(child("worker_fails", "grandchild"), servers=2, workers=2, timeout=60, grace=2, output=io.StringIO())
    elapsed = time.monotonic() - started
    assert not result.ok and result.failed == "worker1" and result.exit_code == 3
    assert result.message == f"worker1 (pid {result.pids['worker1']}) exited with code 3"
    assert result.returncodes["worker1"] == 3
    assert [result.returncodes[n] for n in ("server0", "server1", "worker0")] == [-signal.SIGTERM] * 3
    assert set(result.stopped) == {"server0", "server1", "worker0"}
    assert elapsed < 15, elapsed  # servers would sleep 600 s
    assert len(all_pids(child.out)) == 8  # 4 children + a grandchild each (the failed worker's too)
    assert_all_gone(all_pids(child.out))
    with pytest.raises(LaunchError, match=r"^worker1 \(pid \d+\) exited with code 3$"):
        result.check()


@pytest.mark.e2e
def test_a_failing_server_stops_the_workers(child):
    result = launch(child("server_fails"), servers=2, workers=1, timeout=60, grace=2, output=io.StringIO())
    assert (result.failed, result.exit_code, result.returncodes["server1"]) == ("server1", 5, 5)
    assert "server1 (pid" in result.message and "exited with code 5" in result.message
    assert_all_gone(list(result.pids.values()), within=0)


@pytest.mark.e2e
def test_a_worker_killed_by_a_signal(child, tmp_path):
    result = launch(child("worker_killed"), servers=1, workers=2, timeout=60, grace=2, log_dir=tmp_path / "logs")
    assert (result.failed, result.returncodes["worker0"], result.exit_code) == ("worker0", -signal.SIGKILL, 128 + signal.SIGKILL)
    assert result.message.endswith(f"was killed by SIGKILL; see {tmp_path / 'logs' / 'worker0.log'}")


@pytest.mark.e2e
def test_a_process_that_ignores_sigterm_gets_sigkill_after_the_grace_period(child):
    started = time.monotonic()
    result = launch(child("stubborn"), servers=1, workers=1, timeout=60, grace=0.5, output=io.StringIO())
    assert result.ok and result.returncodes == {"server0": -signal.SIGKILL, "worker0": 0}
    assert 0.5 <= time.monotonic() - started < 15


@pytest.mark.e2e
def test_the_global_timeout_stops_everything(child):
    started = time.monotonic()
    result = launch(child("sleep", "grandchild"), servers=1, workers=1, timeout=3, grace=1, output=io.StringIO())
    assert (result.failed, result.timed_out, result.exit_code) == ("timeout", True, 124)
    assert result.message == "timed out after 3s with server0, worker0 still running"
    assert 3 <= time.monotonic() - started < 15
    assert len(all_pids(child.out)) == 4
    assert_all_gone(all_pids(child.out))


# ---------------------------------------------------------------------------------------- arguments


@pytest.mark.e2e
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(command=[]), "empty command"),
        (dict(servers=0), r"servers=0; a cluster needs at least 1 server and 1 worker"),
        (dict(workers=True), r"workers=True"),
        (dict(timeout=0), r"timeout=0"),
        (dict(grace=-1), r"grace=-1"),
        (dict(restarts=-1), r"restarts=-1; give an integer >= 0"),
        (dict(backoff=-1), r"backoff=-1"),
        (dict(host="256.1.1.1"), r"cannot bind a port on host '256.1.1.1'"),
        (dict(command=["/nonexistent/program"]), r"cannot start server0: '/nonexistent/program'"),
    ],
)
def test_launch_refuses_bad_arguments(kwargs, message):
    args = dict(command=[sys.executable, "-c", "pass"], servers=1, workers=1)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=message):
        launch(**args)


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# --------------------------------------------------------------------------------------------- CLI


def run_cli(args, timeout=60):
    """`python -m recps.launch args` from this cwd; the tests check its exit code themselves."""
    return run_module("recps.launch", *args, timeout=timeout, cwd=os.getcwd(), check=None)


@pytest.mark.e2e
def test_cli_propagates_the_exit_code_and_names_the_process(child):
    done = run_cli(["--servers", "1", "--workers", "2", "--grace", "1", "--timeout", "60", "--", *child("worker_fails")])
    assert done.returncode == 3, done.stderr
    assert "[launch] failed: worker1 (pid" in done.stderr and "exited with code 3" in done.stderr
    assert "[worker1] hello from worker1" in done.stdout.splitlines()
    assert_all_gone(all_pids(child.out))


@pytest.mark.e2e
def test_cli_success(child):
    done = run_cli(["--servers", "1", "--workers", "1", "--", *child("ok")])
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [
        "[server0] hello from server0",
        "[server0] to stderr from server0",
        "[worker0] hello from worker0",
        "[worker0] to stderr from worker0",
    ]


@pytest.mark.e2e
def test_cli_timeout_exits_124(child):
    done = run_cli(["--timeout", "1", "--grace", "1", "--", *child("sleep")])
    assert done.returncode == 124 and "timed out after 1s" in done.stderr


def test_cli_without_a_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--servers", "1"])
    assert exit_info.value.code == 2
    assert "no command; write it after '--'" in capsys.readouterr().err


@pytest.mark.e2e
def test_cli_bad_counts_exit_2(capsys):
    assert main(["--workers", "0", "--", sys.executable, "-c", "pass"]) == 2
    assert "workers=0" in capsys.readouterr().err


def wait_for_records(out, names, within=30.0):
    deadline = time.monotonic() + within
    while not all((out / f"{n}.json").exists() for n in names):
        assert time.monotonic() < deadline, f"children did not start: {sorted(p.name for p in out.iterdir())}"
        time.sleep(0.05)


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_no_orphans_when_the_launcher_itself_is_killed(child, sig):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "recps.launch", "--grace", "1", "--", *child("sleep", "grandchild")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for_records(child.out, ["server0", "worker0"])
        pids = all_pids(child.out)
        assert len(pids) == 4 and all(alive(p) for p in pids)
        launcher.send_signal(sig)
        code = launcher.wait(timeout=30)
        assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + signal.SIGTERM)
        assert_all_gone(pids)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        launcher.stderr.close()


# ------------------------------------------------------------------------------- stopped processes


@pytest.mark.e2e
def test_a_stopped_process_is_continued_with_its_sigterm_not_left_for_the_grace_period(child):
    """A SIGSTOPped server (a stalled process) takes its SIGTERM at once: SIGCONT goes with it."""
    started = time.monotonic()
    result = launch(child("server_stops_itself"), servers=1, workers=1, timeout=60, grace=10, output=io.StringIO())
    elapsed = time.monotonic() - started
    assert (result.failed, result.returncodes) == ("worker0", {"server0": -signal.SIGTERM, "worker0": 3})
    assert elapsed < 8, f"{elapsed:.1f} s: the stopped server sat out the 10 s grace"


# ----------------------------------------------------------------------------------------- restarts


@pytest.mark.e2e
def test_a_failed_cluster_restarts_and_finishes_with_the_restart_count_in_its_environment(child):
    seen = []
    started = time.monotonic()
    result = launch(child("worker1_fails_first_start"), servers=1, workers=2, timeout=120, grace=2, restarts=2,
                    backoff=0.5, output=io.StringIO(), on_restart=lambda n, failed: seen.append((n, failed.failed)))
    assert result.ok, result.message
    assert seen == [(1, "worker1")]
    assert len(result.restarts) == 1 and re.fullmatch(r"worker1 \(pid \d+\) exited with code 3", result.restarts[0])
    assert {r["RECPS_RESTART_COUNT"] for r in records(child.out).values()} == {"1"}  # the second start's records
    assert time.monotonic() - started >= 0.5  # the back-off
    assert_all_gone(all_pids(child.out))


@pytest.mark.e2e
def test_restarts_exhausted_fail_naming_the_last_cause_and_every_earlier_one(child):
    result = launch(child("worker_fails"), servers=1, workers=2, timeout=120, grace=2, restarts=2, backoff=0.1,
                    output=io.StringIO())
    assert (result.failed, result.exit_code, len(result.restarts)) == ("worker1", 3, 2)
    assert re.fullmatch(r"worker1 \(pid \d+\) exited with code 3 \(after 2 restarts: worker1 \(pid \d+\) exited "
                        r"with code 3; worker1 \(pid \d+\) exited with code 3\)", result.message), result.message
    assert_all_gone(list(result.pids.values()), within=0)


@pytest.mark.e2e
def test_a_timeout_is_not_restarted(child):
    result = launch(child("sleep"), servers=1, workers=1, timeout=2, grace=1, restarts=3, output=io.StringIO())
    assert (result.failed, result.restarts) == ("timeout", ())


@pytest.mark.e2e
def test_cli_restarts(child):
    done = run_cli(["--servers", "1", "--workers", "2", "--restarts", "1", "--backoff", "0.1", "--",
                    *child("worker1_fails_first_start")])
    assert done.returncode == 0, done.stderr
    assert re.search(r"restart 1 of 1 in 0.1 s: worker1 \(pid \d+\) exited with code 3", done.stderr), done.stderr


def test_restart_count_comes_from_recps_launch_or_torchrun():
    from recps.cluster.launch import restart_count

    assert restart_count({}) == 0
    assert restart_count({"RECPS_RESTART_COUNT": "2"}) == 2
    assert restart_count({"RECPS_RESTART_COUNT": "0", "TORCHELASTIC_RESTART_COUNT": "1"}) == 1
    with pytest.raises(ConfigError, match=r"\$RECPS_RESTART_COUNT='x' is no restart count"):
        restart_count({"RECPS_RESTART_COUNT": "x"})


# A launcher's preparation in a forked child (recps.cluster.launch.run_in_fork): the threads it starts end with
# the child, so the launcher may still fork its cluster's processes; its error is raised in the launcher.
RUN_IN_FORK = textwrap.dedent(
    """
    import os, sys, threading, time
    import torch
    from recps.cluster.launch import LaunchError, can_fork, note_fork_safe_threads, run_in_fork
    from recps.errors import ConfigError
    note_fork_safe_threads()
    marker = sys.argv[1]
    print("before", can_fork())

    def prepare():
        torch.set_num_threads(2)
        torch.randn(1 << 22).sort()  # an OpenMP team starts
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        with open(marker, "w") as f:
            f.write("written")
        print("in the child", can_fork(), flush=True)
        raise ConfigError("pipeline.stages.recall.keep=9: too large; lower it")

    try:
        run_in_fork(prepare, "the checks")
    except ConfigError as exc:
        print("raised", exc)
    print("after", can_fork(), open(marker).read())
    try:
        run_in_fork(lambda: os._exit(3), "the crash")
    except LaunchError as exc:
        print("crash", exc)
    run_in_fork(lambda: None, "nothing")
    print("ok", can_fork())
    """
)


@pytest.mark.e2e
def test_preparation_in_a_fork_leaves_no_thread_and_raises_its_error(tmp_path):
    done = subprocess.run([sys.executable, "-c", RUN_IN_FORK, str(tmp_path / "marker")], capture_output=True,
                          text=True, timeout=120, cwd=PROJECT_ROOT, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "before True" and lines[1] == "in the child False", done.stdout
    assert lines[2] == "raised pipeline.stages.recall.keep=9: too large; lower it", done.stdout
    assert lines[3] == "after True written", done.stdout  # its threads ended with it; what it wrote stays
    assert re.fullmatch(r"crash the crash \(pid \d+, forked from this process\) ended without an outcome "
                        r"\(exit code 3\)", lines[4]), done.stdout
    assert lines[5] == "ok True", done.stdout
