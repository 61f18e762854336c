"""Bad input fails before any process starts: the launcher's checks (recps.config.validate_config, and
recps.train's of trainer.resume) name the value, where it came from and the fix. Each of these failed
inside worker 0 after the cluster had started (servers forked, then killed), or after ps=local had read
its data, or named no key."""

from __future__ import annotations

from pathlib import Path

import pytest

from recps.config import compose_config, dataset_feature_names, validate_config
from recps.errors import ConfigError
from recps.metrics.groups import check_run_groups
from tests.helpers.cli import recps_train

SYNTHETIC = tuple(f"C{i}" for i in range(1, 27))  # the synthetic data's sparse features


def _refused(overrides: list[str]) -> str:
    """validate_config's message for the config these overrides compose (given as the command line's)."""
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(overrides), overrides)
    return str(err.value)


@pytest.mark.parametrize("ps", ["sync", "async", "geo", "local"])
def test_a_group_key_the_data_lacks_is_refused_by_the_config_check(ps):
    message = _refused([f"ps={ps}", "metrics=grouped", "metrics.group_key=bogus"])
    assert message == ("metrics.group_key='bogus' (from the override metrics.group_key=bogus) is not a sparse feature "
                       f"of dataset synthetic (it has {list(SYNTHETIC)}); set metrics.group_key to its user or query feature "
                       "(metrics.metrics gauc, metrics.metrics pnr group examples by it)")


def test_the_tasks_grouped_metrics_need_a_key_of_the_data_too():
    message = _refused(["task.metrics=[auc,gauc]", "metrics.group_key=user"])
    assert message.startswith("metrics.group_key='user' (from the override metrics.group_key=user) is not a sparse "
                              "feature of dataset synthetic")
    assert message.endswith("(task.metrics gauc group examples by it)")
    assert "group examples by user or query; set metrics.group_key" in _refused(["task.metrics=[auc,pnr]"])
    # metrics off: the training reports' gauc needs no key, the task's still does
    validate_config(compose_config(["metrics=grouped", "metrics.enabled=false", "metrics.group_key=bogus"]))
    assert "task.metrics gauc" in _refused(["metrics.enabled=false", "task.metrics=[gauc]", "metrics.group_key=bogus"])


def test_a_group_key_of_the_data_passes_and_each_datasets_features_are_its_schemas():
    validate_config(compose_config(["metrics=grouped", "metrics.group_key=C26", "task.metrics=[auc,pnr]"]))
    assert dataset_feature_names(compose_config([]).dataset) == SYNTHETIC
    ali = compose_config(["dataset=ali_ccp"]).dataset
    assert dataset_feature_names(ali) == tuple(str(f) for f in ali.schema.sparse)
    assert dataset_feature_names(compose_config(["dataset=movielens"]).dataset) is None  # a _target_ reads its own
    check_run_groups(["auc"], {"metrics": {"gauc": None}, "group_key": "user"}, None)  # features unknown: a key will do


def test_an_optimizer_value_its_constructor_refuses_is_named():
    assert _refused(["optimizer.lr=-1"]) == (
        "optimizer.lr=-1 (from the override optimizer.lr=-1): torch.optim.Adam refuses it (Invalid learning rate: -1); "
        "set optimizer.lr to a learning rate > 0, e.g. 0.001")
    assert _refused(["ps=local", "optimizer=sgd", "optimizer.lr=-0.5"]).startswith(
        "optimizer.lr=-0.5 (from the override optimizer.lr=-0.5): torch.optim.SGD refuses it")
    assert "optimizer.betas=[1.5, 0.9]" in _refused(["+optimizer.betas=[1.5,0.9]"])
    assert "optimizer.lr='fast'" in _refused(["optimizer.lr=fast"])  # torch's TypeError names no key: the config's
    validate_config(compose_config(["optimizer.lr=0.01"]))


@pytest.mark.e2e
@pytest.mark.parametrize("overrides, message", [
    (["ps=async", "metrics=grouped", "metrics.group_key=bogus"],
     "recps.train: ConfigError: metrics.group_key='bogus' (from the override metrics.group_key=bogus) is not a sparse "
     "feature of dataset synthetic"),
    (["ps=local", "metrics=grouped", "metrics.group_key=bogus"], "is not a sparse feature of dataset synthetic"),
    (["ps=async", "optimizer.lr=-1"], "recps.train: ConfigError: optimizer.lr=-1 (from the override optimizer.lr=-1)"),
    (["ps=local", "trainer.resume=/nonexistent"],
     "recps.train: ConfigError: trainer.resume='/nonexistent' (from the override trainer.resume=/nonexistent): no "
     "checkpoint at /nonexistent"),
], ids=["group_key-async", "group_key-local", "lr", "resume-local"])
def test_the_cli_refuses_before_any_process_or_data(tmp_path: Path, overrides, message):
    """`python -m recps.train`: one message, exit 1, no server or worker started, no data generated."""
    run = tmp_path / "run"
    out = recps_train(*overrides, "dataset.generate.train_rows=2000", f"dataset.dir={tmp_path / 'data'}",
                      f"hydra.run.dir={run}", env={"HYDRA_FULL_ERROR": "0"}, timeout=60, check=1).output
    assert message in out, out
    assert "[server0]" not in out and "[worker0]" not in out and "starting" not in out, out
    assert not (tmp_path / "data").exists() and not (run / "cluster.log").exists()
