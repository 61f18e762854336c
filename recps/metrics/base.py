"""The metric protocol: states that add up (or concatenate) and therefore merge.

A metric keeps all it knows in ``state()``, a ``dict[str, Tensor]`` of float64/int64 tensors,
so that the metric of the union of two data sets is computed from a merge of their states:

- **additive** metrics (``additive = True``: AUC, logloss, accuracy, MAE, RMSE, CTRs, COPC,
  calibration, retrieval): fixed-shape float64 tensors, and merge = elementwise sum. Any
  transport that can add merges them: a PS dense push, or one ``torch.distributed.all_reduce``
  of ``MetricCollection.flatten()``.
- **grouped** metrics (``additive = False``: GAUC, PNR): per-example columns of shape (N,),
  and merge = concatenation (a group's examples may sit on several workers, so nothing
  smaller is exact). Merge by gathering the raw columns (one ``all_gather``, no pickle), see ``allreduce_metrics``.

Input conventions (shape letters as in DESIGN.md; inputs of any shape are flattened):

    pointwise:  update(preds (B,), labels (B,), groups (B,) int64 or None)
                preds are ``probs`` (after the sigmoid) for the CTR metrics
    retrieval:  update(scores (B, C), targets (B,) int64 index | (B, C) relevance)
                update_ranked(ranked_ids (B, L) int64, target_ids (B,) | (B, T) int64, -1 pads)

Undefined values (no examples; one class only; 0/0) compute to NaN and never raise: a
periodic metric over an empty window must not kill training. Malformed input (shapes that
disagree, probabilities outside [0, 1], NaN) raises ``DataError`` naming the metric.

Metrics are not thread-safe: give each training thread its own and merge them with
``merge_states``.
"""

from __future__ import annotations

import copy
import math
from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from recps.errors import DataError

__all__ = ["Metric", "GroupedMetric", "prepare_pointwise"]

State = dict[str, Tensor]


def _column(x: Any, what: str, who: str, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Any array-like -> a flat detached tensor of ``dtype`` on ``device``; (B, ...) -> (B*...,)."""
    t = x if isinstance(x, Tensor) else torch.as_tensor(x)
    if dtype == torch.int64 and (t.dtype.is_floating_point or t.dtype.is_complex):
        raise DataError(
            f"metric {who}: {what} has dtype {t.dtype}; group ids must be integers "
            f"(hash string user/query ids to int64 first)"
        )
    return t.detach().reshape(-1).to(device=device, dtype=dtype)


def prepare_pointwise(
    preds: Any,
    labels: Any,
    groups: Any = None,
    *,
    who: str,
    device: torch.device | str = "cpu",
    needs_probs: bool = False,
    needs_unit_labels: bool = False,
    needs_groups: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Check and convert one pointwise batch once, for every metric that reads it.

    Returns ``(preds (B,) float64, labels (B,) float64, groups (B,) int64 | None)`` on ``device``.
    Raises ``DataError`` when the sizes disagree, values are NaN/inf, probabilities leave
    [0, 1] (``needs_probs``), labels leave [0, 1] (``needs_unit_labels``) or groups are
    missing (``needs_groups``).
    """
    device = torch.device(device)
    p = _column(preds, "preds", who, device, torch.float64)  # (B,)
    y = _column(labels, "labels", who, device, torch.float64)  # (B,)
    if p.numel() != y.numel():
        raise DataError(
            f"metric {who}: preds has {p.numel()} values but labels has {y.numel()}; pass one "
            f"prediction per label (use one collection per task for (B, T) labels)"
        )
    g = None
    if groups is not None:
        g = _column(groups, "groups", who, device, torch.int64)  # (B,)
        if g.numel() != p.numel():
            raise DataError(
                f"metric {who}: groups has {g.numel()} ids but preds has {p.numel()} values; "
                f"pass one user/query id per example"
            )
    elif needs_groups:
        raise DataError(
            f"metric {who}: needs groups= (one user or query id per example) in update(); "
            f"none was given"
        )
    if p.numel() == 0:
        return p, y, g
    # One reduction per column: aminmax propagates NaN, which then fails every comparison.
    lo, hi = (float(v) for v in torch.aminmax(p))
    if math.isnan(lo) or math.isnan(hi):
        raise DataError(f"metric {who}: preds contain NaN; check the model's outputs (logits overflow, bad inputs)")
    if needs_probs:
        if not (lo >= 0.0 and hi <= 1.0):
            raise DataError(
                f"metric {who}: preds span [{lo}, {hi}] but this metric needs probabilities in "
                f"[0, 1]; pass probs = sigmoid(logits), not logits"
            )
    elif not (math.isfinite(lo) and math.isfinite(hi)):
        raise DataError(f"metric {who}: preds contain inf (range [{lo}, {hi}])")
    lo, hi = (float(v) for v in torch.aminmax(y))
    if math.isnan(lo) or math.isnan(hi):
        raise DataError(f"metric {who}: labels contain NaN; check the reader's label columns")
    if needs_unit_labels:
        if not (lo >= 0.0 and hi <= 1.0):
            raise DataError(
                f"metric {who}: labels span [{lo}, {hi}] but this metric needs labels in [0, 1] "
                f"(clicks as 0/1; soft labels count as that fraction of a positive)"
            )
    elif not (math.isfinite(lo) and math.isfinite(hi)):
        raise DataError(f"metric {who}: labels contain inf (range [{lo}, {hi}])")
    return p, y, g


class Metric:
    """Base of every metric: an additive state of fixed-shape float64 tensors.

    Subclasses define ``_zero_state()``, ``_update(p, y, g)`` and ``compute()``; everything
    about merging is here. ``name`` is the key under which a collection reports the value.

    Class attributes say what the metric reads, so a collection checks a batch once:
    ``kind`` ("pointwise" | "retrieval"), ``needs_probs``, ``needs_unit_labels``,
    ``needs_groups``, and ``additive`` (False: see ``GroupedMetric``).
    """

    kind: ClassVar[str] = "pointwise"
    additive: ClassVar[bool] = True
    needs_probs: ClassVar[bool] = True
    needs_unit_labels: ClassVar[bool] = True
    needs_groups: ClassVar[bool] = False
    default_name: ClassVar[str] = "metric"

    def __init__(self, *, name: str | None = None, device: torch.device | str = "cpu") -> None:
        self.name = name or self.default_name
        self.device = torch.device(device)
        self.reset()

    # ---- what subclasses write -------------------------------------------------------------

    def _zero_state(self) -> State:
        raise NotImplementedError

    def _update(self, p: Tensor, y: Tensor, g: Tensor | None) -> None:
        """Add one checked, non-empty batch: p (B,) f64, y (B,) f64, g (B,) int64 or None."""
        raise NotImplementedError

    def compute(self) -> float:
        """The metric's value over everything updated and merged so far (NaN if undefined)."""
        raise NotImplementedError

    def details(self) -> dict[str, float]:
        """``{name: value}`` plus whatever counts explain it (skipped groups, pair counts)."""
        return {self.name: self.compute()}

    # ---- the common API ----------------------------------------------------------------------

    def update(self, preds: Any, labels: Any, groups: Any = None) -> None:
        """Add a batch: preds (B,), labels (B,), groups (B,) int64 ids or None. Empty is a no-op."""
        p, y, g = prepare_pointwise(
            preds,
            labels,
            groups,
            who=self.name,
            device=self.device,
            needs_probs=self.needs_probs,
            needs_unit_labels=self.needs_unit_labels,
            needs_groups=self.needs_groups,
        )
        if p.numel():
            self._update(p, y, g)

    def reset(self) -> None:
        """Forget everything: the state of the empty data set."""
        self._state = {k: v.to(self.device) for k, v in self._zero_state().items()}

    def state(self) -> State:
        """A copy of the state: ``{key: float64 tensor}``, fixed shapes, merge = sum."""
        return {k: v.clone() for k, v in self._state.items()}

    def load_state(self, state: Mapping[str, Tensor]) -> None:
        """Replace the state with ``state`` (keys and shapes as ``state()`` returns them)."""
        self._check_state(state)
        for k, v in state.items():
            self._state[k].copy_(v)

    def merge(self, other: "Metric | Mapping[str, Tensor]") -> None:
        """Add another part's state (a Metric of the same kind, or its ``state()``) into this one."""
        state = self._other_state(other)
        self._check_state(state)
        for k, v in state.items():
            self._state[k] += v.to(self._state[k].device)

    def clone(self) -> "Metric":
        """An independent copy, state included."""
        return copy.deepcopy(self)

    # ---- helpers -----------------------------------------------------------------------------

    def _check_same_type(self, other: "Metric") -> None:
        if type(other) is not type(self):
            raise DataError(
                f"metric {self.name}: cannot merge a {type(other).__name__} into a "
                f"{type(self).__name__}; merge parts built from the same metric names"
            )

    def _other_state(self, other: "Metric | Mapping[str, Tensor]") -> Mapping[str, Tensor]:
        if isinstance(other, Metric):
            self._check_same_type(other)
            return other._state
        return other

    def _check_state(self, state: Mapping[str, Tensor]) -> None:
        if set(state) != set(self._state):
            raise DataError(
                f"metric {self.name}: state has keys {sorted(state)}, expected "
                f"{sorted(self._state)}; merge only states of the same metric"
            )
        for k, v in state.items():
            if tuple(v.shape) != tuple(self._state[k].shape):
                raise DataError(
                    f"metric {self.name}: state[{k!r}] has shape {tuple(v.shape)}, expected "
                    f"{tuple(self._state[k].shape)}; were the parts built with the same "
                    f"settings (e.g. num_buckets)?"
                )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class GroupedMetric(Metric):
    """A metric whose state is per-example columns (N,), merged by concatenation.

    State keys: ``groups`` (N,) int64 user/query ids, ``preds`` (N,) float64, ``labels`` (N,)
    float64. It grows by 24 bytes per example until ``reset()``: meant for evaluation windows
    (a pass, a day), like Paddle's offline GAUC/PNR scripts, not for unbounded streams.
    """

    additive: ClassVar[bool] = False
    needs_groups: ClassVar[bool] = True
    _columns: ClassVar[tuple[str, ...]] = ("groups", "preds", "labels")

    def reset(self) -> None:
        self._parts: list[State] = []

    def _update(self, p: Tensor, y: Tensor, g: Tensor | None) -> None:
        # Clone: p/y may alias the caller's float64 tensors, which it may overwrite later.
        self._parts.append({"groups": g.clone(), "preds": p.clone(), "labels": y.clone()})

    def _columns_now(self) -> State:
        """All rows so far as one part (and compact the list to that part)."""
        if not self._parts:
            return {
                "groups": torch.zeros(0, dtype=torch.int64, device=self.device),
                "preds": torch.zeros(0, dtype=torch.float64, device=self.device),
                "labels": torch.zeros(0, dtype=torch.float64, device=self.device),
            }
        if len(self._parts) > 1:
            self._parts = [{k: torch.cat([part[k] for part in self._parts]) for k in self._columns}]
        return self._parts[0]

    def state(self) -> State:
        """A copy of the columns: ``groups`` (N,) int64, ``preds`` (N,) f64, ``labels`` (N,) f64."""
        return {k: v.clone() for k, v in self._columns_now().items()}

    def load_state(self, state: Mapping[str, Tensor]) -> None:
        self._check_state(state)
        self._parts = [self._as_part(state)]

    def merge(self, other: "Metric | Mapping[str, Tensor]") -> None:
        """Append another part's rows (a Metric of the same kind, or its ``state()``)."""
        if isinstance(other, Metric):
            self._check_same_type(other)
            state = other._columns_now()
        else:
            state = other
        self._check_state(state)
        self._parts.append(self._as_part(state))

    def _as_part(self, state: Mapping[str, Tensor]) -> State:
        dtypes = {"groups": torch.int64, "preds": torch.float64, "labels": torch.float64}
        return {k: state[k].detach().to(self.device, dtypes[k]).clone() for k in self._columns}

    def _check_state(self, state: Mapping[str, Tensor]) -> None:
        if set(state) != set(self._columns):
            raise DataError(
                f"metric {self.name}: state has keys {sorted(state)}, expected "
                f"{sorted(self._columns)}; merge only states of the same metric"
            )
        sizes = {k: tuple(v.shape) for k, v in state.items()}
        if len(set(sizes.values())) != 1 or len(next(iter(sizes.values()))) != 1:
            raise DataError(f"metric {self.name}: state columns must be 1-D of one length, got {sizes}")
