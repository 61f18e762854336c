"""HDFSClient: every verb on the test HDFS through both backends, then its timeouts and retries.

The verb tests run twice (`client` is parametrized: WebHDFS and hdfs-native) and assert the
same answers, so the two backends keep one semantics (rename never into a directory, an
existing destination refused, no temporaries left). The retry tests count the calls: a
transient failure is retried and then succeeds, a definite one is raised after one call, an
exhausted budget names the verb, the URL, the attempts and the cause; a WebHDFS proxy that
answers 503 checks the same end to end. Unreachable and silent NameNodes are timed.
"""

from __future__ import annotations

import http.server
import json
import os
import select
import socket
import threading
import time
import uuid

import pytest
import requests

from recps.fs import FileSystemError, HDFSClient

pytestmark = pytest.mark.e2e  # every test here starts a process

DATA = os.urandom(3 * 2**20 + 777)  # four 1 MiB blocks on the test cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _url(hdfs, backend: str) -> str:
    return hdfs.webhdfs_url if backend == "webhdfs" else hdfs.url


@pytest.fixture(params=["webhdfs", "hdfs-native"])
def client(request, hdfs) -> HDFSClient:
    return HDFSClient(_url(hdfs, request.param), user="root", timeout_s=10, retries=2, backoff_s=0.01)


@pytest.fixture
def root(client) -> str:
    """A fresh directory for one test."""
    d = f"/recps-client/{uuid.uuid4().hex[:8]}"
    client.mkdirs(d)
    return d


def _tree(top: str) -> dict[str, bytes | None]:
    """relative path -> bytes (files) or None (directories) under local `top`."""
    out: dict[str, bytes | None] = {}
    for here, dirs, files in os.walk(top):
        rel = os.path.relpath(here, top)
        for d in dirs:
            out[os.path.normpath(os.path.join(rel, d))] = None
        for f in files:
            out[os.path.normpath(os.path.join(rel, f))] = open(os.path.join(here, f), "rb").read()
    return out


def _no_temporaries(client: HDFSClient, d: str) -> bool:
    return not any(".tmp-" in n or ".old-" in n for n in sum(client.ls_dir(d), []))


# --- asking -----------------------------------------------------------------------------------


def test_mkdirs_ls_dir_and_the_predicates(client, root):
    client.mkdirs(f"{root}/b/deep/er")
    client.mkdirs(f"{root}/b/deep/er")  # exists: nothing
    client.mkdirs(f"{root}/a")
    client.touch(f"{root}/z.txt")
    client.touch(f"{root}/c.txt")
    assert client.ls_dir(root) == (["a", "b"], ["c.txt", "z.txt"])
    assert client.list_dirs(root) == ["a", "b"]
    assert client.ls(root) == [f"{root}/a", f"{root}/b", f"{root}/c.txt", f"{root}/z.txt"]
    assert client.ls_dir(f"{root}/c.txt") == ([], ["c.txt"])
    assert client.ls(f"{root}/c.txt") == [f"{root}/c.txt"]
    assert client.ls_dir(f"{root}/nope") == ([], []) and client.list_dirs(f"{root}/nope") == []
    with pytest.raises(FileNotFoundError, match=f"HDFSClient.ls: {client.base}{root}/nope does not exist"):
        client.ls(f"{root}/nope")
    assert (client.is_exist(root), client.is_dir(root), client.is_file(root)) == (True, True, False)
    assert (client.exists(f"{root}/c.txt"), client.is_dir(f"{root}/c.txt"), client.is_file(f"{root}/c.txt")) == \
        (True, False, True)
    assert (client.is_exist(f"{root}/x"), client.is_dir(f"{root}/x"), client.is_file(f"{root}/x")) == \
        (False, False, False)
    with pytest.raises(FileExistsError, match=f"{root}/c.txt is a file"):
        client.mkdirs(f"{root}/c.txt")
    with pytest.raises(FileExistsError):
        client.mkdirs(f"{root}/c.txt/under")
    assert client.need_upload_download() is True


def test_info_glob_and_list_files_info(client, root, tmp_path):
    (tmp_path / "d.bin").write_bytes(DATA)
    client.upload(tmp_path / "d.bin", f"{root}/day=1/part-0.bin")
    client.touch(f"{root}/day=1/part-1.bin")
    client.touch(f"{root}/day=2/part-0.bin")
    client.mkdirs(f"{root}/day=2/sub")
    info = client.info(f"{root}/day=1/part-0.bin")
    assert (info["path"], info["type"], info["size"]) == (f"{root}/day=1/part-0.bin", "file", len(DATA))
    assert info["modified"] > 1_600_000_000_000  # ms since the epoch
    assert client.info(f"{root}/day=2")["type"] == "directory"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        client.info(f"{root}/nope")
    assert client.glob(f"{root}/day=*/part-0.bin") == [f"{root}/day=1/part-0.bin", f"{root}/day=2/part-0.bin"]
    assert client.glob(f"{root}/day=1/part-?.bin") == [f"{root}/day=1/part-0.bin", f"{root}/day=1/part-1.bin"]
    assert client.glob(f"{root}/day=9/*") == []
    assert client.list_files_info([f"{root}/day=1", f"{root}/day=2", f"{root}/day=1/part-0.bin"]) == [
        {"path": f"{root}/day=1/part-0.bin", "size": len(DATA)},
        {"path": f"{root}/day=1/part-1.bin", "size": 0},
        {"path": f"{root}/day=2/part-0.bin", "size": 0},  # day=2/sub is a directory: not listed
        {"path": f"{root}/day=1/part-0.bin", "size": len(DATA)},
    ]
    assert client.list_files_info([]) == []
    with pytest.raises(FileNotFoundError, match=f"{root}/nope does not exist"):
        client.list_files_info([f"{root}/nope"])


def test_cat_and_touch(client, root, tmp_path):
    (tmp_path / "t.txt").write_text("line 1\nline 2\n")
    client.upload(tmp_path / "t.txt", f"{root}/t.txt")
    assert client.cat(f"{root}/t.txt") == "line 1\nline 2\n"
    assert client.cat(f"{root}/t.txt", encoding=None) == b"line 1\nline 2\n"
    client.touch(f"{root}/t.txt")  # exists, exist_ok: left as it is
    assert client.cat(f"{root}/t.txt") == "line 1\nline 2\n"
    with pytest.raises(FileExistsError, match="exist_ok=False"):
        client.touch(f"{root}/t.txt", exist_ok=False)
    client.touch(f"{root}/new/empty", exist_ok=False)
    assert client.cat(f"{root}/new/empty") == "" and client.info(f"{root}/new/empty")["size"] == 0
    with pytest.raises(FileNotFoundError, match=f"HDFSClient.cat: {client.base}{root}/nope does not exist"):
        client.cat(f"{root}/nope")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        client.cat(f"{root}/new")


# --- changing ---------------------------------------------------------------------------------


def test_delete(client, root):
    client.touch(f"{root}/f")
    client.touch(f"{root}/tree/a/b/c")
    client.delete(f"{root}/f")
    client.rm(f"{root}/tree")
    client.delete(f"{root}/never-was")  # nothing
    assert client.ls_dir(root) == ([], [])
    with pytest.raises(FileSystemError, match="refusing to delete the root"):
        client.delete("/")


def test_mv(client, root, tmp_path):
    (tmp_path / "s").write_bytes(b"source")
    client.upload(tmp_path / "s", f"{root}/src")
    client.mv(f"{root}/src", f"{root}/dst")
    assert client.ls_dir(root) == ([], ["dst"]) and client.cat(f"{root}/dst") == "source"

    with pytest.raises(FileNotFoundError, match=f"the source {client.base}{root}/src does not exist"):
        client.mv(f"{root}/src", f"{root}/other")
    client.touch(f"{root}/other")
    with pytest.raises(FileExistsError, match=f"the destination {client.base}{root}/other exists"):
        client.mv(f"{root}/dst", f"{root}/other")
    with pytest.raises(FileExistsError):  # without the checks the NameNode refuses the same
        client.mv(f"{root}/dst", f"{root}/other", test_exists=False)
    assert client.cat(f"{root}/dst") == "source" and client.cat(f"{root}/other") == ""

    client.mv(f"{root}/dst", f"{root}/other", overwrite=True)
    assert client.ls_dir(root) == ([], ["other"]) and client.cat(f"{root}/other") == "source"

    client.touch(f"{root}/dir/inside")
    with pytest.raises(FileExistsError):  # never "into" an existing directory
        client.mv(f"{root}/other", f"{root}/dir", test_exists=False)
    client.mv(f"{root}/other", f"{root}/dir", overwrite=True)  # replaces the directory
    assert client.is_file(f"{root}/dir") and client.cat(f"{root}/dir") == "source"

    client.touch(f"{root}/t1/x")
    client.mv(f"{root}/t1", f"{root}/t2")  # a directory moves as a whole
    assert client.ls(f"{root}/t2") == [f"{root}/t2/x"] and not client.is_exist(f"{root}/t1")
    assert _no_temporaries(client, root)


def test_upload_and_download_a_file(client, root, tmp_path):
    local = tmp_path / "model.bin"
    local.write_bytes(DATA)
    client.upload(local, f"{root}/m.bin")
    client.mkdirs(f"{root}/into")
    client.upload(str(local), f"{root}/into")  # an existing directory: the file goes inside
    assert client.ls_dir(root) == (["into"], ["m.bin"]) and client.ls_dir(f"{root}/into") == ([], ["model.bin"])
    assert client.cat(f"{root}/m.bin", encoding=None) == DATA

    with pytest.raises(FileExistsError, match=f"{client.base}{root}/m.bin exists"):
        client.upload(local, f"{root}/m.bin")
    (tmp_path / "v2.bin").write_bytes(b"v2")
    client.upload(tmp_path / "v2.bin", f"{root}/m.bin", overwrite=True)
    assert client.cat(f"{root}/m.bin", encoding=None) == b"v2"
    with pytest.raises(FileNotFoundError, match="the local path .*nope.bin' does not exist"):
        client.upload(tmp_path / "nope.bin", f"{root}/n.bin")

    out = tmp_path / "out"
    out.mkdir()
    client.download(f"{root}/into/model.bin", out / "copy.bin")
    client.download(f"{root}/m.bin", out)  # an existing local directory: into it
    assert (out / "copy.bin").read_bytes() == DATA and (out / "m.bin").read_bytes() == b"v2"
    with pytest.raises(FileExistsError, match="copy.bin' exists"):
        client.download(f"{root}/m.bin", out / "copy.bin")
    assert (out / "copy.bin").read_bytes() == DATA
    client.download(f"{root}/m.bin", out / "copy.bin", overwrite=True)
    assert (out / "copy.bin").read_bytes() == b"v2"
    with pytest.raises(FileNotFoundError, match=f"{client.base}{root}/nope does not exist"):
        client.download(f"{root}/nope", out / "x")
    assert sorted(os.listdir(out)) == ["copy.bin", "m.bin"]  # no local temporaries
    assert _no_temporaries(client, root) and _no_temporaries(client, f"{root}/into")


def test_upload_dir_and_download_a_tree(client, root, tmp_path):
    src = tmp_path / "ckpt"
    (src / "table_0" / "shard_1").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "manifest.json").write_text(json.dumps({"pass": 3}))
    (src / "table_0" / "shard_1" / "rows.bin").write_bytes(DATA)
    (src / "table_0" / "meta").write_bytes(b"m")

    client.upload(src, f"{root}/pass-3")  # the contents go under fs_path
    client.upload_dir(src, f"{root}/dest")  # the directory goes under dest_dir, by its name
    assert client.ls_dir(f"{root}/pass-3") == (["empty", "table_0"], ["manifest.json"])
    assert client.ls_dir(f"{root}/dest") == (["ckpt"], [])
    with pytest.raises(FileExistsError, match="manifest.json exists"):
        client.upload_dir(src, f"{root}/dest")

    client.touch(f"{root}/dest/ckpt/stale")
    (src / "manifest.json").write_text(json.dumps({"pass": 4}))
    client.upload_dir(src, f"{root}/dest", overwrite=True)  # the old copy is replaced whole
    assert "stale" not in client.ls_dir(f"{root}/dest/ckpt")[1]
    assert json.loads(client.cat(f"{root}/dest/ckpt/manifest.json")) == {"pass": 4}

    client.download(f"{root}/dest/ckpt", tmp_path / "back")
    assert _tree(str(tmp_path / "back")) == _tree(str(src))
    with pytest.raises(FileExistsError, match="exists"):
        client.download(f"{root}/dest/ckpt", tmp_path / "back")
    client.download(f"{root}/dest/ckpt", tmp_path / "back", overwrite=True)
    assert _tree(str(tmp_path / "back")) == _tree(str(src))
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        client.upload_dir(src / "manifest.json", root)


def test_an_upload_that_fails_leaves_no_temporary(client, root, tmp_path, monkeypatch):
    (tmp_path / "f").write_bytes(DATA)

    def refuse(src, dst, **kwargs):
        raise PermissionError(f"rename {src} -> {dst} refused (injected)")

    monkeypatch.setattr(client.fs, "mv", refuse)
    with pytest.raises(PermissionError, match="injected"):
        client.upload(tmp_path / "f", f"{root}/f")
    monkeypatch.undo()
    assert client.ls_dir(root) == ([], [])

    client.upload(tmp_path / "f", f"{root}/f")
    monkeypatch.setattr(client.fs, "mv", refuse)
    with pytest.raises(PermissionError, match="injected"):
        client.upload(tmp_path / "f", f"{root}/f", overwrite=True)
    monkeypatch.undo()
    assert client.ls_dir(root) == ([], ["f"]) and client.cat(f"{root}/f", encoding=None) == DATA


def test_paths_and_urls(client, root, hdfs):
    client.touch(f"{root}/p")
    scheme = client.base.split("://")[0]
    assert client.is_file(f"{client.base}{root}/p") and client.is_file(f"{scheme}:{root}/p")  # Paddle's hdfs:/x
    assert client.is_file(f"{root}//./p") and client.url(f"{root}/p") == f"{client.base}{root}/p"
    with pytest.raises(FileSystemError, match="'relative/p': HDFS paths here are absolute"):
        client.is_file("relative/p")
    with pytest.raises(FileSystemError, match="is on host other.host, this client on 127.0.0.1"):
        client.is_file(f"{scheme}://other.host:1{root}/p")
    with pytest.raises(FileSystemError, match="not an HDFS path"):
        client.is_file(f"s3://bucket{root}/p")


def test_construction_is_checked(hdfs):
    assert HDFSClient(hdfs.webhdfs_url).backend == "webhdfs"
    assert HDFSClient(hdfs.url).backend == "hdfs-native"
    assert HDFSClient(f"127.0.0.1:{hdfs.http_port}").backend == "webhdfs"  # no scheme: WebHDFS
    with pytest.raises(FileSystemError, match=r"backend='webhdfs'.* give webhdfs://127\.0\.0\.1:<the NameNode's HTTP"):
        HDFSClient(hdfs.url, backend="webhdfs")
    with pytest.raises(FileSystemError, match="backend is one of"):
        HDFSClient(hdfs.url, backend="libhdfs")
    with pytest.raises(FileSystemError, match="not a NameNode URL"):
        HDFSClient("s3://bucket")
    with pytest.raises(FileSystemError, match="drop the path '/data'"):
        HDFSClient(f"{hdfs.url}/data")
    with pytest.raises(FileSystemError, match="retries=-1"):
        HDFSClient(hdfs.url, retries=-1)
    with pytest.raises(FileSystemError, match="timeout_s=-5"):
        HDFSClient(hdfs.url, timeout_s=-5)


def test_a_forked_child_uses_the_parents_client(client, root):
    """hdfs-native's Client hangs in a fork; the bounded one rebuilds itself there."""
    client.touch(f"{root}/seen-by-child")
    assert client.ls_dir(root) == ([], ["seen-by-child"])
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, never return into pytest
        try:
            answer = {"ls": client.ls_dir(root)}
        except BaseException as e:  # noqa: BLE001
            answer = {"error": repr(e)}
        os.write(write_end, json.dumps(answer).encode())
        os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 20)
        assert ready, "the forked child got no answer within 20 s"
        answer = json.loads(os.read(read_end, 65536).decode())
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    assert answer == {"ls": [[], ["seen-by-child"]]}


# --- retries ----------------------------------------------------------------------------------


class _Flaky:
    """Wraps one of client.fs's methods: raises `errors` in turn, then calls through; counts calls."""

    def __init__(self, real, *errors: BaseException) -> None:
        self.real, self.errors, self.calls = real, list(errors), 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.real(*args, **kwargs)


def test_a_transient_failure_is_retried_then_succeeds(client, root):
    client.touch(f"{root}/f")
    flaky = _Flaky(client.fs.info, ConnectionResetError(104, "Connection reset by peer"),
                   TimeoutError("timed out"))
    client.fs.info = flaky
    start = time.monotonic()
    assert client.is_file(f"{root}/f") is True
    assert flaky.calls == 3 and time.monotonic() - start >= 0.01 + 0.02  # backoff_s, then 2 x backoff_s


def test_a_definite_answer_is_not_retried(client, root):
    flaky = _Flaky(client.fs.ls)
    client.fs.ls = flaky
    with pytest.raises(FileNotFoundError):
        client.ls(f"{root}/nope")
    assert flaky.calls == 1
    refuse = _Flaky(client.fs.mv, PermissionError("refused"))
    client.fs.mv = refuse
    client.touch(f"{root}/a")
    with pytest.raises(PermissionError, match="refused"):
        client.mv(f"{root}/a", f"{root}/b")
    assert refuse.calls == 1


def test_exhausted_retries_name_the_verb_url_attempts_and_cause(client, root):
    refused = ConnectionRefusedError(111, "Connection refused")
    flaky = _Flaky(client.fs.info, refused, refused, refused, refused)
    client.fs.info = flaky
    with pytest.raises(FileSystemError) as raised:
        client.is_exist(f"{root}/x")
    message = str(raised.value)
    assert message.startswith(f"HDFSClient.is_exist({client.base}{root}/x): no answer after 3 attempts in ")
    assert f"backend={client.backend}" in message and "ConnectionRefusedError: [Errno 111] Connection refused" in message
    assert f"is the NameNode up at {client.address}?" in message
    assert flaky.calls == 3 and raised.value.__cause__ is refused


def test_a_rename_whose_answer_was_lost_is_not_repeated(client, root):
    """The first RENAME goes through but its answer is lost: the retry sees it done."""
    client.touch(f"{root}/a")
    real = client.fs.mv

    def lost_answer(src, dst, **kwargs):
        client.fs.mv = real
        real(src, dst, **kwargs)
        raise ConnectionResetError(104, "Connection reset by peer (after the rename)")

    client.fs.mv = lost_answer
    client.mv(f"{root}/a", f"{root}/b")
    assert client.ls_dir(root) == ([], ["b"])


def test_an_upload_interrupted_mid_write_is_retried_whole(client, root, tmp_path):
    (tmp_path / "f").write_bytes(DATA)
    real_open = client.fs.open
    opened = []

    def open_then_drop(path, mode="rb", **kwargs):
        f = real_open(path, mode, **kwargs)
        opened.append(path)
        if len(opened) == 1:  # the first write stream dies after its first block
            real_write = f.write

            def write(data):
                real_write(data[: 2**20])
                raise ConnectionResetError(104, "Connection reset by peer (injected)")

            f.write = write
        return f

    client.fs.open = open_then_drop
    client.upload(tmp_path / "f", f"{root}/f")
    client.fs.open = real_open
    assert len(opened) == 2 and client.cat(f"{root}/f", encoding=None) == DATA
    assert client.ls_dir(root) == ([], ["f"])


class _Proxy(http.server.BaseHTTPRequestHandler):
    """Answers 503 while server.fail > 0 (or always with fail < 0), else forwards to server.upstream."""

    def _any(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        server = self.server
        with server.lock:
            fail = server.fail != 0
            server.fail -= 1 if server.fail > 0 else 0
        if fail:
            server.statuses.append(503)
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        up = requests.request(self.command, server.upstream + self.path, data=body or None, allow_redirects=False,
                              timeout=10)
        server.statuses.append(up.status_code)
        self.send_response(up.status_code)
        for name in ("Content-Type", "Location"):
            if name in up.headers:
                self.send_header(name, up.headers[name])
        self.send_header("Content-Length", str(len(up.content)))
        self.end_headers()
        self.wfile.write(up.content)

    do_GET = do_PUT = do_POST = do_DELETE = _any

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def proxy(hdfs):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    server.upstream, server.fail, server.statuses, server.lock = \
        f"http://{hdfs.host}:{hdfs.http_port}", 0, [], threading.Lock()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_webhdfs_503_is_retried_then_succeeds(proxy, hdfs):
    client = HDFSClient(f"webhdfs://127.0.0.1:{proxy.server_address[1]}", user="root", timeout_s=10,
                        retries=2, backoff_s=0.01)
    d = f"/recps-client/{uuid.uuid4().hex[:8]}"
    client.mkdirs(f"{d}/sub")
    proxy.statuses.clear()
    proxy.fail = 2
    assert client.ls_dir(d) == (["sub"], [])
    assert proxy.statuses == [503, 503, 200]

    proxy.statuses.clear()
    assert client.is_exist(f"{d}/nope") is False  # the NameNode's 404: a definite answer, asked once
    assert proxy.statuses == [404]

    proxy.statuses.clear()
    proxy.fail = -1  # 503 for ever
    with pytest.raises(FileSystemError, match=r"HDFSClient.ls_dir\(.*\): no answer after 3 attempts .*HTTP 503"):
        client.ls_dir(d)
    assert proxy.statuses == [503, 503, 503]


# --- unreachable ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["webhdfs", "hdfs-native"])
def test_an_unreachable_namenode_fails_within_a_bound(backend):
    port = _free_port()
    scheme = "webhdfs" if backend == "webhdfs" else "hdfs"
    client = HDFSClient(f"{scheme}://127.0.0.1:{port}", timeout_s=2, retries=1, backoff_s=0.1)
    start = time.monotonic()
    with pytest.raises(FileSystemError, match=rf"HDFSClient.is_exist\({scheme}://127\.0\.0\.1:{port}/x\): no answer "
                                              rf"after 2 attempts .*is the NameNode up at 127\.0\.0\.1:{port}"):
        client.is_exist("/x")
    assert time.monotonic() - start < 6  # measured: webhdfs 0.1 s, hdfs-native 0.3-2.5 s


@pytest.mark.parametrize("backend", ["webhdfs", "hdfs-native"])
def test_a_namenode_that_never_answers_is_bounded(backend):
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        port = silent.getsockname()[1]
        scheme = "webhdfs" if backend == "webhdfs" else "hdfs"
        client = HDFSClient(f"{scheme}://127.0.0.1:{port}", timeout_s=0.5, retries=1, backoff_s=0.05)
        start = time.monotonic()
        with pytest.raises(FileSystemError, match=r"no answer after 2 attempts .*no answer within timeout_s=0\.5 s"):
            client.ls_dir("/x")
        elapsed = time.monotonic() - start
    assert 1.0 < elapsed < 4, elapsed
