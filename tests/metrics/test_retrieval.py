"""Retrieval metrics against brute-force per-query computations and sklearn's ndcg_score."""

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import ndcg_score

from recps.errors import ConfigError, DataError
from recps.metrics import MRR, NDCGAtK, RecallAtK, merge_states


def _ranks_pessimistic(scores, rel):
    """Per query: the ranking (best first), ties broken against the relevant items."""
    order = []
    for s, r in zip(scores, rel):
        order.append(sorted(range(len(s)), key=lambda c: (-s[c], r[c])))
    return order


def _reference(scores, rel, k):
    recall, ndcg, rr = [], [], []
    for o, r in zip(_ranks_pessimistic(scores, rel), rel):
        n_rel = int((r > 0).sum())
        if n_rel == 0:
            continue
        top = o[:k]
        recall.append(sum(r[c] > 0 for c in top) / n_rel)
        dcg = sum(r[c] / math.log2(i + 2) for i, c in enumerate(top))
        ideal = sorted(r, reverse=True)[:k]
        ndcg.append(dcg / sum(g / math.log2(i + 2) for i, g in enumerate(ideal)))
        first = next((i for i, c in enumerate(o) if r[c] > 0), None)
        rr.append(0.0 if first is None or first >= k else 1.0 / (first + 1))
    return np.mean(recall), np.mean(ndcg), np.mean(rr)


@pytest.mark.parametrize("ties", [False, True])
def test_relevance_matrix_matches_brute_force(ties):
    rng = np.random.default_rng(0 if not ties else 1)
    b, c, k = 64, 30, 5
    scores = rng.integers(0, 4, size=(b, c)).astype(float) if ties else rng.random((b, c))
    rel = rng.integers(0, 3, size=(b, c)) * (rng.random((b, c)) < 0.2)  # graded, sparse
    rel[0] = 0  # a query without relevant items: skipped
    metrics = [RecallAtK(k), NDCGAtK(k), MRR(k)]
    for m in metrics:
        for lo in range(0, b, 16):
            m.update(torch.from_numpy(scores[lo : lo + 16]), torch.from_numpy(rel[lo : lo + 16]))
    ref = _reference(scores, rel, k)
    for m, r in zip(metrics, ref):
        assert m.compute() == pytest.approx(r, rel=1e-12), m.name
        skipped = int(((rel > 0).sum(1) == 0).sum())
        assert m.details()[f"{m.name}.skipped"] == skipped >= 1
        assert m.details()[f"{m.name}.queries"] == b - skipped


def test_ndcg_matches_sklearn_without_ties():
    rng = np.random.default_rng(2)
    scores, rel = rng.random((40, 25)), rng.integers(0, 4, size=(40, 25)).astype(float)
    rel[rel.sum(1) == 0, 0] = 1.0  # sklearn scores all-zero rows 0, we skip them: avoid them here
    for k in (3, 10, None):
        m = NDCGAtK(k)
        m.update(torch.from_numpy(scores), torch.from_numpy(rel))
        assert m.compute() == pytest.approx(ndcg_score(rel, scores, k=k), rel=1e-12)


def test_single_target_index_matches_relevance_form():
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 6, size=(50, 20)).astype(float)  # ties against the target
    target = rng.integers(0, 20, size=50)
    one_hot = np.zeros((50, 20))
    one_hot[np.arange(50), target] = 1.0
    for cls, k in ((RecallAtK, 4), (NDCGAtK, 4), (NDCGAtK, None), (MRR, None), (MRR, 3)):
        a, b = cls(k), cls(k)
        a.update(torch.from_numpy(scores), torch.from_numpy(target))
        b.update(torch.from_numpy(scores), torch.from_numpy(one_hot))
        assert a.compute() == pytest.approx(b.compute(), rel=1e-12), a.name


def test_constant_scores_rank_targets_last():
    m, r = MRR(), RecallAtK(1)
    for x in (m, r):
        x.update(torch.zeros(2, 4), torch.tensor([0, 3]))
    assert m.compute() == 0.25  # every target ranks 4th of 4
    assert r.compute() == 0.0


def test_ranked_lists():
    ranked = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]])
    targets = torch.tensor([[12, 99], [20, -1], [-1, -1]])  # 99 never retrieved; row 3: none
    recall, ndcg, mrr = RecallAtK(3), NDCGAtK(3), MRR()
    for m in (recall, ndcg, mrr):
        m.update_ranked(ranked, targets)
    assert recall.compute() == pytest.approx((1 / 2 + 1) / 2)
    idcg0 = 1 + 1 / math.log2(3)  # two relevant items in the ideal top 3
    assert ndcg.compute() == pytest.approx(((1 / math.log2(4)) / idcg0 + 1.0) / 2)
    assert mrr.compute() == pytest.approx((1 / 3 + 1) / 2)
    assert mrr.details()["mrr.skipped"] == 1.0
    single = MRR()
    single.update_ranked(ranked, torch.tensor([13, 99, 31]))
    assert single.compute() == pytest.approx((1 / 4 + 0 + 1 / 2) / 3)


def test_merge_and_empty():
    rng = np.random.default_rng(4)
    scores, target = torch.from_numpy(rng.random((30, 10))), torch.from_numpy(rng.integers(0, 10, 30))
    whole = NDCGAtK(5)
    whole.update(scores, target)
    parts = [NDCGAtK(5), NDCGAtK(5)]
    parts[0].update(scores[:12], target[:12])
    parts[1].update(scores[12:], target[12:])
    assert merge_states(parts).compute() == pytest.approx(whole.compute(), rel=1e-12)
    empty = RecallAtK(5)
    assert math.isnan(empty.compute())
    empty.update(torch.zeros(0, 10), torch.zeros(0, dtype=torch.int64))
    assert math.isnan(empty.compute())


def test_retrieval_errors():
    with pytest.raises(ConfigError, match="recall needs a cutoff"):
        RecallAtK(None)
    with pytest.raises(ConfigError, match="k=0"):
        NDCGAtK(0)
    m = MRR()
    with pytest.raises(DataError, match=r"target indices span \[0, 7\] but there are 5 candidates"):
        m.update(torch.rand(2, 5), torch.tensor([0, 7]))
    with pytest.raises(DataError, match="pass \\(B, C\\)"):
        m.update(torch.rand(5), torch.tensor([0]))
    with pytest.raises(DataError, match="relevance must be finite and >= 0"):
        m.update(torch.rand(2, 3), -torch.ones(2, 3))
    with pytest.raises(DataError, match="scores contain NaN"):
        m.update(torch.full((1, 3), float("nan")), torch.tensor([0]))
