"""A sparse table under a RAM budget against the all-RAM table, on a Zipf key stream (issue 31).

One PS server (in this process, `server_threads` handler threads) holds a table of `--rows` rows of
dim 8 (row-wise Adagrad, the CTR accessor, async mode), created by pulling every key once. Then
`--clients` client threads, each with its own PSClient, pull and push batches of `--batch` keys
drawn from Zipf(`--zipf`) over the rows (a rank's key is a fixed random permutation of the ranks,
so hot keys are spread over the key space; the keys of a batch are de-duplicated, as a worker's
are). The same streams run against the all-RAM table and against budgets of `--budgets` of the
rows, in one run, each after `--warmup` batches of every client's stream were pulled. Reported per table: pulled and pushed keys/s (distinct keys per batch, over the
stream's wall time, and per CPU-second of the process), the hit rate and the misses served per second (rows found on disk), the
rows per tier, promotions, evictions, the store's bytes per disk row, and the creation time.

    python -m benchmarks.tier_bench --rows 1000000 --budgets 0.01,0.1,0.5 --batches 100
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import numpy as np
import torch

from recps.ps.modes import server_halves
from recps.ps.node import PSClient, PSServer

DIM = 8
TOKEN = "tier-bench"


def zipf_batches(rows: int, batches: int, batch: int, a: float, seed: int, perm: np.ndarray) -> list[np.ndarray]:
    """`batches` arrays of the distinct keys among `batch` Zipf(a) draws over `rows` ranks."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batches):
        ranks = rng.zipf(a, size=batch * 2)
        ranks = ranks[ranks <= rows][:batch] - 1  # truncated to the table's rows
        out.append(np.unique(perm[ranks]))
    return out


def run_table(budget: int | None, args, streams: list[list[np.ndarray]], warmups: list[list[np.ndarray]]) -> dict:
    with PSServer(token=TOKEN, halves=server_halves(), num_threads=args.server_threads) as server:
        clients = [PSClient([server.endpoint], token=TOKEN, timeout_s=600) for _ in range(args.clients)]
        try:
            clients[0].create_sparse_table("emb", DIM, optimizer={"name": "rowwise_adagrad", "lr": 0.05},
                                           accessor={}, mode="async", memory_budget=budget)
            for c in clients[1:]:
                c.table_spec("emb")  # each client learns the table's spec
            t0 = time.perf_counter()
            chunk = 1 << 16
            for start in range(0, args.rows, chunk):
                clients[0].pull("emb", torch.arange(start, min(args.rows, start + chunk))).wait(600)
            create_s = time.perf_counter() - t0
            shard = server.sparse("emb")
            for i, client in enumerate(clients):  # warm-up: the hot rows find their way into memory
                for keys in warmups[i]:
                    client.pull("emb", torch.from_numpy(keys)).wait(600)
            before = shard.tier_stats()
            times = {"pull": [0.0] * args.clients, "push": [0.0] * args.clients}
            counted = [0] * args.clients
            errors: list[BaseException] = []

            def work(i: int) -> None:
                try:
                    client = clients[i]
                    g = torch.Generator().manual_seed(i)
                    for keys in streams[i]:
                        k = torch.from_numpy(keys)
                        t = time.perf_counter()
                        client.pull("emb", k).wait(600)
                        times["pull"][i] += time.perf_counter() - t
                        grads = torch.randn(k.numel(), DIM, generator=g) * 0.01
                        shows = torch.ones(k.numel())
                        clicks = (torch.rand(k.numel(), generator=g) < 0.05).float()
                        t = time.perf_counter()
                        client.push("emb", k, grads, shows=shows, clicks=clicks, assume_unique=True).wait(600)
                        times["push"][i] += time.perf_counter() - t
                        counted[i] += k.numel()
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            threads = [threading.Thread(target=work, args=(i,)) for i in range(args.clients)]
            t0, cpu0 = time.perf_counter(), time.process_time()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            cpu = time.process_time() - cpu0  # the process's (server and clients): less sensitive to the machine's load
            if errors:
                raise errors[0]
            keys = sum(counted)
            out = {"budget_rows": budget, "rows": len(shard), "create_s": round(create_s, 2), "wall_s": round(wall, 2),
                   "keys": keys,
                   # each client's keys over the time it spent in that verb, summed over clients
                   "pull_keys_per_s": round(sum(c / t for c, t in zip(counted, times["pull"]))),
                   "push_keys_per_s": round(sum(c / t for c, t in zip(counted, times["push"]))),
                   "pull_push_keys_per_s": round(keys / wall), "cpu_s": round(cpu, 2),
                   "pull_push_keys_per_cpu_s": round(keys / cpu)}
            after = shard.tier_stats()
            if after is not None:
                hits = after["memory_hits"] - before["memory_hits"]
                misses = after["disk_hits"] - before["disk_hits"]
                out.update({"hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
                            "misses": misses, "misses_per_s": round(misses / wall),
                            "promotions": after["promotions"] - before["promotions"],
                            "evictions": after["evictions"] - before["evictions"],
                            "rows_memory": after["rows_memory"], "rows_disk": after["rows_disk"],
                            "disk_bytes": after["disk_bytes"],
                            "disk_bytes_per_disk_row": round(after["disk_bytes"] / max(1, after["rows_disk"]), 1)})
            return out
        finally:
            for c in clients:
                c.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--budgets", default="0.01,0.1,0.5", help="fractions of the rows kept in RAM")
    p.add_argument("--batches", type=int, default=100, help="batches per client, measured")
    p.add_argument("--warmup", type=int, default=50, help="batches per client pulled before the measured ones")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--server-threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here too")
    args = p.parse_args()
    perm = np.random.default_rng(args.seed).permutation(args.rows).astype(np.int64)
    drawn = [zipf_batches(args.rows, args.warmup + args.batches, args.batch, args.zipf, args.seed + 1 + i, perm)
             for i in range(args.clients)]
    warmups = [d[: args.warmup] for d in drawn]
    streams = [d[args.warmup :] for d in drawn]
    results = []
    for budget in [None] + [max(1, int(float(f) * args.rows)) for f in args.budgets.split(",")]:
        load = os.getloadavg()
        r = run_table(budget, args, streams, warmups)
        r["loadavg_before"] = [round(x, 2) for x in load]
        r["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        print(json.dumps(r), flush=True)
        results.append(r)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
        os.replace(tmp, args.out)  # atomic


if __name__ == "__main__":
    main()
