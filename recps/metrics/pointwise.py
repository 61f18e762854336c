"""Pointwise CTR metrics with additive states: AUC, logloss, accuracy, MAE, RMSE, CTRs, COPC,
calibration.

Every state here is a few float64 tensors whose sum over parts is the state of the union;
``update`` costs a handful of vectorized tensor ops per batch (no Python loop per example).

Inputs: ``update(probs (B,), labels (B,))``; probs in [0, 1] (after the sigmoid), labels
in [0, 1] (0/1 clicks; a soft label y counts as y of a positive and 1 - y of a negative).
MAE and RMSE also accept any real preds and labels (regression targets).

    >>> import torch
    >>> auc = AUC(num_buckets=1024)
    >>> auc.update(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
    >>> auc.compute()
    0.75
    >>> part = AUC(num_buckets=1024)
    >>> part.update(torch.tensor([0.9]), torch.tensor([0.0]))
    >>> auc.merge(part)  # states add up: the AUC of the five examples
    >>> round(auc.compute(), 4)
    0.5
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from recps.errors import ConfigError
from recps.metrics.base import Metric, State

__all__ = [
    "histogram_auc",
    "AUC",
    "LogLoss",
    "Accuracy",
    "MAE",
    "RMSE",
    "ActualCTR",
    "PredictedCTR",
    "COPC",
    "Calibration",
]


def _scalar() -> Tensor:
    return torch.zeros((), dtype=torch.float64)


def _ratio(num: Tensor | float, den: Tensor | float) -> float:
    """num / den as a float, NaN when den is 0 (the documented 'undefined')."""
    num, den = float(num), float(den)
    return num / den if den != 0.0 else math.nan


def histogram_auc(pos: Tensor, neg: Tensor) -> float:
    """AUC from label mass per ascending score bucket: pos (NB,), neg (NB,) float64.

    A (positive, negative) pair counts 1 when the positive's bucket is higher, 1/2 when they
    share a bucket (sklearn's roc_auc_score counts tied scores 1/2 too). NaN if a class is empty.
    """
    n_pos, n_neg = pos.sum(), neg.sum()
    if float(n_pos) == 0.0 or float(n_neg) == 0.0:
        return math.nan
    pos_above = n_pos - torch.cumsum(pos, 0)  # (NB,) positives in strictly higher buckets
    wins = (neg * (pos_above + 0.5 * pos)).sum()
    return float(wins / (n_pos * n_neg))


class AUC(Metric):
    """Area under the ROC curve from a histogram of predicted probabilities.

    State: ``pos`` (NB,), ``neg`` (NB,) float64: label mass per probability bucket
    [b/NB, (b+1)/NB) (1.0 goes to the last). Pairs inside one bucket count 1/2, so exact
    ties are handled as sklearn does, and the error against the exact AUC is at most half
    the fraction of (pos, neg) pairs that share a bucket without tying: about 1/(2 S) when
    the probs spread over S buckets (S = 2^20 * the width of their range; 16 MiB of state
    with the default NB = 2^20: lower NB to all-reduce less, at that cost in accuracy).
    """

    default_name = "auc"

    def __init__(
        self,
        num_buckets: int = 1 << 20,
        *,
        name: str | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or num_buckets < 2:
            raise ConfigError(f"AUC: num_buckets={num_buckets!r}; use an int >= 2 (default 2**20)")
        self.num_buckets = num_buckets
        super().__init__(name=name, device=device)

    def _zero_state(self) -> State:
        nb = self.num_buckets
        return {"pos": torch.zeros(nb, dtype=torch.float64), "neg": torch.zeros(nb, dtype=torch.float64)}

    def _update(self, p: Tensor, y: Tensor, g: Tensor | None) -> None:
        b = (p * self.num_buckets).long().clamp_(max=self.num_buckets - 1)  # (B,) bucket ids
        self._state["pos"].index_add_(0, b, y)
        self._state["neg"].index_add_(0, b, 1.0 - y)

    def compute(self) -> float:
        return histogram_auc(self._state["pos"], self._state["neg"])

    def details(self) -> dict[str, float]:
        return {
            self.name: self.compute(),
            f"{self.name}.positives": float(self._state["pos"].sum()),
            f"{self.name}.negatives": float(self._state["neg"].sum()),
        }


class _SumCount(Metric):
    """A mean of a per-example quantity: state ``sum`` and ``count``, 0-d float64."""

    def _zero_state(self) -> State:
        return {"sum": _scalar(), "count": _scalar()}

    def _per_example(self, p: Tensor, y: Tensor) -> Tensor:
        raise NotImplementedError

    def _update(self, p: Tensor, y: Tensor, g: Tensor | None) -> None:
        self._state["sum"] += self._per_example(p, y).sum()
        self._state["count"] += p.numel()

    def compute(self) -> float:
        return _ratio(self._state["sum"], self._state["count"])

    def details(self) -> dict[str, float]:
        return {self.name: self.compute(), f"{self.name}.count": float(self._state["count"])}


class LogLoss(_SumCount):
    """Mean binary cross-entropy of probs against labels, natural log.

    Probs are clipped to [eps, 1 - eps] (default eps 1e-7, as most CTR code) so that a
    confident wrong 0/1 costs -log(eps) instead of inf. NaN on no examples.
    """

    default_name = "logloss"

    def __init__(self, eps: float = 1e-7, *, name: str | None = None, device: torch.device | str = "cpu") -> None:
        if not 0.0 < eps < 0.5:
            raise ConfigError(f"LogLoss: eps={eps!r}; use a small positive float such as 1e-7")
        self.eps = float(eps)
        super().__init__(name=name, device=device)

    def _per_example(self, p: Tensor, y: Tensor) -> Tensor:
        p = p.clamp(self.eps, 1.0 - self.eps)  # (B,)
        # xlogy, not torch.log: log goes to MKL's threaded vector math, whose fork/join on a
        # busy machine costs milliseconds for a 512-row batch; xlogy stays on this thread.
        return -(torch.special.xlogy(y, p) + torch.special.xlogy(1.0 - y, 1.0 - p))


class Accuracy(_SumCount):
    """Fraction of examples where (prob > threshold) equals (label > 0.5); threshold 0.5.

    Strict '>' as Paddle's two-class argmax: a prob of exactly 0.5 predicts the negative.
    """

    default_name = "accuracy"

    def __init__(self, threshold: float = 0.5, *, name: str | None = None, device: torch.device | str = "cpu") -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"Accuracy: threshold={threshold!r}; use a probability in [0, 1]")
        self.threshold = float(threshold)
        super().__init__(name=name, device=device)

    def _per_example(self, p: Tensor, y: Tensor) -> Tensor:
        return ((p > self.threshold) == (y > 0.5)).to(torch.float64)


class MAE(_SumCount):
    """Mean absolute error |pred - label|; any real preds and labels."""

    default_name = "mae"
    needs_probs = False
    needs_unit_labels = False

    def _per_example(self, p: Tensor, y: Tensor) -> Tensor:
        return (p - y).abs()


class RMSE(_SumCount):
    """Root mean squared error sqrt(mean((pred - label)^2)); any real preds and labels.

    The state is the sum of squares and the count (the root is taken in ``compute``), so
    merged RMSE is the RMSE of the union, not a mean of RMSEs.
    """

    default_name = "rmse"
    needs_probs = False
    needs_unit_labels = False

    def _per_example(self, p: Tensor, y: Tensor) -> Tensor:
        return (p - y).square()

    def compute(self) -> float:
        return math.sqrt(super().compute())


class ActualCTR(_SumCount):
    """Mean label (clicks / impressions); preds are not read."""

    default_name = "actual_ctr"
    needs_probs = False

    def _per_example(self, p: Tensor, y: Tensor) -> Tensor:
        return y


class PredictedCTR(_SumCount):
    """Mean predicted probability."""

    default_name = "predicted_ctr"

    def _per_example(self, p: Tensor, y: Tensor) -> Tensor:
        return p


class COPC(Metric):
    """Clicks over predicted clicks: sum(labels) / sum(probs); 1.0 is calibrated on average.

    State: ``clicks``, ``predicted`` (0-d float64). NaN when nothing was predicted.
    """

    default_name = "copc"

    def _zero_state(self) -> State:
        return {"clicks": _scalar(), "predicted": _scalar()}

    def _update(self, p: Tensor, y: Tensor, g: Tensor | None) -> None:
        self._state["clicks"] += y.sum()
        self._state["predicted"] += p.sum()

    def compute(self) -> float:
        return _ratio(self._state["clicks"], self._state["predicted"])


class Calibration(Metric):
    """Calibration by probability buckets; ``compute()`` is the expected calibration error.

    Buckets are [e_b, e_{b+1}) over ``edges`` (NB + 1,) ascending from 0 to 1; 1.0 falls in the
    last bucket. Default: NB = 10 equal widths, bucket = floor(prob * NB); pass ``edges``
    (e.g. log-spaced) for low CTRs.
    State: ``count``, ``pred_sum``, ``label_sum`` (NB,) float64.

    ``compute()`` = sum_b count_b / N * |mean_pred_b - mean_label_b| (ECE; NaN when empty);
    ``table()`` gives the per-bucket means for a reliability plot.
    """

    default_name = "calibration"

    def __init__(
        self,
        num_buckets: int = 10,
        edges: Tensor | list[float] | None = None,
        *,
        name: str | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self._equal_width = edges is None
        if edges is None:
            if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or num_buckets < 1:
                raise ConfigError(f"Calibration: num_buckets={num_buckets!r}; use an int >= 1")
            e = torch.linspace(0.0, 1.0, num_buckets + 1, dtype=torch.float64)
        else:
            e = torch.as_tensor(edges, dtype=torch.float64).reshape(-1)
            if e.numel() < 2 or float(e[0]) != 0.0 or float(e[-1]) != 1.0 or not bool((e[1:] > e[:-1]).all()):
                raise ConfigError(
                    f"Calibration: edges={e.tolist()}; give >= 2 strictly increasing edges from 0.0 to 1.0"
                )
        self.edges = e
        self.num_buckets = e.numel() - 1
        super().__init__(name=name, device=device)
        self._inner = e[1:-1].to(self.device)  # (NB - 1,) boundaries between buckets

    def _zero_state(self) -> State:
        nb = self.num_buckets
        return {k: torch.zeros(nb, dtype=torch.float64) for k in ("count", "pred_sum", "label_sum")}

    def _update(self, p: Tensor, y: Tensor, g: Tensor | None) -> None:
        # Arithmetic or one broadcast compare, not torch.bucketize: it forks threads for a few
        # hundred rows, which costs milliseconds on a busy machine.
        if self._equal_width:
            b = (p * self.num_buckets).long().clamp_(max=self.num_buckets - 1)  # (B,)
        else:
            b = (p[:, None] >= self._inner[None, :]).sum(1)  # (B,) inner[b-1] <= p < inner[b]
        self._state["count"].index_add_(0, b, torch.ones_like(p))
        self._state["pred_sum"].index_add_(0, b, p)
        self._state["label_sum"].index_add_(0, b, y)

    def table(self) -> dict[str, list[float]]:
        """Per bucket: lower/upper edge, count, mean prob, mean label (NaN where empty)."""
        count = self._state["count"]
        safe = count.clamp(min=1.0)
        empty = count == 0
        mean_pred = torch.where(empty, math.nan, self._state["pred_sum"] / safe)
        mean_label = torch.where(empty, math.nan, self._state["label_sum"] / safe)
        return {
            "lower": self.edges[:-1].tolist(),
            "upper": self.edges[1:].tolist(),
            "count": count.tolist(),
            "mean_pred": mean_pred.tolist(),
            "mean_label": mean_label.tolist(),
        }

    def compute(self) -> float:
        n = float(self._state["count"].sum())
        if n == 0.0:
            return math.nan
        gap = (self._state["pred_sum"] - self._state["label_sum"]).abs()  # (NB,) count * |mean gap|
        return float(gap.sum()) / n

    def details(self) -> dict[str, float]:
        count = self._state["count"]
        gap = (self._state["pred_sum"] - self._state["label_sum"]).abs() / count.clamp(min=1.0)
        filled = count > 0
        max_gap = float(gap[filled].max()) if bool(filled.any()) else math.nan
        return {self.name: self.compute(), f"{self.name}.max_gap": max_gap}
