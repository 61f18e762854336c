"""Pointwise metrics against direct reference computations (sklearn, numpy)."""

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, log_loss, mean_absolute_error, mean_squared_error, roc_auc_score

from recps.errors import ConfigError, DataError
from recps.metrics import (
    AUC,
    COPC,
    MAE,
    RMSE,
    Accuracy,
    ActualCTR,
    Calibration,
    LogLoss,
    PredictedCTR,
    merge_states,
)


def _data(n, seed=0, pos_rate=0.3):
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < pos_rate).astype(np.float64)
    # informative but noisy scores, squashed to probabilities
    p = 1.0 / (1.0 + np.exp(-(rng.normal(size=n) + 1.2 * y - 0.8)))
    return p, y


@pytest.mark.parametrize("regime", ["spread", "low_ctr"])
def test_auc_one_million_within_1e3_of_exact(regime):
    p, y = _data(1_000_000, seed=1)
    if regime == "low_ctr":  # probs packed into [0.003, 0.13]: far fewer buckets in use
        rng = np.random.default_rng(7)
        y = (rng.random(p.size) < 0.02).astype(np.float64)
        p = 1.0 / (1.0 + np.exp(-(rng.normal(scale=0.4, size=p.size) + 0.5 * y - 4.0)))
    auc = AUC()
    for lo in range(0, p.size, 100_000):  # in batches, as training feeds it
        auc.update(torch.from_numpy(p[lo : lo + 100_000]), torch.from_numpy(y[lo : lo + 100_000]))
    exact = roc_auc_score(y, p)
    assert abs(auc.compute() - exact) < 1e-3
    assert auc.details()["auc.positives"] == y.sum()


def test_auc_ties_count_half_like_sklearn():
    # Predictions on the bucket grid: bucketing is exact, so only the tie rule matters.
    rng = np.random.default_rng(2)
    p = rng.integers(0, 8, size=2000) / 8.0  # 8 distinct values, many ties
    y = (rng.random(2000) < 0.4).astype(np.float64)
    auc = AUC(num_buckets=8)
    auc.update(torch.from_numpy(p), torch.from_numpy(y))
    assert auc.compute() == pytest.approx(roc_auc_score(y, p), abs=1e-12)


def test_auc_all_tied_is_one_half_and_perfect_is_one():
    auc = AUC()
    auc.update(torch.full((10,), 0.3), torch.tensor([0.0, 1.0] * 5))
    assert auc.compute() == 0.5
    auc.reset()
    auc.update(torch.tensor([0.1, 0.2, 0.8, 0.9]), torch.tensor([0, 0, 1, 1]))
    assert auc.compute() == 1.0


def test_auc_soft_labels_equal_split_examples():
    # A label y counts as y of a positive and 1 - y of a negative.
    soft = AUC(num_buckets=1024)
    soft.update(torch.tensor([0.2, 0.7, 0.9]), torch.tensor([0.0, 0.5, 1.0]))
    hard = AUC(num_buckets=1024)
    # every example twice, the soft one once as a negative and once as a positive
    hard.update(torch.tensor([0.2, 0.2, 0.7, 0.7, 0.9, 0.9]), torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0]))
    hard_state = hard.state()
    soft_state = soft.state()
    assert torch.equal(soft_state["pos"] * 2, hard_state["pos"])
    assert torch.equal(soft_state["neg"] * 2, hard_state["neg"])
    assert soft.compute() == hard.compute()


def test_auc_empty_and_single_class_are_nan():
    auc = AUC()
    assert math.isnan(auc.compute())
    auc.update(torch.zeros(0), torch.zeros(0))  # empty batch: a no-op
    assert math.isnan(auc.compute())
    auc.update(torch.tensor([0.3, 0.6]), torch.tensor([1.0, 1.0]))
    assert math.isnan(auc.compute())


def test_logloss_matches_sklearn():
    p, y = _data(10_000, seed=3)
    m = LogLoss()
    m.update(torch.from_numpy(p).float(), torch.from_numpy(y))  # float32 probs are fine
    assert m.compute() == pytest.approx(log_loss(y, p.astype(np.float32).astype(np.float64)), rel=1e-9)


def test_logloss_clips_certain_mistakes():
    m = LogLoss(eps=1e-7)
    m.update(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]))
    assert m.compute() == pytest.approx((-math.log(1e-7) - math.log(1 - 1e-7)) / 2, rel=1e-12)


def test_accuracy_mae_rmse_ctrs_copc_match_references():
    p, y = _data(5000, seed=4)
    p[:3] = 0.5  # exactly at the threshold: predicts the negative (strict >)
    tp, ty = torch.from_numpy(p), torch.from_numpy(y)
    metrics = [Accuracy(), MAE(), RMSE(), ActualCTR(), PredictedCTR(), COPC()]
    for m in metrics:
        m.update(tp, ty)
    acc, mae, rmse, actual, predicted, copc = (m.compute() for m in metrics)
    assert acc == pytest.approx(accuracy_score(y, p > 0.5), abs=1e-15)
    assert mae == pytest.approx(mean_absolute_error(y, p), rel=1e-12)
    assert rmse == pytest.approx(math.sqrt(mean_squared_error(y, p)), rel=1e-12)
    assert actual == pytest.approx(y.mean(), rel=1e-12)
    assert predicted == pytest.approx(p.mean(), rel=1e-12)
    assert copc == pytest.approx(y.sum() / p.sum(), rel=1e-12)


def test_mae_rmse_accept_regression_targets():
    m, r = MAE(), RMSE()
    for x in (m, r):
        x.update(torch.tensor([3.0, -1.0]), torch.tensor([1.0, 2.0]))
    assert m.compute() == 2.5
    assert r.compute() == pytest.approx(math.sqrt((4 + 9) / 2))


def test_calibration_matches_numpy_buckets():
    p, y = _data(20_000, seed=5)
    p[0], p[1] = 1.0, 0.0  # the edges go to the last and the first bucket
    m = Calibration(num_buckets=10)
    m.update(torch.from_numpy(p), torch.from_numpy(y))
    b = np.minimum((p * 10).astype(int), 9)
    table = m.table()
    ece = 0.0
    for k in range(10):
        sel = b == k
        assert table["count"][k] == sel.sum()
        assert table["mean_pred"][k] == pytest.approx(p[sel].mean(), rel=1e-12)
        assert table["mean_label"][k] == pytest.approx(y[sel].mean(), rel=1e-12)
        ece += sel.sum() / p.size * abs(p[sel].mean() - y[sel].mean())
    assert m.compute() == pytest.approx(ece, rel=1e-12)


def test_calibration_custom_edges_and_empty_buckets():
    m = Calibration(edges=[0.0, 0.01, 0.1, 1.0])
    m.update(torch.tensor([0.005, 0.5, 0.5]), torch.tensor([0.0, 1.0, 0.0]))
    t = m.table()
    assert t["count"] == [1.0, 0.0, 2.0]
    assert math.isnan(t["mean_pred"][1])
    assert m.compute() == pytest.approx((0.005 + 0.0) / 3)
    with pytest.raises(ConfigError, match="strictly increasing edges"):
        Calibration(edges=[0.0, 0.5, 0.4, 1.0])


@pytest.mark.parametrize("cls", [LogLoss, Accuracy, MAE, RMSE, ActualCTR, PredictedCTR, COPC, Calibration])
def test_empty_is_nan(cls):
    m = cls()
    m.update(torch.zeros(0), torch.zeros(0))
    assert math.isnan(m.compute())


def test_merge_equals_union_exactly():
    p, y = _data(9000, seed=6)
    tp, ty = torch.from_numpy(p), torch.from_numpy(y)
    for cls in (AUC, LogLoss, Accuracy, MAE, RMSE, ActualCTR, PredictedCTR, COPC, Calibration):
        whole = cls()
        whole.update(tp, ty)
        parts = [cls() for _ in range(3)]
        for i, part in enumerate(parts):
            part.update(tp[i * 3000 : (i + 1) * 3000], ty[i * 3000 : (i + 1) * 3000])
        merged = merge_states(parts)
        assert merged.compute() == pytest.approx(whole.compute(), rel=1e-12, abs=1e-15), cls.__name__
        assert parts[0].compute() != merged.compute() or cls is COPC  # the parts are untouched
        # merging raw state dicts is the same as merging metrics
        again = parts[0].clone()
        again.merge(parts[1].state())
        again.merge(parts[2].state())
        assert again.compute() == merged.compute()


def test_bad_inputs_raise_clear_errors():
    auc = AUC()
    with pytest.raises(DataError, match=r"auc: preds span \[-2.0, 3.0\].*sigmoid\(logits\)"):
        auc.update(torch.tensor([-2.0, 3.0]), torch.tensor([0.0, 1.0]))
    with pytest.raises(DataError, match="preds has 3 values but labels has 2"):
        auc.update(torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.0, 1.0]))
    with pytest.raises(DataError, match="labels span"):
        auc.update(torch.tensor([0.1, 0.2]), torch.tensor([0.0, 2.0]))
    with pytest.raises(DataError, match="NaN"):
        MAE().update(torch.tensor([float("nan")]), torch.tensor([0.0]))
    with pytest.raises(DataError, match="NaN"):
        AUC().update(torch.tensor([float("nan")]), torch.tensor([0.0]))
    assert math.isnan(auc.compute())  # nothing was added by the failed updates


def test_merge_rejects_other_settings_and_types():
    a = AUC(num_buckets=16)
    with pytest.raises(DataError, match=r"state\['pos'\] has shape \(32,\), expected \(16,\)"):
        a.merge(AUC(num_buckets=32))
    with pytest.raises(DataError, match="cannot merge a LogLoss into a AUC"):
        a.merge(LogLoss())
    with pytest.raises(ConfigError, match="num_buckets=1"):
        AUC(num_buckets=1)


def test_load_state_replaces_and_reset_clears():
    a = AUC(num_buckets=4)
    a.update(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0]))
    b = AUC(num_buckets=4)
    b.load_state(a.state())
    assert b.compute() == 1.0
    b.reset()
    assert torch.count_nonzero(b.state()["pos"]) == 0
