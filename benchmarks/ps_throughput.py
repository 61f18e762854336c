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

`run_one` is also the suite's launcher (`python -m benchmarks.run`): any model, mode, topology
(`Topology`: "1S+2Wx1T", "1Px2T"), batch size and generated world, extra `recps.train`
overrides (e.g. `trainer.observers`), the peak RSS of every process of the run
(`benchmarks.procmon`). Training metrics are off in these runs (`metrics=off`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.procmon import run_monitored

__all__ = ["Topology", "TOPOLOGIES", "data_overrides", "run_one", "table", "pooling_bench", "local_child", "main"]

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGIES = {"1S+1Wx2T": (1, 2), "1S+2Wx1T": (2, 1)}  # workers, threads
TARGETS = {  # examples/s from the issue: 3x PaddlePaddle 2.6.2's on this kind of machine
    ("async", "1S+1Wx2T"): 17000, ("geo", "1S+1Wx2T"): 18000,
    ("async", "1S+2Wx1T"): 27000, ("geo", "1S+2Wx1T"): 25000,
}


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where a run trains: `servers` S (0: ps=local, one process), `workers` W, `threads` T each.

    Written "1S+2Wx1T" (PS) or "1Px2T" (one local process with 2 threads).

    >>> Topology.parse("2S+2Wx1T"), Topology.parse("1Px2T").name
    (Topology(servers=2, workers=2, threads=1), '1Px2T')
    """

    servers: int
    workers: int
    threads: int

    @classmethod
    def parse(cls, text: str) -> "Topology":
        import re

        if m := re.fullmatch(r"(\d+)S\+(\d+)Wx(\d+)T", text):
            servers, workers, threads = map(int, m.groups())
            if servers and workers and threads:
                return cls(servers, workers, threads)
        if m := re.fullmatch(r"1Px(\d+)T", text):
            if int(m.group(1)):
                return cls(0, 1, int(m.group(1)))
        raise ValueError(f"topology {text!r}: write SS+WWxTT (e.g. 1S+2Wx1T, servers, workers, threads each >= 1) "
                         f"or 1PxTT for one local process with T threads")

    @property
    def local(self) -> bool:
        return self.servers == 0

    @property
    def name(self) -> str:
        return f"1Px{self.threads}T" if self.local else f"{self.servers}S+{self.workers}Wx{self.threads}T"


def data_overrides(rows: int, vocab: int, seed: int, root: str | os.PathLike | None = None,
                   test_rows: int | None = None) -> list[str]:
    """Dataset overrides of a generated Criteo-schema world: `vocab` keys a slot, `rows` training rows.

    The folder (under `root`, default datasets/generated, git-ignored) is shared by every run of
    the same world, so the data is generated once."""
    test_rows = test_rows or max(rows // 10, 10000)
    suffix = "" if test_rows == max(rows // 10, 10000) else f"-t{test_rows}"
    folder = Path(root or ROOT / "datasets" / "generated") / f"bench-s{seed}-v{vocab}-n{rows}{suffix}"  # shared with local_throughput
    return [f"dataset.dir={folder}", f"dataset.train=[{folder}/train.txt]", f"dataset.test=[{folder}/test.txt]",
            f"dataset.generate.train_rows={rows}", f"dataset.generate.test_rows={test_rows}",
            f"dataset.generate.vocab={vocab}", f"dataset.generate.seed={seed}"]


def run_one(mode: str, topology: str | Topology | None, rows: int, vocab: int, seed: int, k_steps: int,
            extra: list[str] = (), *, model: str = "ctr_dnn", batch: int = 512, epochs: int = 1,
            data_root: str | os.PathLike | None = None, test_rows: int | None = None,
            timeout_s: float = 3600) -> dict:
    """One configuration in fresh processes: `python -m recps.train` for PS modes (launcher,
    servers, workers), a `--local-child` process for ps=local. Returns its metrics and the peak
    RSS of every process (`processes`). `topology` None means 1Px2T for local."""
    topo = (Topology.parse(topology) if isinstance(topology, str) else topology) or Topology(0, 1, 2)
    if (mode == "local") != topo.local:
        raise ValueError(f"mode {mode!r} with topology {topo.name}: ps=local runs as 1PxTT, the PS modes as SS+WWxTT")
    overrides = [f"model={model}", f"trainer.batch_size={batch}", f"trainer.epochs={epochs}", "checkpoint.save=false",
                 "progress=false", "metrics=off", f"seed={seed}",
                 *data_overrides(rows, vocab, seed, data_root, test_rows)]
    if mode == "local":
        overrides += ["ps=local", f"ps.num_embeddings={vocab}", f"trainer.threads={topo.threads}", *extra]
        return _measure(mode, topo, model, batch, [sys.executable, "-m", "benchmarks.ps_throughput", "--local-child",
                                                   json.dumps(overrides)], None, k_steps, timeout_s)
    overrides += [f"ps={mode}", f"cluster.servers={topo.servers}", f"cluster.workers={topo.workers}",
                  f"trainer.threads={topo.threads}"]
    if mode == "geo":
        overrides.append(f"ps.k_steps={k_steps}")
    overrides += list(extra)
    return _measure(mode, topo, model, batch, [sys.executable, "-m", "recps.train", *overrides], "metrics.json",
                    k_steps, timeout_s)


def _measure(mode: str, topo: Topology, model: str, batch: int, command: list[str], metrics_file: str | None,
             k_steps: int, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="recps-ps-bench-") as tmp:
        load_before = os.getloadavg()[0]
        if metrics_file is not None:
            command = [*command, f"hydra.run.dir={tmp}"]
        stdout, processes, wall = run_monitored(command, ROOT, f"{mode} {topo.name}", timeout_s)
        if metrics_file is None:
            metrics = json.loads(stdout.strip().splitlines()[-1])
        else:
            metrics = json.loads((Path(tmp) / metrics_file).read_text())
    cpu_rate = metrics.get("examples_per_cpu_second")
    return {
        "model": model, "mode": mode, "topology": topo.name, "batch": batch,
        "examples_per_sec": round(metrics["examples_per_sec"]),
        "auc": round(metrics["auc"], 4), "logloss": round(metrics["logloss"], 4),
        "examples_per_cpu_second": round(cpu_rate) if cpu_rate else None,
        "train_examples": metrics["train_examples"], "train_seconds": round(metrics.get("train_seconds", 0.0), 2),
        "best_reachable_auc": metrics.get("best_reachable_auc"), "wall_s": round(wall, 1),
        "load_1min_before": round(load_before, 2), "load_1min_after": round(os.getloadavg()[0], 2),
        "k_steps": k_steps if mode == "geo" else None,
        "processes": processes, "peak_rss_mib": max((p["peak_rss_mib"] for p in processes), default=None),
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
    from recps.job.build import build_job
    from recps.job.run import evaluate

    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    job = build_job(cfg)  # with the observers of trainer.observers (benchmarks.quality.HeldOutAUC)
    cpu = time.process_time()
    try:
        stats = job.trainer.fit(job.data.train, int(cfg.trainer.batch_size), epochs=int(cfg.trainer.epochs),
                                progress=False)
    finally:
        for observer in job.trainer.observers:
            observer.close()
    cpu = time.process_time() - cpu
    metrics = evaluate(job)
    metrics.update(examples_per_sec=stats.examples_per_sec, train_examples=stats.examples,
                   train_seconds=stats.seconds, examples_per_cpu_second=stats.examples / cpu,
                   best_reachable_auc=job.data.best_auc)
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
