"""Evaluate a saved checkpoint: `python -m recps.evaluate RUN_DIR/checkpoint [key=value ...]`.

Rebuilds the job from the checkpoint's own `config.yaml` (dotlist overrides apply on top,
e.g. `dataset.test=[other.txt]`), loads the weights and prints the task's metrics as JSON.
The checkpoint may be local (ps=local: checkpoint.pt) or a parameter-server one, on any fsspec
URL (hdfs://...): its manifest and checksums are verified, a parameter server is started in
this process, loads every table (re-sharded onto it) and the model reads through it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

from omegaconf import OmegaConf

from recps import fs as rfs
from recps import quiet_libraries
from recps.config import register_resolvers
from recps.errors import RecpsError

__all__ = ["main", "evaluate_checkpoint"]


def evaluate_checkpoint(path: str, overrides: Sequence[str] = ()) -> dict[str, float]:
    # deferred: torch, torchrec (the job, the checkpoint, the PS) once the arguments parsed
    from recps.job.build import build_job
    from recps.job.checkpoint import find_checkpoint, load_checkpoint, parent_url, verify_ps_checkpoint
    from recps.job.run import evaluate
    from recps.ps.fleet import read_checkpoint

    register_resolvers()
    kind, found = find_checkpoint(path)
    folder = found if kind == "ps" else parent_url(found)
    cfg = OmegaConf.create(rfs.read_bytes(rfs.join(folder, "config.yaml")).decode())
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    cfg.trainer.resume = None
    if kind == "local":
        job = build_job(cfg)
        load_checkpoint(job, found)
        return evaluate(job)
    verify_ps_checkpoint(folder)
    job = build_job(cfg)
    params = [p for group in job.optimizer.param_groups for p in group["params"]]
    with read_checkpoint(folder, [job.collection], params):
        return evaluate(job)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recps.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint folder written by recps.train (or its checkpoint.pt)")
    parser.add_argument("overrides", nargs="*", help="config overrides as key=value")
    args = parser.parse_args(argv)
    quiet_libraries()  # before fbgemm_gpu's import logs its 14 "Successfully loaded" lines
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        metrics = evaluate_checkpoint(args.checkpoint, args.overrides)
    except RecpsError as exc:
        print(f"recps.evaluate: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(metrics, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
