"""NextItemTask: losses by hand, the recurrent state across session-parallel batches, and
evaluation equal to a plain loop over every (prefix, next click) of the test sessions."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from models import GRU4Rec
from recps.data.batch import Batch
from recps.data.sessions import SequenceSource, SessionParallelSource, Sessions
from recps.errors import ConfigError, DataError
from recps.tasks.next_item import MostPopular, NextItemTask, SessionItemsThenPopular, bpr_max_loss

C = 12
SESSIONS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10, 11], [0, 1, 0], [3, 3], [4, 5, 6, 7, 8]]


def sessions_of(lists):
    lengths = [len(s) for s in lists]
    return Sessions(torch.tensor([i for s in lists for i in s]), torch.tensor(np.r_[0, np.cumsum(lengths)]),
                    np.arange(len(lists)))


def gru(layers=1, items=C) -> GRU4Rec:
    torch.manual_seed(0)
    ec = EmbeddingCollection(tables=[EmbeddingConfig(name="t_item", embedding_dim=6, num_embeddings=items,
                                                     feature_names=["item"])])
    return GRU4Rec(ec, num_layers=layers).eval()


def test_cross_entropy_is_over_the_scored_positions_only():
    sparse = KeyedJaggedTensor.from_lengths_sync(["item"], torch.tensor([0, 1, 2, 3]), torch.tensor([3, 1]))
    labels = torch.tensor([[-1.0, 5.0, 7.0], [2.0, -1.0, -1.0]])  # row 0 position 0 is not scored
    batch = Batch(torch.zeros(2, 0), sparse, labels)
    scores = torch.randn(4, C)
    task = NextItemTask()
    assert task.target(batch).tolist() == [-1, 5, 7, 2]
    torch.testing.assert_close(task.loss(scores, batch), F.cross_entropy(scores[1:], torch.tensor([5, 7, 2])))


def test_bpr_max_by_hand():
    scores = torch.tensor([[2.0, 0.0, 1.0], [0.5, -1.0, 3.0]])
    targets = torch.tensor([0, 2])
    expected = 0.0
    for r, t in zip(scores.tolist(), targets.tolist()):
        negatives = [j for j in range(3) if j != t]
        z = sum(math.exp(r[j]) for j in negatives)
        s = {j: math.exp(r[j]) / z for j in negatives}
        ranking = sum(s[j] / (1 + math.exp(-(r[t] - r[j]))) for j in negatives)
        expected += -math.log(ranking) + 0.5 * sum(s[j] * r[j] ** 2 for j in negatives)
    assert float(bpr_max_loss(scores, targets, bpreg=0.5)) == pytest.approx(expected / 2, rel=1e-6)


def test_bpr_max_falls_as_the_target_rises():
    base = torch.zeros(1, 5)
    higher = base.clone()
    higher[0, 3] = 4.0
    t = torch.tensor([3])
    assert float(bpr_max_loss(higher, t)) < float(bpr_max_loss(base, t))


@pytest.mark.parametrize("layers", [1, 2])
def test_session_parallel_state_gives_the_whole_session_scores(layers):
    """The task carries each lane's state and resets it at session starts: the score row of every
    click equals the one of the whole session in one pass (items are unique: an item is a click)."""
    unique = [[0, 1, 2, 3], [4, 5], [6, 7, 8], [9, 10], [11, 12, 13, 14, 15], [16, 17]]
    model, task = gru(layers, items=18), NextItemTask()
    sessions = sessions_of(unique)
    whole, _ = model(KeyedJaggedTensor.from_lengths_sync(["item"], sessions.items, sessions.lengths))  # (M, C)
    checked = []
    for batch in SessionParallelSource(sessions, shuffle=False).batches(3, 0, 1, 0):
        scores = task.forward(model, batch)  # (3, C)
        clicks = batch.sparse.values()
        torch.testing.assert_close(scores, whole[clicks], atol=1e-5, rtol=1e-5)
        assert batch.labels[:, 0].long().tolist() == (clicks + 1).tolist()
        checked += clicks.tolist()
    # 12 targets over 3 lanes: 4 steps; lanes move on to sessions 3, 4, 5, then wrap to 0 and 1.
    assert checked == [0, 4, 6, 1, 9, 7, 2, 11, 16, 0, 12, 4]


def test_a_thread_without_state_cannot_continue_lanes():
    model, task = gru(), NextItemTask()
    batches = SessionParallelSource(sessions_of(SESSIONS), shuffle=False).batches(2, 0, 1, 0)
    task.forward(model, next(batches))
    second = next(batches)
    errors = []

    def other_thread():
        try:
            task.forward(model, second)  # this thread never saw the lanes start
        except DataError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=other_thread)
    t.start()
    t.join(timeout=60)
    assert errors and "continues sessions but this thread's state has None lanes" in errors[0]
    task.forward(model, second)  # the thread that started them goes on


def plain_ranks(model, sessions, max_len=None):
    """Rank of every next click, one prefix at a time (pessimistic ties)."""
    ranks = []
    for s in SESSIONS:
        for j in range(1, len(s)):
            prefix = s[:j] if max_len is None else s[max(0, j - max_len):j]
            scores, _ = model(KeyedJaggedTensor.from_lengths_sync(["item"], torch.tensor(prefix),
                                                                  torch.tensor([len(prefix)])))
            last = scores[-1]
            ranks.append(int((last > last[s[j]]).sum() + (last == last[s[j]]).sum()))
    return ranks


@pytest.mark.parametrize("max_len", [None, 2])
def test_evaluate_equals_a_loop_over_every_prefix(max_len):
    model, task = gru(), NextItemTask(metrics=("recall@3", "mrr@3", "ndcg@5"), eval_rows=2)
    got = task.evaluate(model, SequenceSource(sessions_of(SESSIONS), max_len=max_len, shuffle=False), 100)
    ranks = plain_ranks(model, SESSIONS, max_len)
    assert got["predictions"] == len(ranks) == sum(len(s) - 1 for s in SESSIONS)
    assert got["recall@3"] == pytest.approx(np.mean([r <= 3 for r in ranks]))
    assert got["mrr@3"] == pytest.approx(np.mean([1 / r if r <= 3 else 0 for r in ranks]))
    assert got["ndcg@5"] == pytest.approx(np.mean([1 / math.log2(r + 1) if r <= 5 else 0 for r in ranks]))
    assert not model.training


def test_most_popular_baseline_by_hand():
    sessions = sessions_of(SESSIONS)
    counts = sessions.item_counts(C)
    got = NextItemTask(metrics=("recall@2", "mrr@2")).evaluate(MostPopular(counts), SequenceSource(sessions), 4)
    targets = [s[j] for s in SESSIONS for j in range(1, len(s))]
    def rank(t):  # ties rank the target last among equal counts (pessimistic)
        return int((counts > counts[t]).sum() + (counts == counts[t]).sum())
    assert got["recall@2"] == pytest.approx(np.mean([rank(t) <= 2 for t in targets]))
    assert got["mrr@2"] == pytest.approx(np.mean([1 / rank(t) if rank(t) <= 2 else 0 for t in targets]))
    assert len(set(counts.tolist())) > 1  # the counts are not all equal


@pytest.mark.parametrize("max_len", [None, 2])
def test_the_sessions_own_items_then_popular_equal_a_loop(max_len):
    """Issue 32.11: "the session's own items, most recent first, then popular" beside the model. After each
    click the row's clicks so far rank first (the latest first), then the rest by training count (ties: the
    lower id first); with max_len the windowed rows see their window only, as the model does."""
    sessions = sessions_of(SESSIONS)
    counts = sessions.item_counts(C)
    metrics = ("recall@2", "mrr@3")
    source = SequenceSource(sessions, max_len=max_len, shuffle=False)
    got = NextItemTask(metrics=metrics).evaluate(SessionItemsThenPopular(counts), source, 3)
    popular = sorted(range(C), key=lambda i: (-int(counts[i]), i))
    ranks = []
    for s in SESSIONS:
        for j in range(1, len(s)):
            seen = s[:j] if max_len is None else s[max(0, j - max_len):j]
            recent = list(dict.fromkeys(reversed(seen)))  # the latest click first, each item once
            ranking = recent + [i for i in popular if i not in recent]
            ranks.append(ranking.index(s[j]) + 1)
    assert got["recall@2"] == pytest.approx(np.mean([r <= 2 for r in ranks]))
    assert got["mrr@3"] == pytest.approx(np.mean([1 / r if r <= 3 else 0 for r in ranks]))
    assert any(r == 1 for r in ranks) and any(r > 3 for r in ranks)  # both kinds of position occur


def test_evaluate_ranks_both_baselines_when_the_source_has_training_counts():
    sessions = sessions_of(SESSIONS)
    counts = sessions.item_counts(C)
    task, model = NextItemTask(metrics=("recall@3",)), gru()
    plain = task.evaluate(model, SequenceSource(sessions, shuffle=False), 100)
    assert set(plain) == {"recall@3", "predictions"}  # no training counts: no baseline
    got = task.evaluate(model, SequenceSource(sessions, shuffle=False, item_counts=counts), 100)
    popular = task.evaluate(MostPopular(counts), SequenceSource(sessions, shuffle=False), 100)
    own = task.evaluate(SessionItemsThenPopular(counts), SequenceSource(sessions, shuffle=False), 100)
    assert got == {**plain, "most_popular/recall@3": popular["recall@3"], "session_items/recall@3": own["recall@3"]}
    assert set(NextItemTask(metrics=("recall@3",), baseline=False).evaluate(
        model, SequenceSource(sessions, shuffle=False, item_counts=counts), 100)) == set(plain)


def test_configuration_errors_are_named():
    with pytest.raises(ConfigError, match=r"task.loss='bpr'.*cross_entropy"):
        NextItemTask(loss="bpr")
    with pytest.raises(ConfigError, match=r"task.metrics=\['auc'\].*recall@K"):
        NextItemTask(metrics=("auc",))
    with pytest.raises(ConfigError, match="session-parallel"):
        NextItemTask().evaluate(gru(), SessionParallelSource(sessions_of(SESSIONS)), 4)
