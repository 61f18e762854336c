"""Async mode (Paddle's semantics), both halves: `AsyncMode` builds them.

Worker half, `AsyncCommunicator` over one PSClient, with a background sender; server half,
`AsyncServer`: the table's update rule applied to each push on arrival.

Shape letters: K keys, D row width, N flat dense size.

    training threads --push--> bounded queue --sender thread--> merge per table --> client.push
                     --push_dense--> per-table sum  ------------------------------> client.push_dense
                     <--pull------ client.pull (direct)
                     <--pull_dense- latest copy, refreshed by the sender (never waits on the network
                                    after the first call)

- `push` enqueues and returns; the sender takes up to `merge_threshold` queued pushes at a time,
  concatenates them per table and sends one push per table (the client sums duplicate keys,
  their gradients and their shows and clicks: the CTR statistics stay exact however pushes
  merge), and the servers apply the update rule on arrival. With `min_merge` m > 1 the sender waits
  until m pushes are queued (or a flush) before it sends: one request and one update of each
  row where there were m (Paddle's communicator merges up to `max_merge_var_num` batches the
  same way), for at most m - 1 more steps of staleness; `dense_min_merge` does the same for the
  dense gradients (fewer Adam steps on the servers: measured, a lower AUC at 4, benchmarks/RESULTS.md).
- At most `max_pending` pushes are unapplied at any time (queued or in flight): a push beyond that
  blocks until the sender catches up, up to `timeout_s` (then PSTimeoutError). That is the
  staleness bound: a pull never misses more than `max_pending` of this worker's pushes.
- Dense gradients are summed per table as they come (as Paddle's communicator merges them) and
  sent by the sender, which gets the fresh values back in the same round trip; `pull_dense`
  returns the latest copy it received. Every `dense_refresh_steps` steps (counted by
  `step_end`) the sender also pulls the dense tables, so other workers' updates show up even
  when this worker has nothing to send.
- An error of the sender is raised by the next push, pull_dense, flush or close.

>>> import torch
>>> from recps.ps.modes import server_halves
>>> from recps.ps.node import PSClient, PSServer
>>> with PSServer(token="t", halves=server_halves()) as server, PSClient([server.endpoint], token="t") as client:
...     _ = client.create_sparse_table("emb", dim=1, optimizer={"name": "sgd", "lr": 1.0},
...                                    initializer={"kind": "zeros"})
...     comm = AsyncMode(max_pending=4).communicator(client)
...     for _ in range(3):
...         comm.push("emb", torch.tensor([4, 9]), torch.ones(2, 1))
...     comm.flush()
...     rows = comm.pull("emb", torch.tensor([4, 9]))
...     comm.close()
>>> rows.squeeze(1).tolist()
[-3.0, -3.0]
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from recps.errors import ConfigError, PSError, PSTimeoutError
from recps.ps.modes.base import Mode, OnArrivalServer, check_int, has_accessor, merged_statistics
from recps.ps.modes.server_reader import ServerReader
from recps.ps.node import PSClient

__all__ = ["AsyncMode", "AsyncCommunicator", "AsyncServer"]

logger = logging.getLogger(__name__)


@dataclass
class AsyncMode(Mode):
    """Async: pushes applied on arrival, sent by a background sender (see the module docstring).

    Args (besides `Mode`'s table and timeout_s):
        max_pending: most pushes of a worker unapplied at once (the staleness bound); >= 1.
        merge_threshold: most queued pushes merged into one send; >= 1.
        min_merge: the sender waits for this many queued pushes and sends them as one, unless
            flushing; 1 <= min_merge <= min(merge_threshold, max_pending) (1: every push at once).
        dense_min_merge: the same for dense gradients, summed per table (None: min_merge).
        dense_refresh_steps: the dense values are pulled in the background every this many steps
            (0: only the values returned by this worker's dense pushes).
        prefetch: each training thread sends its next batch's pulls between the current batch's
            forward and backward (recps.job.loop.Trainer with a PS collection's `prefetch`): faster
            (async 1S+2Wx1T 26.2-26.8k -> 28.3-28.7k examples/s), but those rows may miss the current
            batch's push: AUC -0.001 after 200k examples, -0.01 after 60k (benchmarks/RESULTS.md, session 5).
    """

    name = "async"

    max_pending: int = 8
    merge_threshold: int = 4
    min_merge: int = 1
    dense_min_merge: int | None = None
    dense_refresh_steps: int = 1
    prefetch: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for knob, low in (("max_pending", 1), ("merge_threshold", 1), ("min_merge", 1), ("dense_refresh_steps", 0)):
            check_int("AsyncMode", knob, getattr(self, knob), low)
        check_int("AsyncMode", "dense_min_merge", self.dense_min_merge, 1, optional=True)
        if self.min_merge > min(self.max_pending, self.merge_threshold):
            raise ConfigError(
                f"AsyncMode: min_merge={self.min_merge} exceeds max_pending={self.max_pending} or "
                f"merge_threshold={self.merge_threshold}; lower min_merge or raise both (a push beyond max_pending "
                "would wait for a send that waits for it)"
            )
        if not isinstance(self.prefetch, bool):
            raise ConfigError(f"AsyncMode: prefetch={self.prefetch!r}; use true or false (ps.prefetch)")

    @property
    def prefetches(self) -> bool:
        return self.prefetch

    def communicator(self, client, threads: int = 1) -> "AsyncCommunicator":
        return AsyncCommunicator(client, self)


class AsyncCommunicator:
    """Asynchronous training over `client` with `mode`'s knobs (AsyncMode); see the module docstring."""

    mode = "async"

    def __init__(self, client: PSClient, mode: AsyncMode) -> None:
        self.client = client
        self.max_pending = mode.max_pending
        self.merge_threshold = mode.merge_threshold
        self.timeout_s = float(mode.timeout_s)
        self.dense_refresh_steps = mode.dense_refresh_steps
        self.min_merge = mode.min_merge
        self.dense_min_merge = mode.min_merge if mode.dense_min_merge is None else mode.dense_min_merge
        self._cond = threading.Condition()
        # (table, keys (K,), grads (K, D), shows (K,) | None, clicks (K,) | None)
        self._queue: collections.deque[tuple] = collections.deque()
        self._unapplied = 0  # pushes queued or in flight
        self._dense_grads: dict[str, torch.Tensor] = {}  # summed, not sent yet
        self._dense_counts: dict[str, int] = {}  # gradients summed into each table's pending sum
        self._flushing = 0  # callers waiting in flush(): send whatever is queued
        self._dense_inflight = 0
        self._dense_values: dict[str, torch.Tensor] = {}  # latest copy from the servers
        self._dense_tables: set[str] = set()
        self._refresh = False
        self._steps = 0
        self._error: BaseException | None = None
        self._closing = False
        self._closed = False
        self.sent_pushes = 0  # pushes the servers applied (for tests and logs)
        self.sends = 0  # merged sends
        self._sender = threading.Thread(target=self._run, name="recps-async-sender", daemon=True)
        self._sender.start()

    @property
    def pending(self) -> int:
        """Pushes queued or in flight (never more than max_pending)."""
        return self._unapplied

    # -- Communicator --------------------------------------------------------------------------

    def pull(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        """(K,) unique keys -> (K, D) rows, straight from the servers."""
        return self.pull_start(table, keys)()

    def pull_start(self, table: str, keys: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Send the pull of (K,) unique keys now; the returned function waits for its (K, D) rows
        (up to timeout_s). A prefetch (recps.ps.embedding) overlaps the round trip with compute."""
        return functools.partial(self.client.pull(table, keys, assume_unique=True).wait, self.timeout_s)

    def server_reader(self) -> ServerReader:
        """A read-only view of this communicator's servers (ReadsServers): evaluation, frozen tables."""
        return ServerReader(self.client, timeout_s=self.timeout_s)

    def counts_statistics(self, table: str) -> bool:
        """Whether pushes of `table` carry shows and clicks (its servers' table has an accessor)."""
        return has_accessor(self.client, table)

    def push(self, table: str, keys: torch.Tensor, grads: torch.Tensor, shows: torch.Tensor | None = None,
             clicks: torch.Tensor | None = None) -> None:
        """Queue (K, D) gradients of (K,) keys, with their (K,) shows and clicks (both for a table
        with an accessor, else neither); blocks while max_pending pushes are unapplied. The communicator keeps
        the tensors: do not modify them afterwards."""
        if grads.dim() != 2 or grads.shape[0] != keys.numel():
            raise ConfigError(f"push {table!r}: grads have shape {tuple(grads.shape)} for {keys.numel()} keys; expected (K, D)")
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            self._wait_while(
                lambda: self._unapplied >= self.max_pending and self._error is None and not self._closing,
                deadline,
                lambda: f"async push {table!r} ({keys.numel()} keys): {self._unapplied} pushes unapplied "
                f"(max_pending={self.max_pending}) for {self.timeout_s:g} s; the servers do not keep up or are gone",
            )
            self._check()
            self._queue.append((table, keys, grads, shows, clicks))
            self._unapplied += 1
            self._cond.notify_all()

    def pull_dense(self, table: str) -> torch.Tensor:
        """(N,) latest values known to this worker (fetched from the servers on the first call).
        The tensor is shared: read it, do not modify it."""
        with self._cond:
            self._check()
            values = self._dense_values.get(table)
            self._dense_tables.add(table)
        if values is None:
            values = self.client.pull_dense(table).wait(self.timeout_s)
            with self._cond:
                self._dense_values.setdefault(table, values)
        return values

    def push_dense(self, table: str, grads: torch.Tensor) -> None:
        """Add (N,) gradients to the table's pending sum, sent by the sender thread."""
        grads = grads.detach().reshape(-1).to(torch.float32)
        with self._cond:
            self._check()
            acc = self._dense_grads.get(table)
            self._dense_grads[table] = grads.clone() if acc is None else acc.add_(grads)
            self._dense_counts[table] = count = self._dense_counts.get(table, 0) + 1
            self._dense_tables.add(table)
            if count >= self.dense_min_merge:
                self._cond.notify_all()

    def step_end(self, thread: int) -> None:
        """Count a step; every dense_refresh_steps steps the sender refreshes the dense copies."""
        with self._cond:
            self._steps += 1
            if self.dense_refresh_steps and self._steps % self.dense_refresh_steps == 0 and self._dense_tables:
                self._refresh = True
                self._cond.notify_all()

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every push so far was applied by the servers."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                self._wait_while(
                    lambda: bool(self._unapplied or self._dense_grads or self._dense_inflight) and self._error is None,
                    deadline,
                    lambda: f"async flush: {self._unapplied} pushes and {len(self._dense_grads) + self._dense_inflight} "
                    f"dense sums still unapplied after {timeout:g} s",
                )
            finally:
                self._flushing -= 1
            self._check()

    def close(self) -> None:
        """Flush, then stop the sender thread. Idempotent; the client stays open."""
        if self._closed:
            return
        try:
            if self._error is None:
                self.flush()
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._sender.join(self.timeout_s)
            self._closed = True
        self._check()

    # -- the sender thread ---------------------------------------------------------------------

    def _wait_while(self, blocked, deadline: float, timeout_message) -> None:
        """Wait on the condition (held) while `blocked()`; PSTimeoutError(timeout_message()) at `deadline`."""
        while blocked():
            left = deadline - time.monotonic()
            if left <= 0:
                raise PSTimeoutError(timeout_message())
            self._cond.wait(left)

    def _check(self) -> None:
        if self._error is not None:
            raise PSError(f"async communicator: the sender failed: {self._error}") from self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._ready():
                    self._cond.wait()
                if self._closing and not (self._queue or self._dense_grads):
                    return
                forced = self._closing or self._flushing
                take = len(self._queue) if forced or len(self._queue) >= self.min_merge else 0
                batch = [self._queue.popleft() for _ in range(min(self.merge_threshold, take))]
                dense = {}
                if forced or self._dense_due():
                    dense, self._dense_grads = self._dense_grads, {}
                    self._dense_counts = {}
                self._dense_inflight += len(dense)
                refresh = [t for t in self._dense_tables if t not in dense] if self._refresh else []
                self._refresh = False
            try:
                self._send(batch, dense, refresh)
            except BaseException as e:  # noqa: BLE001 - handed to the training threads
                logger.error("async sender failed: %s", e)
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._unapplied -= len(batch)
                self._dense_inflight -= len(dense)
                self.sent_pushes += len(batch)
                self.sends += 1
                self._cond.notify_all()

    def _ready(self) -> bool:
        """Whether the sender has something to send now (called under the lock)."""
        if self._closing:
            return True
        if self._flushing:
            return bool(self._queue or self._dense_grads or self._refresh)
        if len(self._queue) >= self.min_merge or self._dense_due():
            return True
        # A refresh alone goes out only when nothing waits to be merged: else it rides along.
        return self._refresh and not self._queue and not self._dense_grads

    def _dense_due(self) -> bool:
        """Whether some table's pending dense sum holds dense_min_merge gradients (under the lock)."""
        return max(self._dense_counts.values(), default=0) >= self.dense_min_merge

    def _send(self, batch: list, dense: dict[str, torch.Tensor], refresh: list[str]) -> None:
        by_table: dict[str, list[tuple]] = {}
        for table, *piece in batch:
            by_table.setdefault(table, []).append(piece)
        handles = []
        for table, pieces in by_table.items():
            if len(pieces) == 1:
                keys, grads, shows, clicks = pieces[0]
                handles.append((None, self.client.push(table, keys, grads, shows=shows, clicks=clicks,
                                                       assume_unique=True)))
            else:
                keys = torch.cat([k for k, _, _, _ in pieces])  # (sum K,) duplicates summed by the client
                grads = torch.cat([g for _, g, _, _ in pieces])  # (sum K, D)
                shows, clicks = merged_statistics(pieces)  # (sum K,) each, or None
                handles.append((None, self.client.push(table, keys, grads, shows=shows, clicks=clicks)))
        for table, grads in dense.items():
            handles.append((table, self.client.push_dense(table, grads, return_values=True)))
        for table in refresh:
            handles.append((table, self.client.pull_dense(table)))
        deadline = time.monotonic() + self.timeout_s
        for table, h in handles:
            result = h.wait(max(0.0, deadline - time.monotonic()))
            if table is not None:
                with self._cond:
                    self._dense_values[table] = result


# ---------------------------------------------------------------------------------- server half


class AsyncServer(OnArrivalServer):
    """Async's server half (recps.ps.node.server.ServerHalf): each push's rows are gradients, the
    table's update rule applies them on arrival; a dense push with meta return_values answers the
    values after it (the sender's fresh copy, without a pull)."""

    table_verb = "push"


AsyncMode.server_half = AsyncServer  # defined after the mode: the module reads worker half first
