"""recps.fs on plain paths, file://, memory:// and the test HDFS (hdfs:// and webhdfs://).

Each write_atomic test checks the contract, not just a round trip: the target appears whole
(at the rename the temporary holds every byte and the target does not exist yet), an
existing record is refused and left as it was, overwrite=True replaces it, and a failed write
leaves no temporary behind. The unreachable tests time the failure.
"""

from __future__ import annotations

import getpass
import os
import socket
import time
import uuid

import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

import recps.fs as rfs
from recps.fs import FileSystemError, FileSystemTimeoutError, TransientFileSystemError

PAYLOAD = os.urandom(2 * 2**20 + 4321)  # three 1 MiB HDFS blocks (the test cluster's dfs.blocksize)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def silent_port():
    """A port that accepts connections (the kernel's backlog) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    yield s.getsockname()[1]
    s.close()


@pytest.fixture(params=["hdfs", "webhdfs"])
def hdfs_root(request, hdfs) -> str:
    """A fresh directory URL on the test HDFS, through hdfs-native (hdfs://) or WebHDFS."""
    base = hdfs.url if request.param == "hdfs" else hdfs.webhdfs_url
    return f"{base}/recps-fs/{uuid.uuid4().hex[:8]}"


def _temporaries(fs, parent: str) -> list[str]:
    return [p for p in fs.ls(parent, detail=False) if ".tmp-" in p.rsplit("/", 1)[-1]]


# --- paths ------------------------------------------------------------------------------------


def test_plain_paths_and_file_urls_are_local(tmp_path):
    plain = str(tmp_path / "a" / "b.txt")
    fs, path = rfs.resolve(plain)
    assert isinstance(fs, LocalFileSystem) and path == plain
    fs2, path2 = rfs.resolve(f"file://{plain}")
    assert isinstance(fs2, LocalFileSystem) and path2 == plain
    assert rfs.is_local(plain) and rfs.is_local(f"file://{plain}") and not rfs.is_local("hdfs://nn:8020/x")
    assert rfs.local_path(f"file://{plain}") == plain == rfs.local_path(plain)
    assert rfs.local_path("memory://x") is None
    assert rfs.display(fs, path) == plain


def test_join_appends_components_on_every_protocol(tmp_path):
    assert rfs.join(str(tmp_path), "a", "b") == os.path.join(str(tmp_path), "a", "b")
    assert rfs.join("hdfs://nn:8020", "a", "b") == "hdfs://nn:8020/a/b"
    assert rfs.join("hdfs://nn:8020/", "a") == "hdfs://nn:8020/a"
    assert rfs.join("hdfs://nn:8020/ckpt/", "pass-1", "x.bin") == "hdfs://nn:8020/ckpt/pass-1/x.bin"
    assert rfs.join("webhdfs://nn:50070/d", "e") == "webhdfs://nn:50070/d/e"
    assert rfs.join("memory://runs", "r1") == "memory://runs/r1"
    assert rfs.join("s3://bucket") == "s3://bucket"


def test_memory_urls_resolve_and_display():
    fs, path = rfs.resolve("memory://recps-test/x/y.bin")
    assert isinstance(fs, MemoryFileSystem) and path == "/recps-test/x/y.bin"
    shown = rfs.display(fs, path)
    assert shown == "memory:///recps-test/x/y.bin"  # fsspec's memory paths are rooted
    assert rfs.resolve(shown) == (fs, path)


def test_an_unknown_protocol_names_the_package_to_install():
    with pytest.raises(FileSystemError, match=r"nosuchfs://x/y: no file system for protocol 'nosuchfs'"):
        rfs.resolve("nosuchfs://x/y")


# --- write_atomic / read_bytes, locally and in memory ---------------------------------------------


def test_write_atomic_local_whole_refuse_overwrite(tmp_path, monkeypatch):
    target = tmp_path / "d" / "record.bin"
    seen = {}
    real_link = os.link

    def link(src, dst, *args, **kwargs):  # the moment the record appears: the temporary is complete
        seen["tmp"], seen["target_existed"] = open(src, "rb").read(), os.path.exists(dst)
        return real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", link)
    assert rfs.write_atomic(str(target), PAYLOAD) == str(target)
    assert seen == {"tmp": PAYLOAD, "target_existed": False}
    assert target.read_bytes() == PAYLOAD

    with pytest.raises(FileExistsError, match=f"{target} exists; it is a committed record"):
        rfs.write_atomic(str(target), b"other")
    assert target.read_bytes() == PAYLOAD

    rfs.write_atomic(f"file://{target}", "replaced", overwrite=True)
    assert target.read_bytes() == b"replaced"
    assert rfs.read_bytes(str(target)) == b"replaced"
    assert sorted(p.name for p in target.parent.iterdir()) == ["record.bin"]


def test_write_atomic_local_failure_removes_the_temporary(tmp_path, monkeypatch):
    target = tmp_path / "record.bin"

    def fsync(fd):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="injected"):
        rfs.write_atomic(str(target), PAYLOAD)
    assert list(tmp_path.iterdir()) == []


def test_write_atomic_memory(monkeypatch):
    url = f"memory://recps-test-{uuid.uuid4().hex[:8]}/r.json"
    rfs.write_atomic(url, b'{"pass": 1}')
    assert rfs.read_bytes(url) == b'{"pass": 1}'
    with pytest.raises(FileExistsError, match="committed record"):
        rfs.write_atomic(url, b"{}")
    assert rfs.read_bytes(url) == b'{"pass": 1}'
    rfs.write_atomic(url, b'{"pass": 2}', overwrite=True)
    assert rfs.read_bytes(url) == b'{"pass": 2}'
    fs, path = rfs.resolve(url)
    monkeypatch.setattr(fs, "mv", lambda *a, **k: (_ for _ in ()).throw(OSError("mv failed (injected)")))
    with pytest.raises(OSError, match="injected"):
        rfs.write_atomic(rfs.join(url.rsplit("/", 1)[0], "s.json"), b"x")
    assert fs.ls(path.rsplit("/", 1)[0], detail=False) == [path]


def test_read_bytes_of_a_missing_file_names_it(tmp_path):
    missing = tmp_path / "nope.bin"
    with pytest.raises(FileSystemError, match=f"{missing} does not exist"):
        rfs.read_bytes(str(missing))
    with pytest.raises(FileSystemError, match="memory:///recps-none/x does not exist"):
        rfs.read_bytes("memory://recps-none/x")
    assert not rfs.exists(str(missing))


# --- the timeout ------------------------------------------------------------------------------


def test_the_timeout_comes_from_the_option_the_environment_or_60_s(monkeypatch):
    monkeypatch.delenv("RECPS_FS_TIMEOUT_S", raising=False)
    fs, _ = rfs.resolve("webhdfs://127.0.0.1:1/x")  # nothing connects until a call
    assert fs.timeout_s == 60 == rfs.DEFAULT_TIMEOUT_S and fs.session.timeout == 60
    fs, _ = rfs.resolve("webhdfs://127.0.0.1:1/x", timeout_s=3)
    assert fs.timeout_s == 3 and fs.session.timeout == 3
    monkeypatch.setenv("RECPS_FS_TIMEOUT_S", "7.5")
    fs, _ = rfs.resolve("webhdfs://127.0.0.1:1/x")
    assert fs.session.timeout == 7.5
    fs, _ = rfs.resolve("hdfs://127.0.0.1:1/x")
    assert fs.client.timeout_s == 7.5
    assert rfs.resolve("hdfs://127.0.0.1:1/x", timeout_s=2)[0].client.timeout_s == 2
    monkeypatch.setenv("RECPS_FS_TIMEOUT_S", "soon")
    with pytest.raises(FileSystemError, match=r"RECPS_FS_TIMEOUT_S='soon': .* positive number of seconds"):
        rfs.resolve("webhdfs://127.0.0.1:1/x")
    with pytest.raises(FileSystemError, match=r"timeout_s=0: "):
        rfs.resolve("hdfs://127.0.0.1:1/x", timeout_s=0)
    assert isinstance(rfs.resolve("memory://x", timeout_s=5)[0], MemoryFileSystem)  # ignored there


@pytest.mark.parametrize("scheme", ["hdfs", "webhdfs"])
def test_an_unreachable_namenode_fails_fast_naming_host_port(scheme):
    port = _free_port()
    url = f"{scheme}://127.0.0.1:{port}/ckpt/manifest.json"
    start = time.monotonic()
    with pytest.raises(TransientFileSystemError, match=rf"127\.0\.0\.1:{port}.*is the NameNode up at 127\.0\.0\.1:{port}"):
        rfs.exists(url)
    with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
        rfs.read_bytes(url)
    with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
        rfs.write_atomic(url, b"{}")
    assert time.monotonic() - start < 8  # measured: webhdfs ~0.01 s, hdfs-native 0.2-1.5 s (3 calls)


@pytest.mark.parametrize("scheme", ["hdfs", "webhdfs"])
def test_a_namenode_that_never_answers_is_bounded_by_the_timeout(scheme, silent_port):
    fs, path = rfs.resolve(f"{scheme}://127.0.0.1:{silent_port}/x", timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(FileSystemTimeoutError, match=rf"127\.0\.0\.1:{silent_port}.*no answer within timeout_s=0\.5 s"):
        fs.exists(path)
    elapsed = time.monotonic() - start
    assert 0.45 < elapsed < 3, elapsed


# --- the test HDFS ----------------------------------------------------------------------------


@pytest.mark.e2e
def test_hdfs_urls_resolve_and_display_with_host_and_port(hdfs):
    fs, path = rfs.resolve(f"{hdfs.url}/a/b.bin")
    assert type(fs).__module__ == "recps.fs.native" and path == "/a/b.bin"
    assert rfs.display(fs, path) == f"{hdfs.url}/a/b.bin"
    web, path = rfs.resolve(f"{hdfs.webhdfs_url}/a/b.bin")
    assert type(web).__module__ == "recps.fs.webhdfs" and path == "/a/b.bin"
    assert rfs.display(web, path) == f"{hdfs.webhdfs_url}/a/b.bin"
    assert rfs.join(hdfs.url, "a", "b.bin") == f"{hdfs.url}/a/b.bin"


@pytest.mark.e2e
def test_write_atomic_on_hdfs(hdfs_root, monkeypatch):
    url = rfs.join(hdfs_root, "manifest", "pass-1.bin")
    fs, path = rfs.resolve(url)
    parent = path.rsplit("/", 1)[0]
    seen = {}
    real_mv = fs.mv

    def mv(src, dst, **kwargs):  # the moment the record appears: the temporary is complete
        seen["tmp"], seen["target_existed"] = fs.cat_file(src), fs.exists(dst)
        return real_mv(src, dst, **kwargs)

    monkeypatch.setattr(fs, "mv", mv)
    assert rfs.write_atomic(url, PAYLOAD) == url
    assert seen == {"tmp": PAYLOAD, "target_existed": False}
    assert rfs.read_bytes(url) == PAYLOAD
    monkeypatch.undo()

    with pytest.raises(FileExistsError, match=f"{url} exists; it is a committed record"):
        rfs.write_atomic(url, b"other")
    assert rfs.read_bytes(url) == PAYLOAD
    rfs.write_atomic(url, b"replaced", overwrite=True)
    assert rfs.read_bytes(url) == b"replaced"
    assert fs.ls(parent, detail=False) == [path]


@pytest.mark.e2e
def test_write_atomic_on_hdfs_removes_the_temporary_on_failure(hdfs_root, monkeypatch):
    url = rfs.join(hdfs_root, "r.bin")
    fs, path = rfs.resolve(url)
    parent = path.rsplit("/", 1)[0]

    def mv(src, dst, **kwargs):
        raise PermissionError(f"rename {src} refused (injected)")

    monkeypatch.setattr(fs, "mv", mv)
    with pytest.raises(PermissionError, match="injected"):
        rfs.write_atomic(url, PAYLOAD)
    monkeypatch.undo()
    assert fs.ls(parent, detail=False) == [] and not rfs.exists(url)
    rfs.write_atomic(url, b"first")
    monkeypatch.setattr(fs, "mv", mv)
    with pytest.raises(PermissionError, match="injected"):
        rfs.write_atomic(url, b"second", overwrite=True)
    monkeypatch.undo()
    assert rfs.read_bytes(url) == b"first" and _temporaries(fs, parent) == []


@pytest.mark.e2e
def test_read_bytes_and_exists_on_hdfs(hdfs_root):
    missing = rfs.join(hdfs_root, "nope.bin")
    with pytest.raises(FileSystemError, match=f"{missing} does not exist"):
        rfs.read_bytes(missing)
    assert rfs.exists(missing) is False
    rfs.write_atomic(missing, b"now")
    assert rfs.exists(missing) is True and rfs.exists(hdfs_root) is True


@pytest.mark.e2e
def test_webhdfs_acts_as_the_same_user_as_hdfs_native(hdfs, monkeypatch):
    monkeypatch.delenv("HADOOP_USER_NAME", raising=False)
    url = f"{hdfs.webhdfs_url}/recps-fs/{uuid.uuid4().hex[:8]}/owned.txt"
    rfs.write_atomic(url, b"x")  # no user= given
    web, path = rfs.resolve(url)
    native, _ = rfs.resolve(f"{hdfs.url}{path}")
    assert web.info(path)["owner"] == getpass.getuser() == native.info(path)["owner"]


def test_retry_transient_repeats_only_what_may_succeed_later(monkeypatch):
    monkeypatch.setattr("recps.fs._common.time.sleep", lambda s: None)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise TransientFileSystemError("addBlock on hdfs://nn: NotReplicatedYetException: Not replicated yet")
        return "done"

    assert rfs.retry_transient(flaky, "save", retries=2) == "done" and len(calls) == 3
    calls.clear()
    with pytest.raises(TransientFileSystemError):  # the budget spent: the last failure as it was
        rfs.retry_transient(flaky, "save", retries=1)
    assert len(calls) == 2

    def refused():
        calls.append(1)
        raise FileExistsError("exists")

    calls.clear()
    with pytest.raises(FileExistsError):  # a definite answer: never tried again
        rfs.retry_transient(refused, "save", retries=3)
    assert len(calls) == 1


def test_not_replicated_yet_is_transient():
    from recps.fs.native import call_bounded

    def add_block():
        raise RuntimeError('RPCError("org.apache.hadoop.hdfs.server.namenode.NotReplicatedYetException", '
                           '"Not replicated yet: /x/keys.bin\\n\\tat org.apache...")')

    with pytest.raises(TransientFileSystemError, match="NotReplicatedYetException: Not replicated yet: /x/keys.bin"):
        call_bounded("hdfs://127.0.0.1:1", "write", add_block, 5.0)


@pytest.mark.e2e
def test_one_hdfs_file_system_a_process_whatever_the_thread(hdfs_root):
    """fsspec keeps a synchronous file system per thread, for good; on hdfs:// that was an
    hdfs-native client (and its runtime) more for every thread that touched HDFS: a save's
    thread pool each pass. Every thread here gets the one instance, which also works from all."""
    import threading

    seen: list = []

    def use(i: int) -> None:
        fs, path = rfs.resolve(f"{hdfs_root}/t{i}")
        seen.append(fs)
        rfs.write_atomic(f"{hdfs_root}/t{i}", str(i))

    threads = [threading.Thread(target=use, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(seen) == 6 and len({id(fs) for fs in seen}) == 1
    assert seen[0] is rfs.resolve(hdfs_root)[0]
    assert [rfs.read_bytes(f"{hdfs_root}/t{i}") for i in range(6)] == [str(i).encode() for i in range(6)]
    # other arguments (a timeout) are another file system
    assert rfs.resolve(hdfs_root, timeout_s=7)[0] is not seen[0]
