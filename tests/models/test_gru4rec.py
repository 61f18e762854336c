"""GRU4Rec: session-parallel steps equal whole sessions, tied item rows, the same scores over
torchrec's, the local fused and the PS-backed collection, and a real local job whose loss falls."""

from __future__ import annotations

import functools

import pytest
import torch
from torchrec import EmbeddingConfig

from models import GRU4Rec
from recps.ps.embedding import PSEmbeddingCollection, salted_keys

C, D = 30, 8  # tiny_seq's items and dim


@pytest.fixture
def model(tiny_seq):
    """model(**kwargs) -> a GRU4Rec over `tiny_seq.collection()`, in eval mode."""
    return functools.partial(tiny_seq.model, GRU4Rec)


@pytest.mark.parametrize("layers", [1, 2])
def test_one_click_at_a_time_equals_the_whole_session(model, tiny_seq, layers):
    """Session-parallel training and whole-session evaluation compute the same function."""
    m = model(num_layers=layers)
    sessions = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3]]
    whole, last = m(tiny_seq.rows(*sessions))
    assert whole.shape == (10, C) and last.shape == (3, layers, D)
    hidden, stepped, finals = None, {}, {}
    for t in range(5):  # lanes whose session ended keep running on a dummy click; only valid steps are kept
        clicks = [s[t] if t < len(s) else 0 for s in sessions]
        scores, new_hidden = m(tiny_seq.rows(*[[c] for c in clicks]), hidden)
        for lane, s in enumerate(sessions):
            if t < len(s):
                stepped[(lane, t)] = scores[lane]
                finals[lane] = new_hidden[lane]
        hidden = new_hidden
    order = [(lane, t) for lane, s in enumerate(sessions) for t in range(len(s))]
    torch.testing.assert_close(torch.stack([stepped[k] for k in order]), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack([finals[i] for i in range(3)]), last, atol=1e-5, rtol=1e-5)


def test_later_clicks_do_not_change_earlier_scores(model, tiny_seq):
    m = model()
    full, _ = m(tiny_seq.rows([3, 1, 4, 1]))
    prefix, _ = m(tiny_seq.rows([3, 1]))
    torch.testing.assert_close(full[:2], prefix)


def test_scores_are_the_gru_output_against_the_item_table(model, tiny_seq):
    """Tied rows: the output layer is the item table itself; every row gets a gradient."""
    m = model()
    table = m.sparse_arch.embeddings["t_item"].weight
    scores, _ = m(tiny_seq.rows([3, 1, 4]))
    out, _ = m.gru(table[[3, 1, 4]].unsqueeze(0))  # (1, 3, D)
    torch.testing.assert_close(scores, out[0] @ table.t())
    m.train()
    scores, _ = m(tiny_seq.rows([3, 1, 4]))
    torch.nn.functional.cross_entropy(scores, torch.tensor([1, 4, 7])).backward()
    assert bool((table.grad.abs().sum(1) > 0).all())  # unclicked items learn as outputs


def test_same_scores_over_local_fused_and_ps_collections(model, tiny_seq):
    """The model does not know which collection it got: same weights, same scores."""
    from recps.embeddings import LocalEmbeddingCollection

    m = model()
    weight = m.sparse_arch.embeddings["t_item"].weight.detach().clone()  # (C, D)
    expected, _ = m(tiny_seq.rows([3, 1, 4], [2, 2]))

    local = LocalEmbeddingCollection(["item"], D, C, optimizer="sgd", lr=0.0)
    with torch.no_grad():
        next(iter(local.bags.fused.state_dict().values())).copy_(weight)
    ps_keys = salted_keys(torch.arange(C), "t_item")

    class Rows:  # an in-process communicator over `weight`, keyed as the PS keys them
        mode = "async"
        pushed: list = []

        def pull(self, table, keys):
            index = (keys[:, None] == ps_keys[None, :]).int().argmax(1)
            return weight[index].clone()

        def push(self, table, keys, grads):
            self.pushed.append((keys, grads))

    communicator = Rows()
    ps = PSEmbeddingCollection([EmbeddingConfig(name="t_item", embedding_dim=D, num_embeddings=C,
                                                feature_names=["item"])], communicator)
    for ec in (local, ps):
        other = GRU4Rec(ec)
        other.load_state_dict(m.state_dict(), strict=False)
        other.eval()
        got, _ = other(tiny_seq.rows([3, 1, 4], [2, 2]))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    other.train()
    got, _ = other(tiny_seq.rows([3, 1, 4], [2, 2]))
    got.sum().backward()
    keys, grads = communicator.pushed[-1]
    assert sorted(keys.tolist()) == sorted(ps_keys.tolist()) and grads.shape == (C, D)  # one push for all rows


def test_collection_must_serve_one_feature(tiny_seq):
    with pytest.raises(ValueError, match=r"GRU4Rec: the collection serves features \['a', 'b'\]"):
        GRU4Rec(tiny_seq.collection(names=("a", "b")))
    with pytest.raises(ValueError, match="num_layers=0"):
        GRU4Rec(tiny_seq.collection(), num_layers=0)


def planted_sessions(n: int, seed: int) -> list[list[int]]:
    """Sessions that walk item i -> i + 1 (mod 20): the next click is predictable from the last one."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 20, (n,), generator=g).tolist()
    lengths = torch.randint(2, 6, (n,), generator=g).tolist()
    return [[(s + k) % 20 + 100 for k in range(n_)] for s, n_ in zip(starts, lengths)]


@pytest.mark.parametrize("loss", ["cross_entropy", "bpr_max"])
def test_local_job_learns_a_planted_walk(tmp_path, tiny_seq, loss):
    """The engine's own job (conf/ defaults, ps=local, session-parallel lanes, 2 Hogwild threads)."""
    from recps.job.build import build_job
    from recps.job.run import evaluate

    cfg = tiny_seq.job_config(tmp_path, [
        "model=gru4rec", "ps=local", "progress=false", "trainer.batch_size=32", "model.embedding_dim=16",
        f"task.loss={loss}", "optimizer.lr=0.01", "ps.table.optimizer.lr=0.2"],
        train=planted_sessions(600, 0), test=planted_sessions(100, 1))
    assert cfg.dataset.batching == "session_parallel" and cfg.metrics.enabled is False
    job = build_job(cfg)
    assert type(job.collection).__name__ == "LocalEmbeddingCollection" and job.model.num_items == 20
    before = evaluate(job)
    stats = job.trainer.fit(job.data.train, 32, epochs=3, progress=False)
    after = evaluate(job)
    assert stats.last_loss < stats.first_losses[0]
    assert before["recall@20"] == 1.0  # 20 items: everything is in the top 20
    assert after["mrr@20"] > 0.9 > before["mrr@20"]  # the walk is learned: the next item ranks first
