"""Grouped metrics: AUC per user/query (GAUC) and the positive/negative order ratio (PNR).

Both need every example of a group together, and a group's examples may come from any
worker or thread, so their state is the examples themselves (``GroupedMetric``: columns
``groups`` (N,) int64, ``preds`` (N,) f64, ``labels`` (N,) f64) and merge = concatenation.
``compute`` is sort-based and vectorized: a few lexicographic sorts over N, no loop per
group or example (PNR loops over label levels, or over log2(largest group) merge passes
when labels take more than 32 values).

    >>> import torch
    >>> gauc = GroupedAUC()
    >>> gauc.update(torch.tensor([0.9, 0.2, 0.3, 0.6, 0.5]),   # preds
    ...             torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0]),   # labels
    ...             groups=torch.tensor([7, 7, 8, 8, 9]))      # user ids
    >>> gauc.compute()  # user 7: AUC 1 (2 impressions), user 8: AUC 0 (2), user 9 one class: skipped
    0.5
    >>> pnr = PNR()
    >>> pnr.update(torch.tensor([0.9, 0.4, 0.5, 0.3]), torch.tensor([2.0, 0.0, 1.0, 1.0]),
    ...            groups=torch.tensor([1, 1, 1, 1]))
    >>> pnr.details()["pnr.concordant"], pnr.details()["pnr.discordant"], pnr.compute()
    (4.0, 1.0, 4.0)
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

from recps.errors import ConfigError
from recps.metrics.base import GroupedMetric

__all__ = ["GroupedAUC", "PNR", "group_auc", "pair_counts"]


def _lexsort(*keys: Tensor) -> Tensor:
    """Permutation (N,) sorting by keys[0], then keys[1], ... ascending (stable)."""
    order = torch.argsort(keys[-1], stable=True)
    for k in reversed(keys[:-1]):
        order = order[torch.argsort(k[order], stable=True)]
    return order


def _starts(*sorted_keys: Tensor) -> Tensor:
    """(N,) bool: True where any of the already-sorted keys changes (runs of equal tuples)."""
    n = sorted_keys[0].numel()
    new = torch.zeros(n, dtype=torch.bool, device=sorted_keys[0].device)
    new[0] = True
    for k in sorted_keys:
        new[1:] |= k[1:] != k[:-1]
    return new


def _pairs_within_runs(new_run: Tensor, gid: Tensor, num_groups: int) -> Tensor:
    """Per group, unordered pairs inside runs of equal sorted keys: sum_runs c(c-1)/2, (G,) f64.

    new_run (N,) bool marks run starts in a group-major order; gid (N,) the dense group index
    in that same order (group-major orders agree on which slots hold which group)."""
    run_id = torch.cumsum(new_run, 0) - 1  # (N,)
    c = torch.bincount(run_id).to(torch.float64)  # (R,) run sizes
    out = torch.zeros(num_groups, dtype=torch.float64, device=gid.device)
    return out.index_add_(0, gid[new_run], c * (c - 1) / 2)


class _Runs:
    """Examples sorted by (group, pred ascending), cut into tie runs of equal (group, pred).

    order (N,): the sort permutation; gid (N,): dense group index; run_id (N,); run_gid (R,);
    ids (G,): the group ids ascending; size (G,) int64 examples per group.
    """

    def __init__(self, groups: Tensor, preds: Tensor) -> None:
        self.order = _lexsort(groups, preds)
        g, p = groups[self.order], preds[self.order]  # (N,)
        new_group = _starts(g)
        self.new_run = _starts(g, p)
        self.gid = torch.cumsum(new_group, 0) - 1  # (N,)
        self.run_id = torch.cumsum(self.new_run, 0) - 1  # (N,)
        self.run_gid = self.gid[self.new_run]  # (R,)
        self.ids = g[new_group]  # (G,)
        self.num_groups = int(self.ids.numel())
        self.num_runs = int(self.run_gid.numel())
        self.size = torch.bincount(self.gid, minlength=self.num_groups)  # (G,)

    def pair_sums(self, pos_w: Tensor, neg_w: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per group (G,) f64: pos mass, neg mass, sum of pos*neg over pairs with the positive's
        pred higher ("wins"), and over pairs with equal preds ("ties"). pos_w, neg_w (N,) in sorted order."""
        zeros_r = torch.zeros(self.num_runs, dtype=torch.float64, device=pos_w.device)
        run_pos = zeros_r.index_add(0, self.run_id, pos_w)  # (R,)
        run_neg = zeros_r.index_add(0, self.run_id, neg_w)  # (R,)
        zeros_g = torch.zeros(self.num_groups, dtype=torch.float64, device=pos_w.device)
        pos = zeros_g.index_add(0, self.run_gid, run_pos)  # (G,)
        neg = zeros_g.index_add(0, self.run_gid, run_neg)  # (G,)
        # Positive mass in strictly higher runs of the same group: the running total up to the
        # group's end minus the running total up to this run.
        pos_above = torch.cumsum(pos, 0)[self.run_gid] - torch.cumsum(run_pos, 0)  # (R,)
        wins = zeros_g.index_add(0, self.run_gid, run_neg * pos_above)  # (G,)
        ties = zeros_g.index_add(0, self.run_gid, run_neg * run_pos)  # (G,)
        return pos, neg, wins, ties


def group_auc(groups: Tensor, preds: Tensor, labels: Tensor) -> dict[str, Tensor]:
    """Exact AUC of every group, by one lexicographic sort; ties in preds count 1/2 (sklearn).

    Args: groups (N,) int64, preds (N,) f64, labels (N,) f64 in [0, 1] (a soft label y is
    y of a positive and 1 - y of a negative).
    Returns ``{"ids", "auc", "size", "positives", "negatives"}``, each (G,) over the distinct
    group ids in ascending order; ``auc`` is NaN for single-class groups.
    """
    if groups.numel() == 0:
        empty = torch.zeros(0, dtype=torch.float64, device=preds.device)
        return {"ids": groups[:0], "auc": empty, "size": empty, "positives": empty, "negatives": empty}
    runs = _Runs(groups, preds)
    y = labels[runs.order]  # (N,)
    pos, neg, wins, ties = runs.pair_sums(y, 1.0 - y)
    denom = pos * neg  # (G,)
    auc = torch.where(denom > 0, (wins + 0.5 * ties) / denom.clamp(min=1e-300), math.nan)  # (G,)
    return {"ids": runs.ids, "auc": auc, "size": runs.size.to(torch.float64), "positives": pos, "negatives": neg}


def _concordant_by_merging(groups: Tensor, preds: Tensor, labels: Tensor, runs: _Runs) -> Tensor:
    """(G,) int64 concordant pairs for labels with many distinct values (watch time).

    In the order (group, label ascending, pred descending) an example's concordant partners
    are the earlier examples of its group with a smaller pred: a 2-D dominance count, done
    by a bottom-up merge sort inside each group, vectorized per level (each right block
    counts smaller values of its left sibling with one global searchsorted over keys offset
    by the pair's start slot; then one stable sort merges the siblings). A level only keeps
    the groups longer than its block width, so it costs log2(largest group) levels.
    """
    key = torch.empty_like(runs.order)
    key[runs.order] = runs.run_id  # dense rank of (group, pred), comparable within a group
    order = _lexsort(groups, labels, -preds)
    gid = runs.gid  # (N,) dense group index per slot (the same in every group-major order)
    size = runs.size
    slot_start = (torch.cumsum(size, 0) - size)[gid]  # (N,) first slot of each slot's group
    slot_size = size[gid]  # (N,)
    k = runs.num_runs  # keys are < k
    slots = torch.arange(order.numel(), device=order.device)  # active slots, ascending
    vals = key[order]  # (N,) key in each active slot; blocks of `width` slots are sorted
    concordant = torch.zeros(runs.num_groups, dtype=torch.int64, device=order.device)
    width = 1
    while True:
        keep = slot_size[slots] > width  # groups with a sibling block at this width
        slots, vals = slots[keep], vals[keep]
        if slots.numel() == 0:
            return concordant
        in_group = slots - slot_start[slots]
        right = ((in_group // width) & 1).bool()
        pair_start = slots - in_group % (2 * width)  # (A,) slot where the sibling pair starts
        enc = pair_start * k + vals  # (A,) pair-major, sorted within each block
        left = enc[~right]  # globally sorted
        smaller = torch.searchsorted(left, enc[right]) - torch.searchsorted(left, pair_start[right] * k)
        concordant.index_add_(0, gid[slots[right]], smaller)
        width *= 2
        enc, perm = torch.sort(enc, stable=True)  # merge siblings; pairs keep their slots
        vals = vals[perm]


def pair_counts(groups: Tensor, preds: Tensor, labels: Tensor, *, max_levels: int = 32) -> dict[str, Tensor]:
    """Ordered-pair counts per group, exact, for any real labels (clicks, grades, watch time).

    Over the pairs (i, j) of one group with labels[i] > labels[j]:
    ``concordant`` preds[i] > preds[j], ``discordant`` preds[i] < preds[j], ``tied``
    preds[i] == preds[j] (neither). Returns those three (G,) int64 and ``ids`` (G,) int64.

    With at most ``max_levels`` distinct label values (clicks: 2) each level v is one
    vectorized pass over the tie runs (positives: label == v, negatives: label < v);
    beyond that, a merge-sort dominance count (``_concordant_by_merging``).
    """
    dev = groups.device
    if groups.numel() == 0:
        e = torch.zeros(0, dtype=torch.int64, device=dev)
        return {"ids": e, "concordant": e, "discordant": e, "tied": e}
    runs = _Runs(groups, preds)
    y = labels[runs.order]  # (N,) in (group, pred) order
    levels = torch.unique(y)  # (L,) ascending
    zeros_g = torch.zeros(runs.num_groups, dtype=torch.float64, device=dev)
    concordant, tied, differ = zeros_g.clone(), zeros_g.clone(), zeros_g.clone()
    if levels.numel() <= max_levels:
        for v in levels[1:]:  # one pass per label level, not per example
            pos, neg, wins, ties = runs.pair_sums((y == v).to(torch.float64), (y < v).to(torch.float64))
            concordant += wins
            tied += ties
            differ += pos * neg
        concordant_i = concordant.round().to(torch.int64)
    else:
        concordant_i = _concordant_by_merging(groups, preds, labels, runs)
        # Pairs with different labels, and those of them with equal preds, from run sizes.
        o = _lexsort(groups, labels)
        ga, ya = groups[o], labels[o]
        sizes = runs.size.to(torch.float64)
        differ = sizes * (sizes - 1) / 2 - _pairs_within_runs(_starts(ga, ya), runs.gid, runs.num_groups)
        o = _lexsort(groups, preds, labels)
        same_pred_label = _pairs_within_runs(_starts(groups[o], preds[o], labels[o]), runs.gid, runs.num_groups)
        tied = _pairs_within_runs(runs.new_run, runs.gid, runs.num_groups) - same_pred_label
    tied_i = tied.round().to(torch.int64)
    differ_i = differ.round().to(torch.int64)
    return {"ids": runs.ids, "concordant": concordant_i, "discordant": differ_i - concordant_i - tied_i, "tied": tied_i}


class GroupedAUC(GroupedMetric):
    """GAUC: the mean of per-group AUC, weighted by the group's impressions (examples).

    GAUC = sum_g w_g AUC_g / sum_g w_g over groups with both a positive and a negative,
    w_g = #impressions of g (the convention of DIN, Zhou et al. 2018); ``weighting="clicks"``
    uses the positives, ``"uniform"`` 1. Single-class groups have no AUC: they are excluded
    and counted (``details()["gauc.single_class_groups"]``). NaN when no group has both.
    Preds may be any real scores (ranks only matter). Groups are int64 ids (hash strings).
    """

    default_name = "gauc"
    needs_probs: ClassVar[bool] = False
    _weightings: ClassVar[tuple[str, ...]] = ("impressions", "clicks", "uniform")

    def __init__(self, weighting: str = "impressions", *, name: str | None = None, device: torch.device | str = "cpu") -> None:
        if weighting not in self._weightings:
            raise ConfigError(f"GroupedAUC: weighting={weighting!r}; use one of {list(self._weightings)}")
        self.weighting = weighting
        super().__init__(name=name, device=device)

    def details(self) -> dict[str, float]:
        c = self._columns_now()
        per = group_auc(c["groups"], c["preds"], c["labels"])
        valid = ~torch.isnan(per["auc"])
        w = {"impressions": per["size"], "clicks": per["positives"], "uniform": torch.ones_like(per["size"])}[
            self.weighting
        ][valid]
        total = float(w.sum())
        value = float((w * per["auc"][valid]).sum()) / total if total > 0 else math.nan
        n_groups = int(per["ids"].numel())
        n_valid = int(valid.sum())
        return {
            self.name: value,
            f"{self.name}.groups": float(n_groups),
            f"{self.name}.valid_groups": float(n_valid),
            f"{self.name}.single_class_groups": float(n_groups - n_valid),
        }

    def compute(self) -> float:
        return self.details()[self.name]


class PNR(GroupedMetric):
    """Positive/negative order ratio: concordant pairs / discordant pairs within groups.

    Over pairs of one group with different labels (any real labels: clicks, grades, watch
    time), a pair is concordant when the preds order agrees with the labels order and
    discordant when it is reversed; pairs with equal preds are neither (counted as ``tied``).
    PNR = total concordant / total discordant over all groups (a ratio of sums, as Paddle's
    positive_negative_pair), inf when nothing is discordant, NaN when no pair has different labels.
    """

    default_name = "pnr"
    needs_probs: ClassVar[bool] = False
    needs_unit_labels: ClassVar[bool] = False

    def details(self) -> dict[str, float]:
        c = self._columns_now()
        counts = pair_counts(c["groups"], c["preds"], c["labels"])
        conc = float(counts["concordant"].sum())
        disc = float(counts["discordant"].sum())
        value = conc / disc if disc > 0 else (math.inf if conc > 0 else math.nan)
        return {
            self.name: value,
            f"{self.name}.concordant": conc,
            f"{self.name}.discordant": disc,
            f"{self.name}.tied": float(counts["tied"].sum()),
            f"{self.name}.groups": float(counts["ids"].numel()),
        }

    def compute(self) -> float:
        return self.details()[self.name]
