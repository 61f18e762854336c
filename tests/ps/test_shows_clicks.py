"""Training feeds the servers' CTR statistics (issue 14.3): every occurrence of a key in a batch
is one show, and the click of its example (the task's label column) is its click.

The collection's sums are checked against a per-occurrence loop; then two workers of two
threads each train under sync, async (with merged sends) and GEO (k = 7, background syncs,
replicas that grow) against one server, and the servers' show / click of every key must EQUAL
the occurrences and label sums of the data the workers trained (float32 sums of 0/1 values are
exact).
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recps.data.batch import Batch
from recps.cluster.launch import free_port
from recps.ps.embedding import PSEmbeddingBagCollection, PSEmbeddingCollection, ps_table_name, salted_keys
from recps.ps.fleet import DistributedStrategy, Fleet
from recps.ps.modes import AsyncMode, GeoMode, SyncMode
from recps.ps.node import TableConfig
from recps.ps.roles import UserDefinedRoleMaker
from recps.tasks import BinaryTask
from recps.job.loop import Trainer, click_labels
CONFIGS = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=d, num_embeddings=50, feature_names=[f])
           for f, d in (("x", 8), ("y", 8), ("z", 4))]
DIM_OF = {"x": 8, "y": 8, "z": 4}
FEATURES = ["x", "y", "z"]
VOCAB = 40  # repeats within a batch, across batches, threads and workers
BATCH = 16
BATCHES_PER_THREAD = 50  # 2 workers x 2 threads x 50 = 200 steps per mode


def jagged_batch(seed: int, batch: int = BATCH, max_len: int = 3) -> Batch:
    """Bags of 0..max_len keys per feature (empty bags too), labels 0/1."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(FEATURES) * batch,), generator=g)  # (F*B,)
    values = torch.randint(0, VOCAB, (int(lengths.sum()),), generator=g)
    labels = (torch.rand(batch, generator=g) < 0.3).float().unsqueeze(1)  # (B, 1)
    kjt = KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths, stride=batch)
    return Batch(torch.randn(batch, 2, generator=g), kjt, labels)


def occurrences(batch: Batch, clicks: torch.Tensor | None) -> Counter:
    """{(PS table, salted key): [shows, clicks]} by a loop over every key of the batch."""
    out: dict = {}
    for f, jt in batch.sparse.to_dict().items():
        example = torch.repeat_interleave(torch.arange(batch.batch_size), jt.lengths())
        for key, b in zip(salted_keys(jt.values(), f"t_{f}").tolist(), example.tolist()):
            stats = out.setdefault((ps_table_name(DIM_OF[f]), key), [0.0, 0.0])
            stats[0] += 1.0
            stats[1] += 0.0 if clicks is None else float(clicks[b])
    return out


class Recorder:
    """A communicator that keeps what the collection pushes (rows of zeros are pulled)."""

    mode = "async"

    def __init__(self, statistics: bool = True) -> None:
        self.pushes: list[tuple] = []
        if statistics:
            self.counts_statistics = lambda table: True

    def pull(self, table, keys):
        return torch.zeros(keys.numel(), 8 if table.endswith("d8") else 4)

    def push(self, table, keys, grads, **stats):
        self.pushes.append((table, keys, stats))


def recorded(comm: Recorder) -> dict:
    out: dict = {}
    for table, keys, stats in comm.pushes:
        for key, show, click in zip(keys.tolist(), stats["shows"].tolist(), stats["clicks"].tolist()):
            acc = out.setdefault((table, key), [0.0, 0.0])
            acc[0] += show
            acc[1] += click
    return out


@pytest.mark.parametrize("collection", ["bags", "sequence"])
def test_collection_pushes_occurrences_and_clamped_label_sums(collection):
    comm = Recorder()
    if collection == "bags":
        ebc = PSEmbeddingBagCollection(CONFIGS, comm)
    else:
        ebc = PSEmbeddingCollection([EmbeddingConfig(name=c.name, embedding_dim=c.embedding_dim, num_embeddings=50,
                                                     feature_names=c.feature_names) for c in CONFIGS], comm)
    batch = jagged_batch(seed=3, batch=6)
    labels = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.25, 1.0])  # clamped to [0, 1]: 1, 0, 1, 0, 0.25, 1
    ebc.set_batch_clicks(labels)
    out = ebc(batch.sparse)
    ebc.set_batch_clicks(None)
    total = out.values().sum() if collection == "bags" else sum(jt.values().sum() for jt in out.values())
    total.backward()
    assert {t for t, _, _ in comm.pushes} == {"embedding_d8", "embedding_d4"}  # one push per PS table
    assert recorded(comm) == occurrences(batch, labels.clamp(0, 1))


def test_without_clicks_shows_still_count_and_old_communicators_get_no_statistics():
    batch = jagged_batch(seed=4, batch=5)
    comm = Recorder()
    ebc = PSEmbeddingBagCollection(CONFIGS, comm)
    ebc.set_batch_clicks(torch.ones(7))  # made for another batch (7 examples): not used
    ebc(batch.sparse).values().sum().backward()
    ebc.set_batch_clicks(None)
    ebc(batch.sparse).values().sum().backward()  # none set
    want = occurrences(batch, None)
    assert recorded(comm) == {k: [2 * s, 0.0] for k, (s, _) in want.items()}

    plain = Recorder(statistics=False)  # no counts_statistics: push(table, keys, grads) as before
    ebc = PSEmbeddingBagCollection(CONFIGS, plain)
    ebc.set_batch_clicks(torch.ones(5))
    ebc(batch.sparse).values().sum().backward()
    assert len(plain.pushes) == 2 and all(stats == {} for _, _, stats in plain.pushes)


def test_click_labels_follow_the_tasks_label_column():
    batch = Batch(torch.zeros(3, 0), jagged_batch(0, batch=3).sparse, torch.tensor([[0.0, 1.0], [1.0, 1.0],
                                                                                     [0.0, 0.0]]))
    assert click_labels(BinaryTask(), batch).tolist() == [0.0, 1.0, 0.0]
    assert click_labels(BinaryTask(label_index=1), batch).tolist() == [1.0, 1.0, 0.0]

    class PairsTask:  # builds its own features (skip-gram): its labels are no clicks
        passes_batch_sparse = False

    assert click_labels(PairsTask(), batch) is None


# ------------------------------------------------------------------------- two workers, three modes


class Source:
    """Worker `worker`'s batches: thread t of T gets BATCHES_PER_THREAD batches of its own."""

    def __init__(self, worker: int) -> None:
        self.worker = worker

    def seeds(self, shard: int) -> list[int]:
        return [10_000 * self.worker + 100 * shard + i for i in range(BATCHES_PER_THREAD)]

    def batches(self, batch_size, shard_index, num_shards, epoch):
        return iter(jagged_batch(s, batch_size) for s in self.seeds(shard_index))


class TinyModel(torch.nn.Module):
    def __init__(self, ebc) -> None:
        super().__init__()
        self.sparse_arch = ebc
        self.linear = torch.nn.Linear(8 + 8 + 4 + 2, 1)

    def forward(self, dense, kjt):
        return self.linear(torch.cat([self.sparse_arch(kjt).values(), dense], dim=1)).squeeze(1)


def train_two_workers(mode, token: str) -> tuple[dict, list]:
    """1 server + 2 workers x 2 threads in this process; -> the server's {(table, key): [show, click]}
    and each worker's communicator."""
    address = f"127.0.0.1:{free_port()}"
    server_role = UserDefinedRoleMaker("server", 0, 1, 2, coordinator=address, token=token)
    worker_roles = [UserDefinedRoleMaker("worker", w, 1, 2, coordinator=address, token=token) for w in range(2)]
    comms, errors = [None, None], []

    def work(w: int) -> None:
        try:
            with Fleet(worker_roles[w], connect_timeout_s=30) as f:
                torch.manual_seed(0)
                ebc = f.embedding_bag_collection(CONFIGS)
                model = TinyModel(ebc)
                opt = f.distributed_optimizer(torch.optim.SGD(model.linear.parameters(), lr=0.1),
                                              DistributedStrategy(mode, threads=2))
                f.init_worker()
                trainer = Trainer(model, ebc, BinaryTask(), opt.updater, threads=2, prefetch=mode.prefetches)
                stats = trainer.fit(Source(w), BATCH, progress=False)
                assert stats.steps == 2 * BATCHES_PER_THREAD
                comms[w] = f.communicator
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with Fleet(server_role) as server:
        server.init_server()
        threads = [threading.Thread(target=work, args=(w,)) for w in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert server._node is not None and server._node.wait(30)  # worker 0 stopped the server
        held = {}
        for table in ("embedding_d8", "embedding_d4"):
            shard = server._node.server.sparse(table)
            keys = shard.keys()
            stats = shard.stats(keys)
            for key, show, click in zip(keys.tolist(), stats["show"].tolist(), stats["click"].tolist()):
                held[(table, key)] = [show, click]
    return held, comms


def expected_statistics() -> dict:
    want: dict = {}
    for w in range(2):
        for shard in range(2):
            for seed in Source(w).seeds(shard):
                batch = jagged_batch(seed)
                for k, (s, c) in occurrences(batch, batch.labels[:, 0]).items():
                    acc = want.setdefault(k, [0.0, 0.0])
                    acc[0] += s
                    acc[1] += c
    return want


TABLE = dict(optimizer={"name": "sgd", "lr": 0.1}, accessor={})


@pytest.mark.parametrize("mode", [
    SyncMode(timeout_s=30, table=TableConfig(**TABLE)),
    AsyncMode(timeout_s=30, table=TableConfig(**TABLE), merge_threshold=4, min_merge=2, max_pending=8),
    GeoMode(timeout_s=30, table=TableConfig(**TABLE), k_steps=7, replica_capacity=16),  # replicas grow (64 -> 128)
], ids=["sync", "async", "geo"])
@pytest.mark.slow  # two workers train end to end: e2e, not in make test-fast
def test_servers_count_every_occurrence_and_click_exactly(mode):
    held, comms = train_two_workers(mode, token=f"shows-{mode.name}")
    want = expected_statistics()
    assert len(want) > 100 and any(c > 1 for _, c in want.values())
    assert held == want
    if mode.name == "async":
        for comm in comms:
            assert comm.sends < comm.sent_pushes  # pushes were merged (min_merge 2): the counts held
    if mode.name == "geo":
        assert all(comm.syncs > 2 and comm._replicas["embedding_d8"].capacity == 128 for comm in comms)
