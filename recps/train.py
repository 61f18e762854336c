"""Training entry: `python -m recps.train [overrides]` (Hydra; configs in conf/).

    python -m recps.train                                  # DeepFM on generated data
    python -m recps.train model=ctr_dnn trainer.threads=2
    python -m recps.train -m model=deepfm,ctr_dnn trainer.max_steps=50   # sweep
    python -m recps.train --cfg job                        # print the config, start nothing

Writes `metrics.json` and `checkpoint/` into the Hydra run folder and returns the
`objective` metric so that sweepers can optimise it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

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
    metrics = run_training(cfg, out_dir)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    summary = ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in metrics.items() if k in ("auc", "logloss", "accuracy",
                                                             "examples_per_sec", "best_reachable_auc"))
    print(f"[recps] {summary}")  # entry point: the one line a user reads
    print(f"[recps] metrics: {out_dir / 'metrics.json'}")
    return float(metrics[cfg.objective])


if __name__ == "__main__":
    main()
