"""recps.metrics.funnel on hand-computed cases: every value below is worked out in a comment.

Three users; positives (CSR): u0 {7, 5}, u1 {3}, u2 {} (no positive: skipped by per-user means).
"""

from __future__ import annotations

import math

import pytest
import torch

from recps.errors import DataError
from recps.metrics import MetricCollection, merge_states
from recps.metrics.funnel import (
    FunnelTally,
    agreement,
    hit_rate,
    hits,
    merge_tally,
    ndcg_at_k,
    pass_through,
    ranker_counts,
    recall_at_k,
)
from recps.metrics.reporter import LocalMerger

OFFSETS = torch.tensor([0, 2, 3, 3])
ITEMS = torch.tensor([7, 5, 3])
RECALL = torch.tensor([[4, 7, 1, 5], [2, 9, 3, 8], [6, 1, -1, -1]])  # (U=3, K=4) what recall kept
FINAL = torch.tensor([[5, 4], [9, 2], [1, 6]])  # (U, 2) the final list


def pair(d: dict, name: str) -> list[float]:
    return d[name].tolist()


def test_hits_marks_positives_and_never_pads():
    assert hits(RECALL, OFFSETS, ITEMS).tolist() == [
        [False, True, False, True], [False, False, True, False], [False, False, False, False]]


def test_hits_of_a_slice_of_a_bigger_csr():
    # rows 1..2 of the CSR: offsets need not start at 0
    assert hits(RECALL[1:], OFFSETS[1:], ITEMS).tolist() == [[False, False, True, False], [False] * 4]


def test_chance_pass_through_and_its_interval():
    """A random stage keeping k of a request's K candidates passes each positive with probability k / K:
    the chance level weights that by the positives that reached it; Wilson's interval brackets p."""
    from recps.metrics.funnel import wilson_interval

    received = torch.tensor([[1, 2, 3, 4], [5, 6, -1, -1]])  # request 0: 4 candidates, request 1: 2
    kept = torch.tensor([[1], [5]])
    offsets, items = torch.tensor([0, 2, 3]), torch.tensor([1, 2, 6])  # 2 positives reached 0, 1 reached 1
    got = pass_through(received, kept, offsets, items, chance="chance")
    assert got["chance"].tolist() == [2 * 1 / 4 + 1 * 1 / 2, 3.0]
    assert got["pass_through"].tolist() == [1.0, 3.0]  # the same call: item 1 kept of the 3 that reached
    first = pass_through(None, kept, offsets, items, chance="chance", pool=torch.tensor([10, 5]))["chance"]
    assert first.tolist() == [2 * 1 / 10 + 1 * 1 / 5, 3.0]
    with pytest.raises(DataError, match="needs pool"):
        pass_through(None, kept, offsets, items, chance="chance")
    lo, hi = wilson_interval(30, 100)
    assert lo < 0.3 < hi and abs(lo - 0.2189) < 1e-3 and abs(hi - 0.3958) < 1e-3
    assert wilson_interval(0, 0) == (0.0, 0.0)


def test_pass_through_per_stage():
    # recall: 3 positives in all, it kept 7, 5 (u0) and 3 (u1): 3/3
    assert pair(pass_through(None, RECALL, OFFSETS, ITEMS), "pass_through") == [3.0, 3.0]
    # final stage received RECALL, kept 5 (u0) only: 1/3
    assert pair(pass_through(RECALL, FINAL, OFFSETS, ITEMS, name="fine"), "fine") == [1.0, 3.0]
    with pytest.raises(DataError, match="kept holds 1 positives but received only 0"):
        pass_through(torch.full((3, 1), -1), FINAL, OFFSETS, ITEMS)


def test_recall_ndcg_and_hit_rate_at_k():
    # recall@2: u0 top-2 [4, 7] holds 1 of 2 -> 0.5; u1 [2, 9] 0 of 1; u2 skipped: (0.5, 2 users)
    assert pair(recall_at_k(RECALL, OFFSETS, ITEMS, 2), "recall@2") == [0.5, 2.0]
    # recall@4: u0 2/2, u1 1/1
    assert pair(recall_at_k(RECALL, OFFSETS, ITEMS, 4), "recall@4") == [2.0, 2.0]
    # ndcg@4: u0 hits at ranks 2 and 4: (1/log2 3 + 1/log2 5) / (1 + 1/log2 3);
    #         u1 hit at rank 3: (1/log2 4) / 1 = 0.5
    u0 = (1 / math.log2(3) + 1 / math.log2(5)) / (1 + 1 / math.log2(3))
    num, den = pair(ndcg_at_k(RECALL, OFFSETS, ITEMS, 4), "ndcg@4")
    assert num == pytest.approx(u0 + 0.5, abs=1e-12) and den == 2.0
    # hr@2 of the final list: u0 has 5 at rank 1, u1 none: 1 of 2 users with a positive
    assert pair(hit_rate(FINAL, OFFSETS, ITEMS, 2), "hr@2") == [1.0, 2.0]
    # k beyond the width is the whole list
    assert pair(recall_at_k(FINAL, OFFSETS, ITEMS, 10), "recall@10") == [0.5, 2.0]


def test_ranker_gauc_and_pnr_over_candidates_grouped_by_user():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.8], [0.3, 0.2, 0.5, 0.1], [0.0, 0.0, 9.0, 9.0]])
    # u0: positives 7 (0.8), 5 (0.8); negatives 4 (0.9), 1 (0.1)
    #     pairs: 7>4? no, 7>1 yes, 5>4 no, 5>1 yes: AUC 2/4 = 0.5; concordant 2, discordant 2; w = 4
    # u1: positive 3 (0.5) above 2, 9, 8: AUC 1; concordant 3; w = 4
    # u2: no positive (pads ignored): skipped
    got = ranker_counts(RECALL, scores, OFFSETS, ITEMS, prefix="fine/")
    assert pair(got, "fine/gauc") == [4 * 0.5 + 4 * 1.0, 8.0]
    assert pair(got, "fine/pnr") == [5.0, 2.0]
    # ties between a positive and a negative count 1/2 in AUC and neither way in PNR
    tied = ranker_counts(torch.tensor([[7, 4]]), torch.tensor([[1.0, 1.0]]), torch.tensor([0, 1]), torch.tensor([7]))
    assert pair(tied, "gauc") == [1.0, 2.0] and pair(tied, "pnr") == [0.0, 0.0]
    with pytest.raises(DataError, match=r"scores \(3, 2\) and lists \(3, 4\) differ"):
        ranker_counts(RECALL, scores[:, :2], OFFSETS, ITEMS)


def test_agreement_share_of_the_later_top_k_the_earlier_stage_kept():
    earlier = torch.tensor([[5, 4, -1], [3, 8, 2]])
    later = torch.tensor([[4, 7, 5], [9, 2, -1]])
    # k=2: u0 {4, 7}: 4 kept; u1 {9, 2}: 2 kept -> 2 of 4
    assert pair(agreement(earlier, later, 2), "agreement@2") == [2.0, 4.0]
    # k=3: u0 adds 5 (kept), u1 a pad (skipped) -> 3 of 5
    assert pair(agreement(earlier, later, 3), "agreement@3") == [3.0, 5.0]


def test_tally_values_and_merges_to_the_union():
    names = ["recall@2", "hr@2", "gauc", "pnr"]
    whole = FunnelTally(names)
    parts = [FunnelTally(names), FunnelTally(names)]
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.8], [0.3, 0.2, 0.5, 0.1], [0.0, 0.0, 9.0, 9.0]])
    for tally, rows in ((whole, slice(0, 3)), (parts[0], slice(0, 1)), (parts[1], slice(1, 3))):
        offsets = OFFSETS[rows.start:rows.stop + 1]
        tally.add(recall_at_k(RECALL[rows], offsets, ITEMS, 2))
        tally.add(hit_rate(FINAL[rows], offsets, ITEMS, 2))
        tally.add(ranker_counts(RECALL[rows], scores[rows], offsets, ITEMS))
    assert whole.values() == {"recall@2": 0.25, "hr@2": 0.5, "gauc": 0.75, "pnr": 2.5}
    assert merge_states(parts).values() == whole.values()
    assert merge_tally(parts[0], LocalMerger()).values() == parts[0].values()
    # the additive state flattens like any metric's: what the servers or gloo sum
    assert MetricCollection([whole]).flatten().numel() == 2 * len(names)
    empty = FunnelTally(["pnr", "hr@2"])
    empty.add({"pnr": torch.tensor([3.0, 0.0])})
    assert empty.values()["pnr"] == math.inf and math.isnan(empty.values()["hr@2"])
    with pytest.raises(DataError, match=r"\['ndcg@5'\] are not among its names"):
        whole.add({"ndcg@5": torch.tensor([1.0, 1.0])})


def test_bad_inputs_name_the_argument():
    with pytest.raises(DataError, match=r"offsets has shape \(3,\) for 3 users; pass \(U \+ 1,\)"):
        hits(RECALL, OFFSETS[:3], ITEMS)
    with pytest.raises(DataError, match="lists is .*float32"):
        hits(RECALL.float(), OFFSETS, ITEMS)
    with pytest.raises(DataError, match="offsets .* decrease"):
        hits(RECALL, torch.tensor([0, 2, 1, 3]), ITEMS)
