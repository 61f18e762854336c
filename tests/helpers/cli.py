"""Running recps as a user does: `python -m <module> <args>` from the checkout, in a child process.

`run_command` (any program), `run_module` and its shorthand `recps_train` wait for the child and returns a `CliRun`: its
return code, stdout, stderr and, when a `hydra.run.dir=` override was given, the run folder. With
`check` (the default: exit 0) a different exit fails the test with the command and the tail of
both outputs; a child that outlives `timeout` fails it the same way, with what it printed so far.

`job_process` starts a child in a session of its own for a test that reads its output while it
runs (`follow_launch`) and kills the whole process group when the block ends, whatever ended it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from recps.cluster.launch import free_port

__all__ = ["PROJECT_ROOT", "CliRun", "run_command", "run_module", "recps_train", "job_process", "follow_launch", "child_env",
           "torchrun_command", "output_excerpt"]

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # the checkout: tests/helpers/cli.py
TAIL_CHARS = 4000


def child_env(env: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """os.environ with this checkout first on PYTHONPATH (so a child imports this worktree's recps,
    models and tests, not an installed copy), then `env` on top (a None value removes the name)."""
    path = os.environ.get("PYTHONPATH", "")
    parts = [str(PROJECT_ROOT), *(p for p in path.split(os.pathsep) if p and p != str(PROJECT_ROOT))]
    merged = {**os.environ, "PYTHONPATH": os.pathsep.join(parts), **(env or {})}
    return {k: v for k, v in merged.items() if v is not None}


def _text(data) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


class CliRun(subprocess.CompletedProcess):
    """A finished `python -m ...`: returncode, stdout, stderr (text) and the run folder, if named."""

    def __init__(self, args, returncode, stdout, stderr, seconds: float, cwd: Path) -> None:
        super().__init__(args, returncode, _text(stdout), _text(stderr))
        self.seconds, self.cwd = seconds, cwd

    @property
    def output(self) -> str:
        """stdout then stderr."""
        return self.stdout + self.stderr

    @property
    def run_dir(self) -> Path | None:
        """The folder of a `hydra.run.dir=...` override (the last one), else None."""
        dirs = [a.partition("=")[2] for a in self.args if a.startswith("hydra.run.dir=")]
        return Path(dirs[-1]) if dirs else None

    def metrics(self) -> dict:
        """The run folder's metrics.json."""
        assert self.run_dir is not None, f"{self.command}: no hydra.run.dir= override, so no run folder to read"
        return json.loads((self.run_dir / "metrics.json").read_text())

    @property
    def command(self) -> str:
        return " ".join(["python", *self.args[1:]] if self.args[:1] == [sys.executable] else self.args)

    def describe(self, what: str) -> str:
        return (f"`{self.command}` (cwd {self.cwd}) {what} after {self.seconds:.0f} s\n"
                f"--- stdout (last {TAIL_CHARS} characters):\n{self.stdout[-TAIL_CHARS:]}\n"
                f"--- stderr (last {TAIL_CHARS} characters):\n{self.stderr[-TAIL_CHARS:]}")


def run_command(cmd: Sequence[str], cwd: str | os.PathLike = PROJECT_ROOT, env: Mapping[str, str | None] | None = None,
                timeout: float = 300, check: int | None = 0) -> CliRun:
    """`cmd` (a program and its arguments: python -m ..., torchrun ..., mpirun ...) in `cwd` (default:
    the checkout) with child_env(env), waited for at most `timeout` s. `check`: the exit code the
    test expects (0 by default; None: any); another one, or the timeout, fails the test naming the
    command, with the tail of stdout and stderr."""
    cmd = [str(a) for a in cmd]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=child_env(env), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        run = CliRun(cmd, None, exc.stdout, exc.stderr, time.monotonic() - start, Path(cwd))
        pytest.fail(run.describe(f"still ran (timeout {timeout:.0f} s)"), pytrace=False)
    run = CliRun(cmd, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start, Path(cwd))
    if check is not None and run.returncode != check:
        pytest.fail(run.describe(f"exited {run.returncode}, expected {check},"), pytrace=False)
    return run


def run_module(module: str, *args: str, **kwargs) -> CliRun:
    """`python -m module *args` (see run_command for cwd, env, timeout and check)."""
    return run_command([sys.executable, "-m", module, *args], **kwargs)


def recps_train(*overrides: str, **kwargs) -> CliRun:
    """`python -m recps.train *overrides` (see run_module for the keyword arguments)."""
    return run_module("recps.train", *overrides, **kwargs)


def torchrun_command(nproc: int, *args: str, max_restarts: int = 0) -> tuple[list[str], dict[str, str]]:
    """The installed torchrun starting `args` in `nproc` processes on 127.0.0.1, and the variables it needs
    beside the caller's: torchrun's store and recps' coordinator each on a port that was free a moment ago
    (by default the coordinator takes MASTER_PORT + 1, which nobody checked: a client socket of another
    test holding it fails every start-up of server 0, and each failure costs a restart)."""
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert exe, f"torchrun is not beside {sys.executable}: torch installs it"
    cmd = [exe, f"--max-restarts={max_restarts}", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", *args]
    return cmd, {"RECPS_COORDINATOR_PORT": str(free_port())}


@contextlib.contextmanager
def job_process(cmd: Sequence[str], env: Mapping[str, str] | None = None,
                cwd: str | os.PathLike = PROJECT_ROOT) -> Iterator[subprocess.Popen]:
    """`cmd` run from the checkout in a session of its own, its output (stderr too) on a text pipe;
    when the block ends, whatever ended it (a wait that timed out, a failed assertion), the process
    group is killed if the process still runs: no launcher, server or worker outlives a test.
    `env`: the child's whole environment (None: this process's)."""
    proc = subprocess.Popen(list(cmd), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=None if env is None else dict(env))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def follow_launch(proc: subprocess.Popen, pattern: str, lines: list[str], pids: dict[str, int], deadline: float,
                  count: int = 1) -> set[str]:
    """Read a launched job's output (recps.launch's) line by line into `lines` until `count`
    distinct matches of `pattern` (its first group, else the whole match) were seen, noting each
    'started NAME (pid N)' in `pids`; returns the matches. The test fails naming the pattern when
    the output ends or `deadline` (time.monotonic()) passes first."""
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
        pytest.fail(f"never saw {pattern!r} {count} time(s) (saw {sorted(seen)}):\n" + output_excerpt(lines))
    return seen


NOTABLE = re.compile(r"restart|Traceback|Error|FAILED|exit|killed|signal", re.IGNORECASE)


def output_excerpt(lines: Sequence[str], tail: int = 60) -> str:
    """A job's output for a failure message: every earlier line that tells of a failure or a restart
    (an earlier attempt's, which the tail would drop), then the last `tail` lines."""
    head = [line for line in lines[:-tail] if NOTABLE.search(line)]
    skipped = len(lines) - tail - len(head) if len(lines) > tail else 0
    return "".join(head) + (f"[... {skipped} other lines ...]\n" if skipped > 0 else "") + "".join(lines[-tail:])
