"""Funnel metrics: how a recall -> rank -> ... pipeline treats each user's held-out positives.

Every metric here is a ratio of two sums, so a batch of users gives a pair (numerator,
denominator) per metric, and the metric of any union of batches, threads or workers is the
ratio of the summed pairs: exact, O(1) memory. ``FunnelTally`` holds the pairs; it is an
additive ``Metric``, so it merges like AUC does (``merge_states``; ``MetricCollection`` through
the servers' ``PSMerger`` or gloo's ``allreduce_metrics``): ``merge_tally``.

Inputs (U users in a batch, K list width, P positives; shape letters as DESIGN.md):

    lists       (U, K) int64 item ids per user, best first, -1 pads at the end (each row distinct)
    scores      (U, K) float scores of those items (any real; higher is better; pads ignored)
    offsets     (U + 1,) int64, items (P,) int64: the positives as CSR, user u's are
                items[offsets[u]:offsets[u + 1]] (distinct per user; offsets[0] may be > 0,
                as a slice of a bigger CSR; recps.pipeline.data.Csr has this layout)

The pair each function returns, as {name: (2,) float64 [numerator, denominator]}:

    pass_through(received, kept, ...)   positives in `kept` / positives in `received` (the stage's
                                        input; None: every positive, for the first stage): the share
                                        of positives that survive a stage, given they reached it;
                                        with chance=name, also what keeping at random would pass
    recall_at_k(lists, ..., k)          sum over users of |top-k ∩ positives| / |positives|  /  users
                                        with a positive (users without one are skipped)
    ndcg_at_k(lists, ..., k)            sum of DCG@k / IDCG@k (binary gains, 1 / log2(1 + rank);
                                        IDCG over min(k, |positives|) hits)  /  users with a positive
    hit_rate(lists, ..., n)             users with a positive in the top n  /  users with a positive
    ranker_counts(lists, scores, ...)   gauc: sum_u w_u AUC_u / sum_u w_u over users with both a
                                        positive and a negative candidate, AUC_u over u's candidates
                                        (label: is a positive; tied scores count 1/2), w_u = u's
                                        candidates (impressions, as recps.metrics.GroupedAUC);
                                        pnr: concordant / discordant (positive above / below a
                                        negative of the same user; ties neither)
    agreement(earlier, later, k)        items of later[:, :k] that `earlier` holds  /  items of
                                        later[:, :k]: the share of a later stage's top-k that an
                                        earlier stage kept

GAUC and PNR decompose per user, and a user's candidates are one row here (never split over
workers), so summing (w AUC, w) and (concordant, discordant) is exact; GroupedAUC / PNR (whose
groups may be split) are not needed. A 0 denominator gives NaN (0/0) or inf (pnr's x/0).

    >>> import torch
    >>> lists = torch.tensor([[4, 7, 1], [2, 9, -1]])                      # (U=2, K=3)
    >>> offsets, items = torch.tensor([0, 2, 3]), torch.tensor([7, 5, 3])  # u0 {7, 5}, u1 {3}
    >>> hits(lists, offsets, items).tolist()
    [[False, True, False], [False, False, False]]
    >>> recall_at_k(lists, offsets, items, 2)["recall@2"].tolist()         # (1/2 + 0/1), 2 users
    [0.5, 2.0]
    >>> tally = FunnelTally(["recall@2", "hr@3", "gauc", "pnr"])
    >>> tally.add(recall_at_k(lists, offsets, items, 2))
    >>> tally.add(hit_rate(lists, offsets, items, 3))
    >>> tally.add(ranker_counts(lists, torch.tensor([[0.9, 0.8, 0.1], [0.5, 0.4, 0.0]]), offsets, items))
    >>> tally.values()  # u0: 7 (0.8) is below 4 (0.9), above 1 (0.1): AUC 1/2; u1: no positive there
    {'recall@2': 0.25, 'hr@3': 0.5, 'gauc': 0.5, 'pnr': 1.0}
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Mapping, Sequence

import torch
from torch import Tensor

from recps.errors import DataError
from recps.metrics.base import Metric, State
from recps.metrics.collection import MetricCollection
from recps.metrics.grouped import group_auc, pair_counts

__all__ = [
    "hits",
    "pass_through",
    "wilson_interval",
    "recall_at_k",
    "ndcg_at_k",
    "hit_rate",
    "ranker_counts",
    "agreement",
    "FunnelTally",
    "merge_tally",
]

Pairs = dict[str, Tensor]  # metric name -> (2,) float64 [numerator, denominator]


def _pair(num: Any, den: Any) -> Tensor:
    return torch.stack([torch.as_tensor(num, dtype=torch.float64), torch.as_tensor(den, dtype=torch.float64)])


def _check_lists(lists: Tensor, what: str) -> Tensor:
    if not isinstance(lists, Tensor) or lists.dim() != 2 or lists.dtype.is_floating_point:
        got = f"{tuple(lists.shape)} {lists.dtype}" if isinstance(lists, Tensor) else type(lists).__name__
        raise DataError(f"funnel metrics: {what} is {got}; pass (U, K) int64 item ids per user, -1 pads")
    return lists.to(torch.int64)


def _check_csr(offsets: Tensor, items: Tensor, users: int) -> tuple[Tensor, Tensor]:
    offsets = torch.as_tensor(offsets).to(torch.int64)
    items = torch.as_tensor(items).to(torch.int64)
    if offsets.dim() != 1 or offsets.numel() != users + 1:
        raise DataError(
            f"funnel metrics: positives offsets has shape {tuple(offsets.shape)} for {users} users; pass "
            f"(U + 1,) = ({users + 1},) CSR offsets, user u's positives items[offsets[u]:offsets[u + 1]]"
        )
    if users and (bool((offsets.diff() < 0).any()) or int(offsets[0]) < 0 or int(offsets[-1]) > items.numel()):
        raise DataError(
            f"funnel metrics: positives offsets {offsets.tolist()[:8]}... decrease or leave items' range "
            f"[0, {items.numel()}]; offsets must be non-decreasing CSR row starts into items"
        )
    return offsets, items


def _row_keys(lists: Tensor, offsets: Tensor, items: Tensor) -> tuple[Tensor, Tensor, int]:
    """Pairs (row, item) as int64 keys row * M + item: of the lists (U, K) (-1 where padded) and of
    the positives (P',); M = 1 + the largest id."""
    users = lists.shape[0]
    lo, hi = int(offsets[0]) if users else 0, int(offsets[-1]) if users else 0
    pos_items = items[lo:hi]  # (P',)
    pos_rows = torch.repeat_interleave(torch.arange(users, device=lists.device), offsets.diff())  # (P',)
    top = max(int(lists.max()) if lists.numel() else 0, int(pos_items.max()) if pos_items.numel() else 0)
    if (lists.numel() and int(lists.min()) < -1) or (pos_items.numel() and int(pos_items.min()) < 0):
        raise DataError("funnel metrics: item ids must be >= 0 (lists may pad with -1); got a smaller id")
    m = top + 1
    if users * m >= 2**62:
        raise DataError(f"funnel metrics: {users} users x item ids up to {top} overflow int64 keys; pass fewer users")
    rows = torch.arange(users, device=lists.device).unsqueeze(1)  # (U, 1)
    keys = torch.where(lists >= 0, rows * m + lists, torch.full_like(lists, -1))  # (U, K)
    return keys, pos_rows * m + pos_items, m


def hits(lists: Tensor, offsets: Tensor, items: Tensor) -> Tensor:
    """(U, K) bool: lists[u, k] is one of user u's positives (pads never are)."""
    lists = _check_lists(lists, "lists")
    offsets, items = _check_csr(offsets, items, lists.shape[0])
    keys, wanted, _ = _row_keys(lists, offsets, items)
    return torch.isin(keys, wanted) & (keys >= 0)


def _n_positives(offsets: Tensor) -> Tensor:
    return offsets.diff().to(torch.float64)  # (U,)


def pass_through(received: Tensor | None, kept: Tensor, offsets: Tensor, items: Tensor,
                 name: str = "pass_through", chance: str | None = None, pool: Tensor | None = None) -> Pairs:
    """Positives in `kept` (U, K2) / positives in `received` (U, K1), or / all positives when
    received is None (the first stage). A stage keeps a subset of what it received; positives it
    kept that it never received are a caller's error (DataError).

    With `chance` (a name), also the pass-through a stage keeping as many candidates at random
    would have: each positive that reached the stage survives with probability kept / received of
    its request (received None: the first stage, which chose from `pool` (U,) candidates per
    request); the pair (sum over positives of that, positives)."""
    offsets, items = _check_csr(offsets, items, _check_lists(kept, "kept").shape[0])
    survived = hits(kept, offsets, items).sum()
    if received is None:
        reached = _n_positives(offsets)  # (U,)
    else:
        reached = hits(received, offsets, items).sum(1).to(torch.float64)  # (U,)
        if int(survived) > int(reached.sum()):
            raise DataError(f"funnel metrics: {name}: kept holds {int(survived)} positives but received only "
                            f"{int(reached.sum())}; pass the stage's input as received and its output as kept")
    out = {name: _pair(survived, reached.sum())}
    if chance is not None:
        if received is None and pool is None:
            raise DataError(f"funnel metrics: {chance}: the first stage's chance level needs pool, the candidates "
                             f"each request chose from")
        n_kept = (kept >= 0).sum(1).to(torch.float64)  # (U,)
        n_in = torch.as_tensor(pool, dtype=torch.float64) if received is None else \
            (received >= 0).sum(1).to(torch.float64)  # (U,)
        share = torch.where(n_in > 0, n_kept / n_in.clamp(min=1.0), torch.zeros_like(n_in)).clamp(max=1.0)
        out[chance] = _pair((reached * share).sum(), reached.sum())
    return out


def wilson_interval(successes: float, trials: float, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a proportion successes / trials ((0, 0) without trials)."""
    if trials <= 0:
        return 0.0, 0.0
    from scipy.stats import binomtest  # deferred: scipy.stats costs every process ~2.6 s of start-up under load

    ci = binomtest(round(successes), round(trials)).proportion_ci(confidence, method="wilson")
    return float(ci.low), float(ci.high)


def recall_at_k(lists: Tensor, offsets: Tensor, items: Tensor, k: int, name: str | None = None) -> Pairs:
    """(sum over users with a positive of |top-k ∩ positives| / |positives|, those users)."""
    h = hits(lists, offsets, items)[:, :k]  # (U, k)
    npos = _n_positives(torch.as_tensor(offsets).to(torch.int64))  # (U,)
    has = npos > 0
    per = h.sum(1).to(torch.float64)[has] / npos[has]  # (U',)
    return {name or f"recall@{k}": _pair(per.sum(), has.sum())}


def ndcg_at_k(lists: Tensor, offsets: Tensor, items: Tensor, k: int, name: str | None = None) -> Pairs:
    """(sum over users with a positive of DCG@k / IDCG@k, binary gains, those users)."""
    h = hits(lists, offsets, items)[:, :k].to(torch.float64)  # (U, k')
    discount = 1.0 / torch.log2(torch.arange(2, k + 2, dtype=torch.float64))  # (k,)
    dcg = h @ discount[: h.shape[1]]  # (U,)
    npos = torch.as_tensor(offsets).to(torch.int64).diff()  # (U,)
    ideal = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(discount, 0)])  # (k + 1,)
    idcg = ideal[npos.clamp(max=k)]  # (U,)
    has = npos > 0
    return {name or f"ndcg@{k}": _pair((dcg[has] / idcg[has]).sum(), has.sum())}


def hit_rate(lists: Tensor, offsets: Tensor, items: Tensor, n: int, name: str | None = None) -> Pairs:
    """(users with a positive in the top n, users with a positive)."""
    h = hits(lists, offsets, items)[:, :n]  # (U, n)
    has = torch.as_tensor(offsets).to(torch.int64).diff() > 0
    return {name or f"hr@{n}": _pair((h.any(1) & has).sum(), has.sum())}


def ranker_counts(lists: Tensor, scores: Tensor, offsets: Tensor, items: Tensor, prefix: str = "") -> Pairs:
    """GAUC and PNR of a ranker's `scores` (U, K) over the candidates `lists` (U, K) it received,
    grouped by user, label = the candidate is a positive; pads (-1) are left out.
    Returns ``{prefix + "gauc": (sum w AUC, sum w), prefix + "pnr": (concordant, discordant)}``."""
    lists = _check_lists(lists, "lists")
    scores = torch.as_tensor(scores)
    if scores.shape != lists.shape:
        raise DataError(f"funnel metrics: scores {tuple(scores.shape)} and lists {tuple(lists.shape)} differ; "
                        f"pass one score per candidate")
    h = hits(lists, offsets, items)  # (U, K)
    valid = lists >= 0  # (U, K)
    groups = torch.arange(lists.shape[0]).unsqueeze(1).expand_as(lists)[valid]  # (N,) user row
    preds = scores.to(torch.float64)[valid]  # (N,)
    if bool(torch.isnan(preds).any()):
        raise DataError("funnel metrics: scores contain NaN; check the ranker's outputs")
    labels = h[valid].to(torch.float64)  # (N,)
    per = group_auc(groups, preds, labels)
    ok = ~torch.isnan(per["auc"])
    gauc = _pair((per["size"][ok] * per["auc"][ok]).sum(), per["size"][ok].sum())
    pairs = pair_counts(groups, preds, labels)
    pnr = _pair(pairs["concordant"].sum(), pairs["discordant"].sum())
    return {f"{prefix}gauc": gauc, f"{prefix}pnr": pnr}


def agreement(earlier: Tensor, later: Tensor, k: int, name: str | None = None) -> Pairs:
    """(items of later[:, :k] that earlier's row holds, items of later[:, :k]); pads skipped."""
    earlier = _check_lists(earlier, "earlier")
    later = _check_lists(later, "later")[:, :k]
    if earlier.shape[0] != later.shape[0]:
        raise DataError(f"funnel metrics: agreement of {earlier.shape[0]} earlier rows and {later.shape[0]} later "
                        f"rows; pass both stages' lists for the same users")
    users = earlier.shape[0]
    m = max(int(earlier.max()) if earlier.numel() else 0, int(later.max()) if later.numel() else 0) + 1
    rows = torch.arange(users).unsqueeze(1)  # (U, 1)
    want = torch.where(later >= 0, rows * m + later, torch.full_like(later, -1))  # (U, k)
    have = (rows * m + earlier)[earlier >= 0]  # (E,)
    valid = later >= 0
    return {name or f"agreement@{k}": _pair((torch.isin(want, have) & valid).sum(), valid.sum())}


class FunnelTally(Metric):
    """Named (numerator, denominator) sums; values are their ratios. Additive: merges as AUC does.

    Args:
        names: the metric names it holds (fixed: every worker's tally must hold the same ones).
    State: ``{name: (2,) float64}``. ``compute()`` is the first name's value; ``values()`` all.
    """

    kind: ClassVar[str] = "funnel"
    default_name = "funnel"

    def __init__(self, names: Sequence[str], *, name: str | None = None, device: torch.device | str = "cpu") -> None:
        self.names = [str(n) for n in names]
        if not self.names or len(set(self.names)) != len(self.names):
            raise DataError(f"FunnelTally: names={self.names}; give distinct metric names, e.g. ['recall@500', 'hr@10']")
        super().__init__(name=name, device=device)

    def _zero_state(self) -> State:
        return {n: torch.zeros(2, dtype=torch.float64) for n in self.names}

    def add(self, pairs: Mapping[str, Tensor]) -> None:
        """Add the pairs a funnel function returned (each name must be one of ``names``)."""
        unknown = sorted(set(pairs) - set(self.names))
        if unknown:
            raise DataError(f"FunnelTally: {unknown} are not among its names {self.names}; add them to names")
        for n, v in pairs.items():
            self._state[n] += torch.as_tensor(v, dtype=torch.float64).to(self.device)

    def update(self, preds: Any, labels: Any = None, groups: Any = None) -> None:
        raise DataError("FunnelTally: feed it with add(<a recps.metrics.funnel function's result>)")

    def values(self) -> dict[str, float]:
        """{name: numerator / denominator}; 0/0 is NaN, x/0 (x > 0) inf."""
        out = {}
        for n in self.names:
            num, den = (float(v) for v in self._state[n])
            out[n] = num / den if den > 0 else (math.inf if num > 0 else math.nan)
        return out

    def compute(self) -> float:
        return self.values()[self.names[0]]

    def details(self) -> dict[str, float]:
        out = dict(self.values())
        for n in self.names:
            out[f"{n}.num"], out[f"{n}.den"] = (float(v) for v in self._state[n])
        return out


def merge_tally(tally: FunnelTally, merger: Any) -> FunnelTally:
    """The sum of every worker's `tally` (a collective: every worker calls it, same names), through
    a ``recps.metrics.reporter`` merger: ``build_merger("ps", client=...)`` (the servers), gloo, local."""
    merged = merger.merge(MetricCollection([tally], device=tally.device))
    return merged[tally.name]  # type: ignore[return-value]
