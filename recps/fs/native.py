"""HDFS over its native RPC (hdfs-native: Rust, no JVM) as fsspec's `hdfs`, with every call bounded.

hdfs-native's own limits, measured against Hadoop 2.7.3 (hdfs-native 0.14.7):

- a NameNode that refuses connections is retried by the client forever (about once a second)
  unless `dfs.client.failover.max.attempts` is set; here it defaults to 1 and the sleep
  before that retry (`dfs.client.failover.sleep.base.millis`, randomized) to 100 ms, so that
  a refusal surfaces within about 0.2-0.6 s and the caller's retry policy decides;
- a NameNode that accepts the connection but never answers is waited for forever:
  `dfs.client.socket-timeout` bounds only DataNode sockets. So every client call (each
  NameNode RPC, each block of a read or write) runs in a worker thread awaited at most
  `timeout_s` (recps.fs._common.bounded); a timed-out call raises FileSystemTimeoutError and
  its thread is abandoned (a daemon thread);
- a Client used in a forked child hangs, and so does one dropped there (its runtime's threads
  stayed in the parent): the bounded client here builds a fresh Client in a child before its
  first call, and a child keeps the Clients it inherited alive for good (never dropped);
- its errors: FileNotFoundError / FileExistsError / PermissionError as such, anything else the
  NameNode refuses as RuntimeError('RPCError("<java class>", "<message + stack>")'), sockets as
  a bare OSError('Connection refused (os error 111)') with no address. Here the first become
  FileSystemError (TransientFileSystemError for SafeMode/Standby/Retriable) with the Java class
  and the message's first line, the second a TransientFileSystemError naming host:port;
- its fsspec class parses paths with urlparse, so a '?' or '#' in a path (a glob pattern's
  '?') cut it short; the paths here keep them;
- rename(src, dst) never moves into an existing directory (the destination is the new name) and
  with overwrite=True replaces a file atomically (WebHDFS cannot).
"""

from __future__ import annotations

import io
import os
import re
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import hdfs_native
import hdfs_native.fsspec as _hn_fsspec

from recps.fs._common import (RETRIABLE_REMOTE, FileSystemError, SharedAcrossThreads, TransientFileSystemError, bounded,
                              first_line, is_transient)
from recps.fs._common import timeout_s as _timeout

__all__ = ["HdfsFileSystem", "ViewfsFileSystem", "BoundedClient", "DEFAULT_CONFIG"]

# Set unless the caller's config names them (see the module docstring).
DEFAULT_CONFIG = {"dfs.client.failover.max.attempts": "1", "dfs.client.failover.sleep.base.millis": "100"}
# Reads and writes move at most this much per bounded call, so that timeout_s bounds a wait for
# bytes, not a whole transfer.
CHUNK = 8 * 2**20
_RPC_ERROR = re.compile(r'RPCError\("([\w.$]+)",\s*"(.*)', re.DOTALL)

# Dropping an hdfs-native Client in a forked child waits for ever for its runtime's threads,
# which stayed in the parent (measured: a child hung in RawClient's tp_dealloc ->
# BlockingPool::shutdown when fsspec's own at-fork hook cleared its instance cache). So each
# Client made here is tracked; just before a fork the parent holds them all strongly, and the
# child keeps that hold for good (unusable there, never dropped); the parent lets go after.
_LIVE: weakref.WeakSet = weakref.WeakSet()
_HELD: list = []


def _hold() -> None:
    _HELD.extend(_LIVE)


def _release_in_parent() -> None:
    _HELD.clear()


os.register_at_fork(before=_hold, after_in_parent=_release_in_parent)


def _client(url: str, config: dict[str, str]) -> hdfs_native.Client:
    client = hdfs_native.Client(url, config)
    _LIVE.add(client)
    return client


class BoundedClient:
    """hdfs-native's Client with every call bounded by `timeout_s` and its errors named.

    Method calls are forwarded; each runs in a worker thread (recps.fs._common.bounded); a
    listing iterator is drained inside that call; readers and writers come back bounded too.
    A forked child gets a fresh Client on its first call.
    """

    def __init__(self, url: str, config: dict[str, str], timeout_s: float) -> None:
        self.url, self.config, self.timeout_s = url, dict(config), timeout_s
        self._client = _client(url, self.config)
        self._pid = os.getpid()

    def _inner(self) -> hdfs_native.Client:
        if os.getpid() != self._pid:
            self._client, self._pid = _client(self.url, self.config), os.getpid()  # the old one stays in _HELD
        return self._client

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """fn() bounded by timeout_s, its hdfs-native errors turned into named ones (module docstring)."""
        return call_bounded(self.url, what, fn, self.timeout_s)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner(), name)
        if not callable(attr):
            return attr

        def forward(*args: Any, **kwargs: Any) -> Any:
            what = f"{name}({', '.join(repr(a) for a in args[:2])})"
            result = self.call(what, lambda: _drain(attr(*args, **kwargs)))
            if isinstance(result, hdfs_native.FileReader):
                return BoundedReader(result, self, what)
            if isinstance(result, hdfs_native.FileWriter):
                return BoundedWriter(result, self, what)
            return result

        return forward


def call_bounded(url: str, what: str, fn: Callable[[], Any], timeout_s: float) -> Any:
    """fn() bounded by timeout_s, its hdfs-native errors named (see the module docstring)."""
    hostport = url.partition("://")[2].split("/")[0]
    hint = f"is the NameNode up at {hostport} (its RPC port, fs.defaultFS / dfs.namenode.rpc-address)?"
    try:
        return bounded(fn, timeout_s, f"{what} on {url}", hint=f"{hint} Or a DataNode hung.")
    except (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError,
            FileSystemError):
        raise
    except RuntimeError as e:
        m = _RPC_ERROR.search(str(e))
        if m is None:
            raise
        java, message = m.group(1), m.group(2).split("\\n")[0].split("\n")[0].rstrip('")')
        cls = TransientFileSystemError if java.rsplit(".", 1)[-1] in RETRIABLE_REMOTE else FileSystemError
        raise cls(f"{what} on {url}: {java.rsplit('.', 1)[-1]}: {message}") from e
    except OSError as e:
        if not is_transient(e):
            raise
        raise TransientFileSystemError(f"{what} on {url}: {first_line(e)}; {hint}") from e


def _drain(result: Any) -> Any:
    """A listing iterator as a list (its pages are RPCs: they must run inside the bounded call)."""
    if isinstance(result, Iterator) and not isinstance(result, io.IOBase):
        return list(result)
    return result


class BoundedReader(io.RawIOBase):
    """An hdfs-native FileReader whose every read (at most CHUNK bytes a call) is bounded."""

    def __init__(self, inner: hdfs_native.FileReader, client: BoundedClient, what: str) -> None:
        super().__init__()
        self._inner, self._client, self._what = inner, client, what

    def __len__(self) -> int:
        return len(self._inner)

    @property
    def size(self) -> int:
        return len(self._inner)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._inner.seek(offset, whence)  # local: moves the position, no RPC
        return self._inner.tell()

    def tell(self) -> int:
        return self._inner.tell()

    def read(self, size: int = -1) -> bytes:
        want = len(self._inner) - self._inner.tell() if size is None or size < 0 else size
        parts = []
        while want > 0:
            part = self._client.call(f"read {self._what}", lambda n=min(want, CHUNK): self._inner.read(n))
            if not part:
                break
            parts.append(part)
            want -= len(part)
        return b"".join(parts)

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def read_range(self, offset: int, length: int) -> bytes:
        parts, end = [], offset + length
        while offset < end:
            n = min(end - offset, CHUNK)
            parts.append(self._client.call(f"read {self._what}",
                                           lambda o=offset, n=n: self._inner.read_range(o, n)))
            offset += n
        return b"".join(parts)


class BoundedWriter(io.RawIOBase):
    """An hdfs-native FileWriter whose writes (at most CHUNK bytes a call), hsync and close are bounded."""

    def __init__(self, inner: hdfs_native.FileWriter, client: BoundedClient, what: str) -> None:
        super().__init__()
        self._inner, self._client, self._what = inner, client, what

    def writable(self) -> bool:
        return True

    def write(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        for start in range(0, len(view), CHUNK):
            piece = bytes(view[start:start + CHUNK])
            self._client.call(f"write {self._what}", lambda p=piece: self._inner.write(p))
        return len(view)

    def hsync(self) -> None:
        self._client.call(f"hsync {self._what}", self._inner.hsync)

    def close(self) -> None:
        if not self.closed:
            try:
                self._client.call(f"close {self._what}", self._inner.close)
            finally:
                super().close()


class _Bounded:
    """The fsspec class of hdfs-native with a BoundedClient (see the module docstring).

    `timeout_s` bounds each NameNode call and each block moved (default $RECPS_FS_TIMEOUT_S
    or 60 s); other keyword arguments are Hadoop configuration (strings), over DEFAULT_CONFIG.
    """

    def __init__(self, host: str | None = None, port: int | None = None, *, timeout_s: float | None = None,
                 **config: Any) -> None:
        self.timeout_s = _timeout(timeout_s)
        config = {**DEFAULT_CONFIG, **{str(k): str(v) for k, v in config.items()}}
        super().__init__(host, port, **config)
        self.client = BoundedClient(self.unstrip_protocol("/").rstrip("/"), config, self.timeout_s)

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        """The path of a URL, everything after host:port: '?' and '#' are path characters here.

        hdfs-native's uses urlparse, which cuts "/d/part-?.bin" at the "?" (a query) and so
        breaks glob patterns and any name with those characters."""
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        head, sep, rest = path.partition("://")
        if sep:
            path = "/" + rest.partition("/")[2]
        return path or cls.root_marker

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        """Rename to exactly `path2`; an existing `path2` is FileExistsError unless overwrite=True
        (hdfs-native answers a file onto a directory with an IOException)."""
        try:
            super().mv(path1, path2, **kwargs)
        except FileSystemError as e:
            if not kwargs.get("overwrite") and self.exists(path2):
                raise FileExistsError(f"rename {self._strip_protocol(path1)} -> {self._strip_protocol(path2)} on "
                                      f"{self.client.url}: the destination exists ({e})") from e
            raise

    def exists(self, path: str, **kwargs: Any) -> bool:
        try:
            self.info(path)
        except FileNotFoundError:
            return False
        return True

    def isdir(self, path: str) -> bool:
        try:
            return self.info(path)["type"] == "directory"
        except FileNotFoundError:
            return False

    def isfile(self, path: str) -> bool:
        try:
            return self.info(path)["type"] == "file"
        except FileNotFoundError:
            return False


class HdfsFileSystem(_Bounded, _hn_fsspec.HdfsFileSystem, metaclass=SharedAcrossThreads):
    """hdfs:// through hdfs-native, every call bounded (see the module docstring)."""


class ViewfsFileSystem(_Bounded, _hn_fsspec.ViewfsFileSystem, metaclass=SharedAcrossThreads):
    """viewfs:// through hdfs-native, every call bounded (see the module docstring)."""
