"""Cost of metrics during training: ``python -m benchmarks.metrics_bench [--batch 512] [--steps 2000] [--threads N]``.

Prints one JSON object: microseconds per ``update`` of a batch (wall mean and median, and
the calling thread's CPU time) for AUC alone, for the additive CTR collection and for it
plus GAUC/PNR, the CPU time's share of a step at a given training throughput (``--rate``
examples/s, default 25k), and the median cost of ``flatten`` + ``unflatten`` and ``compute``.
`benchmarks.metrics_overhead` measures the same cost end to end, in training throughput.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch

from recps.metrics.collection import MetricCollection

__all__ = ["measure", "main"]

ADDITIVE = ["auc", "logloss", "accuracy", "mae", "rmse", "actual_ctr", "predicted_ctr", "copc", "calibration"]


def _per_call_us(fn: Callable[[int], None], steps: int) -> tuple[float, float, float]:
    """(wall mean, wall median, CPU mean of this thread) microseconds per call.

    On a shared machine the wall mean includes time the process waited for a core; the
    thread CPU time is what the call itself costs (exact with --threads 1)."""
    for i in range(min(50, steps)):  # warm up allocator and dispatch caches
        fn(i)
    times = []
    cpu_start = time.thread_time()
    for i in range(steps):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    cpu = (time.thread_time() - cpu_start) / steps * 1e6
    times.sort()
    return sum(times) / steps * 1e6, times[steps // 2] * 1e6, cpu


def measure(batch: int = 512, steps: int = 2000, rate: float = 25_000.0, seed: int = 0) -> dict[str, float]:
    """The figures ``main`` prints (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    n_pre = 64  # pre-built batches, cycled: measure the metric, not the data generation
    probs = torch.rand(n_pre, batch, generator=gen)  # (n_pre, B) float32 as a model emits
    labels = (torch.rand(n_pre, batch, generator=gen) < 0.2).float()  # (n_pre, B)
    groups = torch.randint(0, 10_000, (n_pre, batch), generator=gen)  # (n_pre, B)
    out: dict[str, float] = {"batch": float(batch), "rate_examples_per_s": rate, "threads": float(torch.get_num_threads())}
    step_us = batch / rate * 1e6
    for label, names in (
        ("auc", ["auc"]),
        ("additive_ctr", ADDITIVE),
        ("additive_ctr_plus_gauc_pnr", ADDITIVE + ["gauc", "pnr"]),
    ):
        coll = MetricCollection(names)
        mean, median, cpu = _per_call_us(
            lambda i: coll.update(probs[i % n_pre], labels[i % n_pre], groups=groups[i % n_pre]), steps
        )
        out[f"{label}.update_us_mean"] = mean
        out[f"{label}.update_us_median"] = median
        out[f"{label}.update_us_cpu"] = cpu
        out[f"{label}.share_of_step_cpu"] = cpu / step_us
    coll = MetricCollection(ADDITIVE)
    coll.update(probs[0], labels[0])
    out["additive_ctr.flatten_unflatten_us"] = _per_call_us(lambda i: coll.unflatten(coll.flatten()), 50)[1]
    out["additive_ctr.compute_us"] = _per_call_us(lambda i: coll.compute(), 20)[1]
    grouped = MetricCollection(["gauc", "pnr"])
    for i in range(200):  # 102,400 examples with the default batch
        grouped.update(probs[i % n_pre], labels[i % n_pre], groups=groups[i % n_pre])
    start = time.perf_counter()
    grouped.compute()
    out["gauc_pnr.compute_s_per_100k"] = (time.perf_counter() - start) / (200 * batch) * 1e5
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=25_000.0, help="training examples/s to relate the cost to")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(json.dumps(measure(args.batch, args.steps, args.rate), indent=1))


if __name__ == "__main__":
    main()
