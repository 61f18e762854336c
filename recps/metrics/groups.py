"""Where grouped metrics (GAUC, PNR) get each example's group: a sparse feature of the data.

``metrics.group_key`` names it (the user or query feature: ``user``; ``C1`` on the synthetic
Criteo-like data). It must hold one key per example; the key's int64 value is the group id.
Examples with no key there are left out of the grouped metrics (``has`` is False), the
other metrics still count them.

    >>> import torch
    >>> from types import SimpleNamespace
    >>> from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(keys=["user", "item"], values=torch.tensor([7, 9, 1, 2, 3]),
    ...                                           lengths=torch.tensor([1, 0, 1, 1, 1, 1]))
    >>> ids, has = batch_groups(SimpleNamespace(sparse=kjt), "user")
    >>> ids.tolist(), has.tolist()
    ([7, 0, 9], [True, False, True])
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from recps.errors import ConfigError, DataError
from recps.metrics.base import Metric, prepare_pointwise
from recps.metrics.collection import METRICS, MetricCollection

__all__ = ["batch_groups", "check_group_key", "check_evaluation_groups", "check_run_groups", "source_groups",
           "evaluate_pointwise", "update_collection", "feed_columns"]


def check_group_key(key: str | None, feature_names: Sequence[str] | None, metric_names: Sequence[str],
                    where: str = "metrics.group_key", source: str = "", data: str = "this data") -> None:
    """Before any data is read: grouped metrics named need a key the data has (ConfigError).

    ``source``: where the key's value came from (an override), shown after it; ``data``: what
    ``feature_names`` are of, as the message names it (a dataset's name).
    """
    if not metric_names:
        return
    if not key:
        raise ConfigError(
            f"{list(metric_names)} group examples by user or query; set {where} to the data's user/query "
            f"feature (e.g. {where}=user; C1 on the synthetic data)"
        )
    if feature_names is not None and key not in list(feature_names):
        shown = f"{where}={key!r}" + (f" (from {source})" if source else "")
        raise ConfigError(
            f"{shown} is not a sparse feature of {data} (it has {list(feature_names)}); "
            f"set {where} to its user or query feature ({', '.join(metric_names)} group examples by it)"
        )


def check_evaluation_groups(task_metrics: Any, metrics_cfg: Any, feature_names: Sequence[str] | None) -> None:
    """Before training: gauc / pnr among a task's evaluation metrics need ``metrics.group_key``,
    a sparse feature of the data (ConfigError naming the fix)."""
    names = [str(n) for n in (task_metrics or ())]  # a list, or a mapping's keys
    grouped = [n for n in names if not getattr(METRICS.get(n), "additive", True)]  # others' names: not ours to judge
    key = (metrics_cfg or {}).get("group_key") if metrics_cfg is not None else None
    check_group_key(key, feature_names, [f"task.metrics {n}" for n in grouped])


def check_run_groups(task_metrics: Any, metrics_cfg: Any, feature_names: Sequence[str] | None, source: str = "",
                     data: str = "this data") -> None:
    """Before any process starts (recps.config.validate_config): the grouped metrics of a run, gauc / pnr
    among the task's evaluation metrics and, with ``metrics.enabled``, among ``metrics.metrics`` (the
    training reports), need ``metrics.group_key`` to be one of the data's sparse ``feature_names``
    (None: not known before the data is read, then only a key is required). ConfigError otherwise,
    naming the key, ``source`` (where its value came from), ``data``'s features and the fix.

    >>> check_run_groups(["auc"], {"metrics": {"pnr": None}, "group_key": "user"}, ["C1", "C2"],
    ...                  data="dataset synthetic")
    Traceback (most recent call last):
    ...
    recps.errors.ConfigError: metrics.group_key='user' is not a sparse feature of dataset synthetic (it has ['C1', 'C2']); set metrics.group_key to its user or query feature (metrics.metrics pnr group examples by it)
    """
    def grouped(names: Any) -> list[str]:  # others' names (recall@20, ...): not ours to judge
        return [str(n) for n in (names or ()) if not getattr(METRICS.get(str(n)), "additive", True)]

    metrics_cfg = metrics_cfg if metrics_cfg is not None else {}
    names = [f"task.metrics {n}" for n in grouped(task_metrics)]
    if bool(metrics_cfg.get("enabled", True)):
        names += [f"metrics.metrics {n}" for n in grouped(metrics_cfg.get("metrics"))]  # a list, or a mapping's keys
    check_group_key(metrics_cfg.get("group_key"), feature_names, names, source=source, data=data)


def batch_groups(batch: Any, key: str) -> tuple[Tensor, Tensor]:
    """Each example's group id from sparse feature ``key`` of ``batch.sparse`` (a KJT).

    Returns ``(ids (B,) int64, has (B,) bool)``: the example's one key there, and whether it
    has one (an example with no key gets id 0 and has=False). Raises ``DataError`` if the
    batch lacks the feature or an example holds several keys (a sequence, not an id).
    """
    sparse = getattr(batch, "sparse", None)
    keys = list(sparse.keys()) if sparse is not None else []
    if key not in keys:
        raise DataError(
            f"grouped metrics: group_key={key!r} is not a sparse feature of this data (it has {keys}); "
            f"set metrics.group_key to its user or query feature"
        )
    jt = sparse[key]
    lengths = jt.lengths()  # (B,)
    if lengths.numel() and int(lengths.max()) > 1:
        raise DataError(
            f"grouped metrics: group_key={key!r} holds up to {int(lengths.max())} keys per example; a group "
            f"is one user or query id: set metrics.group_key to a feature with one key per example"
        )
    has = lengths == 1  # (B,)
    ids = torch.zeros(lengths.numel(), dtype=torch.int64, device=lengths.device)  # (B,)
    ids[has] = jt.values().to(torch.int64)
    return ids, has


def source_groups(source: Any, batch_size: int, key: str) -> tuple[Tensor, Tensor]:
    """``batch_groups`` over one pass of ``source`` (``batches(batch_size, 0, 1, 0)``, the order
    evaluation predicts in): ids (N,) int64, has (N,) bool."""
    ids, has = [], []
    for batch in source.batches(batch_size, 0, 1, 0):
        i, h = batch_groups(batch, key)
        ids.append(i)
        has.append(h)
    if not ids:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool)
    return torch.cat(ids), torch.cat(has)


def evaluate_pointwise(metrics: Any, probs: Tensor, targets: Tensor, source: Any = None, batch_size: int = 0,
                       group_key: str | None = None) -> dict[str, float]:
    """Pointwise metric values over predictions of one pass of ``source`` (evaluation).

    metrics: names or name -> kwargs (``MetricCollection``); the rest as ``update_collection``.
    """
    collection = MetricCollection(metrics)
    update_collection(collection, probs, targets, source, batch_size, group_key)
    return {name: float(value) for name, value in collection.compute().items()}


def update_collection(collection: MetricCollection, probs: Tensor, targets: Tensor, source: Any = None,
                      batch_size: int = 0, group_key: str | None = None) -> None:
    """``collection.update(probs, targets)``, with group ids for its gauc / pnr members.

    probs, targets (N,) in the order ``source.batches(batch_size, 0, 1, 0)`` yields them. With
    grouped members, the ids come from ``source``'s sparse feature ``group_key``
    (``source_groups``: one more pass over the source, no model); examples without a key there
    are left out of those members only.
    """
    grouped = [n for n in collection if not collection[n].additive]
    if not grouped:
        collection.update(probs, targets)
        return
    check_group_key(group_key, None, grouped)
    if source is None:
        raise ConfigError(f"update_collection: {grouped} need the evaluated source (for its {group_key!r} ids)")
    ids, has = source_groups(source, batch_size, str(group_key))  # (N,), (N,)
    members = [collection[n] for n in collection]
    p, y, g = prepare_pointwise(probs, targets, ids, who="evaluation", device=collection.device,
                                needs_probs=any(m.needs_probs for m in members),
                                needs_unit_labels=any(m.needs_unit_labels for m in members))
    feed_columns(members, p, y, g, has.to(p.device))


def feed_columns(members: Sequence[Metric], p: Tensor, y: Tensor, g: Tensor | None, has: Tensor | None) -> None:
    """One checked column (``prepare_pointwise``'s p, y, g) to every member: the additive ones
    get every row, the grouped ones only the rows with a group id (``has``)."""
    if not p.numel():
        return
    kept = None
    for m in members:
        if m.additive:
            m._update(p, y, None)
            continue
        if kept is None:
            kept = (p[has], y[has], g[has])
        if kept[0].numel():
            m._update(*kept)
