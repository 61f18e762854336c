"""Sweeping stale temporaries: what a writer killed mid-write (kill -9, OOM, power loss) left behind.

recps names every temporary of an atomic write one way, beside its target:

    .<name>.tmp-<pid>-<8 hex>          write_atomic's file, ShardWriter's shard folder,
                                       recps.job.checkpoint's staged files
    .<name>.tmp-<pid>-<8 hex>.old      write_atomic's old record, renamed aside (webhdfs, memory)
    .<name>.old-<pid>-<8 hex>          ShardWriter's replaced shard folder, before its removal

`sweep_temporaries(folder)` removes, in that one folder (not below), the entries with such a name
that no live writer can be using, and logs each one it removed; nothing else is ever touched.

On this machine's disk a temporary is stale when the process that made it is gone: its pid is
not running, or runs a process started after the temporary was last changed (the pid was reused);
and, in case the folder is shared with other machines (NFS), where a pid says nothing, it also
predates this process or was last changed more than STALE_AFTER_S ago. This process's own
temporaries are never stale (its writers may be running). Elsewhere (hdfs://, s3://, ...) the
writer's machine is unknown: a temporary is stale when it was last changed more than
REMOTE_STALE_AFTER_S ago. A failure to list or to remove is logged, never raised: a sweep is
housekeeping and never stops the save or load that asked for it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time

from fsspec.implementations.local import LocalFileSystem

__all__ = ["TEMPORARY_RE", "STALE_AFTER_S", "REMOTE_STALE_AFTER_S", "sweep", "is_temporary", "process_started"]

logger = logging.getLogger("recps.fs")

TEMPORARY_RE = re.compile(r"^\.(?P<target>.+)\.(?:tmp|old)-(?P<pid>\d+)-(?P<tag>[0-9a-f]{8})(?:\.old)?$")
STALE_AFTER_S = 60.0  # a dead writer's temporary this old is stale even if it is newer than this process
REMOTE_STALE_AFTER_S = 3600.0  # off this machine's disk only age tells


def is_temporary(name: str) -> bool:
    """Whether `name` (a base name) is one of recps's atomic-write temporaries."""
    return TEMPORARY_RE.match(name) is not None


def process_started(pid: int) -> float | None:
    """Unix time process `pid` started (Linux /proc), or None if it is not running or unknown.

    From its start in clock ticks since boot and the uptime now, both on the boot clock, so the
    answer is as good as a tick (10 ms); /proc/stat's btime is rounded to the second and drifts."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return time.time() - (uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22 of stat: starttime


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it runs
        return True
    return True


def _last_change_local(path: str) -> float:
    """Latest mtime of `path` and, for a folder, of its entries (a live writer keeps adding bytes)."""
    latest = os.lstat(path).st_mtime
    if os.path.isdir(path) and not os.path.islink(path):
        with os.scandir(path) as entries:
            for e in entries:
                try:
                    latest = max(latest, e.stat(follow_symlinks=False).st_mtime)
                except OSError:
                    pass
    return latest


def _stale_local(pid: int, changed: float, now: float, own_start: float | None) -> str | None:
    """Why the temporary of writer `pid`, last changed at `changed`, is stale; None if it may be live."""
    if pid == os.getpid():
        return None
    if _running(pid):
        started = process_started(pid)
        if started is None or started <= changed + 1.0:
            return None  # the writer (or a process that may be it) runs
        why = f"pid {pid} now belongs to a process started after it"
    else:
        why = f"its writer, pid {pid}, is not running"
    if own_start is not None and changed < own_start:
        return f"{why}; it predates this process"
    if now - changed > STALE_AFTER_S:
        return f"{why}; last changed {now - changed:.0f} s ago"
    return None  # a writer on another machine sharing the folder may still be at it


def _mtime(info: dict) -> float | None:
    for key in ("mtime", "modification_time", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            value = float(value)
        except (TypeError, ValueError):
            continue
        return value / 1000.0 if value > 1e11 else value  # HDFS reports milliseconds
    return None


def sweep(fs, folder: str) -> list[str]:
    """Remove the stale temporaries directly in `folder` of file system `fs` (see the module
    docstring); returns the paths removed. Logs each removal (WARNING) and any failure."""
    local = isinstance(fs, LocalFileSystem)
    try:
        if local:
            names = os.listdir(folder)
        else:
            names = [info["name"].rstrip("/").rsplit("/", 1)[-1] for info in fs.ls(folder, detail=True)]
    except FileNotFoundError:
        return []
    except Exception as e:  # noqa: BLE001 - housekeeping never fails the save or load that asked for it
        logger.warning("could not list %s for stale temporaries: %s", folder, e)
        return []
    candidates = [n for n in names if is_temporary(n)]
    if not candidates:
        return []
    now = time.time()
    own_start = process_started(os.getpid())
    removed = []
    for name in candidates:
        path = os.path.join(folder, name) if local else f"{folder.rstrip('/')}/{name}"
        pid = int(TEMPORARY_RE.match(name).group("pid"))
        try:
            if local:
                changed = _last_change_local(path)
                why = _stale_local(pid, changed, now, own_start)
            else:
                changed = _mtime(fs.info(path))
                why = (f"last changed {now - changed:.0f} s ago (> {REMOTE_STALE_AFTER_S:g} s)"
                       if changed is not None and now - changed > REMOTE_STALE_AFTER_S else None)
            if why is None:
                continue
            if local:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            else:
                fs.rm(path, recursive=True)
        except FileNotFoundError:  # another sweeper (a server beside this one) was first
            continue
        except Exception as e:  # noqa: BLE001 - as above
            logger.warning("could not remove the stale temporary %s: %s", path, e)
            continue
        logger.warning("removed the stale temporary %s: %s (a write interrupted by a crash)", path, why)
        removed.append(path)
    return removed
