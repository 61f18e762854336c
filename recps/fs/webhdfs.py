"""WebHDFS (HDFS over HTTP) as fsspec's `webhdfs`, with the gaps that matter to a trainer closed.

`WebHDFS` is fsspec's class plus:

- every request carries a timeout (connect and each read wait, `timeout_s`; default
  $RECPS_FS_TIMEOUT_S or 60 s), the NameNode's and the DataNodes' alike: a hung server fails
  the call instead of hanging the job;
- errors say what happened: the NameNode's RemoteException becomes FileNotFoundError,
  FileExistsError, PermissionError, ValueError, or a FileSystemError with the Java class;
  no answer (refused, reset, timeout, 5xx, SafeMode/Standby/Retriable) becomes a
  TransientFileSystemError naming the NameNode's host:port and the call;
- `mv` fails when the NameNode refuses the RENAME (fsspec's ignores the `{"boolean": false}`
  answer, so a rename onto an existing file silently did nothing) and never moves into an
  existing directory: the destination is the new name, as with hdfs-native;
- `exists`, `isdir`, `isfile` answer False only for a path that does not exist; an unreachable
  NameNode raises (fsspec's answer False for any error);
- a DataNode's error while reading is raised, not returned as the file's bytes;
- the user defaults to $HADOOP_USER_NAME, else the login name, as hdfs-native's does (fsspec's
  leaves it out and the NameNode acts as "dr.who"); a token or Kerberos sets no user;
- fork-safe: a forked child drops the parent's pooled connections before its first request.

WebHDFS's own limits stay: RENAME never overwrites (delete the target first), a write is
CREATE of an empty file then APPENDs (readers can see a partial file: write a temporary and
rename it), and there is one HTTP round trip per call.
"""

from __future__ import annotations

import getpass
import os
from typing import Any
from urllib.parse import quote

import requests
from fsspec.implementations import webhdfs as _fsspec_webhdfs

from recps.fs._common import (RETRIABLE_REMOTE, TIMEOUT_ENV, FileSystemError, FileSystemTimeoutError,
                              SharedAcrossThreads, TransientFileSystemError, first_line)
from recps.fs._common import timeout_s as _timeout

__all__ = ["WebHDFS", "WebHDFile", "default_user"]


def default_user() -> str | None:
    """$HADOOP_USER_NAME, else the login name (what hdfs-native acts as), else None."""
    user = os.environ.get("HADOOP_USER_NAME")
    if user:
        return user
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        return None


class _TimeoutSession(requests.Session):
    """A requests session whose every request carries `timeout` unless it names its own."""

    def __init__(self, timeout: float) -> None:
        super().__init__()
        self.timeout = timeout
        self._pid = os.getpid()

    def request(self, method, url, *args, **kwargs):  # noqa: ANN001 - requests' signature
        if os.getpid() != self._pid:  # a forked child: the pooled sockets are the parent's
            for prefix in list(self.adapters):
                self.mount(prefix, requests.adapters.HTTPAdapter())
            self._pid = os.getpid()
        if kwargs.get("timeout") is None:
            kwargs["timeout"] = self.timeout
        return super().request(method, url, *args, **kwargs)


class WebHDFS(_fsspec_webhdfs.WebHDFS, metaclass=SharedAcrossThreads):
    """fsspec's WebHDFS with a timeout on every request and exact errors (see the module docstring).

    `timeout_s` bounds the connect and each wait for bytes of every request (not a whole
    transfer: a large file that keeps arriving is never cut). Other arguments are fsspec's.
    """

    def __init__(self, host: str, port: int = 50070, *, timeout_s: float | None = None,
                 user: str | None = None, token: str | None = None, kerberos: bool = False,
                 **kwargs: Any) -> None:
        if self._cached:
            return
        self.timeout_s = _timeout(timeout_s)
        if user is None and token is None and not kerberos:
            user = default_user()
        self.where = f"webhdfs://{host}:{port}"
        super().__init__(host, port, user=user, token=token, kerberos=kerberos, **kwargs)

    def _connect(self) -> None:
        super()._connect()
        plain, self.session = self.session, _TimeoutSession(self.timeout_s)
        self.session.cert, self.session.verify, self.session.auth = plain.cert, plain.verify, plain.auth

    # --- requests -----------------------------------------------------------------------------

    def request(self, what: str, method: str, url: str, **kwargs: Any) -> requests.Response:
        """One HTTP request (to the NameNode or a DataNode) with the errors mapped; `what` names it."""
        try:
            out = self.session.request(method.upper(), url, **kwargs)
        except requests.Timeout as e:
            raise FileSystemTimeoutError(
                f"{what} on {self.where}: no answer within timeout_s={self.timeout_s:g} s ({first_line(e)}); "
                f"is the NameNode up at {self._hostport()} (its HTTP port) and its DataNodes reachable? "
                f"(raise timeout_s= or ${TIMEOUT_ENV} for a slow cluster)") from e
        except requests.exceptions.SSLError as e:
            raise FileSystemError(f"{what} on {self.where}: TLS failed ({first_line(e)}); check use_https= "
                                  "and session_verify= / session_cert=") from e
        except requests.ConnectionError as e:
            raise TransientFileSystemError(
                f"{what} on {self.where}: cannot connect ({first_line(e)}); is the NameNode up at "
                f"{self._hostport()} (its HTTP port, dfs.namenode.http-address: 50070 on Hadoop 2, "
                "9870 on Hadoop 3)?") from e
        if out.status_code >= 400:
            raise self._error(what, out)
        return out

    def _call(self, op, method="get", path=None, data=None, redirect=True, **kwargs):  # noqa: ANN001 - fsspec's
        path = self._strip_protocol(path) if path is not None else ""
        url = self._apply_proxy(self.url + quote(path, safe="/="))
        params = {**kwargs, **self.pars, "op": op.upper()}
        return self.request(f"{op.upper()} {path or '/'}", method, url, params=params, data=data,
                            allow_redirects=redirect)

    def unstrip_protocol(self, name: str) -> str:
        """The full URL of `name`, with the NameNode's host:port (fsspec's drops them)."""
        return self.where + self._strip_protocol(name)

    def _hostport(self) -> str:
        return self.where.partition("://")[2]

    def _error(self, what: str, out: requests.Response) -> OSError | ValueError:
        try:
            remote = out.json()["RemoteException"]
            name, message = remote["exception"], str(remote.get("message", ""))
        except (ValueError, KeyError, TypeError):
            name, message = None, out.text.strip()[:300]
        message = message.strip().splitlines()[0] if message.strip() else f"HTTP {out.status_code}"
        text = f"{what} on {self.where}: {message}"
        if name in RETRIABLE_REMOTE:
            return TransientFileSystemError(f"{text} ({name}: the NameNode asks to retry later)")
        if name == "FileNotFoundException" or (name is None and out.status_code == 404):
            return FileNotFoundError(text)
        if name in ("FileAlreadyExistsException", "AlreadyBeingCreatedException"):
            return FileExistsError(text)
        if name in ("AccessControlException", "SecurityException", "AuthorizationException"):
            return PermissionError(f"{text} (acting as user={self.user!r}: pass user= or set HADOOP_USER_NAME)")
        if name in ("IllegalArgumentException", "UnsupportedOperationException"):
            return ValueError(text)
        if name is None and out.status_code >= 500:
            return TransientFileSystemError(f"{text} (HTTP {out.status_code})")
        return FileSystemError(f"{text} ({name or 'HTTP ' + str(out.status_code)})")

    # --- file system verbs with exact semantics ------------------------------------------------

    def _open(self, path, mode="rb", block_size=None, autocommit=True, replication=None,  # noqa: ANN001
              permissions=None, **kwargs):
        return WebHDFile(self, path, mode=mode, block_size=block_size or self.blocksize, tempdir=self.tempdir,
                         autocommit=autocommit, replication=replication, permissions=permissions)

    def exists(self, path, **kwargs) -> bool:  # noqa: ANN001
        try:
            self.info(path)
        except FileNotFoundError:
            return False
        return True

    def isdir(self, path) -> bool:  # noqa: ANN001
        try:
            return self.info(path)["type"] == "directory"
        except FileNotFoundError:
            return False

    def isfile(self, path) -> bool:  # noqa: ANN001
        try:
            return self.info(path)["type"] == "file"
        except FileNotFoundError:
            return False

    def mv(self, path1, path2, **kwargs) -> None:  # noqa: ANN001
        """Rename `path1` to exactly `path2`, which must not exist (FileExistsError, as hdfs-native).

        RENAME itself would move into an existing directory and answers a refusal with
        {"boolean": false}; both are turned into errors here."""
        src, dst = self._strip_protocol(path1), self._strip_protocol(path2)
        if self.exists(dst):
            raise FileExistsError(f"RENAME {src} -> {dst} on {self.where}: the destination exists "
                                  "(WebHDFS RENAME never overwrites: delete it first)")
        answer = self._call("RENAME", method="put", path=src, destination=dst).json().get("boolean")
        if answer is True:
            return
        if not self.exists(src):
            raise FileNotFoundError(f"RENAME {src} -> {dst} on {self.where}: the source does not exist")
        if self.exists(dst):
            raise FileExistsError(f"RENAME {src} -> {dst} on {self.where}: the destination exists")
        raise FileSystemError(f"RENAME {src} -> {dst} on {self.where}: the NameNode refused it (is the "
                              "destination's parent a file, or the destination inside the source?)")

    def ls(self, path, detail=False, **kwargs):  # noqa: ANN001
        """fsspec's listing, except that a file lists as itself (named by its path, no trailing '/')."""
        path = self._strip_protocol(path)
        infos = self._call("LISTSTATUS", path=path).json()["FileStatuses"]["FileStatus"]
        for info in infos:
            self._process_info(info)
            info["name"] = path.rstrip("/") + "/" + info["pathSuffix"] if info["pathSuffix"] else path
        infos.sort(key=lambda i: i["name"])
        return infos if detail else [info["name"] for info in infos]


class WebHDFile(_fsspec_webhdfs.WebHDFile):
    """fsspec's WebHDFile with every DataNode request's error mapped, and fewer round trips.

    A write sends its first block with CREATE (a small file is one CREATE: no empty file, no
    APPEND) and each further block with APPEND; fsspec's CREATEs an empty file first. A read's
    DataNode error is raised (fsspec returns the error page as the file's bytes).
    """

    _created = False
    _append_at: str | None = None

    def _initiate_upload(self) -> None:
        """Nothing yet: the first block goes with CREATE (or APPEND) in _upload_chunk."""

    def _datanode(self, op: str, method: str, **params: Any) -> str:
        out = self.fs._call(op, method, self.path, redirect=False, **params)
        return self.fs._apply_proxy(out.headers["Location"])

    def _upload_chunk(self, final: bool = False) -> bool:
        data = self.buffer.getvalue()
        headers = {"content-type": "application/octet-stream"}
        if "w" in self.mode and not self._created:
            params: dict[str, Any] = {"overwrite": "true"}
            if self.kwargs.get("replication") is not None:
                params["replication"] = self.kwargs["replication"]
            mode = self.kwargs.get("permissions")
            if mode is not None:  # an int (0o644) or fsspec's octal string ("644")
                params["permission"] = format(mode, "o") if isinstance(mode, int) else str(mode)
            self.fs.request(f"CREATE {self.path} (DataNode)", "put", self._datanode("CREATE", "put", **params),
                            data=data, headers=headers)
            self._created = True
            return True
        if self._append_at is None:
            self._append_at = self._datanode("APPEND", "post")
        self.fs.request(f"APPEND {self.path} (DataNode)", "post", self._append_at, data=data, headers=headers)
        return True

    def _fetch_range(self, start: int, end: int) -> bytes:
        start, end = max(start, 0), min(self.size, end)
        if start >= end:
            return b""
        out = self.fs._call("OPEN", path=self.path, offset=start, length=end - start, redirect=False)
        if "Location" not in out.headers:
            return out.content
        location = self.fs._apply_proxy(out.headers["Location"])
        return self.fs.request(f"OPEN {self.path} (DataNode)", "get", location).content
