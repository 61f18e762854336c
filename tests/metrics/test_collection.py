"""MetricCollection: names, one check per batch, flatten/unflatten, merging parts."""

import math

import numpy as np
import pytest
import torch

from recps.errors import ConfigError, DataError
from recps.metrics import AUC, MetricCollection, build_metric, merge_states
from recps.metrics.pointwise import LogLoss

CTR = ["auc", "gauc", "pnr", "logloss", "accuracy", "mae", "rmse", "actual_ctr", "predicted_ctr", "copc", "calibration"]


def _batches(n_batches, b=256, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n_batches):
        y = (rng.random(b) < 0.3).astype(np.float32)
        p = (1 / (1 + np.exp(-(rng.normal(size=b) + y - 0.8)))).astype(np.float32)
        g = rng.integers(0, 40, size=b)
        yield torch.from_numpy(p), torch.from_numpy(y), torch.from_numpy(g)


def test_collection_equals_its_members_updated_alone():
    coll = MetricCollection(CTR, device="cpu")
    alone = {name: build_metric(name) for name in CTR}
    for p, y, g in _batches(4):
        coll.update(p, y, groups=g)
        for m in alone.values():
            m.update(p, y, groups=g)
    values = coll.compute()
    assert list(values) == CTR
    for name, m in alone.items():
        assert values[name] == m.compute(), name
    details = coll.details()
    assert details["gauc.groups"] == 40.0 and "pnr.tied" in details


def test_flatten_of_parts_sums_to_flatten_of_union():
    parts = [MetricCollection(CTR) for _ in range(3)]
    whole = MetricCollection(CTR)
    for i, (p, y, g) in enumerate(_batches(6, seed=1)):
        parts[i % 3].update(p, y, groups=g)
        whole.update(p, y, groups=g)
    flat = sum(part.flatten() for part in parts)
    assert flat.dtype == torch.float64 and flat.numel() == whole.flat_size
    assert torch.allclose(flat, whole.flatten(), rtol=1e-12, atol=1e-9)
    merged = parts[0].clone()
    merged.unflatten(flat)  # additive states: the union's; grouped ones: still part 0's
    merged.load_grouped({n: merge_states([p[n] for p in parts]).state() for n in ("gauc", "pnr")})
    for name, value in whole.compute().items():
        assert merged.compute()[name] == pytest.approx(value, rel=1e-9), name
    assert merge_states(parts).compute() == pytest.approx(whole.compute(), rel=1e-9)


def test_state_round_trip_and_merge_by_state_dict():
    a, b = MetricCollection(["auc", "logloss", "gauc"]), MetricCollection(["auc", "logloss", "gauc"])
    batches = list(_batches(2, seed=2))
    a.update(*batches[0][:2], groups=batches[0][2])
    b.update(*batches[1][:2], groups=batches[1][2])
    c = MetricCollection(["auc", "logloss", "gauc"])
    c.load_state(a.state())
    c.merge(b.state())
    assert c.compute() == merge_states([a, b]).compute()
    assert set(c.grouped_state()) == {"gauc"}


def test_hydra_style_mapping_and_instances():
    coll = MetricCollection({"auc": {"num_buckets": 4096}, "logloss": None})
    assert coll["auc"].num_buckets == 4096 and coll.flat_size == 2 * 4096 + 2
    coll2 = MetricCollection([AUC(num_buckets=64, name="auc/ctr"), "logloss"])
    assert coll2.names == ["auc/ctr", "logloss"]
    r = MetricCollection(["recall@5", "ndcg@5", "ndcg", "mrr"])
    r.update(torch.tensor([[0.1, 0.9, 0.5]]), torch.tensor([2]))
    assert r.compute() == {"recall@5": 1.0, "ndcg@5": 1 / math.log2(3), "ndcg": 1 / math.log2(3), "mrr": 0.5}
    r.update_ranked(torch.tensor([[4, 5]]), torch.tensor([5]))
    assert r.compute()["mrr"] == 0.5


def test_collection_config_errors():
    with pytest.raises(ConfigError, match="metric 'acu': unknown name"):
        MetricCollection(["acu"])
    with pytest.raises(ConfigError, match="appears twice"):
        MetricCollection(["auc", "auc"])
    with pytest.raises(ConfigError, match="mixes input kinds"):
        MetricCollection(["auc", "recall@10"])
    with pytest.raises(ConfigError, match="only recall/ndcg/mrr take @K"):
        build_metric("auc@10")
    with pytest.raises(ConfigError, match="cutoff 'x'"):
        build_metric("recall@x")
    with pytest.raises(ConfigError, match="is a string"):
        MetricCollection("auc")
    with pytest.raises(ConfigError, match="no metrics"):
        MetricCollection([])


def test_collection_data_errors():
    coll = MetricCollection(["auc", "gauc"])
    with pytest.raises(DataError, match="metric auc,gauc: needs groups="):
        coll.update(torch.tensor([0.5]), torch.tensor([1.0]))
    with pytest.raises(DataError, match=r"flat state has shape \(3,\)"):
        coll.unflatten(torch.zeros(3))
    with pytest.raises(DataError, match="update_ranked is for retrieval"):
        coll.update_ranked(torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(DataError, match=r"merge got metrics \['auc', 'logloss'\]"):
        coll.merge(MetricCollection(["auc", "logloss"]))
    # MAE alone accepts regression targets; with AUC in the collection probabilities are checked
    with pytest.raises(DataError, match="needs probabilities"):
        MetricCollection(["mae", "auc"]).update(torch.tensor([2.0]), torch.tensor([1.0]))
    MetricCollection(["mae", "rmse"]).update(torch.tensor([2.0]), torch.tensor([7.0]))


def test_empty_collection_values_are_nan():
    coll = MetricCollection(CTR)
    coll.update(torch.zeros(0), torch.zeros(0), groups=torch.zeros(0, dtype=torch.int64))
    assert all(math.isnan(v) for v in coll.compute().values())


def test_merge_states_errors():
    with pytest.raises(DataError, match="got no parts"):
        merge_states([])
    with pytest.raises(DataError, match="cannot merge a AUC into a LogLoss"):
        merge_states([LogLoss(), AUC()])
