"""MetricCollection: several metrics built from names, fed one batch at a time, merged as one.

A collection checks and converts each batch once and hands it to every member. Its
additive states pack into one float64 vector, ``flatten()`` (S,), so the whole collection
merges with ONE ``all_reduce`` (or one PS dense push) and ``unflatten`` loads the sum back.
Grouped members (GAUC, PNR) cannot be a fixed-size vector: ``grouped_state()`` returns
their columns, to be gathered and loaded back with ``load_grouped`` (see ``allreduce_metrics``).

    >>> import torch
    >>> threads = [MetricCollection(["auc", "logloss", "copc"]) for _ in range(2)]
    >>> threads[0].update(torch.tensor([0.2, 0.7]), torch.tensor([0.0, 1.0]))
    >>> threads[1].update(torch.tensor([0.6, 0.4]), torch.tensor([0.0, 1.0]))
    >>> worker = merge_states(threads)          # the union of both threads' data
    >>> worker.compute()["auc"]
    0.75
    >>> flat = worker.flatten()                 # (S,) float64: what one all_reduce sums
    >>> flat.dtype, flat.numel() == 2 * 2**20 + 2 + 2   # auc pos+neg, logloss sum+count, copc
    (torch.float64, True)
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Iterator, Mapping, Sequence, TypeVar

import torch
from torch import Tensor

from recps.errors import ConfigError, DataError
from recps.metrics.base import Metric, prepare_pointwise
from recps.metrics.grouped import PNR, GroupedAUC
from recps.metrics.pointwise import (
    AUC,
    COPC,
    MAE,
    RMSE,
    Accuracy,
    ActualCTR,
    Calibration,
    LogLoss,
    PredictedCTR,
)
from recps.metrics.retrieval import MRR, NDCGAtK, RecallAtK, _RetrievalMetric, rank_lists, rank_scores

__all__ = ["METRICS", "build_metric", "MetricCollection", "merge_states"]

#: Metric names -> classes; retrieval names take a cutoff: ``recall@50``, ``ndcg@10``, ``mrr@100``.
METRICS: dict[str, type[Metric]] = {
    "auc": AUC,
    "gauc": GroupedAUC,
    "pnr": PNR,
    "logloss": LogLoss,
    "accuracy": Accuracy,
    "mae": MAE,
    "rmse": RMSE,
    "actual_ctr": ActualCTR,
    "predicted_ctr": PredictedCTR,
    "copc": COPC,
    "calibration": Calibration,
    "recall": RecallAtK,
    "ndcg": NDCGAtK,
    "mrr": MRR,
}


def build_metric(spec: str, **kwargs: Any) -> Metric:
    """A metric from its name: ``build_metric("auc", num_buckets=4096)``, ``build_metric("recall@50")``.

    ``kwargs`` go to the class (``name=`` renames it; ``device=`` places its state).
    """
    base, at, cutoff = str(spec).partition("@")
    cls = METRICS.get(base)
    if cls is None:
        raise ConfigError(
            f"metric {spec!r}: unknown name; known: {sorted(METRICS)} (retrieval ones take a cutoff, "
            f"e.g. recall@50)"
        )
    kwargs.setdefault("name", str(spec))
    if issubclass(cls, _RetrievalMetric):
        k = None
        if at:
            if not cutoff.isdigit() or int(cutoff) < 1:
                raise ConfigError(f"metric {spec!r}: cutoff {cutoff!r} is not a positive int; write e.g. {base}@10")
            k = int(cutoff)
        return cls(k, **kwargs)
    if at:
        raise ConfigError(f"metric {spec!r}: only recall/ndcg/mrr take @K; write {base!r}")
    return cls(**kwargs)


class MetricCollection:
    """Named metrics of one kind (all pointwise or all retrieval), updated and merged together.

    Args:
        metrics: names (``["auc", "logloss", "gauc", "recall@50"]``), ``Metric`` instances, or
            a mapping name -> constructor kwargs (``{"auc": {"num_buckets": 4096}}``, as Hydra gives).
        device: where the states live (every member must agree).

    Values: ``compute() -> {name: float}``; ``details()`` adds counts (skipped groups, pairs).
    Not thread-safe: one collection per training thread, then ``merge_states``.
    """

    def __init__(
        self,
        metrics: Iterable[str | Metric] | Mapping[str, Mapping[str, Any] | None],
        *,
        device: torch.device | str = "cpu",
    ) -> None:
        if isinstance(metrics, str):
            raise ConfigError(f"MetricCollection: metrics={metrics!r} is a string; pass a list of names, e.g. [{metrics!r}]")
        self.device = torch.device(device)
        if isinstance(metrics, Mapping):
            items = [build_metric(spec, device=self.device, **dict(kw or {})) for spec, kw in metrics.items()]
        else:
            items = [m if isinstance(m, Metric) else build_metric(m, device=self.device) for m in metrics]
        if not items:
            raise ConfigError("MetricCollection: no metrics given; name at least one, e.g. ['auc', 'logloss']")
        self._metrics: dict[str, Metric] = {}
        for m in items:
            if m.name in self._metrics:
                raise ConfigError(f"MetricCollection: metric name {m.name!r} appears twice; pass name= to rename one")
            if m.device != self.device:
                raise ConfigError(f"MetricCollection: metric {m.name!r} lives on {m.device}, the collection on {self.device}")
            self._metrics[m.name] = m
        kinds = {m.kind for m in items}
        if len(kinds) > 1:
            by_kind = {k: [m.name for m in items if m.kind == k] for k in sorted(kinds)}
            raise ConfigError(
                f"MetricCollection: mixes input kinds {by_kind}; pointwise metrics read (probs, labels), "
                f"retrieval ones (scores, targets): use one collection per kind"
            )
        self.kind = kinds.pop()
        self._needs_probs = any(m.needs_probs for m in items)
        self._needs_unit_labels = any(m.needs_unit_labels for m in items)
        self._needs_groups = any(m.needs_groups for m in items)

    # ---- feeding -----------------------------------------------------------------------------

    def update(self, preds: Any, labels: Any, groups: Any = None) -> None:
        """Add a batch to every member.

        pointwise: preds (B,) probs, labels (B,), groups (B,) int64 (required with gauc/pnr);
        retrieval: preds = scores (B, C), labels = targets (B,) int64 or (B, C) relevance.
        """
        if self.kind == "retrieval":
            ranked = rank_scores(preds, labels, who=self._who(), device=self.device)
            for m in self._metrics.values():
                m._update_ranked(ranked)  # type: ignore[attr-defined]
            return
        p, y, g = prepare_pointwise(
            preds,
            labels,
            groups,
            who=self._who(),
            device=self.device,
            needs_probs=self._needs_probs,
            needs_unit_labels=self._needs_unit_labels,
            needs_groups=self._needs_groups,
        )
        if p.numel():
            for m in self._metrics.values():
                m._update(p, y, g)

    def update_ranked(self, ranked_ids: Any, target_ids: Any) -> None:
        """Retrieval only: ranked_ids (B, L) int64 best first, target_ids (B,) or (B, T) (-1 pads)."""
        if self.kind != "retrieval":
            raise DataError(f"MetricCollection {self._who()}: update_ranked is for retrieval metrics; use update(probs, labels)")
        ranked = rank_lists(ranked_ids, target_ids, who=self._who(), device=self.device)
        for m in self._metrics.values():
            m._update_ranked(ranked)  # type: ignore[attr-defined]

    # ---- values ------------------------------------------------------------------------------

    def compute(self) -> dict[str, float]:
        """``{name: value}`` in construction order; NaN where undefined (empty, one class)."""
        return {name: m.compute() for name, m in self._metrics.items()}

    def details(self) -> dict[str, float]:
        """``compute()`` plus each member's counts (``gauc.single_class_groups``, ``pnr.tied`` ...)."""
        out: dict[str, float] = {}
        for m in self._metrics.values():
            out.update(m.details())
        return out

    def reset(self) -> None:
        for m in self._metrics.values():
            m.reset()

    # ---- states and merging ------------------------------------------------------------------

    def state(self) -> dict[str, dict[str, Tensor]]:
        """``{metric name: metric.state()}`` (copies)."""
        return {name: m.state() for name, m in self._metrics.items()}

    def load_state(self, state: Mapping[str, Mapping[str, Tensor]]) -> None:
        """Replace every member's state; ``state`` as ``state()`` returns it."""
        self._check_names(state.keys(), "load_state")
        for name, m in self._metrics.items():
            m.load_state(state[name])

    def merge(self, other: "MetricCollection | Mapping[str, Mapping[str, Tensor]]") -> None:
        """Merge another part (a collection with the same names and settings, or its ``state()``)."""
        parts = other._metrics if isinstance(other, MetricCollection) else other
        self._check_names(parts.keys(), "merge")
        for name, m in self._metrics.items():
            m.merge(parts[name])

    def flatten(self) -> Tensor:
        """The additive members' states as one (S,) float64 vector (metric order, sorted keys).

        The sum of the parts' vectors is the vector of the union: all-reduce it, then ``unflatten``.
        Grouped members are not in it (see ``grouped_state``).
        """
        pieces = [m._state[k].reshape(-1) for m in self._additive() for k in sorted(m._state)]
        if not pieces:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        return torch.cat(pieces)

    @property
    def flat_size(self) -> int:
        """S, the length of ``flatten()``."""
        return sum(m._state[k].numel() for m in self._additive() for k in m._state)

    def unflatten(self, flat: Tensor) -> None:
        """Load the additive members' states from a vector laid out as ``flatten()`` (replaces them)."""
        flat = torch.as_tensor(flat)
        if flat.dim() != 1 or flat.numel() != self.flat_size:
            raise DataError(
                f"MetricCollection {self._who()}: flat state has shape {tuple(flat.shape)}, expected "
                f"({self.flat_size},); was it flattened from a collection with the same names and settings?"
            )
        flat = flat.to(self.device, torch.float64)
        offset = 0
        for m in self._additive():
            for k in sorted(m._state):
                t = m._state[k]
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def grouped_state(self) -> dict[str, dict[str, Tensor]]:
        """``{name: columns}`` of the grouped members (GAUC, PNR); {} if there are none."""
        return {name: m.state() for name, m in self._metrics.items() if not m.additive}

    def load_grouped(self, state: Mapping[str, Mapping[str, Tensor]]) -> None:
        """Replace the grouped members' columns (e.g. with the concatenation over all ranks)."""
        self._check_names(state.keys(), "load_grouped", grouped_only=True)
        for name, columns in state.items():
            self._metrics[name].load_state(columns)

    def clone(self) -> "MetricCollection":
        """An independent copy, states included."""
        return copy.deepcopy(self)

    # ---- container -----------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return list(self._metrics)

    def __getitem__(self, name: str) -> Metric:
        return self._metrics[name]

    def __contains__(self, name: object) -> bool:
        return name in self._metrics

    def __iter__(self) -> Iterator[str]:
        return iter(self._metrics)

    def __len__(self) -> int:
        return len(self._metrics)

    def __repr__(self) -> str:
        return f"MetricCollection({self.names})"

    def _additive(self) -> list[Metric]:
        return [m for m in self._metrics.values() if m.additive]

    def _who(self) -> str:
        return ",".join(self._metrics)

    def _check_names(self, names: Iterable[str], what: str, grouped_only: bool = False) -> None:
        want = {n for n, m in self._metrics.items() if not (grouped_only and m.additive)}
        got = set(names)
        if got != want:
            raise DataError(
                f"MetricCollection {self._who()}: {what} got metrics {sorted(got)}, expected {sorted(want)}; "
                f"merge only collections built from the same names"
            )


M = TypeVar("M", Metric, MetricCollection)


def merge_states(parts: Sequence[M]) -> M:
    """Merge parts (Metrics or MetricCollections built alike, e.g. one per thread) into a new one.

    The parts are left untouched; the result equals one metric updated with all their data.
    """
    parts = list(parts)
    if not parts:
        raise DataError("merge_states: got no parts; pass at least one Metric or MetricCollection")
    out = parts[0].clone()
    for part in parts[1:]:
        out.merge(part)
    return out
