"""SparseTable: one shard of a sparse parameter table (int64 key -> embedding row).

A row holds the embedding (D values, float32 or float16), the update rule's state
(S float32 columns) and statistics (M float32 columns: show, click, unseen_days,
delta_score, dirty with an accessor; only dirty without). Rows live in growable
column-block arrays addressed by slot; a `KeyIndex` maps keys to slots.

    keys  (C,)     int64      key of each slot
    live  (C,)     bool       slot holds a row
    rows  (C, W)   float32    [values (D, only if float32) | state (S) | meta (M)]
    half  (C, D)   float16    values, only with dtype=float16

Values, state and statistics of one row sit together in `rows`, so an update is one
gather and one scatter, and a save copies each row's value and state atomically.

Verbs (K keys in a request; duplicates allowed):
    pull(keys) -> (K, D) float32     creates missing rows per the entry policy
    push(keys, grads)                duplicates summed, then the update rule
    push_delta(keys, deltas)         GEO: value += delta, state untouched
    shrink() -> int                  decay statistics, delete rows, return how many
    save(path, mode) / load(path)    full | delta | base | batch, re-sharded by `partition`

Two tiers (`memory_budget=`, issue 31): rows beyond the budget live in a disk store
(recps.ps.table.tier.ColdStore, RocksDB), each row in exactly one tier. Before a verb runs, the
request's keys that miss memory are fetched from disk in one multi-get and their rows (values,
rule state, statistics) are created in memory as they were, then deleted from disk; the verb then
runs the RAM-only code unchanged; after it, if memory holds more than the budget, the least recently
used rows (ties within a request broken by the lower accessor score) move to disk, down to 15/16 of
the budget. `save`, `shrink`, `load`, `keys`, `contains`, `state`, `stats` and `len` see both tiers;
a save of a tiered table holds the lock throughout (a row may not move while the tiers are scanned).
Without a budget no line of the tier runs (an `is None` test in each verb and in row creation).

Thread safety: every public method may be called from any thread. pull, push,
push_delta, shrink and load are atomic with respect to each other (one lock). save copies
rows in chunks under that lock, releasing it between chunks, so updates continue during a
save; each saved row's value, state and statistics come from the same update, and a row
updated after its chunk was copied appears with its older value. shrink and load wait for
a running save. A save changes statistics (delta_score, unseen_days) only after its shard
was committed: a save that failed, and its retry, select the same rows.

>>> table = SparseTable(dim=4, optimizer=SGDRule(lr=0.5), initializer=Initializer("zeros"))
>>> keys = torch.tensor([3, 3, -1])
>>> table.pull(keys).shape
torch.Size([3, 4])
>>> table.push(keys, torch.ones(3, 4))
2
>>> table.pull(torch.tensor([3, -1]))[:, 0].tolist()
[-1.0, -0.5]
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import torch
import torch.nn.functional as F

from recps.errors import ConfigError
from recps.ps.table._memory import alloc
from recps.ps.table._kernels import DELTA, RULE_CODES, apply_rule
from recps.ps.table.accessor import (
    CountFilterEntry,
    CtrAccessor,
    Entry,
    ProbabilityEntry,
    meta_columns,
)
from recps.ps.table.checkpoint import (
    CheckpointError,
    ShardReader,
    ShardWriter,
    list_shards,
)
from recps.ps.table.hashing import PARTITION_SCHEME, Initializer, partition
from recps.ps.table.key_index import KeyIndex
from recps.ps.table.keys import as_keys, unique_keys
from recps.ps.table.optimizers import SGDRule, UpdateRule
from recps.ps.table.tier import HOLD_EVICTION_ENV, ColdStore, hold_eviction

__all__ = ["SparseTable", "SAVE_MODES"]

_log = logging.getLogger(__name__)

SAVE_MODES = ("full", "delta", "base", "batch")  # Paddle's save modes 0, 1, 2, 3
_WHOLE = ("full", "batch")  # modes that write the whole shard: rows, state, deleted keys, candidates
_MIN_ROWS = 1024
_GROWTH = 1.5
_SAVE_CHUNK_ROWS = 1 << 20
_PENDING_COLS = 2  # pending count-filter candidates: [sightings, unseen_days]


def _as_rows(x: torch.Tensor, k: int, d: int, what: str, where: str) -> torch.Tensor:
    x = torch.as_tensor(x)
    if tuple(x.shape) != (k, d):
        raise ConfigError(f"{where}: {what} has shape {tuple(x.shape)}, expected ({k}, {d}) for {k} keys of dim {d}")
    if not x.is_floating_point():
        raise ConfigError(f"{where}: {what} has dtype {x.dtype}; pass floating-point values")
    return x.to(torch.float32).contiguous()


def _as_counts(x: torch.Tensor | None, k: int, what: str, where: str) -> torch.Tensor | None:
    if x is None:
        return None
    x = torch.as_tensor(x, dtype=torch.float32)
    if tuple(x.shape) != (k,):
        raise ConfigError(f"{where}: {what} has shape {tuple(x.shape)}, expected ({k},)")
    return x


def _grown(t: torch.Tensor, capacity: int, used: int) -> torch.Tensor:
    """A larger array holding t[:used]; the tail stays untouched (no resident memory)."""
    out = alloc((capacity, *t.shape[1:]), t.dtype)
    out[:used].copy_(t[:used])
    return out


class _Pending:
    """Count-filter candidates: keys seen but not admitted yet, with [sightings, unseen_days]."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.index = KeyIndex()
        self.keys = torch.empty(0, dtype=torch.int64)
        self.data = torch.empty(0, _PENDING_COLS, dtype=torch.float32)  # (P, 2)
        self.used = 0

    def __len__(self) -> int:
        return int((self.data[: self.used, 0] >= 0).sum())

    def add(self, keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Record counts (U,) sightings of unique keys (U,); returns their totals (U,)."""
        slots = self.index.lookup(keys)  # (U,)
        new = slots < 0
        n_new = int(new.sum())
        if n_new:
            if self.used + n_new > self.keys.numel():
                cap = max(_MIN_ROWS, int((self.used + n_new) * _GROWTH))
                self.keys = _grown(self.keys, cap, self.used)
                self.data = _grown(self.data, cap, self.used)
            fresh = torch.arange(self.used, self.used + n_new, dtype=torch.int64)
            self.keys[fresh] = keys[new]
            self.data[fresh] = 0.0
            self.index.insert(keys[new], fresh)
            slots[new] = fresh
            self.used += n_new
        rows = self.data[slots]  # (U, 2)
        rows[:, 0].clamp_(min=0.0).add_(counts.to(torch.float32))  # admitted (-1) restarts at 0
        rows[:, 1] = 0.0
        self.data[slots] = rows
        return rows[:, 0]

    def forget(self, keys: torch.Tensor) -> None:
        """Mark admitted keys (count -1); they are dropped at the next compaction."""
        slots = self.index.lookup(keys)
        slots = slots[slots >= 0]
        self.data[slots, 0] = -1.0

    def day_end(self, decay: float, max_unseen: float) -> None:
        """Decay counts, drop admitted and stale candidates, add an unseen day; compacts."""
        data = self.data[: self.used]
        keep = (data[:, 0] >= 0) & (data[:, 1] <= max_unseen)  # (P,)
        keys, kept = self.keys[: self.used][keep], data[keep]
        kept[:, 0] *= decay
        kept[:, 1] += 1.0
        self.restore(keys, kept)

    def restore(self, keys: torch.Tensor, data: torch.Tensor) -> None:
        self.clear()
        n = keys.numel()
        self.keys = keys.clone()
        self.data = data.clone()
        self.used = n
        self.index = KeyIndex(n)
        self.index.insert(self.keys, torch.arange(n, dtype=torch.int64))

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.data[: self.used]
        alive = data[:, 0] >= 0
        return self.keys[: self.used][alive].clone(), data[alive].clone()


class SparseTable:
    """One shard of a sparse table; see the module docstring for layout and thread safety.

    Args:
        dim: embedding width D.
        optimizer: update rule applied by `push` (default SGDRule(lr=0.01)).
        initializer: initial values, a function of (key, seed) (default uniform +-0.01).
        seed: table seed; replicas with equal seeds create equal rows.
        accessor: CtrAccessor for statistics, shrink and score-filtered saves; None keeps
            only the dirty flag (delta saves still work; shrink refuses).
        entry: admission policy (CountFilterEntry / ProbabilityEntry); None admits all keys.
        dtype: value storage, torch.float32 or torch.float16 (or "float32"/"float16");
            arithmetic is float32.
        capacity: expected rows; reserves buckets and address space up front.
        name: used in error messages and manifests.
        memory_budget: None keeps every row in memory. A row count >= 1 adds a disk tier (see
            "Two tiers" in the module docstring): about that many rows stay in memory, the rest
            live in an embedded RocksDB store (recps.ps.table.tier).
        tier_dir: the folder the disk tier's store is created in (None: $RECPS_TIER_DIR, else
            the temp folder); the store is removed with the table (`close()`).
    """

    def __init__(
        self,
        dim: int,
        optimizer: UpdateRule | None = None,
        initializer: Initializer | None = None,
        seed: int = 0,
        accessor: CtrAccessor | None = None,
        entry: Entry | None = None,
        dtype: torch.dtype | str = torch.float32,
        capacity: int = 0,
        name: str = "sparse",
        memory_budget: int | None = None,
        tier_dir: str | None = None,
    ) -> None:
        if isinstance(dtype, str):  # from a config file
            dtype = {"float32": torch.float32, "float16": torch.float16, "fp32": torch.float32, "fp16": torch.float16}.get(dtype, dtype)
        if int(dim) != dim or dim < 1:
            raise ConfigError(f"SparseTable {name}: dim={dim}; it must be an integer >= 1")
        if dtype not in (torch.float32, torch.float16):
            raise ConfigError(f"SparseTable {name}: dtype={dtype}; use torch.float32 or torch.float16")
        optimizer = SGDRule() if optimizer is None else optimizer
        if not isinstance(optimizer, UpdateRule):
            raise ConfigError(f"SparseTable {name}: optimizer={optimizer!r} is not an UpdateRule; use e.g. AdagradRule(lr=0.05)")
        if entry is not None and not isinstance(entry, (CountFilterEntry, ProbabilityEntry)):
            raise ConfigError(f"SparseTable {name}: entry={entry!r}; use CountFilterEntry or ProbabilityEntry")
        if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, int)
                                          or memory_budget < 1):
            raise ConfigError(f"SparseTable {name}: memory_budget={memory_budget!r}; give a row count >= 1 "
                              "(ps.table.memory_budget also takes a size such as 4GiB), or None for RAM only")
        self.name = name
        self.dim = int(dim)
        self.dtype = dtype
        self.rule = optimizer
        self.initializer = Initializer() if initializer is None else initializer
        self.seed = int(seed)
        self.accessor = accessor
        self.entry = entry
        self.meta_columns = meta_columns(accessor is not None)
        self._state_width = optimizer.state_width(self.dim)
        self._fused_values = dtype == torch.float32
        self._vcols = self.dim if self._fused_values else 0
        self._scol = self._vcols  # first state column in rows
        self._mcol = self._scol + self._state_width  # first meta column
        self._width = self._mcol + len(self.meta_columns)
        self._col = {c: self._mcol + i for i, c in enumerate(self.meta_columns)}
        self._rule_code = RULE_CODES.get(optimizer.name)  # None: no compiled update for this rule
        # Statistics columns in a disk-tier row [values | state | meta]
        self._cold_col = {c: self.dim + self._state_width + i for i, c in enumerate(self.meta_columns)}
        self._lock = threading.RLock()
        self._save_lock = threading.Lock()
        self._generator = torch.Generator().manual_seed(self.seed)
        self.memory_budget = memory_budget
        self._cold: ColdStore | None = None
        if memory_budget is not None:
            self._cold = ColdStore(self.dim + self._state_width + len(self.meta_columns), name, tier_dir)
            self._clock = 1  # recency: a row's tick is the clock of the last request that touched it
            self._tier_counts = dict.fromkeys(("memory_hits", "disk_hits", "promotions", "evictions"), 0)
            self._hold = os.environ.get(HOLD_EVICTION_ENV) or None  # a test hook (recps.ps.table.tier)
            capacity = min(int(capacity), memory_budget)  # memory never holds the whole table
        self._reset(int(capacity))

    # ------------------------------------------------------------------ storage

    def _reset(self, capacity: int) -> None:
        cap = max(_MIN_ROWS, capacity)
        self._index = KeyIndex(capacity)
        self._keys = alloc((cap,), torch.int64)
        self._live = torch.zeros(cap, dtype=torch.bool)
        self._rows = alloc((cap, self._width), torch.float32)
        self._half = alloc((cap, self.dim), torch.float16) if not self._fused_values else None
        self._used = 0  # high-water mark of slots ever handed out
        self._free = torch.empty(0, dtype=torch.int64)  # slots freed by shrink, reused first
        self._size = 0
        self._pending = _Pending()
        self._deleted: list[torch.Tensor] = []  # keys deleted since the last delta/base save
        if self._cold is not None:
            self._tick = torch.zeros(cap, dtype=torch.int64)  # (C,) recency of each slot's row
            if self._cold.rows:
                self._cold.clear()

    @property
    def capacity(self) -> int:
        return self._keys.numel()

    def __len__(self) -> int:
        """Rows in the table (both tiers)."""
        return self._size if self._cold is None else self._size + self._cold.rows

    def memory_bytes(self) -> int:
        """Bytes of the table's arrays and buckets at current capacity (reserved, not resident)."""
        n = self._keys.numel() * 8 + self._live.numel() + self._rows.numel() * 4 + self._index.nbytes
        if self._half is not None:
            n += self._half.numel() * 2
        return n

    def reserve(self, rows: int) -> None:
        """Make room for `rows` rows in total without further resizes (buckets and row
        arrays; untouched capacity costs address space, not resident memory)."""
        with self._lock:
            if self._cold is not None:
                rows = min(rows, self.memory_budget)
            self._reserve(max(0, rows - self._used))
            self._index.reserve(rows)

    def _reserve(self, n_new: int) -> None:
        need = self._used + n_new
        if need <= self.capacity:
            return
        cap = max(need, int(self.capacity * _GROWTH))
        used = self._used
        self._keys = _grown(self._keys, cap, used)
        live = torch.zeros(cap, dtype=torch.bool)
        live[:used] = self._live[:used]
        self._live = live
        self._rows = _grown(self._rows, cap, used)
        if self._half is not None:
            self._half = _grown(self._half, cap, used)
        if self._cold is not None:
            tick = torch.zeros(cap, dtype=torch.int64)
            tick[:used] = self._tick[:used]
            self._tick = tick

    def _take_slots(self, n: int) -> tuple[torch.Tensor, int]:
        """n free slots: freed ones first, then fresh ones past the high-water mark.
        Returns (slots (n,), first) where first >= 0 means slots == first + arange(n)."""
        reuse = min(n, self._free.numel())
        taken = self._free[self._free.numel() - reuse :]
        self._free = self._free[: self._free.numel() - reuse]
        fresh = n - reuse
        first = self._used if reuse == 0 else -1
        if fresh:
            self._reserve(fresh)
            taken = torch.cat([taken, torch.arange(self._used, self._used + fresh, dtype=torch.int64)])
            self._used += fresh
        return taken, first

    def _create(
        self,
        keys: torch.Tensor,
        values: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        meta: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows for (U,) unique absent keys; initial values/state/meta unless given. -> (U,) slots."""
        u = keys.numel()
        slots, first = self._take_slots(u)
        # Fresh slots form a range: fill the rows in place instead of a gather-free scatter.
        block = self._rows[first : first + u] if first >= 0 else torch.empty(u, self._width)  # (U, W)
        if self._fused_values:
            if values is None:
                self.initializer(keys, self.dim, self.seed, out=block[:, : self.dim])
            else:
                block[:, : self.dim] = values
        else:
            if values is None:
                values = self.initializer(keys, self.dim, self.seed)  # (U, D)
            self._half.index_copy_(0, slots, values.to(torch.float16))
        if state is None:
            block[:, self._scol : self._mcol] = self.rule.initial_state_value()
        else:
            block[:, self._scol : self._mcol] = state
        if meta is None:
            block[:, self._mcol :] = 0.0
            block[:, self._col["dirty"]] = 1.0
        else:
            block[:, self._mcol :] = meta
        if first < 0:
            self._rows.index_copy_(0, slots, block)
        self._keys.index_copy_(0, slots, keys)
        self._live[slots] = True
        self._index.insert(keys, slots)
        self._size += u
        if self._cold is not None:
            self._tick[slots] = self._clock
        return slots

    def _delete(self, slots: torch.Tensor) -> None:
        """Remove rows at (X,) slots and rebuild the key index."""
        if slots.numel() == 0:
            return
        self._deleted.append(self._keys[slots].clone())
        self._live[slots] = False
        self._free = torch.cat([self._free, slots])
        self._size -= slots.numel()
        self._index.retain(self._live)

    def _values_at(self, slots: torch.Tensor) -> torch.Tensor:
        """(R,) valid slots -> (R, D) float32 values."""
        if self._fused_values:
            return self._rows[:, : self.dim].index_select(0, slots)  # contiguous (R, D)
        return self._half.index_select(0, slots).to(torch.float32)

    # ------------------------------------------------------------------ admission

    def _admit(self, keys: torch.Tensor) -> torch.Tensor:
        """(K,) keys without a row (duplicates allowed) -> (K,) slots, -1 where not admitted."""
        uniq, inverse, counts = unique_keys(keys, counts=True)
        if self.entry is None:
            admitted = torch.ones(uniq.numel(), dtype=torch.bool)
        elif isinstance(self.entry, CountFilterEntry):
            totals = self._pending.add(uniq, counts)  # (U,)
            admitted = totals >= self.entry.count
            if bool(admitted.any()):
                self._pending.forget(uniq[admitted])
        else:
            # Each sighting is an independent chance: P(admit) = 1 - (1 - p)^count.
            p_admit = 1.0 - torch.pow(1.0 - self.entry.probability, counts.to(torch.float64))
            admitted = torch.rand(uniq.numel(), generator=self._generator, dtype=torch.float64) < p_admit
        slots_u = torch.full((uniq.numel(),), -1, dtype=torch.int64)
        if bool(admitted.any()):
            slots_u[admitted] = self._create(uniq[admitted])
        return slots_u[inverse]

    def _slots(self, keys: torch.Tensor, create: bool) -> torch.Tensor:
        slots = self._index.lookup(keys)  # (K,)
        if create:
            missing = (slots < 0).nonzero().squeeze(1)  # (X,)
            if missing.numel():
                slots[missing] = self._admit(keys[missing])
        return slots

    # ------------------------------------------------------------------ two tiers

    def _payload(self, slots: torch.Tensor) -> torch.Tensor:
        """(R,) slots -> (R, D + S + M) float32 rows as the disk tier stores them."""
        rows = self._rows.index_select(0, slots)  # (R, W)
        if self._fused_values:
            return rows
        return torch.cat([self._half.index_select(0, slots).to(torch.float32), rows], 1)

    def _split(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(R, D + S + M) disk rows -> values (R, D), state (R, S), meta (R, M)."""
        d, s = self.dim, self._state_width
        return payload[:, :d], payload[:, d : d + s], payload[:, d + s :]

    def _promote(self, keys: torch.Tensor, count: bool = True) -> None:
        """Move the rows of (K,) keys that live on disk into memory (one multi-get, one batched
        delete) and mark every requested row as just used. `count`: add to the hit statistics."""
        slots = self._index.lookup(keys)  # (K,)
        hit = slots >= 0
        n_hit = int(hit.sum())
        self._tick[slots[hit]] = self._clock
        counts = self._tier_counts
        if n_hit < keys.numel():
            uniq, _, occurrences = unique_keys(keys[~hit], counts=True)  # (X,)
            found, payload = self._cold.get(uniq)  # (X,) (F, D + S + M)
            if bool(found.any()):
                moved = uniq[found]
                values, state, meta = self._split(payload)
                new = self._create(moved, values=values, state=state, meta=meta)  # ticked now
                try:
                    self._cold.delete(moved)
                except BaseException:
                    self._drop(new)  # each row in exactly one tier: it stays on disk
                    raise
                if count:
                    counts["disk_hits"] += int(occurrences[found].sum())
                counts["promotions"] += moved.numel()
        if count:
            counts["memory_hits"] += n_hit
        self._clock += 1

    def _drop(self, slots: torch.Tensor) -> None:
        """Remove rows at (X,) slots from memory without deleting them from the table (they are
        on disk): not recorded as deleted keys."""
        self._live[slots] = False
        self._free = torch.cat([self._free, slots])
        self._size -= slots.numel()
        self._index.retain(self._live)

    def _evict(self) -> None:
        """Past the memory budget, move the least recently used rows (among equally recent ones,
        the lowest scores) to disk, down to 15/16 of the budget: evictions come in batches."""
        budget = self.memory_budget
        if self._size <= budget:
            return
        n = self._size - budget + budget // 16
        live = self._live[: self._used].nonzero().squeeze(1)  # (N,)
        priority = self._tick.index_select(0, live).to(torch.float64)  # (N,) lower goes first
        if self.accessor is not None:
            score = self.accessor.score(self._rows[live, self._col["show"]], self._rows[live, self._col["click"]])
            priority += 0.5 * torch.sigmoid(score.to(torch.float64))  # < 1: breaks ties within a tick only
        victims = live[torch.topk(priority, n, largest=False, sorted=False).indices]  # (n,)
        self._cold.put(self._keys[victims], self._payload(victims))
        if self._hold is not None:
            hold_eviction(self._hold, self.name, n)  # both tiers hold the victims here
        self._drop(victims)
        self._tier_counts["evictions"] += n

    def _inspect(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K,) keys -> exists (K,) bool and (K, D + S + M) rows from either tier (zeros where
        absent), without moving any row."""
        slots = self._index.lookup(keys)  # (K,)
        hot = slots >= 0
        out = torch.zeros(keys.numel(), self.dim + self._state_width + len(self.meta_columns))
        out[hot] = self._payload(slots[hot])
        exists = hot.clone()
        if not bool(hot.all()):
            uniq, inverse = unique_keys(keys[~hot])
            found, payload = self._cold.get(uniq)  # (X,) (F, D + S + M)
            full = torch.zeros(uniq.numel(), out.shape[1])
            full[found] = payload
            out[~hot] = full[inverse]
            exists[~hot] = found[inverse]
        return exists, out

    def _on_disk(self, keys: torch.Tensor) -> torch.Tensor:
        """(K,) keys without a row in memory -> (K,) bool: a row on disk."""
        uniq, inverse = unique_keys(keys)
        found, _ = self._cold.get(uniq)
        return found[inverse]

    def tier_stats(self) -> dict | None:
        """The tiers' counters (None without a disk tier): rows in memory and on disk, lookups
        that found their row in memory (`memory_hits`) or on disk (`disk_hits`, per key
        occurrence), `hit_rate` = memory_hits / (memory_hits + disk_hits), rows promoted and
        evicted, the store's bytes on disk."""
        if self._cold is None:
            return None
        with self._lock:
            counts = dict(self._tier_counts)
            looked = counts["memory_hits"] + counts["disk_hits"]
            return {"memory_budget": self.memory_budget, "rows_memory": self._size, "rows_disk": self._cold.rows,
                    "hit_rate": counts["memory_hits"] / looked if looked else None, **counts,
                    "disk_bytes": self._cold.disk_bytes(), "disk_path": self._cold.path}

    def close(self) -> None:
        """Release the disk tier (its store and folder are removed); a no-op without one."""
        if self._cold is not None:
            with self._lock:
                self._cold.close()

    # ------------------------------------------------------------------ verbs

    @torch.no_grad()
    def pull(self, keys: torch.Tensor, create: bool = True) -> torch.Tensor:
        """Values of (K,) int64 keys -> (K, D) float32.

        Missing keys get a row when `create` and the entry policy admits them; keys left
        without a row read as zeros. With a count filter, each occurrence of a missing key
        in a creating pull is one sighting.
        """
        keys = as_keys(keys, f"SparseTable {self.name}.pull")
        with self._lock:
            if self._cold is None:
                return self._pull(keys, create)
            self._promote(keys)
            try:
                return self._pull(keys, create)
            finally:
                self._evict()

    def _pull(self, keys: torch.Tensor, create: bool) -> torch.Tensor:
        slots = self._slots(keys, create)  # (K,)
        absent = slots < 0
        if not bool(absent.any()):
            return self._values_at(slots)
        out = self._values_at(slots.clamp(min=0))  # (K, D)
        out[absent] = 0.0
        return out

    def _push_slots(self, keys: torch.Tensor) -> torch.Tensor:
        """(K,) slots a push updates: rows are created for new keys only without an entry policy."""
        return self._index.lookup(keys) if self.entry is not None else self._slots(keys, create=True)

    def _group(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Group (K,) keys by row, creating rows only when every key is admitted.

        Returns (U,) sorted distinct slots, perm (K',) positions of the kept keys in slot
        order, offsets (U + 1,) segment bounds into perm; None if no key has a row.
        """
        slots = self._push_slots(keys)  # (K,)
        # Slots fit int32 below 2^31 rows; the int32 sort was 1.7x faster here.
        by_slot = slots.to(torch.int32) if self.capacity < 2**31 else slots
        ordered, perm = torch.sort(by_slot)  # absent (-1) first
        first = int(torch.searchsorted(ordered, 0))
        if first:
            ordered, perm = ordered[first:], perm[first:]
        if ordered.numel() == 0:
            return None
        uniq, counts = torch.unique_consecutive(ordered, return_counts=True)  # (U,)
        if uniq.numel() < ordered.numel():
            # Duplicate keys: their gradients are summed in request order (a stable sort), so the
            # float sum does not depend on which slots the rows hold (after a load, or with a disk
            # tier, they hold others). An unstable sort orders ties by the other keys' slots.
            perm = torch.sort(by_slot, stable=True)[1][first:]
        offsets = torch.zeros(uniq.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        return uniq.to(torch.int64), perm, offsets

    @staticmethod
    def _segment_sum(x: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """(K, D) rows summed per segment -> (U, D)."""
        if perm.numel() == offsets.numel() - 1:  # no duplicates
            return x.index_select(0, perm)
        # FBGEMM's embedding-bag kernel; index_add_ over rows was 2-5x slower here.
        return F.embedding_bag(perm, x, offsets, mode="sum", include_last_offset=True)

    @staticmethod
    def _segment_sum_1d(x: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """(K,) values summed per segment -> (U,) float32 (float64 prefix sums: exact for counts)."""
        prefix = torch.zeros(perm.numel() + 1, dtype=torch.float64)
        torch.cumsum(x.index_select(0, perm).to(torch.float64), 0, out=prefix[1:])
        return (prefix[offsets[1:]] - prefix[offsets[:-1]]).to(torch.float32)

    def _touch(self, rows: torch.Tensor, perm, offsets, shows, clicks) -> None:
        """Update statistics of gathered rows (U, W) with the pushes' shows and clicks."""
        rows[:, self._col["dirty"]] = 1.0
        if self.accessor is None:
            return
        shows = self._segment_sum_1d(shows, perm, offsets)  # (U,)
        clicks = self._segment_sum_1d(clicks, perm, offsets)  # (U,)
        rows[:, self._col["show"]] += shows
        rows[:, self._col["click"]] += clicks
        rows[:, self._col["unseen_days"]] = 0.0
        rows[:, self._col["delta_score"]] += self.accessor.score(shows, clicks)

    def _apply(self, keys, x, shows, clicks, where: str, delta: bool, unique: bool = False) -> int:
        keys = as_keys(keys, where)
        k = keys.numel()
        x = _as_rows(x, k, self.dim, "deltas" if delta else "grads", where)
        if self.accessor is None and (shows is not None or clicks is not None):
            raise ConfigError(f"{where}: shows/clicks given but the table has no accessor; build it with accessor=CtrAccessor()")
        if self.accessor is not None and (shows is None or clicks is None):
            raise ConfigError(f"{where}: the table has an accessor: give the keys' shows and clicks ((K,) each; "
                              "recps.ps.embedding counts them from the batch: one show per occurrence, its example's click)")
        shows = _as_counts(shows, k, "shows", where)
        clicks = _as_counts(clicks, k, "clicks", where)
        with self._lock:
            if self._cold is None:
                return self._apply_locked(keys, x, shows, clicks, delta, unique)
            self._promote(keys)
            try:
                return self._apply_locked(keys, x, shows, clicks, delta, unique)
            finally:
                self._evict()

    def _apply_locked(self, keys, x, shows, clicks, delta: bool, unique: bool) -> int:
        if unique and (delta or self._rule_code is not None) and self.accessor is None and self._fused_values:
            return self._apply_compiled(keys, x, delta)
        grouped = self._group(keys)
        if grouped is None:
            return 0
        slots, perm, offsets = grouped  # (U,) (K',) (U + 1,)
        g = self._segment_sum(x, perm, offsets)  # (U, D) duplicates summed
        rows = self._rows.index_select(0, slots)  # (U, W) in slot order: better locality
        w = rows[:, : self.dim] if self._fused_values else self._half.index_select(0, slots).to(torch.float32)
        if delta:
            w.add_(g)
        else:
            self.rule.apply(w, g, rows[:, self._scol : self._mcol])
        self._touch(rows, perm, offsets, shows, clicks)
        self._rows.index_copy_(0, slots, rows)
        if not self._fused_values:
            self._half.index_copy_(0, slots, w.to(torch.float16))
        return slots.numel()

    def _apply_compiled(self, keys: torch.Tensor, x: torch.Tensor, delta: bool) -> int:
        """push / push_delta of (K,) unique keys in one compiled pass over their rows (under the lock)."""
        slots = self._push_slots(keys)  # (K,)
        rule = self.rule
        low, high = rule.bounds if rule.bounds is not None else (0.0, 0.0)
        # Python floats and ints only: another argument type would compile another variant.
        apply_rule(self._rows.numpy(), slots.numpy(), x.numpy(), DELTA if delta else self._rule_code, self.dim,
                   self._scol, self._col["dirty"], float(rule.lr), float(getattr(rule, "eps", 0.0)), float(rule.l2),
                   float(low), float(high), rule.bounds is not None)
        return int((slots >= 0).sum())

    @torch.no_grad()
    def push(self, keys: torch.Tensor, grads: torch.Tensor, shows=None, clicks=None, unique: bool = False) -> int:
        """Apply the update rule with (K, D) gradients of (K,) keys; returns rows updated.

        Gradients of duplicate keys are summed first. A key without a row gets one
        (initial value, then the update) if the table has no entry policy; otherwise its
        gradient is dropped. With an accessor, the keys' shows (K,) and clicks (K,) are required
        (and refused without one); both are added to the row's statistics.

        Several workers' gradients become one step (sync mode) by concatenating their keys
        and gradients into one push: duplicates are summed before the rule runs.

        `unique=True` promises distinct keys (a PSClient's pushes are): SGD, Adagrad and
        row-wise Adagrad on a float32 table without accessor then run as one compiled pass
        (recps.ps.table._kernels); a duplicate key would be updated once per occurrence.
        """
        return self._apply(keys, grads, shows, clicks, f"SparseTable {self.name}.push", delta=False, unique=unique)

    @torch.no_grad()
    def push_delta(self, keys: torch.Tensor, deltas: torch.Tensor, shows=None, clicks=None, unique: bool = False) -> int:
        """GEO: add (K, D) deltas to the values of (K,) keys (duplicates summed); optimizer
        state is untouched. Rows are created as in `push`; `unique` as in `push`. Returns rows updated."""
        return self._apply(keys, deltas, shows, clicks, f"SparseTable {self.name}.push_delta", delta=True, unique=unique)

    # ------------------------------------------------------------------ inspection

    @torch.no_grad()
    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        """(K,) keys -> (K,) bool: has a row."""
        keys = as_keys(keys, f"SparseTable {self.name}.contains")
        with self._lock:
            found = self._index.lookup(keys) >= 0
            if self._cold is not None and not bool(found.all()):
                found[~found] = self._on_disk(keys[~found])
            return found

    @torch.no_grad()
    def keys(self) -> torch.Tensor:
        """(N,) int64 keys of all rows, in slot order."""
        with self._lock:
            hot = self._keys[: self._used][self._live[: self._used]].clone()
            if self._cold is None:
                return hot
            return torch.cat([hot, *(k for k, _ in self._cold.scan(_SAVE_CHUNK_ROWS))])

    @torch.no_grad()
    def state(self, keys: torch.Tensor) -> torch.Tensor:
        """(K,) keys -> (K, S) float32 optimizer state; zeros for keys without a row."""
        keys = as_keys(keys, f"SparseTable {self.name}.state")
        with self._lock:
            if self._cold is not None:
                exists, payload = self._inspect(keys)
                return self._split(payload)[1].clone()
            slots = self._index.lookup(keys)
            out = self._rows.index_select(0, slots.clamp(min=0))[:, self._scol : self._mcol].clone()
            out[slots < 0] = 0.0
            return out

    @torch.no_grad()
    def stats(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """(K,) keys -> {column: (K,) float32} for each statistics column and `exists` (K,) bool."""
        keys = as_keys(keys, f"SparseTable {self.name}.stats")
        with self._lock:
            if self._cold is not None:
                exists, payload = self._inspect(keys)
                meta = self._split(payload)[2]
                out = {c: meta[:, i].clone() for i, c in enumerate(self.meta_columns)}
                out["exists"] = exists
                return out
            slots = self._index.lookup(keys)
            rows = self._rows.index_select(0, slots.clamp(min=0))  # (K, W)
            exists = slots >= 0
            out = {c: torch.where(exists, rows[:, self._col[c]], 0.0) for c in self.meta_columns}
            out["exists"] = exists
            return out

    @torch.no_grad()
    def set_stats(self, keys: torch.Tensor, **columns: torch.Tensor) -> int:
        """Overwrite statistics columns (e.g. show=, click=, unseen_days=) of existing rows.

        Each column is a (K,) tensor or a scalar; keys without a row are skipped.
        Returns the number of rows written.
        """
        where = f"SparseTable {self.name}.set_stats"
        keys = as_keys(keys, where)
        for c in columns:
            if c not in self._col:
                raise ConfigError(f"{where}: unknown column {c!r}; this table has {list(self.meta_columns)}")
        with self._lock:
            if self._cold is not None:
                self._promote(keys, count=False)
            slots = self._index.lookup(keys)
            found = slots >= 0
            slots = slots[found]
            rows = self._rows.index_select(0, slots)
            for c, v in columns.items():
                v = torch.as_tensor(v, dtype=torch.float32)
                rows[:, self._col[c]] = v if v.dim() == 0 else v[found]
            self._rows.index_copy_(0, slots, rows)
            if self._cold is not None:
                self._evict()
            return slots.numel()

    # ------------------------------------------------------------------ shrink

    @torch.no_grad()
    def shrink(self) -> int:
        """Decay show and click by show_click_decay_rate, then delete rows whose decayed score
        < delete_threshold or whose unseen_days > delete_after_unseen_days (Paddle's
        CtrCommonAccessor::Shrink). Unseen days are not counted here: a "batch" save adds one.

        Count-filter candidates (keys sighted but without a row) do age here, as before: their
        sightings decay and each shrink adds an unseen day, a sighting restarts it, and a
        candidate is dropped after more than delete_after_unseen_days shrinks unseen (a batch
        save writes candidates but has no row of theirs to age). Freed slots are reused.
        Returns rows deleted."""
        acc = self.accessor
        if acc is None:
            raise ConfigError(f"SparseTable {self.name}.shrink: the table has no accessor; build it with accessor=CtrAccessor(...)")
        with self._save_lock, self._lock:
            show, click, unseen = self._col["show"], self._col["click"], self._col["unseen_days"]
            doomed = []
            for start in range(0, self._used, _SAVE_CHUNK_ROWS):
                end = min(start + _SAVE_CHUNK_ROWS, self._used)
                block = self._rows[start:end]  # (B, W) view
                live = self._live[start:end]  # (B,)
                block[:, show] *= acc.show_click_decay_rate
                block[:, click] *= acc.show_click_decay_rate
                score = acc.score(block[:, show], block[:, click])  # (B,)
                dead = live & ((score < acc.delete_threshold) | (block[:, unseen] > acc.delete_after_unseen_days))
                doomed.append(dead.nonzero().squeeze(1) + start)
            doomed = torch.cat(doomed) if doomed else torch.empty(0, dtype=torch.int64)
            self._delete(doomed)
            deleted = doomed.numel() + (self._shrink_cold() if self._cold is not None else 0)
            self._pending.day_end(acc.show_click_decay_rate, acc.delete_after_unseen_days)
            _log.info("table %s: shrink deleted %d rows, %d left", self.name, deleted, len(self))
            return deleted

    def _shrink_cold(self) -> int:
        """shrink() of the disk tier, chunk by chunk, with the memory tier's arithmetic; returns rows deleted."""
        acc = self.accessor
        c = self._cold_col
        deleted = 0
        for keys, rows in self._cold.scan(_SAVE_CHUNK_ROWS):  # (B,) (B, D + S + M)
            rows[:, c["show"]] *= acc.show_click_decay_rate
            rows[:, c["click"]] *= acc.show_click_decay_rate
            score = acc.score(rows[:, c["show"]], rows[:, c["click"]])
            dead = (score < acc.delete_threshold) | (rows[:, c["unseen_days"]] > acc.delete_after_unseen_days)
            self._cold.replace(keys[~dead], rows[~dead])
            self._cold.delete(keys[dead])
            if bool(dead.any()):
                self._deleted.append(keys[dead])
            deleted += int(dead.sum())
        return deleted

    # ------------------------------------------------------------------ save / load

    def _header(self, mode: str, shard: int, num_shards: int, rows: int) -> dict:
        return {
            "kind": "sparse",
            "table": self.name,
            "mode": mode,
            "shard": shard,
            "num_shards": num_shards,
            "partition": PARTITION_SCHEME,
            "rows": rows,
            "dim": self.dim,
            "dtype": "float16" if self.dtype == torch.float16 else "float32",
            "optimizer": self.rule.config(),
            "state_width": self._state_width,
            "meta_columns": list(self.meta_columns),
            "accessor": self.accessor.config() if self.accessor else None,
            "seed": self.seed,
        }

    @torch.no_grad()
    def save(
        self,
        path: str | os.PathLike,
        mode: str = "full",
        shard: int = 0,
        num_shards: int = 1,
        chunk_rows: int = _SAVE_CHUNK_ROWS,
    ) -> dict:
        """Write this shard to `path/shard-SSSSS-of-NNNNN/` atomically; returns the manifest.

        Modes, with Paddle's numbers (with an accessor, the rows written and the statistics
        updated are CtrCommonAccessor's; see recps.ps.table.accessor):

        mode="full" (0): every row with values, optimizer state and statistics, plus
            count-filter candidates and the keys deleted since the last delta/base save (a
            restart resumes the delta chain exactly). Changes nothing.
        mode="delta" (1): full payload of the rows with score >= base_threshold,
            delta_score >= delta_threshold and unseen_days <= delta_keep_days (without an
            accessor: of the rows pushed since a delta or base save last wrote them), plus
            the keys deleted since the last delta/base save. Sets their delta_score to 0.
        mode="base" (2): serving export, values only, of the rows delta selects with
            delta_threshold = 0 (every row without an accessor). Sets their delta_score to 0
            and starts a new delta chain (the deleted keys owed are dropped).
        mode="batch" (3): the payload of "full" (statistics as they were before this save,
            as Paddle's), then adds one unseen day to every row: the day count that
            delta_keep_days and shrink's delete_after_unseen_days compare with.

        The dirty flag marks rows pushed since a delta or base save last wrote them: it selects
        the delta of a table without an accessor (with one, delta_score does). delta and base
        clear it on the rows they write as each chunk is copied, and set it back if the write fails.

        delta_score, unseen_days and the deleted keys owed change only after the shard was
        committed: a failed write (and its retry, e.g. the server's retry_transient) leaves
        them as they were, so the retry writes the same rows. A push to a written row after
        its chunk was copied keeps the delta_score it added.
        """
        if mode not in SAVE_MODES:
            raise ConfigError(f"SparseTable {self.name}.save: mode={mode!r}; use one of {SAVE_MODES}")
        if chunk_rows < 1:
            raise ConfigError(f"SparseTable {self.name}.save: chunk_rows={chunk_rows}; it must be >= 1")
        # A tiered table is saved under its lock (updates wait): a row may not move between the
        # tiers while they are scanned, or it would be written twice or not at all.
        with self._save_lock, (self._lock if self._cold is not None else contextlib.nullcontext()):
            # shrink and load wait for _save_lock: no row is deleted and no key is added to
            # _deleted until this save ends, so written slots still hold their keys after the commit.
            cleared: list[torch.Tensor] = []  # slots whose dirty flag this save cleared
            scores: list[tuple[torch.Tensor, torch.Tensor]] = []  # (slots, delta_score written)
            with self._lock:
                deleted = torch.cat(self._deleted) if self._deleted else torch.empty(0, dtype=torch.int64)
            try:
                with ShardWriter(path, shard, num_shards) as writer:
                    rows = self._write_rows(writer, mode, chunk_rows, cleared, scores)
                    if mode != "base":
                        writer.declare("deleted", torch.int64, ())
                        writer.append("deleted", deleted)
                    if mode in _WHOLE:
                        with self._lock:
                            pkeys, pdata = self._pending.snapshot()
                        writer.declare("pending_keys", torch.int64, ())
                        writer.append("pending_keys", pkeys)
                        writer.declare("pending", torch.float32, (_PENDING_COLS,))
                        writer.append("pending", pdata)
                    manifest = writer.commit(self._header(mode, shard, num_shards, rows))
            except BaseException:
                # Nothing was exported: the rows it cleared are still owed to the next delta.
                with self._lock:
                    for slots in cleared:
                        self._rows[slots, self._col["dirty"]] = 1.0
                raise
            self._after_save(mode, chunk_rows, scores)
            if self._cold is not None:
                self._after_save_cold(mode, chunk_rows)
            return manifest

    def _cold_selects(self, mode: str, rows: torch.Tensor) -> torch.Tensor:
        """(B, D + S + M) disk rows -> (B,) bool: the rows a save of `mode` writes (as `_write_rows`)."""
        c = self._cold_col
        if self.accessor is not None:
            return self.accessor.save_selects(mode, rows[:, c["show"]], rows[:, c["click"]], rows[:, c["unseen_days"]],
                                              rows[:, c["delta_score"]])
        if mode == "delta":
            return rows[:, c["dirty"]] > 0
        return torch.ones(rows.shape[0], dtype=torch.bool)

    def _write_cold(self, writer: ShardWriter, mode: str, chunk_rows: int) -> int:
        """Append the disk tier's rows `mode` selects; returns how many."""
        total = 0
        for keys, rows in self._cold.scan(chunk_rows):  # (B,) (B, D + S + M)
            select = self._cold_selects(mode, rows)
            keys, rows = keys[select], rows[select]
            values, state, meta = self._split(rows)
            writer.append("keys", keys)
            writer.append("values", values.to(self.dtype).contiguous())
            if mode != "base":
                writer.append("state", state.contiguous())
                writer.append("meta", meta.contiguous())
            total += keys.numel()
        return total

    def _after_save_cold(self, mode: str, chunk_rows: int) -> None:
        """`_after_save` and the dirty flags `_write_rows` clears, for the disk tier (the save holds
        the lock: its rows are as they were written)."""
        if mode not in ("delta", "base") and not (mode == "batch" and self.accessor is not None):
            return
        c = self._cold_col
        for keys, rows in self._cold.scan(chunk_rows):
            if mode == "batch":
                rows[:, c["unseen_days"]] += 1.0
                self._cold.replace(keys, rows)
                continue
            select = self._cold_selects(mode, rows)
            keys, rows = keys[select], rows[select]
            rows[:, c["dirty"]] = 0.0
            if self.accessor is not None:
                ds = rows[:, c["delta_score"]]
                rows[:, c["delta_score"]] = torch.where(ds != 0, ds - ds, ds)  # as the memory tier: score - written
            self._cold.replace(keys, rows)

    def _after_save(self, mode: str, chunk_rows: int, scores: list) -> None:
        """Statistics updates of a committed save (Paddle's UpdateStatAfterSave), under the save lock."""
        if mode in ("delta", "base"):
            with self._lock:
                self._deleted = []
            ds = self._col.get("delta_score")
            for slots, written in scores:
                with self._lock:
                    # written - written is exactly 0; a push after the copy keeps what it added.
                    self._rows[slots, ds] = self._rows[slots, ds] - written
        elif mode == "batch" and self.accessor is not None:
            unseen = self._col["unseen_days"]
            for start in range(0, self._used, chunk_rows):
                with self._lock:
                    end = min(start + chunk_rows, self._used)
                    self._rows[start:end, unseen] += self._live[start:end].to(torch.float32)

    def _write_rows(self, writer: ShardWriter, mode: str, chunk_rows: int, cleared: list, scores: list) -> int:
        """Append the rows `mode` selects, chunk by chunk; returns how many. Fills `cleared`
        with the slots whose dirty flag it cleared and `scores` with (slots, delta_score) of
        written rows whose delta_score the commit resets."""
        d, s, m = self.dim, self._state_width, len(self.meta_columns)
        writer.declare("keys", torch.int64, ())
        writer.declare("values", self.dtype, (d,))
        if mode != "base":
            writer.declare("state", torch.float32, (s,))
            writer.declare("meta", torch.float32, (m,))
        acc, dirty, col = self.accessor, self._col["dirty"], self._col
        resets = mode in ("delta", "base")
        total, start = 0, 0
        while True:
            with self._lock:  # one chunk is copied atomically with respect to updates
                if start >= self._used:
                    break
                end = min(start + chunk_rows, self._used)
                block = self._rows[start:end]  # (B, W) view
                select = self._live[start:end].clone()  # (B,)
                if acc is not None:
                    select &= acc.save_selects(mode, block[:, col["show"]], block[:, col["click"]],
                                               block[:, col["unseen_days"]], block[:, col["delta_score"]])
                elif mode == "delta":
                    select &= block[:, dirty] > 0
                slots = select.nonzero().squeeze(1) + start  # (R,)
                keys = self._keys[slots]
                rows = self._rows.index_select(0, slots)  # (R, W) copy
                values = self._half[slots] if self._half is not None else rows[:, :d]
                if resets:
                    was_dirty = slots[rows[:, dirty] > 0]  # (X,)
                    self._rows[was_dirty, dirty] = 0.0
                    cleared.append(was_dirty)
                    if acc is not None:
                        written = rows[:, col["delta_score"]]  # (R,)
                        nonzero = written != 0
                        scores.append((slots[nonzero], written[nonzero]))
            writer.append("keys", keys)
            writer.append("values", values)
            if mode != "base":
                writer.append("state", rows[:, self._scol : self._mcol])
                writer.append("meta", rows[:, self._mcol :])
            total += keys.numel()
            start = end
        if self._cold is not None:
            total += self._write_cold(writer, mode, chunk_rows)
        return total

    def _check_manifest(self, man: dict, where: str) -> None:
        def refuse(what: str, saved, here, fix: str) -> None:
            raise CheckpointError(f"load {where}: checkpoint {what}={saved!r}, table {self.name} has {what}={here!r}; {fix}")

        if man.get("kind") != "sparse":
            refuse("kind", man.get("kind"), "sparse", "load it into the matching table type")
        if man["dim"] != self.dim:
            refuse("dim", man["dim"], self.dim, "build the table with the checkpoint's dim or load another checkpoint")
        if man["partition"] != PARTITION_SCHEME:
            refuse("partition", man["partition"], PARTITION_SCHEME, "re-save with this recps version")
        if man["mode"] != "base" and (
            man["optimizer"]["name"] != self.rule.name or man["state_width"] != self._state_width
        ):
            refuse("optimizer", man["optimizer"]["name"], self.rule.name, "use the same optimizer, or load a base export")

    @torch.no_grad()
    def load(self, path: str | os.PathLike, shard: int = 0, num_shards: int = 1) -> int:
        """Load this shard's rows from a table checkpoint folder written by `save`.

        The checkpoint may have any number of shards: each is read and its keys with
        `partition(key, num_shards) == shard` are kept. A full, batch or base checkpoint
        replaces the table's contents; a delta is applied on top (rows overwritten or added, deleted
        keys removed). Sizes, sha256 checksums, dims and the optimizer are verified first;
        on a mismatch nothing is changed and CheckpointError names the file. Returns rows
        loaded.
        """
        if not 0 <= shard < num_shards:
            raise ConfigError(f"SparseTable {self.name}.load: shard={shard} is outside [0, num_shards={num_shards})")
        parts = self._read_checkpoint(os.fspath(path), shard, num_shards)
        mode = parts["mode"]
        with self._save_lock, self._lock:
            if self._cold is not None:
                return self._load_tiered(parts)
            if mode != "delta":
                self._reset(parts["keys"].numel())
            if mode == "base":
                self._create(parts["keys"], values=parts["values"])
                self._rows[: self._used, self._col["dirty"]] = 0.0
                return parts["keys"].numel()
            if mode in _WHOLE:
                self._create(parts["keys"], values=parts["values"], state=parts["state"], meta=parts["meta"])
                if parts["deleted"].numel():
                    self._deleted = [parts["deleted"]]
                self._pending.restore(parts["pending_keys"], parts["pending"])
                return parts["keys"].numel()
            return self._load_delta(parts)

    def _load_delta(self, parts: dict) -> int:
        """A delta checkpoint on top of the table (under the locks): overwrite existing rows, add
        new ones, remove deleted keys."""
        meta = parts["meta"]
        meta[:, self._col["dirty"] - self._mcol] = 0.0
        if self.accessor is not None:
            meta[:, self._col["delta_score"] - self._mcol] = 0.0
        keys = parts["keys"]
        slots = self._index.lookup(keys)
        old = slots >= 0
        if bool(old.any()):
            self._rows.index_copy_(0, slots[old], self._assemble(parts["values"][old], parts["state"][old], meta[old]))
            if self._half is not None:
                self._half.index_copy_(0, slots[old], parts["values"][old].to(torch.float16))
        new = ~old
        if bool(new.any()):
            self._create(keys[new], values=parts["values"][new], state=parts["state"][new], meta=meta[new])
        gone = self._index.lookup(parts["deleted"])
        self._delete(gone[gone >= 0])
        self._deleted = []
        return keys.numel()

    def _load_tiered(self, parts: dict) -> int:
        """`load` of a table with a disk tier (under the locks): the first rows up to the budget
        go to memory, the others straight to disk; a delta's rows are promoted, then applied as
        in memory, then the budget is restored."""
        mode, keys = parts["mode"], parts["keys"]
        if mode == "delta":
            self._promote(torch.cat([keys, parts["deleted"]]), count=False)
            try:
                return self._load_delta(parts)
            finally:
                self._evict()
        n = keys.numel()
        hot = min(n, self.memory_budget)
        self._reset(hot)
        values = parts["values"]
        if mode == "base":  # values only: fresh state, zero statistics, not dirty
            state = torch.full((n, self._state_width), self.rule.initial_state_value(), dtype=torch.float32)
            meta = torch.zeros(n, len(self.meta_columns))
        else:
            state, meta = parts["state"], parts["meta"]
        self._create(keys[:hot], values=values[:hot], state=state[:hot], meta=meta[:hot])
        for start in range(hot, n, _SAVE_CHUNK_ROWS):
            end = min(n, start + _SAVE_CHUNK_ROWS)
            self._cold.put(keys[start:end], torch.cat([values[start:end], state[start:end], meta[start:end]], 1))
        if mode in _WHOLE:
            if parts["deleted"].numel():
                self._deleted = [parts["deleted"]]
            self._pending.restore(parts["pending_keys"], parts["pending"])
        return n

    def _assemble(self, values: torch.Tensor, state: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        block = torch.empty(values.shape[0], self._width, dtype=torch.float32)  # (R, W)
        if self._fused_values:
            block[:, : self.dim] = values
        block[:, self._scol : self._mcol] = state
        block[:, self._mcol :] = meta
        return block

    def _read_checkpoint(self, path: str, shard: int, num_shards: int) -> dict:
        """Read, verify and re-partition the saved shards; nothing in the table changes here.

        Saved by as many servers as read it, shard `shard` holds exactly the keys this shard owns
        (the client routes with the same `partition`): only it is read. Otherwise, or if it holds
        another shard's key, every saved shard is read and this shard's keys are kept."""
        shard_dirs = list_shards(path)
        if num_shards > 1 and len(shard_dirs) == num_shards:
            parts = self._read_shards(path, shard_dirs[shard:shard + 1], shard, num_shards, own=True)
            if parts is not None:
                return parts
        return self._read_shards(path, shard_dirs, shard, num_shards, own=False)

    def _read_shards(self, path: str, shard_dirs: list[str], shard: int, num_shards: int, own: bool) -> dict | None:
        """The keys of `shard` in `shard_dirs`; with `own`, None if a saved key is not this shard's."""
        pieces: dict[str, list[torch.Tensor]] = {}
        mode = None
        for shard_dir in shard_dirs:
            reader = ShardReader(shard_dir)
            man = reader.manifest
            self._check_manifest(man, shard_dir)
            if mode is None:
                mode = man["mode"]
            elif man["mode"] != mode:
                raise CheckpointError(f"load {path}: shards mix modes {mode!r} and {man['mode']!r}; save each into its own folder")
            keys = reader.read("keys")
            arrays = {"keys": keys, "values": reader.read("values").to(torch.float32)}
            if keys.numel() != man["rows"]:
                raise CheckpointError(f"load {shard_dir}: {keys.numel()} keys but the manifest says rows={man['rows']}")
            if mode != "base":
                arrays["state"] = reader.read("state")
                arrays["meta"] = self._map_meta(reader.read("meta"), man["meta_columns"])
                arrays["deleted"] = reader.read("deleted")
            if mode in _WHOLE:
                arrays["pending_keys"] = reader.read("pending_keys")
                arrays["pending"] = reader.read("pending")
            if own:
                if not all(bool((partition(arrays[k], num_shards) == shard).all())
                           for k in ("keys", "deleted", "pending_keys") if k in arrays):
                    return None
            elif num_shards > 1:
                for key_name, names in (("keys", ("keys", "values", "state", "meta")), ("deleted", ("deleted",)), ("pending_keys", ("pending_keys", "pending"))):
                    if key_name in arrays:
                        mine = partition(arrays[key_name], num_shards) == shard
                        for n in names:
                            if n in arrays:
                                arrays[n] = arrays[n][mine]
            for n, t in arrays.items():
                pieces.setdefault(n, []).append(t)
        parts = {n: torch.cat(ts) for n, ts in pieces.items()}
        parts["mode"] = mode
        keys = parts["keys"]
        if keys.numel() and torch.unique(keys).numel() != keys.numel():
            raise CheckpointError(f"load {path}: a key appears in more than one row or shard; the checkpoint is inconsistent")
        return parts

    def _map_meta(self, meta: torch.Tensor, saved_columns: list[str]) -> torch.Tensor:
        """Saved statistics columns -> this table's columns (absent ones are zero)."""
        out = torch.zeros(meta.shape[0], len(self.meta_columns), dtype=torch.float32)
        for i, c in enumerate(self.meta_columns):
            if c in saved_columns:
                out[:, i] = meta[:, saved_columns.index(c)]
        return out
