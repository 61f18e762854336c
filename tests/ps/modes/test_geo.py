"""GEO: a worker's replica (FBGEMM TBE, fused optimizer) syncs deltas every k steps.

Servers run in this process (PSServer on 127.0.0.1); the reference is plain torch: one
nn.Parameter over every key of the data, F.embedding_bag, torch.optim.SGD.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from recps.data.reader import TensorBatches
from recps.errors import ConfigError, PSError, PSTimeoutError
from recps.ps.embedding import PSEmbeddingBagCollection, salted_keys
from recps.ps.modes import server_halves
from recps.ps.modes.geo import GeoCommunicator, GeoDenseUpdater, GeoMode
from recps.job.loop import Trainer
from recps.data.dataset import ExamplesSource
from recps.ps.node import PSClient, PSServer, TableConfig
from recps.ps.table import Initializer
from recps.tasks import BinaryTask
from tests.helpers.reference import DIM, FEATURES, INIT, ReferenceEBC, examples, make_model, reference_sgd
from tests.helpers.threads import run_threads

TOKEN = "geo-test"
SGD1 = {"name": "sgd", "lr": 1.0}


def geo_comm(client: PSClient, optimizer: dict | None = SGD1, **knobs) -> GeoCommunicator:
    """A GEO communicator whose replica trains with `optimizer` (None: GeoMode's default)."""
    table = TableConfig() if optimizer is None else TableConfig(optimizer=optimizer)
    comm = GeoMode(table=table, **knobs).communicator(client)
    assert isinstance(comm, GeoCommunicator)
    return comm


def dense_named(model, ebc):
    owned = {id(p) for p in ebc.parameters()}
    return {n: p for n, p in model.named_parameters() if id(p) not in owned}


@pytest.fixture
def server():
    with PSServer(token=TOKEN, halves=server_halves()) as s:
        yield s


def geo_worker(endpoint: str, optimizer: dict, k_steps: int, create: bool = True, dense_values=None,
               background_sync: bool = False, local_init: bool = True):
    client = PSClient([endpoint], token=TOKEN, timeout_s=20.0)
    if create:
        client.create_sparse_table("embedding_d9", dim=DIM, optimizer=SGD1, initializer=INIT, mode="geo")
    ebc = PSEmbeddingBagCollection.from_features(FEATURES, DIM)
    model = make_model(ebc)
    named = dense_named(model, ebc)
    if create:
        client.create_dense_table("dense", {n: p.detach() for n, p in named.items()}, mode="geo")
    geo = geo_comm(client, optimizer, k_steps=k_steps, background_sync=background_sync, local_init=local_init)
    ebc.bind(geo)
    geo.attach_dense("dense", named)
    return client, geo, ebc, model, named


def test_geo_one_worker_k1_sgd_equals_local_sgd(server):
    data = examples(256)
    lr, dense_lr, steps = 0.5, 0.1, 12
    client, geo, ebc, model, named = geo_worker(server.endpoint, {"name": "sgd", "lr": lr}, k_steps=1)
    opt = torch.optim.SGD(list(named.values()), lr=dense_lr)
    ref_ebc, ref, ref_opt = reference_sgd(ebc, data, lr, dense_lr)
    task = BinaryTask()
    losses = []
    for step, batch in enumerate(TensorBatches(data, 16)):
        if step == steps:
            break
        loss = task.loss(model(batch.dense, batch.sparse), batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        geo.step_end(0)
        ref_loss = task.loss(ref(batch.dense, batch.sparse), batch)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        losses.append((loss.item(), ref_loss.item()))
    assert geo.syncs == steps
    for a, b in losses:
        assert a == pytest.approx(b, abs=1e-5)
    # The servers hold exactly what local SGD computed: rows and dense parameters.
    pulled = client.pull("embedding_d9", ref_ebc.keys).wait()
    torch.testing.assert_close(pulled, ref_ebc.weight.detach(), atol=1e-5, rtol=0)
    server_dense = client.dense_layout("dense").unflatten(client.pull_dense("dense").wait())
    for name, p in ref.named_parameters():
        if name != "sparse_arch.weight":
            torch.testing.assert_close(server_dense[name], p.detach(), atol=1e-5, rtol=0)
    # The worker holds only the rows it saw, not a table.
    seen = ReferenceEBC(ebc, data.select(slice(0, steps * 16))).keys.numel()
    assert geo.replica_rows("embedding_d9") == seen < ref_ebc.keys.numel()
    client.close()


def test_geo_rowwise_adagrad_replica_equals_torch_rowwise_adagrad(server):
    """The TBE's fused row-wise Adagrad on a width-9 (padded to 12) row equals the textbook rule."""
    client, geo, ebc, model, named = geo_worker(server.endpoint, {"name": "rowwise_adagrad", "lr": 0.3, "eps": 1e-8},
                                                k_steps=1000)
    batch = next(iter(TensorBatches(examples(32), 32)))
    ps_keys = salted_keys(batch.sparse.values()[:32], "t_C1")  # feature C1's keys
    uniq = torch.unique(ps_keys)
    before = geo.pull("embedding_d9", uniq)  # (U, D)
    pooled = ebc(batch.sparse).values()  # (B, F*D)
    upstream = torch.randn(pooled.shape, generator=torch.Generator().manual_seed(3))
    (pooled * upstream).sum().backward()
    # d loss / d row of key u (feature C1 = columns 0..8): sum of upstream over its bags.
    idx = torch.searchsorted(uniq, ps_keys)
    grad = torch.zeros(uniq.numel(), DIM).index_add_(0, idx, upstream[:, :DIM])
    state = grad.pow(2).mean(dim=1, keepdim=True)
    expected = before - 0.3 * grad / (state.sqrt() + 1e-8)
    torch.testing.assert_close(geo.pull("embedding_d9", uniq), expected, atol=1e-5, rtol=1e-5)
    client.close()


@pytest.mark.parametrize("local_init", [True, False])
def test_geo_two_workers_server_adds_both_deltas(server, local_init):
    """Deltas of two workers add up on the server; each worker pulls the merged rows back and
    keeps updates it made while syncing. First-seen rows: the initial value computed locally
    (refreshed by the next sync) or pulled (refreshed once trained)."""
    c0, g0, *_ = geo_worker(server.endpoint, {"name": "sgd", "lr": 1.0}, k_steps=2, local_init=local_init)
    c1, g1, *_ = geo_worker(server.endpoint, {"name": "sgd", "lr": 1.0}, k_steps=2, create=False,
                            local_init=local_init)
    keys = torch.tensor([11, 22, 33])
    start = g0.pull("embedding_d9", keys)
    torch.testing.assert_close(start, g1.pull("embedding_d9", keys))
    g0.push("embedding_d9", keys[:2], torch.ones(2, DIM))  # worker 0 trains keys 11, 22
    g1.push("embedding_d9", keys[1:], 2 * torch.ones(2, DIM))  # worker 1 trains keys 22, 33
    g0.step_end(0)
    g1.step_end(0)
    assert g0.syncs == g1.syncs == 0  # k = 2: nothing sent yet
    torch.testing.assert_close(c0.pull("embedding_d9", keys).wait(), start)
    g0.step_end(0)  # worker 0 syncs first: the server has its deltas only
    g1.step_end(0)  # worker 1 syncs: the server adds its deltas, worker 1 sees both
    expected = start - torch.tensor([[1.0], [3.0], [2.0]])
    torch.testing.assert_close(c0.pull("embedding_d9", keys).wait(), expected)
    torch.testing.assert_close(g1.pull("embedding_d9", keys[1:]), expected[1:])
    # Key 11 is in worker 1's replica since its first pull; worker 1 never trained it: a pulled
    # row stays stale, a locally initialized one was marked for the sync and is fresh.
    torch.testing.assert_close(g1.pull("embedding_d9", keys[:1]), expected[:1] if local_init else start[:1])
    # Worker 0 synced before worker 1 pushed: it sees worker 1's work on key 22 after its next sync.
    torch.testing.assert_close(g0.pull("embedding_d9", keys[:2]), start[:2] - torch.tensor([[1.0], [1.0]]))
    g0.push("embedding_d9", keys[1:2], torch.zeros(1, DIM))  # touch key 22 again
    g0.sync()
    torch.testing.assert_close(g0.pull("embedding_d9", keys[1:2]), expected[1:2])
    c0.close()
    c1.close()


def test_geo_replica_grows_and_keeps_rows(server):
    client = PSClient([server.endpoint], token=TOKEN)
    client.create_sparse_table("emb", dim=5, initializer=INIT, mode="geo")
    geo = geo_comm(client, k_steps=1, replica_capacity=64)
    assert geo.capacity == 64
    keys = torch.arange(1000, dtype=torch.int64) * 7919
    first = geo.pull("emb", keys[:100])
    geo.push("emb", keys[:100], torch.ones(100, 5))
    all_rows = geo.pull("emb", keys)  # grows 64 -> 128 -> ... -> 1024
    assert geo.replica_rows("emb") == 1000
    torch.testing.assert_close(all_rows[:100], first - 1.0)
    torch.testing.assert_close(all_rows[100:], client.pull("emb", keys[100:]).wait())
    geo.sync()
    torch.testing.assert_close(client.pull("emb", keys[:100]).wait(), first - 1.0)
    client.close()


def test_geo_threads_sync_once_per_k_worker_steps(server):
    client = PSClient([server.endpoint], token=TOKEN)
    client.create_sparse_table("emb", dim=4, initializer={"kind": "zeros"}, mode="geo")
    geo = geo_comm(client, k_steps=10, background_sync=False)

    def train(thread: int) -> None:
        for _ in range(25):
            geo.push("emb", torch.tensor([thread]), torch.ones(1, 4))
            geo.step_end(thread)

    threads = [threading.Thread(target=train, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert geo.syncs == 5  # 50 worker steps, k = 10
    geo.flush()
    torch.testing.assert_close(client.pull("emb", torch.tensor([0, 1])).wait(), torch.full((2, 4), -25.0))
    client.close()


def test_geo_bad_settings_are_named():
    """The mode refuses its knobs when it is built (before any communicator or server)."""
    with pytest.raises(ConfigError, match=r"k_steps=0.*ps.k_steps"):
        GeoMode(k_steps=0)
    with pytest.raises(ConfigError, match=r"'adam'.*rowwise_adagrad"):
        GeoMode(table=TableConfig(optimizer={"name": "adam", "lr": 0.1}))
    with pytest.raises(ConfigError, match=r"'adam'.*rowwise_adagrad"):
        GeoMode(table={"optimizer": {"name": "adam", "lr": 0.1}})  # the table's fields, as conf gives them
    with pytest.raises(ConfigError, match=r"replica_capacity=0"):
        GeoMode(replica_capacity=0)
    with pytest.raises(ConfigError, match=r"delta_scale=-1"):
        GeoMode(delta_scale=-1)


def test_geo_fused_training_threads_survive_syncs_and_new_rows(server):
    """Two Hogwild threads (recps.job.loop) train through the TBE while syncs and first-seen rows
    rewrite the replica: no autograd version error, and after the final sync the servers hold
    exactly the replica's rows and dense values."""
    client, geo, ebc, model, named = geo_worker(server.endpoint, {"name": "sgd", "lr": 0.2}, k_steps=3)
    params = list(named.values())
    updater = GeoDenseUpdater(params, torch.optim.SGD(params, lr=0.05), geo)
    trainer = Trainer(model, ebc, BinaryTask(), updater, threads=2)
    stats = trainer.fit(ExamplesSource(examples(640, vocab=400, seed=5), shuffle=False), 16, progress=False)
    assert stats.steps == 40 and geo.syncs == 40 // 3
    geo.flush()
    replica = geo._replicas["embedding_d9"]
    keys = replica.slot_keys[: replica.size]
    torch.testing.assert_close(client.pull("embedding_d9", keys).wait(), replica.rows[: replica.size, :DIM])
    dense = client.dense_layout("dense").unflatten(client.pull_dense("dense").wait())
    for name, p in named.items():
        torch.testing.assert_close(dense[name], p.detach())
    client.close()


def test_geo_deltas_are_averaged_over_workers(server):
    """With W workers each delta counts 1/W (Paddle's GEO): the servers hold the workers' mean model."""
    clients = [PSClient([server.endpoint], token=TOKEN, worker_index=w, num_workers=2) for w in range(2)]
    clients[0].create_sparse_table("emb", dim=2, initializer={"kind": "zeros"}, mode="geo")
    geos = [geo_comm(c, k_steps=1, background_sync=False) for c in clients]
    assert geos[0].delta_scale == 0.5
    keys = torch.tensor([1, 2])
    geos[0].push("emb", keys, torch.tensor([[1.0, 1.0], [2.0, 2.0]]))  # worker 0: rows -> -1, -2
    geos[1].push("emb", keys[:1], torch.tensor([[3.0, 3.0]]))  # worker 1: row 1 -> -3
    geos[0].step_end(0)
    geos[1].step_end(0)
    torch.testing.assert_close(clients[0].pull("emb", keys).wait(), torch.tensor([[-2.0, -2.0], [-1.0, -1.0]]))
    torch.testing.assert_close(geos[1].pull("emb", keys[:1]), torch.tensor([[-2.0, -2.0]]))
    for c in clients:
        c.close()


def _fit_and_flush(endpoint: str, background_sync: bool, threads: int = 1):
    """CTR-DNN through recps.job.loop on one worker (k = 3); after flush: the servers' rows (keys
    in sorted order) and dense values, and the communicator."""
    client, geo, ebc, model, named = geo_worker(endpoint, {"name": "sgd", "lr": 0.2}, k_steps=3,
                                                background_sync=background_sync)
    params = list(named.values())
    updater = GeoDenseUpdater(params, torch.optim.SGD(params, lr=0.05), geo)
    trainer = Trainer(model, ebc, BinaryTask(), updater, threads=threads)
    stats = trainer.fit(ExamplesSource(examples(640, vocab=400, seed=5), shuffle=False), 16, progress=False)
    assert stats.steps == 40
    geo.flush()
    replica = geo._replicas["embedding_d9"]
    keys = torch.sort(replica.slot_keys[: replica.size]).values
    rows = client.pull("embedding_d9", keys).wait()  # (K, D)
    torch.testing.assert_close(rows, geo.pull("embedding_d9", keys))  # the replica holds the servers' values
    dense = client.dense_layout("dense").unflatten(client.pull_dense("dense").wait())
    for name, p in named.items():
        torch.testing.assert_close(dense[name], p.detach())  # ... and the dense values
    client.close()
    return keys, rows, dense, geo


def test_geo_background_sync_after_flush_equals_synchronous_sync(server):
    """One worker, one thread, SGD: a delta sync on the communicator's thread leaves the servers
    (after flush) with the values the synchronous path gives, to 1e-5."""
    with PSServer(token=TOKEN, halves=server_halves()) as other:
        keys, rows, dense, geo = _fit_and_flush(server.endpoint, background_sync=True)
        ref_keys, ref_rows, ref_dense, ref_geo = _fit_and_flush(other.endpoint, background_sync=False)
    assert geo.background_sync and not ref_geo.background_sync
    assert ref_geo.syncs == 40 // 3 + 1  # every k-th step + the flush
    assert 2 <= geo.syncs <= ref_geo.syncs  # syncs that fall due while one runs are coalesced
    torch.testing.assert_close(keys, ref_keys)
    torch.testing.assert_close(rows, ref_rows, atol=1e-5, rtol=0)
    for name, value in ref_dense.items():
        torch.testing.assert_close(dense[name], value, atol=1e-5, rtol=0)


def test_geo_background_sync_with_two_threads_servers_hold_the_replica(server):
    """Two Hogwild threads, background syncs: no autograd error; after flush the servers hold
    exactly the replica's rows and dense values (checked in _fit_and_flush)."""
    keys, rows, dense, geo = _fit_and_flush(server.endpoint, background_sync=True, threads=2)
    assert geo.syncs >= 2 and keys.numel() > 100


def test_geo_dead_server_during_background_sync_is_raised_naming_it():
    """A server that dies under a background sync: the next step_end (or flush) raises a PSError
    that names the server, within the sync's bounded waits."""
    server = PSServer(token=TOKEN, halves=server_halves()).start()
    endpoint = server.endpoint
    client = PSClient([endpoint], token=TOKEN, timeout_s=1.0)
    client.create_sparse_table("emb", dim=4, initializer={"kind": "zeros"}, mode="geo")
    geo = geo_comm(client, k_steps=2, timeout_s=1.0)
    keys = torch.tensor([1, 2, 3])
    geo.push("emb", keys, torch.ones(3, 4))  # pulls the rows while the server is up
    geo.step_end(0)
    geo.flush()
    torch.testing.assert_close(client.pull("emb", keys).wait(), -torch.ones(3, 4))
    server.stop()
    start = time.monotonic()
    with pytest.raises(PSError, match=r"background delta sync failed.*" + re.escape(endpoint.split("//")[-1])):
        while time.monotonic() - start < 20:
            geo.push("emb", keys, torch.ones(3, 4))  # replica rows only: no server call
            geo.step_end(0)
            time.sleep(0.05)
    assert time.monotonic() - start < 10  # one sync's waits (1 s each) plus a few steps
    with pytest.raises(PSError, match="background delta sync failed"):
        geo.flush()
    client.close()


def test_geo_local_init_computes_first_seen_rows_without_the_servers(server):
    """First-seen keys start from the servers' initial value computed by the worker: no row is
    created on the server until the sync sends its delta; with an entry policy (the server may
    refuse a key) or local_init=False, first-seen keys are pulled."""
    client = PSClient([server.endpoint], token=TOKEN)
    client.create_sparse_table("emb", dim=5, initializer=INIT, seed=3, mode="geo")
    client.create_sparse_table("filtered", dim=5, initializer=INIT, entry={"name": "count_filter", "count": 2}, mode="geo")
    keys = torch.tensor([5, 6, 7], dtype=torch.int64)
    geo = geo_comm(client, k_steps=1, background_sync=False)
    rows = geo.pull("emb", keys)
    torch.testing.assert_close(rows, Initializer(**INIT)(keys, 5, seed=3))
    assert not server.sparse("emb").contains(keys).any()
    geo.push("emb", keys[:1], torch.ones(1, 5))
    geo.step_end(0)
    assert server.sparse("emb").contains(keys).all()  # every first-seen row was marked for the sync
    torch.testing.assert_close(client.pull("emb", keys).wait(), torch.cat([rows[:1] - 1.0, rows[1:]]))
    geo.pull("filtered", keys)
    assert server.sparse("filtered").contains(keys).sum() == 0  # pulled once: the filter has not admitted them
    pulling = geo_comm(client, k_steps=1, local_init=False)
    pulling.pull("filtered", keys)
    assert server.sparse("filtered").contains(keys).all()  # the second sighting admitted them
    client.close()


def test_geo_background_sync_default_is_on_for_k_above_one(server):
    """k = 1 asks for a sync after every step: it stays synchronous (and exact) unless asked."""
    client = PSClient([server.endpoint], token=TOKEN)
    assert geo_comm(client, None, k_steps=2).background_sync
    assert not geo_comm(client, None, k_steps=1).background_sync
    assert geo_comm(client, None, k_steps=1, background_sync=True).background_sync
    assert not geo_comm(client, None, k_steps=100, background_sync=False).background_sync
    client.close()


# ------------------------------------------------------------------ growth vs steps in flight


def counting_geo(server, tables=("emb",), **knobs) -> tuple[PSClient, GeoCommunicator]:
    """A counting replica: SGD lr 1 on dim-1 rows that start at 0, deltas as they are, 64 rows
    (the smallest replica): after flush each row is minus its occurrences in the trained batches."""
    client = PSClient([server.endpoint], token=TOKEN, timeout_s=20.0)
    for name in tables:
        client.create_sparse_table(name, dim=1, optimizer=SGD1, initializer={"kind": "zeros"}, mode="geo")
    knobs = {"k_steps": 1000, "background_sync": False, "delta_scale": 1.0, "replica_capacity": 1,
             "timeout_s": 20.0, **knobs}
    return client, geo_comm(client, **knobs)


def bags(geo: GeoCommunicator, table: str, keys: torch.Tensor) -> torch.Tensor:
    """One forward of a step: one bag per key (one feature); (1, N) pooled rows."""
    return geo.lookup_bags(table, keys, torch.arange(keys.numel() + 1), keys.numel())


def assert_counts(client: PSClient, table: str, counts: dict[int, int]) -> None:
    """The servers' row of each key of `counts` is minus its occurrences (key -> occurrences)."""
    keys = torch.tensor(sorted(counts))
    rows = client.pull(table, keys, assume_unique=True).wait(10.0)[:, 0]  # (K,)
    expected = torch.tensor([-float(counts[k]) for k in sorted(counts)])
    lost = {int(k): (0.0 - float(r), counts[int(k)]) for k, r, e in zip(keys, rows, expected) if r != e}
    assert not lost, f"{len(lost)} of {len(counts)} rows miscounted (key: (counted, occurrences)): {lost}"


def test_geo_replica_grows_only_between_the_other_threads_steps(server):
    """A growth moves the replica's rows to larger buffers; a step whose forward ran over the old
    ones would train them in its backward, lost for good. So a lookup whose new keys do not fit
    waits until no other thread is inside a step: here thread 2's growth waits for thread 1's
    step in flight, and every update counts once."""
    client, geo = counting_geo(server)
    assert geo._replica("emb").capacity == 64
    shared = torch.tensor([1, 2, 3, 3])
    pooled = bags(geo, "emb", shared)  # thread 1 (this one): forward done, backward not yet
    grown, backward = threading.Event(), threading.Event()
    errors = []

    def thread2() -> None:
        try:
            out = bags(geo, "emb", torch.cat([shared, torch.arange(100, 200)]))  # 100 new keys: 64 rows grow
            grown.set()
            assert backward.wait(10.0)
            out.sum().backward()
            geo.step_end(1)
        except BaseException as err:  # noqa: BLE001 - raised by the main thread
            errors.append(err)
            grown.set()

    other = threading.Thread(target=thread2, daemon=True)
    other.start()
    assert not grown.wait(0.5), "the replica grew while another thread's step was in flight"
    pooled.sum().backward()  # the fused SGD trains the rows the replica holds
    geo.step_end(0)
    assert grown.wait(10.0), "the growth did not go on after the step ended"
    backward.set()
    other.join(10.0)
    assert not errors, errors
    assert geo._replica("emb").capacity == 128
    geo.flush()
    assert_counts(client, "emb", {1: 2, 2: 2, 3: 4, **{k: 1 for k in range(100, 200)}})
    client.close()


def test_geo_threads_that_grow_at_once_neither_wait_for_the_other(server):
    """Two threads inside a step (a lookup of table a done) both need table b to grow: each steps
    out of its step while it waits, so neither waits for the other's step_end (which comes after
    its own growth): both go on at once, far within the timeout, and every update counts once."""
    client, geo = counting_geo(server, ("a", "b"))
    ready = threading.Barrier(2, timeout=10.0)
    took = {}

    def train(thread: int) -> None:
        first = bags(geo, "a", torch.tensor([7, 8]) + 10 * thread)  # inside a step from here (own rows: two
        # backwards writing one row at once may lose an update, which Hogwild accepts)
        ready.wait()
        start = time.monotonic()
        second = bags(geo, "b", torch.arange(100, 180) + 1000 * thread)  # 80 new keys each: b grows
        took[thread] = time.monotonic() - start
        (first.sum() + second.sum()).backward()
        geo.step_end(thread)

    run_threads([lambda: train(0), lambda: train(1)], timeout=30.0)
    assert max(took.values()) < 5.0, took  # the timeout is 20 s
    geo.flush()
    assert_counts(client, "a", {7: 1, 8: 1, 17: 1, 18: 1})
    assert_counts(client, "b", {k + 1000 * t: 1 for t in range(2) for k in range(100, 180)})
    client.close()


def test_geo_hogwild_threads_growing_replicas_count_every_update_once(server):
    """Stress: 2 threads, 2 tables looked up in turn each step, fresh keys each step (the replicas
    grow 64 -> 8192 rows) besides keys a thread looks up every step, background syncs every 3 steps:
    every row ends at minus its occurrences. No row is trained by both threads: two backwards
    writing one row at once may lose one update, which Hogwild accepts (the TBE's row update is
    not atomic); what is tested is that a growth or a sync loses none."""
    client, geo = counting_geo(server, ("a", "b"), k_steps=3, background_sync=True)
    steps, fresh = 120, 30

    def own(thread: int) -> torch.Tensor:
        return torch.tensor([1, 2, 2, 3]) + 10 * thread  # (4,) every step of this thread

    def keys(thread: int, step: int, table: int) -> torch.Tensor:
        new = torch.arange(fresh) + 100 * (2 * step + thread + 1) + 10**6 * table  # (fresh,) never seen before
        return torch.cat([own(thread), new])

    def train(thread: int) -> None:
        for step in range(steps):
            loss = sum(bags(geo, name, keys(thread, step, t)).sum() for t, name in enumerate(("a", "b")))
            loss.backward()
            geo.step_end(thread)

    run_threads([lambda: train(0), lambda: train(1)], timeout=60.0)
    geo.flush()
    assert geo._replica("a").capacity == 8192 and geo.syncs >= 2
    for t, name in enumerate(("a", "b")):
        counts = {k + 10 * th: n * steps for th in range(2) for k, n in ((1, 1), (2, 2), (3, 1))}
        counts.update({int(k): 1 for th in range(2) for s in range(steps) for k in keys(th, s, t)[4:]})
        assert_counts(client, name, counts)
    client.close()


def test_geo_one_thread_that_grows_a_table_it_looked_up_in_its_step_counts_both_lookups(server):
    """One thread (nothing to wait for: no deadlock) looks a table up twice in one step and the
    second lookup grows it: the first lookup's backward trains the buffers the rows left, and
    step_end adds that update to the rows' new place."""
    client, geo = counting_geo(server)
    first = bags(geo, "emb", torch.tensor([1, 2, 2]))
    start = time.monotonic()
    second = bags(geo, "emb", torch.cat([torch.tensor([2]), torch.arange(100, 200)]))  # 64 rows grow
    assert time.monotonic() - start < 5.0 and geo._replica("emb").capacity == 128
    (first.sum() + second.sum()).backward()
    geo.step_end(0)
    torch.testing.assert_close(geo.pull("emb", torch.tensor([1, 2, 100])), torch.tensor([[-1.0], [-3.0], [-1.0]]))
    geo.flush()
    assert_counts(client, "emb", {1: 1, 2: 3, **{k: 1 for k in range(100, 200)}})
    client.close()


def test_geo_a_thread_out_of_its_step_for_a_growth_keeps_its_tables_from_growing(server):
    """Thread 1 looked up table a and waits (out of its step) to grow table b; thread 2, inside a
    step, needs table a to grow: it waits until thread 1's step ended, since thread 1's backward
    trains a's buffers still; thread 1's growth of b goes first. Every update counts once."""
    client, geo = counting_geo(server, ("a", "b"))
    t2_inside, go2, t1_grown = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def thread1() -> None:
        try:
            assert t2_inside.wait(10.0)
            first = bags(geo, "a", torch.tensor([1, 2]))
            second = bags(geo, "b", torch.arange(100, 200))  # b grows once thread 2 is out of its step
            t1_grown.set()
            (first.sum() + second.sum()).backward()
            geo.step_end(0)
        except BaseException as err:  # noqa: BLE001 - raised by the main thread
            errors.append(err)

    def thread2() -> None:
        try:
            first = bags(geo, "a", torch.tensor([1]))
            t2_inside.set()
            assert go2.wait(10.0)
            second = bags(geo, "a", torch.arange(100, 200))  # a grows once thread 1's step ended
            (first.sum() + second.sum()).backward()
            geo.step_end(1)
        except BaseException as err:  # noqa: BLE001 - raised by the main thread
            errors.append(err)

    threads = [threading.Thread(target=f, daemon=True) for f in (thread1, thread2)]
    for t in threads:
        t.start()
    assert not t1_grown.wait(0.5), "table b grew while thread 2 was inside a step"
    go2.set()
    for t in threads:
        t.join(30.0)
    assert not errors, errors
    geo.flush()
    assert_counts(client, "a", {1: 2, 2: 1, **{k: 1 for k in range(100, 200)}})
    assert_counts(client, "b", {k: 1 for k in range(100, 200)})
    client.close()


def test_geo_threads_growing_each_others_tables_in_opposite_orders_time_out_naming_the_growth(server):
    """The documented limit: thread 1 looked up a and grows b, thread 2 looked up b and grows a;
    neither growth may move buffers the other's backward trains, so both wait, bounded: the first
    to wait raises a PSTimeoutError that names its growth and the cause (then the other goes on)."""
    client, geo = counting_geo(server, ("a", "b"), timeout_s=1.0)
    ready = threading.Barrier(2, timeout=10.0)
    errors = {}

    def train(thread: int, first: str, second: str) -> None:
        try:
            bags(geo, first, torch.tensor([1]))
            ready.wait()
            bags(geo, second, torch.arange(100, 200))  # 100 new keys: 64 rows grow
        except BaseException as err:  # noqa: BLE001 - checked by the main thread
            errors[thread] = err

    start = time.monotonic()
    threads = [threading.Thread(target=train, args=(t, *tables), daemon=True)
               for t, tables in enumerate((("a", "b"), ("b", "a")))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20.0)
    assert time.monotonic() - start < 10.0
    assert len(errors) == 1, errors
    (thread, err), = errors.items()
    assert isinstance(err, PSTimeoutError), err
    table = "ba"[thread]
    assert re.search(rf"growth of replica '{table}' to 101 rows waited 1 s .*look the tables up in one order", str(err))
    client.close()
