"""The table a `-m` sweep ends with: overrides -> objective and the main metrics, best first.

    python -m recps.train -m model=deepfm,ctr_dnn optimizer.lr=0.001,0.01
    ...
    objective: auc (maximised); 4 jobs: 4 completed, 0 failed
    every job: (none)

    | rank | job | status    | model   | optimizer.lr | objective | auc    | logloss | ... | error |
    |    1 |   2 | COMPLETED | deepfm  | 0.01         | 0.7741    | 0.7741 | 0.4512  | ... |       |
    ...

Hydra's callback (registered in conf/config.yaml's `hydra.callbacks`) does it in two halves:

- `on_job_end`, in the process that ran the job (any launcher): writes `sweep_job.json` into
  the job's folder: its number, status (COMPLETED / FAILED), overrides, objective name, the
  metrics it reports and, for a failed job, the error. A failed job has no metrics.json, so
  without this record it would vanish from the table.
- `on_multirun_end`, in the process that started the sweep: reads every `sweep_job.json`
  under the sweep folder written since the sweep started, and each job's `metrics.json`;
  prints the table and writes it as `summary.csv` and `summary.md` in the sweep folder.

Hydra's basic sweeper re-raises the first failed job's error after every job has run and
before `on_multirun_end` (the sweep exits 1, as it should), so the summary is also made at
interpreter exit when `on_multirun_end` was never reached. `python -m recps.sweep DIR`
makes it again from a sweep folder (a killed sweep, another machine).

Order: jobs whose objective is a number, best first: highest, or lowest for an error or loss
(`minimised`: logloss, mse, rmse, mae, loss, also as the last part of a name such as
ctr/logloss); then completed jobs without it (NaN, or not a metric of the run); then
failed jobs; ties by job number. Columns: rank, job, status, one column per override that
differs between jobs (the shared ones are listed once above the table), objective, the main
metrics (those `recps.train` prints: auc, logloss, accuracy, the task's metrics,
examples_per_sec, best_reachable_auc; whichever the jobs report), error; the CSV also has
every job's full override list and folder.
"""

from __future__ import annotations

import atexit
import csv
import io
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

__all__ = ["JOB_RECORD", "MINIMISED", "minimised", "SweepJob", "SweepSummary", "collect_jobs", "summary_table", "write_summary", "main_metrics"]

#: The record each job of a sweep writes into its folder.
JOB_RECORD = "sweep_job.json"
_ALWAYS_SHOWN = ("auc", "logloss", "accuracy")
_SHOWN_LAST = ("examples_per_sec", "best_reachable_auc")
_MAX_ERROR = 300  # characters of an error kept in the table


def main_metrics(task_metrics: Iterable[str] = ()) -> list[str]:
    """The metrics `recps.train` prints for a run of a task with `task_metrics`, in its order."""
    return list(dict.fromkeys((*_ALWAYS_SHOWN, *(str(m) for m in task_metrics), *_SHOWN_LAST)))


@dataclass
class SweepJob:
    """One job of a sweep: its record and its metrics.json (empty when it has none)."""

    job: int
    status: str
    overrides: list[str]
    objective: str
    shown: list[str]
    folder: Path
    error: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def objective_value(self) -> float:
        """The objective metric, NaN when the job failed or does not report it."""
        value = self.metrics.get(self.objective)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan

    def sort_key(self) -> tuple[int, float, int]:
        if self.status != "COMPLETED":
            return (2, 0.0, self.job)
        value = self.objective_value
        if math.isnan(value):
            return (1, 0.0, self.job)
        return (0, value if minimised(self.objective) else -value, self.job)


MINIMISED = ("logloss", "mse", "rmse", "mae", "loss")


def minimised(metric: str) -> bool:
    """Whether lower is better for `metric` (an error or a loss; `ctr/logloss` too).

    >>> minimised("logloss"), minimised("click/rmse"), minimised("auc"), minimised("recall@20")
    (True, True, False, False)
    """
    return metric.rsplit("/", 1)[-1] in MINIMISED


def _error_line(exc: BaseException | None) -> str:
    if exc is None:
        return "failed (no exception recorded)"
    text = " ".join(str(exc).split())  # one line: the table has one row per job
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _write_text(path: Path, text: str) -> None:
    from recps.fs import write_atomic  # deferred: fsspec; Hydra loads this callback in every run's start-up

    write_atomic(path, text, overwrite=True)


class SweepSummary(Callback):
    """Hydra callback (conf/config.yaml, `hydra.callbacks.sweep_summary`): see the module docstring."""

    def __init__(self) -> None:
        self._sweep_dir: Path | None = None
        self._started = 0.0
        self._done = True

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._sweep_dir = Path(str(config.hydra.sweep.dir))
        self._started = time.time()
        self._done = False
        # The basic sweeper raises a failed job's error before on_multirun_end: finish at exit then.
        atexit.register(self._finish)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        status = job_return.status.name
        # JobReturn.return_value re-raises a failed job's exception (and writes to stderr): read
        # the stored value instead.
        value = getattr(job_return, "_return_value", None)
        record = {
            "job": int(config.hydra.job.num),
            "status": status,
            "overrides": [str(o) for o in (job_return.overrides or ())],
            "objective": str(config.get("objective", "")),
            "shown": main_metrics((config.get("task") or {}).get("metrics") or ()),
            "error": "" if status == "COMPLETED" else _error_line(value if isinstance(value, BaseException) else None),
        }
        out = Path(str(config.hydra.runtime.output_dir))
        _write_text(out / JOB_RECORD, json.dumps(record, indent=2) + "\n")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish()

    def _finish(self) -> None:
        if self._done or self._sweep_dir is None:
            return
        self._done = True
        jobs = collect_jobs(self._sweep_dir, since=self._started)
        if not jobs:  # nothing ran (e.g. an override failed to compose): Hydra said why
            return
        text = write_summary(self._sweep_dir, jobs)
        # The sweep's entry point is done: this table is the last thing the user reads.
        print(f"\n{text}", flush=True)


def collect_jobs(sweep_dir: str | os.PathLike, since: float | None = None) -> list[SweepJob]:
    """The jobs under `sweep_dir` (their `sweep_job.json` records, written at or after `since`,
    a time.time(); None: all), with their metrics.json, best first (see the module docstring)."""
    jobs = []
    for path in Path(sweep_dir).rglob(JOB_RECORD):
        # A second sweep into the same folder leaves the first one's extra jobs behind: skip them
        # (1 s of slack for file systems that store whole seconds).
        if since is not None and path.stat().st_mtime < since - 1.0:
            continue
        record = json.loads(path.read_text())
        job = SweepJob(job=int(record["job"]), status=str(record["status"]), overrides=list(record["overrides"]),
                       objective=str(record["objective"]), shown=list(record["shown"]), folder=path.parent,
                       error=str(record.get("error") or ""))
        metrics_file = path.parent / "metrics.json"
        if job.status == "COMPLETED":
            try:
                metrics = json.loads(metrics_file.read_text())
            except FileNotFoundError:
                job.error = f"no metrics.json in {path.parent}"
            except ValueError as exc:
                job.error = f"{metrics_file} is not JSON ({exc})"
            else:
                job.metrics = metrics if isinstance(metrics, dict) else {}
        jobs.append(job)
    return sorted(jobs, key=SweepJob.sort_key)


def _split_override(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key, value


def _swept_keys(jobs: Sequence[SweepJob]) -> tuple[list[str], list[str]]:
    """(keys whose override differs between jobs, in first-seen order; the overrides every job shares)."""
    per_job = [dict(_split_override(o) for o in j.overrides) for j in jobs]
    keys = list(dict.fromkeys(k for d in per_job for k in d))
    swept = [k for k in keys if len({d.get(k) for d in per_job}) > 1]
    shared = [o for o in jobs[0].overrides if _split_override(o)[0] not in swept]
    return swept, shared


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "" if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "nan"
    return f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"  # metrics 0.xxxx, rates and counts


def summary_table(jobs: Sequence[SweepJob]) -> tuple[list[str], list[list[Any]], list[str]]:
    """(columns, rows of raw values in the table's order, the shared overrides) of `jobs` (sorted)."""
    swept, shared = _swept_keys(jobs)
    metrics = [m for m in dict.fromkeys(m for j in jobs for m in j.shown)
               if any(isinstance(j.metrics.get(m), (int, float)) for j in jobs)]
    columns = ["rank", "job", "status", *swept, "objective", *metrics, "error"]
    rows, rank = [], 0
    for j in jobs:
        overrides = dict(_split_override(o) for o in j.overrides)
        value = j.objective_value
        ranked = j.status == "COMPLETED" and not math.isnan(value)
        rank += ranked
        rows.append([rank if ranked else None, j.job, j.status, *(overrides.get(k, "") for k in swept),
                     None if math.isnan(value) and j.status != "COMPLETED" else value,
                     *(j.metrics.get(m) for m in metrics), j.error])
    return columns, rows, shared


def _markdown(sweep_dir: Path, jobs: Sequence[SweepJob], columns: list[str], rows: list[list[Any]],
              shared: list[str]) -> str:
    failed = sum(j.status != "COMPLETED" for j in jobs)
    objectives = ", ".join(dict.fromkeys(j.objective for j in jobs))
    lines = [
        f"# Sweep summary: {sweep_dir}",
        "",
        f"objective: {objectives} ({'minimised' if jobs and minimised(jobs[0].objective) else 'maximised'}); "
        f"{len(jobs)} jobs: {len(jobs) - failed} completed, {failed} failed",
        f"every job: {' '.join(shared) if shared else '(none)'}",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---:" if c in ("rank", "job") else "---" for c in columns) + "|",
    ]
    for row in rows:
        cells = [_number(v) for v in row]
        error = cells[-1]
        cells[-1] = (error[:_MAX_ERROR] + " ...") if len(error) > _MAX_ERROR else error
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def write_summary(sweep_dir: str | os.PathLike, jobs: Sequence[SweepJob] | None = None) -> str:
    """Writes `summary.csv` and `summary.md` into `sweep_dir` (atomically); returns the Markdown.

    `jobs`: as `collect_jobs` returns them (None: every job record under the folder)."""
    sweep_dir = Path(sweep_dir)
    jobs = collect_jobs(sweep_dir) if jobs is None else list(jobs)
    columns, rows, shared = summary_table(jobs)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([*columns, "overrides", "folder"])
    for job, row in zip(jobs, rows):
        cells = ["" if v is None else repr(v) if isinstance(v, float) else v for v in row]
        writer.writerow([*cells, " ".join(job.overrides), str(job.folder)])
    _write_text(sweep_dir / "summary.csv", buf.getvalue())
    text = _markdown(sweep_dir, jobs, columns, rows, shared)
    _write_text(sweep_dir / "summary.md", text)
    return text


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m recps.sweep",
                                     description="A sweep's table again: writes SWEEP_DIR/summary.csv and summary.md.")
    parser.add_argument("sweep_dir", help="the folder of a `python -m recps.train -m` sweep")
    folder = parser.parse_args().sweep_dir
    found = collect_jobs(folder)
    if not found:
        sys.exit(f"{folder}: no {JOB_RECORD} below it; give the folder of a `python -m recps.train -m` sweep")
    print(write_summary(folder, found))
