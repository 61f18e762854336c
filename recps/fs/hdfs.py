"""HDFSClient: the verbs of Paddle's HDFSClient over WebHDFS or hdfs-native, with timeouts and retries.

    client = HDFSClient("webhdfs://namenode:50070", user="alice")   # HTTP, fork-safe (the default)
    client = HDFSClient("hdfs://namenode:8020")                     # native RPC (hdfs-native, no JVM)
    dirs, files = client.ls_dir("/data/day=20240101")
    client.upload("model/", "/ckpt/pass-7", overwrite=True)
    client.mv("/ckpt/tmp", "/ckpt/pass-7", overwrite=True)

No Hadoop install, no `hadoop fs` subprocess: WebHDFS is plain HTTP (requests), hdfs-native a
Rust client; both go through recps.fs's fsspec classes (recps.fs.webhdfs, recps.fs.native),
so resolve() and this client share one timeout and one error mapping.

Every call is bounded and retried:

- `timeout_s` (default $RECPS_FS_TIMEOUT_S or 60 s) bounds each request: connect and each wait
  for bytes on WebHDFS (a requests timeout on every request), each NameNode RPC and each block
  on hdfs-native (a worker thread awaited with a timeout). A transfer that keeps moving is
  never cut.
- A call that got no definite answer (refused, reset, timed out, HTTP 5xx, SafeMode / Standby /
  Retriable) is tried again, up to `retries` more times, after `backoff_s`, 2 x backoff_s, ...
  (at most 30 s). A definite answer (FileNotFoundError, FileExistsError, PermissionError, ...)
  is raised at once. After the last attempt: FileSystemError naming the verb, the URL, the
  attempts, the time spent and the cause, and asking whether the NameNode is up at host:port.
- A step that changes something is retried only where a repeat is safe: a rename whose answer
  was lost and whose source is gone while its destination exists counts as done; an upload
  goes to a hidden temporary beside the target (a fresh one per attempt, removed on failure)
  that is renamed into place, so readers never see a partial file; a download likewise.

Where this differs from Paddle's (which shells out to `hadoop fs`): paths are absolute (`/a/b`)
or URLs of the same NameNode host (`hdfs://nn:8020/a/b`, `hdfs:/a/b`); `cat` raises for a
missing file or a directory (Paddle's returns ""); `mkdirs` over a file raises (Paddle's
returns); `upload` / `download` copy one file at a time in this process (no multi_processes).
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from recps.fs._common import FileSystemError, first_line, is_transient, retry_transient
from recps.fs._common import timeout_s as _timeout
from recps.fs.webhdfs import WebHDFS

__all__ = ["HDFSClient", "BACKENDS"]

BACKENDS = ("webhdfs", "hdfs-native")
_SCHEMES = {"webhdfs": "webhdfs", "hdfs": "hdfs-native", "viewfs": "hdfs-native"}
_CHUNK = 8 * 2**20
log = logging.getLogger(__name__)
T = TypeVar("T")


class HDFSClient:
    """One HDFS cluster's files, through WebHDFS (`backend="webhdfs"`) or hdfs-native (`"hdfs-native"`).

    `url` names the NameNode: webhdfs://host:<http port> (50070 on Hadoop 2, 9870 on 3),
    hdfs://host:<rpc port> or viewfs://cluster, or host:<http port> (WebHDFS). `backend`
    defaults to the scheme's; it must agree with the scheme (the ports differ). `user` is whom
    the NameNode acts for on WebHDFS (default $HADOOP_USER_NAME, else the login name; hdfs-native
    reads the same). `config` is Hadoop configuration for hdfs-native (strings). `timeout_s`,
    `retries`, `backoff_s`: see the module docstring. Thread-safe; fork-safe on both backends
    (a forked child opens its own connections).
    """

    def __init__(self, url: str, *, backend: str | None = None, user: str | None = None,
                 timeout_s: float | None = None, retries: int = 2, backoff_s: float = 0.5,
                 config: dict[str, str] | None = None) -> None:
        url = os.fspath(url)
        parts = urlsplit(url if "://" in url else f"webhdfs://{url}")
        scheme = parts.scheme.lower()
        if scheme not in _SCHEMES or not parts.hostname:
            raise FileSystemError(f"HDFSClient({url!r}): not a NameNode URL; give webhdfs://host:<http port>, "
                                  "hdfs://host:<rpc port> or viewfs://cluster")
        if parts.path not in ("", "/"):
            raise FileSystemError(f"HDFSClient({url!r}): the URL names the NameNode only; drop the path "
                                  f"{parts.path!r} and pass paths to the verbs")
        backend = backend or _SCHEMES[scheme]
        if backend not in BACKENDS:
            raise FileSystemError(f"HDFSClient({url!r}, backend={backend!r}): backend is one of {BACKENDS}")
        if backend != _SCHEMES[scheme]:
            port = "the NameNode's HTTP port (dfs.namenode.http-address)" if backend == "webhdfs" else \
                "the NameNode's RPC port (fs.defaultFS)"
            want = "webhdfs" if backend == "webhdfs" else "hdfs"
            raise FileSystemError(f"HDFSClient({url!r}, backend={backend!r}): a {scheme}:// URL gives another "
                                  f"port than backend {backend!r} needs; give {want}://{parts.hostname}:<{port}>")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise FileSystemError(f"HDFSClient(retries={retries!r}): retries is a count >= 0 (extra attempts)")
        if not backoff_s >= 0:
            raise FileSystemError(f"HDFSClient(backoff_s={backoff_s!r}): backoff_s is seconds >= 0")
        self.backend, self.scheme, self.host, self.port = backend, scheme, parts.hostname, parts.port
        self.timeout_s, self.retries, self.backoff_s = _timeout(timeout_s), retries, float(backoff_s)
        self.address = f"{self.host}:{self.port}" if self.port else self.host
        self.base = f"{scheme}://{self.address}"
        if backend == "webhdfs":
            self.fs: Any = WebHDFS(self.host, self.port or 50070, user=user, timeout_s=self.timeout_s,
                                   skip_instance_cache=True)
        else:
            # deferred: hdfs-native (optional) is imported only when asked for
            from recps.fs.native import HdfsFileSystem, ViewfsFileSystem

            cls = ViewfsFileSystem if scheme == "viewfs" else HdfsFileSystem
            self.fs = cls(self.host, self.port, timeout_s=self.timeout_s, skip_instance_cache=True,
                          **(config or {}))

    def __repr__(self) -> str:
        return (f"HDFSClient({self.base!r}, backend={self.backend!r}, timeout_s={self.timeout_s:g}, "
                f"retries={self.retries})")

    # --- paths and attempts ----------------------------------------------------------------

    def url(self, path: str) -> str:
        """The full URL of `path` on this cluster (for messages and recps.fs.resolve)."""
        return self.base + self._path(path)

    def _path(self, path: str | os.PathLike) -> str:
        """`path` as an absolute, normalized HDFS path; a URL must name this NameNode's host."""
        text = os.fspath(path)
        parts = urlsplit(text)
        if parts.scheme:
            if parts.scheme.lower() not in _SCHEMES:
                raise FileSystemError(f"{text!r}: not an HDFS path; {self.base} takes /absolute/paths or "
                                      f"{self.scheme}:// URLs")
            if parts.hostname and parts.hostname != self.host:
                raise FileSystemError(f"{text!r} is on host {parts.hostname}, this client on {self.host}; "
                                      "use an HDFSClient for that NameNode")
            text = parts.path or "/"
        if not text.startswith("/"):
            raise FileSystemError(f"{text!r}: HDFS paths here are absolute (/user/name/...), or URLs of {self.base}")
        normal = posixpath.normpath(text)
        return "/" if normal in ("/", "//") else normal

    def _attempt(self, verb: str, path: str, fn: Callable[[], T]) -> T:
        """fn() with the retry policy (module docstring); definite answers are raised at once."""
        start, attempts = time.monotonic(), self.retries + 1
        try:
            return retry_transient(fn, f"HDFSClient.{verb}({self.url(path)})", self.retries, self.backoff_s)
        except Exception as e:  # noqa: BLE001 - classified right here
            if not is_transient(e):
                raise
            cause = str(e).strip().splitlines()[0] if isinstance(e, FileSystemError) else first_line(e)
            hint = "" if "is the NameNode up" in cause else f"; is the NameNode up at {self.address}?"
            raise FileSystemError(
                f"HDFSClient.{verb}({self.url(path)}): no answer after {attempts} attempt"
                f"{'s' if attempts > 1 else ''} in {time.monotonic() - start:.1f} s (timeout_s="
                f"{self.timeout_s:g}, retries={self.retries}, backend={self.backend}): {cause}{hint} "
                "Raise retries= / timeout_s= if the cluster is only slow.") from e

    def _info(self, verb: str, path: str) -> dict | None:
        """The file status of `path`, None when it does not exist."""
        def info() -> dict | None:
            try:
                return self.fs.info(path)
            except FileNotFoundError:
                return None
        return self._attempt(verb, path, info)

    def _entries(self, verb: str, path: str) -> list[dict]:
        """The statuses inside directory `path` (a file: itself), each with an absolute "name"."""
        entries = self._attempt(verb, path, lambda: self.fs.ls(path, detail=True))
        for entry in entries:
            entry["name"] = self._path(entry["name"])
        return sorted(entries, key=lambda e: e["name"])

    # --- asking ------------------------------------------------------------------------------

    def info(self, path: str) -> dict:
        """{"path", "type": "file" | "directory", "size", "modified" (ms since the epoch)} of `path`."""
        p = self._path(path)
        status = self._info("info", p)
        if status is None:
            raise FileNotFoundError(f"HDFSClient.info: {self.url(p)} does not exist")
        return {"path": p, "type": status["type"], "size": int(status["size"]),
                "modified": status.get("modificationTime", status.get("modification_time"))}

    def is_exist(self, path: str) -> bool:
        """Whether `path` exists (a file or a directory); an unreachable NameNode raises, never False."""
        p = self._path(path)
        return self._info("is_exist", p) is not None

    exists = is_exist

    def is_dir(self, path: str) -> bool:
        """Whether `path` exists and is a directory."""
        p = self._path(path)
        status = self._info("is_dir", p)
        return status is not None and status["type"] == "directory"

    def is_file(self, path: str) -> bool:
        """Whether `path` exists and is a file."""
        p = self._path(path)
        status = self._info("is_file", p)
        return status is not None and status["type"] == "file"

    def ls_dir(self, path: str) -> tuple[list[str], list[str]]:
        """(subdirectory names, file names) directly inside `path`, each sorted; ([], []) when it
        does not exist (as Paddle's); a file lists as ([], [its name])."""
        p = self._path(path)
        try:
            entries = self._entries("ls_dir", p)
        except FileNotFoundError:
            return [], []
        dirs = [posixpath.basename(e["name"]) for e in entries if e["type"] == "directory"]
        files = [posixpath.basename(e["name"]) for e in entries if e["type"] != "directory"]
        return dirs, files

    def list_dirs(self, path: str) -> list[str]:
        """The subdirectory names directly inside `path`; [] when it does not exist."""
        return self.ls_dir(path)[0]

    def ls(self, path: str) -> list[str]:
        """The absolute paths directly inside directory `path`, sorted (a file: [itself]);
        FileNotFoundError when it does not exist."""
        p = self._path(path)
        try:
            return [e["name"] for e in self._entries("ls", p)]
        except FileNotFoundError as e:
            raise FileNotFoundError(f"HDFSClient.ls: {self.url(p)} does not exist") from e

    def glob(self, pattern: str) -> list[str]:
        """The absolute paths matching `pattern` (*, ?, [..]; ** crosses directories), sorted."""
        p = self._path(pattern)
        return sorted(self._path(m) for m in self._attempt("glob", p, lambda: self.fs.glob(p)))

    def list_files_info(self, path_list: Iterable[str]) -> list[dict]:
        """[{"path", "size"}] of each file named and of each file directly inside each directory
        named, in that order; a missing path raises FileNotFoundError."""
        out = []
        for path in path_list:
            p = self._path(path)
            status = self._info("list_files_info", p)
            if status is None:
                raise FileNotFoundError(f"HDFSClient.list_files_info: {self.url(p)} does not exist")
            entries = self._entries("list_files_info", p) if status["type"] == "directory" else \
                [{**status, "name": p}]
            out.extend({"path": e["name"], "size": int(e["size"])} for e in entries if e["type"] == "file")
        return out

    def cat(self, path: str, encoding: str | None = "utf-8") -> str | bytes:
        """The content of file `path`, decoded (encoding=None: the bytes). A missing file raises
        FileNotFoundError and a directory IsADirectoryError (Paddle's returns "" for both)."""
        p = self._path(path)
        status = self._info("cat", p)
        if status is None:
            raise FileNotFoundError(f"HDFSClient.cat: {self.url(p)} does not exist")
        if status["type"] == "directory":
            raise IsADirectoryError(f"HDFSClient.cat: {self.url(p)} is a directory")
        data = self._attempt("cat", p, lambda: self._read_all(p))
        return data if encoding is None else data.decode(encoding)

    def need_upload_download(self) -> bool:
        """True: files here are remote (Paddle's FS interface; its LocalFS answers False)."""
        return True

    # --- changing ----------------------------------------------------------------------------

    def mkdirs(self, path: str) -> None:
        """Create directory `path` and its parents; nothing when it exists; FileExistsError when
        `path` (or a parent) is a file."""
        p = self._path(path)
        status = self._info("mkdirs", p)
        if status is not None:
            if status["type"] != "directory":
                raise FileExistsError(f"HDFSClient.mkdirs: {self.url(p)} is a file")
            return
        self._attempt("mkdirs", p, lambda: self.fs.makedirs(p, exist_ok=True))

    def touch(self, path: str, exist_ok: bool = True) -> None:
        """Create an empty file at `path` (parents too); an existing path is left as it is, or
        refused with FileExistsError when exist_ok=False."""
        p = self._path(path)
        if self._info("touch", p) is not None:
            if exist_ok:
                return
            raise FileExistsError(f"HDFSClient.touch: {self.url(p)} exists (exist_ok=False)")
        self._attempt("touch", p, lambda: self._write_all(p, b""))

    def delete(self, path: str) -> None:
        """Delete `path`, a file or a whole directory tree; nothing when it does not exist.
        The root is refused."""
        p = self._path(path)
        if p == "/":
            raise FileSystemError(f"HDFSClient.delete({self.url(p)}): refusing to delete the root")
        if self._info("delete", p) is None:
            return
        try:
            self._attempt("delete", p, lambda: self.fs.rm(p, recursive=True))
        except FileNotFoundError:
            pass  # gone meanwhile (or by an attempt whose answer was lost)

    rm = delete

    def mv(self, fs_src_path: str, fs_dst_path: str, overwrite: bool = False, test_exists: bool = True) -> None:
        """Rename `fs_src_path` to exactly `fs_dst_path` (never into it, if it is a directory).

        overwrite=True replaces an existing destination: a file atomically on hdfs-native; on
        WebHDFS (RENAME cannot overwrite) by renaming the old file aside and deleting it after,
        never losing it on failure; a directory is deleted first. test_exists=True checks first, as
        Paddle's: a missing source raises FileNotFoundError, an existing destination (after
        overwrite) FileExistsError; test_exists=False leaves the same refusals to the NameNode.
        """
        src, dst = self._path(fs_src_path), self._path(fs_dst_path)
        if test_exists and self._info("mv", src) is None:
            raise FileNotFoundError(f"HDFSClient.mv: the source {self.url(src)} does not exist")
        if overwrite:
            self._replace(src, dst)
            return
        if test_exists and self._info("mv", dst) is not None:
            raise FileExistsError(f"HDFSClient.mv: the destination {self.url(dst)} exists (pass overwrite=True)")
        self._rename("mv", src, dst)

    def upload(self, local_path: str | os.PathLike, fs_path: str, overwrite: bool = False) -> None:
        """Copy a local file or directory to HDFS.

        A file goes to `fs_path`, or into it when `fs_path` is a directory (as `hadoop fs -put`);
        an existing file there raises FileExistsError unless overwrite=True (then it is
        replaced). A directory's contents go under `fs_path` (created), recursively, empty
        directories too; overwrite=True deletes `fs_path` first (as Paddle's), else an existing
        file there raises FileExistsError. Each file is written to a hidden temporary and
        renamed into place: readers see no file or the whole file.
        """
        local = os.fspath(local_path)
        remote = self._path(fs_path)
        if not os.path.exists(local):
            raise FileNotFoundError(f"HDFSClient.upload: the local path {local!r} does not exist")
        if os.path.isdir(local):
            if overwrite:
                self.delete(remote)
            self.mkdirs(remote)
            for root, dirs, files in os.walk(local):
                rel = os.path.relpath(root, local)
                here = remote if rel == "." else posixpath.join(remote, *rel.split(os.sep))
                for name in sorted(dirs):
                    self.mkdirs(posixpath.join(here, name))
                for name in sorted(files):
                    self._put(os.path.join(root, name), posixpath.join(here, name), overwrite=False)
            return
        status = self._info("upload", remote)
        if status is not None and status["type"] == "directory":
            remote = posixpath.join(remote, os.path.basename(local))
        self._put(local, remote, overwrite)

    def upload_dir(self, local_dir: str | os.PathLike, dest_dir: str, overwrite: bool = False) -> None:
        """Copy local directory `local_dir` to `dest_dir`/<its name> (as Paddle's); overwrite=True
        replaces an existing copy."""
        local = os.fspath(local_dir).rstrip(os.sep) or os.sep
        if not os.path.isdir(local):
            raise NotADirectoryError(f"HDFSClient.upload_dir: the local path {local!r} is not a directory")
        self.upload(local, posixpath.join(self._path(dest_dir), os.path.basename(local)), overwrite=overwrite)

    def download(self, fs_path: str, local_path: str | os.PathLike, overwrite: bool = False) -> None:
        """Copy an HDFS file or directory to this machine.

        A file goes to `local_path`, or into it when `local_path` is a directory; an existing
        local file raises FileExistsError unless overwrite=True. A directory's contents go under
        `local_path` (created), recursively; existing local files are replaced only with
        overwrite=True, others there are left alone. A missing `fs_path` raises
        FileNotFoundError. Each file is written to a temporary beside its target and renamed
        into place, the temporary removed on failure.
        """
        remote, local = self._path(fs_path), os.fspath(local_path)
        status = self._info("download", remote)
        if status is None:
            raise FileNotFoundError(f"HDFSClient.download: {self.url(remote)} does not exist")
        if status["type"] != "directory":
            target = os.path.join(local, posixpath.basename(remote)) if os.path.isdir(local) else local
            self._get(remote, target, overwrite)
            return
        os.makedirs(local, exist_ok=True)
        for entry in self._entries("download", remote):
            name = posixpath.basename(entry["name"])
            if entry["type"] == "directory":
                self.download(entry["name"], os.path.join(local, name), overwrite)
            else:
                self._get(entry["name"], os.path.join(local, name), overwrite)

    # --- the steps ---------------------------------------------------------------------------

    def _read_all(self, path: str) -> bytes:
        with self.fs.open(path, "rb") as f:
            return f.read()

    def _write_all(self, path: str, data: bytes) -> None:
        with self.fs.open(path, "wb") as f:
            f.write(data)

    def _rename(self, verb: str, src: str, dst: str) -> None:
        """src -> dst (dst must not exist); a retry that finds src gone and dst present is done."""
        tried = False

        def rename() -> None:
            nonlocal tried
            if tried and not self.fs.exists(src) and self.fs.exists(dst):
                return  # the earlier attempt's rename went through; its answer was lost
            tried = True
            self.fs.mv(src, dst)

        self._attempt(verb, dst, rename)

    def _replace(self, src: str, dst: str) -> None:
        """src -> dst, an existing dst replaced: a file atomically on hdfs-native; on WebHDFS the old
        file is renamed aside, src renamed in, the old one deleted (moved back if the rename
        fails); an existing directory is deleted first."""
        status = self._info("mv", dst)
        if self.backend == "hdfs-native" and (status is None or status["type"] == "file"):
            tried = False

            def rename() -> None:
                nonlocal tried
                if tried and not self.fs.exists(src) and self.fs.exists(dst):
                    return
                tried = True
                self.fs.mv(src, dst, overwrite=True)

            self._attempt("mv", dst, rename)
            return
        if status is None:
            self._rename("mv", src, dst)
            return
        if status["type"] == "directory":  # a tree is not kept aside: replacing it means deleting it
            self.delete(dst)
            self._rename("mv", src, dst)
            return
        parent, name = posixpath.split(dst)
        aside = posixpath.join(parent, f".{name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._rename("mv", dst, aside)
        try:
            self._rename("mv", src, dst)
        except BaseException:
            try:
                self._rename("mv", aside, dst)
            except Exception as e:  # noqa: BLE001 - the original error matters more
                log.warning("HDFSClient.mv: the replaced file stays at %s (%s)", self.url(aside), first_line(e))
            raise
        self.delete(aside)

    def _put(self, local: str, remote: str, overwrite: bool) -> None:
        """One local file to `remote` through a hidden temporary beside it (see upload)."""
        if not overwrite and self._info("upload", remote) is not None:
            raise FileExistsError(f"HDFSClient.upload: {self.url(remote)} exists (pass overwrite=True)")
        parent, name = posixpath.split(remote)
        tmp = posixpath.join(parent, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")

        def write() -> None:
            try:
                with open(local, "rb") as src, self.fs.open(tmp, "wb") as dst:
                    while chunk := src.read(_CHUNK):
                        dst.write(chunk)
            except BaseException:
                self._discard(tmp)
                raise

        self.mkdirs(parent)
        self._attempt("upload", remote, write)
        try:
            if overwrite:
                self._replace(tmp, remote)
            else:
                self._rename("upload", tmp, remote)
        except BaseException:
            self._discard(tmp)
            raise

    def _get(self, remote: str, local: str, overwrite: bool) -> None:
        """One HDFS file to `local` through a temporary beside it (see download)."""
        if os.path.exists(local) and not overwrite:
            raise FileExistsError(f"HDFSClient.download: the local file {local!r} exists (pass overwrite=True)")
        parent = os.path.dirname(os.path.abspath(local))
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(local)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")

        def read() -> None:
            with self.fs.open(remote, "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)

        try:
            self._attempt("download", remote, read)
            if overwrite:
                os.replace(tmp, local)
            else:
                os.link(tmp, local)  # refuses a file that appeared meanwhile
                os.unlink(tmp)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _discard(self, tmp: str) -> None:
        """Remove a temporary, best effort, one bounded attempt: the failure that led here matters more."""
        try:
            if self.fs.exists(tmp):
                self.fs.rm(tmp)
        except Exception as e:  # noqa: BLE001
            log.warning("HDFSClient: could not remove the temporary %s (%s); delete it by hand",
                        self.url(tmp), first_line(e))
