"""Dense compute against the machine's roofline: fp32 and bf16 (trainer.precision), CTR-DNN.

    python -m benchmarks.compute_bench [--rows 200000] [--vocab 1000000] [--rounds 2]
    python -m benchmarks.compute_bench --rows 2000 --vocab 100 --rounds 1 --probe-size 256 --out /tmp/c.json  # tiny
    python -m benchmarks.compute_bench --precisions fp32 --configs local-2T,geo-1S+2Wx1T  # Hogwild against GEO only

One run, alternating (issue 17): each round takes, in turn,
1. a matmul peak probe: (N, N) @ (N, N), N = 2048, fp32 and bf16, on every core this process may use
   (os.sched_getaffinity), in a fresh process; GFLOP/s = 2 N^3 / seconds, the best of `--probe-trials`;
2. CTR-DNN (conf/model/ctr_dnn.yaml, the real CLI in fresh processes: benchmarks.ps_throughput.run_one)
   in ps=local with 1 and with 2 Hogwild threads (1Px1T, 1Px2T) and in GEO and async with 1 server +
   2 workers x 1 thread (1S+2Wx1T), each in fp32 and bf16;
the precisions swap order every round (fp32 first in odd rounds), and so do the probe's dtypes.

The roofline of a run is the peak of its precision (the best probe of the whole run; the same cores):
fraction = examples/s x FLOP per example / peak. On a machine shared with other jobs the wall-clock
rate moves with their load; the CPU time the run's processes took does much less (training loops, and
the servers' whole life for the PS modes: benchmarks.ps_throughput), so each run is also given per
CPU-second against one core's roofline: examples per CPU-second x FLOP per example / (peak / cores). FLOP per example is counted from the model's Linear
layers as built (`flop_per_example`): forward 2·in·out, backward 4·in·out (the input's gradient: the
first layer's feeds the embedding rows; the weight's), i.e. 6·sum(in·out); the embedding lookups,
pooling, activations and optimizers are not counted (they are the distance to the roofline).

Targets (issue 17): fp32 local and GEO >= 75% of the fp32 roofline; bf16 >= 1.6x fp32 examples/s where
the CPU has bf16 units (avx512_bf16 / amx_bf16 in /proc/cpuinfo), at equal AUC (within 0.002);
async >= 85% of GEO examples/s; Hogwild that scales: local 1Px2T >= GEO 1S+2Wx1T examples/s (per CPU-second
the local figure counts the training loop's CPU, GEO's every worker's and the server's). Each is judged on the medians over rounds and written met or not, on
examples/s as the issue states them, then the same ratios per CPU-second ("per CPU-s").

Prints one JSON record per probe and run as it ends, then a Markdown table; writes every record,
the CPU (model name, flags that matter, cores), the medians and the targets to --out
(default benchmarks/results/compute_bench.json).

On a GPU (issue 17.1), one short prepared run: `--device cuda` (in .venv-gpu, `make setup-gpu`)

    .venv-gpu/bin/python -m benchmarks.compute_bench --device cuda [--rows 100000] [--rounds 1] [--precisions fp32]

fails at once, naming the fix, where this process cannot train on CUDA (recps.device.check_device);
else each round takes, the devices alternating (cuda first in odd rounds):
1. FBGEMM TBE forward + backward keys/s (ps=local's collection, its fused row-wise Adagrad update
   included): 26 features x one key per bag, `--tbe-batch` bags per feature, D=16, on cuda and on cpu;
2. CTR-DNN and DLRM in ps=local, 1 thread (`device=cuda` / `device=cpu`, the real CLI's job in a fresh
   process), each precision: examples/s and AUC on the same generated data;
3. GEO and async, 1 server + 1 worker x 1 thread: the worker on the GPU (`device=cuda`) against CPU
   server processes, and the same run with `device=cpu`.
The table gives per configuration the medians on both devices, the GPU's speedup and its AUC minus
the CPU's; --out defaults to benchmarks/results/compute_bench_cuda.json. No GPU figure of this project
has been measured yet (no GPU was available to the sessions that wrote it): docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.ps_throughput import ROOT, run_one

__all__ = ["CONFIGS", "PRECISIONS", "cpu_info", "flop_per_example", "ctr_dnn_flop_per_example", "peak_probe",
           "run", "summarize", "table", "main", "GPU_MODELS", "GPU_PS_CONFIGS", "tbe_keys_per_second", "cuda_run",
           "cuda_summarize", "cuda_table"]

CONFIGS = {  # name: (ps mode, topology)
    "local-1T": ("local", "1Px1T"),
    "local-2T": ("local", "1Px2T"),
    "geo-1S+2Wx1T": ("geo", "1S+2Wx1T"),
    "async-1S+2Wx1T": ("async", "1S+2Wx1T"),
}
PRECISIONS = ("fp32", "bf16")
ROOFLINE_TARGET = 0.75        # fp32 local and GEO, of the fp32 roofline
BF16_SPEEDUP_TARGET = 1.6     # bf16 / fp32 examples/s, where the CPU has bf16 units
AUC_TOLERANCE = 0.002         # bf16's AUC against fp32's
ASYNC_OF_GEO_TARGET = 0.85    # async / GEO examples/s
HOGWILD_OF_GEO_TARGET = 1.0   # local 1Px2T / GEO 1S+2Wx1T examples/s: T threads in one process, T processes
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_fp16", "avx512_fp16")


def cpu_info() -> dict[str, Any]:
    """The CPU this runs on: model name, the flags that decide fp32 / bf16 speed, cores usable here."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    import torch

    return {
        "model": model, "machine": platform.machine(), "cores": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(), "flags": {f: f in flags for f in _CPU_FLAGS},
        "bf16_units": "avx512_bf16" in flags or "amx_bf16" in flags,
        "torch": torch.__version__, "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    }


def flop_per_example(model) -> int:
    """FLOP of one example's forward and backward through `model`'s Linear layers: 6·sum(in·out).

    >>> from torch import nn
    >>> flop_per_example(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1)))  # 6 * (4*3 + 3*1)
    90
    """
    from torch import nn

    return sum(6 * m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))


def ctr_dnn_flop_per_example(model_config: str | os.PathLike = ROOT / "conf" / "model" / "ctr_dnn.yaml") -> int:
    """`flop_per_example` of CTR-DNN as conf/model/ctr_dnn.yaml builds it on the Criteo schema
    (26 sparse features of embedding_dim, 13 dense): 247-512-256-128-32-1 -> 1,766,592."""
    from hydra.utils import get_object
    from omegaconf import OmegaConf
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    from recps.data.schema import Schema

    cfg = OmegaConf.to_container(OmegaConf.load(model_config), resolve=True)
    schema, dim = Schema.criteo(), int(cfg.pop("embedding_dim"))
    collection = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=dim, num_embeddings=1, feature_names=[f])
        for f in schema.feature_names])
    model = get_object(cfg.pop("_target_"))(collection, dense_in_features=schema.num_dense,
                                            **{k: v for k, v in cfg.items() if k in ("hidden",)})
    return flop_per_example(model)


def _probe(size: int, dtype: str, reps: int, trials: int) -> dict[str, Any]:
    """In this process: the best GFLOP/s of `reps` (size, size) matmuls in `dtype`, over `trials`."""
    import torch

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=g).to(dt), torch.randn(size, size, generator=g).to(dt)
    for _ in range(2):
        a @ b
    rates = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        rates.append(2 * size ** 3 * reps / (time.perf_counter() - start) / 1e9)
    return {"kind": "peak", "dtype": dtype, "size": size, "threads": threads, "gflops": round(max(rates), 2),
            "trials_gflops": [round(r, 2) for r in rates]}


def peak_probe(size: int = 2048, dtype: str = "fp32", reps: int = 10, trials: int = 5) -> dict[str, Any]:
    """`_probe` in a fresh process (no thread pool or cache state from the parent)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.compute_bench", "--probe-child",
                           json.dumps([size, dtype, reps, trials])], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise RuntimeError(f"the {dtype} peak probe failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(rows: int = 200_000, vocab: int = 1_000_000, rounds: int = 2, configs: list[str] | None = None,
        seed: int = 0, k_steps: int = 100, probe_size: int = 2048, probe_reps: int = 10, probe_trials: int = 5,
        data_root: str | os.PathLike | None = None, echo=print,
        precisions: tuple[str, ...] = PRECISIONS) -> dict[str, Any]:
    """Every round: the probes, then each configuration in both precisions (see the module docstring).
    Returns {"cpu", "flop_per_example", "records", "summary", "targets"}."""
    names = list(configs or CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"configs {unknown} unknown; pick from {list(CONFIGS)}")
    if not precisions or any(p not in PRECISIONS for p in precisions):
        raise ValueError(f"precisions {list(precisions)}; pick from {list(PRECISIONS)}")
    flop = ctr_dnn_flop_per_example()
    records: list[dict[str, Any]] = []
    for rnd in range(1, rounds + 1):
        order = tuple(p for p in (PRECISIONS if rnd % 2 else PRECISIONS[::-1]) if p in precisions)
        for dtype in order:
            rec = {**peak_probe(probe_size, dtype, probe_reps, probe_trials), "round": rnd,
                   "load_1min": round(os.getloadavg()[0], 2)}
            records.append(rec)
            echo(json.dumps(rec))
        for name in names:
            mode, topology = CONFIGS[name]
            for precision in order:
                r = run_one(mode, topology, rows, vocab, seed, k_steps, [f"trainer.precision={precision}"],
                            data_root=data_root)
                rec = {"kind": "train", "config": name, "precision": precision, "round": rnd,
                       "flop_per_example": flop, "gflops": round(r["examples_per_sec"] * flop / 1e9, 2),
                       **{k: r[k] for k in ("mode", "topology", "examples_per_sec", "auc", "logloss",
                                            "examples_per_cpu_second", "train_examples", "train_seconds",
                                            "best_reachable_auc", "wall_s", "load_1min_before",
                                            "load_1min_after", "k_steps")}}
                records.append(rec)
                echo(json.dumps(rec))
    summary, targets = summarize(records, names)
    return {"benchmark": "compute_bench", "cpu": cpu_info(), "flop_per_example": flop, "rows": rows,
            "vocab_per_slot": vocab, "rounds": rounds, "records": records, "summary": summary, "targets": targets}


def summarize(records: list[dict[str, Any]], names: list[str] | None = None) -> tuple[dict, list[dict]]:
    """Peaks (best probe per dtype), per (config, precision) the median examples/s over rounds, its
    roofline fraction and AUCs; every train record gets its `roofline_fraction` (of the best peak).
    Then the targets, each {"target", "value", "met"} (met None: not applicable here)."""
    peaks = {d: max((r["gflops"] for r in records if r["kind"] == "peak" and r["dtype"] == d), default=None)
             for d in PRECISIONS}
    runs = [r for r in records if r["kind"] == "train"]
    cores = max((r.get("threads", 1) for r in records if r["kind"] == "peak"), default=1)
    for r in runs:
        peak = peaks.get(r["precision"])
        r["roofline_fraction"] = round(r["gflops"] / peak, 4) if peak else None
        cpu_rate = r.get("examples_per_cpu_second")
        r["cpu_roofline_fraction"] = (round(cpu_rate * r["flop_per_example"] / 1e9 / (peak / cores), 4)
                                      if peak and cpu_rate else None)
    summary: dict[str, Any] = {"peak_gflops": peaks, "cores": cores, "configs": {}}
    for name in names or sorted({r["config"] for r in runs}):
        for precision in PRECISIONS:
            mine = [r for r in runs if r["config"] == name and r["precision"] == precision]
            if not mine:
                continue
            rate = statistics.median(r["examples_per_sec"] for r in mine)
            cpu_rates = [r["examples_per_cpu_second"] for r in mine if r.get("examples_per_cpu_second")]
            cpu_rate = statistics.median(cpu_rates) if len(cpu_rates) == len(mine) else None
            peak, flop = peaks.get(precision), mine[0]["flop_per_example"]
            summary["configs"].setdefault(name, {})[precision] = {
                "examples_per_sec": round(rate), "runs_examples_per_sec": [r["examples_per_sec"] for r in mine],
                "roofline_fraction": round(rate * flop / 1e9 / peak, 4) if peak else None,
                "examples_per_cpu_second": round(cpu_rate) if cpu_rate else None, "runs_examples_per_cpu_second": cpu_rates,
                "cpu_roofline_fraction": round(cpu_rate * flop / 1e9 / (peak / cores), 4) if peak and cpu_rate else None,
                "auc": round(statistics.median(r["auc"] for r in mine), 4), "runs_auc": [r["auc"] for r in mine]}
    bf16_units = cpu_info()["bf16_units"]
    targets: list[dict[str, Any]] = []
    configs = summary["configs"]
    for basis, rate, fraction, suffix in (("wall", "examples_per_sec", "roofline_fraction", ""),
                                          ("cpu", "examples_per_cpu_second", "cpu_roofline_fraction", " (per CPU-s)")):
        for name, both in configs.items():
            fp32, bf16 = both.get("fp32"), both.get("bf16")
            if fp32 and name in ("local-1T", "local-2T", "geo-1S+2Wx1T") and fp32[fraction] is not None:
                targets.append({"target": f"{name} fp32 >= {ROOFLINE_TARGET:.0%} of the fp32 roofline{suffix}",
                                "value": fp32[fraction], "met": fp32[fraction] >= ROOFLINE_TARGET})
            if fp32 and bf16 and fp32[rate] and bf16[rate]:
                speedup = round(bf16[rate] / fp32[rate], 3)
                targets.append({"target": f"{name} bf16 >= {BF16_SPEEDUP_TARGET}x fp32 examples/s (CPU with bf16 units)"
                                          f"{suffix}", "value": speedup,
                                "met": speedup >= BF16_SPEEDUP_TARGET if bf16_units else None})
            if fp32 and bf16 and basis == "wall":
                dauc = round(bf16["auc"] - fp32["auc"], 4)
                targets.append({"target": f"{name} bf16 AUC within {AUC_TOLERANCE} of fp32", "value": dauc,
                                "met": abs(dauc) <= AUC_TOLERANCE})
        for precision in PRECISIONS:
            geo, asyn = configs.get("geo-1S+2Wx1T", {}).get(precision), configs.get("async-1S+2Wx1T", {}).get(precision)
            if geo and asyn and geo[rate] and asyn[rate]:
                ratio = round(asyn[rate] / geo[rate], 3)
                targets.append({"target": f"async {precision} >= {ASYNC_OF_GEO_TARGET:.0%} of GEO examples/s{suffix}",
                                "value": ratio, "met": ratio >= ASYNC_OF_GEO_TARGET})
            hogwild = configs.get("local-2T", {}).get(precision)
            if geo and hogwild and geo[rate] and hogwild[rate]:
                ratio = round(hogwild[rate] / geo[rate], 3)
                targets.append({"target": f"local-2T {precision} >= GEO 1S+2Wx1T examples/s (Hogwild){suffix}",
                                "value": ratio, "met": ratio >= HOGWILD_OF_GEO_TARGET})
    return summary, targets


def table(result: dict[str, Any]) -> str:
    """Markdown: the medians per configuration and precision, then the targets."""
    s = result["summary"]
    peaks = s["peak_gflops"]
    def pct(x):
        return f"{x:.1%}" if x is not None else "-"

    lines = [f"Peak (best probe, {result['cpu']['cores']} cores): fp32 {peaks['fp32']} GFLOP/s, bf16 {peaks['bf16']} "
             f"GFLOP/s; CTR-DNN {result['flop_per_example']:,} FLOP per example.", "",
             "| config | precision | examples/s (median) | runs | of the roofline | examples per CPU-s (median) | runs "
             "| of one core's roofline | AUC | runs' AUC |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, both in s["configs"].items():
        for precision, v in both.items():
            cpu = f"{v['examples_per_cpu_second']:,}" if v.get("examples_per_cpu_second") else "-"
            lines.append(f"| {name} | {precision} | {v['examples_per_sec']:,} | "
                         f"{' / '.join(f'{x:,}' for x in v['runs_examples_per_sec'])} | {pct(v['roofline_fraction'])} | "
                         f"{cpu} | {' / '.join(f'{x:,}' for x in v.get('runs_examples_per_cpu_second', []))} | "
                         f"{pct(v.get('cpu_roofline_fraction'))} | {v['auc']:.4f} | "
                         f"{' / '.join(f'{x:.4f}' for x in v['runs_auc'])} |")
    lines += ["", "| target | value | met |", "|---|---|---|"]
    for t in result["targets"]:
        met = {True: "yes", False: "**no**", None: "n/a (no bf16 units)"}[t["met"]]
        lines.append(f"| {t['target']} | {t['value']} | {met} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ --device cuda

GPU_MODELS = ("ctr_dnn", "dlrm")  # ps=local, 1 thread, on cuda and on cpu
GPU_PS_CONFIGS = {"geo-1S+1Wx1T": ("geo", "1S+1Wx1T"), "async-1S+1Wx1T": ("async", "1S+1Wx1T")}  # a GPU worker, CPU servers


def tbe_keys_per_second(device: str, batch: int = 4096, features: int = 26, dim: int = 16, rows: int = 100_000,
                        steps: int = 50, warmup: int = 5) -> dict[str, Any]:
    """FBGEMM TBE forward + backward of ps=local's collection (recps.embeddings.LocalEmbeddingBagCollection: one
    batched lookup, the fused row-wise Adagrad update in backward) on `device`, in this process: keys per
    second over `steps` steps of `features` x `batch` bags of one key each (uniform keys, 4 batches in turn)."""
    import torch
    from torchrec import KeyedJaggedTensor

    from recps.device import check_device
    from recps.embeddings import LocalEmbeddingBagCollection

    dev = check_device(device)
    names = [f"C{i}" for i in range(1, features + 1)]
    collection = LocalEmbeddingBagCollection(names, dim, rows, device=dev, init_std=0.01)
    g = torch.Generator().manual_seed(0)
    kjts = [KeyedJaggedTensor(keys=names, values=torch.randint(0, 2 ** 40, (features * batch,), generator=g),
                              lengths=torch.ones(features * batch, dtype=torch.int64)).to(dev) for _ in range(4)]
    upstream = torch.randn(batch, features * dim, generator=g).to(dev)  # d loss / d pooled (B, F*D)
    synchronize = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for i in range(warmup):
        collection(kjts[i % 4]).values().backward(upstream)
    synchronize()
    start = time.perf_counter()
    for i in range(steps):
        collection(kjts[i % 4]).values().backward(upstream)
    synchronize()
    seconds = time.perf_counter() - start
    return {"kind": "tbe", "device": dev.type, "batch": batch, "features": features, "dim": dim, "rows": rows,
            "steps": steps, "seconds": round(seconds, 6), "keys_per_sec": round(batch * features * steps / seconds),
            "threads": torch.get_num_threads()}


def _gpu_info() -> dict[str, Any]:
    import torch
    from importlib import metadata

    versions = {}
    for package in ("torch", "fbgemm-gpu", "fbgemm-gpu-cpu", "torchrec"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(), "cuda": torch.version.cuda,
            "packages": versions}


def cuda_run(rows: int = 100_000, vocab: int = 1_000_000, rounds: int = 1, seed: int = 0, k_steps: int = 100,
             batch: int = 512, tbe_batch: int = 4096, data_root: str | os.PathLike | None = None, echo=print,
             precisions: tuple[str, ...] = PRECISIONS, device: str = "cuda") -> dict[str, Any]:
    """`--device cuda` (see the module docstring). Raises ConfigError before anything runs where this
    process cannot train on CUDA. Returns {"gpu", "cpu", "records", "summary"}. `device`: the one compared
    with the CPU; "cpu" runs every step of it without a GPU (its records say cpu for both sides: a check
    of this script, never a GPU figure)."""
    from recps.device import check_device

    check_device(device)  # the reason and the fix, before any data or process
    if not precisions or any(p not in PRECISIONS for p in precisions):
        raise ValueError(f"precisions {list(precisions)}; pick from {list(PRECISIONS)}")
    records: list[dict[str, Any]] = []
    keys = ("mode", "topology", "examples_per_sec", "auc", "logloss", "examples_per_cpu_second", "train_examples",
            "train_seconds", "wall_s", "load_1min_before", "load_1min_after")

    def train(config: str, mode: str, topology: str, model: str, side: str, precision: str, rnd: int) -> None:
        on = device if side == "cuda" else "cpu"
        r = run_one(mode, topology, rows, vocab, seed, k_steps, [f"device={on}", f"trainer.precision={precision}"],
                    model=model, batch=batch, data_root=data_root)
        rec = {"kind": "train", "config": config, "model": model, "device": side, "ran_on": on, "precision": precision,
               "round": rnd, **{k: r.get(k) for k in keys}}
        records.append(rec)
        echo(json.dumps(rec))

    for rnd in range(1, rounds + 1):
        devices = ("cuda", "cpu") if rnd % 2 else ("cpu", "cuda")
        order = tuple(p for p in (PRECISIONS if rnd % 2 else PRECISIONS[::-1]) if p in precisions)
        for side in devices:
            rec = {**tbe_keys_per_second(device if side == "cuda" else "cpu", batch=tbe_batch), "round": rnd}
            rec["device"] = side
            records.append(rec)
            echo(json.dumps(rec))
        for model in GPU_MODELS:
            for precision in order:
                for side in devices:
                    train(f"{model} local-1T", "local", "1Px1T", model, side, precision, rnd)
        for name, (mode, topology) in GPU_PS_CONFIGS.items():
            for side in devices:
                train(f"ctr_dnn {name}", mode, topology, "ctr_dnn", side, "fp32", rnd)
    gpu = _gpu_info() if device != "cpu" else {"name": "none (device=cpu: a check of the script)", "count": 0,
                                               "cuda": None, "packages": {}}
    return {"benchmark": f"compute_bench --device {device}", "gpu": gpu, "cpu": cpu_info(), "rows": rows,
            "vocab_per_slot": vocab, "batch": batch, "rounds": rounds, "records": records,
            "summary": cuda_summarize(records)}


def cuda_summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per TBE shape and per (config, precision): the medians on cuda and cpu, the GPU's speedup, and
    (training) the median AUCs and cuda's minus cpu's."""
    out: dict[str, Any] = {"tbe": {}, "train": {}}
    tbe = [r for r in records if r["kind"] == "tbe"]
    for shape in sorted({(r["batch"], r["features"], r["dim"]) for r in tbe}):
        by = {d: [r["keys_per_sec"] for r in tbe if (r["batch"], r["features"], r["dim"]) == shape and r["device"] == d]
              for d in ("cuda", "cpu")}
        med = {d: round(statistics.median(v)) if v else None for d, v in by.items()}
        out["tbe"][f"B={shape[0]} F={shape[1]} D={shape[2]}"] = {
            "cuda_keys_per_sec": med["cuda"], "cpu_keys_per_sec": med["cpu"],
            "speedup": round(med["cuda"] / med["cpu"], 2) if med["cuda"] and med["cpu"] else None}
    runs = [r for r in records if r["kind"] == "train"]
    for config in dict.fromkeys(r["config"] for r in runs):
        for precision in PRECISIONS:
            mine = {d: [r for r in runs if r["config"] == config and r["precision"] == precision and r["device"] == d]
                    for d in ("cuda", "cpu")}
            if not any(mine.values()):
                continue
            rate = {d: round(statistics.median(r["examples_per_sec"] for r in v)) if v else None for d, v in mine.items()}
            auc = {d: round(statistics.median(r["auc"] for r in v), 4) if v else None for d, v in mine.items()}
            out["train"].setdefault(config, {})[precision] = {
                "cuda_examples_per_sec": rate["cuda"], "cpu_examples_per_sec": rate["cpu"],
                "speedup": round(rate["cuda"] / rate["cpu"], 2) if rate["cuda"] and rate["cpu"] else None,
                "cuda_auc": auc["cuda"], "cpu_auc": auc["cpu"],
                "auc_cuda_minus_cpu": round(auc["cuda"] - auc["cpu"], 4) if auc["cuda"] is not None and auc["cpu"] is not None else None}
    return out


def cuda_table(result: dict[str, Any]) -> str:
    """Markdown of `cuda_run`'s summary."""
    s, gpu = result["summary"], result["gpu"]
    lines = [f"GPU: {gpu['name']} (CUDA {gpu['cuda']}; {gpu['packages']}); CPU: {result['cpu']['model']}, "
             f"{result['cpu']['cores']} cores. {result['rows']:,} rows, batch {result['batch']}.", "",
             "| TBE fwd+bwd | cuda keys/s | cpu keys/s | speedup |", "|---|---|---|---|"]
    for shape, v in s["tbe"].items():
        lines.append(f"| {shape} | {v['cuda_keys_per_sec']:,} | {v['cpu_keys_per_sec']:,} | {v['speedup']}x |")
    lines += ["", "| config | precision | cuda examples/s | cpu examples/s | speedup | cuda AUC | cpu AUC | AUC cuda - cpu |",
              "|---|---|---|---|---|---|---|---|"]
    for config, both in s["train"].items():
        for precision, v in both.items():
            lines.append(f"| {config} | {precision} | {v['cuda_examples_per_sec']} | {v['cpu_examples_per_sec']} | "
                         f"{v['speedup']} | {v['cuda_auc']} | {v['cpu_auc']} | {v['auc_cuda_minus_cpu']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the GPU run (module docstring); cpu: the roofline run")
    parser.add_argument("--rows", type=int, default=None, help="default 200000 (cpu), 100000 (cuda)")
    parser.add_argument("--vocab", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=None, help="default 2 (cpu), 1 (cuda)")
    parser.add_argument("--batch", type=int, default=512, help="--device cuda: trainer.batch_size")
    parser.add_argument("--tbe-batch", type=int, default=4096, help="--device cuda: bags per feature of the TBE probe")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="fp32,bf16 (default) or one of them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k-steps", type=int, default=100)
    parser.add_argument("--probe-size", type=int, default=2048)
    parser.add_argument("--probe-reps", type=int, default=10)
    parser.add_argument("--probe-trials", type=int, default=5)
    parser.add_argument("--data-dir", default=None, help="where the generated data is cached (default datasets/generated)")
    parser.add_argument("--out", default=None, help="default benchmarks/results/compute_bench.json "
                        "(--device cuda: compute_bench_cuda.json)")
    parser.add_argument("--summarize", metavar="JSON", help="print the table of a saved run's records (no run)")
    parser.add_argument("--probe-child", help=argparse.SUPPRESS)  # JSON [size, dtype, reps, trials]: one probe, here
    args = parser.parse_args(argv)
    if args.probe_child:
        print(json.dumps(_probe(*json.loads(args.probe_child))))
        return 0
    if args.summarize:
        result = json.loads(Path(args.summarize).read_text())
        result["summary"], result["targets"] = summarize(result["records"])
        print(table(result))
        return 0
    echo = lambda line: print(line, flush=True)  # noqa: E731
    if args.device == "cuda":
        from recps.device import check_device
        from recps.errors import ConfigError

        try:
            check_device("cuda")
        except ConfigError as exc:  # one line, before anything ran
            print(f"compute_bench --device cuda: {exc}", file=sys.stderr)
            return 2
        result = cuda_run(args.rows or 100_000, args.vocab, args.rounds or 1, args.seed, args.k_steps, args.batch,
                          args.tbe_batch, args.data_dir, echo=echo, precisions=tuple(args.precisions.split(",")))
        out = Path(args.out or ROOT / "benchmarks" / "results" / "compute_bench_cuda.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(cuda_table(result))
        return 0
    result = run(args.rows or 200_000, args.vocab, args.rounds or 2, args.configs.split(","), args.seed, args.k_steps,
                 args.probe_size, args.probe_reps, args.probe_trials, args.data_dir,
                 echo=echo, precisions=tuple(args.precisions.split(",")))
    out = Path(args.out or ROOT / "benchmarks" / "results" / "compute_bench.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"cpu": result["cpu"]}))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
