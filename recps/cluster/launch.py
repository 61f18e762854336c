"""Start S servers and W workers of one command on this machine and supervise them (like fleetrun).

    python -m recps.launch --servers 1 --workers 2 -- python my_train.py --lr 0.1

Each copy of the command gets the RECPS_* variables that `recps.ps.roles.EnvRoleMaker` reads:
servers are server0..server{S-1}, workers worker0..worker{W-1}; the coordinator address is
127.0.0.1 (or --host) on a free port; the cluster token is --token, else $RECPS_CLUSTER_TOKEN,
else a random one. Output is forwarded line by line with a "[worker1] " prefix, or written to
--log-dir/worker1.log.

Supervision (a poll every 50 ms):
- all workers exit 0          -> the servers are stopped (SIGTERM, SIGKILL after --grace seconds); exit 0.
  A server that exits 0 on its own before that (told to stop by the workers) is fine.
- any process exits non-zero,
  or is killed by a signal    -> every other process is stopped the same way; the launcher exits with
                                 that process's code (128 + signal when killed) and names it.
- --timeout seconds pass      -> everything is stopped; exit 124.
- --restarts N                -> a failed cluster (a process exited non-zero or was killed) is stopped as
                                 above and started again, at most N times, after a back-off of --backoff
                                 seconds doubling per restart (at most 30 s); each start's processes get
                                 RECPS_RESTART_COUNT=k (0 first), as torchrun's TORCHELASTIC_RESTART_COUNT,
                                 and resume from their own checkpoints (recps.train: its last committed one).
                                 A timeout or a signal to the launcher is never restarted.
- the launcher gets SIGINT,
  SIGTERM or SIGHUP           -> everything is stopped; exit 128 + signal.

Stopping sends SIGCONT right after SIGTERM, so that a stopped (SIGSTOPped, stalled) process takes
its SIGTERM at once instead of sitting out the grace period.

No orphans: each child leads its own process group (a signal reaches its own subprocesses too,
and whatever is left of a group when its leader exits is killed). If the launcher itself dies,
even by `kill -9`: on Linux each child asks the kernel for SIGKILL when its parent dies
(PR_SET_PDEATHSIG), and a small watchdog process, which sees the launcher's death as EOF on a
pipe, kills every child's process group (grandchildren included). Not covered: grandchildren
that leave their process group (setsid, daemons).

A preloaded image (`launch(..., fork=target)`, as `recps.train` does): each child is forked from
the launcher, which has imported torch, fbgemm, torchrec and the models and composed the config
already, and runs `target()` instead of exec'ing the command (saving each process its python
start, imports and config: about 3 CPU-seconds on the 2-core development machine,
benchmarks/RESULTS.md "Start-up"); everything above holds for it (its own process group,
the parent-death signal, output forwarded or logged, the same environment and exit codes). It
forks only when that is safe (`can_fork`: no other thread in this process but numpy's BLAS pool
and jemalloc's background thread, whose libraries handle a fork; no OpenMP team yet); else, and
with RECPS_LAUNCH_FORK=0, it execs the command as usual.

The same from Python (e.g. `recps.train cluster=local`):

    result = launch([sys.executable, "-m", "my_job"], servers=1, workers=2, timeout=600)
    result.check()   # raises LaunchError("worker1 (pid 4242) exited with code 3") unless every worker succeeded
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import io
import logging
import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import IO, Any, Callable, Mapping, Sequence, TextIO

from recps.errors import ConfigError, RecpsError
from recps.ps.roles import (
    COORDINATOR_ENV,
    HOST_ENV,
    INDEX_ENV,
    NUM_SERVERS_ENV,
    NUM_WORKERS_ENV,
    ROLE_ENV,
    SERVER_ENDPOINTS_ENV,
    TOKEN_ENV,
    Role,
)

__all__ = ["launch", "LaunchResult", "LaunchError", "free_port", "main", "DEFAULT_GRACE_S", "TIMEOUT_EXIT_CODE",
           "RESTART_ENV", "restart_count", "MAX_BACKOFF_S", "process_age", "FORK_ENV", "can_fork", "note_fork_safe_threads",
           "run_in_fork"]

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 5.0  # between SIGTERM and SIGKILL
TIMEOUT_EXIT_CODE = 124  # as timeout(1)
RESTART_ENV = "RECPS_RESTART_COUNT"  # which start of the cluster this is: 0, then 1.. after restarts
MAX_RESTARTS_ENV = "RECPS_MAX_RESTARTS"  # `restarts`: the processes' errors say whether a restart follows
_ELASTIC_RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # torchrun's (--max-restarts)
MAX_BACKOFF_S = 30.0
FORK_ENV = "RECPS_LAUNCH_FORK"  # "0": always exec the command, even when launch() was given a `fork` target
_POLL_S = 0.05
_REAP_TIMEOUT_S = 5.0  # a SIGKILLed process is normally gone in milliseconds; D-state ones may take longer
_READER_JOIN_S = 2.0
# Inherited values of these would describe another cluster; the launcher sets its own.
_ROLE_VARIABLES = (ROLE_ENV, INDEX_ENV, NUM_SERVERS_ENV, NUM_WORKERS_ENV, COORDINATOR_ENV, HOST_ENV, SERVER_ENDPOINTS_ENV)


class LaunchError(RecpsError):
    """A launched cluster failed: a process exited non-zero or was killed, or the run timed out."""


@dataclass(frozen=True)
class LaunchResult:
    """How a launched cluster ended.

    Attributes:
        returncodes: name -> exit code in start order (server0.., worker0..); negative: killed by
            that signal (subprocess's convention); None: could not be reaped (should not happen).
        pids: name -> process id.
        failed: the name of the process that failed the run ("worker1"), "timeout", or None.
        message: one line saying how the run ended, naming the failed process and its code.
        stopped: names of the processes the launcher signalled (servers after a successful run,
            everyone else after a failure); their codes are not failures.
        timed_out: the global timeout ended the run.
        coordinator: the "host:port" handed to every process.
        duration_s: wall time from the first start to the last exit.
        log_dir: where per-process logs went, or None when output was forwarded.
        restarts: the failures the cluster was restarted after, one message each ("worker1 (pid
            4242) was killed by SIGKILL"), oldest first; the fields above describe the last start.
    """

    returncodes: dict[str, int | None]
    pids: dict[str, int]
    failed: str | None
    message: str
    stopped: tuple[str, ...] = ()
    timed_out: bool = False
    coordinator: str = ""
    duration_s: float = 0.0
    log_dir: str | None = None
    restarts: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.failed is None

    @property
    def exit_code(self) -> int:
        """0 on success; the failed process's code, 128 + signal if it was killed, or 124 on timeout."""
        if self.ok:
            return 0
        if self.timed_out:
            return TIMEOUT_EXIT_CODE
        code = self.returncodes.get(self.failed)
        if code is None:
            return 1
        return 128 - code if code < 0 else min(code, 255)

    def check(self) -> LaunchResult:
        """Self when the run succeeded; else raise LaunchError with `message`."""
        if not self.ok:
            raise LaunchError(self.message)
        return self


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """Which restart this process belongs to: $RECPS_RESTART_COUNT (recps.launch's restarts) or
    $TORCHELASTIC_RESTART_COUNT (torchrun's), 0 on the first start. A value that is no integer >= 0
    raises naming it.

    >>> restart_count({"TORCHELASTIC_RESTART_COUNT": "1"})
    1
    """
    env = os.environ if environ is None else environ
    for name in (RESTART_ENV, _ELASTIC_RESTART_ENV):
        value = env.get(name)
        if value is None or value == "":
            continue
        if not value.isdigit():
            raise ConfigError(f"${name}={value!r} is no restart count; the launcher sets an integer >= 0 (unset it)")
        if int(value) > 0:
            return int(value)
    return 0


def process_age() -> float | None:
    """Seconds since this process started (fork, or exec's start), from /proc; None where there is none.
    Start-up log lines report it (benchmarks/startup_bench.py reads them).

    >>> 0.0 <= process_age() < 3600.0
    True
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            started_ticks = int(f.read().rpartition(b")")[2].split()[19])  # field 22: starttime, in clock ticks
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))


_fork_safe_threads: frozenset[str] = frozenset()
_FORK_SAFE_NAMES = ("jemalloc_bg_thd",)  # pyarrow's jemalloc: its fork handlers stop and restart it


def note_fork_safe_threads() -> None:
    """Takes the native threads this process runs now as safe to fork with: an entry point calls it
    right after its imports, when the only ones are the BLAS pool numpy started (OpenBLAS stops it
    around a fork and starts it again when needed). Any thread started later prevents `can_fork`."""
    global _fork_safe_threads
    try:
        _fork_safe_threads = frozenset(os.listdir("/proc/self/task"))
    except OSError:
        _fork_safe_threads = frozenset()


def can_fork() -> bool:
    """Whether a child forked now may run Python without exec'ing: no other Python thread, and no native
    thread but those `note_fork_safe_threads` took and jemalloc's (a thread holding a lock at the fork,
    e.g. an OpenMP team's or hdfs-native's runtime, would deadlock the child); Linux only."""
    if not hasattr(os, "fork") or not sys.platform.startswith("linux") or threading.active_count() > 1:
        return False
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    me = str(threading.get_native_id())
    for task in tasks:
        if task == me or task in _fork_safe_threads:
            continue
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as f:
                name = f.read().strip()
        except OSError:  # it has just exited
            continue
        if name not in _FORK_SAFE_NAMES:
            return False
    return True


def run_in_fork(fn: Callable[[], Any], what: str) -> Any:
    """fn() in a child forked from this process, waited for: its result (pickled) is returned and its
    exception raised here. The threads fn starts (pyarrow's pools while a data set is read, torch's OpenMP
    team, an HDFS client's runtime) end with that child, so this process can still fork its cluster's
    processes afterwards (`can_fork`). Where a fork is not safe now, or RECPS_LAUNCH_FORK=0, fn runs in
    this process. fn's effects on disk stay; its effects on this process's memory do not: give it only
    checks and preparation (`what` names it in an error)."""
    if os.environ.get(FORK_ENV, "1") == "0" or not can_fork():
        return fn()
    for stream in (sys.stdout, sys.stderr):  # nothing of ours is written twice by the child
        stream.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, send the outcome, leave without this process's exit handlers
        os.close(read)
        try:
            outcome: tuple[str, Any] = ("result", fn())
        except BaseException as exc:  # noqa: BLE001 - raised again in the parent
            if not isinstance(exc, (RecpsError, KeyboardInterrupt)):
                traceback.print_exc()  # a bug's traceback, which the parent cannot rebuild
            outcome = ("error", exc)
        try:
            payload = pickle.dumps(outcome)
        except Exception:  # an exception or a result that does not pickle: its type and text
            payload = pickle.dumps(("error", RuntimeError(f"{what}: {type(outcome[1]).__name__}: {outcome[1]}")))
        for handler in logging.getLogger().handlers:
            handler.flush()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        with os.fdopen(write, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        payload = f.read()  # until the child closes its end: as long as fn takes there
    _, status = os.waitpid(pid, 0)
    if not payload:
        raise LaunchError(f"{what} (pid {pid}, forked from this process) ended without an outcome "
                          f"({_status_text(status)})")
    kind, value = pickle.loads(payload)
    if kind == "error":
        raise value
    return value


def _status_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (the OS picks it; another process may take it later).

    >>> 0 < free_port() < 65536
    True
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            return probe.getsockname()[1]
    except OSError as e:
        raise ConfigError(f"cannot bind a port on host {host!r} ({e}); give an address of this machine, e.g. 127.0.0.1") from None


# ---------------------------------------------------------------------------------------- children


# Run in each child before it execs the command: die with the launcher (PR_SET_PDEATHSIG survives
# exec), and if the launcher died before that took effect, die now.
_DEATH_SIGNAL_EXEC = """
import ctypes, os, signal, sys
parent = int(sys.argv[1])
if sys.platform.startswith("linux"):
    try:
        ctypes.CDLL(None, use_errno=True).prctl(ctypes.c_int(1), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0),
                                                ctypes.c_ulong(0), ctypes.c_ulong(0))
    except (OSError, AttributeError):
        pass
if os.getppid() != parent:
    os.kill(os.getpid(), signal.SIGKILL)
os.execvp(sys.argv[2], sys.argv[2:])
"""


# Run by a watchdog process: it learns the children's process groups from its stdin and kills
# them if its stdin reaches EOF without "done" (the launcher died, even by SIGKILL). It covers
# the grandchildren that PR_SET_PDEATHSIG (direct children only) does not.
_GUARDIAN_CODE = """
import os, signal, sys
for s in (signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
groups = []
for line in sys.stdin.buffer:
    if line == b"done\\n":
        sys.exit(0)
    groups.append(int(line))
for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
"""


class _Guardian:
    """The watchdog above. Its stdin pipe is not inherited by anyone else (PEP 446), so EOF means we died."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _GUARDIAN_CODE],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # out of reach of the terminal's Ctrl-C and hangup
        )

    def _send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):  # the guardian was killed: children still have PR_SET_PDEATHSIG
            pass

    def watch(self, pgid: int) -> None:
        self._send(f"{pgid}\n")

    def fileno(self) -> int:
        """Its stdin pipe's end here (a forked child closes it: only our death may close it)."""
        return self.proc.stdin.fileno()

    def close(self) -> None:
        self._send("done\n")
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=_REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass(eq=False)
class _Child:
    name: str
    is_worker: bool
    proc: subprocess.Popen | _Forked
    log: IO[bytes] | None = None
    reader: threading.Thread | None = None
    returncode: int | None = None
    signalled: bool = False
    exited: bool = False

    @property
    def pid(self) -> int:
        return self.proc.pid


class _Forked:
    """A child forked from this process (no exec), with the part of subprocess.Popen that launch uses."""

    def __init__(self, pid: int, stdout: IO[bytes] | None) -> None:
        self.pid, self.stdout, self.returncode = pid, stdout, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: as Popen, an unknown code reads 0
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)  # -N: killed by signal N
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout)
            time.sleep(_POLL_S)
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _fork(target: Callable[[], int | None], env: Mapping[str, str], out_fd: int, close: Sequence[int]) -> int:
    """Fork a child that runs `target()` as a fresh process of `env` would, its stdout and stderr on
    `out_fd`; returns its pid. The child closes `close` (the launcher's pipes to the guardian and to
    the other children) and exits with target's return value (a traceback and 1 on an exception)."""
    parent = os.getpid()
    for stream in (sys.stdout, sys.stderr):  # nothing of ours is written twice by the child
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    pid = os.fork()
    if pid:
        try:
            os.setpgid(pid, pid)  # also done by the child: whichever runs first
        except OSError:
            pass
        return pid
    code = 1
    try:  # the child: never returns into the launcher's frames
        os.setpgid(0, 0)
        _die_with_parent(parent)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        for fd in {null, out_fd, *close}:
            if fd > 2:
                try:
                    os.close(fd)
                except OSError:
                    pass
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        # PYTHONUNBUFFERED's streams on the new descriptors; no log handler of the launcher's.
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                      line_buffering=True, write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                      line_buffering=True, write_through=True)
        for handler in logging.root.handlers[:]:
            logging.root.removeHandler(handler)
        result = target()
        code = result if isinstance(result, int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 (the child's top: what a fresh interpreter prints)
        traceback.print_exc()
    finally:
        try:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _die_with_parent(parent: int) -> None:
    """PR_SET_PDEATHSIG(SIGKILL) for this child (as _DEATH_SIGNAL_EXEC); if `parent` died already, die now."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(ctypes.c_int(1), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0),
                                                ctypes.c_ulong(0), ctypes.c_ulong(0))
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def _forward(child_name: str, pipe: IO[bytes], output: TextIO | None, lock: threading.Lock) -> None:
    """Copy a child's output line by line with a "[name] " prefix (runs on its own thread)."""
    prefix = f"[{child_name}] "
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            if not line.endswith("\n"):
                line += "\n"
            stream = output if output is not None else sys.stdout
            with lock:
                try:
                    stream.write(prefix + line)
                    stream.flush()
                except (OSError, ValueError):  # our stdout went away (closed pipe): keep draining the child
                    pass


def _signal_group(child: _Child, sig: int) -> None:
    """Send `sig` to the child's process group (the child and its own subprocesses), or to the child alone."""
    try:
        if os.getpgid(child.pid) == child.pid:
            os.killpg(child.pid, sig)
        else:  # the child left its group; reach it at least
            os.kill(child.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _has_exited(child: _Child) -> bool:
    """True once the child has exited; then it is reaped, after the rest of its process group is killed.

    waitid(WNOWAIT) sees the exit without reaping, so the child's pid (= its group id) cannot be
    reused while we kill what is left of the group.
    """
    if child.exited:
        return True
    if hasattr(os, "waitid"):
        try:
            seen = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped by someone else: its pid may be reused, leave the group alone
            pass
        else:
            if seen is None:
                return False
            try:
                os.killpg(child.pid, signal.SIGKILL)  # leftovers of a finished child: nobody will stop them
            except (ProcessLookupError, PermissionError):
                pass
    code = child.proc.poll()
    if code is None:
        return False
    child.returncode, child.exited = code, True
    return True


def _describe(child: _Child, log_dir: str | None) -> str:
    code = child.returncode
    if code is not None and code < 0:
        try:
            what = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            what = f"was killed by signal {-code}"
    else:
        what = f"exited with code {code}"
    where = f"; see {os.path.join(log_dir, child.name + '.log')}" if log_dir else ""
    return f"{child.name} (pid {child.pid}) {what}{where}"


def _stop(children: Sequence[_Child], grace: float) -> None:
    """SIGTERM every live child's group, wait up to `grace` seconds, then SIGKILL and reap."""
    live = [c for c in children if not _has_exited(c)]
    for child in live:
        child.signalled = True
        _signal_group(child, signal.SIGTERM)
        _signal_group(child, signal.SIGCONT)  # a stopped process takes its SIGTERM now, not after the grace
    deadline = time.monotonic() + grace
    while live and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        live = [c for c in live if not _has_exited(c)]
    for child in live:
        logger.warning("%s (pid %d) ignored SIGTERM for %.1fs; sending SIGKILL", child.name, child.pid, grace)
        _signal_group(child, signal.SIGKILL)
    deadline = time.monotonic() + _REAP_TIMEOUT_S
    while live and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        live = [c for c in live if not _has_exited(c)]
    for child in live:  # uninterruptible sleep (D state); nothing more a launcher can do
        logger.error("%s (pid %d) survived SIGKILL for %.0fs", child.name, child.pid, _REAP_TIMEOUT_S)


def _start(
    role: Role,
    command: Sequence[str],
    base_env: Mapping[str, str],
    log_dir: str | None,
    guardian: _Guardian,
    fork: Callable[[], int | None] | None = None,
    close: Sequence[int] = (),
) -> _Child:
    """Start one child (forked to run `fork`, when given and safe; else exec'ing `command`). Its output
    is read by `_read`, started once every child of the start is up (no thread runs at the forks)."""
    env = dict(base_env)
    env.update(role.to_env())
    restarted = base_env.get(RESTART_ENV, "0") != "0"  # a restart appends to the first start's log
    log = open(os.path.join(log_dir, f"{role.name}.log"), "ab" if restarted else "wb") if log_dir else None
    try:
        if shutil.which(command[0]) is None:
            raise FileNotFoundError(f"no such program: {command[0]!r}")
        if fork is not None and os.environ.get(FORK_ENV, "1") != "0" and can_fork():
            proc = _start_forked(fork, env, log, [guardian.fileno(), *close])
        else:
            # No preexec_fn (Python code between fork and exec deadlocks when another thread of this
            # process holds a lock at the fork, e.g. hdfs-native's runtime): the child leads its own
            # group (process_group=0, done in C) and a tiny exec wrapper sets the parent-death signal.
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _DEATH_SIGNAL_EXEC, str(os.getpid()), *command],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log if log is not None else subprocess.PIPE,
                stderr=subprocess.STDOUT,
                process_group=0,
                close_fds=True,
            )
    except OSError as e:
        if log is not None:
            log.close()
        raise ConfigError(f"cannot start {role.name}: {command[0]!r}: {e}; check the command after '--'") from None
    guardian.watch(proc.pid)  # the child leads its own group: pgid == pid
    child = _Child(role.name, role.is_worker, proc, log=log)
    logger.info("started %s (pid %d)%s", role.name, proc.pid, " forked from this image" if isinstance(proc, _Forked) else "")
    return child


def _start_forked(target: Callable[[], int | None], env: Mapping[str, str], log: IO[bytes] | None,
                  close: Sequence[int]) -> _Forked:
    if log is not None:
        return _Forked(_fork(target, env, log.fileno(), close), None)
    read, write = os.pipe()
    try:
        pid = _fork(target, env, write, [read, *close])
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)
    return _Forked(pid, os.fdopen(read, "rb"))


def _read(child: _Child, output: TextIO | None, lock: threading.Lock) -> None:
    """Forward the child's output on a thread of its own (nothing to do when it writes to a log file)."""
    if child.log is None:
        child.reader = threading.Thread(target=_forward, args=(child.name, child.proc.stdout, output, lock),
                                        name=f"recps-launch-{child.name}", daemon=True)
        child.reader.start()


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"launch: {name}={value!r}; a cluster needs at least 1 server and 1 worker")
    return value


def launch(
    command: Sequence[str],
    servers: int,
    workers: int,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    log_dir: str | os.PathLike | None = None,
    token: str | None = None,
    host: str = "127.0.0.1",
    grace: float = DEFAULT_GRACE_S,
    output: TextIO | None = None,
    restarts: int = 0,
    backoff: float = 1.0,
    on_restart: Callable[[int, LaunchResult], str | None] | None = None,
    fork: Callable[[], int | None] | None = None,
) -> LaunchResult:
    """Run `servers` + `workers` copies of `command` with their roles; return when the cluster is done.

    Blocks until every worker has exited 0 (then stops the servers), or any process fails (then
    stops the rest, and starts the cluster again if restarts are left), or `timeout` seconds pass.
    Never returns with a child still running. Call it from a thread that outlives the run (on
    Linux, children die when the thread that started them exits). KeyboardInterrupt stops the
    children, then propagates.

    Args:
        command: argv of each process, e.g. [sys.executable, "-m", "my_job"].
        env: variables added to this process's environment for the children (the RECPS_* role
            variables are set by the launcher and win).
        timeout: seconds before everything is stopped (None: no limit); over all restarts.
        log_dir: write each process's stdout+stderr to log_dir/<name>.log instead of forwarding it
            (a restart appends to the same files).
        token: cluster token; default $RECPS_CLUSTER_TOKEN, else a random one.
        host: address the coordinator and the servers bind (loopback by default).
        grace: seconds between SIGTERM and SIGKILL when stopping a process.
        output: stream that receives forwarded output (default: sys.stdout at the time of writing).
        restarts: how many times a failed cluster is started again (a new coordinator port, the
            same token; each process gets RECPS_RESTART_COUNT); a timeout is not restarted.
        backoff: seconds before the first restart, doubled for each next one (at most MAX_BACKOFF_S).
        on_restart: called with (restart number from 1, the failed start's result) before each
            restart; what it returns (e.g. "from checkpoint .../step-40") joins the restart's log line.
        fork: what each child runs when it is forked from this process instead of exec'ing `command`
            (the preloaded image in the module docstring; it must do what `command` does with the
            child's environment): returns the exit code. Used when `can_fork()` and not
            RECPS_LAUNCH_FORK=0, per start (a restart may exec).
    """
    command = [os.fspath(part) for part in command]
    if not command:
        raise ConfigError("launch: empty command; give the program to run, e.g. -- python my_job.py")
    servers, workers = _check_count("servers", servers), _check_count("workers", workers)
    if timeout is not None and not timeout > 0:
        raise ConfigError(f"launch: timeout={timeout!r}; give a positive number of seconds or None")
    if not grace >= 0:
        raise ConfigError(f"launch: grace={grace!r}; give a number of seconds >= 0")
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ConfigError(f"launch: restarts={restarts!r}; give an integer >= 0 (0: a failure ends the run)")
    if not backoff >= 0:
        raise ConfigError(f"launch: backoff={backoff!r}; give a number of seconds >= 0")
    token = token or os.environ.get(TOKEN_ENV) or secrets.token_hex(16)
    base_env = {k: v for k, v in os.environ.items() if k not in _ROLE_VARIABLES}
    base_env.update(env or {})
    base_env.setdefault("PYTHONUNBUFFERED", "1")  # children's lines show up as they are written
    base_env[MAX_RESTARTS_ENV] = str(restarts)
    log_dir = os.fspath(log_dir) if log_dir is not None else None
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    recovered: list[str] = []
    for attempt in range(restarts + 1):
        result = _launch_once(command, servers, workers, {**base_env, RESTART_ENV: str(attempt)}, deadline, timeout,
                              log_dir, token, host, grace, output, fork)
        if result.ok or result.timed_out or attempt == restarts:
            break
        delay = min(backoff * 2**attempt, MAX_BACKOFF_S)
        if deadline is not None and time.monotonic() + delay >= deadline:
            break  # no time left for another start: the failure stands
        recovered.append(result.message)
        where = on_restart(attempt + 1, result) if on_restart is not None else None
        logger.warning("restart %d of %d in %g s: %s%s", attempt + 1, restarts, delay, result.message,
                       f"; {where}" if where else "")
        time.sleep(delay)
    if recovered:
        message = result.message if result.ok else f"{result.message} (after {len(recovered)} restarts: {'; '.join(recovered)})"
        result = dataclasses.replace(result, restarts=tuple(recovered), message=message,
                                     duration_s=time.monotonic() - started)
    return result


def _launch_once(command: list[str], servers: int, workers: int, base_env: dict[str, str], deadline: float | None,
                 timeout: float | None, log_dir: str | None, token: str, host: str, grace: float,
                 output: TextIO | None, fork: Callable[[], int | None] | None = None) -> LaunchResult:
    """One start of the cluster, supervised until it is done (launch's loop restarts it)."""
    coordinator = f"[{host}]:{free_port(host)}" if ":" in host else f"{host}:{free_port(host)}"
    roles = [Role("server", i, servers, workers, coordinator, host, token) for i in range(servers)]
    roles += [Role("worker", j, servers, workers, coordinator, host, token) for j in range(workers)]
    lock = threading.Lock()
    children: list[_Child] = []
    failed: str | None = None
    message = ""
    timed_out = False
    started = time.monotonic()
    logger.info("launching %d servers and %d workers, coordinator %s", servers, workers, coordinator)
    guardian = _Guardian()
    try:
        for role in roles:
            theirs = [fd for c in children for fd in (c.proc.stdout.fileno() if c.proc.stdout else -1,
                                                       c.log.fileno() if c.log else -1) if fd >= 0]
            children.append(_start(role, command, base_env, log_dir, guardian, fork, theirs))
        for child in children:
            _read(child, output, lock)
        while failed is None:
            for child in children:
                if _has_exited(child) and child.returncode != 0 and failed is None:
                    failed, message = child.name, _describe(child, log_dir)
            if failed is not None:
                logger.error("%s; stopping the other processes", message)
                break
            if all(c.exited for c in children if c.is_worker):
                logger.info("all %d workers finished; stopping the servers", workers)
                break
            if deadline is not None and time.monotonic() >= deadline:
                failed, timed_out = "timeout", True
                message = f"timed out after {timeout:g}s with {', '.join(c.name for c in children if not c.exited)} still running"
                logger.error("%s; stopping everything", message)
                break
            time.sleep(_POLL_S)
    finally:
        _stop(children, grace)
        guardian.close()
        for child in children:
            if child.reader is not None:
                child.reader.join(_READER_JOIN_S)
            if child.log is not None:
                child.log.close()
    if failed is None:
        message = f"{workers} workers exited 0; {servers} servers stopped"
    return LaunchResult(
        returncodes={c.name: c.returncode for c in children},
        pids={c.name: c.pid for c in children},
        failed=failed,
        message=message,
        stopped=tuple(c.name for c in children if c.signalled),
        timed_out=timed_out,
        coordinator=coordinator,
        duration_s=time.monotonic() - started,
        log_dir=log_dir,
    )


# ------------------------------------------------------------------------------------------ the CLI


class _Interrupted(BaseException):
    """The launcher received SIGTERM or SIGHUP; unwinds launch() so that its children are stopped."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum: int, frame: object) -> None:
    raise _Interrupted(signum)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m recps.launch",
        description="Start S servers and W workers of a command on this machine, with RECPS_* role variables.",
        epilog="example: python -m recps.launch --servers 1 --workers 2 -- python my_train.py",
    )
    parser.add_argument("--servers", type=int, default=1, help="number of servers (default 1)")
    parser.add_argument("--workers", type=int, default=1, help="number of workers (default 1)")
    parser.add_argument(
        "--token", default=None, help=f"cluster token (default ${TOKEN_ENV}, else random; prefer the variable: argv is public)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before everything is stopped (exit 124)")
    parser.add_argument("--log-dir", default=None, help="write DIR/<name>.log per process instead of forwarding output")
    parser.add_argument("--restarts", type=int, default=0,
                        help="start a failed cluster again at most N times (default 0); processes see RECPS_RESTART_COUNT")
    parser.add_argument("--backoff", type=float, default=1.0,
                        help=f"seconds before the first restart, doubled for each next (at most {MAX_BACKOFF_S:g}; default 1)")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, help="seconds between SIGTERM and SIGKILL (default 5)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run in every process")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m recps.launch`; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("no command; write it after '--', e.g. -- python my_train.py")
    logging.basicConfig(level=logging.INFO, format="[launch] %(message)s", stream=sys.stderr)
    previous = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        previous[signum] = signal.signal(signum, _raise_interrupted)
    try:
        result = launch(
            command,
            args.servers,
            args.workers,
            timeout=args.timeout,
            log_dir=args.log_dir,
            token=args.token,
            host=args.host,
            grace=args.grace,
            restarts=args.restarts,
            backoff=args.backoff,
        )
    except ConfigError as e:
        print(f"[launch] error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("[launch] interrupted; every process was stopped", file=sys.stderr)
        return 128 + signal.SIGINT
    except _Interrupted as e:
        print(f"[launch] got {signal.Signals(e.signum).name}; every process was stopped", file=sys.stderr)
        return 128 + e.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if not result.ok:
        print(f"[launch] failed: {result.message}", file=sys.stderr)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
