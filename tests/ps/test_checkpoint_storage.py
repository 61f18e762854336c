"""PS checkpoints through recps.fs: written by 2 servers, read back by 1 and by 3 (re-sharding),
on the local disk and on the real HDFS (tests/conftest.py's `hdfs` fixture), through hdfs://
(hdfs-native) and webhdfs://; rows and optimizer state bit-equal."""

from __future__ import annotations

import uuid

import pytest
import torch

from recps.ps.node.client import PSClient

TOKEN = "storage-test"
KEYS = torch.arange(-3000, 3000, 7, dtype=torch.int64) * 1_000_003  # spread over every partition


def trained(client: PSClient) -> None:
    client.create_sparse_table("emb", dim=8, optimizer={"name": "adagrad", "lr": 0.1},
                               initializer={"kind": "normal", "std": 0.1}, seed=3)
    client.create_dense_table("dense", {"w": torch.zeros(5, 3), "b": torch.zeros(3)},
                              optimizer={"name": "adam", "lr": 0.01})
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        client.pull("emb", KEYS).wait()
        client.push("emb", KEYS, torch.randn(KEYS.numel(), 8, generator=gen)).wait()
        client.push_dense("dense", torch.randn(18, generator=gen)).wait()


def snapshot(servers) -> dict[int, torch.Tensor]:
    """key -> [values | optimizer state] over every server's shard of "emb"."""
    rows = {}
    for s in servers:
        table = s.sparse("emb")
        keys, values, state = _rows(table)
        for k, v, st in zip(keys.tolist(), values, state):
            rows[k] = torch.cat([v, st])
    return rows


def _rows(table):
    used = table._used
    live = table._live[:used]
    keys = table._keys[:used][live]
    block = table._rows[:used][live]
    return keys, block[:, : table.dim], block[:, table._scol : table._mcol]


def dense_state(client: PSClient) -> torch.Tensor:
    return client.pull_dense("dense").wait()


def roundtrip(url: str, readers: int, ps_cluster) -> None:
    with ps_cluster(2, TOKEN) as (servers, client):
        trained(client)
        before, dense_before = snapshot(servers), dense_state(client)
        client.save(url, tables=["emb", "dense"])
        dense_opt = [s.dense("dense") for s in servers if s.dense("dense") is not None]
        state_before = {n: st.clone() for d in dense_opt for n, st in d._state.items()}
    with ps_cluster(readers, TOKEN) as (servers, client):
        client.load(url)  # a fresh cluster restores every saved table from its spec
        after = snapshot(servers)
        assert sorted(after) == sorted(before) and len(after) == len(set(KEYS.tolist()))
        for k, row in before.items():
            assert torch.equal(after[k], row), k
        assert torch.equal(dense_state(client), dense_before)
        state_after = {n: st for s in servers if s.dense("dense") is not None for n, st in s.dense("dense")._state.items()}
        assert sorted(state_after) == sorted(state_before)
        for n, st in state_before.items():
            assert torch.equal(state_after[n], st), n


@pytest.mark.parametrize("readers", [1, 3])
def test_two_servers_write_one_and_three_read_on_file(tmp_path, readers, ps_cluster):
    roundtrip(str(tmp_path / "ckpt"), readers, ps_cluster)


@pytest.mark.e2e
@pytest.mark.parametrize("readers", [1, 3])
@pytest.mark.parametrize("scheme", ["hdfs", "webhdfs"])
def test_two_servers_write_one_and_three_read_on_real_hdfs(hdfs, scheme, readers, ps_cluster):
    base = hdfs.url if scheme == "hdfs" else hdfs.webhdfs_url
    roundtrip(f"{base}/recps-tests/{uuid.uuid4().hex}/ckpt", readers, ps_cluster)


@pytest.mark.e2e
def test_a_corrupt_shard_on_hdfs_is_refused_naming_the_file(hdfs, ps_cluster):
    from recps import fs as rfs

    url = f"{hdfs.url}/recps-tests/{uuid.uuid4().hex}/ckpt"
    with ps_cluster(2, TOKEN) as (_, client):
        trained(client)
        client.save(url, tables=["emb"])
    fs, path = rfs.resolve(rfs.join(url, "emb", "shard-00001-of-00002", "values.bin"))
    data = bytearray(fs.cat_file(path))
    data[100] ^= 0xFF
    fs.rm_file(path)
    fs.pipe_file(path, bytes(data))
    with ps_cluster(1, TOKEN) as (_, client):
        with pytest.raises(Exception, match="checksum mismatch in .*shard-00001-of-00002/values.bin"):
            client.load(url)


def _leftovers(fs, path: str) -> list[str]:
    """Temporaries (.shard-...tmp-..., .name.tmp-...) anywhere under `path`."""
    return [p for p in fs.find(path, withdirs=True) if ".tmp-" in p.rsplit("/", 1)[-1]]


@pytest.mark.e2e
def test_a_full_hdfs_fails_the_save_naming_the_quota_and_keeps_the_saved_checkpoint(hdfs, ps_cluster):
    """A space quota stands in for a full cluster: the save fails with the NameNode's reason (which
    names the folder and the quota), leaves no temporary, and the checkpoint saved before still loads."""
    from recps import fs as rfs

    root = f"/recps-tests/{uuid.uuid4().hex}"
    fs, _ = rfs.resolve(hdfs.url + root)
    fs.makedirs(root, exist_ok=True)
    with ps_cluster(2, TOKEN) as (servers, client):
        trained(client)
        before = snapshot(servers)
        client.save(f"{hdfs.url}{root}/first", tables=["emb", "dense"])
        hdfs.admin("-setSpaceQuota", str(fs.du(root) + 2**19), root)  # not one more 1 MiB block
        try:
            with pytest.raises(Exception, match=rf"DSQuotaExceededException: The DiskSpace quota of {root} is exceeded"):
                client.save(f"{hdfs.url}{root}/second", tables=["emb", "dense"])
        finally:
            hdfs.admin("-clrSpaceQuota", root)
    assert _leftovers(fs, root) == []
    with ps_cluster(1, TOKEN) as (servers, client):
        client.load(f"{hdfs.url}{root}/first")
        assert snapshot(servers).keys() == before.keys()


@pytest.mark.e2e
def test_hdfs_in_safe_mode_fails_the_save_after_its_retries_naming_it(hdfs, ps_cluster):
    """A NameNode refusing writes (safe mode): transient, so each table's save is tried again
    (recps.ps.node.server.SAVE_RETRIES), then the save fails with the NameNode's reason."""
    url = f"{hdfs.url}/recps-tests/{uuid.uuid4().hex}/ckpt"
    with ps_cluster(2, TOKEN) as (_, client):
        trained(client)
        hdfs.admin("-safemode", "enter")
        try:
            with pytest.raises(Exception, match=r"SafeModeException: .*safe mode"):
                client.save(url, tables=["emb"])
        finally:
            hdfs.admin("-safemode", "leave")
        client.save(url, tables=["emb"])  # the same save once the NameNode takes writes again
