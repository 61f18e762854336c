"""A worker's training pieces over the parameter server: dense updaters, the per-mode communicator,
input shards, a reader of the servers' values.

Dense parameters live on the PS too (one dense table, "dense" by default, the parameters
concatenated in order). The trainer's threads share one copy of them (recps.trainer); what a
step does with their gradients is the mode's:

    sync   PSDenseUpdater: push (N,) grads; step_end waits for the step's update on the servers,
           then the shared params are refreshed from one pull (once per step, not per thread)
    async  PSDenseUpdater: push (merged and sent in the background); step_end copies the latest
           values the communicator received into the shared params (no network wait)
    geo    GeoDenseUpdater: a local torch optimizer steps the shared params; every k steps the
           communicator sends their deltas and folds the merged values back in

Shapes: N the flat size of the dense table.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from recps.errors import ConfigError, PSError

__all__ = [
    "DENSE_TABLE",
    "PSDenseUpdater",
    "GeoDenseUpdater",
    "ServerReader",
    "WorkerShards",
    "CommunicatorSettings",
    "make_communicator",
    "torch_optimizer_rule",
    "flatten",
    "assign_flat",
]

log = logging.getLogger(__name__)

DENSE_TABLE = "dense"


def flatten(tensors: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensors (None: zeros shaped as `like`) -> one (N,) float32 vector."""
    return torch.cat([(t if t is not None else torch.zeros_like(p)).detach().reshape(-1).to(torch.float32)
                      for t, p in zip(tensors, like)])


def assign_flat(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy (N,) values into `params` in order (in place: the threads' replicas alias them)."""
    pos = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[pos:pos + n].view_as(p))
            pos += n
    if pos != flat.numel():
        raise PSError(f"dense table holds {flat.numel()} values, the model's dense parameters {pos}; "
                      "the servers hold another model's table (a stale checkpoint?)")


def torch_optimizer_rule(optimizer: torch.optim.Optimizer) -> dict:
    """The server-side update rule equal to `optimizer`'s step (SGD, Adam, Adagrad; one param group).

    >>> torch_optimizer_rule(torch.optim.Adam([nn.Parameter(torch.zeros(1))], lr=0.002))["name"]
    'adam'
    """
    if len(optimizer.param_groups) != 1:
        raise ConfigError(f"{type(optimizer).__name__} has {len(optimizer.param_groups)} param groups; "
                          "a PS dense table has one update rule: use one group")
    g = optimizer.param_groups[0]
    l2 = float(g.get("weight_decay", 0.0))
    if isinstance(optimizer, torch.optim.SGD):
        if g.get("momentum", 0.0) or g.get("nesterov"):
            raise ConfigError("torch.optim.SGD with momentum has no server-side rule; use momentum=0, Adam or Adagrad")
        return {"name": "sgd", "lr": float(g["lr"]), "l2": l2}
    if isinstance(optimizer, torch.optim.Adam) and not isinstance(optimizer, torch.optim.AdamW):
        if g.get("amsgrad"):
            raise ConfigError("torch.optim.Adam(amsgrad=True) has no server-side rule; use amsgrad=False")
        b1, b2 = g["betas"]
        return {"name": "adam", "lr": float(g["lr"]), "l2": l2, "beta1": float(b1), "beta2": float(b2),
                "eps": float(g["eps"])}
    if isinstance(optimizer, torch.optim.Adagrad):
        if g.get("lr_decay", 0.0):
            raise ConfigError("torch.optim.Adagrad(lr_decay != 0) has no server-side rule; use lr_decay=0")
        return {"name": "adagrad", "lr": float(g["lr"]), "l2": l2, "eps": float(g["eps"]),
                "initial_accumulator_value": float(g.get("initial_accumulator_value", 0.0))}
    raise ConfigError(f"{type(optimizer).__name__} has no server-side update rule; use torch.optim.SGD, Adam or "
                      "Adagrad for the dense parameters (or ps=geo, which steps any optimizer locally)")


class PSDenseUpdater:
    """sync / async: the servers own the dense update; see the module docstring.

    Args:
        params: the shared dense parameters, in the dense table's order.
        communicator: a sync or async Communicator.
        table: the dense table's name.
    """

    def __init__(self, params: Sequence[nn.Parameter], communicator, table: str = DENSE_TABLE) -> None:
        self.params = list(params)
        self.communicator = communicator
        self.table = table
        self._lock = threading.Lock()
        self._seen = None  # what was copied last: the sync step, or the async values object

    def apply(self, grads: Sequence[torch.Tensor | None]) -> None:
        self.communicator.push_dense(self.table, flatten(grads, self.params))  # (N,)

    def step_end(self, thread: int) -> None:
        self.communicator.step_end(thread)
        self.refresh()

    def refresh(self) -> None:
        """Copy the servers' latest values into the shared params (once per sync step / new values)."""
        step = getattr(self.communicator, "step", None) if self.communicator.mode == "sync" else None
        with self._lock:
            if step is not None:
                if step == self._seen:
                    return  # another thread of this worker refreshed after this step
                values = self.communicator.pull_dense(self.table)
                self._seen = step
            else:
                values = self.communicator.pull_dense(self.table)  # async: the latest copy, no wait
                if values is self._seen:
                    return
                self._seen = values
            assign_flat(self.params, values)


class GeoDenseUpdater:
    """geo: a local torch optimizer on the shared params (under a lock); the communicator syncs them."""

    def __init__(self, params: Sequence[nn.Parameter], optimizer: torch.optim.Optimizer, communicator) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        self.communicator = communicator
        self._lock = threading.Lock()

    def apply(self, grads: Sequence[torch.Tensor | None]) -> None:
        with self._lock:
            for param, grad in zip(self.params, grads):
                param.grad = grad
            self.optimizer.step()
            for param in self.params:
                param.grad = None

    def step_end(self, thread: int) -> None:
        self.communicator.step_end(thread)


class ServerReader:
    """Pull-only view of the servers (the read half of the Communicator protocol): evaluation
    reads the merged values, whatever the training mode."""

    mode = "read"

    def __init__(self, client, timeout_s: float | None = None) -> None:
        self.client = client
        self.timeout_s = timeout_s

    def pull(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        return self.client.pull(table, keys, create=False, assume_unique=True).wait(self.timeout_s)

    def push(self, table: str, keys: torch.Tensor, grads: torch.Tensor) -> None:
        raise PSError(f"ServerReader is read-only: a push to {table!r} came from a model in training mode; "
                      "call model.eval() or bind the training communicator")

    def pull_dense(self, table: str) -> torch.Tensor:
        return self.client.pull_dense(table).wait(self.timeout_s)


class WorkerShards:
    """A BatchSource view for one worker: trainer thread t of T reads shard worker*T + t of W*T."""

    def __init__(self, source, worker_index: int, num_workers: int) -> None:
        self.source, self.worker_index, self.num_workers = source, worker_index, num_workers

    def batches(self, batch_size: int, shard_index: int, num_shards: int, epoch: int) -> Iterator:
        return self.source.batches(batch_size, self.worker_index * num_shards + shard_index,
                                   self.num_workers * num_shards, epoch)

    def shard_batches(self, batch_size: int, threads: int) -> list[int]:
        """Batches per epoch of every one of the W*T shards (sync mode takes the minimum)."""
        rows = len(self.source)
        n = self.num_workers * threads
        return [-(-len(range(s, rows, n)) // batch_size) for s in range(n)]


@dataclass
class CommunicatorSettings:
    """What `make_communicator` needs besides the client (the Fleet strategy and conf/ps carry it)."""

    mode: str = "async"
    threads: int = 1
    k_steps: int = 100
    max_pending: int = 8
    merge_threshold: int = 4
    min_merge: int = 1
    dense_min_merge: int | None = None
    dense_refresh_steps: int = 1
    geo_capacity: int = 1 << 16
    geo_delta_scale: float | None = None
    geo_dense_delta_scale: float | None = None
    geo_background_sync: bool | None = None
    geo_local_init: bool = True
    timeout_s: float | None = None
    embedding_optimizer: Mapping = field(default_factory=lambda: {"name": "rowwise_adagrad", "lr": 0.05})


MODES = ("sync", "async", "geo")


def make_communicator(settings: CommunicatorSettings, client):
    """The Communicator of `settings.mode` over `client`."""
    mode = settings.mode
    if mode == "sync":
        from recps.ps.modes.synchronous import SyncCommunicator

        return SyncCommunicator(client, num_threads=settings.threads, timeout_s=settings.timeout_s)
    if mode == "async":
        from recps.ps.modes.asynchronous import AsyncCommunicator

        return AsyncCommunicator(client, max_pending=settings.max_pending, merge_threshold=settings.merge_threshold,
                                 timeout_s=settings.timeout_s, dense_refresh_steps=settings.dense_refresh_steps,
                                 min_merge=settings.min_merge, dense_min_merge=settings.dense_min_merge)
    if mode == "geo":
        from recps.ps.modes.geo import GeoCommunicator

        return GeoCommunicator(client, k_steps=settings.k_steps, optimizer=dict(settings.embedding_optimizer),
                               capacity=settings.geo_capacity, timeout_s=settings.timeout_s,
                               delta_scale=settings.geo_delta_scale, dense_delta_scale=settings.geo_dense_delta_scale,
                               background_sync=settings.geo_background_sync, local_init=settings.geo_local_init)
    raise ConfigError(f"ps mode {mode!r} is not one of {MODES} (ps=local trains without servers)")
