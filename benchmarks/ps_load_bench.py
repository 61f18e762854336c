"""Load test of the PS node verbs: C client processes push and pull as fast as they can against S
server processes (recps.ps.node PSServer / PSClient on 127.0.0.1) for a fixed time, then the
tables are checked for lost updates, exactly.

Counting setup: one sparse table (dim D, zeros, SGD lr 1, async: applied on arrival) and one dense
table (N floats, zeros, SGD lr 1). Every gradient is integer-valued (uniform in [-3, 3]), so each
row's value is minus the sum of every gradient pushed to it, in any order, exactly in float32
(|sums| stay far below 2^24). Each client keeps its own int64 total per key (and per dense
parameter); at the end the totals of all clients are added and compared with a pull of every key
(create=False): a row that differs is a lost (or doubled) update. The servers' row count is checked
against the keys the clients touched too.

A client's step, as fast as it can: pull(keys).wait(), push(keys, grads).wait(), pull_dense().wait(),
push_dense(grads).wait(); keys: B per step, Zipf(1.2) over K keys (hot rows: every client updates
the same rows at once). The latency of each wait (request sent -> result assembled) is recorded per
op; p50 / p99 / max are over every call of every client.

    python -m benchmarks.ps_load_bench --clients 8 --servers 2 --seconds 60     # JSON + a RESULTS.md section
    python -m benchmarks.ps_load_bench --clients 4 --seconds 5 --no-md           # a quick check

The JSON goes to benchmarks/results/ps_load_<UTC date>.json (--json to choose); the section is
written between <!-- BEGIN ps_load_bench --> and <!-- END ps_load_bench --> in benchmarks/RESULTS.md
(appended if absent; the rest of the file is left as it is; written atomically).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["run", "markdown", "write_section"]

TOKEN = "load-bench-token"
OPS = ("pull", "push", "pull_dense", "push_dense")
HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- BEGIN ps_load_bench -->", "<!-- END ps_load_bench -->"


def _serve(index: int, num_servers: int, threads: int, ready, stop) -> None:
    import torch

    from recps.ps.modes import server_halves
    from recps.ps.node import PSServer

    torch.set_num_threads(1)
    with PSServer(index, num_servers, token=TOKEN, num_threads=threads, halves=server_halves()) as server:
        ready.put((index, server.endpoint))
        stop.wait(3600)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _save_npz(path: Path, **arrays) -> None:
    """np.savez to a temporary name, then renamed into place (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)


def _client(index: int, endpoints: list[str], cfg: dict, folder: str, ready, go, deadline_box) -> None:
    """One client process: steps until the shared deadline, then writes its totals and latencies."""
    import torch

    from recps.ps.node import PSClient

    torch.set_num_threads(1)
    keys_n, batch, dim, dense_n = cfg["keys"], cfg["batch"], cfg["dim"], cfg["dense"]
    rng = np.random.default_rng(1000 + index)
    total = torch.zeros(keys_n, dim, dtype=torch.int64)  # (K, D) this client's sum of pushed gradients
    dense_total = torch.zeros(dense_n, dtype=torch.int64)  # (N,)
    touched = torch.zeros(keys_n, dtype=torch.bool)  # (K,) keys this client pulled (each has a row now)
    lat: dict[str, list[float]] = {op: [] for op in OPS}
    with PSClient(endpoints, token=TOKEN, timeout_s=cfg["timeout_s"]) as client:
        client.table_spec("load")  # learn both tables' specs before the clock starts
        client.table_spec("load_dense")
        ready.put(index)
        if not go.wait(120):
            raise RuntimeError(f"client {index}: no start signal within 120 s")
        deadline = deadline_box.value
        perf = time.perf_counter
        cpu0 = time.process_time()
        while time.time() < deadline:
            keys = torch.from_numpy((rng.zipf(1.2, size=batch) - 1) % keys_n)  # (B,) int64, duplicates
            grads = torch.from_numpy(rng.integers(-3, 4, size=(batch, dim))).to(torch.float32)  # (B, D)
            dense_grads = torch.from_numpy(rng.integers(-3, 4, size=dense_n)).to(torch.float32)  # (N,)
            t0 = perf()
            client.pull("load", keys).wait()
            t1 = perf()
            client.push("load", keys, grads).wait()
            t2 = perf()
            client.pull_dense("load_dense").wait()
            t3 = perf()
            client.push_dense("load_dense", dense_grads).wait()
            t4 = perf()
            total.index_add_(0, keys, grads.to(torch.int64))
            touched[keys] = True
            dense_total += dense_grads.to(torch.int64)
            lat["pull"].append(t1 - t0)
            lat["push"].append(t2 - t1)
            lat["pull_dense"].append(t3 - t2)
            lat["push_dense"].append(t4 - t3)
        ended, cpu = time.time(), time.process_time() - cpu0
    _save_npz(Path(folder) / f"client{index}.npz", total=total.numpy(), dense_total=dense_total.numpy(),
              touched=touched.numpy(), ended=np.float64(ended), cpu=np.float64(cpu),
              **{f"lat_{op}": np.asarray(v, dtype=np.float64) for op, v in lat.items()})


def _percentiles_ms(x: np.ndarray) -> dict:
    if x.size == 0:
        return {"calls": 0}
    p50, p99 = np.percentile(x, [50, 99])
    return {"calls": int(x.size), "p50_ms": round(1000 * p50, 3), "p99_ms": round(1000 * p99, 3),
            "max_ms": round(1000 * float(x.max()), 3)}


def run(clients: int = 8, servers: int = 2, seconds: float = 60.0, keys: int = 100_000, batch: int = 512, dim: int = 8,
        dense: int = 4096, server_threads: int = 2, timeout_s: float = 60.0) -> dict:
    """Run the load test (see the module docstring) and return its result; `lost_rows` == 0 and
    `dense_lost` == 0 mean no lost update."""
    for name, value in (("clients", clients), ("servers", servers), ("keys", keys), ("batch", batch), ("dim", dim),
                        ("dense", dense)):
        if value < 1:
            raise ValueError(f"ps_load_bench: --{name}={value}; give a positive number")
    if not seconds > 0:
        raise ValueError(f"ps_load_bench: --seconds={seconds}; give a positive number of seconds")
    import torch

    from recps.ps.node import PSClient

    cfg = {"keys": keys, "batch": batch, "dim": dim, "dense": dense, "timeout_s": timeout_s}
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_serve, args=(i, servers, server_threads, ready, stop), daemon=True) for i in range(servers)]
    cprocs: list = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="recps-load-") as folder:
        try:
            for p in procs:
                p.start()
            endpoints = [e for _, e in sorted(ready.get(timeout=120) for _ in procs)]
            admin = PSClient(endpoints, token=TOKEN, timeout_s=timeout_s)
            sgd = {"name": "sgd", "lr": 1.0}
            admin.create_sparse_table("load", dim=dim, optimizer=sgd, initializer={"kind": "zeros"}, mode="async")
            admin.create_dense_table("load_dense", dense, optimizer=sgd, mode="async")
            client_ready, go, deadline = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
            cprocs = [ctx.Process(target=_client, args=(i, endpoints, cfg, folder, client_ready, go, deadline))
                      for i in range(clients)]
            for p in cprocs:
                p.start()
            for _ in cprocs:
                client_ready.get(timeout=180)
            cpu0 = {p.pid: _cpu_s(p.pid) for p in procs}
            start = time.time()
            deadline.value = start + seconds
            go.set()
            for p in cprocs:
                p.join(seconds + timeout_s + 60)
            server_cpu = sum(_cpu_s(p.pid) - cpu0[p.pid] for p in procs)  # includes the clients' wind-down
            bad = [(i, p.exitcode) for i, p in enumerate(cprocs) if p.exitcode != 0]
            if bad:
                raise RuntimeError(f"ps_load_bench: client process(es) failed (index, exit code): {bad}")
            parts = [np.load(Path(folder) / f"client{i}.npz") for i in range(clients)]
            total = sum(torch.from_numpy(p["total"]) for p in parts)  # (K, D) int64
            dense_total = sum(torch.from_numpy(p["dense_total"]) for p in parts)  # (N,)
            all_keys = torch.arange(keys, dtype=torch.int64)
            rows = admin.pull("load", all_keys, create=False).wait(timeout_s)  # (K, D) float32
            values = admin.pull_dense("load_dense").wait(timeout_s)  # (N,)
            server_rows = admin.stats()["tables"]["load"]["rows"]
            admin.close()
        finally:
            stop.set()
            for p in cprocs + procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    load_after = os.getloadavg()
    integral = bool(torch.equal(rows, rows.round())) and bool(torch.equal(values, values.round()))
    expected = -total  # SGD lr 1 from zeros: value = -(sum of gradients)
    wrong = (rows.to(torch.int64) != expected).any(dim=1)  # (K,)
    dense_wrong = values.to(torch.int64) != -dense_total
    touched = int(np.logical_or.reduce([p["touched"] for p in parts]).sum())
    wall = max(float(p["ended"]) for p in parts) - start  # the go signal to the last client's last step
    client_cpu = sum(float(p["cpu"]) for p in parts)
    lat = {op: np.concatenate([p[f"lat_{op}"] for p in parts]) for op in OPS}
    steps = int(lat["pull"].size)
    return {
        "clients": clients, "servers": servers, "seconds": seconds, "wall_s": round(wall, 2),
        "keys": keys, "batch": batch, "dim": dim, "dense": dense, "server_threads": server_threads,
        "steps": steps, "steps_per_s": round(steps / wall, 1),
        "rows_pushed": int(batch * steps), "abs_gradient_sum": int(total.abs().sum()) + int(dense_total.abs().sum()),
        "latency": {op: _percentiles_ms(lat[op]) for op in OPS},
        "ops_per_s": {op: round(lat[op].size / wall, 1) for op in OPS},
        "lost_rows": int(wrong.sum()), "rows_checked": keys, "rows_nonzero": int((total != 0).any(dim=1).sum()),
        "dense_lost": int(dense_wrong.sum()), "dense_checked": dense, "values_integral": integral,
        "server_rows": int(server_rows), "keys_touched": touched,  # a row for every key pulled, no other
        "cpu_s": {"servers": round(server_cpu, 1), "clients": round(client_cpu, 1)},
        "load_avg_before": [round(x, 2) for x in load_before], "load_avg_after": [round(x, 2) for x in load_after],
        "cpus": os.cpu_count(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }


def markdown(r: dict, command: str) -> str:
    lines = [
        f"## PS load: {r['clients']} clients x {r['servers']} servers, {r['seconds']:g} s (issue 15)",
        "",
        f"`{command}` ({r['date_utc']} UTC, {r['cpus']} CPUs shared with other runs: load average "
        f"{r['load_avg_before'][0]} before, {r['load_avg_after'][0]} after). Each client process steps as fast as it can: "
        f"pull + push of {r['batch']} Zipf(1.2) keys over {r['keys']:,} rows of dim {r['dim']} (one table, async, SGD lr 1), "
        f"then pull_dense + push_dense of {r['dense']:,} floats; {r['server_threads']} handler threads per server; "
        "integer gradients, so every row must equal minus the sum of what was pushed to it, exactly.",
        "",
        f"**Lost updates: {r['lost_rows']} of {r['rows_checked']:,} rows ({r['rows_nonzero']:,} with a non-zero sum), "
        f"{r['dense_lost']} of {r['dense_checked']:,} dense values**; {r['rows_pushed']:,} rows pushed in {r['steps']:,} steps "
        f"({r['steps_per_s']:,} steps/s over all clients, wall {r['wall_s']} s); {r['server_rows']:,} rows on the servers for "
        f"{r['keys_touched']:,} keys pulled. "
        f"CPU: servers {r['cpu_s']['servers']} s, clients {r['cpu_s']['clients']} s.",
        "",
        "| op | calls | calls/s | p50 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for op in OPS:
        x = r["latency"][op]
        lines.append(f"| {op} | {x['calls']:,} | {r['ops_per_s'][op]:,} | {x.get('p50_ms', '-')} | {x.get('p99_ms', '-')} | "
                     f"{x.get('max_ms', '-')} |")
    return "\n".join(lines) + "\n"


def write_section(path: Path, text: str) -> None:
    """Put `text` between the markers in `path` (appended with them if absent), atomically: the
    file is re-read just before the write, so other sections written meanwhile are kept."""
    from recps import fs as rfs

    old = path.read_text()
    block = f"{BEGIN}\n{text.rstrip()}\n{END}\n"
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END) + r"\n?", re.S)
    new = pattern.sub(lambda _: block, old, count=1) if pattern.search(old) else old.rstrip() + "\n\n" + block
    rfs.write_atomic(str(path), new, overwrite=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ps_load_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--keys", type=int, default=100_000, help="rows of the sparse table the keys fall in")
    parser.add_argument("--batch", type=int, default=512, help="keys per pull / push")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--dense", type=int, default=4096, help="floats of the dense table")
    parser.add_argument("--server-threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="where the JSON goes (default benchmarks/results/ps_load_<date>.json)")
    parser.add_argument("--results-md", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--no-md", action="store_true", help="do not write the RESULTS.md section")
    args = parser.parse_args(argv)
    result = run(args.clients, args.servers, args.seconds, args.keys, args.batch, args.dim, args.dense, args.server_threads)
    command = "python -m benchmarks.ps_load_bench " + " ".join(argv if argv is not None else os.sys.argv[1:])
    result["command"] = command
    out = Path(args.json) if args.json else HERE / "results" / f"ps_load_{time.strftime('%Y-%m-%d', time.gmtime())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    from recps import fs as rfs

    rfs.write_atomic(str(out), json.dumps(result, indent=1), overwrite=True)
    print(json.dumps(result))
    if not args.no_md:
        write_section(Path(args.results_md), markdown(result, command))
    ok = (result["lost_rows"] == 0 and result["dense_lost"] == 0 and result["values_integral"]
          and result["server_rows"] == result["keys_touched"])
    if not ok:
        print(f"LOST UPDATES: {result['lost_rows']} rows, {result['dense_lost']} dense values")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
