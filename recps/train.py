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

Mistakes fail first: `recps.config.validate_config` checks the whole composed config here,
before any data is read or process started, and an error a user can cause (a RecpsError: a bad
value, data or a failed cluster; a key the config lacks; a config that is not found) prints as
one message, without a traceback (`HYDRA_FULL_ERROR=1` shows it).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import hydra
from omegaconf import DictConfig

from recps.config import composition_error_message, register_resolvers, validate_config

__all__ = ["main", "cli", "error_message"]

log = logging.getLogger("recps.train")

register_resolvers()

_FULL_ERROR = "HYDRA_FULL_ERROR"
# cli() sets HYDRA_FULL_ERROR=1 so that Hydra raises what fails to it instead of printing a trace;
# the job itself (and every process it starts) sees the user's own value.
_cli_env: dict[str, Any] = {"set": False, "user": None}  # "error": what a single run failed with


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Trains, evaluates on the held-out split, writes metrics.json; returns cfg.objective."""
    with _users_environment():
        try:
            return _run(cfg)
        except Exception as exc:
            if not (_cli_env["set"] and _single_run()):
                raise  # a sweep's job: Hydra records it and the sweep goes on (recps.sweep lists it)
            _cli_env["error"] = exc  # cli() reports it, without Hydra's "Error executing job" line
            return float("nan")


def _single_run() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.RUN


def _run(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    validate_config(cfg, overrides=list(hydra_cfg.overrides.task))  # before any data, process or heavy import
    out_dir = Path(hydra_cfg.runtime.output_dir)
    if cfg.get("stream") is not None and cfg.stream.get("enabled"):
        from recps.stream import run_stream

        metrics = run_stream(cfg, out_dir)
        if metrics is None:
            return float("nan")
    elif cfg.ps.name == "local":
        from recps.run import run_training

        metrics = run_training(cfg, out_dir)
    else:
        from recps.cluster import run_distributed

        metrics = run_distributed(cfg, out_dir)
        if metrics is None:  # a server or worker of the cluster: the launcher reports
            return float("nan")
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True, default=str) + "\n")
    task_metrics = cfg.task.get("metrics") or ()
    shown = ("auc", "logloss", "accuracy", *(str(m) for m in task_metrics), "examples_per_sec", "best_reachable_auc")
    summary = ", ".join(f"{k}={metrics[k]:.4f}" if isinstance(metrics[k], float) else f"{k}={metrics[k]}"
                        for k in dict.fromkeys(shown) if k in metrics)
    print(f"[recps] {summary}")  # entry point: the one line a user reads
    print(f"[recps] metrics: {out_dir / 'metrics.json'}")
    if cfg.objective not in metrics:
        log.warning("objective=%s is not a metric of this run (%s); sweepers get NaN: set objective=<one of them>",
                    cfg.objective, ", ".join(sorted(k for k, v in metrics.items() if isinstance(v, float))))
        return float("nan")
    return float(metrics[cfg.objective])


# ------------------------------------------------------------------------------------- the CLI


@contextmanager
def _users_environment() -> Iterator[None]:
    """The job, and every process it starts, sees HYDRA_FULL_ERROR as the user set it."""
    if not _cli_env["set"]:
        yield
        return
    if _cli_env["user"] is None:
        os.environ.pop(_FULL_ERROR, None)
    else:
        os.environ[_FULL_ERROR] = _cli_env["user"]
    try:
        yield
    finally:  # a failure after the job (a sweep's) still reaches cli()
        os.environ[_FULL_ERROR] = "1"


def error_message(exc: BaseException) -> str | None:
    """One line for an error a user can cause, None for any other (a bug: its traceback is printed)."""
    from hydra.errors import CompactHydraException, ConfigCompositionException

    from recps.errors import RecpsError

    if isinstance(exc, RecpsError):
        return f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ConfigCompositionException) and (message := composition_error_message(exc)):
        return message
    if isinstance(exc, CompactHydraException):  # a config that is not found, an override that does not parse
        cause = exc.__cause__
        return f"{exc}" + (f"\n{cause}" if cause is not None and type(cause).__module__.startswith("omegaconf") else "")
    return None


def cli() -> None:
    """`python -m recps.train`: main(), with an error a user can cause printed as one message and exit
    status 1; `HYDRA_FULL_ERROR=1` shows its traceback instead (Hydra's own switch)."""
    user = os.environ.get(_FULL_ERROR)
    if user == "1":
        main()
        return
    _cli_env.update(set=True, user=user)
    os.environ[_FULL_ERROR] = "1"  # Hydra raises what fails, composition included, to us
    try:
        main()
        failure = _cli_env.pop("error", None)
    except Exception as exc:  # noqa: BLE001 (entry point: everything is reported here)
        failure = exc
    if failure is None:
        return
    message = error_message(failure)
    if message is None:  # not a user's error: its traceback
        traceback.print_exception(failure)
    else:
        print(f"recps.train: {message}", file=sys.stderr)
    sys.stderr.flush()
    sys.exit(1)


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
    cli()
    _end_cluster_process()
