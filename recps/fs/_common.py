"""What every recps.fs backend shares: the error classes, the timeout, the transient test, the bound.

A call that reached no answer is *transient* (worth another attempt): a refused, reset or
broken connection, a timeout, an HTTP 5xx without a definite answer, or a NameNode that says
"try again" (SafeModeException, StandbyException, RetriableException, NotReplicatedYetException:
a new block asked for before the DataNode reported the last one, which Hadoop's own client retries
and hdfs-native does not). A definite answer never
is: a missing path, an existing target, a refused permission, a bad argument.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import requests
from fsspec.spec import _Cached

from recps.errors import RecpsError

__all__ = ["FileSystemError", "TransientFileSystemError", "FileSystemTimeoutError", "DEFAULT_TIMEOUT_S",
           "TIMEOUT_ENV", "timeout_s", "is_transient", "bounded", "first_line", "retry_transient"]

DEFAULT_TIMEOUT_S = 60.0
TIMEOUT_ENV = "RECPS_FS_TIMEOUT_S"

# Server-side exceptions (Java simple names) that mean "not now", not "no".
RETRIABLE_REMOTE = frozenset({"RetriableException", "StandbyException", "SafeModeException",
                              "ObserverRetryOnActiveException", "NotReplicatedYetException"})
MAX_BACKOFF_S = 30.0

log = logging.getLogger("recps.fs")
# Messages of the bare OSErrors hdfs-native raises for its sockets ("Connection refused (os error 111)").
_TRANSIENT_TEXT = re.compile(r"connection refused|connection reset|connection aborted|broken pipe|timed out|"
                             r"unexpected eof|network is unreachable|no route to host", re.IGNORECASE)

_REQUESTS_REASON = re.compile(r"\[Errno -?\d+\][^'\"()]*|Read timed out|Connection aborted|Connection reset by peer|"
                              r"Remote end closed connection without response")

T = TypeVar("T")


class FileSystemError(RecpsError, OSError):
    """A file system call failed or was refused; the message names the URL and the fix."""


class TransientFileSystemError(FileSystemError):
    """A call got no definite answer (unreachable, reset, timed out, 5xx, NameNode busy): retrying may help."""


class FileSystemTimeoutError(TransientFileSystemError, TimeoutError):
    """A call got no answer within its timeout."""


def timeout_s(value: float | str | None = None) -> float:
    """The per-request timeout in seconds: `value`, else $RECPS_FS_TIMEOUT_S, else 60; always > 0."""
    where = "timeout_s"
    if value is None:
        value, where = os.environ.get(TIMEOUT_ENV), TIMEOUT_ENV
        if value is None or value == "":
            return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise FileSystemError(f"{where}={value!r}: the file system timeout must be a positive number of "
                              f"seconds; set it to e.g. {DEFAULT_TIMEOUT_S:g}")
    return seconds


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` is a call that got no definite answer (see the module docstring)."""
    if isinstance(exc, TransientFileSystemError):
        return True
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                        NotADirectoryError, FileSystemError)):
        return False
    if isinstance(exc, requests.exceptions.SSLError):
        return False
    if isinstance(exc, (requests.ConnectionError, requests.Timeout)):
        return True
    if isinstance(exc, requests.HTTPError):
        return exc.response is not None and exc.response.status_code >= 500
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    return isinstance(exc, OSError) and bool(_TRANSIENT_TEXT.search(str(exc)))


def first_line(exc: BaseException, limit: int = 300) -> str:
    """`exc` as one short line: the class and the first line of its message (no Java stack trace).

    A requests error is cut down to its reason ("[Errno 111] Connection refused", "Read timed
    out"): its message repeats the whole URL and the urllib3 wrapper classes."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, requests.RequestException):
        reason = _REQUESTS_REASON.search(text)
        text = reason.group(0).strip() if reason else text
    text = text if len(text) <= limit else text[:limit] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def bounded(fn: Callable[[], T], seconds: float, what: str, hint: str = "is the server up and answering?") -> T:
    """fn() run in a worker thread, its result awaited at most `seconds`.

    The outer bound for clients whose own timeouts do not cover every wait (hdfs-native waits
    for a NameNode that accepted the connection but never answers). On timeout a
    FileSystemTimeoutError naming `what` is raised; the worker is left to finish or hang on
    its own (a daemon thread: it never keeps the process alive). fn's own error is re-raised.
    """
    box: dict[str, object] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name=f"recps.fs {what}"[:60], daemon=True).start()
    if not done.wait(seconds):
        raise FileSystemTimeoutError(f"{what}: no answer within timeout_s={seconds:g} s; {hint} "
                                     f"(raise the bound with timeout_s= or ${TIMEOUT_ENV})")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def retry_transient(fn: Callable[[], T], what: str, retries: int = 2, backoff_s: float = 0.5) -> T:
    """fn(), tried again up to `retries` more times after backoff_s, 2 x backoff_s, ... (at most
    MAX_BACKOFF_S) while it fails transiently (`is_transient`); a definite failure, or the last
    transient one, is raised as it is. `fn` must be safe to repeat (a whole atomic write)."""
    for attempt in range(1, retries + 2):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified right here
            if not is_transient(e) or attempt > retries:
                raise
            pause = min(backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
            log.warning("%s: attempt %d/%d failed (%s); again in %.2f s", what, attempt, retries + 1,
                        first_line(e), pause)
            time.sleep(pause)
    raise AssertionError("unreachable")  # pragma: no cover


class SharedAcrossThreads(_Cached):
    """The metaclass of the bounded HDFS file systems: one instance per process and arguments.

    fsspec caches a synchronous file system per *thread* (its instance token holds
    threading.get_ident()) and never lets one go, so every new thread that resolves an hdfs://
    URL (a save's thread pool, each bounded call) built another file system, and with it another
    hdfs-native Client and its Rust runtime: measured, a stream worker grew 3-6 MiB a pass (2.36
    GiB after 24 passes in one process holding a server and a worker). The clients here are
    used from many threads anyway (every call runs in a worker thread, `bounded`), so one per
    process is enough; a forked child makes its own (the key holds the pid)."""

    _shared: dict = {}
    _lock = threading.Lock()

    def __call__(cls, *args, **kwargs):
        key = (cls, os.getpid(), args, tuple(sorted((str(k), repr(v)) for k, v in kwargs.items())))
        with SharedAcrossThreads._lock:
            fs = SharedAcrossThreads._shared.get(key)
            if fs is None:
                fs = SharedAcrossThreads._shared[key] = super().__call__(*args, **kwargs)
        return fs

