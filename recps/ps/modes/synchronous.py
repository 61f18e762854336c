"""Sync mode (Paddle's semantics), both halves: `SyncMode` builds them.

Worker half, `SyncCommunicator` over one PSClient; server half, `SyncServer`, the step
aggregation the servers run for the tables of this mode.

Shape letters: K keys, D row width, N flat dense size, T threads of this worker, W workers.

Per step s, each of the worker's T training threads calls `push` / `push_dense` (its batch's
mean-loss gradients) and then `step_end(thread)`. The last thread to arrive merges the T
threads' gradients, keys concatenated and every gradient divided by T, so a worker with T
threads of batch B equals one thread with the merged batch of T*B examples (shows and clicks,
the CTR statistics of a table with an accessor, are concatenated too, and summed, never
divided, by the client and the servers), and sends ONE
`push` per sparse table (to every server, meta: the step) and one `push_dense` per dense
table for step s. Each server applies one update with the mean over the W workers once all W
arrived; `step_end` returns to every thread after every table's update was applied, so the
next step's pulls see fresh values.

Every worker must take the same number of steps, and its threads the same number each (the
step's barrier waits for all T). A table this worker ever pushed is sent every step (with 0
keys, or zero dense gradients, when no thread pushed it), because the servers wait for all W
workers on every table that any worker pushed.

Server half: a push to a sync table carries meta {step, worker, workers, timeout_s}; the server
keeps each (table, step)'s contributions, sums them when the last of the W workers arrived and
applies ONE update with the mean over the W workers (the table's update rule; the workers'
shows and clicks are added to the rows' statistics as they are), then answers every
worker's deferred reply, so a pull that follows sees it. A step incomplete after its timeout
fails for the workers that did push, naming the ones that did not (reply meta {"error":
"timeout"}, raised by the client as PSTimeoutError); a sweeper thread checks the deadlines.

>>> import torch
>>> from recps.ps.modes import server_halves
>>> from recps.ps.node import PSClient, PSServer
>>> with PSServer(token="t", halves=server_halves()) as server, PSClient([server.endpoint], token="t") as client:
...     _ = client.create_sparse_table("emb", dim=1, optimizer={"name": "sgd", "lr": 1.0},
...                                    initializer={"kind": "zeros"}, mode="sync")
...     comm = SyncMode().communicator(client, threads=1)
...     comm.push("emb", torch.tensor([4]), torch.tensor([[0.5]]))
...     comm.step_end(0)
...     rows = comm.pull("emb", torch.tensor([4]))
...     comm.close()
>>> rows.tolist()
[[-0.5]]
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from recps.errors import ConfigError, PSError, PSTimeoutError
from recps.ps.modes.base import Mode, has_accessor, merged_statistics
from recps.ps.modes.server_reader import ServerReader
from recps.ps.node import PSClient
from recps.ps.node.server import HostedTable

__all__ = ["SyncMode", "SyncCommunicator", "SyncServer"]

logger = logging.getLogger(__name__)

_MARGIN_S = 2.0
_SWEEP_S = 0.25  # how often the server half fails expired steps


@dataclass
class SyncMode(Mode):
    """Sync: one update per step with the mean over the workers (see the module docstring).

    Args: those of `Mode` (table, timeout_s).
    """

    name = "sync"

    def communicator(self, client, threads: int = 1) -> "SyncCommunicator":
        return SyncCommunicator(client, num_threads=threads, timeout_s=self.timeout_s)



class SyncCommunicator:
    """Synchronous training over `client` for `num_threads` threads; see the module docstring.

    Args:
        client: this worker's PSClient (its worker_index / num_workers are used unless given).
        num_threads: T, the training threads that call step_end each step.
        worker_index, num_workers: override the client's.
        timeout_s: bound of every wait (default: the client's timeout_s); includes waiting for
            the slowest worker of the step.
    """

    mode = "sync"

    def __init__(
        self,
        client: PSClient,
        num_threads: int = 1,
        worker_index: int | None = None,
        num_workers: int | None = None,
        timeout_s: float | None = None,
    ) -> None:
        if num_threads < 1:
            raise ConfigError(f"SyncCommunicator: num_threads={num_threads}; it must be >= 1")
        if worker_index is not None and worker_index != client.worker_index or num_workers is not None and num_workers != client.num_workers:
            raise ConfigError(
                f"SyncCommunicator: worker_index={worker_index}, num_workers={num_workers} but the client was built "
                f"for worker {client.worker_index} of {client.num_workers}; build the client with the same values"
            )
        self.client = client
        self.num_threads = num_threads
        self.timeout_s = client.timeout_s if timeout_s is None else float(timeout_s)
        self.step = 0  # the step being accumulated
        self._cond = threading.Condition()
        self._sparse: dict[str, list[tuple]] = {}  # table -> the threads' (keys, grads, shows, clicks)
        self._dense: dict[str, torch.Tensor] = {}
        self._known_sparse: dict[str, int] = {}  # table -> dim, pushed at some step
        self._known_dense: dict[str, int] = {}  # table -> N
        self._arrived: set[int] = set()
        self._generation = 0
        self._error: BaseException | None = None
        self._closed = False

    # -- Communicator --------------------------------------------------------------------------

    def pull(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        """(K,) unique keys -> (K, D) rows as of the last completed step."""
        return self.client.pull(table, keys, assume_unique=True).wait(self.timeout_s)

    def server_reader(self) -> ServerReader:
        """A read-only view of this communicator's servers (ReadsServers): evaluation, frozen tables."""
        return ServerReader(self.client, timeout_s=self.timeout_s)

    def counts_statistics(self, table: str) -> bool:
        """Whether pushes of `table` carry shows and clicks (its servers' table has an accessor)."""
        return has_accessor(self.client, table)

    def push(self, table: str, keys: torch.Tensor, grads: torch.Tensor, shows: torch.Tensor | None = None,
             clicks: torch.Tensor | None = None) -> None:
        """Buffer one thread's (K, D) gradients for this step (sent by step_end), with the keys' (K,)
        shows and clicks (both for a table with an accessor, else neither). Keeps the tensors."""
        if grads.dim() != 2 or grads.shape[0] != keys.numel():
            raise ConfigError(f"push {table!r}: grads have shape {tuple(grads.shape)} for {keys.numel()} keys; expected (K, D)")
        with self._cond:
            self._check()
            self._sparse.setdefault(table, []).append((keys, grads, shows, clicks))
            self._known_sparse.setdefault(table, int(grads.shape[1]))

    def pull_dense(self, table: str) -> torch.Tensor:
        """(N,) values as of the last completed step."""
        return self.client.pull_dense(table).wait(self.timeout_s)

    def push_dense(self, table: str, grads: torch.Tensor) -> None:
        """Add one thread's (N,) gradients to this step's sum."""
        grads = grads.detach().reshape(-1).to(torch.float32)
        with self._cond:
            self._check()
            acc = self._dense.get(table)
            self._dense[table] = grads.clone() if acc is None else acc.add_(grads)
            self._known_dense.setdefault(table, grads.numel())

    def step_end(self, thread: int) -> None:
        """Wait for the T threads, send the merged step, return once the servers applied it."""
        if not 0 <= thread < self.num_threads:
            raise ConfigError(f"step_end: thread={thread} is outside [0, num_threads={self.num_threads})")
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            self._check()
            if thread in self._arrived:
                raise ConfigError(f"step_end: thread {thread} ended step {self.step} twice; each thread ends each step once")
            self._arrived.add(thread)
            generation = self._generation
            if len(self._arrived) < self.num_threads:
                while self._generation == generation and self._error is None:
                    if len(self._arrived) == self.num_threads:
                        self._cond.wait()  # the last thread is sending; its waits are bounded
                        continue
                    left = deadline - time.monotonic()
                    if left <= 0:
                        missing = sorted(set(range(self.num_threads)) - self._arrived)
                        self._error = PSTimeoutError(
                            f"sync step {self.step}: thread(s) {missing} of worker {self.client.worker_index} did not end the "
                            f"step within {self.timeout_s:g} s; every thread must take the same number of steps"
                        )
                        self._cond.notify_all()
                        raise self._error
                    self._cond.wait(left)
                self._check()
                return
            # The last thread of the step sends it; the others wait for the new generation.
            sparse, dense, step = self._sparse, self._dense, self.step
            self._sparse, self._dense = {}, {}
        try:
            self._send(sparse, dense, step)
        except BaseException as e:
            with self._cond:
                self._error = e
                self._cond.notify_all()
            raise
        with self._cond:
            self._arrived = set()
            self.step += 1
            self._generation += 1
            self._cond.notify_all()

    def flush(self, timeout_s: float | None = None) -> None:
        """Nothing is queued between steps in sync mode: a completed step_end is applied."""
        with self._cond:
            self._check()

    def close(self) -> None:
        """Idempotent; the client stays open (its owner closes it)."""
        self._closed = True

    # -- internals -----------------------------------------------------------------------------

    def _check(self) -> None:
        if self._error is not None:
            raise PSError(f"sync communicator failed earlier: {self._error}") from self._error

    def _send(self, sparse: dict, dense: dict, step: int) -> None:
        t = float(self.num_threads)
        meta = {"step": int(step), "worker": self.client.worker_index, "workers": self.client.num_workers,
                "timeout_s": self.timeout_s}
        handles = []
        for table, dim in self._known_sparse.items():
            pieces = sparse.get(table, [])
            shows = clicks = None
            if pieces:
                keys = torch.cat([p[0] for p in pieces]) if len(pieces) > 1 else pieces[0][0]  # (sum K,)
                grads = torch.cat([p[1] for p in pieces]) if len(pieces) > 1 else pieces[0][1]  # (sum K, D)
                grads = grads.to(torch.float32) / t if t > 1 else grads.to(torch.float32)
                shows, clicks = merged_statistics(pieces)  # (sum K,) each, or None: summed, not / T
            else:
                keys, grads = torch.empty(0, dtype=torch.int64), torch.empty(0, dim)
            handles.append(self.client.push(table, keys, grads, shows=shows, clicks=clicks, meta=meta,
                                            every_server=True))
        for table, n in self._known_dense.items():
            grads = dense.get(table)
            grads = torch.zeros(n) if grads is None else (grads.div_(t) if t > 1 else grads)
            handles.append(self.client.push_dense(table, grads, meta=meta))
        # The servers fail an incomplete step after timeout_s naming the missing workers; wait a
        # little longer so that message, not a bare timeout, reaches the caller.
        deadline = time.monotonic() + self.timeout_s + _MARGIN_S
        for h in handles:
            h.wait(max(0.0, deadline - time.monotonic()))


# ---------------------------------------------------------------------------------- server half


@dataclass
class _Step:
    """Contributions of the workers to one (table, step)."""

    workers: int
    deadline: float
    arrived: dict[int, Future] = field(default_factory=dict)  # worker -> its deferred reply
    keys: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    shows: list[torch.Tensor | None] = field(default_factory=list)  # per worker; None: the table's default
    clicks: list[torch.Tensor | None] = field(default_factory=list)
    dense: torch.Tensor | None = None  # running sum of dense parts


class _Timeout(Exception):
    """A step expired: answered as meta {"error": "timeout"}, raised by the client as
    PSTimeoutError (an exception crossing the transport would arrive as a plain PSError)."""


class SyncServer:
    """Sync's server half on server `index` (recps.ps.node.server.ServerHalf): see the module docstring."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._steps: dict[tuple[str, str, int], _Step] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name=f"recps-ps{index}-sync-sweeper", daemon=True)
        self._sweeper.start()

    def push(self, table: HostedTable, fields: Mapping, meta: Mapping) -> Future:
        shard = table.sparse_shard("push")
        keys, grads, shows, clicks = fields["keys"], fields["rows"], fields.get("shows"), fields.get("clicks")

        def add(step: _Step) -> None:
            step.keys.append(keys)
            step.grads.append(grads)
            step.shows.append(shows)
            step.clicks.append(clicks)

        step, future, last = self._arrive("push", table.name, meta, add)
        if last:
            self._apply(step, lambda: _apply_sparse(shard, step))
        return future

    def push_dense(self, table: HostedTable, fields: Mapping, meta: Mapping) -> Future:
        shard = table.dense_shard("push_dense")
        grads = fields["values"]

        def add(step: _Step) -> None:
            step.dense = grads.clone() if step.dense is None else step.dense.add_(grads)

        step, future, last = self._arrive("push_dense", table.name, meta, add)
        if last:
            self._apply(step, lambda: shard.push(table.dense_parts(step.dense.div_(step.workers))))
        return future

    def pending(self) -> int:
        with self._lock:
            return len(self._steps)

    def close(self) -> None:
        self._stopped.set()
        with self._lock:
            pending, self._steps = list(self._steps.values()), {}
        for step in pending:
            _fail(step, PSError(f"server {self.index} stopped while a synchronous step was pending"))
        self._sweeper.join(5.0)

    def _arrive(self, kind: str, name: str, meta: Mapping, add) -> tuple[_Step, Future, bool]:
        """Record worker meta["worker"]'s contribution to (name, step) with add(step), under the
        lock; returns the step, the worker's deferred reply and whether it was the last to arrive."""
        for key in ("step", "worker", "workers"):
            if key not in meta:
                raise ConfigError(f"{kind} {name!r}: a push to a sync table without meta {key!r}; "
                                  "train the table with SyncMode's communicator")
        step_id, worker, workers = int(meta["step"]), int(meta["worker"]), int(meta["workers"])
        if not 0 <= worker < workers:
            raise ConfigError(f"{kind} {name!r} step {step_id}: worker={worker} is outside [0, workers={workers})")
        key = (kind, name, step_id)
        future: Future = Future()
        with self._lock:
            step = self._steps.get(key)
            if step is None:
                deadline = time.monotonic() + float(meta.get("timeout_s", 60.0))
                step = self._steps[key] = _Step(workers=workers, deadline=deadline)
            if step.workers != workers:
                raise ConfigError(f"{kind} {name!r} step {step_id}: worker {worker} says workers={workers}, others said {step.workers}")
            if worker in step.arrived:
                raise ConfigError(f"{kind} {name!r} step {step_id}: worker {worker} pushed twice; each worker pushes each step once")
            add(step)
            step.arrived[worker] = future
            last = len(step.arrived) == workers
            if last:
                del self._steps[key]
        return step, future, last

    def _apply(self, step: _Step, apply) -> None:
        try:
            apply()
        except Exception as e:  # noqa: BLE001 - every waiting worker gets the error
            _fail(step, e)
            return
        for f in step.arrived.values():
            f.set_result(None)

    def _sweep(self) -> None:
        """Fail steps whose deadline passed, naming the workers that never pushed."""
        while not self._stopped.wait(_SWEEP_S):
            now = time.monotonic()
            with self._lock:
                expired = [(k, s) for k, s in self._steps.items() if s.deadline <= now]
                for k, _ in expired:
                    del self._steps[k]
            for (kind, name, step_id), step in expired:
                missing = sorted(set(range(step.workers)) - set(step.arrived))
                _fail(step, _Timeout(
                    f"server {self.index}: sync {kind} of table {name!r} step {step_id}: worker(s) {missing} did not push "
                    f"within the timeout ({len(step.arrived)} of {step.workers} arrived); is a worker dead or behind?"
                ))


def _fail(step: _Step, error: Exception) -> None:
    for f in step.arrived.values():
        if f.done():
            continue
        if isinstance(error, _Timeout):
            f.set_result(([], {"error": "timeout", "message": str(error)}))
        else:
            f.set_exception(error)


@torch.no_grad()
def _apply_sparse(shard, step: _Step) -> None:
    keys = torch.cat(step.keys) if len(step.keys) > 1 else step.keys[0]  # (sum K,)
    grads = torch.cat(step.grads) if len(step.grads) > 1 else step.grads[0]  # (sum K, D)
    if keys.numel():
        # Keys pushed by several workers are summed by the table: / W makes it the mean. Their
        # shows and clicks are summed too, as they are: statistics count, they are not averaged.
        shows, clicks = merged_statistics(list(zip(step.keys, step.grads, step.shows, step.clicks)))  # (sum K,)
        shard.push(keys, grads / step.workers if step.workers > 1 else grads, shows=shows, clicks=clicks)


SyncMode.server_half = SyncServer  # defined after the mode: the module reads worker half first
