"""The Communicator protocol: what a worker's training threads ask of the parameter server.

Shape letters: K keys in a request, D row width, N flat dense size.

Contract, for every mode:
- `pull(table, keys)` blocks (bounded by the communicator's timeout) and returns (K, D)
  float32 rows in `keys` order. `keys` are unique int64 feature keys (the caller
  de-duplicates). Thread-safe: several training threads call it at once.
- `push(table, keys, grads)` hands (K, D) gradient rows for unique `keys` of one thread's
  batch (already summed over the batch's duplicates, scaled as the loss was: mean over
  the batch). When the update is applied is the mode's policy:
    sync  — merged over the worker's threads, sent once per step, applied by the servers
            when every worker's gradient for that step arrived;
    async — sent (merged in the background, bounded queue) and applied on arrival;
    geo   — applied locally to the worker's replica with SGD; deltas go to the servers
            every k steps.
- `pull_dense(table)` / `push_dense(table, grads)` do the same for a flat (N,) dense table.
- `step_end(thread)` marks the end of one training step of `thread` (sync: the step's
  barrier; geo: counts towards k). Every thread calls it once per step.
- `flush(timeout_s)` sends whatever is queued and waits until the servers applied it;
  `close()` flushes and releases sockets and threads. Both are idempotent.
Errors: a dead or silent server raises `recps.errors.PSTimeoutError` naming the server,
the table and the key count, within the timeout.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["Communicator"]


@runtime_checkable
class Communicator(Protocol):
    mode: str  # "sync" | "async" | "geo"

    def pull(self, table: str, keys: torch.Tensor) -> torch.Tensor: ...

    def push(self, table: str, keys: torch.Tensor, grads: torch.Tensor) -> None: ...

    def pull_dense(self, table: str) -> torch.Tensor: ...

    def push_dense(self, table: str, grads: torch.Tensor) -> None: ...

    def step_end(self, thread: int) -> None: ...

    def flush(self, timeout_s: float | None = None) -> None: ...

    def close(self) -> None: ...
