"""PSMerger: sums metric states over workers through the parameter servers' dense tables.

Dense tables hold float32 and add in float32, and metric states are float64 sums (AUC
bucket counts past 2^24, logloss sums); adding them on the server would round. So the
server only carries them: each worker owns its tables, every value x travels as two
float32 numbers hi = fl32(x), lo = fl32(x - hi) (x = hi + lo to about 2^-48 relative),
and the readers add in float64.

One round (``all_min`` or ``merge``; every worker makes the same rounds in the same order):

    worker w:  push_dense        <prefix>.<kind>.w<w>.b<u%2>  += [hi | lo]   (the table is 0:
                                                                              0 + x is exact)
               barrier <prefix>.<round>                  every worker wrote round u
               pull_dense the W tables of round u, decode, reduce (min or sum) in float64
               push_dense       -[hi | lo] of round u-1  zero the other buffer again (x - x is
                                                         exact); everyone has read it: they
                                                         passed this barrier after that round

The tables are GEO-mode tables: their server half adds what arrives (recps.ps.modes.geo).
Two buffers per kind, used in turn, so a worker may write round u+1 while a slower one
still reads round u. Tables: 2 kinds x 2 buffers per worker, 2 x (S + 4) float32 values
each for a collection of S state values (about 16 MiB per buffer with the default AUC).
Every wait is bounded by the client's timeout (barriers by ``timeout_s``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from recps.errors import ConfigError, DataError
from recps.metrics.collection import MetricCollection

__all__ = ["PSMerger", "split_float64", "join_float64"]


def split_float64(x: Tensor) -> Tensor:
    """(n,) float64 -> (2n,) float32 [hi | lo] with hi + lo == x to ~2^-48 relative."""
    hi = x.to(torch.float32)  # (n,)
    lo = (x - hi.to(torch.float64)).to(torch.float32)  # (n,)
    return torch.cat([hi, lo])


def join_float64(v: Tensor) -> Tensor:
    """(2n,) float32 [hi | lo] -> (n,) float64 hi + lo."""
    n = v.numel() // 2
    return v[:n].to(torch.float64) + v[n:].to(torch.float64)


class PSMerger:
    """A ``MetricMerger`` over a ``PSClient`` of a worker (see the module docstring).

    Args:
        client: this worker's PSClient (``worker_index``, ``num_workers``; barriers need its
            coordinator, as ``recps.ps.node.connect`` builds it).
        prefix: table and barrier names start with it.
        timeout_s: bound of each barrier wait (default: the client's timeout).

    Grouped metrics (GAUC, PNR) are not fixed-size vectors; it refuses them.
    """

    def __init__(self, client: Any, prefix: str = "recps.metrics", timeout_s: float | None = None) -> None:
        self.client = client
        self.rank = int(client.worker_index)
        self.world_size = int(client.num_workers)
        self.prefix = prefix
        self.timeout_s = float(timeout_s if timeout_s is not None else client.timeout_s)
        self._round = 0
        self._uses: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._stored: dict[str, Tensor] = {}  # table -> what this worker put there (float32)
        self._zeroing: dict[str, Any] = {}  # table -> handle of its pending zeroing push

    def all_min(self, values: Tensor) -> Tensor:
        rows = self._round_trip("header", values.detach().to("cpu", torch.float64).reshape(-1))  # (W, K)
        return rows.min(dim=0).values.round().to(torch.int64)  # (K,)

    def merge(self, collection: MetricCollection) -> MetricCollection:
        if collection.grouped_state():
            raise ConfigError(
                f"PSMerger: {sorted(collection.grouped_state())} keep per-example columns, which a dense "
                f"table does not carry; merge them with metrics.merge=gloo or compute them in evaluation"
            )
        merged = collection.clone()
        flat = merged.flatten().detach().to("cpu", torch.float64)  # (S,)
        if flat.numel():
            merged.unflatten(self._round_trip("state", flat).sum(dim=0))
        return merged

    # ---- one round -----------------------------------------------------------------------------

    def _table(self, kind: str, worker: int, buffer: int) -> str:
        return f"{self.prefix}.{kind}.w{worker}.b{buffer}"

    def _round_trip(self, kind: str, values: Tensor) -> Tensor:
        """Every worker's `values` (n,) float64 as rows (W, n), in worker order."""
        size = 2 * values.numel()
        if self._sizes.setdefault(kind, size) != size:
            raise DataError(
                f"PSMerger: {kind} vector has {values.numel()} values, earlier rounds had "
                f"{self._sizes[kind] // 2}; merge collections built from the same names and settings"
            )
        use = self._uses.get(kind, 0)
        self._uses[kind] = use + 1
        mine = self._table(kind, self.rank, use % 2)
        other = self._table(kind, self.rank, (use + 1) % 2)
        if use < 2:
            self.client.create_dense_table(mine, size, mode="geo")  # zeros; idempotent; pushes add
        pending = self._zeroing.pop(mine, None)
        if pending is not None:
            pending.wait()  # the table is back to exact zeros before we add to it
        payload = split_float64(values)  # (2n,)
        self.client.push_dense(mine, payload).wait()
        self._stored[mine] = payload
        self.client.barrier(f"{self.prefix}.{self._round}", timeout=self.timeout_s)
        self._round += 1
        handles = [self.client.pull_dense(self._table(kind, w, use % 2)) for w in range(self.world_size)]
        rows = torch.stack([join_float64(h.wait()) for h in handles])  # (W, n)
        if other in self._stored:  # every worker passed this barrier, so none reads it any more
            self._zeroing[other] = self.client.push_dense(other, -self._stored.pop(other))
        return rows
