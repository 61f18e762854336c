"""The Communicator protocol: what a worker's training threads ask of the parameter server.

Shape letters: K keys in a request, D row width, N flat dense size.

Contract, for every mode:
- `pull(table, keys)` blocks (bounded by the communicator's timeout) and returns (K, D)
  float32 rows in `keys` order. `keys` are unique int64 feature keys (the caller
  de-duplicates). Thread-safe: several training threads call it at once.
- `push(table, keys, grads, shows=None, clicks=None)` hands (K, D) gradient rows for unique
  `keys` of one thread's batch (already summed over the batch's duplicates, scaled as the loss
  was: mean over the batch), and, for a table whose `counts_statistics(table)` is true, the
  keys' (K,) shows and clicks in that batch (the CTR accessor's statistics, decided once where
  the batch enters: recps.ps.embedding, one show per occurrence and its example's click). Both
  or neither; required for such a table, refused for another. Every mode hands the servers'
  table the exact sums of the shows and clicks of all pushes, however it merges or delays them. When the update is applied is the mode's policy:
    sync  — merged over the worker's threads, sent once per step, applied by the servers
            when every worker's gradient for that step arrived;
    async — sent (merged in the background, bounded queue) and applied on arrival;
    geo   — applied locally to the worker's replica with SGD; deltas go to the servers
            every k steps.
- `counts_statistics(table)` (optional, `CountsStatistics`): whether the servers' sparse table
  `table` keeps CTR statistics (it has an accessor); pushes of other tables carry none (a table
  without an accessor refuses them). A communicator without it is asked for none.
- `pull_dense(table)` / `push_dense(table, grads)` do the same for a flat (N,) dense table.
- `step_end(thread)` marks the end of one training step of `thread` (sync: the step's
  barrier; geo: counts towards k). Every thread calls it once per step.
- `flush(timeout_s)` sends whatever is queued and waits until the servers applied it;
  `close()` flushes and releases sockets and threads. Both are idempotent.
Optional abilities, each a Protocol of its own (checked with isinstance, never probed by name):
- `CountsStatistics`: `counts_statistics(table)`, above.
- `StartsPulls`: `pull_start(table, keys)` sends a pull now and returns the function that waits
  for its rows (async): the embedding prefetches the next batch's rows with it.
- `PlacesReplicas`: `place_replicas(device)`: the communicator keeps local replicas (GEO) and
  puts them on the device of the collection that binds it.
- `KeepsWorkerState`: `state_dict()` / `load_state_dict(state)`: what the worker holds that the
  servers do not (GEO's replicas), for a checkpoint.
- `NumbersSteps`: `step`, the number of the step being accumulated (sync): a dense refresh
  happens once per step.
- `ReadsServers`: `server_reader()`, a read-only view of the servers this communicator talks to
  (a ServerReader; a read-only view answers itself).

Errors: a dead or silent server raises `recps.errors.PSTimeoutError` naming the server,
the table and the key count, within the timeout.

A mode is one constructor (`SyncMode`, `AsyncMode`, `GeoMode`; conf/ps/<mode>.yaml names it in
`_target_`): its arguments are the mode's knobs, with their one default, and it builds what the
mode is on both sides of the wire:

    mode.communicator(client, threads)       the worker half over one PSClient
    mode.dense_updater(named, opt, comm, t)  what a step does with the dense gradients
    mode.dense_rule(opt)                     the servers' rule of the dense table
    type(mode).server_half(server_index)     the server half (`recps.ps.node.server.ServerHalf`)

Nothing in a mode object is process-global: two collections of one worker may train two tables
in two modes against the same servers (each table is tagged with its mode on the servers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import torch

from recps.errors import ConfigError, PSError
from recps.ps.modes.abilities import (CountsStatistics, KeepsWorkerState, NumbersSteps, PlacesReplicas, ReadsServers,
                                      StartsPulls)
from recps.ps.modes.dense import PSDenseUpdater, torch_optimizer_rule
from recps.ps.node.specs import TableConfig

__all__ = ["Communicator", "CountsStatistics", "StartsPulls", "PlacesReplicas", "KeepsWorkerState", "NumbersSteps",
           "ReadsServers", "Mode", "OnArrivalServer", "check_int", "has_accessor", "merged_statistics"]


@runtime_checkable
class Communicator(Protocol):
    mode: str  # "sync" | "async" | "geo"

    def pull(self, table: str, keys: torch.Tensor) -> torch.Tensor: ...

    def push(self, table: str, keys: torch.Tensor, grads: torch.Tensor,
             shows: torch.Tensor | None = None, clicks: torch.Tensor | None = None) -> None: ...

    def pull_dense(self, table: str) -> torch.Tensor: ...

    def push_dense(self, table: str, grads: torch.Tensor) -> None: ...

    def step_end(self, thread: int) -> None: ...

    def flush(self, timeout_s: float | None = None) -> None: ...

    def close(self) -> None: ...


def has_accessor(client, table: str) -> bool:
    """Whether sparse table `table` keeps CTR statistics on the servers (its spec has an accessor):
    the communicators' `counts_statistics`. The client caches the spec (one request at most)."""
    return bool(client.table_spec(table).get("accessor"))


def merged_statistics(pushes) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The shows and clicks of pushes (keys (K,), rows, shows (K,) | None, clicks (K,) | None) of one
    table whose keys are concatenated: (sum K,) each, in the same order; (None, None) when none has
    statistics (a table without accessor). Every push of a table with an accessor carries both
    (recps.ps.embedding decides them, once, from the batch): a push with only one of them, or
    pushes of one table with and without them, raise PSError."""
    given = [p[2] is not None and p[3] is not None for p in pushes]
    if not any(p[2] is not None or p[3] is not None for p in pushes):
        return None, None
    if not all(given):
        raise PSError(f"{sum(given)} of {len(pushes)} pushes of one table carry shows and clicks; every push of a "
                      "table with an accessor gives both (counts_statistics(table)), of one without neither")
    return torch.cat([p[2].to(torch.float32) for p in pushes]), torch.cat([p[3].to(torch.float32) for p in pushes])


def check_int(owner: str, name: str, value, lowest: int, optional: bool = False) -> None:
    """A knob that must be an integer >= lowest (None allowed when `optional`)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        extra = " or null" if optional else ""
        raise ConfigError(f"{owner}: {name}={value!r}; it must be an integer >= {lowest}{extra} (ps.{name})")


@dataclass
class Mode:
    """What every PS mode holds (see the module docstring).

    Args:
        table: the settings of the sparse tables this mode creates (a TableConfig or its fields).
        timeout_s: bound of every wait on a server (sync: including the slowest worker of a step).
        checkpoint_every_steps: during training, a committed checkpoint every this many steps of
            each worker (over its threads; sync: rounded up to a multiple of the threads), taken at
            a barrier of every worker after the communicators drained (recps.cluster); None: only
            the one at the end (checkpoint.save).
        checkpoint_every_seconds: the same about every this many seconds of training, as worker 0
            measures them (the workers meet every `checkpoint_check_steps` steps at first, then
            when worker 0's step rate says the time is due). Give at most one of the two.
        checkpoint_check_steps: steps of each worker before the first meeting of
            checkpoint_every_seconds (worker 0 measures its step rate over them).
    """

    name: ClassVar[str] = ""
    server_half: ClassVar = None  # the factory of the mode's server half: server index -> ServerHalf

    table: TableConfig = field(default_factory=TableConfig)
    timeout_s: float = 60.0
    checkpoint_every_steps: int | None = None
    checkpoint_every_seconds: float | None = None
    checkpoint_check_steps: int = 100

    def __post_init__(self) -> None:
        if isinstance(self.table, Mapping):
            self.table = TableConfig(**{k: v for k, v in self.table.items() if not str(k).startswith("_")})
        if not isinstance(self.table, TableConfig):
            raise ConfigError(f"{type(self).__name__}: table={self.table!r}; give a TableConfig or its fields")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ConfigError(f"{type(self).__name__}: timeout_s={self.timeout_s!r}; it must be > 0 seconds (ps.timeout_s)")
        owner = type(self).__name__
        check_int(owner, "checkpoint_every_steps", self.checkpoint_every_steps, 1, optional=True)
        check_int(owner, "checkpoint_check_steps", self.checkpoint_check_steps, 1)
        seconds = self.checkpoint_every_seconds
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0):
            raise ConfigError(f"{owner}: checkpoint_every_seconds={seconds!r}; it must be > 0 seconds or null "
                              "(ps.checkpoint_every_seconds)")
        if seconds is not None and self.checkpoint_every_steps is not None:
            raise ConfigError(f"{owner}: checkpoint_every_steps={self.checkpoint_every_steps} and "
                              f"checkpoint_every_seconds={seconds} are both set; give one of them (the other null)")

    @property
    def prefetches(self) -> bool:
        """Whether training threads send their next batch's pulls early (async's `prefetch`)."""
        return False

    def communicator(self, client, threads: int = 1) -> Communicator:
        """The worker half over `client` for `threads` training threads."""
        raise NotImplementedError

    def dense_rule(self, optimizer: torch.optim.Optimizer) -> dict:
        """The update rule the servers apply to the dense table (the optimizer's own by default)."""
        return torch_optimizer_rule(optimizer)

    def dense_updater(self, named: Mapping[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                      communicator, table: str):
        """What a training step does with the dense gradients (recps.job.loop.DenseUpdater); `named`:
        the dense table's parameters by the names it was created with, in its order."""
        return PSDenseUpdater(list(named.values()), communicator, table)


class OnArrivalServer:
    """A server half that applies each push when it arrives, with the shard method its mode names
    (`table_verb`: "push" runs the table's update rule, "push_delta" adds); a dense push with meta
    return_values answers the values after it."""

    table_verb = ""

    def __init__(self, index: int) -> None:
        self.index = index

    def push(self, table, fields: Mapping, meta: Mapping) -> list:
        apply = getattr(table.sparse_shard("push"), self.table_verb)
        apply(fields["keys"], fields["rows"], shows=fields.get("shows"), clicks=fields.get("clicks"),
              unique=bool(meta.get("unique")))
        return []

    def push_dense(self, table, fields: Mapping, meta: Mapping) -> list:
        shard = table.dense_shard("push_dense")
        getattr(shard, self.table_verb)(table.dense_parts(fields["values"]))
        return [shard.flat()] if meta.get("return_values") else []

    def pending(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing is held between requests."""
