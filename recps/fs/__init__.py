"""File systems through fsspec: every path the engine reads or writes is a URL.

    /abs/or/relative/path, file:///abs/path       this machine's disk
    hdfs://namenode:8020/path                     HDFS over its native RPC (hdfs-native, no JVM)
    webhdfs://namenode:50070/path                 HDFS over WebHDFS (pure HTTP, fork-safe)
    memory://path                                 this process's memory (tests)
    s3://bucket/path, gs://...                    any fsspec protocol whose package is installed

`hdfs://` is chosen here, on purpose: fsspec's own `hdfs` is pyarrow's libhdfs (a JVM in the
process) and installing hdfs-native re-registers the protocol by entry point; `resolve` makes
it hdfs-native whatever is installed (recps.fs.native's bounded class), and says how to get it
when it is not. `webhdfs://` is recps.fs.webhdfs's class (fsspec's, with exact errors).

No call on HDFS waits forever: every request of a file system from `resolve` carries a timeout
(`timeout_s=` option, else $RECPS_FS_TIMEOUT_S, else 60 s; a bound on each wait for an answer
or for bytes, not on a whole transfer). An unreachable NameNode raises an OSError naming its
host:port (TransientFileSystemError; FileSystemTimeoutError when it accepted but never
answered). `exists` answers False only for a missing path, never for an unreachable one.
For the verbs of Paddle's HDFSClient with retries, see recps.fs.hdfs.HDFSClient.

A writer killed mid-write leaves its temporary behind; `sweep_temporaries(folder)` removes those
no live writer can be using (the checkpoint writers and readers call it on their folders).

Writes that must be atomic (a manifest, a commit record) go through `write_atomic`: the bytes
go to a hidden temporary beside the target, which is then renamed into place; the temporary
is removed on failure, and the error names the target, the reason (No space left on device,
Permission denied ...) and what is there now (`write_error`). An existing record is refused
unless overwrite=True, so layouts write
one file per record; replacing is atomic on local disks and hdfs:// (a rename with OVERWRITE),
three renames on webhdfs:// (WebHDFS RENAME cannot overwrite; the old record is never lost).
"""

from __future__ import annotations

import os
import posixpath
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Sequence

import fsspec
from fsspec.implementations.local import LocalFileSystem

from recps.fs._common import (DEFAULT_TIMEOUT_S, TIMEOUT_ENV, FileSystemError, FileSystemTimeoutError,
                              TransientFileSystemError, first_line, is_transient, retry_transient, timeout_s)
from recps.fs.stale import TEMPORARY_RE, is_temporary, sweep as _sweep_folder
from recps.fs.webhdfs import WebHDFS

__all__ = ["FileSystemError", "TransientFileSystemError", "FileSystemTimeoutError", "FileSystemPermissionError",
           "FileSystemNotFoundError", "FileSystemIsADirectoryError", "FileSystemNotADirectoryError", "resolve", "join",
           "is_local", "local_path", "display", "write_atomic", "fsync_dir", "read_bytes", "exists", "timeout_s",
           "concurrently", "retry_transient", "sweep_temporaries", "is_temporary", "TEMPORARY_RE", "is_transient", "write_error", "HDFSClient", "HDFS_PROTOCOLS", "WEBHDFS_PROTOCOLS", "DEFAULT_TIMEOUT_S", "TIMEOUT_ENV"]

HDFS_PROTOCOLS = ("hdfs", "viewfs")
WEBHDFS_PROTOCOLS = ("webhdfs", "webHDFS")
_registered: set[str] = set()


def _register(protocol: str) -> None:
    """hdfs:// and viewfs:// -> recps.fs.native (hdfs-native, bounded), webhdfs:// -> recps.fs.webhdfs.

    Registered in fsspec's table too (once), so that fsspec.open() elsewhere in the process gets
    the same classes. An hdfs:// without hdfs-native installed stays unregistered (resolve says)."""
    if protocol in _registered:
        return
    if protocol in HDFS_PROTOCOLS:
        try:
            # deferred: hdfs-native (optional) is imported only when an hdfs:// URL is used
            from recps.fs.native import HdfsFileSystem, ViewfsFileSystem
        except ImportError:
            return
        classes = {"hdfs": HdfsFileSystem, "viewfs": ViewfsFileSystem}
    else:
        classes = dict.fromkeys(WEBHDFS_PROTOCOLS, WebHDFS)
    for name, cls in classes.items():
        fsspec.register_implementation(name, cls, clobber=True)
        _registered.add(name)


def _protocol(url: str) -> str:
    head, sep, _ = url.partition("://")
    return head.lower() if sep else "file"


def resolve(url: str | os.PathLike, **options: Any) -> tuple[fsspec.AbstractFileSystem, str]:
    """(file system, path inside it) for a path or URL; `options` go to the file system.

    `timeout_s` (default $RECPS_FS_TIMEOUT_S, else 60) bounds each request on hdfs://, viewfs://
    and webhdfs:// (other protocols keep their own settings and ignore it). On webhdfs:// the
    user defaults to $HADOOP_USER_NAME, else the login name (as hdfs-native's); `user=` sets it.
    """
    url = os.fspath(url)
    protocol = _protocol(url)
    seconds = timeout_s(options.pop("timeout_s", None))
    if protocol in HDFS_PROTOCOLS or protocol in ("webhdfs",):
        _register(protocol)
        if protocol not in _registered:
            raise FileSystemError(f"{url}: {protocol}:// needs the hdfs-native package (`pip install "
                                  "hdfs-native`), or use webhdfs://<namenode>:<http port>/... (WebHDFS over HTTP)")
        options["timeout_s"] = seconds
    try:
        return fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as e:
        raise FileSystemError(f"{url}: no file system for protocol {protocol!r} ({e}); install its fsspec "
                              "package (s3fs for s3://, gcsfs for gs://) or give a local path") from e


def is_local(url: str | os.PathLike) -> bool:
    """Whether `url` is a plain path or a file:// (local://) URL."""
    return _protocol(os.fspath(url)) in ("file", "local")


def local_path(url: str | os.PathLike) -> str | None:
    """The local path of a plain path or file:// URL; None for any other protocol."""
    url = os.fspath(url)
    if not is_local(url):
        return None
    return url.partition("://")[2] if "://" in url else url


def join(url: str | os.PathLike, *parts: str) -> str:
    """`url` with path components appended ('/' on every protocol; plain paths stay plain)."""
    url = os.fspath(url)
    if not parts:
        return url
    if "://" not in url:
        return os.path.join(url, *parts)
    return posixpath.join(url.rstrip("/") if url.rstrip("/").count("/") > 2 else url, *parts)


def display(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """What messages show for a path of `fs`: the local path, else the full URL."""
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


def exists(url: str | os.PathLike) -> bool:
    """Whether `url` exists; False only for a missing path (an unreachable HDFS raises)."""
    fs, path = resolve(url)
    return fs.exists(path)


def read_bytes(url: str | os.PathLike) -> bytes:
    """The bytes of file `url`; a missing file raises FileSystemError naming it."""
    fs, path = resolve(url)
    try:
        return fs.cat_file(path)
    except FileNotFoundError as e:
        raise FileSystemError(f"{display(fs, path)} does not exist") from e


class FileSystemPermissionError(FileSystemError, PermissionError):
    """A write refused for its permissions (write_error's PermissionError): both a recps error and a PermissionError."""


class FileSystemNotFoundError(FileSystemError, FileNotFoundError):
    """A write whose folder vanished (write_error's FileNotFoundError)."""


class FileSystemIsADirectoryError(FileSystemError, IsADirectoryError):
    """A write onto a folder (write_error's IsADirectoryError)."""


class FileSystemNotADirectoryError(FileSystemError, NotADirectoryError):
    """A write under a file taken for a folder (write_error's NotADirectoryError)."""


# The class write_error raises for each of Python's OSError classes: a recps error (entry points
# print it on one line) that still is what the caller may catch.
_WRITE_ERRORS: dict[type, type] = {OSError: FileSystemError, PermissionError: FileSystemPermissionError,
                                   FileNotFoundError: FileSystemNotFoundError,
                                   IsADirectoryError: FileSystemIsADirectoryError,
                                   NotADirectoryError: FileSystemNotADirectoryError}


def write_error(exc: BaseException, target: str, kept: str | Callable[[], str]) -> BaseException:
    """What to raise for a write of `target` (as messages show it) that failed with `exc`:
    "cannot write <target>: <exc's class and first line>; <kept>" (`kept`: what the failure
    left there: the old file, nothing, ...; a callable is asked only when the message is made),
    errno kept, as a FileSystemError that also is exc's class (a PermissionError stays one:
    FileSystemPermissionError), or exc's own class where that is none of Python's. Anything but
    an OSError, a transient failure (is_transient: worth retrying, and no more calls to a sick
    file system) and FileExistsError (a refusal, already naming the target) are returned as
    they are, so the callers' retry and refusal logic still sees them."""
    if not _names_the_target(exc):
        return exc
    if callable(kept):
        try:
            kept = kept()
        except Exception as e:  # noqa: BLE001 - the write's own error matters more
            kept = f"what is left there is unknown ({first_line(e)})"
    message = f"cannot write {target}: {first_line(exc)}; {kept}"
    cls = type(exc) if isinstance(exc, FileSystemError) else _WRITE_ERRORS.get(type(exc), type(exc))
    try:
        new = cls(message)
    except Exception:  # noqa: BLE001 - a class that takes other arguments
        new = FileSystemError(message)
    if not isinstance(new, OSError) or str(new) != message:
        new = FileSystemError(message)
    new.errno = exc.errno
    new.__cause__ = exc
    return new


def _names_the_target(exc: BaseException) -> bool:
    """Whether write_error rewrites `exc` (a definite OSError other than a refusal)."""
    return isinstance(exc, OSError) and not isinstance(exc, FileExistsError) and not is_transient(exc)


def sweep_temporaries(url: str | os.PathLike, fs: fsspec.AbstractFileSystem | None = None) -> list[str]:
    """Remove the stale temporaries a killed writer left directly in folder `url` (recps's own
    atomic-write names only, none a live writer may be using; see recps.fs.stale), logging each;
    returns the paths removed. With `fs`, `url` is a path of that file system. Never raises for
    what it cannot list or remove (it logs it): saves and loads call it before they start."""
    if fs is None:
        fs, path = resolve(url)
    else:
        path = os.fspath(url)
    return _sweep_folder(fs, path)


def write_atomic(url: str | os.PathLike, data: bytes | str, *, overwrite: bool = False) -> str:
    """Write `data` to `url` so that readers see no file or the whole file; returns the URL.

    A temporary beside the target is written, flushed and renamed into place; on failure it is
    removed. With overwrite=False an existing target is refused (FileExistsError) and left as it
    is, also one that appears while the temporary is written (local disks and HDFS: the rename
    refuses it). overwrite=True replaces the target atomically on local disks and hdfs://
    (a rename with OVERWRITE); elsewhere (webhdfs://, memory://) the old file is renamed aside
    first and deleted after: readers may briefly find no file, never a partial one, and a
    failed replace leaves the old record in place. A failed write (a full disk, a refused
    permission) raises naming the target and what is left there (`write_error`)."""
    url = os.fspath(url)
    payload = data.encode() if isinstance(data, str) else bytes(data)
    fs, path = resolve(url)
    local = isinstance(fs, LocalFileSystem)
    parent, name = os.path.split(path) if local else posixpath.split(path.rstrip("/"))
    tmp = (os.path.join if local else posixpath.join)(parent, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    refused = f"{display(fs, path)} exists; it is a committed record and is never overwritten (overwrite=False)"
    if not overwrite and fs.exists(path):
        raise FileExistsError(refused)
    renamed = False  # whether the target already holds the new bytes
    try:
        fs.makedirs(parent, exist_ok=True)
        if local:
            with open(tmp, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            if overwrite:
                os.replace(tmp, path)
            else:
                try:
                    os.link(tmp, path)  # fails if the target appeared meanwhile: no overwrite, atomic
                except FileExistsError as e:
                    raise FileExistsError(refused) from e
                os.unlink(tmp)
            renamed = True
            fsync_dir(parent)
        else:
            with fs.open(tmp, "wb") as f:
                f.write(payload)
            if overwrite and _renames_over(fs):
                fs.mv(tmp, path, overwrite=True)
            elif fs.exists(path):
                if not overwrite:
                    raise FileExistsError(refused)
                _replace_by_renames(fs, tmp, path)
            else:
                fs.mv(tmp, path)
    except BaseException as exc:
        removed = _remove_quietly(fs, tmp)
        if not _names_the_target(exc):  # a refusal, a transient failure (retried by callers), an interrupt
            raise
        raise write_error(exc, display(fs, path), lambda: _what_is_left(fs, path, display(fs, tmp), renamed, removed)) from exc
    return url


def _remove_quietly(fs: fsspec.AbstractFileSystem, tmp: str) -> bool:
    """Remove the temporary `tmp` if it is there; whether none is left."""
    try:
        if fs.exists(tmp):
            fs.rm_file(tmp)
        return True
    except Exception:  # noqa: BLE001 - the original error matters more
        return False


def _what_is_left(fs: fsspec.AbstractFileSystem, path: str, tmp: str, renamed: bool, removed: bool) -> str:
    """For a failed write_atomic: what is at the target now, and of the temporary."""
    if renamed:
        there = "the new file is in place (only flushing the folder failed)"
    else:
        try:
            there = ("the file there is as it was before this write" if fs.exists(path)
                     else "nothing was written there")
        except Exception:  # noqa: BLE001 - the original error matters more
            there = "the file there is as it was before this write, or absent"
    return f"{there}; " + ("the temporary was removed" if removed else f"the temporary {tmp} is left: delete it")


def _replace_by_renames(fs: fsspec.AbstractFileSystem, tmp: str, path: str) -> None:
    """tmp -> path over an existing path where a rename cannot overwrite: the old file is moved
    aside, the new one renamed in, the old one deleted; if the second rename fails the old one is
    moved back. Readers may find no file in between, never a partial one, and a failure never
    loses the old record."""
    aside = f"{tmp}.old"
    fs.mv(path, aside)
    try:
        fs.mv(tmp, path)
    except BaseException:
        try:
            fs.mv(aside, path)
        except Exception:  # noqa: BLE001 - the original error matters more; the old record stays at `aside`
            pass
        raise
    fs.rm_file(aside)


def _renames_over(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether fs.mv(a, b, overwrite=True) replaces b atomically (hdfs-native's Rename2 OVERWRITE)."""
    try:
        from hdfs_native.fsspec import BaseFileSystem  # deferred: hdfs-native is optional
    except ImportError:
        return False
    return isinstance(fs, BaseFileSystem)


def concurrently(calls: Sequence[Callable[[], Any]], max_workers: int = 16) -> list[Any]:
    """Run `calls` (file system operations) in threads at once; their results in order.

    On HDFS a write's close waits for the NameNode to complete the file (a fixed latency, not
    bandwidth), so files closed together cost one wait. Every call ends: each request of a file
    system from `resolve` is bounded by its timeout. All calls finish before the first error
    (in call order) is raised, so no write is left running behind a caller that moved on."""
    if len(calls) <= 1:
        return [call() for call in calls]
    with ThreadPoolExecutor(min(max_workers, len(calls)), thread_name_prefix="recps-fs") as pool:
        futures = [pool.submit(call) for call in calls]
        wait(futures)
    for future in futures:
        if (error := future.exception()) is not None:
            raise error
    return [future.result() for future in futures]


def fsync_dir(path: str) -> None:
    """Flush a local folder's entries (a rename into it) to disk; a no-op where folders have no fd."""
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


from recps.fs.hdfs import HDFSClient  # noqa: E402 - it imports this package's parts
