"""Training entry: `python -m recps.train [overrides]` (Hydra; configs in conf/).

    python -m recps.train                                  # DeepFM on generated data, async PS: 1 server + 1 worker x 2 threads
    python -m recps.train model=ctr_dnn ps=geo ps.k_steps=100 cluster.servers=2 cluster.workers=2
    python -m recps.train ps=local trainer.threads=2       # one process, no servers
    python -m recps.train -m model=deepfm,ctr_dnn trainer.max_steps=50   # sweep
    python -m recps.train --cfg job                        # print the config, start nothing

Writes `metrics.json` and `checkpoint/` into the Hydra run folder and returns the
`objective` metric so that sweepers can optimise it. With ps=sync|async|geo this process
launches the cluster (recps.cluster); a process started with a role in its environment acts
as that server or worker instead (worker 0 writes metrics.json and the PS checkpoint).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from recps.config import register_resolvers

__all__ = ["main"]

log = logging.getLogger("recps.train")

register_resolvers()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Trains, evaluates on the held-out split, writes metrics.json; returns cfg.objective."""
    from hydra.core.hydra_config import HydraConfig

    from recps.run import run_training  # heavy imports only once a job really runs

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    if cfg.get("stream") is not None and cfg.stream.get("enabled"):
        from recps.stream import run_stream

        metrics = run_stream(cfg, out_dir)
        if metrics is None:
            return float("nan")
    elif cfg.ps.name == "local":
        metrics = run_training(cfg, out_dir)
    else:
        from recps.cluster import run_distributed

        metrics = run_distributed(cfg, out_dir)
        if metrics is None:  # a server or worker of the cluster: the launcher reports
            return float("nan")
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    task_metrics = cfg.task.get("metrics") or ()
    shown = ("auc", "logloss", "accuracy", *(str(m) for m in task_metrics), "examples_per_sec", "best_reachable_auc")
    summary = ", ".join(f"{k}={metrics[k]:.4f}" if isinstance(metrics[k], float) else f"{k}={metrics[k]}"
                        for k in dict.fromkeys(shown) if k in metrics)
    print(f"[recps] {summary}")  # entry point: the one line a user reads
    print(f"[recps] metrics: {out_dir / 'metrics.json'}")
    if cfg.objective not in metrics:  # e.g. objective=auc (the default) for a next-item task
        log.warning("objective=%s is not a metric of this run (%s); sweepers get NaN: set objective=<one of them>",
                    cfg.objective, ", ".join(sorted(k for k, v in metrics.items() if isinstance(v, float))))
        return float("nan")
    return float(metrics[cfg.objective])


def _end_cluster_process() -> None:
    """A server or worker the launcher started has reported and closed everything by now:
    leave without the interpreter's teardown of torch/fbgemm/torchrec (about 2.4 CPU-s per
    process, measured), which a cluster run otherwise pays once per process."""
    from recps.ps.roles import ROLE_ENV

    if os.environ.get(ROLE_ENV):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
    _end_cluster_process()
