"""GAUC and PNR against per-group reference computations (sklearn, brute-force pairs)."""

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from recps.errors import ConfigError, DataError
from recps.metrics import PNR, GroupedAUC, merge_states, pair_counts


def _grouped(n, n_groups, seed, levels=2, distinct_preds=None):
    rng = np.random.default_rng(seed)
    g = rng.integers(0, n_groups, size=n) * 7919 - 5000  # sparse, partly negative ids
    y = rng.integers(0, levels, size=n).astype(np.float64)
    if distinct_preds is None:
        p = rng.random(n)
    else:  # force ties
        p = rng.integers(0, distinct_preds, size=n) / distinct_preds
    return g, p, y


def _reference_gauc(g, p, y):
    """{weighting: GAUC} from sklearn per group, and the number of single-class groups."""
    aucs, sizes, clicks = [], [], []
    single = 0
    for gid in np.unique(g):
        sel = g == gid
        if len(np.unique(y[sel])) < 2:
            single += 1
            continue
        aucs.append(roc_auc_score(y[sel], p[sel]))
        sizes.append(sel.sum())
        clicks.append(y[sel].sum())
    aucs = np.array(aucs)
    weights = {"impressions": np.array(sizes, float), "clicks": np.array(clicks), "uniform": np.ones(len(aucs))}
    return {k: float((w * aucs).sum() / w.sum()) for k, w in weights.items()}, single


def _reference_pairs(g, p, y):
    conc = disc = tied = 0
    for gid in np.unique(g):
        sel = g == gid
        dy = y[sel][:, None] - y[sel][None, :]
        dp = p[sel][:, None] - p[sel][None, :]
        conc += int(((dy > 0) & (dp > 0)).sum())
        disc += int(((dy > 0) & (dp < 0)).sum())
        tied += int(((dy > 0) & (dp == 0)).sum())
    return conc, disc, tied


@pytest.mark.parametrize("distinct_preds", [None, 5])
def test_gauc_matches_per_group_sklearn(distinct_preds):
    g, p, y = _grouped(1500, 500, seed=1, distinct_preds=distinct_preds)  # ~3 rows a group
    ref, single = _reference_gauc(g, p, y)
    for weighting in ("impressions", "clicks", "uniform"):
        m = GroupedAUC(weighting=weighting)
        for lo in range(0, 1500, 512):  # a group's rows arrive in several batches
            m.update(torch.from_numpy(p[lo : lo + 512]), torch.from_numpy(y[lo : lo + 512]), groups=g[lo : lo + 512])
        d = m.details()
        assert d["gauc"] == pytest.approx(ref[weighting], rel=1e-12)
        assert d["gauc.single_class_groups"] == single > 0
        assert d["gauc.groups"] == len(np.unique(g))
        assert d["gauc.valid_groups"] == d["gauc.groups"] - single
    assert ref["impressions"] != pytest.approx(ref["uniform"], rel=1e-6)  # the weighting matters


def test_gauc_single_class_groups_excluded_and_all_single_is_nan():
    m = GroupedAUC()
    m.update(torch.tensor([0.9, 0.1, 0.5, 0.4, 0.3]), torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]), groups=torch.tensor([1, 1, 2, 2, 3]))
    d = m.details()
    assert d["gauc"] == 1.0  # only group 1 has both classes
    assert (d["gauc.groups"], d["gauc.valid_groups"], d["gauc.single_class_groups"]) == (3.0, 1.0, 2.0)
    m.reset()
    m.update(torch.tensor([0.9, 0.1]), torch.tensor([1.0, 1.0]), groups=torch.tensor([4, 4]))
    assert math.isnan(m.compute())
    assert m.details()["gauc.single_class_groups"] == 1.0


def test_grouped_empty_is_nan_and_groups_required():
    for m in (GroupedAUC(), PNR()):
        assert math.isnan(m.compute())
        m.update(torch.zeros(0), torch.zeros(0), groups=torch.zeros(0, dtype=torch.int64))
        assert math.isnan(m.compute())
        with pytest.raises(DataError, match=f"metric {m.name}: needs groups="):
            m.update(torch.tensor([0.5]), torch.tensor([1.0]))
        with pytest.raises(DataError, match="group ids must be integers"):
            m.update(torch.tensor([0.5]), torch.tensor([1.0]), groups=torch.tensor([1.5]))
        with pytest.raises(DataError, match="groups has 2 ids but preds has 1"):
            m.update(torch.tensor([0.5]), torch.tensor([1.0]), groups=torch.tensor([1, 2]))


@pytest.mark.parametrize("levels", [2, 5, 60])
@pytest.mark.parametrize("distinct_preds", [None, 4])
@pytest.mark.parametrize("max_levels", [32, 1])  # 1 forces the merge-sort path
def test_pair_counts_match_brute_force(levels, distinct_preds, max_levels):
    g, p, y = _grouped(3000, 40, seed=levels, levels=levels, distinct_preds=distinct_preds)
    c = pair_counts(torch.from_numpy(g), torch.from_numpy(p), torch.from_numpy(y), max_levels=max_levels)
    assert (int(c["concordant"].sum()), int(c["discordant"].sum()), int(c["tied"].sum())) == _reference_pairs(g, p, y)
    # per group too
    for gid, conc in zip(c["ids"].tolist()[:5], c["concordant"].tolist()[:5]):
        sel = g == gid
        assert conc == _reference_pairs(g[sel], p[sel], y[sel])[0]


def test_pnr_ratio_ties_neither_and_degenerate_cases():
    m = PNR()
    # group 1: labels 2 > 1 > 0; group 2 has a prediction tie across labels
    m.update(
        torch.tensor([0.9, 0.5, 0.1, 0.3, 0.3, 0.2]),
        torch.tensor([2.0, 1.0, 0.0, 1.0, 0.0, 0.0]),
        groups=torch.tensor([1, 1, 1, 2, 2, 2]),
    )
    d = m.details()
    # group 1: 3 concordant; group 2: (0.3 vs 0.2) concordant, (0.3 vs 0.3) tied
    assert (d["pnr.concordant"], d["pnr.discordant"], d["pnr.tied"], d["pnr.groups"]) == (4.0, 0.0, 1.0, 2.0)
    assert d["pnr"] == math.inf  # nothing discordant
    m.update(torch.tensor([0.1, 0.8]), torch.tensor([1.0, 0.0]), groups=torch.tensor([3, 3]))
    assert m.compute() == 4.0
    single = PNR()
    single.update(torch.tensor([0.1, 0.8]), torch.tensor([1.0, 1.0]), groups=torch.tensor([3, 3]))
    assert math.isnan(single.compute())  # no pair with different labels


def test_pnr_accepts_scores_and_real_labels():
    g, p, y = _grouped(500, 10, seed=9, levels=2)
    watch = y * np.random.default_rng(0).random(500) * 300.0  # watch time in seconds
    m = PNR()
    m.update(torch.from_numpy(p * 40 - 20), torch.from_numpy(watch), groups=torch.from_numpy(g))
    conc, disc, _ = _reference_pairs(g, p, watch)
    assert m.compute() == pytest.approx(conc / disc, rel=1e-12)


def test_grouped_merge_is_concatenation():
    g, p, y = _grouped(3000, 200, seed=3)
    tg, tp, ty = torch.from_numpy(g), torch.from_numpy(p), torch.from_numpy(y)
    for cls in (GroupedAUC, PNR):
        whole = cls()
        whole.update(tp, ty, groups=tg)
        parts = [cls() for _ in range(3)]
        for i, part in enumerate(parts):  # groups straddle the parts
            part.update(tp[i::3], ty[i::3], groups=tg[i::3])
        merged = merge_states(parts)
        assert merged.compute() == pytest.approx(whole.compute(), rel=1e-12)
        via_state = parts[0].clone()
        via_state.merge(parts[1].state())
        via_state.merge(parts[2].state())
        assert via_state.compute() == pytest.approx(whole.compute(), rel=1e-12)
        assert merged.state()["preds"].numel() == 3000


def test_grouped_state_does_not_alias_inputs():
    p = torch.tensor([0.9, 0.1], dtype=torch.float64)
    m = GroupedAUC()
    m.update(p, torch.tensor([1.0, 0.0]), groups=torch.tensor([1, 1]))
    p.fill_(0.5)  # the caller reuses its buffer
    assert m.compute() == 1.0


def test_gauc_bad_weighting():
    with pytest.raises(ConfigError, match="weighting='size'"):
        GroupedAUC(weighting="size")
