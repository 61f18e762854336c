"""MultiTask: loss values against hand arithmetic, ESMM's product and its stability, per-task
evaluation against sklearn, clear errors, and the Hydra task configs."""

from __future__ import annotations

import decimal
import math

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from sklearn.metrics import log_loss, roc_auc_score
from torch import nn
from torchrec import KeyedJaggedTensor

from recps.config import PROJECT_ROOT, register_resolvers
from recps.data.batch import Batch
from recps.data.dataset import ExamplesSource
from recps.data.reader import Examples
from recps.errors import ConfigError
from recps.tasks.multitask import MultiTask, esmm_ctcvr_loss


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def bce(p: float, y: float) -> float:
    return -(y * math.log(p) + (1 - y) * math.log(1 - p))


def make_batch(labels, logits=None) -> Batch:
    labels = torch.as_tensor(labels, dtype=torch.float32)
    b = labels.shape[0]
    dense = torch.zeros(b, 0) if logits is None else torch.as_tensor(logits, dtype=torch.float32)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["C1"], values=torch.zeros(b, dtype=torch.int64),
                                              lengths=torch.ones(b, dtype=torch.int64))
    return Batch(dense=dense, sparse=kjt, labels=labels)


class DenseAsLogits(nn.Module):
    """A model whose logits are its dense inputs (B, T): evaluation sees exactly the given scores."""

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return dense


LOGITS = [[0.5, -1.0], [-2.0, 0.3], [1.5, 2.0]]
LABELS = [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 1.0]]  # three label columns


def test_plain_loss_is_the_weighted_sum_of_per_task_means():
    task = MultiTask(label_indices=(2, 1), weights=(0.5, 2.0))
    logits = torch.tensor(LOGITS)
    expected = sum(w * sum(bce(sig(LOGITS[r][t]), LABELS[r][col]) for r in range(3)) / 3
                   for t, (col, w) in enumerate(((2, 0.5), (1, 2.0))))
    assert task.loss(logits, make_batch(LABELS)).item() == pytest.approx(expected, rel=1e-6)


def test_plain_predict_and_target_pick_the_label_columns():
    task = MultiTask(label_indices=(2, 0))
    torch.testing.assert_close(task.predict(torch.tensor(LOGITS)), torch.sigmoid(torch.tensor(LOGITS)))
    torch.testing.assert_close(task.target(make_batch(LABELS)), torch.tensor(LABELS)[:, [2, 0]])


def test_esmm_loss_matches_hand_computation():
    """BCE(σ(a), click) + BCE(σ(a)σ(b), click·conversion), weights (1, 3)."""
    labels = [[1.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.0, 1.0]]  # the last row: a conversion without click counts 0
    logits = [[0.4, -0.7], [-1.2, 2.2], [0.1, 0.9], [2.5, 1.5]]
    task = MultiTask(label_indices=(0, 1), weights=(1.0, 3.0), esmm=True)
    ctr = sum(bce(sig(a), y[0]) for (a, _), y in zip(logits, labels)) / 4
    ctcvr = sum(bce(sig(a) * sig(b), y[0] * y[1]) for (a, b), y in zip(logits, labels)) / 4
    got = task.loss(torch.tensor(logits), make_batch(labels)).item()
    assert got == pytest.approx(ctr + 3.0 * ctcvr, rel=1e-6)


def test_esmm_predict_is_ctr_and_the_product():
    task = MultiTask(esmm=True)
    probs = task.predict(torch.tensor([[0.0, 0.0], [2.0, -1.0]]))
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.25], [sig(2.0), sig(2.0) * sig(-1.0)]]))
    torch.testing.assert_close(task.target(make_batch([[1.0, 1.0], [0.0, 1.0], [1.0, 0.0]])),
                               torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]))


@pytest.mark.parametrize("a, b", [(60.0, 60.0), (-60.0, -60.0), (60.0, -60.0), (-60.0, 60.0), (30.0, 1e-3),
                                  (-100.0, 100.0), (100.0, 100.0)])
@pytest.mark.parametrize("y", [0.0, 1.0])
def test_esmm_ctcvr_loss_is_stable_at_extreme_logits(a, b, y):
    """float32 in log space agrees with 80-digit arithmetic where a naive log(1 − σ(a)σ(b)) gives inf."""
    ta = torch.tensor([a], requires_grad=True)
    tb = torch.tensor([b], requires_grad=True)
    loss = esmm_ctcvr_loss(ta, tb, torch.tensor([y]))
    loss.backward()
    with decimal.localcontext(decimal.Context(prec=80)):
        p = 1 / (1 + (-decimal.Decimal(a)).exp()) / (1 + (-decimal.Decimal(b)).exp())
        expected = float(-(p.ln() if y == 1.0 else (1 - p).ln()))
    assert torch.isfinite(loss) and torch.isfinite(ta.grad).all() and torch.isfinite(tb.grad).all()
    assert loss.item() == pytest.approx(expected, rel=1e-4, abs=1e-6)


def source(logits, labels) -> ExamplesSource:
    logits = torch.as_tensor(logits, dtype=torch.float32)
    n = logits.shape[0]
    examples = Examples(("C1",), logits, torch.zeros(n, 1, dtype=torch.int64), torch.as_tensor(labels, dtype=torch.float32))
    return ExamplesSource(examples, shuffle=False)


def random_rows(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, 2, generator=g) * 2
    click = (torch.rand(n, generator=g) < torch.sigmoid(logits[:, 0])).float()
    conv = click * (torch.rand(n, generator=g) < torch.sigmoid(logits[:, 1])).float()
    return logits, torch.stack([click, conv], dim=1)


def test_evaluate_reports_each_task_like_sklearn():
    logits, labels = random_rows(1000)
    task = MultiTask(label_indices=(0, 1), metrics=("auc", "logloss"), label_names=("click", "buy"))
    out = task.evaluate(DenseAsLogits(), source(logits, labels), batch_size=128)
    probs = torch.sigmoid(logits).double().numpy()
    for t, name in enumerate(("click", "buy")):
        assert out[f"auc/{name}"] == pytest.approx(roc_auc_score(labels[:, t], probs[:, t]), abs=1e-3)
        assert out[f"logloss/{name}"] == pytest.approx(log_loss(labels[:, t], probs[:, t]), rel=1e-5)
        assert out[f"rows/{name}"] == 1000
    assert out["auc"] == pytest.approx((out["auc/click"] + out["auc/buy"]) / 2)


def test_evaluate_esmm_scores_cvr_on_clicked_rows_only():
    logits, labels = random_rows(2000, seed=1)
    task = MultiTask(esmm=True, metrics=("auc",))
    out = task.evaluate(DenseAsLogits(), source(logits, labels), batch_size=300)
    p_ctr, p_cvr = torch.sigmoid(logits.double()).unbind(1)
    clicked = labels[:, 0] == 1
    assert out["auc/ctr"] == pytest.approx(roc_auc_score(labels[:, 0], p_ctr), abs=1e-3)
    assert out["auc/cvr"] == pytest.approx(roc_auc_score(labels[clicked, 1], p_cvr[clicked]), abs=1e-3)
    assert out["auc/ctcvr"] == pytest.approx(roc_auc_score(labels[:, 0] * labels[:, 1], p_ctr * p_cvr), abs=1e-3)
    assert out["rows/cvr"] == int(clicked.sum()) and out["rows/ctr"] == out["rows/ctcvr"] == 2000
    assert out["auc"] == pytest.approx((out["auc/ctr"] + out["auc/ctcvr"]) / 2)


def grouped_source(logits, labels, users) -> ExamplesSource:
    logits = torch.as_tensor(logits, dtype=torch.float32)
    examples = Examples(("C1",), logits, users.reshape(-1, 1), torch.as_tensor(labels, dtype=torch.float32))
    return ExamplesSource(examples, shuffle=False)


@pytest.mark.parametrize("esmm", [False, True])
def test_evaluate_groups_gauc_and_pnr_by_the_group_key_per_task(esmm):
    """gauc / pnr in a multi-task run's evaluation: each task's rows grouped by metrics.group_key, the
    same values as the single-task path (evaluate_pointwise) over that task's columns (ESMM's cvr over
    the clicked rows); without a group key they are refused before any pass, naming the key."""
    from recps.metrics.groups import evaluate_pointwise

    logits, labels = random_rows(3000, seed=2)
    users = torch.arange(3000) % 40  # 40 users, 75 rows each
    task = MultiTask(esmm=esmm, metrics=("auc", "gauc", "pnr"), label_names=("click", "buy"))
    out = task.evaluate(DenseAsLogits(), grouped_source(logits, labels, users), batch_size=256, group_key="C1")
    probs = task.predict(logits)  # (N, 2)
    if esmm:
        clicked = labels[:, 0] == 1
        columns = {"ctr": (probs[:, 0], labels[:, 0], None), "ctcvr": (probs[:, 1], labels[:, 0] * labels[:, 1], None),
                   "cvr": (torch.sigmoid(logits[clicked, 1]), labels[clicked, 1], clicked)}
    else:
        columns = {"click": (probs[:, 0], labels[:, 0], None), "buy": (probs[:, 1], labels[:, 1], None)}
    for name, (p, y, kept) in columns.items():
        rows = torch.ones(3000, dtype=torch.bool) if kept is None else kept
        # the rows' own source: the same group ids in the same order
        expected = evaluate_pointwise(["auc", "gauc", "pnr"], p, y, grouped_source(logits[rows], labels[rows], users[rows]),
                                      256, group_key="C1")
        for metric in ("auc", "gauc", "pnr"):
            assert out[f"{metric}/{name}"] == pytest.approx(expected[metric], rel=1e-9), (name, metric)
    assert 0.5 < out["gauc"] < 1.0 and out["pnr"] > 1.0
    with pytest.raises(ConfigError, match="group_key"):
        task.evaluate(DenseAsLogits(), grouped_source(logits, labels, users), batch_size=256)


def test_evaluate_restores_training_mode_and_names_default_labels():
    model = DenseAsLogits().train()
    logits, labels = random_rows(50)
    out = MultiTask(label_indices=(1,), metrics=("logloss",)).evaluate(model, source(logits[:, :1], labels), 16)
    assert model.training and set(out) == {"logloss/label1", "rows/label1", "logloss"}


@pytest.mark.parametrize("kwargs, message", [
    (dict(label_indices=()), r"task.label_indices is empty"),
    (dict(label_indices=(0, 0)), r"task.label_indices=\[0, 0\] repeats a column"),
    (dict(label_indices=(-1, 0)), r"task.label_indices=\[-1, 0\] has a negative index"),
    (dict(weights=(1.0,)), r"task.weights has 1 values for 2 tasks \(label_indices=\[0, 1\]\)"),
    (dict(weights=(1.0, -2.0)), r"task.weights=\[1.0, -2.0\]; use finite weights >= 0"),
    (dict(esmm=True, label_indices=(0, 1, 2)), r"task.esmm=true needs label_indices=\[click, conversion\]"),
    (dict(label_indices=(0, 2), label_names=("click", "buy")), r"the data set has 2 labels \['click', 'buy'\]"),
    (dict(metrics=("aucc",)), r"metric 'aucc': unknown name"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        MultiTask(**kwargs)


def test_wrong_logit_width_and_missing_label_columns_are_named():
    task = MultiTask(label_indices=(0, 1))
    with pytest.raises(ConfigError, match=r"DenseAsLogits returned logits of shape \(3, 3\) but the task has 2 label "
                                          r"columns \[0, 1\]; set model.num_tasks=2"):
        task.forward(DenseAsLogits(), make_batch(LABELS, logits=torch.zeros(3, 3)))
    with pytest.raises(ConfigError, match=r"labels of shape \(3, 1\) but task.label_indices=\[0, 1\]; use a data set "
                                          r"with 2\+ label columns"):
        task.loss(torch.zeros(3, 2), make_batch([[1.0], [0.0], [1.0]]))


@pytest.mark.parametrize("name, esmm", [("multitask", False), ("multitask_esmm", True)])
def test_task_configs_instantiate_with_the_data_sets_label_names(name, esmm):
    register_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"task={name}", "dataset=ali_ccp"])
        plain = compose(config_name="config", overrides=[f"task={name}"])  # a one-label schema without names
    task = instantiate(cfg.task, _convert_="all")
    assert isinstance(task, MultiTask) and task.esmm is esmm
    assert task.task_names == (("ctr", "ctcvr") if esmm else ("click", "purchase"))  # predict's columns
    assert instantiate(plain.task, _convert_="all").label_names is None


class LinearHeads(nn.Module):
    """Two logit columns from the dense inputs; trained with lr 0, so the scores stay fixed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(2, 2)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.linear(dense)  # (B, 2)


def test_training_metrics_reporter_gets_esmm_columns_ctr_and_ctcvr():
    """The reporter reports <metric>/<task> per predict() column; for ESMM these are ctr and
    ctcvr, and they agree with the task's own evaluation on the same fixed scores."""
    from recps.metrics.reporter import MetricsReporter
    from recps.job.loop import LocalDenseUpdater, Trainer

    logits, labels = random_rows(1024, seed=2)
    task = MultiTask(esmm=True, metrics=("auc", "logloss"))
    model = LinearHeads()
    params = list(model.parameters())
    reporter = MetricsReporter(["auc", "logloss"], task, threads=1, every_steps=0)
    Trainer(model, nn.Identity(), task, LocalDenseUpdater(params, torch.optim.SGD(params, lr=0.0)),
            observers=[reporter]).fit(source(logits, labels), 128, progress=False)
    (report,) = reporter.reports
    evaluated = task.evaluate(model, source(logits, labels), 256)
    assert {k for k in report if "/" in k} == {"auc/ctr", "logloss/ctr", "auc/ctcvr", "logloss/ctcvr"}
    for key in ("auc/ctr", "auc/ctcvr"):
        assert report[key] == pytest.approx(evaluated[key], abs=1e-3)
    for key in ("logloss/ctr", "logloss/ctcvr"):
        assert report[key] == pytest.approx(evaluated[key], rel=1e-5)


@pytest.mark.parametrize("model, esmm", [("shared_bottom", False), ("mmoe", False), ("ple", False), ("esmm", True)])
def test_multitask_models_default_to_their_task_and_data_set(model, esmm):
    """`python -m recps.train model=<name>` runs the right task on two-label data; the command line still wins."""
    register_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={model}"])
        other = compose(config_name="config", overrides=[f"model={model}", "dataset=aliexpress", "task=binary"])
    assert cfg.dataset.name == "synthetic_multitask" and cfg.task.esmm is esmm
    assert instantiate(cfg.task, _convert_="all").label_names == ("click", "conversion")
    assert other.dataset.name == "aliexpress" and other.task._target_ == "recps.tasks.BinaryTask"
