"""Peak resident memory of a process and of every process it starts, from /proc (Linux).

    monitor = ProcessTreeMonitor(proc.pid).start()
    ...                                    # the process runs, starts servers and workers
    processes = monitor.stop()             # [{"name": "worker0", "pid": ..., "peak_rss_mib": ...}, ...]

A background thread reads, every `interval_s`, the tree under the root pid (the kernel's
/proc/<pid>/task/<tid>/children lists) and each process's VmHWM: the kernel's own high-water
mark of its resident set, so a spike between two reads is not missed as long as the process is
still alive at the next read; only what a process adds in its last `interval_s` before it exits
can escape (the training and evaluation peaks come well before that). Processes are named by
their recps role (RECPS_ROLE + RECPS_INDEX in their environment: "server0", "worker1"), the
root "main", anything else by its executable and pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["ProcessTreeMonitor", "peak_rss_mib", "process_name", "descendants", "run_monitored"]

_MIB = 1024 * 1024


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children, grandchildren ...), from /proc."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        for task in _tasks(current):
            text = _read(f"/proc/{current}/task/{task}/children")
            for child in (text or "").split():
                out.append(int(child))
                todo.append(int(child))
    return out


def _tasks(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []


def peak_rss_mib(pid: int) -> tuple[float, float] | None:
    """(VmHWM, VmRSS) of `pid` in MiB, or None once it has exited."""
    text = _read(f"/proc/{pid}/status")
    if text is None:
        return None
    values = {}
    for line in text.splitlines():
        if line.startswith(("VmHWM:", "VmRSS:")):
            key, value = line.split(":", 1)
            values[key] = int(value.split()[0]) * 1024 / _MIB  # kB
    if "VmHWM" not in values:  # a zombie has no memory lines
        return None
    return values["VmHWM"], values.get("VmRSS", 0.0)


def process_name(pid: int) -> str:
    """recps role of `pid` ("server0", "worker1") from its environment, else "<exe>-<pid>"."""
    env = _read(f"/proc/{pid}/environ") or ""
    variables = dict(item.split("=", 1) for item in env.split("\0") if "=" in item)
    role = variables.get("RECPS_ROLE")
    if role:
        return f"{role}{variables.get('RECPS_INDEX', '')}"
    cmd = (_read(f"/proc/{pid}/cmdline") or "").split("\0")
    return f"{Path(cmd[0]).name if cmd and cmd[0] else 'process'}-{pid}"


class ProcessTreeMonitor:
    """Peak RSS of `root` and its descendants, polled every `interval_s` (see the module docstring)."""

    def __init__(self, root: int, interval_s: float = 0.25, root_name: str = "main") -> None:
        self.root = int(root)
        self.interval_s = float(interval_s)
        self.root_name = root_name
        self._seen: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recps-procmon", daemon=True)

    def start(self) -> "ProcessTreeMonitor":
        self.poll()
        self._thread.start()
        return self

    def poll(self) -> None:
        """One read of the tree (the thread calls it every interval_s)."""
        for pid in [self.root, *descendants(self.root)]:
            memory = peak_rss_mib(pid)
            if memory is None:
                continue
            entry = self._seen.get(pid)
            if entry is None:
                entry = self._seen[pid] = {"name": self.root_name, "pid": pid, "peak_rss_mib": 0.0, "role": False}
            if pid != self.root and not entry["role"]:  # first seen between fork and exec: read again
                entry["name"] = process_name(pid)
                entry["role"] = not entry["name"].endswith(f"-{pid}")
            entry["peak_rss_mib"] = round(max(entry["peak_rss_mib"], memory[0]), 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def stop(self) -> list[dict[str, Any]]:
        """Stops polling; every process seen, in the order first seen, with its peak RSS (MiB)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        return [{k: v for k, v in e.items() if k != "role"} for e in self._seen.values()]


def run_monitored(command: list[str], cwd: str | Path, label: str, timeout_s: float) -> tuple[str, list, float]:
    """Runs `command` in its own process group under a ProcessTreeMonitor.

    Returns (stdout, the monitor's processes, wall seconds). A timeout kills the whole group
    (servers and workers too); a non-zero exit raises with the output's tails. `label` names
    the run in those errors.
    """
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own group: a timeout stops servers and workers too
    monitor = ProcessTreeMonitor(proc.pid).start()
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        monitor.stop()
        raise RuntimeError(f"{label}: no result within {timeout_s:g} s; stopped it") from None
    processes = monitor.stop()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{label}: run failed:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return stdout, processes, wall
