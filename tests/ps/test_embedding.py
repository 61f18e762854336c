"""PS-backed embedding collections over a real server in this process (PSServer on 127.0.0.1).

References are plain torch: F.embedding_bag / indexing over the rows the servers hold.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from models import CTRDNN, DeepFM
from recps.errors import ConfigError, PSError
from recps.ps.embedding import (
    PSEmbeddingBagCollection,
    PSEmbeddingCollection,
    pool_sum,
    ps_table_name,
    salted_keys,
)
from recps.ps.modes import AsyncCommunicator, AsyncMode, ServerReader, server_halves
from recps.ps.node import PSClient, PSServer

TOKEN = "emb-test"
INIT = {"kind": "uniform", "low": -0.5, "high": 0.5}
LR = 0.5

# Interleaved widths: output columns must follow the configs' order, not the PS tables'.
CONFIGS = [
    EmbeddingBagConfig(name="t_ab", embedding_dim=8, num_embeddings=100, feature_names=["a1", "a2"]),
    EmbeddingBagConfig(name="t_b", embedding_dim=12, num_embeddings=100, feature_names=["b"]),
    EmbeddingBagConfig(name="t_c", embedding_dim=8, num_embeddings=100, feature_names=["c"]),
]
TABLE_OF = {"a1": "t_ab", "a2": "t_ab", "b": "t_b", "c": "t_c"}
DIM_OF = {"a1": 8, "a2": 8, "b": 12, "c": 8}


@pytest.fixture
def cluster():
    with PSServer(token=TOKEN, halves=server_halves()) as server, \
            PSClient([server.endpoint], token=TOKEN, timeout_s=20.0) as client:
        for dim in (8, 12):
            client.create_sparse_table(ps_table_name(dim), dim, optimizer={"name": "sgd", "lr": LR}, initializer=INIT,
                                       mode="async")
        comm = AsyncMode(max_pending=4).communicator(client)
        yield client, comm
        comm.close()


def random_kjt(keys: list[str], batch: int, seed: int, vocab: int = 12, max_len: int = 3) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(keys) * batch,), generator=g)  # empty bags included
    values = torch.randint(0, vocab, (int(lengths.sum()),), generator=g)  # repeats within and across bags
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, stride=batch)


def reference_pooled(client: PSClient, kjt: KeyedJaggedTensor, order: list[str]) -> tuple[torch.Tensor, dict]:
    """(B, sum D) by F.embedding_bag over the servers' rows, one feature at a time, in `order`;
    and the leaf row tensors per feature (for gradients)."""
    per = kjt.to_dict()
    outs, leaves = [], {}
    for f in order:
        jt = per[f]
        keys = salted_keys(jt.values(), TABLE_OF[f])
        uniq, inverse = torch.unique(keys, return_inverse=True)
        rows = client.pull(ps_table_name(DIM_OF[f]), uniq, create=False).wait().requires_grad_(True)
        leaves[f] = (uniq, rows)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), jt.lengths().cumsum(0)])
        outs.append(F.embedding_bag(inverse, rows, offsets[:-1], mode="sum"))  # (B, D)
    return torch.cat(outs, dim=1), leaves


def test_pooled_output_and_pushed_gradients_equal_embedding_bag(cluster):
    client, comm = cluster
    ebc = PSEmbeddingBagCollection(CONFIGS, comm)
    assert ebc.table_dims() == {"embedding_d8": 8, "embedding_d12": 12}
    kjt = random_kjt(["c", "b", "a2", "a1"], batch=6, seed=1)  # another key order than the configs
    out = ebc(kjt)
    assert isinstance(out, KeyedTensor)
    assert out.keys() == ["a1", "a2", "b", "c"] and out.length_per_key() == [8, 8, 12, 8]
    expected, leaves = reference_pooled(client, kjt, ["a1", "a2", "b", "c"])  # rows as pulled (no update yet)
    torch.testing.assert_close(out.values(), expected.detach(), atol=1e-6, rtol=0)

    upstream = torch.randn(out.values().shape, generator=torch.Generator().manual_seed(2))
    (expected * upstream).sum().backward()
    before = {f: rows.detach().clone() for f, (_, rows) in leaves.items()}
    (out.values() * upstream).sum().backward()
    comm.flush()
    # Server SGD: each key's row moved by -lr * (its gradient summed over every use, all features of its table).
    want: dict[tuple[int, int], torch.Tensor] = {}
    for f, (uniq, rows) in leaves.items():
        for key, row, grad in zip(uniq.tolist(), before[f], rows.grad):
            k = (DIM_OF[f], key)
            want[k] = want.get(k, row.clone()) - LR * grad
    for dim in (8, 12):
        keys = torch.tensor([k for d, k in want if d == dim])
        after = client.pull(ps_table_name(dim), keys, create=False).wait()
        torch.testing.assert_close(after, torch.stack([want[(dim, k)] for k in keys.tolist()]), atol=1e-5, rtol=0)


def test_duplicates_leave_once_and_tables_keep_keys_apart(cluster):
    client, comm = cluster
    configs = [EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=10, feature_names=[f])
               for n, f in (("t_user", "user"), ("t_item", "item"))]
    ebc = PSEmbeddingBagCollection(configs, comm)
    # Key 5 in both features, and three times in "user".
    kjt = KeyedJaggedTensor(keys=["user", "item"], values=torch.tensor([5, 5, 5, 5, 7]),
                            lengths=torch.tensor([2, 1, 1, 1]), stride=2)
    pooled = ebc(kjt).values().detach()  # (2, 16)
    assert client.stats()["tables"]["embedding_d8"]["rows"] == 3  # user:5, item:5, item:7
    user5, item5 = pooled[1, :8], pooled[0, 8:]
    torch.testing.assert_close(pooled[0, :8], 2 * user5)
    assert not torch.allclose(user5, item5)  # same raw key, different tables, different rows
    torch.testing.assert_close(
        item5, client.pull("embedding_d8", salted_keys(torch.tensor([5]), "t_item"), create=False).wait()[0])


def test_eval_and_no_grad_push_nothing(cluster):
    client, comm = cluster
    ebc = PSEmbeddingBagCollection.from_features(["x"], 8, comm)
    kjt = random_kjt(["x"], batch=4, seed=3)
    keys = torch.unique(salted_keys(kjt.values(), "t_x"))
    first = ebc(kjt).values()
    before = client.pull("embedding_d8", keys).wait()
    ebc.eval()
    assert not ebc(kjt).values().requires_grad
    ebc.train()
    with torch.no_grad():
        ebc(kjt)
    first.sum().backward()  # the one training forward pushes once
    comm.flush()
    assert comm.sent_pushes == 1
    assert not torch.allclose(client.pull("embedding_d8", keys).wait(), before)


def test_sequence_collection_returns_jagged_rows_and_pushes_summed_grads(cluster):
    client, comm = cluster
    configs = [EmbeddingConfig(name="t_hist", embedding_dim=8, num_embeddings=50, feature_names=["hist"]),
               EmbeddingConfig(name="t_q", embedding_dim=12, num_embeddings=50, feature_names=["q"])]
    ec = PSEmbeddingCollection(configs, comm, prefix="embedding")
    kjt = KeyedJaggedTensor(keys=["hist", "q"], values=torch.tensor([3, 4, 3, 9, 1]),
                            lengths=torch.tensor([2, 1, 1, 1]), stride=2)
    out = ec(kjt)
    assert list(out) == ["hist", "q"]
    assert out["hist"].lengths().tolist() == [2, 1] and out["q"].values().shape == (2, 12)
    hist_keys = salted_keys(torch.tensor([3, 4]), "t_hist")
    rows = client.pull("embedding_d8", hist_keys, create=False).wait()
    torch.testing.assert_close(out["hist"].values().detach(), rows[[0, 1, 0]])
    out["hist"].values().sum().backward()
    comm.flush()
    # Key 3 was used twice: its gradient is 2 per column, key 4's is 1.
    after = client.pull("embedding_d8", hist_keys, create=False).wait()
    torch.testing.assert_close(after, rows - LR * torch.tensor([[2.0], [1.0]]), atol=1e-6, rtol=0)


def test_pool_sum_equals_embedding_bag_on_uneven_bags():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(30, 9, generator=g, requires_grad=True)
    lengths = torch.randint(0, 4, (3 * 5,), generator=g)  # 3 features x B=5
    inverse = torch.randint(0, 30, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    out = pool_sum(rows, inverse, offsets, 3)  # (5, 27)
    ref = F.embedding_bag(inverse, rows, offsets[:-1], mode="sum").view(3, 5, 9).transpose(0, 1).reshape(5, 27)
    torch.testing.assert_close(out, ref)
    up = torch.randn(5, 27, generator=g)
    (grad_fbgemm,) = torch.autograd.grad((out * up).sum(), rows)
    (grad_torch,) = torch.autograd.grad((ref * up).sum(), rows)
    torch.testing.assert_close(grad_fbgemm, grad_torch)


class RowsEBC(torch.nn.Module):
    """Reference: F.embedding_bag over rows read from the servers, one table per feature."""

    def __init__(self, client, configs) -> None:
        super().__init__()
        self.client, self.configs = client, configs

    def embedding_bag_configs(self):
        return self.configs

    def forward(self, kjt):
        per = kjt.to_dict()
        outs, names = [], []
        for c in self.configs:
            for f in c.feature_names:
                jt = per[f]
                uniq, inverse = torch.unique(salted_keys(jt.values(), c.name), return_inverse=True)
                rows = self.client.pull(ps_table_name(c.embedding_dim), uniq, create=False).wait()
                offsets = torch.cat([torch.zeros(1, dtype=torch.int64), jt.lengths().cumsum(0)])
                outs.append(F.embedding_bag(inverse, rows, offsets[:-1], mode="sum"))
                names.append(f)
        return KeyedTensor(keys=names, length_per_key=[o.shape[1] for o in outs], values=torch.cat(outs, dim=1))


@pytest.mark.parametrize("model_cls, dim", [(CTRDNN, 8), (DeepFM, 12)])
def test_models_run_unchanged_over_the_ps_collection(cluster, model_cls, dim):
    client, comm = cluster
    features = ["f0", "f1", "f2"]
    ps_ebc = PSEmbeddingBagCollection.from_features(features, dim, ServerReader(client))
    ref_ebc = RowsEBC(client, ps_ebc.embedding_bag_configs())
    torch.manual_seed(0)
    model = model_cls(ps_ebc, dense_in_features=2)
    torch.manual_seed(0)
    ref = model_cls(ref_ebc, dense_in_features=2)
    model.eval()
    ref.eval()
    kjt = random_kjt(features, batch=5, seed=4)
    for f, jt in kjt.to_dict().items():  # the rows exist (as after training): not all zeros
        client.pull(ps_table_name(dim), salted_keys(jt.values(), f"t_{f}")).wait()
    dense = torch.randn(5, 2)
    with torch.no_grad():
        torch.testing.assert_close(model(dense, kjt), ref(dense, kjt), atol=1e-5, rtol=1e-5)


def test_errors_name_the_problem(cluster):
    client, comm = cluster
    ebc = PSEmbeddingBagCollection.from_features(["x", "y"], 8)
    with pytest.raises(PSError, match="no communicator is bound.*init_worker"):
        ebc(random_kjt(["x", "y"], 2, 0))
    ebc.bind(comm)
    with pytest.raises(ConfigError, match=r"no sparse features \['y'\].*batch features are \['x'\]"):
        ebc(random_kjt(["x"], 2, 0))
    twice = [EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=1, feature_names=["x"]),
             EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=1, feature_names=["x"])]
    with pytest.raises(ConfigError, match="feature 'x' is in tables t1 and t2"):
        PSEmbeddingBagCollection(twice)
    with pytest.raises(PSError, match="read-only"):
        reader = PSEmbeddingBagCollection.from_features(["x"], 8, ServerReader(client))
        reader(random_kjt(["x"], 2, 0)).values().sum().backward()


class CountingAsync(AsyncCommunicator):
    """The real async communicator, counting the pulls it starts."""

    def __init__(self, client, mode: AsyncMode) -> None:
        super().__init__(client, mode)
        self.started = 0

    def pull_start(self, table, keys):
        self.started += 1
        return super().pull_start(table, keys)


def test_prefetched_forward_equals_a_plain_one_and_pulls_once(cluster):
    client, _ = cluster
    comm = CountingAsync(client, AsyncMode(max_pending=4))
    ebc = PSEmbeddingBagCollection(CONFIGS, comm)
    kjt = random_kjt(["c", "b", "a2", "a1"], batch=6, seed=1)
    ebc.prefetch(kjt)
    assert comm.started == 2  # one pull per PS table (widths 8 and 12), sent before forward()
    out = ebc(kjt)
    assert comm.started == 2  # forward() only waited for them
    expected, _ = reference_pooled(client, kjt, ["a1", "a2", "b", "c"])
    torch.testing.assert_close(out.values(), expected.detach(), atol=1e-6, rtol=0)
    out.values().sum().backward()  # the prefetched rows push their gradients as pulled ones do
    comm.flush()
    assert comm.sent_pushes == 2
    assert not ebc._prefetched
    comm.close()


def test_prefetch_of_other_features_is_dropped_and_turned_off(cluster, caplog):
    client, _ = cluster
    comm = CountingAsync(client, AsyncMode(max_pending=4))
    ebc = PSEmbeddingBagCollection.from_features(["x"], 8, comm)
    first, second = random_kjt(["x"], batch=4, seed=3), random_kjt(["x"], batch=4, seed=4)
    ebc.prefetch(first)
    with caplog.at_level("WARNING", logger="recps.ps.embedding"):
        out = ebc(second).values().detach()  # another KJT: its own pull; the prefetch is awaited and dropped
    assert "prefetch is off" in caplog.text
    assert comm.started == 2 and not ebc._prefetched
    keys = salted_keys(second.values(), "t_x")
    rows = client.pull("embedding_d8", keys, create=False).wait()  # (N, D), one key per bag or none
    expected = torch.zeros(4, 8).index_add_(0, torch.repeat_interleave(torch.arange(4), second.lengths()), rows)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    ebc.prefetch(first)  # off from now on: no pull
    assert comm.started == 2
    # A batch without the collection's features (the model builds its own KJT): off, nothing sent.
    other = PSEmbeddingBagCollection.from_features(["y"], 8, comm)
    other.prefetch(first)
    assert other._prefetch_off and comm.started == 2 and not other._prefetched
    comm.close()


def test_trainer_prefetches_each_next_batch(cluster):
    """recps.job.loop with prefetch=True: every batch is pulled exactly once, all but the first by a
    prefetch issued during the previous step (before its backward), and nothing is left in flight."""
    from models import CTRDNN
    from recps.data.dataset import ExamplesSource
    from recps.data.reader import Examples
    from recps.tasks import BinaryTask
    from recps.job.loop import LocalDenseUpdater, Trainer

    client, _ = cluster
    comm = CountingAsync(client, AsyncMode(max_pending=4))
    features = ["f0", "f1", "f2"]
    ebc = PSEmbeddingBagCollection.from_features(features, 8, comm)
    model = CTRDNN(ebc, dense_in_features=2, hidden=(8,))
    used = []
    forward = ebc.forward

    def spy(kjt):  # records whether forward() found its batch prefetched
        used.append(kjt is ebc._prefetched.get(threading.get_ident(), None).features
                    if ebc._prefetched else False)
        return forward(kjt)

    ebc.forward = spy
    g = torch.Generator().manual_seed(0)
    data = Examples(tuple(features), torch.randn(96, 2, generator=g), torch.randint(0, 30, (96, 3), generator=g),
                    torch.randint(0, 2, (96, 1), generator=g).float())
    params = [p for n, p in model.named_parameters() if not n.startswith("sparse_arch")]
    trainer = Trainer(model, ebc, BinaryTask(), LocalDenseUpdater(params, torch.optim.SGD(params, lr=0.1)),
                      prefetch=True)
    stats = trainer.fit(ExamplesSource(data, shuffle=False), 16, progress=False)
    assert stats.steps == 6 and comm.started == 6  # one PS table (width 8): one pull per batch
    assert used == [False] + [True] * 5
    assert not ebc._prefetched

    class OwnFeatures(BinaryTask):  # a task whose model gets other features than batch.sparse
        passes_batch_sparse = False

    used.clear()
    trainer.task = OwnFeatures()
    trainer.fit(ExamplesSource(data, shuffle=False), 16, progress=False)
    assert used == [False] * 6 and comm.started == 12 and not ebc._prefetch_off  # no prefetch tried
    comm.close()
