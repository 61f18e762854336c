"""Parameter-server training throughput: CTR-DNN, local vs sync / async / GEO, two topologies.

    python -m benchmarks.ps_throughput [--rows 200000] [--repeat 1] [--modes local,sync,async,geo]
    python -m benchmarks.ps_throughput --pooling        # the pooling kernel choice of recps.ps.embedding

Each run is the real CLI, `python -m recps.train`, on generated Criteo-schema data (26 slots,
vocabulary 10^6 per slot, batch 512, one pass, the full CTR-DNN 512-256-128-32, Adam on the
dense layers, row-wise Adagrad on the rows): ps=local with 2 Hogwild threads, then each PS
mode with 1 server + 1 worker x 2 threads and with 1 server + 2 workers x 1 thread on
127.0.0.1. examples/s is the training rate the workers measured (summed over workers, warm-up
included, start-up excluded); AUC is on the 20,000 held-out rows, from the servers' values.
Examples per CPU-second divide the examples by the CPU time the training took in every
process (workers during their training loop, servers from start to stop; local: the process
during its training loop): on a machine shared with other jobs it is the steadier figure.
Prints one JSON line per run and a Markdown table with each rate's ratio to local; writes
benchmarks/results/ps_throughput.json. The 1-minute load average is recorded around each run:
this machine has 2 cores shared with other jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGIES = {"1S+1Wx2T": (1, 2), "1S+2Wx1T": (2, 1)}  # workers, threads
TARGETS = {  # examples/s from the issue: 3x PaddlePaddle 2.6.2's on this kind of machine
    ("async", "1S+1Wx2T"): 17000, ("geo", "1S+1Wx2T"): 18000,
    ("async", "1S+2Wx1T"): 27000, ("geo", "1S+2Wx1T"): 25000,
}


def data_overrides(rows: int, vocab: int, seed: int) -> list[str]:
    folder = ROOT / "datasets" / "generated" / f"bench-s{seed}-v{vocab}-n{rows}"  # shared with local_throughput
    test_rows = max(rows // 10, 10000)
    return [f"dataset.dir={folder}", f"dataset.train=[{folder}/train.txt]", f"dataset.test=[{folder}/test.txt]",
            f"dataset.generate.train_rows={rows}", f"dataset.generate.test_rows={test_rows}",
            f"dataset.generate.vocab={vocab}", f"dataset.generate.seed={seed}"]


def run_one(mode: str, topology: str | None, rows: int, vocab: int, seed: int, k_steps: int,
            extra: list[str] = ()) -> dict:
    overrides = ["model=ctr_dnn", "trainer.batch_size=512", "trainer.epochs=1", "checkpoint=false",
                 "progress=false", f"seed={seed}", *data_overrides(rows, vocab, seed)]
    if mode == "local":
        overrides += ["ps=local", f"ps.num_embeddings={vocab}", "trainer.threads=2"]
        return _measure(mode, None, [sys.executable, "-m", "benchmarks.ps_throughput", "--local-child",
                                     json.dumps(overrides)], None, k_steps)
    workers, threads = TOPOLOGIES[topology]
    overrides += [f"ps={mode}", f"cluster.workers={workers}", f"trainer.threads={threads}"]
    if mode == "geo":
        overrides.append(f"ps.k_steps={k_steps}")
    overrides += list(extra)
    return _measure(mode, topology, [sys.executable, "-m", "recps.train", *overrides], "metrics.json", k_steps)


def _measure(mode: str, topology: str | None, command: list[str], metrics_file: str | None, k_steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="recps-ps-bench-") as tmp:
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        if metrics_file is not None:
            command = [*command, f"hydra.run.dir={tmp}"]
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{mode} {topology}: run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        if metrics_file is None:
            metrics = json.loads(proc.stdout.strip().splitlines()[-1])
        else:
            metrics = json.loads((Path(tmp) / metrics_file).read_text())
    return {
        "mode": mode, "topology": topology or "1 process x 2 threads", "examples_per_sec": round(metrics["examples_per_sec"]),
        "auc": round(metrics["auc"], 4), "logloss": round(metrics["logloss"], 4),
        "examples_per_cpu_second": round(metrics["examples_per_cpu_second"]) if "examples_per_cpu_second" in metrics else None,
        "train_examples": metrics["train_examples"], "wall_s": round(wall, 1),
        "load_1min_before": round(load_before, 2), "load_1min_after": round(os.getloadavg()[0], 2),
        "k_steps": k_steps if mode == "geo" else None,
    }


def table(results: list[dict]) -> str:
    local = {r["run"]: r for r in results if r["mode"] == "local"}
    lines = ["| run | mode | topology | examples/s | ratio to local | examples per CPU-s | ratio to local | AUC | "
             "AUC - local | load (1 min) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = local.get(r["run"])
        ratio = f"{r['examples_per_sec'] / base['examples_per_sec']:.2f}" if base else "-"
        cpu, base_cpu = r.get("examples_per_cpu_second"), base and base.get("examples_per_cpu_second")
        cpu_ratio = f"{cpu / base_cpu:.2f}" if cpu and base_cpu else "-"
        dauc = f"{r['auc'] - base['auc']:+.4f}" if base else "-"
        lines.append(f"| {r['run']} | {r['mode']} | {r['topology']} | {r['examples_per_sec']:,} | {ratio} | "
                     f"{cpu or 0:,} | {cpu_ratio} | {r['auc']:.4f} | {dauc} | "
                     f"{r['load_1min_before']:.1f} -> {r['load_1min_after']:.1f} |")
    return "\n".join(lines)


def pooling_bench(unique: int = 8000, batch: int = 512, features: int = 26, repeats: int = 5) -> dict:
    """Forward + backward of sum pooling over pulled rows: FBGEMM vs torch (the embedding's choice)."""
    import torch
    import torch.nn.functional as F

    from recps.ps.embedding import pool_sum

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    inverse = torch.randint(0, unique, (batch * features,), generator=g)
    offsets = torch.arange(batch * features + 1)  # one key per bag, as Criteo
    out = {}
    for dim in (9, 12):
        rows = torch.randn(unique, dim, generator=g)
        up = torch.randn(batch, features * dim, generator=g)

        def fbgemm():
            r = rows.clone().requires_grad_(True)
            (pool_sum(r, inverse, offsets, features) * up).sum().backward()

        def embedding_bag():
            r = rows.clone().requires_grad_(True)
            pooled = F.embedding_bag(inverse, r, offsets[:-1], mode="sum")  # (F*B, D)
            (pooled.view(features, batch, dim).transpose(0, 1).reshape(batch, -1) * up).sum().backward()

        def gather():
            r = rows.clone().requires_grad_(True)
            (r[inverse].view(features, batch, dim).transpose(0, 1).reshape(batch, -1) * up).sum().backward()

        for name, fn in (("fbgemm", fbgemm), ("embedding_bag", embedding_bag), ("gather", gather)):
            for _ in range(3):
                fn()
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                for _ in range(20):
                    fn()
                times.append((time.perf_counter() - t) / 20 * 1e3)
            out[f"{name}_d{dim}_ms"] = round(sorted(times)[len(times) // 2], 3)
    out["load_1min"] = round(os.getloadavg()[0], 2)
    return out


def local_child(overrides: list[str]) -> dict:
    """ps=local in this process: the job recps.train builds, with the training loop's CPU time."""
    from hydra import compose, initialize_config_dir

    from recps.config import register_resolvers
    from recps.run import build_job, evaluate

    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    job = build_job(cfg)
    cpu = time.process_time()
    stats = job.trainer.fit(job.data.train, int(cfg.trainer.batch_size), epochs=int(cfg.trainer.epochs), progress=False)
    cpu = time.process_time() - cpu
    metrics = evaluate(job)
    metrics.update(examples_per_sec=stats.examples_per_sec, train_examples=stats.examples,
                   examples_per_cpu_second=stats.examples / cpu)
    return metrics


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--vocab", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k-steps", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=1, help="runs of the whole set")
    parser.add_argument("--modes", default="local,sync,async,geo")
    parser.add_argument("--topologies", default=",".join(TOPOLOGIES))
    parser.add_argument("--override", action="append", default=[], help="extra recps.train override for the PS runs")
    parser.add_argument("--pooling", action="store_true", help="only the pooling kernel comparison")
    parser.add_argument("--local-child", help=argparse.SUPPRESS)  # JSON overrides: one ps=local run, here
    args = parser.parse_args(argv)
    if args.local_child:
        print(json.dumps(local_child(json.loads(args.local_child))))
        return 0
    if args.pooling:
        print(json.dumps(pooling_bench()))
        return 0
    modes = args.modes.split(",")
    results = []
    for run in range(1, args.repeat + 1):
        for mode in modes:
            for topology in ([None] if mode == "local" else args.topologies.split(",")):
                r = run_one(mode, topology, args.rows, args.vocab, args.seed, args.k_steps, args.override)
                r["run"] = run
                target = TARGETS.get((mode, topology))
                if target:
                    r["target_examples_per_sec"] = target
                print(json.dumps(r), flush=True)
                results.append(r)
    report = {"benchmark": "ps_throughput", "machine": f"{platform.machine()} {os.cpu_count()} cpus",
              "rows": args.rows, "vocab_per_slot": args.vocab, "batch": 512, "results": results}
    out = ROOT / "benchmarks" / "results" / "ps_throughput.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
