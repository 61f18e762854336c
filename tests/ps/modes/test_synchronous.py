"""Sync mode. SyncCommunicator: T threads of batch B equal one thread of batch T*B; W workers
equal one worker with the merged batch; a missing thread or worker fails naming it. SyncServer
(the server half): a step's pushes are applied once, with the mean over the workers, when all
arrived; a missing worker is named. Servers run in this process on 127.0.0.1."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F

from recps.errors import ConfigError, PSError, PSTimeoutError
from recps.ps.modes import Communicator, SyncCommunicator, SyncMode, server_halves
from recps.ps.modes.synchronous import SyncServer
from recps.ps.node import HostedTable, PSClient, PSServer
from recps.ps.node.specs import build_sparse, sparse_spec
from recps.ps.table import Initializer
from tests.helpers.threads import run_threads

TOKEN = "sync-test"
DIM = 4
INIT = {"kind": "uniform", "low": -0.2, "high": 0.2}


def make_cluster(num_workers: int = 1):
    server = PSServer(token=TOKEN, halves=server_halves()).start()
    clients = [PSClient([server.endpoint], token=TOKEN, timeout_s=10.0, worker_index=j, num_workers=num_workers)
               for j in range(num_workers)]
    clients[0].create_sparse_table("emb", dim=DIM, optimizer={"name": "adagrad", "lr": 0.1}, initializer=INIT, seed=3,
                                   mode="sync")
    clients[0].create_dense_table("dense", {"w": torch.linspace(-0.5, 0.5, DIM), "b": torch.zeros(1)},
                                  optimizer={"name": "sgd", "lr": 0.5}, mode="sync")
    return server, clients


def data(steps: int, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, 30, (steps, batch, 3), generator=g)  # (steps, B, F) small vocabulary: shared keys
    labels = (torch.rand(steps, batch, generator=g) < 0.4).float()  # (steps, B)
    return keys, labels


def train_step(comm: Communicator, keys: torch.Tensor, labels: torch.Tensor) -> None:
    """One thread's step of a tiny CTR model: logit = sum of the example's rows . w + b."""
    uniq, inverse = torch.unique(keys, return_inverse=True)  # (U,), (B, F)
    rows = comm.pull("emb", uniq).clone().requires_grad_()  # (U, D)
    dense = comm.pull_dense("dense").clone().requires_grad_()  # (D + 1,)
    logits = rows[inverse].sum(1) @ dense[:DIM] + dense[DIM]  # (B,)
    F.binary_cross_entropy_with_logits(logits, labels).backward()  # mean over the batch
    comm.push("emb", uniq, rows.grad)
    comm.push_dense("dense", dense.grad)


def snapshot(client: PSClient) -> tuple[torch.Tensor, torch.Tensor]:
    return client.pull("emb", torch.arange(30)).wait(), client.pull_dense("dense").wait()


def reference(keys, labels) -> tuple[torch.Tensor, torch.Tensor]:
    """One worker, one thread, the whole batch per step."""
    server, (client,) = make_cluster()
    try:
        comm = SyncCommunicator(client, num_threads=1)
        for s in range(keys.shape[0]):
            train_step(comm, keys[s], labels[s])
            comm.step_end(0)
        return snapshot(client)
    finally:
        client.close()
        server.stop()


def test_two_threads_equal_one_thread_with_the_merged_batch():
    keys, labels = data(steps=6, batch=16)
    expected = reference(keys, labels)
    server, (client,) = make_cluster()
    try:
        comm = SyncMode().communicator(client, threads=2)
        assert isinstance(comm, SyncCommunicator) and isinstance(comm, Communicator) and comm.mode == "sync"
        assert comm.num_threads == 2

        def thread(t: int) -> None:
            for s in range(keys.shape[0]):
                half = slice(8 * t, 8 * (t + 1))
                train_step(comm, keys[s, half], labels[s, half])
                comm.step_end(t)

        run_threads([lambda: thread(0), lambda: thread(1)])
        assert comm.step == 6
        rows, dense = snapshot(client)
        torch.testing.assert_close(rows, expected[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dense, expected[1], rtol=1e-5, atol=1e-6)
        initial = Initializer(**INIT)(torch.arange(30), DIM, seed=3)  # (30, D) the rows before training
        assert (rows - initial).abs().max() > 1e-3  # it did train
    finally:
        client.close()
        server.stop()


def test_two_workers_equal_one_worker_with_the_merged_batch():
    keys, labels = data(steps=5, batch=12, seed=1)
    expected = reference(keys, labels)
    server, clients = make_cluster(num_workers=2)
    try:
        comms = [SyncCommunicator(c, num_threads=1) for c in clients]

        def worker(j: int) -> None:
            for s in range(keys.shape[0]):
                half = slice(6 * j, 6 * (j + 1))
                train_step(comms[j], keys[s, half], labels[s, half])
                comms[j].step_end(0)

        run_threads([lambda: worker(0), lambda: worker(1)])
        rows, dense = snapshot(clients[0])
        torch.testing.assert_close(rows, expected[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dense, expected[1], rtol=1e-5, atol=1e-6)
    finally:
        for c in clients:
            c.close()
        server.stop()


def test_a_thread_that_does_not_end_its_step_is_named():
    server, (client,) = make_cluster()
    try:
        comm = SyncCommunicator(client, num_threads=2, timeout_s=0.5)
        comm.push("emb", torch.tensor([1]), torch.ones(1, DIM))
        with pytest.raises(PSTimeoutError, match=r"thread\(s\) \[1\] of worker 0 did not end the step"):
            comm.step_end(0)
        with pytest.raises(PSError, match="failed earlier"):
            comm.push("emb", torch.tensor([1]), torch.ones(1, DIM))
    finally:
        client.close()
        server.stop()


def test_a_worker_that_does_not_push_is_named():
    server, clients = make_cluster(num_workers=2)
    try:
        comm = SyncCommunicator(clients[0], num_threads=1, timeout_s=0.5)
        comm.push("emb", torch.tensor([1]), torch.ones(1, DIM))
        with pytest.raises(PSTimeoutError, match=r"step 0: worker\(s\) \[1\] did not push"):
            comm.step_end(0)
    finally:
        for c in clients:
            c.close()
        server.stop()


# ------------------------------------------------------------------- the server half (SyncServer)


@pytest.fixture(params=[2, 0], ids=["threads2", "inline"])
def servers2(request):
    """2 servers with 2 handler threads each, or serving on the network thread; clients made by
    `client(worker, workers)` are closed with them."""
    servers = [PSServer(i, 2, token=TOKEN, num_threads=request.param, halves=server_halves()).start() for i in range(2)]
    clients: list[PSClient] = []

    def client(worker: int = 0, workers: int = 1, timeout_s: float = 10.0) -> PSClient:
        c = PSClient([s.endpoint for s in servers], token=TOKEN, timeout_s=timeout_s, worker_index=worker,
                     num_workers=workers)
        clients.append(c)
        return c

    yield servers, client
    for c in clients:
        c.close()
    for s in servers:
        s.stop()


def step_meta(client: PSClient, step: int, timeout_s: float | None = None) -> dict:
    """What SyncCommunicator sends with a step's pushes."""
    return {"step": step, "worker": client.worker_index, "workers": client.num_workers,
            "timeout_s": client.timeout_s if timeout_s is None else timeout_s}


def push_step(client: PSClient, table: str, keys, grads, step: int, timeout_s: float | None = None):
    """This worker's part of step `step` of a sync table, to every server (zero keys where none)."""
    return client.push(table, keys, grads, meta=step_meta(client, step, timeout_s), every_server=True)


def test_push_of_two_workers_applies_once_with_the_mean(servers2):
    servers, client = servers2
    a, b = client(0, 2), client(1, 2)
    a.create_sparse_table("emb", dim=2, optimizer={"name": "sgd", "lr": 1.0}, initializer={"kind": "zeros"}, mode="sync")
    keys_a, grads_a = torch.tensor([1, 2, 3]), torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    keys_b, grads_b = torch.tensor([3, 4]), torch.tensor([[5.0, 5.0], [8.0, 8.0]])
    handle_a = push_step(a, "emb", keys_a, grads_a, step=0)
    time.sleep(0.2)
    assert not handle_a.done()  # waits for worker 1
    assert b.pull("emb", torch.tensor([1, 3])).wait().abs().sum() == 0  # nothing applied yet
    assert [s["pending"] for s in a.stats()["servers"]] == [{"sync": 1}] * 2  # each server holds the step
    push_step(b, "emb", keys_b, grads_b, step=0).wait()
    handle_a.wait()
    rows = a.pull("emb", torch.tensor([1, 2, 3, 4])).wait()[:, 0]
    # Mean over the 2 workers: (sum of both workers' gradients) / 2, applied once with lr 1.
    assert rows.tolist() == [-0.5, -1.0, -4.0, -4.0]
    assert [s["pending"] for s in a.stats()["servers"]] == [{"sync": 0}] * 2
    # The next step works the same way (state is per step).
    threads = [threading.Thread(target=lambda c: push_step(c, "emb", torch.tensor([1]), torch.ones(1, 2), step=1).wait(),
                                args=(c,)) for c in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert a.pull("emb", torch.tensor([1])).wait()[0, 0].item() == -1.5


def test_push_of_a_missing_worker_fails_naming_it(servers2):
    _, client = servers2
    a = client(0, 2)
    a.create_sparse_table("emb", dim=2, mode="sync")
    start = time.monotonic()
    with pytest.raises(PSTimeoutError, match=r"worker\(s\) \[1\] did not push"):
        push_step(a, "emb", torch.tensor([1]), torch.ones(1, 2), step=0, timeout_s=0.5).wait(5.0)
    assert time.monotonic() - start < 3.0


def test_dense_push_of_two_workers_applies_the_mean_once(servers2):
    _, client = servers2
    a, b = client(0, 2), client(1, 2)
    params = {"w": torch.arange(6.0).view(2, 3), "b": torch.tensor([10.0, 20.0]), "s": torch.tensor([7.0])}
    a.create_dense_table("dense", params, optimizer={"name": "sgd", "lr": 1.0}, mode="sync")
    assert set(b.dense_layout("dense").owner) == {0, 1}  # spread over both servers
    flat = b.pull_dense("dense").wait()
    ha = a.push_dense("dense", torch.full((9,), 2.0), meta=step_meta(a, 0))
    hb = b.push_dense("dense", torch.full((9,), 4.0), meta=step_meta(b, 0))
    ha.wait(), hb.wait()
    # Mean over workers, applied once.
    assert torch.equal(a.pull_dense("dense").wait(), flat - 3.0)


def test_a_push_without_step_meta_is_refused(servers2):
    """A sync table's pushes must come from SyncMode's communicator (they carry the step)."""
    _, client = servers2
    a = client()
    a.create_sparse_table("emb", dim=2, mode="sync")
    with pytest.raises(PSError, match="without meta 'step'.*SyncMode"):
        a.push("emb", torch.tensor([1, 2]), torch.ones(2, 2)).wait()
    a.create_dense_table("dense", 3, mode="sync")
    with pytest.raises(PSError, match="without meta 'step'"):
        a.push_dense("dense", torch.ones(3)).wait()


def test_server_half_holds_a_step_until_every_worker_and_fails_it_on_close():
    """SyncServer alone (what a PSServer hands a sync table's pushes): a step waits for all W
    workers (pending() counts it), a worker pushing twice is refused, close() fails what it holds."""
    spec = sparse_spec(2, optimizer={"name": "sgd", "lr": 1.0}, initializer={"kind": "zeros"}, mode="sync")
    half = SyncServer(0)
    try:
        table = HostedTable("emb", spec, build_sparse(spec, "emb", 1), None, half, 0)
        meta = {"step": 0, "worker": 0, "workers": 2, "timeout_s": 30.0}
        fields = {"keys": torch.tensor([1, 2]), "rows": torch.ones(2, 2)}
        first = half.push(table, fields, meta)
        assert not first.done() and half.pending() == 1
        with pytest.raises(ConfigError, match="worker 0 pushed twice"):
            half.push(table, fields, meta)
        second = half.push(table, {"keys": torch.tensor([2]), "rows": torch.ones(1, 2)}, {**meta, "worker": 1})
        assert first.result(5.0) is None and second.result(5.0) is None and half.pending() == 0
        assert table.shard.pull(torch.tensor([1, 2])).tolist() == [[-0.5, -0.5], [-1.0, -1.0]]  # the mean, once
        held = half.push(table, fields, {**meta, "step": 1})
    finally:
        half.close()
    with pytest.raises(PSError, match="server 0 stopped while a synchronous step was pending"):
        held.result(5.0)
