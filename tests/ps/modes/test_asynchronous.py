"""AsyncCommunicator: everything pushed is applied after flush; the queue bounds the pushes in
flight; dense copies refresh in the background. Servers run in this process on 127.0.0.1."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from recps.errors import ConfigError, PSError
from recps.ps.modes import AsyncCommunicator, AsyncMode, Communicator, server_halves
from recps.ps.node import PSClient, PSServer

TOKEN = "async-test"


@pytest.fixture
def cluster():
    server = PSServer(token=TOKEN, halves=server_halves()).start()
    client = PSClient([server.endpoint], token=TOKEN, timeout_s=10.0)
    client.create_sparse_table("emb", dim=3, optimizer={"name": "sgd", "lr": 1.0}, initializer={"kind": "zeros"},
                               mode="async")
    client.create_dense_table("dense", 5, optimizer={"name": "sgd", "lr": 1.0}, mode="async")
    yield server, client
    client.close()
    server.stop()


def test_everything_is_applied_after_flush(cluster):
    _, client = cluster
    comm = AsyncMode(max_pending=4, merge_threshold=3).communicator(client)
    assert isinstance(comm, AsyncCommunicator) and isinstance(comm, Communicator) and comm.mode == "async"
    g = torch.Generator().manual_seed(0)
    pushes = [[(torch.randperm(40, generator=g)[:25], torch.randn(25, 3, generator=g), torch.randn(5, generator=g))
               for _ in range(20)] for _ in range(2)]
    high_water = []

    def thread(t: int) -> None:
        for keys, grads, dense in pushes[t]:
            comm.push("emb", keys, grads)
            comm.push_dense("dense", dense)
            high_water.append(comm.pending)
            comm.step_end(t)

    threads = [threading.Thread(target=thread, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    comm.flush()
    assert comm.pending == 0 and comm.sent_pushes == 40
    assert max(high_water) <= 4  # the staleness bound held
    # SGD with lr 1 from zeros: each row is minus the sum of every gradient pushed for it.
    expected = torch.zeros(40, 3)
    expected_dense = torch.zeros(5)
    for per_thread in pushes:
        for keys, grads, dense in per_thread:
            expected.index_add_(0, keys, -grads)
            expected_dense -= dense
    torch.testing.assert_close(comm.pull("emb", torch.arange(40)), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comm.pull_dense("dense"), expected_dense, rtol=1e-5, atol=1e-5)  # the local copy
    torch.testing.assert_close(client.pull_dense("dense").wait(), expected_dense, rtol=1e-5, atol=1e-5)
    comm.close()
    comm.close()  # idempotent


def test_dense_copy_refreshes_in_the_background(cluster):
    _, client = cluster
    comm = AsyncCommunicator(client, AsyncMode(dense_refresh_steps=1))
    assert comm.pull_dense("dense").tolist() == [0.0] * 5  # first call fetches
    client.push_dense("dense", torch.ones(5)).wait()  # another worker's update
    comm.step_end(0)
    deadline = time.monotonic() + 5.0
    while comm.pull_dense("dense")[0].item() != -1.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert comm.pull_dense("dense").tolist() == [-1.0] * 5
    comm.close()


def test_push_blocks_when_max_pending_are_unapplied():
    server = PSServer(token=TOKEN, halves=server_halves()).start()
    client = PSClient([server.endpoint], token=TOKEN, timeout_s=1.0)
    client.create_sparse_table("emb", dim=2, mode="async")
    server.stop()  # nothing will be applied any more
    comm = AsyncMode(max_pending=3, merge_threshold=1, timeout_s=1.0).communicator(client)
    try:
        start = time.monotonic()
        for _ in range(3):
            comm.push("emb", torch.tensor([1, 2]), torch.ones(2, 2))
        assert time.monotonic() - start < 0.5  # within the bound: no waiting
        with pytest.raises(PSError, match="unapplied|did not answer push"):
            comm.push("emb", torch.tensor([1, 2]), torch.ones(2, 2))
        assert 0.8 < time.monotonic() - start < 3.0
        assert comm.pending == 3
        with pytest.raises(PSError):
            comm.close()
    finally:
        client.close()


def _wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_min_merge_sends_every_m_pushes_as_one_and_flush_sends_the_rest(cluster):
    _, client = cluster
    comm = AsyncMode(max_pending=4, merge_threshold=4, min_merge=3).communicator(client)
    keys = torch.tensor([1, 2])
    for _ in range(2):
        comm.push("emb", keys, torch.ones(2, 3))
        comm.push_dense("dense", torch.ones(5))
    time.sleep(0.2)  # the sender waits for a third push: nothing reached the server
    assert comm.sends == 0 and comm.pending == 2
    assert client.pull("emb", keys).wait().abs().sum().item() == 0.0
    assert client.pull_dense("dense").wait().tolist() == [0.0] * 5
    comm.push("emb", keys, torch.ones(2, 3))
    assert _wait_until(lambda: comm.pending == 0)
    assert comm.sends == 1 and comm.sent_pushes == 3  # three pushes, one request
    torch.testing.assert_close(client.pull("emb", keys).wait(), torch.full((2, 3), -3.0))
    assert client.pull_dense("dense").wait().tolist() == [0.0] * 5  # two dense sums wait for a third
    comm.push("emb", keys, torch.ones(2, 3))
    comm.flush()  # sends what is queued, below min_merge
    assert comm.sent_pushes == 4
    torch.testing.assert_close(client.pull("emb", keys).wait(), torch.full((2, 3), -4.0))
    assert client.pull_dense("dense").wait().tolist() == [-2.0] * 5
    comm.close()


def test_dense_min_merge_sends_the_dense_sum_on_its_own_count(cluster):
    _, client = cluster
    comm = AsyncMode(max_pending=4, merge_threshold=4, min_merge=4, dense_min_merge=2).communicator(client)
    comm.push_dense("dense", torch.ones(5))
    time.sleep(0.2)
    assert client.pull_dense("dense").wait().tolist() == [0.0] * 5
    comm.push_dense("dense", torch.ones(5))
    assert _wait_until(lambda: client.pull_dense("dense").wait().tolist() == [-2.0] * 5)
    assert _wait_until(lambda: comm.pull_dense("dense").tolist() == [-2.0] * 5)  # the copy from the reply
    comm.close()


@pytest.mark.parametrize("kwargs", [{"min_merge": 0}, {"min_merge": 5, "max_pending": 4}, {"min_merge": 3, "merge_threshold": 2}])
def test_min_merge_out_of_range_is_refused(kwargs):
    """The mode refuses its knobs when it is built (before any communicator or server)."""
    with pytest.raises(ConfigError, match="min_merge"):
        AsyncMode(**kwargs)
