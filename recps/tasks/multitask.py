"""Multi-task binary labels: one sigmoid cross-entropy per task, or ESMM's entire-space pair.

A multi-task model returns logits (B, T), one column per task. `MultiTask` picks the T
label columns, weighs the per-task mean losses and evaluates every task on its own:

    plain:  loss = Σ_t w_t · BCE(σ(logits[:, t]), labels[:, label_indices[t]])
    ESMM:   logits (B, 2) = [a, b] (CTR and CVR towers), labels = [click, conversion]
            pCTR = σ(a), pCVR = σ(b), pCTCVR = σ(a)·σ(b)
            loss = w_0 · BCE(pCTR, click) + w_1 · BCE(pCTCVR, click·conversion)

The ESMM loss stays in log space: log pCTCVR = logσ(a) + logσ(b) and
log(1 − pCTCVR) = log(σ(−a) + σ(a)σ(−b)) = logaddexp(logσ(−a), logσ(a) + logσ(−b)),
two sums of log-probabilities with no cancellation, finite for any logits.

Evaluation (`evaluate`) reports `<metric>/<task>` per task: the label names for plain
tasks; for ESMM `ctr` (all rows, click), `cvr` (clicked rows only, conversion) and
`ctcvr` (all rows, click·conversion), with `rows/<task>` the rows each saw. The bare
`<metric>` is the mean over the trained objectives (the plain tasks; ESMM's ctr and
ctcvr), what `objective=auc` hands to sweepers.

Example:
    >>> import torch
    >>> task = MultiTask(label_indices=(0, 1), esmm=True)
    >>> logits = torch.tensor([[0.0, 0.0]])
    >>> task.predict(logits).tolist()  # [pCTR, pCTCVR]
    [[0.5, 0.25]]
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from recps.data.batch import Batch
from recps.errors import ConfigError
from recps.metrics import MetricCollection
from recps.metrics.base import prepare_pointwise
from recps.metrics.groups import batch_groups, check_group_key, feed_columns
from recps.tasks.base import TaskBase, check_label_range

__all__ = ["MultiTask", "esmm_ctcvr_loss"]

ESMM_TASKS = ("ctr", "ctcvr")  # the columns of predict() / target()
ESMM_EVAL = ("ctr", "cvr", "ctcvr")  # evaluation adds the post-click CVR


def esmm_ctcvr_loss(ctr_logits: torch.Tensor, cvr_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean BCE of pCTCVR = σ(ctr)·σ(cvr) against `target` (B,), computed in log space."""
    log_p = F.logsigmoid(ctr_logits) + F.logsigmoid(cvr_logits)  # (B,) log pCTCVR
    # 1 − σ(a)σ(b) = σ(−a) + σ(a)σ(−b): both terms are probabilities, so no cancellation.
    log_not_p = torch.logaddexp(F.logsigmoid(-ctr_logits), F.logsigmoid(ctr_logits) + F.logsigmoid(-cvr_logits))  # (B,)
    return -(target * log_p + (1.0 - target) * log_not_p).mean()


class MultiTask(TaskBase):
    """Losses, predictions and per-task evaluation for a model returning logits (B, T).

    Args:
        label_indices: the columns of `Batch.labels` the T logit columns predict, in order.
            ESMM: exactly two, (click, conversion).
        weights: per-task loss weights (T,); None weighs every task 1.
        metrics: pointwise metric names (recps.metrics) reported per task.
        esmm: the model returns [ctr, cvr] logits and trains through pCTCVR (see module doc).
        label_names: the names of `Batch.labels`' columns (dataset.schema.labels); metric keys
            use them; None names them label0, label1, ...
        label_range: the values every label column holds, [lo, hi]: [0, 1] (binary tasks); the
            tabular readers skip a row whose label lies outside as a bad row.

    `task_names` names the T columns of `predict` / `target` (the training metrics reporter
    reports `<metric>/<task>` per column): the label names, or ESMM's ("ctr", "ctcvr").
    """

    def __init__(self, label_indices: Sequence[int] = (0, 1), weights: Sequence[float] | None = None,
                 metrics: Sequence[str] = ("auc", "logloss"), esmm: bool = False,
                 label_names: Sequence[str] | None = None, label_range: Sequence[float] | None = (0.0, 1.0)) -> None:
        self.label_range = check_label_range(label_range)
        self.label_indices = tuple(int(i) for i in label_indices)
        if not self.label_indices:
            raise ConfigError("task.label_indices is empty; name the label column of each task, e.g. [0, 1]")
        if min(self.label_indices) < 0:
            raise ConfigError(f"task.label_indices={list(self.label_indices)} has a negative index; "
                              f"use column numbers of dataset.schema.labels (0-based)")
        if len(set(self.label_indices)) != len(self.label_indices):
            raise ConfigError(f"task.label_indices={list(self.label_indices)} repeats a column; give each task its own")
        self.esmm = bool(esmm)
        if self.esmm and len(self.label_indices) != 2:
            raise ConfigError(f"task.esmm=true needs label_indices=[click, conversion] (2 columns), got "
                              f"{list(self.label_indices)}")
        n = len(self.label_indices)
        self.weights = tuple(float(w) for w in (weights if weights is not None else [1.0] * n))
        if len(self.weights) != n:
            raise ConfigError(f"task.weights has {len(self.weights)} values for {n} tasks "
                              f"(label_indices={list(self.label_indices)}); give one weight per task or null")
        if any(not (w >= 0 and math.isfinite(w)) for w in self.weights):
            raise ConfigError(f"task.weights={list(self.weights)}; use finite weights >= 0")
        self.metrics = tuple(metrics)
        MetricCollection(list(self.metrics))  # unknown or mixed-kind names fail here, before training
        self.label_names = None if label_names is None else tuple(str(x) for x in label_names)
        if self.label_names is not None and max(self.label_indices) >= len(self.label_names):
            raise ConfigError(f"task.label_indices={list(self.label_indices)} but the data set has "
                              f"{len(self.label_names)} labels {list(self.label_names)}; pick columns among them")
        if self.esmm:
            self.task_names = ESMM_TASKS
        elif self.label_names is not None:
            self.task_names = tuple(self.label_names[i] for i in self.label_indices)
        else:
            self.task_names = tuple(f"label{i}" for i in self.label_indices)
        self._weights = torch.tensor(self.weights)  # (T,)
        self._columns = torch.tensor(self.label_indices)  # (T,)

    # ---- training -------------------------------------------------------------------------------

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        logits = model(batch.dense, batch.sparse)  # (B, T)
        if logits.dim() != 2 or logits.shape[1] != len(self.label_indices):
            raise ConfigError(
                f"{type(model).__name__} returned logits of shape {tuple(logits.shape)} but the task has "
                f"{len(self.label_indices)} label columns {list(self.label_indices)}; set model.num_tasks="
                f"{len(self.label_indices)} or change task.label_indices"
            )
        return logits

    def _labels(self, batch: Batch) -> torch.Tensor:
        labels = batch.labels
        if labels.dim() != 2 or labels.shape[1] <= max(self.label_indices):
            raise ConfigError(
                f"the batch has labels of shape {tuple(labels.shape)} but task.label_indices="
                f"{list(self.label_indices)}; use a data set with {max(self.label_indices) + 1}+ label columns "
                f"(e.g. dataset=synthetic_multitask)"
            )
        return labels.index_select(1, self._columns.to(labels.device))  # (B, T)

    def target(self, batch: Batch) -> torch.Tensor:
        """(B, T) targets of what `predict` estimates: the labels; ESMM [click, click·conversion]."""
        y = self._labels(batch)  # (B, T)
        if self.esmm:
            return torch.stack([y[:, 0], y[:, 0] * y[:, 1]], dim=1)  # (B, 2)
        return y

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Weighted sum of the per-task mean losses; the sigmoid is applied here, once."""
        y = self._labels(batch)  # (B, T)
        w = self._weights.to(logits.device)
        if self.esmm:
            ctr = F.binary_cross_entropy_with_logits(logits[:, 0], y[:, 0])
            ctcvr = esmm_ctcvr_loss(logits[:, 0], logits[:, 1], y[:, 0] * y[:, 1])
            return w[0] * ctr + w[1] * ctcvr
        per_task = F.binary_cross_entropy_with_logits(logits, y, reduction="none").mean(dim=0)  # (T,)
        return (per_task * w).sum()

    def predict(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, T) probabilities; ESMM [pCTR, pCTCVR]."""
        if self.esmm:
            log_ctr = F.logsigmoid(logits[:, 0])  # (B,)
            return torch.stack([log_ctr.exp(), (log_ctr + F.logsigmoid(logits[:, 1])).exp()], dim=1)  # (B, 2)
        return torch.sigmoid(logits)

    # ---- evaluation -----------------------------------------------------------------------------

    evaluates_groups = True  # recps.job.run.evaluate passes metrics.group_key (gauc / pnr among the metrics)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, source: Any, batch_size: int, group_key: str | None = None) -> dict[str, float]:
        """Per-task metrics over one pass of `source` (a BatchSource): `<metric>/<task>`,
        `rows/<task>`, and the bare `<metric>` averaged over the trained objectives. Grouped metrics
        (gauc, pnr) group each task's rows by the sparse feature `group_key` (metrics.group_key: the
        user or query id); rows without a key there count in the other metrics only."""
        names = ESMM_EVAL if self.esmm else self.task_names
        collections = {name: MetricCollection(list(self.metrics)) for name in names}
        grouped = [n for n in collections[names[0]] if not collections[names[0]][n].additive]
        if grouped:
            check_group_key(group_key, None, [f"task.metrics {n}" for n in grouped])
        rows = dict.fromkeys(names, 0)
        was_training = model.training
        model.eval()
        try:
            for batch in source.batches(batch_size, 0, 1, 0):
                ids, has = batch_groups(batch, str(group_key)) if grouped else (None, None)  # (B,) each
                for name, probs, labels, kept in self._eval_columns(self.forward(model, batch), batch):
                    if grouped:
                        members = [collections[name][n] for n in collections[name]]
                        p, y, g = prepare_pointwise(probs, labels, ids if kept is None else ids[kept],
                                                    who=f"evaluation {name}", device=collections[name].device,
                                                    needs_probs=any(m.needs_probs for m in members),
                                                    needs_unit_labels=any(m.needs_unit_labels for m in members))
                        feed_columns(members, p, y, g, (has if kept is None else has[kept]).to(p.device))
                    else:
                        collections[name].update(probs, labels)
                    rows[name] += int(labels.numel())
        finally:
            model.train(was_training)
        if not sum(rows.values()):
            raise ConfigError("the evaluation split is empty; give dataset.test files or a test_fraction > 0")
        out: dict[str, float] = {}
        for name, collection in collections.items():
            values = collection.compute() if rows[name] else dict.fromkeys(self.metrics, math.nan)
            out.update({f"{metric}/{name}": float(v) for metric, v in values.items()})
            out[f"rows/{name}"] = rows[name]
        for metric in self.metrics:  # the trained objectives: predict's columns
            out[metric] = sum(out[f"{metric}/{name}"] for name in self.task_names) / len(self.task_names)
        return out

    def _eval_columns(self, logits: torch.Tensor, batch: Batch):
        """(task name, probs (n,), labels (n,), kept) for each evaluated task of one batch; kept: the
        (B,) bool mask of the batch's rows the task evaluates (None: all of them)."""
        y = self._labels(batch)  # (B, T)
        if not self.esmm:
            probs = torch.sigmoid(logits)  # (B, T)
            return [(name, probs[:, t], y[:, t], None) for t, name in enumerate(self.task_names)]
        p_ctr, p_ctcvr = self.predict(logits).unbind(1)  # (B,), (B,)
        clicked = y[:, 0] > 0.5  # (B,) the CVR task's population: clicked impressions
        return [("ctr", p_ctr, y[:, 0], None),
                ("cvr", torch.sigmoid(logits[clicked, 1]), y[clicked, 1], clicked),
                ("ctcvr", p_ctcvr, y[:, 0] * y[:, 1], None)]
