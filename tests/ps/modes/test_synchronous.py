"""SyncCommunicator: T threads of batch B equal one thread of batch T*B; W workers equal one
worker with the merged batch; a missing thread or worker fails naming it. Servers run in
this process on 127.0.0.1."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from recps.errors import PSError, PSTimeoutError
from recps.ps.modes import Communicator, SyncCommunicator
from recps.ps.node import PSClient, PSServer
from recps.ps.table import Initializer

TOKEN = "sync-test"
DIM = 4
INIT = {"kind": "uniform", "low": -0.2, "high": 0.2}


def make_cluster(num_workers: int = 1):
    server = PSServer(token=TOKEN).start()
    clients = [PSClient([server.endpoint], token=TOKEN, timeout_s=10.0, worker_index=j, num_workers=num_workers)
               for j in range(num_workers)]
    clients[0].create_sparse_table("emb", dim=DIM, optimizer={"name": "adagrad", "lr": 0.1}, initializer=INIT, seed=3)
    clients[0].create_dense_table("dense", {"w": torch.linspace(-0.5, 0.5, DIM), "b": torch.zeros(1)},
                                  optimizer={"name": "sgd", "lr": 0.5})
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


def run_threads(fns) -> None:
    errors = []

    def run(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


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
        comm = SyncCommunicator(client, num_threads=2)
        assert isinstance(comm, Communicator) and comm.mode == "sync"

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
