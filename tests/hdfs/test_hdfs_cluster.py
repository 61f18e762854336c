"""Smoke tests of the test HDFS (tests/conftest.py's `hdfs`, Hadoop 2.7.3 on 127.0.0.1).

Each client does the same round trip: mkdir, write (a few blocks: dfs.blocksize is 1 MiB),
read, list, rename, delete; plus WebHDFS <-> RPC cross reads and the bind address.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.webhdfs import WebHDFS

pytestmark = pytest.mark.e2e  # every test here starts a process

BIG = os.urandom(1024 * 1024 * 2 + 12345)  # three 1 MiB blocks


def _dir(name: str) -> str:
    return f"/recps-smoke/{name}-{uuid.uuid4().hex[:8]}"


def _webhdfs(hdfs) -> WebHDFS:
    return WebHDFS(host=hdfs.host, port=hdfs.http_port, user="root")


def test_fixture_api(hdfs):
    assert hdfs.host == "127.0.0.1"
    assert hdfs.url == f"hdfs://127.0.0.1:{hdfs.rpc_port}"
    assert hdfs.webhdfs_url == f"webhdfs://127.0.0.1:{hdfs.http_port}"
    assert (hdfs.work_dir / "pids").is_file()


def test_webhdfs_round_trip(hdfs):
    fs = _webhdfs(hdfs)
    d = _dir("webhdfs")
    fs.makedirs(d)
    with fs.open(f"{d}/a.bin", "wb") as f:
        f.write(BIG)
    fs.pipe_file(f"{d}/small.txt", b"hello")
    assert fs.cat_file(f"{d}/a.bin") == BIG
    assert fs.cat_file(f"{d}/a.bin", start=1024 * 1024 - 3, end=1024 * 1024 + 3) == BIG[
        1024 * 1024 - 3 : 1024 * 1024 + 3
    ]
    assert fs.info(f"{d}/a.bin")["size"] == len(BIG)
    assert sorted(fs.ls(d, detail=False)) == [f"{d}/a.bin", f"{d}/small.txt"]
    fs.mv(f"{d}/a.bin", f"{d}/b.bin")
    assert not fs.exists(f"{d}/a.bin")
    assert fs.cat_file(f"{d}/b.bin") == BIG
    fs.rm(f"{d}/b.bin")
    assert fs.ls(d, detail=False) == [f"{d}/small.txt"]
    fs.rm(d, recursive=True)
    assert not fs.exists(d)


def test_webhdfs_by_url(hdfs):
    d = _dir("url")
    with fsspec.open(f"{hdfs.webhdfs_url}{d}/u.txt", "wb", user="root") as f:
        f.write(b"by url")
    with fsspec.open(f"{hdfs.webhdfs_url}{d}/u.txt", "rb", user="root") as f:
        assert f.read() == b"by url"
    _webhdfs(hdfs).rm(d, recursive=True)


def test_hdfs_native_client_round_trip(hdfs):
    from hdfs_native import Client

    c = Client(hdfs.url)
    d = _dir("native")
    c.mkdirs(d, create_parent=True)
    with c.create(f"{d}/a.bin") as w:
        w.write(BIG)
    with c.read(f"{d}/a.bin") as r:
        assert r.read() == BIG
    assert c.get_file_info(f"{d}/a.bin").length == len(BIG)
    with c.append(f"{d}/a.bin") as w:
        w.write(b"tail")
    with c.read(f"{d}/a.bin") as r:
        assert r.read() == BIG + b"tail"
    c.rename(f"{d}/a.bin", f"{d}/b.bin")
    assert [s.path for s in c.list_status(d)] == [f"{d}/b.bin"]
    with c.create(f"{d}/c.bin") as w:
        w.write(b"c")
    c.rename(f"{d}/c.bin", f"{d}/b.bin", overwrite=True)
    with c.read(f"{d}/b.bin") as r:
        assert r.read() == b"c"
    assert c.delete(f"{d}/b.bin")
    assert list(c.list_status(d)) == []
    assert c.delete(d, recursive=True)


def test_hdfs_native_fsspec_round_trip(hdfs):
    from hdfs_native.fsspec import HdfsFileSystem

    fs = HdfsFileSystem(host=hdfs.host, port=hdfs.rpc_port)
    d = _dir("native-fsspec")
    fs.makedirs(d)
    with fs.open(f"{d}/a.bin", "wb") as f:
        f.write(BIG)
    assert fs.cat_file(f"{d}/a.bin") == BIG
    assert fs.ls(d, detail=False) == [f"{d}/a.bin"]
    fs.mv(f"{d}/a.bin", f"{d}/b.bin")
    assert fs.ls(d, detail=False) == [f"{d}/b.bin"]
    fs.rm(f"{d}/b.bin")
    assert fs.ls(d, detail=False) == []
    fs.rm(d, recursive=True)
    assert not fs.exists(d)


def test_rpc_and_webhdfs_see_the_same_files(hdfs):
    from hdfs_native import Client

    c, web = Client(hdfs.url), _webhdfs(hdfs)
    d = _dir("cross")
    with c.create(f"{d}/by-rpc.bin") as w:
        w.write(BIG)
    assert web.cat_file(f"{d}/by-rpc.bin") == BIG
    web.pipe_file(f"{d}/by-http.txt", b"over http")
    with c.read(f"{d}/by-http.txt") as r:
        assert r.read() == b"over http"
    web.rm(d, recursive=True)


def _listening(pid: int) -> list[str]:
    """The local addresses (hex ip:port, /proc/net/tcp form) pid listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                out.append(fields[1])
    return out


@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="needs Linux /proc")
def test_binds_only_loopback(hdfs):
    for name in ("namenode_pid", "datanode_pid"):
        addrs = _listening(hdfs.info[name])
        assert addrs, name
        # 0100007F is 127.0.0.1 in /proc/net/tcp's byte order
        assert all(a.split(":")[0] == "0100007F" for a in addrs), (name, addrs)
    ports = {int(a.split(":")[1], 16) for a in _listening(hdfs.info["namenode_pid"])}
    assert {hdfs.rpc_port, hdfs.http_port} <= ports
