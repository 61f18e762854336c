"""GEO mode, both halves: each worker trains a local replica; every k steps it sends deltas and
pulls merged values; the servers add the deltas. `GeoMode` builds them.

Paddle's GEO-SGD semantics over one `PSClient`:

- Sparse tables. The worker keeps, per PS table, a replica of the rows it has seen: a
  `KeyIndex` key -> local slot that grows, the rows in an FBGEMM TBE's host buffer trained
  by its fused optimizer (EXACT_SGD, or EXACT_ROWWISE_ADAGRAD) in the backward pass, a copy
  of each row as last synced, and a "touched" mark. A key seen for the first time starts
  from the servers' initial value, a deterministic function of (key, seed) that the worker
  computes itself (`local_init`, when the table admits every key: no entry policy, float32):
  no network round trip per step for unseen keys, which with a large vocabulary are most keys
  of a batch. The row is marked touched, so the next sync brings what other workers made of
  it (local += merged - current keeps this worker's training; the servers create the row from
  the same initial value when its first delta arrives). Otherwise (or `local_init=False`)
  first-seen keys are pulled from the servers.
- Dense tables. The trainer's own parameters are the replica: a local torch optimizer steps
  them (`GeoDenseUpdater`); `attach_dense` tells this communicator where they are.
- Every `k_steps` worker steps (`step_end` calls, summed over the worker's threads) a delta
  sync runs. With `background_sync` (the default for k > 1, as Paddle's communicator thread) the k-th
  `step_end` only hands it to the communicator's sync thread and returns: no training thread
  waits on the network for a sync. At most one sync is in flight; a sync that falls due while
  one runs is coalesced into the next (it sends every row touched by then). A failed
  background sync (a dead server: every wait is bounded by `timeout_s`) is raised, naming the
  cause, by the next `step_end` or `flush`. Without it, the thread that ends the k-th step
  syncs itself (the other threads keep training); with one worker, k = 1 and SGD this is
  exactly local training. Either way a sync is:

      delta  = (current - synced) / W        rows touched since the last sync, all dense params
      server: value += delta                 GeoServer, the server half (no update rule)
      merged = the servers' values           after every worker's deltas so far
      local += merged - current              keeps local updates made during the sync
      synced  = merged

  Shows and clicks (the CTR statistics of a table with an accessor): each replica row sums those
  of its keys' occurrences in the batches it trained (`lookup_bags`: one show per occurrence, the
  collection's clicks; `push`: the collection's sums) and a sync sends them with the row's delta
  (the servers add them to the row's statistics as they are, not scaled); they are taken off the
  row once the push succeeded, so every occurrence counts once on the servers.

  Dividing by the W workers (as Paddle's GeoCommunicator does) makes the servers hold the
  average of the workers' models rather than their sum, which overshoots with W > 1
  (`delta_scale` overrides 1/W). With one worker, k = 1 and `background_sync=False` this is
  exactly local training (tested to 1e-5); in the background the replica trains on while a
  sync is in flight, so the k-th step's values reach the server a little later (GEO's usual
  staleness, bounded by one sync), and `flush` waits for it and syncs the rest.

Verbs of the Communicator protocol: `pull` / `push` read and train the replica (SGD or
row-wise Adagrad in torch, for PSEmbeddingCollection); `lookup_bags` is the fused path that
PSEmbeddingBagCollection uses (TBE forward; backward updates the replica in place);
`pull_dense` / `push_dense` read / SGD-step the attached dense params.

Device (`device=cuda`): the replica's rows, their optimizer state and their synced copy live on
the worker's GPU, in a CUDA TBE (EmbeddingLocation.DEVICE, ComputeDevice.CUDA) with the same fused
optimizer; the key index, the touched marks and the statistics stay on the host, where the keys
are. Slots and offsets are copied up per lookup, deltas down and merged values up per sync
(recps.device). The collection that binds this communicator places the replicas (`place_replicas`);
on the CPU every copy is the tensor itself.

Thread safety: every method may be called from several training threads. Slot assignment
(lookup + insert) holds one lock per table; the TBE's forward and backward run outside it,
Hogwild like local training. A sync writes the merged values into the rows it synced (a
read-modify-write) only while no training step is in flight (`_StepGate`): a thread is inside a
step from its first `lookup_bags` (whose backward runs the TBE's fused optimizer) or dense step to
its `step_end`, and a step that begins meanwhile waits for the write (microseconds). A backward
landing inside that write was overwritten by it: the step's update was lost for good, on the
servers too (a row of the recovery test's counting model ended with 8 of its 10 updates).
Growing a replica (capacity doubles: its rows move to larger buffers, its TBEs are rebuilt over
them) is such a write too: a backward over the old buffers, of a step whose forward came before,
trained rows the replica had left (2 threads, 2 tables, 30 fresh keys a table each step: in 60
steps each, 123-183 of a table's 3,603 rows were miscounted). A lookup whose new keys do not fit
grows the replica through the same gate, outside the replica's lock and before any side effect
(no row pulled, none inserted), then looks up again. A thread inside a step that needs a growth
steps out while it waits, so two that grow at once do not wait for each other's step_end; no
other thread grows a table its step has looked up meanwhile (with one table order in every step,
as a collection's, that never deadlocks; two threads that look up two tables in opposite orders
and both grow the other's: the first to wait raises a PSTimeoutError at the timeout). A thread that looks up one
table twice in a step, the second lookup growing it, trains the old buffers in its first lookup's
backward: its step_end adds that update to the rows' new place (_Moved).

Shapes: K keys, N keys with duplicates, U unique keys, C replica capacity (rows), D row
width, P = D rounded up to a multiple of 4 (TBE's width), B batch, Fg features of a table.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from recps.device import same_device, to_device, to_host
from recps.errors import ConfigError, PSError, PSTimeoutError
from recps.ps.modes.base import Mode, OnArrivalServer, check_int, has_accessor
from recps.ps.modes.dense import LocalDenseUpdater, load_optimizer_state
from recps.ps.modes.server_reader import ServerReader
from recps.ps.table import Initializer, KeyIndex, unique_keys, warm_up_kernels

__all__ = ["GeoMode", "GeoCommunicator", "GeoServer", "GeoDenseUpdater", "GEO_OPTIMIZERS"]

log = logging.getLogger(__name__)

GEO_OPTIMIZERS = ("sgd", "rowwise_adagrad")  # FBGEMM's fused CPU optimizers: EXACT_SGD, EXACT_ROWWISE_ADAGRAD


@dataclass
class GeoMode(Mode):
    """GEO-SGD: local replicas, deltas every k steps (see the module docstring).

    Args (besides `Mode`'s table and timeout_s; the table's optimizer is the replica's fused
    optimizer, "sgd" or "rowwise_adagrad"):
        k_steps: worker steps (over its threads) between two delta syncs; 1 syncs after every step.
        replica_capacity: initial replica rows per table (doubles as needed).
        delta_scale: factor of the rows' deltas; None: 1 / workers (Paddle's averaging).
        dense_delta_scale: factor of the dense deltas; None: 1 / workers.
        background_sync: True: delta syncs on the communicator's thread (training never waits on
            them; at most one in flight); False: the thread ending the k-th step syncs (exact for
            1 worker with k_steps 1); None: True when k_steps > 1.
        local_init: first-seen rows start from the servers' initial value computed on the worker
            (no pull per step; tables without an entry policy); False: pulled.
    """

    name = "geo"

    k_steps: int = 100
    replica_capacity: int = 1 << 16
    delta_scale: float | None = None
    dense_delta_scale: float | None = None
    background_sync: bool | None = None
    local_init: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("GeoMode", "k_steps", self.k_steps, 1)
        check_int("GeoMode", "replica_capacity", self.replica_capacity, 1)
        for knob in ("delta_scale", "dense_delta_scale"):
            value = getattr(self, knob)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ConfigError(f"GeoMode: {knob}={value!r}; it must be > 0, or null for 1 / workers (ps.{knob})")
        name = self.table.optimizer.get("name")
        if name not in GEO_OPTIMIZERS:
            raise ConfigError(f"GeoMode: the replica's sparse optimizer {name!r} is not one of {list(GEO_OPTIMIZERS)} "
                              "(FBGEMM's fused CPU optimizers); set ps.table.optimizer.name")

    def communicator(self, client, threads: int = 1) -> "GeoCommunicator":
        return GeoCommunicator(client, self)

    def dense_rule(self, optimizer: torch.optim.Optimizer) -> dict:
        """Unused: the servers only add the dense deltas; the trainer's optimizer steps the replica."""
        return {"name": "sgd", "lr": 0.01}

    def dense_updater(self, named, optimizer, communicator, table: str) -> "GeoDenseUpdater":
        communicator.attach_dense(table, named)
        return GeoDenseUpdater(list(named.values()), optimizer, communicator)


class GeoDenseUpdater(LocalDenseUpdater):
    """geo: the local torch optimizer on the shared params (LocalDenseUpdater); the communicator
    counts the steps and syncs them."""

    def __init__(self, params, optimizer: torch.optim.Optimizer, communicator) -> None:
        super().__init__(params, optimizer)
        self.communicator = communicator

    def apply(self, grads) -> None:
        self.communicator.begin_step()  # the step writes the params a sync writes too
        super().apply(grads)

    def step_end(self, thread: int) -> None:
        self.communicator.step_end(thread)

    def state_dict(self) -> dict:
        """The local dense optimizer's state (the servers never see it)."""
        with self._lock:
            return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """The saved moments and step counts; the hyperparameters stay the configured ones."""
        with self._lock:
            changed = load_optimizer_state(self.optimizer, state)
        if changed:
            log.info("geo: the dense optimizer resumes with the configured %s (the checkpoint had the former)",
                     ", ".join(changed))


class _StepGate:
    """Training steps against the folds: a sync's write of the merged values into the replicas, and
    a replica's growth (its rows move to larger buffers).

    A training thread is inside from its first update of a step (`enter`: `lookup_bags`, whose
    backward the TBE's fused optimizer runs on the rows, and a dense step) to its `step_end`
    (`leave`). `folding()` waits until no other thread is inside and keeps new steps out while it
    runs (a fold waiting goes first): no backward writes a row while a sync reads, adds to and
    writes it back, and none writes the buffers a growth has just left. A thread inside a step that
    folds (it needs a replica to grow) steps out while it waits and runs the block, and back in after
    it once no fold runs: two threads that need a growth at once do not wait for each other's
    step_end. It names the replicas its step has looked up (`holds`): no other thread grows those
    while it is out, since its forward ran over their buffers. Every wait is bounded by `timeout`
    and raises PSTimeoutError past it."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._inside = 0  # training threads inside a step, less those stepped out in a fold
        self._folds = 0  # folds waiting or running: steps that begin wait for them
        self._running = 0  # folds running: a thread stepped out goes back in only when none does
        self._held: Counter = Counter()  # replica -> threads stepped out whose step looked it up
        self._local = threading.local()  # .inside: this thread is inside a step

    def enter(self, timeout: float) -> None:
        """This thread's step updates the replica from here to `leave` (idempotent within a step)."""
        if getattr(self._local, "inside", False):
            return
        with self._cv:
            if not self._cv.wait_for(lambda: self._folds == 0, timeout):
                raise PSTimeoutError(f"geo: a training step waited {timeout:g} s for {self._folds} delta sync(s) or "
                                     "replica growth(s) to write the replica (they wait for the other threads' "
                                     "steps in flight); a training thread is stuck inside a step, or raise "
                                     "ps.timeout_s")
            self._inside += 1
        self._local.inside = True

    def leave(self) -> None:
        """This thread's step is over: its updates of the replica have landed."""
        if not getattr(self._local, "inside", False):
            return
        self._local.inside = False
        with self._cv:
            self._inside -= 1
            self._cv.notify_all()

    @contextlib.contextmanager
    def folding(self, timeout: float, what: str = "a delta sync", holds: frozenset = frozenset(),
                grows: "_Replica | None" = None):
        """For the block, no other training thread is inside a step (the calling thread may be: it
        steps out, runs the block, not a backward, and steps back in). `holds`: the replicas the
        calling thread's step looked up (its forward ran over their buffers); `grows`: the replica
        the block grows, which waits until no other thread stepped out holds it. `what` names the
        fold in the timeout errors."""
        own = getattr(self._local, "inside", False)

        def others_out() -> bool:
            if self._inside != 0:
                return False
            return grows is None or self._held[grows] == (1 if own and grows in holds else 0)

        with self._cv:
            self._folds += 1
            if own:  # out of the step while waiting: a thread waiting for this one's step_end may go on
                self._local.inside = False
                self._inside -= 1
                self._held.update(holds)
                self._cv.notify_all()
            if not self._cv.wait_for(others_out, timeout):
                self._folds -= 1
                if own:
                    self._held.subtract(holds)
                self._cv.notify_all()
                if self._inside == 0:  # others_out failed on `grows`
                    raise PSTimeoutError(f"geo: {what} waited {timeout:g} s for another training thread whose step "
                                         "looked that table up and that waits, out of its step, to grow another "
                                         "one; look the tables up in one order in every step")
                raise PSTimeoutError(f"geo: {what} waited {timeout:g} s for {self._inside} training thread(s) to end "
                                     "their step before writing the replica; a thread is stuck inside a step "
                                     "(a forward with gradients whose step_end never came?), or raise ps.timeout_s")
            self._running += 1
        try:
            yield
        finally:
            with self._cv:
                self._running -= 1
                self._folds -= 1
                self._cv.notify_all()
                if own:  # back in once no fold writes rows: its backward is still to come
                    back = self._cv.wait_for(lambda: self._running == 0, timeout)
                    self._held.subtract(holds)
                    self._cv.notify_all()
                    if not back:
                        raise PSTimeoutError(f"geo: a training step waited {timeout:g} s after {what} for "
                                             f"{self._running} other fold(s) writing the replica; a delta sync or "
                                             "growth is stuck, or raise ps.timeout_s")
                    self._inside += 1
                    self._local.inside = True


class _Full(Exception):
    """A replica's new keys do not fit: it needs `rows` rows (raised by _Replica.slots)."""

    def __init__(self, rows: int) -> None:
        super().__init__(rows)
        self.rows = rows


@dataclass
class _Moved:
    """Buffers a replica grew out of under a step's lookup, whose backward trains them still."""

    rows: torch.Tensor  # (C, P) the old buffer's rows
    state: torch.Tensor  # (C,) its row-wise Adagrad state
    slots: torch.Tensor  # (U,) the lookup's slots, unique, on the host
    rows_then: torch.Tensor  # (U, P) their rows at the growth (copied to the new buffer)
    state_then: torch.Tensor  # (U,) their state at the growth


@dataclass
class _Lookup:
    """One `lookup_bags` of a training thread's step in flight: the rows its backward trains."""

    replica: "_Replica"
    generation: int  # the replica's syncs at the lookup: one since clears the marks the step set
    slots: torch.Tensor  # (N,)
    weights: torch.Tensor  # the buffer its TBE trains
    moved: _Moved | None = None  # the replica grew since: the backward trains the old buffers


class _Replica:
    """One PS sparse table's local replica (see the module docstring)."""

    def __init__(self, name: str, dim: int, optimizer: str, lr: float, eps: float, capacity: int, client,
                 initializer: Initializer | None = None, seed: int = 0, statistics: bool = False,
                 device: torch.device = torch.device("cpu")) -> None:
        self.name, self.dim, self.client = name, dim, client
        self.device = device  # of the rows, their state and synced copy (the TBE's); the rest is on the host
        self.statistics = statistics  # the servers' table keeps shows and clicks (an accessor)
        self.initializer, self.seed = initializer, seed  # None: first-seen rows are pulled
        self.width = -(-dim // 4) * 4  # P: TBE rows are multiples of 4 wide; pad columns stay 0
        self.optimizer, self.lr, self.eps = optimizer, lr, eps
        # Row-wise Adagrad's state is mean(g^2) over P columns = (D/P) x the mean over D: rescale
        # lr and eps by sqrt(D/P) so the padding changes nothing (as recps.embeddings.local_embedding).
        scale = math.sqrt(dim / self.width) if optimizer == "rowwise_adagrad" else 1.0
        self._tbe_lr, self._tbe_eps = lr * scale, eps * scale
        self.lock = threading.Lock()
        self.index = KeyIndex(capacity)
        self.size = 0
        self.generation = 0  # syncs that cleared the marks; a step that spans one marks its rows again
        self._alloc(max(64, capacity))
        self._tbes: dict[int, object] = {}  # features -> SplitTableBatchedEmbeddingBagsCodegen

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.weights = torch.zeros(capacity * self.width, device=self.device)  # (C*P,) the TBE's buffer
        self.state = torch.zeros(capacity, device=self.device)  # (C,) row-wise Adagrad accumulator, the TBE's momentum1
        # Every write of ours goes through `.data` views: same memory, but no autograd version
        # bump, so a sync or a new row never fails another thread's TBE backward (Hogwild).
        self.rows = self.weights.data.view(capacity, self.width)  # (C, P)
        self.state_rows = self.state.data  # (C,)
        self.synced = torch.zeros(capacity, self.dim, device=self.device)  # (C, D) values at the last sync
        self.slot_keys = torch.empty(capacity, dtype=torch.int64)  # (C,)
        self.touched = torch.zeros(capacity, dtype=torch.bool)  # (C,) trained since the last sync
        counted = capacity if self.statistics else 0  # only a table with an accessor counts
        self.shows = torch.zeros(counted)  # (C,) shows not sent yet
        self.clicks = torch.zeros(counted)  # (C,) clicks not sent yet

    def grow(self, needed: int) -> None:
        """At least `needed` rows (capacity doubles): the rows move to new buffers, the TBEs are
        rebuilt over them. Call under `lock`, within the communicator's fold (no other thread
        inside a step: a backward over the old buffers would be lost)."""
        if needed <= self.capacity:
            return  # another thread grew it first
        old = (self.weights, self.state, self.synced, self.slot_keys, self.touched, self.shows, self.clicks)
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        self._alloc(capacity)
        n = self.size
        self.rows[:n].copy_(old[0].view(-1, self.width)[:n])
        self.state_rows[:n].copy_(old[1][:n])
        self.synced[:n].copy_(old[2][:n])
        self.slot_keys[:n].copy_(old[3][:n])
        self.touched[:n].copy_(old[4][:n])
        self.shows[:n].copy_(old[5][:n])
        self.clicks[:n].copy_(old[6][:n])
        self._tbes.clear()  # rebuilt over the new buffers on the next lookup
        log.debug("geo replica %s grew to %d rows", self.name, capacity)

    def tbe(self, num_features: int):
        """The TBE over this replica's buffers for lookups of `num_features` features (call under lock)."""
        tbe = self._tbes.get(num_features)
        if tbe is None:
            # deferred: FBGEMM's TBE ops, not at import: the launcher validates GeoMode without loading them.
            from fbgemm_gpu.split_embedding_configs import EmbOptimType
            from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
                BoundsCheckMode,
                EmbeddingLocation,
                PoolingMode,
            )
            from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
                ComputeDevice,
                SplitTableBatchedEmbeddingBagsCodegen,
            )

            fused = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}
            buffers = {"weights": self.weights}
            if self.optimizer == "rowwise_adagrad":
                buffers["momentum1"] = self.state
            gpu = self.device.type == "cuda"
            where = {"device": self.device} if gpu else {"preallocated_host_buffers": buffers}
            tbe = SplitTableBatchedEmbeddingBagsCodegen(
                [(self.capacity, self.width, EmbeddingLocation.DEVICE if gpu else EmbeddingLocation.HOST,
                  ComputeDevice.CUDA if gpu else ComputeDevice.CPU)],
                feature_table_map=[0] * num_features, optimizer=fused[self.optimizer],
                learning_rate=self._tbe_lr, eps=self._tbe_eps, pooling_mode=PoolingMode.SUM,
                bounds_check_mode=BoundsCheckMode.NONE, **where,
            )
            if gpu:
                # A CUDA TBE allocates its own weights_dev / momentum1_dev (buffers it reads at every
                # call): the replica's take their place, shared by its TBEs as the host buffers are.
                for name, buffer in buffers.items():
                    setattr(tbe, f"{name}_dev", buffer)
            self._tbes[num_features] = tbe
        return tbe

    def slots(self, keys: torch.Tensor, timeout: float | None) -> torch.Tensor:
        """(N,) keys -> (N,) local slots; keys seen for the first time get a row (initialized here,
        or pulled from the servers). Call under `lock`. Raises _Full, before any change or pull,
        when the new keys do not fit: the communicator grows the replica and calls again."""
        slots = self.index.lookup(keys)  # (N,)
        missing = slots < 0
        if bool(missing.any()):
            new_keys, inverse = unique_keys(keys[missing])  # (M,), (N_missing,)
            m, start = new_keys.numel(), self.size
            if start + m > self.capacity:
                raise _Full(start + m)
            if self.initializer is not None:  # the servers' initial value, computed here
                rows = self.initializer(new_keys, self.dim, self.seed)  # (M, D)
            else:
                rows = self.client.pull(self.name, new_keys, assume_unique=True).wait(timeout)  # (M, D)
            rows = to_device(rows, self.device)
            new_slots = torch.arange(start, start + m, dtype=torch.int64)
            self.rows[start:start + m, : self.dim] = rows
            self.synced[start:start + m] = rows
            self.slot_keys[start:start + m] = new_keys
            self.index.insert(new_keys, new_slots)
            if self.initializer is not None:
                self.touched[start:start + m] = True  # the next sync brings the servers' value
            self.size += m
            slots[missing] = new_slots[inverse]
        return slots

    def land(self, moved: "_Moved") -> None:
        """Add what a backward wrote into buffers this replica has left (it grew under that step's
        lookup) to the rows' new place: their values and row-wise Adagrad state now minus at the growth."""
        at = to_device(moved.slots, self.device)  # (U,)
        with self.lock:
            self.rows.index_add_(0, at, moved.rows[at] - moved.rows_then)
            self.state_rows.index_add_(0, at, moved.state[at] - moved.state_then)
            self.touched[moved.slots] = True  # the next sync sends it

    def check_statistics(self, shows: torch.Tensor | None, clicks: torch.Tensor | None, n: int) -> None:
        """PSError unless a push or lookup of `n` keys gives both shows and clicks (a table with
        statistics) or neither (one without)."""
        if self.statistics and (shows is None or clicks is None):
            raise PSError(f"geo: table {self.name!r} keeps shows and clicks (an accessor); a push or lookup of {n} "
                          f"keys gave {'no shows' if shows is None else 'no clicks'} (recps.ps.embedding counts both "
                          "from the batch)")
        if not self.statistics and (shows is not None or clicks is not None):
            raise PSError(f"geo: table {self.name!r} keeps no shows and clicks (no accessor); a push or lookup of {n} "
                          "keys gave them")

    def count(self, slots: torch.Tensor, shows: torch.Tensor | None, clicks: torch.Tensor | None) -> None:
        """Add (K,) shows and clicks to the rows at `slots` (K,), duplicates summed (call under `lock`).
        A table with statistics needs both (PSError otherwise), one without takes neither (a no-op)."""
        if not self.statistics:
            return
        self.check_statistics(shows, clicks, slots.numel())
        self.shows.index_add_(0, slots, shows.to(torch.float32))
        self.clicks.index_add_(0, slots, clicks.to(torch.float32))

    def apply_grads(self, slots: torch.Tensor, grads: torch.Tensor) -> None:
        """The local optimizer on unique `slots` (K,) with gradients (K, D), as the TBE would."""
        marked, slots, grads = slots, to_device(slots, self.device), to_device(grads, self.device)
        rows = self.rows[slots, : self.dim]  # (K, D)
        if self.optimizer == "sgd":
            rows.sub_(grads, alpha=self.lr)
        else:
            state = self.state_rows[slots] + grads.pow(2).mean(dim=1)  # (K,)
            self.state_rows[slots] = state
            rows.sub_(grads * (self.lr / (state.sqrt() + self.eps)).unsqueeze(1))
        self.rows[slots, : self.dim] = rows
        self.touched[marked] = True

    def sync(self, scale: float, timeout: float | None, fold=None) -> int:
        """Push scale * deltas of touched rows, pull the merged values, fold them in (within `fold`:
        the communicator's _StepGate.folding, no training step in flight); returns rows synced."""
        with self.lock:
            slots = self.touched[: self.size].nonzero().squeeze(1)  # (K,)
            self.touched[slots] = False  # rows trained from here on are marked again
            self.generation += 1
            keys = self.slot_keys[slots]
            # (K,) each: counted with the marks, so every count made after this belongs to a marked row
            shows, clicks = (self.shows[slots], self.clicks[slots]) if self.statistics else (None, None)
        if slots.numel() == 0:
            return 0
        at = to_device(slots, self.device)  # (K,) where the rows are
        current = self.rows[at, : self.dim]  # (K, D) a copy
        delta = current - self.synced[at]  # (K, D)
        if scale != 1.0:
            delta.mul_(scale)
        # GeoServer adds the delta, and the shows and clicks to the rows' statistics (not scaled).
        self.client.push(self.name, keys, to_host(delta), shows=shows, clicks=clicks, assume_unique=True).wait(timeout)
        if self.statistics:
            with self.lock:  # sent: off the rows (what was counted since stays for the next sync)
                self.shows.index_add_(0, slots, -shows)
                self.clicks.index_add_(0, slots, -clicks)
        merged = to_device(self.client.pull(self.name, keys, assume_unique=True).wait(timeout), self.device)  # (K, D)
        with fold or contextlib.nullcontext(), self.lock:  # a growth in between moved the buffers; slots stay valid
            now = self.rows[at, : self.dim]  # (K, D) includes training since `current` was read
            # In place: the steps' updates since `current` was read stay. No backward runs now
            # (`fold`): one landing inside this read-modify-write was overwritten, its update lost.
            self.rows[:, : self.dim].index_add_(0, at, merged - current)
            self.synced[at] = merged
            # A row trained while we synced keeps that work as its next delta: mark it again
            # (steps whose forward came before the sync's clear are re-marked in step_end too).
            self.touched[slots[to_host((now != current).any(dim=1))]] = True
        return slots.numel()


class _DenseReplica:
    """The trainer's dense parameters as the replica of one PS dense table."""

    def __init__(self, name: str, params: Mapping[str, torch.Tensor], client) -> None:
        self.name, self.client = name, client
        layout = client.dense_layout(name)
        missing = [n for n in layout.names if n not in params]
        if missing:
            raise ConfigError(f"geo: dense table {name!r} holds parameters {missing} that attach_dense did not get; "
                              f"pass every parameter of the table (it has {layout.names})")
        self.params = [params[n] for n in layout.names]  # spec order = the flat vector's order
        self.synced = self.flat()  # (N,)

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])  # (N,)

    def assign(self, flat: torch.Tensor, add: bool) -> None:
        pos = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                part = flat[pos:pos + n].view_as(p)
                p.add_(part) if add else p.copy_(part)
                pos += n

    def sync(self, scale: float, timeout: float | None, fold=None) -> None:
        """As _Replica.sync, for the dense parameters (`fold`: no dense step in flight)."""
        current = self.flat()  # (N,)
        delta = current - self.synced  # (N,)
        if scale != 1.0:
            delta.mul_(scale)
        merged = self.client.push_dense(self.name, to_host(delta), return_values=True).wait(timeout)  # GeoServer adds it
        merged = to_device(merged, current.device)  # (N,) where the params are
        with fold or contextlib.nullcontext():
            self.assign(merged - current, add=True)
        self.synced = merged


class GeoCommunicator:
    """GEO over one PSClient with `mode`'s knobs (GeoMode); see the module docstring.

    Args:
        client: the worker's PSClient (tables created already, or created by another worker).
        mode: k_steps, the replica's optimizer (mode.table.optimizer), replica_capacity, timeout_s,
            delta scales (None: 1 / the client's num_workers), background_sync, local_init.
        dense_lr: SGD rate of `push_dense` (protocol callers; the trainer steps its own optimizer).
    """

    mode = "geo"

    def __init__(self, client, mode: GeoMode, dense_lr: float = 0.01) -> None:
        opt = dict(mode.table.optimizer)
        self._opt_name, self._lr, self._eps = opt["name"], float(opt.get("lr", 0.01)), float(opt.get("eps", 1e-8))
        self.client = client
        self.k_steps = mode.k_steps
        self.dense_lr = float(dense_lr)
        self.capacity = mode.replica_capacity
        self.timeout_s = float(mode.timeout_s)
        average = 1.0 / max(1, int(getattr(client, "num_workers", 1)))
        self.delta_scale = average if mode.delta_scale is None else float(mode.delta_scale)
        self.dense_delta_scale = average if mode.dense_delta_scale is None else float(mode.dense_delta_scale)
        self._replicas: dict[str, _Replica] = {}
        self.device = torch.device("cpu")  # of the replicas' rows (place_replicas)
        self._dense: dict[str, _DenseReplica] = {}
        self._lock = threading.Lock()  # replicas dict, step counter
        self._sync_lock = threading.Lock()  # one sync at a time
        self._steps = 0
        self.syncs = 0
        self._closed = False
        self._local = threading.local()  # per training thread: rows its step in flight trains
        self._gate = _StepGate()  # training steps in flight vs a sync's write of merged values
        self.background_sync = self.k_steps > 1 if mode.background_sync is None else bool(mode.background_sync)
        self.local_init = bool(mode.local_init)
        if self.local_init:
            # The initializer's compiled loop (~1 CPU-s to load), now: replicas are made at the first batch.
            warm_up_kernels()
        # Background sync: `_due` (a sync was asked for) and `_in_flight` under `_cv`; the first
        # error of the sync thread stays in `_error` and is raised by every later step_end / flush.
        self._cv = threading.Condition()
        self._due = False
        self._in_flight = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # -- replicas ------------------------------------------------------------------------------

    def _replica(self, table: str) -> _Replica:
        replica = self._replicas.get(table)
        if replica is None:
            with self._lock:
                replica = self._replicas.get(table)
                if replica is None:
                    spec = self.client.table_spec(table)
                    if spec["kind"] != "sparse":
                        raise ConfigError(f"geo: table {table!r} is {spec['kind']}; pull/push take sparse tables")
                    initializer = None
                    if self.local_init and spec.get("entry") is None and spec.get("dtype", "float32") == "float32":
                        initializer = Initializer(**spec["initializer"])
                    replica = _Replica(table, int(spec["dim"]), self._opt_name, self._lr, self._eps,
                                       self.capacity, self.client, initializer, int(spec.get("seed", 0)),
                                       statistics=bool(spec.get("accessor")), device=self.device)
                    self._replicas[table] = replica
        return replica

    def place_replicas(self, device: str | torch.device) -> None:
        """The sparse replicas live on `device` (a collection binding this communicator calls it with
        its own); before the first lookup. Raises PSError when replicas exist on another device."""
        device = torch.device(device)
        if same_device(device, self.device):
            return
        with self._lock:
            if self._replicas:
                raise PSError(f"geo: the replicas of tables {sorted(self._replicas)} live on {self.device}; a "
                              f"collection on {device} cannot train them; bind collections of one device to "
                              "this communicator (device= of recps.ps.embedding's collections)")
            self.device = device

    def attach_dense(self, table: str, params: Mapping[str, torch.Tensor]) -> None:
        """Use `params` (name -> the trainer's shared tensors, every parameter of dense table
        `table`) as that table's replica; their current values count as synced."""
        self._dense[table] = _DenseReplica(table, params, self.client)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """What the replicas hold that the servers do not: per table the keys seen and their
        row-wise Adagrad accumulators (SGD: zeros). Call between steps (after `flush`)."""
        out = {}
        for name, replica in list(self._replicas.items()):
            with replica.lock:
                n = replica.size
                out[name] = {"keys": replica.slot_keys[:n].clone(), "state": to_host(replica.state_rows[:n]).clone()}
        return out

    def load_state_dict(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Replicas as `state_dict` left them: the keys (their values pulled from the servers,
        counted as synced) with their accumulators. Call before training."""
        for name, saved in state.items():
            keys, accumulators = saved["keys"], saved["state"]
            if keys.numel() == 0:
                continue
            replica = self._replica(name)
            values = to_device(self.client.pull(name, keys, assume_unique=True).wait(self.timeout_s),
                               replica.device)  # (K, D)

            def restore(slots: torch.Tensor) -> None:
                at = to_device(slots, replica.device)
                replica.rows[at, : replica.dim] = values
                replica.synced[at] = values
                replica.touched[slots] = False
                replica.state_rows[at] = to_device(accumulators, replica.device)

            self._with_slots(replica, keys, restore)

    def replica_rows(self, table: str) -> int:
        """Rows the replica of `table` holds (the worker's share of the table, never all of it)."""
        replica = self._replicas.get(table)
        return 0 if replica is None else replica.size

    def _pending(self) -> list[_Lookup]:
        """The calling thread's lookups in its step in flight (their backward is still to land)."""
        pending = getattr(self._local, "pending", None)
        if pending is None:
            pending = self._local.pending = []
        return pending

    def _with_slots(self, replica: _Replica, keys: torch.Tensor, work):
        """work((N,) slots of `keys`) under the replica's lock (keys seen for the first time get
        rows); returns what it returns. New keys that do not fit grow the replica first, outside
        the lock (`_grow`), and are looked up again."""
        while True:
            with replica.lock:
                try:
                    slots = replica.slots(keys, self.timeout_s)  # (N,)
                except _Full as full:
                    needed = full.rows
                else:
                    return work(slots)
            self._grow(replica, needed)

    def _grow(self, replica: _Replica, needed: int) -> None:
        """`replica` holds at least `needed` rows. A fold (_StepGate): no other thread is inside a
        step, whose backward would train the buffers the rows leave; this thread's own lookups of
        the replica in its step (its second lookup of one table) are landed by step_end (_Moved).
        Never called under a replica's lock: the fold waits for the other threads' steps."""
        pending = self._pending()
        holds = frozenset(lookup.replica for lookup in pending)
        with self._gate.folding(self.timeout_s, f"a growth of replica {replica.name!r} to {needed} rows", holds,
                                grows=replica), replica.lock:
            if needed <= replica.capacity:
                return  # another thread grew it
            for lookup in pending:
                if lookup.replica is replica and lookup.weights is replica.weights:
                    slots = torch.unique(lookup.slots)  # (U,)
                    at = to_device(slots, replica.device)
                    lookup.moved = _Moved(replica.rows, replica.state_rows, slots, replica.rows[at],
                                          replica.state_rows[at])
            replica.grow(needed)

    # -- Communicator protocol -----------------------------------------------------------------

    def pull(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        """(K,) keys -> (K, D) replica rows (new keys pulled from the servers first)."""
        replica = self._replica(table)

        def read(slots: torch.Tensor) -> torch.Tensor:
            return replica.rows[to_device(slots, replica.device), : replica.dim]  # (K, D) a copy, where the replica is

        return self._with_slots(replica, keys, read)

    def server_reader(self) -> ServerReader:
        """A read-only view of this communicator's servers (ReadsServers): evaluation, frozen tables."""
        return ServerReader(self.client, timeout_s=self.timeout_s)

    def counts_statistics(self, table: str) -> bool:
        """Whether `table` keeps shows and clicks (its servers' table has an accessor)."""
        replica = self._replicas.get(table)
        return replica.statistics if replica is not None else has_accessor(self.client, table)

    def push(self, table: str, keys: torch.Tensor, grads: torch.Tensor, shows: torch.Tensor | None = None,
             clicks: torch.Tensor | None = None) -> None:
        """The local optimizer on (K,) unique keys' rows with gradients (K, D); their (K,) shows
        and clicks (both for a table with statistics, else neither) go with the next sync."""
        replica = self._replica(table)
        replica.check_statistics(shows, clicks, keys.numel())

        def train(slots: torch.Tensor) -> None:
            replica.apply_grads(slots, grads.to(torch.float32))
            replica.count(slots, shows, clicks)

        self._with_slots(replica, keys, train)

    def lookup_bags(self, table: str, keys: torch.Tensor, offsets: torch.Tensor, num_features: int,
                    shows: torch.Tensor | None = None, clicks: torch.Tensor | None = None) -> torch.Tensor:
        """Fused path: (N,) keys, (Fg*B+1,) offsets -> pooled (B, Fg*D); the backward pass runs the
        TBE's fused optimizer on the replica. The N keys' (N,) shows and clicks (both for a table
        with statistics, else neither) are sent with the next sync."""
        training = torch.is_grad_enabled()
        if training:  # a backward will update the rows: this thread is inside a step
            self.begin_step()
        replica = self._replica(table)
        replica.check_statistics(shows, clicks, keys.numel())

        def claim(slots: torch.Tensor) -> tuple:
            replica.touched[slots] = True
            replica.count(slots, shows, clicks)
            return slots, replica.tbe(num_features), replica.generation, replica.weights

        slots, tbe, generation, weights = self._with_slots(replica, keys, claim)  # (N,) ...
        if training:
            # The fused update lands in backward, after this mark: if a sync clears the marks in
            # between, step_end (called after backward by this thread) marks the rows again.
            self._pending().append(_Lookup(replica, generation, slots, weights))
        pooled = tbe(to_device(slots, replica.device), to_device(offsets, replica.device))  # (B, Fg*P)
        if replica.width != replica.dim:
            batch = pooled.shape[0]
            pooled = pooled.view(batch, num_features, replica.width)[:, :, : replica.dim]  # (B, Fg, D)
            pooled = pooled.reshape(batch, num_features * replica.dim)  # (B, Fg*D)
        return pooled

    def pull_dense(self, table: str) -> torch.Tensor:
        dense = self._dense.get(table)
        if dense is None:
            return self.client.pull_dense(table).wait(self.timeout_s)
        return dense.flat()

    def push_dense(self, table: str, grads: torch.Tensor) -> None:
        dense = self._dense.get(table)
        if dense is None:
            raise PSError(f"geo: dense table {table!r} has no local replica; call attach_dense first")
        dense.assign(grads.reshape(-1).to(torch.float32) * -self.dense_lr, add=True)

    def begin_step(self) -> None:
        """The calling thread's step updates the replicas from here to its `step_end` (lookup_bags
        calls it; a dense updater before its step): a sync's write of merged values waits for it."""
        self._gate.enter(self.timeout_s)

    def step_end(self, thread: int) -> None:
        """Counts one worker step; the k-th starts a sync (on the sync thread, or in this thread
        without `background_sync`). Call it from the thread that trained the step, after its
        backward pass. Raises the error of a failed background sync."""
        pending = self._pending()
        for lookup in pending:  # inside the step still: no fold runs
            if lookup.moved is not None:
                lookup.replica.land(lookup.moved)
            if lookup.replica.generation != lookup.generation:
                with lookup.replica.lock:
                    lookup.replica.touched[lookup.slots] = True
        pending.clear()
        self._gate.leave()  # this step's updates have landed: a sync may write the rows
        if self._error is not None:
            self._raise_background_error()
        with self._lock:
            self._steps += 1
            due = self._steps % self.k_steps == 0
        if not due:
            return
        if self.background_sync:
            self._request_sync()
        else:
            self.sync()

    def sync(self) -> int:
        """Push the deltas of every replica, pull merged values back (in the calling thread);
        returns the sparse rows synced."""
        with self._sync_lock:
            rows = sum(r.sync(self.delta_scale, self.timeout_s, self._gate.folding(self.timeout_s))
                       for r in list(self._replicas.values()))
            for dense in list(self._dense.values()):
                dense.sync(self.dense_delta_scale, self.timeout_s, self._gate.folding(self.timeout_s))
            self.syncs += 1
            return rows

    # -- background sync -----------------------------------------------------------------------

    def _request_sync(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._due = True  # coalesces with a request not yet started
            if self._thread is None:
                self._thread = threading.Thread(target=self._sync_loop, name="geo-sync", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _sync_loop(self) -> None:
        while True:
            with self._cv:
                while not self._due and not self._closed:
                    self._cv.wait(timeout=1.0)  # re-checks `_closed` at least once a second
                if not self._due:
                    return
                self._due, self._in_flight = False, True
            try:
                self.sync()
            except BaseException as err:  # noqa: BLE001 - handed to the training threads
                log.error("geo: background delta sync failed: %s", err)
                with self._cv:
                    self._error = err
                    self._in_flight = False
                    self._cv.notify_all()
                return
            with self._cv:
                self._in_flight = False
                self._cv.notify_all()

    def _wait_bound(self) -> float:
        """Seconds a sync may take: each of its waits is bounded by the timeout (push and pull per
        sparse table, one per dense table), plus one for the work between them."""
        timeout = self.timeout_s if self.timeout_s is not None else float(getattr(self.client, "timeout_s", 60.0))
        return timeout * (2 * len(self._replicas) + len(self._dense) + 1)

    def wait_sync(self, timeout_s: float | None = None) -> None:
        """Block until no background sync is requested or in flight (at most `timeout_s`; None:
        the bound of one sync's waits); raises the error of a failed one."""
        bound = self._wait_bound() if timeout_s is None else float(timeout_s)
        with self._cv:
            idle = self._cv.wait_for(lambda: self._error is not None or not (self._due or self._in_flight), bound)
        if self._error is not None:
            self._raise_background_error()
        if not idle:
            raise PSTimeoutError(f"geo: the background delta sync did not finish within {bound:.0f} s "
                                 f"(tables {sorted(self._replicas) + sorted(self._dense)}, servers "
                                 f"{getattr(self.client, 'endpoints', '?')}); check that every server is up "
                                 "or raise ps.timeout_s")

    def _raise_background_error(self) -> None:
        err = self._error
        cls = PSTimeoutError if isinstance(err, TimeoutError) else PSError
        raise cls(f"geo: the background delta sync failed: {err}") from err

    def flush(self, timeout_s: float | None = None) -> None:
        """The last deltas go to the servers: waits for a background sync in flight, then syncs
        (in this thread). Raises the error of a failed background sync."""
        if self._closed:
            return
        if self.background_sync:
            self.wait_sync(timeout_s)
        self.sync()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()


# ---------------------------------------------------------------------------------- server half


class GeoServer(OnArrivalServer):
    """GEO's server half (recps.ps.node.server.ServerHalf): a push's rows are deltas, added to the
    values (value += delta, no update rule; rows created at their initial value first); a dense
    push adds its deltas and, with meta return_values, answers the merged values."""

    table_verb = "push_delta"


GeoMode.server_half = GeoServer  # defined after the mode: the module reads worker half first
