"""KeyIndex: a vectorized int64 key -> int64 slot map over FBGEMM's pruned hash map.

Why this map (measured on the 2-core development VM, 10M keys, batches of 100k Zipf keys,
one thread; benchmarks/RESULTS.md): FBGEMM's `pruned_hashmap_lookup/insert` CPU ops (open
addressing, linear probing, a (capacity, 2) int64 table of [key, slot] pairs) on huge pages
ran 16M lookups per CPU-second, pandas' Int64HashTable 8M, a Python dict 1.7M; the issue
reports 3-6M/s for an open-addressing table written in torch ops. The op releases the GIL.

The ops need a wrapper, which is this class:
- key -1 marks an empty bucket, so it cannot be stored: it gets a side slot here;
- there is no delete: `retain()` rebuilds the table from the surviving entries;
- an insert into a full table never returns: the table is kept at most half full
  (`MAX_LOAD`) and grows by re-inserting every entry into a larger table.

Not thread-safe: the owning table serializes calls.

Shapes: K keys in a request, C bucket capacity.

>>> index = KeyIndex()
>>> index.insert(torch.tensor([10, -1, 2**63 - 1]), torch.tensor([0, 1, 2]))
>>> index.lookup(torch.tensor([-1, 10, 11, 2**63 - 1])).tolist()
[1, 0, -1, 2]
"""

from __future__ import annotations

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch

from recps.ps.table._memory import alloc

__all__ = ["KeyIndex", "MAX_LOAD"]

MAX_LOAD = 0.5  # never fill more than half the buckets: FBGEMM's insert hangs on a full table
_GROW_LOAD = 0.3  # load right after a resize: grows by ~1.67x, so 32-53 bytes of buckets per key
_SHRINK_LOAD = 0.05  # after deletions, a table this empty is rebuilt smaller
_MIN_CAPACITY = 64

_lookup = torch.ops.fbgemm.pruned_hashmap_lookup
_insert = torch.ops.fbgemm.pruned_hashmap_insert


def _empty_buckets(capacity: int) -> torch.Tensor:
    buckets = alloc((capacity, 2), torch.int64)  # (C, 2) [key, slot]
    buckets.fill_(-1)
    return buckets


class KeyIndex:
    """Map from int64 keys (any value) to non-negative int64 slots; -1 means absent."""

    def __init__(self, expected_keys: int = 0) -> None:
        # A reservation fills to 90% of MAX_LOAD before the first resize.
        self._capacity = _capacity_for(expected_keys, 0.9 * MAX_LOAD)
        self._buckets = _empty_buckets(self._capacity)  # (C, 2)
        self._bucket_offsets = torch.tensor([0, self._capacity], dtype=torch.int64)
        self._size = 0  # keys stored in buckets (key -1 excluded)
        self._minus_one_slot = -1

    def __len__(self) -> int:
        return self._size + (self._minus_one_slot >= 0)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def nbytes(self) -> int:
        return self._buckets.numel() * 8

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """(K,) int64 keys -> (K,) int64 slots, -1 where absent."""
        keys = keys.contiguous()  # the op reads raw memory
        offsets = torch.tensor([0, keys.numel()], dtype=torch.int64)
        slots = _lookup(keys, offsets, self._buckets, self._bucket_offsets)  # (K,)
        if self._minus_one_slot >= 0:
            slots.masked_fill_(keys == -1, self._minus_one_slot)
        return slots

    def insert(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Add (K,) unique, absent keys with their (K,) non-negative slots; grows as needed."""
        keys, slots = keys.contiguous(), slots.contiguous()  # the op reads raw memory
        minus_one = keys == -1
        if bool(minus_one.any()):
            self._minus_one_slot = int(slots[minus_one][0])
            keep = ~minus_one
            keys, slots = keys[keep], slots[keep]
        if keys.numel() == 0:
            return
        if self._size + keys.numel() > MAX_LOAD * self._capacity:
            self._rebuild(_capacity_for(self._size + keys.numel(), _GROW_LOAD), *self.entries())
        _insert(keys, slots, torch.tensor([0, keys.numel()], dtype=torch.int64), self._buckets, self._bucket_offsets)
        self._size += keys.numel()

    def reserve(self, keys: int) -> None:
        """Resize now so that `keys` keys in total fit without another resize."""
        if keys > MAX_LOAD * self._capacity:
            self._rebuild(_capacity_for(keys, 0.9 * MAX_LOAD), *self.entries())

    def entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All (keys, slots), each (N,) int64, in bucket order."""
        used = self._buckets[:, 0] != -1  # (C,)
        pairs = self._buckets[used]  # (N, 2)
        keys, slots = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()
        if self._minus_one_slot >= 0:
            keys = torch.cat([keys, torch.tensor([-1])])
            slots = torch.cat([slots, torch.tensor([self._minus_one_slot])])
        return keys, slots

    def retain(self, slot_alive: torch.Tensor) -> None:
        """Keep only the keys whose slot s has slot_alive[s] True (a (S,) bool); rebuilds."""
        keys, slots = self.entries()
        keep = slot_alive[slots]
        keys, slots = keys[keep], slots[keep]
        capacity = self._capacity
        if keys.numel() < _SHRINK_LOAD * capacity:
            capacity = _capacity_for(keys.numel(), _GROW_LOAD)
        self._rebuild(capacity, keys, slots)

    def clear(self) -> None:
        empty = torch.empty(0, dtype=torch.int64)
        self._rebuild(_MIN_CAPACITY, empty, empty)

    def _rebuild(self, capacity: int, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Re-insert (keys, slots) into `capacity` buckets (at most MAX_LOAD full)."""
        capacity = max(capacity, _capacity_for(keys.numel(), MAX_LOAD))
        if capacity == self._capacity:
            self._buckets.fill_(-1)  # in place: never two tables alive at once
        else:
            self._buckets = None  # free the old table before the new one is touched
            self._buckets = _empty_buckets(capacity)
            self._capacity = capacity
            self._bucket_offsets = torch.tensor([0, capacity], dtype=torch.int64)
        self._size = 0
        self._minus_one_slot = -1
        self.insert(keys, slots)


def _capacity_for(keys: int, load: float) -> int:
    return max(_MIN_CAPACITY, int(keys / load) + 1)
