"""Global metric values over a torch.distributed group (gloo on CPU, nccl on GPU).

``allreduce_metrics`` is a collective: every rank of the group calls it at the same point,
with a collection built from the same names and settings. The additive states travel as
ONE all_reduce (SUM) of ``collection.flatten()`` (float64; 16 MiB with the default AUC),
the grouped ones (GAUC, PNR) as raw tensors: one all_gather of a 2-number header (the
layout's fingerprint, the rank's length), then one all_gather of every rank's columns packed
as int64 words (24 bytes per example, padded to the longest rank). Nothing is pickled: a
peer's bytes are only ever read as numbers. Every wait is bounded by the process group's
timeout: pass ``timeout=`` to ``torch.distributed.init_process_group``.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from recps.errors import ConfigError
from recps.metrics.collection import MetricCollection

__all__ = ["allreduce_metrics"]

Columns = dict[str, dict[str, torch.Tensor]]  # metric name -> column name -> (N,) tensor


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
    on_cpu = dist.get_backend(group) == "gloo"
    flat = merged.flatten()  # (S,) float64
    if flat.numel():
        buf = flat.cpu() if on_cpu else flat
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        merged.unflatten(buf)
    local = merged.grouped_state()
    if local:
        merged.load_grouped(_gather_columns(local, group, on_cpu))
    return merged


def _gather_columns(local: Columns, group: dist.ProcessGroup | None, on_cpu: bool) -> Columns:
    """Every rank's columns, concatenated in rank order (each (sum of N over ranks,)), on every rank.

    Wire layout of one rank (int64 words): the row count N_m of each of the M grouped metrics,
    then each metric's columns in order, N_m words each (float64 values as their bit patterns)."""
    names = list(local)
    layout = [(n, k, local[n][k].dtype) for n in names for k in local[n]]
    for n, k, dtype in layout:
        if dtype not in (torch.int64, torch.float64):
            raise ConfigError(f"allreduce_metrics: metric {n} column {k} is {dtype}; grouped columns travel as "
                              "int64 or float64, convert it in the metric's state()")
    device = torch.device("cpu") if on_cpu else next(iter(local[names[0]].values())).device
    counts = torch.tensor([_rows(local[n], n) for n in names], dtype=torch.int64)  # (M,)
    words = torch.cat([counts.to(device)] + [local[n][k].detach().to(device).contiguous().view(torch.int64)
                                             for n, k, _ in layout])  # (M + sum_m N_m * C_m,)
    world = dist.get_world_size(group)
    header = torch.tensor([_fingerprint(layout), words.numel()], dtype=torch.int64, device=device)  # (2,)
    headers = [torch.empty_like(header) for _ in range(world)]
    dist.all_gather(headers, header, group=group)
    prints = [int(h[0]) for h in headers]
    if len(set(prints)) != 1:
        differ = [r for r, p in enumerate(prints) if p != prints[dist.get_rank(group)]]
        raise ConfigError(f"allreduce_metrics: ranks {differ} hold other grouped metrics than rank "
                          f"{dist.get_rank(group)} ({[n for n in names]}: columns {[(n, k) for n, k, _ in layout]}); "
                          "build every rank's collection from the same metric names")
    longest = max(int(h[1]) for h in headers)
    padded = torch.zeros(longest, dtype=torch.int64, device=device)
    padded[: words.numel()] = words
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    pieces: dict[tuple[str, str], list[torch.Tensor]] = {(n, k): [] for n, k, _ in layout}
    for part in parts:  # one rank's words
        rows = part[: len(names)].tolist()
        at = len(names)
        for n, k, dtype in layout:
            size = rows[names.index(n)]
            pieces[(n, k)].append(part[at: at + size].view(dtype))
            at += size
    return {n: {k: torch.cat(pieces[(n, k)]) for k in local[n]} for n in names}


def _rows(columns: dict[str, torch.Tensor], name: str) -> int:
    sizes = {k: int(v.numel()) for k, v in columns.items()}
    if len(set(sizes.values())) != 1:
        raise ConfigError(f"allreduce_metrics: metric {name} has columns of different lengths {sizes}")
    return next(iter(sizes.values()))


def _fingerprint(layout: list[tuple[str, str, torch.dtype]]) -> int:
    """A signed 64-bit digest of the grouped layout (names, columns, dtypes), equal on every rank
    that built the same collection (hashlib: Python's hash() differs between processes)."""
    text = ";".join(f"{n}.{k}:{dtype}" for n, k, dtype in layout).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little", signed=True)
