"""Pull and push latency through the full PS client + server (recps.ps.node), on loopback.

The issue's workload per training step: CTR-DNN, 26 slots, batch 512 -> 13,312 keys per batch,
~6k unique (Zipf a=1.1 per slot, keys salted per slot), dim 9, all slots in ONE sparse table.
A server runs in its own process (as in the 1 server + 1 worker setup); the client process
de-duplicates, pulls (K, 9) rows and pushes (K, 9) gradients (Adagrad on the server).

Reported, median over --steps after --warmup (ms); --optimizer picks the server's rule:
    pull        client.pull(keys).wait()  (unique + partition + round trip + reassembly)
    push        client.push(keys, grads).wait()
    step        pull + push, one thread
    step_2thr   pull + push per thread, 2 threads at once (wall time per pair of steps)
    table_pull / table_push   the same ops on an in-process SparseTable (no transport)
    server_cpu / client_cpu   CPU ms per single-thread step (pull + push) of the server processes
                              and of the client process (from /proc: robust on a loaded machine)
    table_cpu                 CPU ms of the same pull + push on the in-process table
    pull_dense / push_dense   CTR-DNN's MLP as one dense table (~420k floats, Adam), push returning values
    communicators_2threads    Async / SyncCommunicator, 2 threads: per-step pull, pull_dense, push +
                              step_end, and steps/s (the PS part of a training step, no model compute),
                              each on tables of its mode (the servers apply a push by its table's mode)

    python benchmarks/ps_ops_bench.py                  # 1 server, prints a JSON line and a Markdown row
    python benchmarks/ps_ops_bench.py --servers 2      # keys split over 2 server processes
"""

from __future__ import annotations

import argparse
import os
import json
import multiprocessing as mp
import statistics
import threading
import time

import numpy as np

TOKEN = "bench-token"
SLOTS, BATCH, DIM = 26, 512, 9


def _serve(index: int, num_servers: int, threads: int, ready, stop) -> None:
    import torch

    from recps.ps.modes import server_halves
    from recps.ps.node import PSServer

    torch.set_num_threads(1)
    with PSServer(index, num_servers, token=TOKEN, num_threads=threads, halves=server_halves()) as server:
        ready.put((index, server.endpoint))
        stop.wait(900)


def _batches(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    salt = np.arange(SLOTS, dtype=np.int64) * 10_000_000
    return [(np.minimum(rng.zipf(1.1, size=(BATCH, SLOTS)), 1_000_000) + salt).reshape(-1) for _ in range(n)]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (from /proc), so that figures survive a loaded machine."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--server-threads", type=int, default=2, help="PSServer handler threads (0: on the network thread)")
    parser.add_argument("--optimizer", default="adagrad", help="server-side rule: sgd, adagrad, rowwise_adagrad, adam")
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_serve, args=(i, args.servers, args.server_threads, ready, stop), daemon=True) for i in range(args.servers)]
    for p in procs:
        p.start()

    import torch

    from recps.ps.node import PSClient, unique_inverse
    from recps.ps.table import SparseTable, make_rule

    torch.set_num_threads(1)
    endpoints = [e for _, e in sorted(ready.get(timeout=120) for _ in procs)]  # server order
    client = PSClient(endpoints, token=TOKEN, timeout_s=30)
    client.create_sparse_table("ctr", dim=DIM, optimizer={"name": args.optimizer, "lr": 0.05}, mode="async")

    batches = [torch.from_numpy(b) for b in _batches(args.warmup + args.steps)]
    uniq = [unique_inverse(b)[0] for b in batches]
    unique_keys = statistics.median(u.numel() for u in uniq)

    def step(keys: torch.Tensor, times: dict | None) -> None:
        t0 = time.perf_counter()
        rows = client.pull("ctr", keys).wait()  # (K, D)
        t1 = time.perf_counter()
        client.push("ctr", keys, rows * 0.01).wait()
        t2 = time.perf_counter()
        if times is not None:
            times["pull"].append(t1 - t0)
            times["push"].append(t2 - t1)
            times["step"].append(t2 - t0)

    times = {"pull": [], "push": [], "step": []}
    for i, b in enumerate(batches[: args.warmup]):
        step(b, None)
    cpu0 = [_cpu_s(p.pid) for p in procs], _cpu_s(os.getpid())
    for b in batches[args.warmup :]:
        step(b, times)
    cpu1 = [_cpu_s(p.pid) for p in procs], _cpu_s(os.getpid())
    server_cpu_ms = 1000 * sum(b - a for a, b in zip(cpu0[0], cpu1[0])) / args.steps
    client_cpu_ms = 1000 * (cpu1[1] - cpu0[1]) / args.steps

    # Two training threads, each with its own batches, at once.
    pair = []
    barrier = threading.Barrier(2)

    def worker(offset: int, out: list) -> None:
        for i in range(args.steps // 2):
            barrier.wait()
            t0 = time.perf_counter()
            step(batches[(2 * i + offset) % len(batches)], None)
            out.append(time.perf_counter() - t0)

    outs = [[], []]
    threads = [threading.Thread(target=worker, args=(k, outs[k])) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pair = [max(a, b) for a, b in zip(*outs)]

    # The same ops on an in-process table: what the transport and the client add.
    table = SparseTable(DIM, optimizer=make_rule(args.optimizer, lr=0.05))
    tt = {"pull": [], "push": []}
    cpu_table = 0.0
    for i, u in enumerate(uniq):
        if i == args.warmup:
            cpu_table = time.process_time()
        t0 = time.perf_counter()
        rows = table.pull(u)
        t1 = time.perf_counter()
        table.push(u, rows * 0.01)
        t2 = time.perf_counter()
        if i >= args.warmup:
            tt["pull"].append(t1 - t0)
            tt["push"].append(t2 - t1)

    table_cpu_ms = 1000 * (time.process_time() - cpu_table) / args.steps

    # Dense: CTR-DNN's MLP (26*9 + 13 -> 400 -> 400 -> 400 -> 1, ~420k floats) with Adam.
    shapes = {"l0.w": (400, SLOTS * DIM + 13), "l0.b": (400,), "l1.w": (400, 400), "l1.b": (400,),
              "l2.w": (400, 400), "l2.b": (400,), "out.w": (1, 400), "out.b": (1,)}
    client.create_dense_table("dense", shapes, optimizer={"name": "adam", "lr": 1e-3}, mode="async")
    n_dense = client.dense_layout("dense").size
    dense_grads = torch.randn(n_dense) * 1e-3
    td = {"pull_dense": [], "push_dense": []}
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        client.pull_dense("dense").wait()
        t1 = time.perf_counter()
        client.push_dense("dense", dense_grads, return_values=True).wait()
        t2 = time.perf_counter()
        if i >= args.warmup:
            td["pull_dense"].append(t1 - t0)
            td["push_dense"].append(t2 - t1)

    # Communicators: what a training thread waits for per step (no model compute here).
    # Each mode trains tables of its own: a table's mode says what the servers do with its pushes.
    from recps.ps.modes import AsyncMode, SyncMode

    client.create_sparse_table("ctr_sync", dim=DIM, optimizer={"name": args.optimizer, "lr": 0.05}, mode="sync")
    client.create_dense_table("dense_sync", shapes, optimizer={"name": "adam", "lr": 1e-3}, mode="sync")

    def comm_steps(comm, tables: tuple[str, str], thread: int, n: int, out: dict) -> None:
        sparse, dense = tables
        for i in range(n):
            u = uniq[(2 * i + thread) % len(uniq)]
            t0 = time.perf_counter()
            rows = comm.pull(sparse, u)  # (U, D)
            t1 = time.perf_counter()
            comm.pull_dense(dense)
            t2 = time.perf_counter()
            comm.push(sparse, u, rows * 0.01)
            comm.push_dense(dense, dense_grads)
            comm.step_end(thread)
            t3 = time.perf_counter()
            if i >= args.warmup // 2:
                out.setdefault("pull", []).append(t1 - t0)
                out.setdefault("pull_dense", []).append(t2 - t1)
                out.setdefault("push_and_step_end", []).append(t3 - t2)
                out.setdefault("step", []).append(t3 - t0)

    comm_results = {}
    for mode, tables in ((AsyncMode(max_pending=8, merge_threshold=4, timeout_s=30.0), ("ctr", "dense")),
                         (SyncMode(timeout_s=30.0), ("ctr_sync", "dense_sync"))):
        name = mode.name
        comm = mode.communicator(client, threads=2)
        outs = [{}, {}]
        n = args.warmup // 2 + args.steps // 2
        threads = [threading.Thread(target=comm_steps, args=(comm, tables, k, n, outs[k])) for k in range(2)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        comm.flush()
        wall = time.perf_counter() - t0
        comm.close()
        merged = {k: outs[0][k] + outs[1][k] for k in outs[0]}
        comm_results[name] = {f"{k}_ms": _median_ms(v) for k, v in merged.items()}
        comm_results[name]["steps_per_s_2threads"] = round(2 * n / wall, 1)
    result = {
        "servers": args.servers,
        "optimizer": args.optimizer,
        "server_threads": args.server_threads,
        "keys_per_batch": BATCH * SLOTS,
        "unique_keys": int(unique_keys),
        "dim": DIM,
        "pull_ms": _median_ms(times["pull"]),
        "push_ms": _median_ms(times["push"]),
        "step_ms": _median_ms(times["step"]),
        "step_2threads_ms": _median_ms(pair),
        "table_pull_ms": _median_ms(tt["pull"]),
        "table_push_ms": _median_ms(tt["push"]),
        "server_cpu_ms_per_step": round(server_cpu_ms, 2),
        "table_cpu_ms_per_step": round(table_cpu_ms, 2),
        "client_cpu_ms_per_step": round(client_cpu_ms, 2),
        "dense_floats": n_dense,
        "pull_dense_ms": _median_ms(td["pull_dense"]),
        "push_dense_ms": _median_ms(td["push_dense"]),
        "communicators_2threads": comm_results,
        "keys_per_s_1thread": round(BATCH * SLOTS / statistics.median(times["step"])),
        "keys_per_s_2threads": round(2 * BATCH * SLOTS / statistics.median(pair)),
    }
    client.close()
    stop.set()
    for p in procs:
        p.join(10)
    print(json.dumps(result))
    print(
        f"| {args.servers} | {args.server_threads} | {args.optimizer} | {result['unique_keys']} | {result['pull_ms']} | {result['push_ms']} | {result['step_ms']} | "
        f"{result['step_2threads_ms']} | {result['table_pull_ms']} | {result['table_push_ms']} | {result['server_cpu_ms_per_step']} | {result['table_cpu_ms_per_step']} | {result['client_cpu_ms_per_step']} |"
    )


if __name__ == "__main__":
    main()
