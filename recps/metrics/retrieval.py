"""Retrieval metrics with additive states: recall@K, NDCG@K, MRR (optionally @K).

Two input forms, reduced once per batch to ``RankedTargets`` (where the relevant items landed):

- ``update(scores (B, C), targets)``: a score per candidate. ``targets`` is (B,) int64, the
  index of the one relevant candidate per query (in-batch / sampled-softmax evaluation), or
  (B, C) relevance >= 0 (0 = irrelevant; graded values are NDCG gains).
- ``update_ranked(ranked_ids (B, L) int64, target_ids)``: the ids an ANN index returned, best
  first (distinct within a row), and the relevant ids: (B,) or (B, T) padded with -1.
  A target missing from the list is a miss at every K.

Ties in scores count against the relevant items (pessimistic): a relevant candidate ranks
after every irrelevant one with the same score, so a constant model scores 0, not 1.
Queries with no relevant item are skipped and counted (``details()[name + ".skipped"]``).
NDCG uses linear gains rel / log2(1 + rank), as sklearn's ndcg_score.
State: ``sum`` (of per-query values), ``count`` (queries scored), ``skipped``; 0-d float64.

    >>> import torch
    >>> scores = torch.tensor([[0.1, 0.9, 0.3], [0.8, 0.2, 0.5]])   # (B=2, C=3)
    >>> targets = torch.tensor([2, 0])                                # target ranks 2 and 1
    >>> m = MRR()
    >>> m.update(scores, targets)
    >>> m.compute()  # (1/2 + 1) / 2
    0.75
    >>> r = RecallAtK(1)
    >>> r.update_ranked(torch.tensor([[5, 9, 2]]), torch.tensor([[9, 4]]))
    >>> r.compute()  # top-1 [5] holds none of {9, 4}
    0.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from recps.errors import ConfigError, DataError
from recps.metrics.base import Metric, State

__all__ = ["RankedTargets", "rank_scores", "rank_lists", "RecallAtK", "NDCGAtK", "MRR"]


@dataclass(frozen=True)
class RankedTargets:
    """Where the relevant items of B queries landed; exactly one of ``rank`` / ``gains`` is set.

    rank: (B,) float64, 1-based rank of the single relevant item (pessimistic ties).
    gains: (B, L) float64, relevance in ranked order, best first.
    ideal: (B, M) float64, relevance sorted descending (for the ideal DCG); with ``gains``.
    n_relevant: (B,) float64, relevant items per query (> 0 relevance).
    """

    rank: Tensor | None
    gains: Tensor | None
    ideal: Tensor | None
    n_relevant: Tensor


def _discounts(n: int, device: torch.device) -> Tensor:
    return 1.0 / torch.log2(torch.arange(n, dtype=torch.float64, device=device) + 2.0)  # (n,)


def rank_scores(scores: Any, targets: Any, *, who: str = "retrieval", device: torch.device | str = "cpu") -> RankedTargets:
    """Rank a (B, C) score matrix against (B,) target indices or (B, C) relevance."""
    s = torch.as_tensor(scores).detach().to(device=device, dtype=torch.float64)
    t = torch.as_tensor(targets).detach().to(device=device)
    if s.dim() != 2:
        raise DataError(f"metric {who}: scores has shape {tuple(s.shape)}; pass (B, C), a score per candidate")
    if s.numel() and not bool(torch.isfinite(s).all()):
        raise DataError(f"metric {who}: scores contain NaN or inf")
    b, c = s.shape
    if t.dim() == 1 and not t.dtype.is_floating_point:
        if t.numel() != b:
            raise DataError(f"metric {who}: scores has {b} rows but targets has {t.numel()} indices")
        if b and (int(t.min()) < 0 or int(t.max()) >= c):
            raise DataError(
                f"metric {who}: target indices span [{int(t.min())}, {int(t.max())}] but there are "
                f"{c} candidates; pass column indices in [0, {c})"
            )
        t = t.long()
        target_score = s.gather(1, t[:, None])  # (B, 1)
        above = (s > target_score).sum(1)  # (B,)
        tied_others = (s == target_score).sum(1) - 1  # (B,)
        rank = (1 + above + tied_others).to(torch.float64)  # (B,)
        return RankedTargets(rank=rank, gains=None, ideal=None, n_relevant=torch.ones_like(rank))
    if tuple(t.shape) != (b, c):
        raise DataError(
            f"metric {who}: targets has shape {tuple(t.shape)} and dtype {t.dtype}; pass (B,) int64 "
            f"indices or (B, C) = {(b, c)} relevance"
        )
    rel = t.to(torch.float64)  # (B, C)
    if rel.numel() and not (bool(torch.isfinite(rel).all()) and float(rel.min()) >= 0.0):
        raise DataError(f"metric {who}: relevance must be finite and >= 0 (0 = irrelevant)")
    # Pessimistic ties: order by relevance ascending first, then a stable sort by score
    # descending keeps the less relevant item first among equal scores.
    by_rel = torch.argsort(rel, dim=1, stable=True)  # (B, C)
    by_score = torch.argsort(s.gather(1, by_rel), dim=1, descending=True, stable=True)  # (B, C)
    gains = rel.gather(1, by_rel.gather(1, by_score))  # (B, C)
    ideal = torch.sort(rel, dim=1, descending=True).values  # (B, C)
    return RankedTargets(rank=None, gains=gains, ideal=ideal, n_relevant=(rel > 0).sum(1).to(torch.float64))


def rank_lists(ranked_ids: Any, target_ids: Any, *, who: str = "retrieval", device: torch.device | str = "cpu") -> RankedTargets:
    """Match ranked id lists (B, L) against relevant ids (B,) or (B, T) (-1 = padding)."""
    r = torch.as_tensor(ranked_ids).detach().to(device=device)
    t = torch.as_tensor(target_ids).detach().to(device=device)
    if r.dim() != 2 or r.dtype.is_floating_point:
        raise DataError(f"metric {who}: ranked_ids has shape {tuple(r.shape)}, dtype {r.dtype}; pass (B, L) int64 ids")
    if t.dim() == 1:
        t = t[:, None]  # (B, 1)
    if t.dim() != 2 or t.shape[0] != r.shape[0] or t.dtype.is_floating_point:
        raise DataError(
            f"metric {who}: target_ids has shape {tuple(t.shape)}, dtype {t.dtype}; pass (B,) or (B, T) "
            f"int64 ids with B = {r.shape[0]} (pad with -1)"
        )
    valid = t >= 0  # (B, T)
    hit = ((r[:, :, None] == t[:, None, :]) & valid[:, None, :]).any(2)  # (B, L)
    gains = hit.to(torch.float64)
    ideal = torch.sort(valid.to(torch.float64), dim=1, descending=True).values  # (B, T)
    return RankedTargets(rank=None, gains=gains, ideal=ideal, n_relevant=valid.sum(1).to(torch.float64))


class _RetrievalMetric(Metric):
    """Mean of a per-query value over queries with a relevant item; K=None means the whole list."""

    kind: ClassVar[str] = "retrieval"
    needs_probs: ClassVar[bool] = False
    needs_unit_labels: ClassVar[bool] = False
    base_name: ClassVar[str] = "retrieval"

    def __init__(self, k: int | None = None, *, name: str | None = None, device: torch.device | str = "cpu") -> None:
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"{type(self).__name__}: k={k!r}; use an int >= 1 (or None for the whole list)")
        self.k = k
        super().__init__(name=name or (self.base_name if k is None else f"{self.base_name}@{k}"), device=device)

    def _zero_state(self) -> State:
        return {k: torch.zeros((), dtype=torch.float64) for k in ("sum", "count", "skipped")}

    def update(self, scores: Any, targets: Any, groups: Any = None) -> None:  # type: ignore[override]
        """Add a batch of queries: scores (B, C), targets (B,) int64 indices or (B, C) relevance."""
        self._update_ranked(rank_scores(scores, targets, who=self.name, device=self.device))

    def update_ranked(self, ranked_ids: Any, target_ids: Any) -> None:
        """Add a batch of ranked lists: ranked_ids (B, L), target_ids (B,) or (B, T) (-1 pads)."""
        self._update_ranked(rank_lists(ranked_ids, target_ids, who=self.name, device=self.device))

    def _per_query(self, r: RankedTargets) -> Tensor:
        raise NotImplementedError

    def _update_ranked(self, r: RankedTargets) -> None:
        valid = r.n_relevant > 0  # (B,)
        values = self._per_query(r)  # (B,)
        self._state["sum"] += values[valid].sum()
        n_valid = valid.sum()
        self._state["count"] += n_valid
        self._state["skipped"] += valid.numel() - n_valid

    def compute(self) -> float:
        count = float(self._state["count"])
        return float(self._state["sum"]) / count if count > 0 else math.nan

    def details(self) -> dict[str, float]:
        return {
            self.name: self.compute(),
            f"{self.name}.queries": float(self._state["count"]),
            f"{self.name}.skipped": float(self._state["skipped"]),
        }

    def _top(self, x: Tensor) -> Tensor:
        return x if self.k is None else x[:, : self.k]


class RecallAtK(_RetrievalMetric):
    """Recall@K: relevant items in the top K / relevant items, averaged over queries."""

    base_name = "recall"

    def __init__(self, k: int, *, name: str | None = None, device: torch.device | str = "cpu") -> None:
        if k is None:
            raise ConfigError("RecallAtK: k=None; recall needs a cutoff, e.g. recall@50")
        super().__init__(k, name=name, device=device)

    def _per_query(self, r: RankedTargets) -> Tensor:
        if r.rank is not None:
            return (r.rank <= self.k).to(torch.float64)
        hits = (self._top(r.gains) > 0).sum(1)  # (B,)
        return hits / r.n_relevant.clamp(min=1.0)


class NDCGAtK(_RetrievalMetric):
    """NDCG@K = DCG@K / ideal DCG@K, gains rel / log2(1 + rank); K=None: the whole list."""

    base_name = "ndcg"

    def _per_query(self, r: RankedTargets) -> Tensor:
        if r.rank is not None:
            hit = r.rank <= (self.k if self.k is not None else math.inf)
            return torch.where(hit, 1.0 / torch.log2(r.rank + 1.0), 0.0)
        top = self._top(r.gains)  # (B, K)
        dcg = (top * _discounts(top.shape[1], top.device)).sum(1)  # (B,)
        best = self._top(r.ideal)  # (B, K')
        idcg = (best * _discounts(best.shape[1], best.device)).sum(1)  # (B,)
        return dcg / idcg.clamp(min=1e-300)


class MRR(_RetrievalMetric):
    """Mean reciprocal rank of the first relevant item (0 if it is not in the top K / the list)."""

    base_name = "mrr"

    def _per_query(self, r: RankedTargets) -> Tensor:
        if r.rank is not None:
            hit = r.rank <= (self.k if self.k is not None else math.inf)
            return torch.where(hit, 1.0 / r.rank, 0.0)
        hit = self._top(r.gains) > 0  # (B, K)
        if hit.shape[1] == 0:
            return torch.zeros(hit.shape[0], dtype=torch.float64, device=hit.device)
        first = hit.to(torch.int8).argmax(1).to(torch.float64)  # (B,) first hit (0 if none)
        return torch.where(hit.any(1), 1.0 / (first + 1.0), 0.0)
