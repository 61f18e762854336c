"""The disk tier of a sparse table: cold rows in an embedded RocksDB (rocksdict), and the budget.

A `SparseTable` built with `memory_budget=` keeps at most about that many rows in its memory
arrays (the hot tier) and the rest here (the cold tier); each row lives in exactly one of them.
This module holds the store and the parsing of the budget; the moves between tiers (promotion on
a miss, eviction by recency and score) are the table's (recps.ps.table.sparse).

Why RocksDB and not LMDB (benchmarks/tier_store_bench.py, figures in benchmarks/RESULTS.md):
on this machine's batched pattern both reach the issue's 10^5 misses/s, LMDB's multi-get is the
faster one, but its B-tree took ~3x the disk per row under random keys; the tier exists for
capacity, which the free disk bounds.

A cold row is one float32 record, whatever the table's value dtype (a float16 value widens to
float32 exactly, and narrows back to the same bits):

    key    8 bytes, the int64 key little-endian
    value  (D + S + M) float32: [values (D) | rule state (S) | statistics (M)]

The store is a cache of the table, not a checkpoint: it has no write-ahead log and is removed
with the table. Checkpoints (`SparseTable.save`) are what survive a process. A process killed
without its clean-up (kill -9) leaves its store behind: the next store created under the same
folder on the same host removes those whose process is gone (an `owner` file names host and pid).

Not thread-safe: the owning table serializes calls under its lock.

>>> parse_memory_budget("4GiB", "ps.table.memory_budget")
('bytes', 4294967296)
>>> parse_memory_budget(1000, "ps.table.memory_budget")
('rows', 1000)
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import socket
import tempfile
import time
import weakref

import numpy as np
import torch

from recps.errors import ConfigError, PSError

__all__ = ["ColdStore", "TIER_DIR_ENV", "HOLD_EVICTION_ENV", "parse_memory_budget", "budget_rows", "row_bytes",
           "merge_tier_stats", "tier_line", "hold_eviction"]

_log = logging.getLogger(__name__)

TIER_DIR_ENV = "RECPS_TIER_DIR"  # where tables create their stores (default: the system's temp folder)
# A test hook: a file path; the first eviction batch after that file appears removes it and stops for at most
# HOLD_MAX_S, its rows written to disk and still in memory (tests/cluster: a kill -9 lands there).
HOLD_EVICTION_ENV = "RECPS_TIER_HOLD_EVICTION"
HOLD_MAX_S = 300.0
_OWNER = "owner"  # in a store's folder: "<host> <pid>" of the process it belongs to
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*$")
# Memory of a hot row besides its payload: key 8, live flag 1, recency tick 8, and the key index's
# buckets (16 bytes a key at a load of 0.3-0.5: 32-53 bytes).
_ROW_OVERHEAD = 8 + 1 + 8 + 53


def parse_memory_budget(value, where: str) -> tuple[str, int] | None:
    """A `memory_budget` setting -> ("rows", n), ("bytes", n) or None (no disk tier).

    An integer is a row count; a string with a unit is a size ("4GiB", "500MB", "2g"); a string
    of digits is a row count. Anything else raises ConfigError naming the value and `where`."""
    if value is None:
        return None
    if isinstance(value, bool) or isinstance(value, float):
        raise ConfigError(f"{where}={value!r}: give a row count (an integer such as 1000000), a size with a unit "
                          "(such as 4GiB or 500MB), or null for RAM only")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"{where}={value}: the budget must hold at least 1 row; give a row count >= 1, or null for RAM only")
        return "rows", value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(f"{where}={value!r} is not a size: give a row count (1000000) or a number with a unit "
                              f"({', '.join(u for u in ('KiB', 'MiB', 'GiB', 'TiB', 'KB', 'MB', 'GB', 'TB'))}), e.g. 4GiB")
        if unit == "" and "." not in m.group(1):
            return parse_memory_budget(int(m.group(1)), where)
        n = int(float(m.group(1)) * _UNITS[unit])
        if n < 1:
            raise ConfigError(f"{where}={value!r} is 0 bytes; give a size that holds at least one row, or null for RAM only")
        return "bytes", n
    raise ConfigError(f"{where}={value!r} ({type(value).__name__}): give a row count, a size such as 4GiB, or null")


def row_bytes(dim: int, state_width: int, meta_width: int, half: bool) -> int:
    """Bytes of RAM one hot row takes (payload and bookkeeping): the unit a byte budget is divided by."""
    payload = (state_width + meta_width + (0 if half else dim)) * 4 + (dim * 2 if half else 0)
    return payload + _ROW_OVERHEAD


def budget_rows(budget: tuple[str, int] | None, dim: int, state_width: int, meta_width: int, half: bool,
                where: str, value) -> int | None:
    """A parsed budget -> rows (None: no tier); a byte budget below one row raises ConfigError."""
    if budget is None:
        return None
    kind, n = budget
    if kind == "rows":
        return n
    per_row = row_bytes(dim, state_width, meta_width, half)
    rows = n // per_row
    if rows < 1:
        raise ConfigError(f"{where}={value!r} holds no row: a row of dim {dim} takes {per_row} bytes here; "
                          f"give at least {per_row} bytes, a row count, or null for RAM only")
    return rows


_SUMMED = ("memory_budget", "rows_memory", "rows_disk", "memory_hits", "disk_hits", "promotions", "evictions",
           "disk_bytes")


def merge_tier_stats(shards: list[dict]) -> dict:
    """The `tier_stats()` of one table's shards (one per server) -> the table's: counts and budgets
    summed, `hit_rate` recomputed from the sums (None before any lookup), `servers` = how many.

    >>> a = {"memory_budget": 10, "rows_memory": 10, "rows_disk": 5, "memory_hits": 3, "disk_hits": 1,
    ...      "promotions": 1, "evictions": 6, "disk_bytes": 4096, "hit_rate": 0.75, "disk_path": "/tmp/x"}
    >>> merged = merge_tier_stats([a, {**a, "memory_hits": 1, "disk_hits": 3}])
    >>> merged["rows_disk"], merged["hit_rate"], merged["servers"]
    (10, 0.5, 2)
    """
    out = {k: sum(int(s[k]) for s in shards) for k in _SUMMED}
    looked = out["memory_hits"] + out["disk_hits"]
    out["hit_rate"] = out["memory_hits"] / looked if looked else None
    out["servers"] = len(shards)
    return out


def tier_line(table: str, t: dict) -> str:
    """One line of a run's closing output for a table with a disk tier (`t`: merge_tier_stats' dict).

    >>> tier_line("emb", {"rows_memory": 940, "rows_disk": 9060, "memory_budget": 1000, "hit_rate": 0.8734,
    ...                   "promotions": 12000, "evictions": 21060, "disk_bytes": 1048576, "servers": 1})
    'disk tier of table emb: 940 rows in memory (budget 1000), 9060 on disk (1.0 MiB), hit rate 0.873, 12000 promotions, 21060 evictions'
    """
    rate = "no lookups" if t.get("hit_rate") is None else f"hit rate {t['hit_rate']:.3f}"
    servers = f" over {t['servers']} servers" if t.get("servers", 1) > 1 else ""
    return (f"disk tier of table {table}: {t['rows_memory']} rows in memory (budget {t['memory_budget']}{servers}), "
            f"{t['rows_disk']} on disk ({t['disk_bytes'] / 2**20:.1f} MiB), {rate}, {t['promotions']} promotions, "
            f"{t['evictions']} evictions")


def _keys_bytes(keys: torch.Tensor) -> list:
    """(K,) int64 -> K 8-byte strings (numpy makes the list in C: no Python call per key)."""
    return keys.numpy().astype("<i8", copy=False).view("V8").tolist()


def _rows_bytes(rows: torch.Tensor) -> list:
    """(K, W) float32 -> K strings of 4W bytes."""
    a = np.ascontiguousarray(rows.numpy(), dtype="<f4")
    return a.view(f"V{a.shape[1] * 4}").ravel().tolist()


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def hold_eviction(marker: str | None, table: str, rows: int) -> None:
    """The HOLD_EVICTION_ENV test hook, called by an eviction batch between its write to disk and
    its removal from memory: if the file `marker` exists, remove it, say so in the log and sleep
    HOLD_MAX_S (the test kills the process meanwhile). Once per marker file; nothing without one."""
    if not marker or not os.path.exists(marker):
        return
    try:
        os.remove(marker)
    except FileNotFoundError:  # another table's eviction took it
        return
    _log.warning("table %s: holding an eviction batch of %d rows, written to disk and still in memory (%s, a test "
                 "hook), for at most %.0f s", table, rows, HOLD_EVICTION_ENV, HOLD_MAX_S)
    time.sleep(HOLD_MAX_S)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _sweep_orphans(root: str) -> None:
    """Remove the stores under `root` left by processes of this host that are gone (a kill -9 runs no
    clean-up: each would keep its rows' disk space). A folder without an owner file, another host's, or a
    live process's is left alone."""
    host = socket.gethostname()
    try:
        names = [n for n in os.listdir(root) if n.startswith("recps-tier-")]
    except OSError:
        return
    for n in names:
        path = os.path.join(root, n)
        try:
            with open(os.path.join(path, _OWNER), encoding="utf-8") as f:
                owner_host, pid = f.read().split()
            pid = int(pid)
        except (OSError, ValueError):
            continue
        if owner_host == host and pid != os.getpid() and not _alive(pid):
            _log.info("removing the disk tier store %s of process %d, which is gone", path, pid)
            _remove(path)


class ColdStore:
    """The cold rows of one table shard: int64 key -> (W,) float32 row, in RocksDB at `path`.

    Args:
        width: W, floats per row.
        name: the table's name (messages).
        root: the folder the store is created in (None: $RECPS_TIER_DIR, else the temp folder);
            the store's own folder is created fresh and removed by `close()` or at exit.
    """

    def __init__(self, width: int, name: str, root: str | None = None) -> None:
        import rocksdict  # deferred: only a tiered table pays its import

        self._rocksdict = rocksdict
        self.width = int(width)
        self.name = name
        root = root if root is not None else os.environ.get(TIER_DIR_ENV) or None
        _sweep_orphans(root or tempfile.gettempdir())
        try:
            self.path = tempfile.mkdtemp(prefix=f"recps-tier-{name}-", dir=root)
            self._finalizer = weakref.finalize(self, _remove, self.path)
            owner = f"{socket.gethostname()} {os.getpid()}\n"
            with open(os.path.join(self.path, _OWNER + ".tmp"), "w", encoding="utf-8") as f:
                f.write(owner)
            os.replace(os.path.join(self.path, _OWNER + ".tmp"), os.path.join(self.path, _OWNER))
        except OSError as e:
            raise PSError(f"table {name}: cannot create its disk tier under {root or tempfile.gettempdir()} ({e}); "
                          f"set ${TIER_DIR_ENV} to a writable folder with free space") from None
        self._db = None
        self.rows = 0  # rows held (the table's moves keep it exact: a put is always of an absent key)
        self._open()

    def _open(self) -> None:
        rd = self._rocksdict
        opts = rd.Options(raw_mode=True)
        opts.create_if_missing(True)
        table = rd.BlockBasedOptions()
        table.set_bloom_filter(10, False)  # a miss of a new key costs no disk read
        opts.set_block_based_table_factory(table)
        opts.set_compression_type(rd.DBCompressionType.none())  # trained floats do not compress
        write = rd.WriteOptions()
        write.disable_wal = True  # a cache: checkpoints are what survive
        try:
            self._db = rd.Rdict(os.path.join(self.path, "db"), opts)
        except Exception as e:  # rocksdict raises its own exception types
            raise PSError(f"table {self.name}: cannot open its disk tier at {self.path} ({e}); nothing was kept there; "
                          f"check the folder, or set ${TIER_DIR_ENV} to another") from None
        self._db.set_write_options(write)

    def _fail(self, verb: str, e: Exception, kept: str) -> PSError:
        """The error of a failed store call: the path, RocksDB's reason, what the table kept and the fix."""
        if verb == "read":  # a store that cannot be read (corrupt, removed) is not fixed by space
            fix = ("the store cannot be read (RocksDB's LOG in that folder says why); resume the job from its last "
                   "checkpoint (a restart makes a new store)")
        else:
            fix = (f"free disk space there or set ${TIER_DIR_ENV} to another folder, then resume the job from its last "
                   "checkpoint")
        return PSError(f"table {self.name}: disk tier {verb} failed at {self.path} ({e}); {kept}; {fix}")

    def get(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K,) unique int64 keys -> found (K,) bool and their rows (F, W) float32, in key order."""
        if keys.numel() == 0:
            return torch.zeros(0, dtype=torch.bool), torch.empty(0, self.width)
        try:
            got = self._db.get(_keys_bytes(keys))  # one batched multi-get
        except Exception as e:
            raise self._fail("read", e, "the table is unchanged") from None
        arr = np.array(got, dtype=object)
        found = np.not_equal(arr, None)
        blob = b"".join(arr[found].tolist())
        rows = np.frombuffer(blob, dtype="<f4").reshape(-1, self.width).copy() if blob else np.empty((0, self.width), np.float32)
        return torch.from_numpy(found), torch.from_numpy(rows)

    def put(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Write (K,) keys absent from the store with their (K, W) rows, in one write batch."""
        if keys.numel() == 0:
            return
        self._write(_keys_bytes(keys), _rows_bytes(rows), "write", "the rows are still in memory")
        self.rows += keys.numel()

    def replace(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Overwrite the rows of (K,) keys the store holds."""
        if keys.numel():
            self._write(_keys_bytes(keys), _rows_bytes(rows), "write", "the rows on disk are as before")

    def delete(self, keys: torch.Tensor) -> None:
        """Remove (K,) keys the store holds, in one write batch."""
        if keys.numel() == 0:
            return
        self._write(_keys_bytes(keys), None, "delete", "the rows are still on disk")
        self.rows -= keys.numel()

    def _write(self, keys: list, values: list | None, verb: str, kept: str) -> None:
        batch = self._rocksdict.WriteBatch(raw_mode=True)
        # WriteBatch takes one entry per call (the binding has no bulk form); the write itself is one call.
        if values is None:
            for k in keys:
                batch.delete(k)
        else:
            for k, v in zip(keys, values):
                batch.put(k, v)
        try:
            self._db.write(batch)
        except Exception as e:
            raise self._fail(verb, e, kept) from None

    def scan(self, chunk_rows: int):
        """Yield (keys (B,), rows (B, W)) chunks of every row, from a snapshot taken at the first
        chunk: writes made while scanning (e.g. `replace`, `delete` of the chunk) are not seen."""
        expected, seen = self.rows, 0
        try:
            it = self._db.items()
        except Exception as e:
            raise self._fail("read", e, "nothing was read from it; the table is unchanged") from None
        while True:
            try:
                items = list(itertools.islice(it, chunk_rows))
            except Exception as e:
                raise self._fail("read", e, f"{seen} of its {expected} rows were read; the save, shrink or keys() "
                                 "that scanned them stopped there") from None
            if not items:
                if seen != expected:  # RocksDB's iterator ends early on an error, without raising one
                    raise self._fail("read", RuntimeError(f"the scan ended after {seen} of its {expected} rows"),
                                     "the save, shrink or keys() that scanned them stopped there") from None
                return
            seen += len(items)
            ks, vs = zip(*items)
            keys = torch.from_numpy(np.frombuffer(b"".join(ks), dtype="<i8").copy())
            rows = torch.from_numpy(np.frombuffer(b"".join(vs), dtype="<f4").reshape(-1, self.width).copy())
            yield keys, rows

    def clear(self) -> None:
        """Remove every row (the store is recreated empty)."""
        try:
            self._db.close()
            self._rocksdict.Rdict.destroy(os.path.join(self.path, "db"))
        except Exception as e:
            raise self._fail("removal", e, "its rows may still be there") from None
        self.rows = 0
        self._open()

    def disk_bytes(self) -> int:
        """Bytes of the store's files on disk."""
        total = 0
        for root, _, files in os.walk(self.path):
            for f in files:
                try:
                    total += os.stat(os.path.join(root, f)).st_blocks * 512
                except FileNotFoundError:  # a compaction removed it meanwhile
                    pass
        return total

    def close(self) -> None:
        """Close the store and remove its folder (also after a failed write: RocksDB's close then reports
        the error again, which is logged, not raised: the folder goes either way)."""
        try:
            if self._db is not None:
                db, self._db = self._db, None
                db.close()
        except Exception as e:
            _log.warning("table %s: closing its disk tier at %s: %s; removing it anyway", self.name, self.path, e)
        finally:
            self._finalizer()
