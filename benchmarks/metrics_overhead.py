"""Training throughput with the periodic metrics on vs off (debug dump off), ps=local.

    python -m benchmarks.metrics_overhead [--rows 60000] [--pairs 4] [--threads 2] [--every 100]
                                          [--model deepfm] [--out results.json]

One job (conf defaults: DeepFM, FBGEMM tables, Adam, batch 512) trains pass after pass
on generated data; passes alternate metrics off / on in ABBA order (off on on off off on
...) so that drift of a shared machine hits both sides alike. Each pass is timed (wall) and
its process CPU time taken. Overhead = 1 - median over pairs of (on / off) examples/s; the
CPU-time ratio is printed too, as it is less sensitive to other processes than the wall
clock. On a shared machine both swing by more than the effect, so the cost is also measured
directly: every call into the reporter (per-step hooks, reports) is timed in its thread
(wall and thread CPU time) and set against the pass's wall time and process CPU time
("direct" figures); per hook too, with the reporter's no-op `after_backward` as the baseline
of what any Python call from a training thread waits for the GIL or a core. The machine's load average is printed before and after. Metrics: conf/metrics/default
(auc, logloss, accuracy, actual/predicted CTR, COPC; a report every `--every` steps).
"""

from __future__ import annotations

from recps import quiet_libraries
import argparse
import json
import logging
import os
import platform
import statistics
import threading
import time


class Timed:
    """Forwards the TrainObserver hooks to `inner`, summing the wall and thread CPU time of each
    call, in all and per hook (`hooks`: name -> [calls, wall s, CPU s])."""

    def __init__(self, inner) -> None:
        self.inner, self.wall, self.cpu, self._lock = inner, 0.0, 0.0, threading.Lock()
        self.hooks: dict[str, list[float]] = {}

    def __getattr__(self, name):
        fn = getattr(self.inner, name)
        if not name.startswith("on_") and name != "after_backward":
            return fn

        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
                with self._lock:
                    self.wall += wall
                    self.cpu += cpu
                    h = self.hooks.setdefault(name, [0, 0.0, 0.0])
                    h[0], h[1], h[2] = h[0] + 1, h[1] + wall, h[2] + cpu

        return timed


def run(rows: int, pairs: int, threads: int, every: int, model: str, batch: int) -> dict:
    import torch
    from hydra import compose, initialize_config_dir

    from recps.config import PROJECT_ROOT, register_resolvers
    from recps.metrics.reporter import build_reporter
    from recps.job.build import build_job

    register_resolvers()
    overrides = [
        "ps=local", f"model={model}", f"dataset.generate.train_rows={rows}", "dataset.generate.test_rows=10000",
        f"trainer.threads={threads}", f"trainer.batch_size={batch}", f"metrics.every_steps={every}",
        "progress=false", "checkpoint.save=false",
    ]
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    job = build_job(cfg)
    job.trainer.fit(job.data.train, batch, max_steps=30, progress=False)  # warm-up: allocator, TBE, caches
    order = [("off", "on") if i % 2 == 0 else ("on", "off") for i in range(pairs)]
    passes: list[dict] = []
    reports = 0
    hooks: dict[str, list[float]] = {}
    load_before = os.getloadavg()
    epoch = 1
    for pair in order:
        for side in pair:
            reporter = timed = None
            if side == "on":
                reporter = build_reporter(cfg.metrics, task=job.task, threads=threads, out_dir=None)
                timed = Timed(reporter)
            job.trainer.observers = [timed] if timed is not None else []
            cpu = time.process_time()
            stats = job.trainer.fit(job.data.train, batch, epochs=1, first_epoch=epoch, progress=False)
            cpu = time.process_time() - cpu
            epoch += 1
            if reporter is not None:
                reports += len(reporter.reports)
                for name, (n, w, c) in timed.hooks.items():
                    h = hooks.setdefault(name, [0, 0.0, 0.0])
                    h[0], h[1], h[2] = h[0] + n, h[1] + w, h[2] + c
            passes.append({"side": side, "examples_per_sec": stats.examples / stats.seconds, "seconds": stats.seconds,
                           "cpu_seconds": cpu, "examples": stats.examples, "steps": stats.steps,
                           "observer_wall_seconds": timed.wall if timed else 0.0,
                           "observer_cpu_seconds": timed.cpu if timed else 0.0})
    job.trainer.observers = []
    load_after = os.getloadavg()
    ratios, cpu_ratios = [], []
    for i in range(pairs):
        a, b = passes[2 * i], passes[2 * i + 1]
        on, off = (a, b) if a["side"] == "on" else (b, a)
        ratios.append(on["examples_per_sec"] / off["examples_per_sec"])
        cpu_ratios.append(on["cpu_seconds"] / off["cpu_seconds"])
    side = lambda s: [p["examples_per_sec"] for p in passes if p["side"] == s]  # noqa: E731
    on = [p for p in passes if p["side"] == "on"]
    # Per-thread wall time in hooks over (threads x pass wall time): the share of the
    # training threads' time spent in the reporter; CPU: over the process's CPU time.
    direct_wall = [p["observer_wall_seconds"] / (threads * p["seconds"]) for p in on]
    direct_cpu = [p["observer_cpu_seconds"] / p["cpu_seconds"] for p in on]
    return {
        "benchmark": "metrics_overhead", "model": model, "threads": threads, "batch": batch, "train_rows": rows,
        "pairs": pairs, "every_steps": every, "metrics": list(cfg.metrics.metrics), "reports_made": reports,
        "off_examples_per_sec_median": round(statistics.median(side("off")), 1),
        "on_examples_per_sec_median": round(statistics.median(side("on")), 1),
        "throughput_ratios_on_off": [round(r, 4) for r in ratios],
        "overhead_pct_median": round(100 * (1 - statistics.median(ratios)), 2),
        "cpu_ratios_on_off": [round(r, 4) for r in cpu_ratios],
        "cpu_overhead_pct_median": round(100 * (statistics.median(cpu_ratios) - 1), 2),
        "direct_wall_share_pct_median": round(100 * statistics.median(direct_wall), 2),
        "direct_cpu_share_pct_median": round(100 * statistics.median(direct_cpu), 2),
        "direct_cpu_ms_per_step": round(1e3 * sum(p["observer_cpu_seconds"] for p in on) / sum(p["steps"] for p in on), 3),
        # after_backward is a no-op in the reporter: its wall time per call is what merely
        # calling Python from a training thread costs here (waiting for the GIL or a core).
        "hooks_ms_per_call": {name: {"calls": n, "wall": round(1e3 * w / n, 3), "cpu": round(1e3 * c / n, 3)}
                              for name, (n, w, c) in sorted(hooks.items())},
        "passes": [{k: round(v, 3) if isinstance(v, float) else v for k, v in p.items()} for p in passes],
        "load_average_before": [round(x, 2) for x in load_before], "load_average_after": [round(x, 2) for x in load_after],
        "cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=60_000, help="generated training rows (one pass)")
    parser.add_argument("--pairs", type=int, default=4, help="(off, on) pass pairs, in ABBA order")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--every", type=int, default=100, help="metrics.every_steps")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--model", default="deepfm")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    quiet_libraries()  # the libraries' import-time lines a user cannot act on
    logging.basicConfig(level=logging.WARNING)
    start = time.perf_counter()
    result = run(args.rows, args.pairs, args.threads, args.every, args.model, args.batch)
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    text = json.dumps(result)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
