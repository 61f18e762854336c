"""The disk tier's access pattern on RocksDB (rocksdict) and LMDB (py-lmdb): which store to embed.

A tiered sparse table (issue 31) asks its on-disk store for three things, each in batches of the
keys of one request: a multi-get of the keys the memory tier misses (some on disk, some new), a
multi-put of the rows it evicts, and a multi-delete of the rows it promotes (each row lives in one
tier). Rows are a table row's float32 payload: dim 8 values, the row-wise Adagrad accumulator and
the CTR accessor's 5 statistics (14 floats, 56 bytes), under 8-byte int64 keys.

Both stores are configured as a cache that a checkpoint, not the store, makes durable: RocksDB
without its write-ahead log, LMDB without fsync. The store is filled with `--rows` rows first,
then every batch (`--batch` keys, half of them on disk, half absent) is fetched, its present rows
deleted and as many rows put back, as a promotion and the eviction it causes would.

    python -m benchmarks.tier_store_bench --rows 2000000 --batches 200
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

WIDTH = 14  # dim 8 + row-wise Adagrad state 1 + 5 statistics, float32


def _keys(a: np.ndarray) -> list:
    return np.ascontiguousarray(a, dtype="<i8").view("V8").tolist()


def _values(rows: np.ndarray) -> list:
    rows = np.ascontiguousarray(rows, dtype="<f4")
    return rows.view(f"V{rows.shape[1] * 4}").ravel().tolist()


class Rocks:
    name = "rocksdict"

    def __init__(self, path: str) -> None:
        import rocksdict

        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_block_based_table_factory(_bloom_table(rocksdict))
        if os.environ.get("TIER_BENCH_ROCKS_PLAIN") != "1":  # rows are incompressible floats: skip the codec
            opts.set_compression_type(rocksdict.DBCompressionType.none())
        self.write_opts = rocksdict.WriteOptions()
        self.write_opts.disable_wal = True
        self.db = rocksdict.Rdict(path, opts)
        self.db.set_write_options(self.write_opts)
        self.rocksdict = rocksdict

    def get(self, keys: list) -> list:
        return self.db.get(keys)

    def put(self, keys: list, values: list) -> None:
        wb = self.rocksdict.WriteBatch(raw_mode=True)
        for k, v in zip(keys, values):
            wb.put(k, v)
        self.db.write(wb)

    def delete(self, keys: list) -> None:
        wb = self.rocksdict.WriteBatch(raw_mode=True)
        for k in keys:
            wb.delete(k)
        self.db.write(wb)

    def close(self) -> None:
        self.db.close()


def _bloom_table(rocksdict):
    table = rocksdict.BlockBasedOptions()
    table.set_bloom_filter(10, False)
    return table


class Lmdb:
    name = "lmdb"

    def __init__(self, path: str) -> None:
        import lmdb

        self.env = lmdb.open(path, map_size=1 << 36, sync=False, metasync=False, writemap=True,
                             readahead=False, max_dbs=0)

    def get(self, keys: list) -> list:
        with self.env.begin() as txn:
            found = dict(txn.cursor().getmulti(keys))
        return [found.get(k) for k in keys]

    def put(self, keys: list, values: list) -> None:
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti(zip(keys, values))

    def delete(self, keys: list) -> None:
        with self.env.begin(write=True) as txn:
            for k in keys:
                txn.delete(k)

    def close(self) -> None:
        self.env.close()


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.stat(os.path.join(root, f)).st_blocks * 512
    return total


def run(store_cls, rows: int, batches: int, batch: int, seed: int, workdir: str) -> dict:
    path = tempfile.mkdtemp(prefix=f"tier-store-{store_cls.name}-", dir=workdir)
    rng = np.random.default_rng(seed)
    try:
        store = store_cls(path)
        fill = 1 << 16
        t0 = time.perf_counter()
        for start in range(0, rows, fill):
            k = np.arange(start, min(rows, start + fill), dtype=np.int64)
            store.put(_keys(k), _values(rng.standard_normal((k.size, WIDTH), dtype=np.float32)))  # incompressible, as trained rows
        fill_s = time.perf_counter() - t0
        on_disk = np.ones(rows, dtype=bool)
        next_key = rows
        t_get = t_put = t_del = 0.0
        hits = 0
        for _ in range(batches):
            present = rng.choice(np.flatnonzero(on_disk), batch // 2, replace=False)
            absent = rng.integers(rows * 4, rows * 8, batch - batch // 2)
            query = np.concatenate([present, absent])
            t0 = time.perf_counter()
            got = store.get(_keys(query))
            t_get += time.perf_counter() - t0
            found = np.array([g is not None for g in got])
            hits += int(found.sum())
            t0 = time.perf_counter()
            store.delete(_keys(query[found]))
            t_del += time.perf_counter() - t0
            on_disk[query[found]] = False
            evicted = np.arange(next_key, next_key + int(found.sum()), dtype=np.int64)
            next_key += evicted.size
            t0 = time.perf_counter()
            store.put(_keys(evicted), _values(rng.standard_normal((evicted.size, WIDTH), dtype=np.float32)))
            t_put += time.perf_counter() - t0
        n = batches * batch
        store.close()
        return {"store": store_cls.name, "rows": rows, "batch": batch, "batches": batches, "fill_s": round(fill_s, 2),
                "fill_rows_per_s": round(rows / fill_s), "get_keys_per_s": round(n / t_get),
                "delete_keys_per_s": round(hits / t_del), "put_keys_per_s": round(hits / t_put),
                "cycle_keys_per_s": round(n / (t_get + t_del + t_put)), "hit_fraction": round(hits / n, 3),
                "disk_bytes": _du(path), "disk_bytes_per_row": round(_du(path) / rows, 1)}
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="where the stores are created (default: the temp folder)")
    p.add_argument("--stores", default="rocksdict,lmdb")
    args = p.parse_args()
    classes = {"rocksdict": Rocks, "lmdb": Lmdb}
    load = os.getloadavg()
    for name in args.stores.split(","):
        result = run(classes[name], args.rows, args.batches, args.batch, args.seed, args.workdir)
        result["loadavg"] = [round(x, 2) for x in load]
        print(json.dumps(result))


if __name__ == "__main__":
    main()
