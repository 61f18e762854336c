"""File systems through fsspec: every path the engine reads or writes is a URL.

    /abs/or/relative/path, file:///abs/path       this machine's disk
    hdfs://namenode:8020/path                     HDFS over its native RPC (hdfs-native, no JVM)
    webhdfs://namenode:50070/path                 HDFS over WebHDFS (pure HTTP, fork-safe)
    memory://path                                 this process's memory (tests)
    s3://bucket/path, gs://...                    any fsspec protocol whose package is installed

`hdfs://` is chosen here, on purpose: fsspec's own `hdfs` is pyarrow's libhdfs (a JVM in the
process) and installing hdfs-native re-registers the protocol by entry point; `resolve` makes
it hdfs-native whatever is installed, and says how to get it when it is not.

Writes that must be atomic (a manifest, a commit record) go through `write_atomic`: the bytes
go to a hidden temporary beside the target, which is then renamed into place; the temporary
is removed on failure. A rename never overwrites here (WebHDFS RENAME cannot): a record that
exists already is refused, so layouts write one file per record.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from recps.errors import RecpsError

__all__ = ["FileSystemError", "resolve", "join", "is_local", "local_path", "display", "write_atomic",
           "read_bytes", "exists", "HDFS_PROTOCOLS"]

HDFS_PROTOCOLS = ("hdfs", "viewfs")
_registered = False


class FileSystemError(RecpsError, OSError):
    """A file system call failed or was refused; the message names the URL and the fix."""


def _register_hdfs() -> None:
    """hdfs:// (and viewfs://) -> hdfs-native's fsspec class, explicitly."""
    global _registered
    if _registered:
        return
    try:
        from hdfs_native.fsspec import HdfsFileSystem
    except ImportError:
        return  # resolve() says what to install when an hdfs:// URL is used
    for protocol in HDFS_PROTOCOLS:
        fsspec.register_implementation(protocol, HdfsFileSystem, clobber=True)
    _registered = True


def _protocol(url: str) -> str:
    head, sep, _ = url.partition("://")
    return head.lower() if sep else "file"


def resolve(url: str | os.PathLike, **options: Any) -> tuple[fsspec.AbstractFileSystem, str]:
    """(file system, path inside it) for a path or URL; `options` go to the file system."""
    url = os.fspath(url)
    protocol = _protocol(url)
    if protocol in HDFS_PROTOCOLS:
        _register_hdfs()
        if not _registered:
            raise FileSystemError(f"{url}: hdfs:// needs the hdfs-native package (`pip install hdfs-native`), "
                                  "or use webhdfs://<namenode>:<http port>/... (WebHDFS over HTTP)")
    try:
        return fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as e:
        raise FileSystemError(f"{url}: no file system for protocol {protocol!r} ({e}); install its fsspec "
                              "package (s3fs for s3://, gcsfs for gs://) or give a local path") from e


def is_local(url: str | os.PathLike) -> bool:
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
    fs, path = resolve(url)
    return fs.exists(path)


def read_bytes(url: str | os.PathLike) -> bytes:
    fs, path = resolve(url)
    try:
        return fs.cat_file(path)
    except FileNotFoundError as e:
        raise FileSystemError(f"{display(fs, path)} does not exist") from e


def write_atomic(url: str | os.PathLike, data: bytes | str, *, overwrite: bool = False) -> str:
    """Write `data` to `url` so that readers see no file or the whole file; returns the URL.

    A temporary beside the target is written, flushed and renamed into place; on failure it is
    removed. With overwrite=False an existing target is refused (FileExistsError) and left as it
    is; overwrite=True replaces it atomically on local disks only, elsewhere by delete + rename."""
    url = os.fspath(url)
    payload = data.encode() if isinstance(data, str) else bytes(data)
    fs, path = resolve(url)
    parent, name = posixpath.split(path.rstrip("/")) if not isinstance(fs, LocalFileSystem) else os.path.split(path)
    tmp = (os.path.join if isinstance(fs, LocalFileSystem) else posixpath.join)(
        parent, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    if not overwrite and fs.exists(path):
        raise FileExistsError(f"{display(fs, path)} exists; it is a committed record and is never overwritten")
    fs.makedirs(parent, exist_ok=True)
    try:
        if isinstance(fs, LocalFileSystem):
            with open(tmp, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            if overwrite:
                os.replace(tmp, path)
            else:
                os.link(tmp, path)  # fails if the target appeared meanwhile: no overwrite, atomic
                os.unlink(tmp)
            _fsync_dir(parent)
        else:
            with fs.open(tmp, "wb") as f:
                f.write(payload)
            if fs.exists(path):
                if not overwrite:
                    raise FileExistsError(f"{display(fs, path)} exists; it is a committed record and is never overwritten")
                fs.rm_file(path)
            fs.mv(tmp, path)
    except BaseException:
        try:
            if fs.exists(tmp):
                fs.rm_file(tmp)
        except Exception:  # noqa: BLE001 - the original error matters more
            pass
        raise
    return url


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
