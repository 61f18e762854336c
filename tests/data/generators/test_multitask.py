"""synthetic_multitask: the click rows are synthetic's, the second label follows its planted logit,
the sidecar's best AUCs are the true probabilities' AUCs, caching, errors, and the dataset config."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict
from sklearn.metrics import roc_auc_score

from recps.config import PROJECT_ROOT, register_resolvers
from recps.data.generators import ctr as synthetic
from recps.data.generators import multitask as mt
from recps.data.dataset import prepare_data
from recps.errors import ConfigError

WORLD = dict(vocab=40, interactions=[], shares=[0.9, 0.1, 0.0])
ROWS = 20000


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    d = tmp_path_factory.mktemp("mt")
    train, test = mt.ensure_split(d, ROWS, 8000, seed=3, **WORLD)
    return d, train, test


def test_click_columns_are_the_synthetic_worlds_rows(split, tmp_path):
    d, train, _ = split
    clicks = synthetic.generate(tmp_path / "c.parquet", ROWS, config=train.world, stream=0, fmt="parquet")
    ours, theirs = pq.read_table(d / "train.parquet"), pq.read_table(clicks.path)
    assert ours.column_names == list(mt.COLUMNS)
    assert ours.column("click").to_pylist() == theirs.column("label").to_pylist()
    for c in ("I1", "I13", "C1", "C26"):
        assert ours.column(c).equals(theirs.column(c))
    assert train.best_aucs["click"] == clicks.best_auc


def test_after_click_labels_rates_and_best_aucs(split):
    d, train, test = split
    for info, path in ((train, d / "train.parquet"), (test, d / "test.parquet")):
        table = pq.read_table(path)
        click, conv = table.column("click").to_numpy(), table.column("conversion").to_numpy()
        assert not (conv & (1 - click)).any()  # no conversion without a click
        probs = mt.true_probs(table, info)  # (N, 2)
        z = mt.true_logits(table, info)
        clicked = click == 1
        assert info.best_aucs["click"] == pytest.approx(roc_auc_score(click, probs[:, 0]), abs=1e-9)
        assert info.best_aucs["conversion"] == pytest.approx(roc_auc_score(conv, probs[:, 1]), abs=1e-6)
        assert info.best_aucs["cvr"] == pytest.approx(roc_auc_score(conv[clicked], 1 / (1 + np.exp(-z[clicked, 1]))),
                                                      abs=1e-6)
        assert info.rates["click"] == pytest.approx(0.25, abs=0.02)
        assert info.rates["cvr"] == pytest.approx(0.3, abs=0.03)  # conversion_rate, per click
        # The two logits' varying parts correlate as conversion_shared (0.5) says.
        assert np.corrcoef(z[:, 0], z[:, 1])[0, 1] == pytest.approx(0.5, abs=0.05)
    assert mt.load_info(d / "test.parquet") == test


def test_ensure_split_reuses_files_and_regenerates_on_change(split):
    d, train, _ = split
    before = os.path.getmtime(d / "train.parquet")
    again, _ = mt.ensure_split(d, ROWS, 8000, seed=3, **WORLD)
    assert again == train and os.path.getmtime(d / "train.parquet") == before
    other, _ = mt.ensure_split(d / "other", 3000, 1000, seed=3, conversion_shared=-0.9, **WORLD)
    table = pq.read_table(d / "other" / "train.parquet")
    z = mt.true_logits(table, other)
    assert np.corrcoef(z[:, 0], z[:, 1])[0, 1] == pytest.approx(-0.9, abs=0.05)


def test_independent_structure_labels_every_row(tmp_path):
    _, test = mt.ensure_split(tmp_path, 2000, 10000, seed=1, structure="independent", conversion_rate=0.2, **WORLD)
    table = pq.read_table(test.path)
    click, conv = table.column("click").to_numpy(), table.column("conversion").to_numpy()
    assert (conv & (1 - click)).any()  # conversions without clicks exist
    assert conv.mean() == pytest.approx(0.2, abs=0.02) and "cvr" not in test.best_aucs
    assert test.best_aucs["conversion"] == pytest.approx(roc_auc_score(conv, mt.true_probs(table, test)[:, 1]), abs=1e-6)


def test_same_world_same_labels(tmp_path):
    a = mt.generate(tmp_path / "a.parquet", 3000, world=synthetic.SyntheticConfig(seed=5, vocab=30), stream=1)
    b = mt.generate(tmp_path / "b.parquet", 3000, world=synthetic.SyntheticConfig(seed=5, vocab=30), stream=1)
    assert pq.read_table(a.path).equals(pq.read_table(b.path))
    assert a.best_aucs == b.best_aucs


@pytest.mark.parametrize("kwargs, message", [
    (dict(colour=1), r"unknown generate options \['colour'\]"),
    (dict(structure="before_click"), r"structure='before_click'; use one of \('after_click', 'independent'\)"),
    (dict(conversion_shared=1.5), r"conversion_shared=1.5; it is a correlation"),
    (dict(conversion_rate=0.0), r"conversion_rate=0.0; use a value in \(0, 1\)"),
    (dict(fmt="text"), r"fmt='text': only 'parquet' is written"),
])
def test_bad_options_are_named(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        mt.ensure_split(tmp_path, 10, 10, **kwargs)


def test_dataset_config_reads_two_label_columns(tmp_path):
    register_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["dataset=synthetic_multitask"])
    with open_dict(cfg):
        cfg.dataset.dir = str(tmp_path)
        cfg.dataset.generate.train_rows, cfg.dataset.generate.test_rows = 3000, 1000
    data = prepare_data(cfg.dataset, seed=0)
    info = mt.load_info(tmp_path / "test.parquet")
    assert data.best_aucs == info.best_aucs and data.best_auc == info.best_aucs["click"]
    labels = data.test.examples.labels  # (N, 2) click, conversion in file order
    table = pq.read_table(tmp_path / "test.parquet")
    assert labels.shape == (1000, 2)
    assert labels[:, 1].tolist() == table.column("conversion").to_numpy().astype(float).tolist()
    assert data.schema.feature_names == tuple(f"C{i}" for i in range(1, 27)) and data.schema.num_dense == 13
