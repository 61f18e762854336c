"""Quality proofs of the multi-task zoo (issue 5): Shared-Bottom, MMoE, PLE and ESMM.

- Generated two-label data (conf/dataset/synthetic_multitask.yaml: 150k train / 40k test rows,
  conversion only after a click, its logit correlated 0.5 with the click logit): after one
  pass every model's AUC on both labels is within 0.03 of the best reachable AUC (the true
  probabilities' AUC on the same test rows). For ESMM the two labels are CTR (click) and
  CTCVR (click·conversion); its post-click CVR AUC is held to 0.06. Baseline: a logistic
  regression (models.LR) per label, same data, same pass.
- The Ali-CCP and AliExpress samples (../shared/data/multitask, read in place): every model
  trains (its loss over the train split falls) and evaluates on the test split.

Each run goes through the real engine (`recps.job.build.build_job`, ps=local FBGEMM tables, the
Hogwild trainer, the task's own evaluation), as `python -m recps.train` does. The figures
print one line per run (`pytest -s`); models/README.md records them.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from recps.config import PROJECT_ROOT, register_resolvers
from recps.data.dataset import prepare_data
from recps.job.build import build_job
from recps.job.run import evaluate

pytestmark = pytest.mark.slow

MODELS = {"shared_bottom": "multitask", "mmoe": "multitask", "ple": "multitask", "esmm": "multitask_esmm"}
# The one setting the proofs change from conf/: FBGEMM's row-wise Adagrad rate for the embedding
# rows (0.05 by default) so that one pass reaches the tail keys; the same for the LR baseline.
GENERATED_OVERRIDES = ("ps.table.optimizer.lr=0.2",)
TOLERANCE = 0.03  # issue 5: both AUCs within 0.03 of the best reachable
CVR_TOLERANCE = 0.06  # ESMM's post-click CVR: learnt only through the product, on the clicked quarter
SHARED = PROJECT_ROOT.parent / "shared" / "data" / "multitask"
REAL = {  # data set -> (its train and test files, its label names)
    "ali_ccp": (("ali_ccp_train_sample.csv", "ali_ccp_test_sample.csv"), ("click", "purchase")),
    "aliexpress": (("aliexpress_train_sample.csv", "aliexpress_test_sample.csv"), ("click", "conversion")),
}
REAL_OVERRIDES = ("trainer.batch_size=16", "trainer.epochs=5")  # 100 train rows: 7 steps a pass


def config(*overrides: str):
    register_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=["ps=local", "progress=false", "checkpoint.save=false",
                                                        *overrides])


def train_and_evaluate(cfg, data=None):
    job = build_job(cfg, data)
    job.trainer.fit(job.data.train, int(cfg.trainer.batch_size), epochs=int(cfg.trainer.epochs), progress=False)
    return job, evaluate(job)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """(dataset overrides, PreparedData): the default synthetic_multitask world in a tmp folder, parsed once."""
    overrides = ("dataset=synthetic_multitask", f"dataset.dir={tmp_path_factory.mktemp('synthetic_multitask')}")
    return overrides, prepare_data(config(*overrides).dataset, seed=0)


@pytest.fixture(scope="module")
def lr_baseline(generated):
    """LR test AUC per label of the generated data (one binary LR per label)."""
    overrides, data = generated
    out = {}
    for index, label in enumerate(("click", "conversion")):
        cfg = config("model=lr", "task=binary", f"task.label_index={index}", *overrides, *GENERATED_OVERRIDES)
        out[label] = train_and_evaluate(cfg, data)[1]["auc"]
    print(f"\n[generated] LR baseline auc: {out}")
    return out


@pytest.mark.parametrize("model", MODELS)
def test_generated_two_labels_reach_best_reachable_auc(model, generated, lr_baseline):
    overrides, data = generated
    cfg = config(f"model={model}", f"task={MODELS[model]}", *overrides, *GENERATED_OVERRIDES)
    _, metrics = train_and_evaluate(cfg, data)
    best = data.best_aucs
    keys = {"click": "auc/ctr", "conversion": "auc/ctcvr"} if model == "esmm" else {
        "click": "auc/click", "conversion": "auc/conversion"}
    got = {label: metrics[key] for label, key in keys.items()}
    if model == "esmm":
        got["cvr"] = metrics["auc/cvr"]
    print(f"\n[generated] {model}: auc {got}, best reachable {best}, LR baseline {lr_baseline}")
    for label in ("click", "conversion"):
        assert best[label] - got[label] <= TOLERANCE, (label, got, best)
    if model == "esmm":
        assert best["cvr"] - got["cvr"] <= CVR_TOLERANCE, (got, best)
        assert metrics["rows/cvr"] == int(data.test.examples.labels[:, 0].sum())  # the clicked rows only


def test_lr_baseline_learns_both_labels(lr_baseline, generated):
    """The baseline is a real one: far above chance on both labels, below the best reachable."""
    _, data = generated
    for label in ("click", "conversion"):
        assert 0.7 < lr_baseline[label] < data.best_aucs[label]


def real_data(name: str):
    (train, test), _ = REAL[name]
    missing = [f for f in (train, test) if not (SHARED / f).is_file()]
    if missing:
        pytest.skip(f"{SHARED} lacks {missing}: the Ali-CCP / AliExpress samples are not redistributable "
                    f"(Tianchi terms) and are read in place from ../shared/data; see its README.md")


def train_loss(job) -> float:
    """The task's mean loss over the whole train split (one batch: 100 rows)."""
    batch = next(iter(job.data.train.batches(len(job.data.train), 0, 1, 0)))
    with torch.no_grad():
        return float(job.task.loss(job.task.forward(job.model, batch), batch))


@pytest.mark.parametrize("dataset", REAL)
@pytest.mark.parametrize("model", [*MODELS, "lr"])
def test_real_samples_train_and_evaluate(model, dataset):
    real_data(dataset)
    _, labels = REAL[dataset]
    if model == "lr":  # the baseline: one binary LR per label
        aucs = {}
        for index, label in enumerate(labels):
            cfg = config("model=lr", "task=binary", f"task.label_index={index}", f"dataset={dataset}", *REAL_OVERRIDES)
            aucs[label] = train_and_evaluate(cfg)[1]["auc"]
        print(f"\n[{dataset}] LR baseline auc: {aucs}")
        assert all(math.isnan(v) or 0.0 <= v <= 1.0 for v in aucs.values())
        return
    cfg = config(f"model={model}", f"task={MODELS[model]}", f"dataset={dataset}", *REAL_OVERRIDES)
    job = build_job(cfg)
    before = train_loss(job)
    job.trainer.fit(job.data.train, int(cfg.trainer.batch_size), epochs=int(cfg.trainer.epochs), progress=False)
    after = train_loss(job)
    metrics = evaluate(job)
    test_labels = job.data.test.examples.labels  # (N, 2)
    print(f"\n[{dataset}] {model}: train loss {before:.4f} -> {after:.4f}, "
          + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(metrics.items())))
    assert after < before
    names = ("ctr", "cvr", "ctcvr") if model == "esmm" else labels
    assert metrics[f"rows/{names[0]}"] == len(test_labels)
    if model == "esmm":
        assert metrics["rows/cvr"] == int(test_labels[:, 0].sum())  # CVR is scored on clicked rows only
    for name in names:
        assert math.isfinite(metrics[f"logloss/{name}"])
        assert math.isnan(metrics[f"auc/{name}"]) or 0.0 <= metrics[f"auc/{name}"] <= 1.0


def test_real_sample_configs_name_the_files_in_place():
    """The dataset configs read ../shared/data next to the checkout; nothing is copied in."""
    for name, ((train, test), labels) in REAL.items():
        ds = config(f"dataset={name}").dataset
        assert [Path(p).resolve() for p in ds.train] == [(SHARED / train).resolve()]
        assert [Path(p).resolve() for p in ds.test] == [(SHARED / test).resolve()]
        assert list(ds.schema.labels) == list(labels) and ds.schema.hash_values is False
        assert not any((PROJECT_ROOT / "datasets").rglob(train))
