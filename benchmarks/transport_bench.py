"""Pull latency of the recps transport on one machine (loopback TCP or IPC).

A server process answers "pull" with a slice of a preallocated table (K, D) fp32, so the figure
is the transport's cost: request of K int64 keys out (named "keys", as recps.ps.node.PSClient
sends them), K x D fp32 rows back. Reported per
configuration: median and 10th percentile of the wall-clock latency, and the CPU time one call
costs the client process and the server process (all their threads, ZeroMQ's I/O threads included).
The configurations take turns (--rounds x --runs calls each), and a bare pyzmq server/client pair
answering the same pull is measured alongside as the floor.

    python benchmarks/transport_bench.py                         # the issue's two sizes, TCP and IPC
    python benchmarks/transport_bench.py --fanout                # also: 2 servers, 1 and 2 client threads,
                                                                 #   per-thread sockets vs one I/O thread
    python benchmarks/transport_bench.py --encryption both       # every configuration with CURVE and without,
                                                                 #   taking turns (issue 15: the cost of encryption)

Issue 4's reference (ZeroMQ, loopback TCP): 8k keys -> 8k x 16 in 0.42 ms, 64k keys -> 64k x 64 in 6.4 ms.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import Future

import numpy as np
import torch
import zmq

from recps.ps.transport import TransportClient, TransportServer, curve_keys, security, wait_all, wire

TOKEN = "bench-token"
SIZES = [(8192, 16), (65536, 64)]


def _serve(bind: str, num_threads: int, curve: bool, ready: mp.Queue, stop: mp.Event) -> None:
    torch.set_num_threads(1)
    tables = {f"d{d}": torch.randn(k, d) for k, d in SIZES}  # (K, D) preallocated rows

    def pull(verb, table, fields, meta):
        return [tables[table][: fields["keys"].shape[0]]]  # (K, D) a contiguous slice, sent without a copy

    with TransportServer(pull, token=TOKEN, bind=bind, num_threads=num_threads, curve=curve) as server:
        ready.put(server.endpoint)
        stop.wait(600)


def _serve_raw(ready: mp.Queue, stop: mp.Event) -> None:
    """The floor: bare pyzmq ROUTER answering with the same rows, no header, no checks, one thread."""
    tables = {d: torch.randn(k, d).numpy() for k, d in SIZES}  # (K, D)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    ready.put(f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}")
    while not stop.is_set():
        if router.poll(100):
            identity, dim, keys = router.recv_multipart(copy=False)
            router.send_multipart([identity, tables[int(dim.bytes)][: len(keys.buffer) // 8]], copy=False)
    router.close()
    ctx.term()


def _raw_caller(endpoint: str, k: int, d: int):
    """A call() against the bare pyzmq server, and its cleanup."""
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 30_000
    sock.connect(endpoint)
    keys = torch.randint(0, 1 << 40, (k,)).numpy()  # (K,) int64

    def call():
        sock.send_multipart([str(d).encode(), keys], copy=False)
        (reply,) = sock.recv_multipart(copy=False)
        return torch.from_numpy(np.frombuffer(reply.buffer, np.float32)).view(k, d)  # (K, D)

    def close():
        sock.close()
        zctx.term()

    return call, close


class IOThreadClient:
    """The alternative client design, for comparison only: one I/O thread owns every socket;
    callers hand it requests over inproc and wait on a Future."""

    def __init__(self, endpoints, token, curve: bool):
        self._ctx = zmq.Context()
        self._digest = wire.token_digest(token)
        self._keys = curve_keys(token) if curve else None
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._local = threading.local()
        self._inbox = f"inproc://io-{id(self)}"
        pull = self._ctx.socket(zmq.PULL)
        pull.bind(self._inbox)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(endpoints, pull), daemon=True)
        self._thread.start()

    def request(self, server, verb, table, tensors):
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._local.push = self._ctx.socket(zmq.PUSH)
            push.linger = 0
            push.connect(self._inbox)
        rid = next(self._ids)
        future = self._pending[rid] = Future()
        frames = wire.encode(wire.REQUEST, rid, verb=verb, text=table, tensors=tensors, token_digest=self._digest)
        push.send_multipart([server.to_bytes(2, "little"), *frames], copy=False)
        return future

    def _run(self, endpoints, pull):
        socks = []
        for e in endpoints:
            s = self._ctx.socket(zmq.DEALER)
            s.linger = 0
            security.secure_client_socket(s, self._keys)
            s.connect(e)
            socks.append(s)
        poller = zmq.Poller()
        for s in (pull, *socks):
            poller.register(s, zmq.POLLIN)
        while not self._stop.is_set():
            for s, _ in poller.poll(100):
                if s is pull:
                    frames = pull.recv_multipart(copy=False)
                    socks[int.from_bytes(frames[0].bytes, "little")].send_multipart(frames[1:], copy=False)
                else:
                    msg = wire.decode(s.recv_multipart(copy=False))
                    self._pending.pop(msg.request_id).set_result(msg.tensors)
        for s in (pull, *socks):
            s.close()

    def close(self):
        self._stop.set()
        self._thread.join(5)


def _median_ms(fn, runs: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 10 ms ticks), NaN elsewhere.

    Wall-clock latency on a shared machine swings with the load; the CPU a call costs does not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start(target, args_list):
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    procs = []
    endpoints = []
    for args in args_list:  # one at a time, so that endpoints[i] belongs to args_list[i]
        procs.append(ctx.Process(target=target, args=(*args, ready, stop), daemon=True))
        procs[-1].start()
        endpoints.append(ready.get(timeout=180))
    return endpoints, stop, procs


def _stop_servers(stop, procs):
    stop.set()
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()


def bench_latency(configs: list[tuple[str, int, bool]], runs: int, warmup: int, rounds: int) -> list[dict]:
    """Median pull latency per (transport, server threads, encryption) and size. The configurations
    take turns, `rounds` times, so that load from other processes on the machine hits them all alike."""
    tmp = tempfile.mkdtemp(prefix="recps-bench-")
    binds = ["127.0.0.1" if t == "tcp" else f"ipc://{tmp}/s{i}.sock" for i, (t, _, _) in enumerate(configs)]
    endpoints, stop, procs = _start(_serve, [(b, n, c) for b, (_, n, c) in zip(binds, configs)])
    raw_endpoints, raw_stop, raw_procs = _start(_serve_raw, [()])
    callers, closers, pids = {}, [], {}
    try:
        clients = {}  # one per encryption setting, knowing every server (it talks only to its own kind)
        for curve in sorted({c for _, _, c in configs}):
            clients[curve] = TransportClient(endpoints, token=TOKEN, timeout_s=30, curve=curve)
            closers.append(clients[curve].close)
        for k, d in SIZES:
            call, close = _raw_caller(raw_endpoints[0], k, d)
            callers[("raw pyzmq, tcp", "-", k, d)] = call
            pids[("raw pyzmq, tcp", "-", k, d)] = raw_procs[0].pid
            closers.append(close)
            keys = torch.randint(0, 1 << 40, (k,))  # (K,) int64
            for i, (transport, threads, curve) in enumerate(configs):
                what = f"recps, {transport}, {'curve' if curve else 'no encryption'}"
                callers[(what, threads, k, d)] = lambda i=i, d=d, keys=keys, c=clients[curve]: c.call(i, "pull", f"d{d}", {"keys": keys})
                pids[(what, threads, k, d)] = procs[i].pid
        for key, call in callers.items():
            got = call()
            got = got.tensors[0] if hasattr(got, "tensors") else got
            assert tuple(got.shape) == key[2:], (key, got.shape)
            for _ in range(warmup):
                call()
        samples: dict[tuple, list[float]] = {key: [] for key in callers}
        cpu = {key: [0.0, 0.0] for key in callers}  # client, server CPU seconds
        for _ in range(rounds):
            for key, call in callers.items():
                client_cpu, server_cpu = time.process_time(), _cpu_seconds(pids[key])
                for _ in range(runs):
                    start = time.perf_counter()
                    call()
                    samples[key].append(time.perf_counter() - start)
                cpu[key][0] += time.process_time() - client_cpu
                cpu[key][1] += _cpu_seconds(pids[key]) - server_cpu
    finally:
        for close in closers:
            close()
        _stop_servers(stop, procs)
        _stop_servers(raw_stop, raw_procs)
    return [{"what": w, "server_threads": n, "keys": k, "dim": d, "runs": len(v), "median_ms": statistics.median(v) * 1e3,
             "p10_ms": float(np.percentile(v, 10)) * 1e3,
             "client_cpu_ms": cpu[(w, n, k, d)][0] / len(v) * 1e3, "server_cpu_ms": cpu[(w, n, k, d)][1] / len(v) * 1e3}
            for (w, n, k, d), v in samples.items()]


def bench_fanout(runs: int, warmup: int, rounds: int, num_threads: int, curve: bool = True) -> list[dict]:
    """8k keys -> 8k x 16 rows split over 2 servers, from 1 and from 2 client threads at once,
    with per-thread sockets (TransportClient) and with one I/O thread (IOThreadClient); taking turns."""
    endpoints, stop, procs = _start(_serve, [("127.0.0.1", num_threads, curve)] * 2)
    k, d = SIZES[0]
    halves = [torch.randint(0, 1 << 40, (k // 2,)) for _ in endpoints]  # (K/2,) per server
    direct = TransportClient(endpoints, token=TOKEN, timeout_s=30, curve=curve)
    io = IOThreadClient(endpoints, TOKEN, curve)
    designs = {
        "per-thread sockets": lambda: wait_all([direct.request(s, "pull", f"d{d}", {"keys": halves[s]}) for s in range(2)]),
        "one I/O thread": lambda: [f.result(30) for f in [io.request(s, "pull", f"d{d}", {"keys": halves[s]}) for s in range(2)]],
    }
    samples: dict[tuple, list[float]] = {(name, n): [] for name in designs for n in (1, 2)}

    def loop(fn, out, count):
        for _ in range(warmup):  # each new thread opens its own connections first
            fn()
        for _ in range(count):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)

    try:
        for _ in range(rounds):
            for (name, n), out in samples.items():
                threads = [threading.Thread(target=loop, args=(designs[name], out, runs)) for _ in range(n)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(300)
    finally:
        direct.close()
        io.close()
        _stop_servers(stop, procs)
    return [{"what": f"fan-out to 2 servers, {name}", "client_threads": n, "keys": k, "dim": d, "runs": len(v),
             "median_ms": statistics.median(v) * 1e3} for (name, n), v in samples.items()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="calls per configuration and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--configs", default="tcp:2,tcp:0,ipc:2", help="transport:server_threads, comma-separated")
    parser.add_argument("--encryption", choices=["curve", "off", "both"], default="curve",
                        help="CURVE (the transport's default), none, or each configuration both ways, taking turns")
    parser.add_argument("--fanout", action="store_true", help="also compare the two client designs")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    settings = {"curve": [True], "off": [False], "both": [True, False]}[args.encryption]
    configs = [(c.split(":")[0], int(c.split(":")[1]), curve) for c in args.configs.split(",") for curve in settings]
    rows = bench_latency(configs, args.runs, args.warmup, args.rounds)
    if args.fanout:
        rows += bench_fanout(args.runs, args.warmup, args.rounds, 2, curve=settings[0])
    for row in rows:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
