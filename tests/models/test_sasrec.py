"""SASRec: causal attention (no position sees a later click, padding changes nothing), tied
item rows, positions matter, clear errors, and a real local job that learns a planted order."""

from __future__ import annotations

import functools

import pytest
import torch

from models import SASRec

C, D = 30, 8  # tiny_seq's items and dim


@pytest.fixture
def model(tiny_seq):
    """model(**kwargs) -> a SASRec over `tiny_seq.collection()` (max_len 6, 2 heads unless given), in eval mode."""
    return functools.partial(tiny_seq.model, SASRec, max_len=6, num_heads=2)


def test_each_position_reads_only_its_prefix(model, tiny_seq):
    m = model()
    full = m(tiny_seq.rows([3, 1, 4, 1, 5]))
    assert full.shape == (5, C)
    for p in range(1, 6):
        torch.testing.assert_close(m(tiny_seq.rows([3, 1, 4, 1, 5][:p])), full[:p], atol=1e-5, rtol=1e-5)
    changed = m(tiny_seq.rows([3, 1, 4, 9, 9]))
    torch.testing.assert_close(changed[:3], full[:3], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(changed[3:], full[3:])


def test_rows_of_a_batch_do_not_see_each_other_or_the_padding(model, tiny_seq):
    m = model()
    alone = [m(tiny_seq.rows(s)) for s in ([3, 1, 4, 1, 5], [2], [7, 7, 8])]
    together = m(tiny_seq.rows([3, 1, 4, 1, 5], [2], [7, 7, 8]))  # padded to 5 inside
    torch.testing.assert_close(together, torch.cat(alone), atol=1e-5, rtol=1e-5)


def test_positions_matter_and_scores_use_the_item_table(model, tiny_seq):
    m = model()
    a, b = m(tiny_seq.rows([3, 1])), m(tiny_seq.rows([1, 3]))
    assert not torch.allclose(a[1], b[1])  # same set, other order
    table = m.sparse_arch.embeddings["t_item"].weight
    m.train()
    torch.nn.functional.cross_entropy(m(tiny_seq.rows([3, 1, 4])), torch.tensor([1, 4, 7])).backward()
    assert bool((table.grad.abs().sum(1) > 0).all())  # every item learns as an output row


def test_dropout_only_in_training(model, tiny_seq):
    m = model(dropout=0.5)
    x = tiny_seq.rows([3, 1, 4])
    torch.testing.assert_close(m(x), m(x))
    m.train()
    torch.manual_seed(0)
    first = m(x)
    assert not torch.allclose(first, m(x))


def test_errors_name_the_setting(model, tiny_seq):
    with pytest.raises(ValueError, match=r"a row of 7 clicks exceeds max_len=6.*dataset.max_len"):
        model()(tiny_seq.rows([1, 2, 3, 4, 5, 6, 7]))
    with pytest.raises(ValueError, match=r"num_heads=3 does not divide embedding_dim=8"):
        SASRec(tiny_seq.collection(), num_heads=3)
    with pytest.raises(ValueError, match=r"SASRec: the collection serves features \['a', 'b'\]"):
        SASRec(tiny_seq.collection(names=("a", "b")))


def planted_sessions(n: int, seed: int) -> list[list[int]]:
    """Walks i -> i + step (mod 20) with a step of 1, 2 or 3 per session: the last click leaves
    three candidates, the last two clicks determine the next one."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 20, (n,), generator=g).tolist()
    steps = torch.randint(1, 4, (n,), generator=g).tolist()
    lengths = torch.randint(3, 7, (n,), generator=g).tolist()
    return [[(a + k * step) % 20 + 100 for k in range(length)] for a, step, length in zip(starts, steps, lengths)]


def test_local_job_learns_a_walk_that_needs_two_clicks(tmp_path, tiny_seq):
    """The engine's own job (conf/ defaults, ps=local, sequence rows windowed at max_len, 2 threads)."""
    from recps.job.build import build_job
    from recps.job.run import evaluate

    cfg = tiny_seq.job_config(tmp_path, [
        "model=sasrec", "ps=local", "progress=false", "model.embedding_dim=32", "model.max_len=4",
        "model.num_heads=2", "model.dropout=0.0", "optimizer.lr=0.005", "ps.table.optimizer.lr=0.1"],
        train=planted_sessions(1500, 0), test=planted_sessions(200, 1))
    assert cfg.dataset.batching == "sequences" and cfg.dataset.max_len == 4
    job = build_job(cfg)
    assert max(int(b.sparse.lengths().max()) for b in job.data.test.batches(64, 0, 1, 0)) == 4  # windowed
    stats = job.trainer.fit(job.data.train, 64, epochs=8, progress=False)
    after = evaluate(job)
    assert stats.last_loss < stats.first_losses[0]
    # Reading only the last click, the best ranking puts the true next item first, second or third
    # with equal chance: MRR (1 + 1/2 + 1/3) / 3 = 0.61. Two clicks leave one candidate. Measured
    # with 2 Hogwild threads (session 6, 12 runs here and in full suites, the same at cf0cd15):
    # 0.689-0.868, so the bound sits between that spread and the one-click ceiling (it was 0.75,
    # which failed 2 of 4 full-suite runs).
    assert after["mrr@20"] > 0.66, after
