"""PSServer + PSClient: ps-lite arithmetic, partition and reassembly, tables tagged with their
mode (async: the update rule on arrival; geo: deltas added), dense tables, checkpoints across
cluster sizes, errors. Servers run in this process on 127.0.0.1 free ports. The sync mode's
server half (step aggregation) is tested in tests/ps/modes/test_synchronous.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from recps.errors import ConfigError, PSError, PSTimeoutError
from recps.ps.modes import server_halves
from recps.ps.node import PSClient, PSServer, unique_inverse
from recps.ps.table import AdagradRule, Initializer, SparseTable, partition
from recps.ps.table import checkpoint
from recps.ps.table.checkpoint import read_table

TOKEN = "node-test"
INIT = {"kind": "uniform", "low": -0.1, "high": 0.1}


class Cluster:
    """S in-process servers and a way to make clients for them."""

    def __init__(self, num_servers: int, num_threads: int = 2) -> None:
        self.servers = [PSServer(i, num_servers, token=TOKEN, num_threads=num_threads, halves=server_halves()).start()
                        for i in range(num_servers)]
        self.endpoints = [s.endpoint for s in self.servers]
        self.clients: list[PSClient] = []

    def client(self, worker: int = 0, workers: int = 1, timeout_s: float = 10.0) -> PSClient:
        c = PSClient(self.endpoints, token=TOKEN, timeout_s=timeout_s, worker_index=worker, num_workers=workers)
        self.clients.append(c)
        return c

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for s in self.servers:
            s.stop()


@pytest.fixture(params=[2, 0], ids=["threads2", "inline"])
def cluster2(request):
    """2 servers with 2 handler threads each, or serving on the network thread."""
    c = Cluster(2, num_threads=request.param)
    yield c
    c.close()


def test_unique_inverse_round_trip():
    keys = torch.tensor([5, -3, 5, 2**62, -3, 7])
    uniq, inverse = unique_inverse(keys)
    assert torch.equal(uniq[inverse], keys)
    assert uniq.numel() == 4
    same, none = unique_inverse(torch.tensor([3, 1, 2]))
    assert none is None and same.tolist() == [3, 1, 2]


def test_push_n_times_equals_table_in_process(cluster2):
    """ps-lite style: push n times (duplicates inside each push), pull, compare with one SparseTable."""
    client = cluster2.client()
    client.create_sparse_table("emb", dim=4, optimizer={"name": "adagrad", "lr": 0.1}, initializer=INIT, seed=7)
    reference = SparseTable(4, optimizer=AdagradRule(lr=0.1), initializer=Initializer(**INIT), seed=7)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        keys = torch.randint(-50, 50, (300,), generator=g) * 1_000_003  # (K,) many duplicates, negative keys too
        grads = torch.randn(300, 4, generator=g)  # (K, 4)
        pulled = client.pull("emb", keys).wait()
        torch.testing.assert_close(pulled, reference.pull(keys), rtol=1e-6, atol=1e-6)  # sums of duplicates may round differently
        client.push("emb", keys, grads).wait()
        reference.push(keys, grads)
    keys = torch.arange(-50, 50) * 1_000_003
    torch.testing.assert_close(client.pull("emb", keys).wait(), reference.pull(keys), rtol=1e-6, atol=1e-6)


def test_two_servers_partition_and_key_order(cluster2):
    client = cluster2.client()
    client.create_sparse_table("emb", dim=3, optimizer={"name": "sgd", "lr": 1.0}, initializer={"kind": "zeros"})
    keys = torch.tensor([9, 4, 9, 100, -7, 4, 2**40, 9])  # duplicates, arbitrary order
    grads = torch.arange(keys.numel() * 3, dtype=torch.float32).view(-1, 3)  # (K, 3)
    client.push("emb", keys, grads).wait()
    rows = client.pull("emb", keys).wait()  # (K, 3)
    # Each key's row is minus the sum of its gradients, returned at every occurrence in caller order.
    expected = torch.stack([-grads[keys == k].sum(0) for k in keys.tolist()])
    torch.testing.assert_close(rows, expected)
    # Each server holds exactly the keys the shared partition function gives it.
    held = [set(s.sparse("emb").keys().tolist()) for s in cluster2.servers]
    uniq = torch.unique(keys)
    owner = partition(uniq, 2)
    for i in range(2):
        assert held[i] == set(uniq[owner == i].tolist())
    assert held[0] and held[1]


def test_empty_pull_and_create_false(cluster2):
    client = cluster2.client()
    client.create_sparse_table("emb", dim=2, initializer={"kind": "uniform", "low": 1.0, "high": 2.0})
    assert client.pull("emb", torch.empty(0, dtype=torch.int64)).wait().shape == (0, 2)
    rows = client.pull("emb", torch.tensor([1, 2]), create=False).wait()
    assert rows.abs().sum() == 0  # not created: zeros
    assert client.stats()["tables"]["emb"]["rows"] == 0
    assert client.pull("emb", torch.tensor([1, 2])).wait().min() >= 1.0
    assert client.stats()["tables"]["emb"]["rows"] == 2


def test_geo_table_push_adds_deltas_without_the_update_rule(cluster2):
    """A table of mode geo: a push's rows are deltas, added to the values (value += delta, duplicates
    summed); the table's optimizer (Adagrad here) is not applied."""
    client = cluster2.client()
    client.create_sparse_table("emb", dim=2, optimizer={"name": "adagrad", "lr": 0.1}, initializer=INIT, seed=1,
                               mode="geo")
    keys = torch.tensor([7, 3, 7, 2**40])
    start = client.pull("emb", torch.unique(keys)).wait()  # (3, 2) initial values: 3, 7, 2**40
    deltas = torch.tensor([[1.0, 2.0], [0.5, 0.5], [3.0, 4.0], [-1.0, 0.0]])
    client.push("emb", keys, deltas).wait()
    expected = start + torch.tensor([[0.5, 0.5], [4.0, 6.0], [-1.0, 0.0]])
    torch.testing.assert_close(client.pull("emb", torch.unique(keys)).wait(), expected)
    client.push("emb", torch.tensor([3]), torch.tensor([[0.5, 0.5]])).wait()  # the same again: exactly additive
    torch.testing.assert_close(client.pull("emb", torch.tensor([3])).wait(), expected[:1] + 0.5)


def test_dense_table_named_params_two_servers(cluster2):
    a, b = cluster2.client(0, 2), cluster2.client(1, 2)
    params = {"w": torch.arange(6.0).view(2, 3), "b": torch.tensor([10.0, 20.0]), "s": torch.tensor([7.0])}
    a.create_dense_table("dense", params, optimizer={"name": "sgd", "lr": 1.0})
    layout = b.dense_layout("dense")  # b learns the spec from the servers
    assert layout.names == ["w", "b", "s"] and layout.size == 9
    assert set(layout.owner) == {0, 1}  # spread over both servers
    flat = b.pull_dense("dense").wait()
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0, 7.0]
    a.push_dense("dense", torch.ones(9)).wait()
    values = a.push_dense("dense", {"w": torch.ones(2, 3), "b": torch.ones(2), "s": torch.ones(1)}, return_values=True).wait()
    assert torch.equal(values, flat - 2)
    # GEO: the values plus the deltas, no update rule; return_values answers the merged values.
    a.create_dense_table("delta", params, optimizer={"name": "sgd", "lr": 1.0}, mode="geo")
    a.push_dense("delta", torch.full((9,), 0.5)).wait()
    assert torch.equal(b.pull_dense("delta").wait(), flat + 0.5)
    merged = b.push_dense("delta", torch.full((9,), -2.0), return_values=True).wait()
    assert torch.equal(merged, flat - 1.5) and torch.equal(a.pull_dense("delta").wait(), flat - 1.5)
    with pytest.raises(ConfigError, match="got 8 values"):
        a.push_dense("dense", torch.ones(8))


def test_create_is_idempotent_and_refuses_another_spec(cluster2):
    a, b = cluster2.client(), cluster2.client()
    spec = a.create_sparse_table("emb", dim=4, optimizer={"name": "adagrad", "lr": 0.1})
    assert b.create_sparse_table("emb", dim=4, optimizer={"name": "adagrad", "lr": 0.1}) == spec
    with pytest.raises(PSError, match=r"already exists with another spec \(dim: 4 -> 8"):
        b.create_sparse_table("emb", dim=8, optimizer={"name": "adagrad", "lr": 0.1})
    assert spec["mode"] == "async"  # the default mode
    with pytest.raises(PSError, match=r"already exists with another spec \(mode: 'async' -> 'geo'"):
        b.create_sparse_table("emb", dim=4, optimizer={"name": "adagrad", "lr": 0.1}, mode="geo")
    with pytest.raises(ConfigError, match="mode='Sync!'"):
        b.create_sparse_table("other", dim=4, mode="Sync!")
    with pytest.raises(ConfigError, match="optimizer"):
        b.create_sparse_table("other", dim=4, optimizer={"name": "lion"})
    with pytest.raises(ConfigError, match="table name"):
        b.create_sparse_table("a/b", dim=4)
    with pytest.raises(PSError, match="no table 'missing'"):
        b.pull("missing", torch.tensor([1])).wait()
    with pytest.raises(ConfigError, match="is sparse"):
        a.pull_dense("emb")


def test_table_of_a_mode_without_a_server_half_is_refused():
    """The server holds no mode policy: a table's mode must be one of the halves it was given."""
    with PSServer(token=TOKEN, halves={"geo": server_halves()["geo"]}) as server, \
            PSClient([server.endpoint], token=TOKEN, timeout_s=5.0) as client:
        with pytest.raises(PSError, match=r"trained by mode 'async'.*knows the modes \['geo'\].*server_halves"):
            client.create_sparse_table("emb", dim=2)  # the default mode, async
        with pytest.raises(PSError, match=r"trained by mode 'custom'"):
            client.create_dense_table("dense", 3, mode="custom")
        client.create_sparse_table("emb", dim=2, mode="geo", initializer={"kind": "zeros"})
        client.push("emb", torch.tensor([1]), torch.ones(1, 2)).wait()
        assert client.pull("emb", torch.tensor([1])).wait().tolist() == [[1.0, 1.0]]
        assert client.stats()["servers"][0]["pending"] == {"geo": 0}
    with PSServer(token=TOKEN) as bare, PSClient([bare.endpoint], token=TOKEN, timeout_s=5.0) as client:
        with pytest.raises(PSError, match=r"knows the modes none"):
            client.create_sparse_table("emb", dim=2)


def test_save_on_two_servers_load_on_three(tmp_path, cluster2):
    client = cluster2.client()
    client.create_sparse_table("emb", dim=3, optimizer={"name": "adagrad", "lr": 0.1}, initializer=INIT)
    client.create_dense_table("dense", {"w": torch.randn(4, 2), "b": torch.randn(3)}, optimizer={"name": "adam", "lr": 0.01})
    keys = torch.arange(0, 500) * 7919
    client.push("emb", keys, torch.randn(500, 3)).wait()
    client.push_dense("dense", torch.randn(11)).wait()
    written = client.save(str(tmp_path / "ckpt"), mode="full")
    assert written == {"emb": 500, "dense": 2}
    before_rows, before_dense = client.pull("emb", keys).wait(), client.pull_dense("dense").wait()

    three = Cluster(3)
    try:
        c3 = three.client()
        loaded = c3.load(str(tmp_path / "ckpt"))  # tables are created from the saved specs
        assert loaded == {"emb": 500, "dense": 2}
        assert c3.table_spec("emb")["mode"] == c3.table_spec("dense")["mode"] == "async"  # with their mode
        torch.testing.assert_close(c3.pull("emb", keys).wait(), before_rows, rtol=0, atol=0)
        torch.testing.assert_close(c3.pull_dense("dense").wait(), before_dense, rtol=0, atol=0)
        for i, s in enumerate(three.servers):  # re-partitioned by the shared function
            held = s.sparse("emb").keys()
            assert held.numel() > 0 and bool((partition(held, 3) == i).all())
        # Optimizer state came along: the same push gives the same values on both clusters.
        g = torch.randn(500, 3)
        client.push("emb", keys, g).wait()
        c3.push("emb", keys, g).wait()
        torch.testing.assert_close(c3.pull("emb", keys).wait(), client.pull("emb", keys).wait(), rtol=1e-6, atol=1e-6)
    finally:
        three.close()


def test_stats_and_shrink(cluster2):
    client = cluster2.client()
    client.create_sparse_table("ctr", dim=2, accessor={"delete_threshold": 0.5, "nonclk_coeff": 0.1, "click_coeff": 1.0})
    client.create_sparse_table("plain", dim=2)
    keys = torch.arange(100)
    client.pull("ctr", keys).wait()
    client.pull("plain", keys).wait()
    clicks = (keys < 30).float()  # score 1 (clicked) or 0.1, decayed by 0.98: 30 keys stay above 0.5
    client.push("ctr", keys, torch.zeros(100, 2), shows=torch.ones(100), clicks=clicks).wait()
    stats = client.stats()
    assert stats["tables"]["ctr"]["rows"] == 100 and stats["tables"]["plain"]["rows"] == 100
    assert sum(s["tables"]["ctr"]["rows"] for s in stats["servers"]) == 100
    assert stats["tables"]["ctr"]["memory_bytes"] > 0
    assert client.shrink() == 70  # tables without an accessor are skipped
    assert client.stats()["tables"]["ctr"]["rows"] == 30
    with pytest.raises(PSError, match="no accessor"):
        client.shrink(["plain"])


def test_save_modes_through_the_servers(tmp_path, cluster2, monkeypatch):
    """delta, base and batch on two servers select by Paddle's rule; a transient write failure,
    retried by the server, writes the same rows and resets their delta_score once; batch adds
    one unseen day to every row; a bad mode is refused naming the four."""
    client = cluster2.client()
    client.create_sparse_table("ctr", dim=2, accessor={"nonclk_coeff": 0.125, "click_coeff": 1.0,
                                                       "base_threshold": 1.0, "delta_threshold": 0.5})
    keys = torch.arange(200) * 7919
    is_clicked = torch.arange(200) % 4 == 0  # score 0.125 * 2 + 2 = 2.25; the others 0.125 * 4 = 0.5 < 1
    client.push("ctr", keys, torch.zeros(200, 2), shows=torch.full((200,), 4.0), clicks=is_clicked.float() * 2).wait()
    tables = [s.sparse("ctr") for s in cluster2.servers]

    def column(name: str) -> torch.Tensor:  # (200,) summed over the servers (a key has one)
        return sum(t.stats(keys)[name] for t in tables)

    real_commit, lock, failures = checkpoint.ShardWriter.commit, threading.Lock(), [1]

    def flaky_commit(writer, header):
        with lock:
            fail, failures[0] = failures[0] > 0, failures[0] - 1
        if fail:
            raise TimeoutError("a DataNode was slow to report the block")
        return real_commit(writer, header)

    monkeypatch.setattr(checkpoint.ShardWriter, "commit", flaky_commit)
    assert client.save(str(tmp_path / "delta"), mode="delta") == {"ctr": 50}
    assert failures[0] < 0  # one commit failed and was retried
    assert torch.equal(read_table(tmp_path / "delta" / "ctr").keys, torch.sort(keys[is_clicked]).values)
    assert torch.equal(column("delta_score"), torch.where(is_clicked, 0.0, 0.5))
    assert client.save(str(tmp_path / "delta2"), mode="delta") == {"ctr": 0}
    assert client.save(str(tmp_path / "base"), mode="base") == {"ctr": 50}
    assert client.save(str(tmp_path / "batch"), mode="batch") == {"ctr": 200}
    assert column("unseen_days").eq(1).all() and column("show").eq(4).all()
    with pytest.raises(ConfigError, match=r"mode='xbox'; use one of \('full', 'delta', 'base', 'batch'\)"):
        client.save(str(tmp_path / "x"), mode="xbox")


def test_wrong_token_is_refused(cluster2):
    bad = PSClient(cluster2.endpoints, token="not-the-token", timeout_s=5.0)
    try:
        with pytest.raises(PSError, match="token mismatch"):
            bad.create_sparse_table("emb", dim=2)
    finally:
        bad.close()


def test_dead_server_times_out_naming_it():
    cluster = Cluster(2)
    try:
        client = cluster.client(timeout_s=1.0)
        client.create_sparse_table("emb", dim=2)
        keys = torch.arange(1000)
        client.pull("emb", keys).wait()
        dead = cluster.servers[1]
        dead.stop()
        start = time.monotonic()
        with pytest.raises(PSTimeoutError) as info:
            client.pull("emb", keys).wait()
        elapsed = time.monotonic() - start
        n1 = int((partition(keys, 2) == 1).sum())
        assert dead.endpoint in str(info.value) and "'emb'" in str(info.value) and f"({n1} keys)" in str(info.value)
        assert elapsed < 2.5
    finally:
        cluster.close()


def test_stop_verb_sets_the_server_flag(cluster2):
    client = cluster2.client()
    client.stop_servers()
    assert all(s.wait_stop_requested(2.0) for s in cluster2.servers)


def test_client_is_thread_safe(cluster2):
    """4 threads pull and push at once through one client; SGD is additive, so the result is exact."""
    client = cluster2.client()
    client.create_sparse_table("emb", dim=2, optimizer={"name": "sgd", "lr": 1.0}, initializer={"kind": "zeros"})
    keys = torch.arange(64)
    errors = []

    def run() -> None:
        try:
            for _ in range(25):
                client.pull("emb", keys).wait()
                client.push("emb", keys, torch.ones(64, 2)).wait()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert torch.equal(client.pull("emb", keys).wait(), torch.full((64, 2), -100.0))


def test_the_engines_exchange_tables_are_created_at_debug_the_models_at_info(caplog):
    """Issue 32.7: every stream pass logged `created dense table 'recps.metrics.header.w1.b0'` at INFO; the
    engine's buffers (names under recps.) are created at DEBUG, the model's tables stay at INFO."""
    import logging

    c = Cluster(1)
    try:
        client = c.client()
        with caplog.at_level(logging.DEBUG, logger="recps.ps.node.server"):
            client.create_dense_table("dense", 3)
            client.create_dense_table("recps.metrics.header.w0.b0", 4, mode="geo")
    finally:
        c.close()
    created = [(r.levelname, r.getMessage()) for r in caplog.records if "created" in r.getMessage()]
    assert created == [("INFO", "server 0: created dense table 'dense' (async)"),
                       ("DEBUG", "server 0: created dense table 'recps.metrics.header.w0.b0' (geo)")]
