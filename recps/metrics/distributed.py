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

__all__ = ["allreduce_metrics", "column_layout", "pack_columns", "unpack_columns", "layout_fingerprint"]

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
    """Every rank's columns, concatenated in rank order (each (sum of N over ranks,)), on every rank."""
    layout = column_layout(local)
    device = torch.device("cpu") if on_cpu else next(iter(next(iter(local.values())).values())).device
    words = pack_columns(local, layout).to(device)  # (M + sum_m N_m * C_m,)
    world = dist.get_world_size(group)
    header = torch.tensor([layout_fingerprint(layout), words.numel()], dtype=torch.int64, device=device)  # (2,)
    headers = [torch.empty_like(header) for _ in range(world)]
    dist.all_gather(headers, header, group=group)
    prints = [int(h[0]) for h in headers]
    if len(set(prints)) != 1:
        differ = [r for r, p in enumerate(prints) if p != prints[dist.get_rank(group)]]
        raise ConfigError(f"allreduce_metrics: ranks {differ} hold other grouped metrics than rank "
                          f"{dist.get_rank(group)} (columns {[(n, k) for n, k, _ in layout]}); "
                          "build every rank's collection from the same metric names")
    longest = max(int(h[1]) for h in headers)
    padded = torch.zeros(longest, dtype=torch.int64, device=device)
    padded[: words.numel()] = words
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return unpack_columns(parts, layout)


Layout = list[tuple[str, str, torch.dtype]]  # (metric name, column name, dtype) in wire order


def column_layout(local: Columns) -> Layout:
    """The wire order of grouped columns: metrics in collection order, columns in state order."""
    layout = [(n, k, local[n][k].dtype) for n in local for k in local[n]]
    for n, k, dtype in layout:
        if dtype not in (torch.int64, torch.float64):
            raise ConfigError(f"grouped metric {n} column {k} is {dtype}; grouped columns travel as "
                              "int64 or float64, convert it in the metric's state()")
    return layout


def pack_columns(local: Columns, layout: Layout) -> torch.Tensor:
    """One rank's grouped columns as int64 words (float64 as their bit patterns, exact):
    the row count N_m of each of the M metrics, then each metric's columns in ``layout`` order."""
    names = list(dict.fromkeys(n for n, _, _ in layout))
    counts = torch.tensor([_rows(local[n], n) for n in names], dtype=torch.int64)  # (M,)
    device = counts.device
    return torch.cat([counts] + [local[n][k].detach().to(device).contiguous().view(torch.int64)
                                 for n, k, _ in layout])


def unpack_columns(parts: list[torch.Tensor], layout: Layout) -> Columns:
    """The inverse of ``pack_columns`` over ranks: ``parts`` (each rank's words, maybe padded
    at the end) -> every column concatenated in rank order."""
    names = list(dict.fromkeys(n for n, _, _ in layout))
    pieces: dict[tuple[str, str], list[torch.Tensor]] = {(n, k): [] for n, k, _ in layout}
    for part in parts:  # one rank's words
        rows = part[: len(names)].tolist()
        at = len(names)
        for n, k, dtype in layout:
            size = rows[names.index(n)]
            pieces[(n, k)].append(part[at: at + size].view(dtype))
            at += size
    return {n: {k: torch.cat(pieces[(n, k)]) for m, k, _ in layout if m == n} for n in names}


def _rows(columns: dict[str, torch.Tensor], name: str) -> int:
    sizes = {k: int(v.numel()) for k, v in columns.items()}
    if len(set(sizes.values())) != 1:
        raise ConfigError(f"allreduce_metrics: metric {name} has columns of different lengths {sizes}")
    return next(iter(sizes.values()))


def layout_fingerprint(layout: list[tuple[str, str, torch.dtype]]) -> int:
    """A signed 64-bit digest of the grouped layout (names, columns, dtypes), equal on every rank
    that built the same collection (hashlib: Python's hash() differs between processes)."""
    text = ";".join(f"{n}.{k}:{dtype}" for n, k, dtype in layout).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little", signed=True)
