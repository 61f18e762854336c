"""Global metric values over a torch.distributed group (gloo on CPU, nccl on GPU).

``allreduce_metrics`` is a collective: every rank of the group calls it at the same point,
with a collection built from the same names and settings. The additive states travel as
ONE all_reduce (SUM) of ``collection.flatten()`` (float64; 16 MiB with the default AUC),
the grouped ones (GAUC, PNR) as one all_gather_object of their columns (24 bytes per
example). Every wait is bounded by the process group's timeout: pass
``timeout=`` to ``torch.distributed.init_process_group``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from recps.errors import ConfigError
from recps.metrics.collection import MetricCollection

__all__ = ["allreduce_metrics"]


def allreduce_metrics(collection: MetricCollection, group: dist.ProcessGroup | None = None) -> MetricCollection:
    """The collection merged over every rank of ``group``, as a new collection on every rank.

    The local ``collection`` is left as it was, so a worker keeps accumulating its own part
    and calls this again later without counting anything twice.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "allreduce_metrics: torch.distributed is not initialized; call init_process_group first "
            "(or merge in one process with merge_states)"
        )
    merged = collection.clone()
    flat = merged.flatten()  # (S,) float64
    if flat.numel():
        on_cpu = dist.get_backend(group) == "gloo"
        buf = flat.cpu() if on_cpu else flat
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        merged.unflatten(buf)
    local = merged.grouped_state()
    if local:
        parts: list[dict | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, {n: {k: v.cpu() for k, v in cols.items()} for n, cols in local.items()}, group=group)
        merged.load_grouped(
            {n: {k: torch.cat([p[n][k] for p in parts]) for k in cols} for n, cols in local.items()}  # type: ignore[index]
        )
    return merged
