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

Mistakes fail first: `recps.config.validate_config` checks the whole composed config here (and
`_check_resume` that trainer.resume holds a checkpoint), before any data is read or process started,
and an error a user can cause (a RecpsError: a bad value, data or a failed cluster; a key the config
lacks; a config that is not found) prints as one message, without a traceback (`HYDRA_FULL_ERROR=1`
shows it). Library log lines nobody can act on are silenced (`recps.quiet_libraries`). The run ends
with what its numbers are: the task's metrics on the held-out test split, the baseline's on the same
split when the task computes one (retrieval: most popular items), the training throughput, and where
metrics.json is.
"""

from __future__ import annotations

import time as _time

_IMPORTING = _time.perf_counter()  # start-up phases (the launcher logs them: _log_startup)

import json
import logging
import math
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, ConfigCompositionException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import recps.cluster.launch as _launch
from recps import quiet_libraries
from recps.cluster.launch import process_age
from recps.config import check_group_overrides, composition_error_message, override_source, ps_mode, register_resolvers, validate_config
from recps.errors import ConfigError, RecpsError
from recps.job.settings import node_settings
from recps.pipeline import run_pipeline
from recps.ps.roles import ROLE_ENV

__all__ = ["main", "cli", "error_message", "summary_lines", "held_out_metric_names"]

log = logging.getLogger("recps.train")

register_resolvers()
_IMPORTED = _time.perf_counter()
_launch.note_fork_safe_threads()  # numpy's BLAS pool: the launcher may fork its cluster from this image

_FULL_ERROR = "HYDRA_FULL_ERROR"
# cli() sets HYDRA_FULL_ERROR=1 so that Hydra raises what fails to it instead of printing a trace;
# the job itself (and every process it starts) sees the user's own value.
_cli_env: dict[str, Any] = {"set": False, "user": None}  # "error": what a single run failed with


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Trains, evaluates on the held-out split, writes metrics.json; returns cfg.objective."""
    _startup.setdefault("composed", _time.perf_counter())
    with _users_environment():
        try:
            return _run(cfg)
        except Exception as exc:
            if not (_cli_env["set"] and _single_run()):
                raise  # a sweep's job: Hydra records it and the sweep goes on (recps.sweep lists it)
            _cli_env["error"] = exc  # cli() reports it, without Hydra's "Error executing job" line
            return float("nan")


def _single_run() -> bool:
    return HydraConfig.get().mode == RunMode.RUN


def _run(cfg: DictConfig) -> float:
    quiet_libraries()
    hydra_cfg = HydraConfig.get()
    overrides = list(hydra_cfg.overrides.task)
    with _one_torch_thread():
        validate_config(cfg, overrides=overrides)  # before any data, process or heavy import
    pipeline = cfg.get("pipeline") is not None and str(cfg.pipeline.get("name", "none")) != "none"
    stream = cfg.get("stream") is not None and bool(cfg.stream.get("enabled", False))
    if not (pipeline or stream):  # (a stream resumes from its own records)
        _check_resume(cfg, overrides)  # before ps=local reads its data, before a cluster starts
    _log_startup()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    if pipeline:
        return run_pipeline(cfg, out_dir)  # checks its stages first; prints and writes metrics.json itself
    if stream:
        metrics = _run_stream(cfg, out_dir)
        if metrics is None:
            return float("nan")
    elif cfg.ps.name == "local":
        from recps.job.build import run_training  # deferred: torch, torchrec, the readers; `--cfg job` needs none

        metrics = run_training(cfg, out_dir)
    else:
        from recps.cluster.driver import run_distributed  # deferred: torch, torchrec, zmq; `--cfg job` needs none

        metrics = run_distributed(cfg, out_dir)
        if metrics is None:  # a server or worker of the cluster: the launcher reports
            return float("nan")
    from recps import fs as rfs  # deferred: fsspec; `--cfg job` needs none

    rfs.write_atomic(str(out_dir / "metrics.json"), json.dumps(metrics, indent=2, sort_keys=True, default=str) + "\n",
                     overwrite=True)
    for line in summary_lines(cfg, metrics):
        print(f"[recps] {line}")  # entry point: the lines a user reads
    print(f"[recps] metrics: {out_dir / 'metrics.json'}")
    _tensorboard_test_metrics(cfg, metrics, out_dir)
    if cfg.objective not in metrics:
        log.warning("objective=%s is not a metric of this run (%s); sweepers get NaN: set objective=<one of them>",
                    cfg.objective, ", ".join(sorted(k for k, v in metrics.items() if isinstance(v, float))))
        return float("nan")
    return float(metrics[cfg.objective])


def _run_stream(cfg: DictConfig, out_dir: Path) -> dict[str, Any] | None:
    """stream.enabled: launch the stream job's cluster, or be one of its processes (recps.stream.pass_loop,
    given the typed values `_stream_worker` builds)."""
    if cfg.ps.name not in ("sync", "async", "geo"):
        raise ConfigError(f"stream=hourly trains on the parameter server; ps={cfg.ps.name!r}: use ps=sync, async or geo")
    from recps.cluster.driver import run_distributed  # deferred: torch, torchrec, zmq (the PS); `--cfg job` needs none
    from recps.cluster.driver import environment_role  # deferred: as run_distributed
    from recps.stream import StreamConfig, check_stream_out, nothing_left, with_start_day  # deferred: torch, the PS

    # A bad stream key fails here, in the launcher, before any process starts.
    values = with_start_day(OmegaConf.to_container(cfg.stream, resolve=True))
    cfg.stream.start_day = values["start_day"]  # the cluster's processes read it from the config
    config = StreamConfig.from_config(values)
    if environment_role(cfg) is None and (left := _launch.run_in_fork(lambda: nothing_left(config),
                                                                      "reading the stream's records")):
        print(f"[recps] {left}")  # decided from the records: no cluster starts
        return None

    def before_launch(c: DictConfig, mode, d: Path) -> None:
        if c.ps.table.get("accessor") is None:
            raise ConfigError("stream=hourly needs the tables' CTR accessor (shows, clicks, scores: what deltas, bases "
                              "and shrink select by); ps.table.accessor is null: drop that override (stream=hourly "
                              "sets it) or give ps.table.accessor={...}")
        check_stream_out(config)

    return run_distributed(cfg, out_dir, work=_stream_worker, before_launch=before_launch)


def _stream_worker(cfg: DictConfig, role, out_dir: Path, data=None, observers=()) -> dict[str, Any] | None:
    """A stream job's worker (recps.cluster.driver.run_role's `work`): recps.stream.stream_work with the
    typed values of the composed config; `data`: an in-process cluster's rows (None: the schema's, no rows)."""
    from recps.job.build import build_job, schema_data  # deferred: torch, torchrec, the readers; a worker's only
    from recps.stream import StreamConfig, StreamWork, stream_work  # deferred: torch, the PS; a stream's only

    ds = cfg.dataset
    work = StreamWork(StreamConfig.from_config(OmegaConf.to_container(cfg.stream, resolve=True)), ps_mode(cfg),
                      node_settings(cfg), build_job=lambda: build_job(cfg, data or schema_data(cfg)),
                      shuffle=bool(ds.get("shuffle", True)), error_budget=float(ds.get("error_budget", 0.01)))
    return stream_work(work, role, Path(out_dir), observers=observers)


def _check_resume(cfg: DictConfig, overrides: list[str]) -> None:
    """Before any data is read or process started: trainer.resume, when set, holds a checkpoint
    (recps.job.checkpoint.find_checkpoint's ConfigError, with trainer.resume and its source in front)."""
    resume = cfg.trainer.get("resume")
    if not resume:
        return
    from recps.job.checkpoint import find_checkpoint  # deferred: torch, the PS tables; only with trainer.resume

    try:
        find_checkpoint(str(resume))
    except ConfigError as exc:
        source = override_source("trainer.resume", overrides)
        raise ConfigError(f"trainer.resume={str(resume)!r}{f' (from {source})' if source else ''}: {exc}") from None


_startup: dict[str, float] = {}


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Torch ops of the block (the checks build metric states) run on this thread: no OpenMP team starts,
    so a launcher may still fork its cluster's processes (recps.cluster.launch.can_fork; a child forked after a
    team started would hang in its first parallel op). torch's thread count is restored after it."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _log_startup() -> None:
    """One line, the first run of this process only: how long python, the imports, Hydra's composition
    and the config's checks took (benchmarks/startup_bench.py reads it)."""
    if "checked" in _startup:
        return
    now = _startup["checked"] = _time.perf_counter()
    age = process_age()
    before = f"python {age - (now - _IMPORTING):.2f} s, " if age is not None else ""
    log.info("start-up %s: %simports %.2f s, Hydra's composition %.2f s, config checks %.2f s",
             f"{age:.2f} s" if age is not None else "", before, _IMPORTED - _IMPORTING,
             _startup["composed"] - _IMPORTED, now - _startup["composed"])


def held_out_metric_names(cfg: DictConfig, metrics: dict[str, Any]) -> list[str]:
    """The evaluation's metrics in `metrics`, in the task's order: the task's metrics (auc, logloss and
    accuracy first), their per-label values (`auc/ctr`) and the baseline's (`most_popular/recall@10`)."""
    names = list(dict.fromkeys(("auc", "logloss", "accuracy", *(str(m) for m in cfg.task.get("metrics") or ()))))

    def rank(key: str) -> tuple[int, int, str]:
        head, _, tail = key.partition("/")
        if head in names:
            return (0, names.index(head), tail)
        return (1, names.index(key.rpartition("/")[2]), head)

    keys = [k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and (k.partition("/")[0] in names or k.rpartition("/")[2] in names)]
    return sorted(keys, key=rank)


# What the baselines' metric prefixes stand for (recps.tasks.retrieval, recps.tasks.next_item).
_BASELINES = {"most_popular": "most popular items",
              "session_items": "the session's own items, most recent first, then popular"}


def summary_lines(cfg: DictConfig, metrics: dict[str, Any]) -> list[str]:
    """What the run's numbers are, in words: the held-out split's metrics (a stream's: its last pass,
    evaluated before training on it), the baseline's on the same split, the training throughput.

    >>> from omegaconf import OmegaConf
    >>> cfg = OmegaConf.create({"task": {"metrics": ["recall@10", "auc"]}})
    >>> for line in summary_lines(cfg, {"recall@10": 0.031, "auc": 0.8, "most_popular/recall@10": 0.043,
    ...                                 "most_popular/auc": 0.83, "queries": 610.0, "train_steps": 20,
    ...                                 "train_examples": 10240, "examples_per_sec": 87344.7}):
    ...     print(line)
    held-out test split (610 queries): auc=0.8000 recall@10=0.0310
    baseline on the same split, most popular items: auc=0.8300 recall@10=0.0430
    trained 20 steps, 10240 examples, 87345 examples/s

    A table with a disk tier (metrics.json's "disk_tier") adds a line: recps.ps.table.tier.tier_line.
    """
    names = held_out_metric_names(cfg, metrics)
    task_names = {"auc", "logloss", "accuracy", *(str(m) for m in cfg.task.get("metrics") or ())}
    stream = metrics.get("stream")
    if isinstance(stream, dict):
        passes = [p for p in stream.get("passes") or () if isinstance(p, dict) and "pass" in p]
        last = passes[-1] if passes else {}
        name = f"{last['day']}/{last['pass']}" if last.get("day") else str(last.get("pass", ""))
        where = f"last pass ({name}), evaluated before training on it" if passes else "last pass"
    else:
        where = f"held-out {'validation' if metrics.get('evaluated_on') == 'validation' else 'test'} split"
        for count in ("queries", "predictions"):  # retrieval's queries; next-item's predicted clicks
            if isinstance(metrics.get(count), (int, float)):
                where += f" ({int(metrics[count])} {count})"
    own = [k for k in names if "/" not in k]
    lines = [f"{where}: " + (" ".join(f"{k}={metrics[k]:.4f}" for k in own) or "no metrics")]
    if isinstance(metrics.get("best_reachable_auc"), float):
        lines[0] += f" (the data's best reachable auc={metrics['best_reachable_auc']:.4f})"
    baselines: dict[str, list[str]] = {}  # `most_popular/recall@10`: a metric of the task, another ranking's
    for k in names:
        head, _, tail = k.partition("/")
        if tail and head not in task_names:
            baselines.setdefault(head, []).append(k)
    for name, keys in baselines.items():
        what = _BASELINES.get(name, name)
        lines.append(f"baseline on the same split, {what}: "
                     + " ".join(f"{k.partition('/')[2]}={metrics[k]:.4f}" for k in keys))
    if "train_steps" in metrics and "examples_per_sec" in metrics:
        workers = metrics.get("workers")
        steps = f"{metrics['train_steps']} steps" + (" on worker 0" if isinstance(workers, int) and workers > 1 else "")
        examples = f"{metrics.get('train_examples', '?')} examples" + (
            f" over {workers} workers" if isinstance(workers, int) and workers > 1 else "")
        step, count = metrics.get("step"), metrics["train_steps"]
        if isinstance(step, int) and isinstance(count, int) and step > count > 0:  # a resumed job's steps
            steps += f" (steps {step - count + 1}-{step})"
        lines.append(f"trained {steps}, {examples}, {metrics['examples_per_sec']:.0f} examples/s")
    tiers = metrics.get("disk_tier")
    if isinstance(tiers, dict):  # tables with a disk tier (ps.table.memory_budget)
        from recps.ps.fleet import tier_line  # deferred: the PS imports torch and zmq

        lines += [tier_line(name, t) for name, t in sorted(tiers.items())]
    return lines


def _tensorboard_test_metrics(cfg: DictConfig, metrics: dict[str, Any], out_dir: Path) -> None:
    """With metrics.tensorboard=true, the held-out metrics as `test/<name>` scalars in <run dir>/tensorboard
    (beside the training reports' `train/` and `pass/`), at the last reported training step."""
    node = cfg.get("metrics")
    if node is None or not bool(node.get("tensorboard", False)) or isinstance(metrics.get("stream"), dict):
        return  # (a stream's metrics are per pass: recps.stream writes them)
    from torch.utils.tensorboard import SummaryWriter  # deferred: tensorboard is optional, asked for

    reports = [r for r in metrics.get("train_metrics") or () if isinstance(r, dict) and "step" in r]
    step = int(reports[-1]["step"]) if reports else int(metrics.get("step", metrics.get("train_steps", 0)))
    names = held_out_metric_names(cfg, metrics)
    if isinstance(metrics.get("best_reachable_auc"), float):
        names.append("best_reachable_auc")
    writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
    try:
        for name in names:
            value = float(metrics[name])
            if math.isfinite(value):
                writer.add_scalar(f"test/{name}", value, step)
    finally:
        writer.close()


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
        check_group_overrides(sys.argv[1:])  # before Hydra, which fails on them with a traceback
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
    if os.environ.get(ROLE_ENV):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    cli()
    _end_cluster_process()
