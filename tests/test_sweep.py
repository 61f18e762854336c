"""A `-m` sweep ends with one table: overrides -> objective and the main metrics, best first.

The real CLI (`python -m recps.train -m ...`, one subprocess, three tiny ps=local jobs on a
small generated data set); one job fails on purpose (trainer.batch_size=0) and must appear
with its error, last, while the sweep still exits non-zero as Hydra makes it.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from tests.helpers.cli import CliRun, recps_train

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, CliRun]:
    root = tmp_path_factory.mktemp("sweep")
    proc = recps_train(
        "-m", "trainer.batch_size=0,16,256", "trainer.max_steps=4", "trainer.threads=1",
        "ps=local", "progress=false", "checkpoint.save=false", "metrics=off",
        f"dataset.dir={root / 'data'}", "dataset.generate.train_rows=2000", "dataset.generate.test_rows=500",
        "dataset.generate.vocab=100", f"hydra.sweep.dir={root / 'multirun'}",
        env={"HYDRA_FULL_ERROR": "0"}, timeout=500, check=1,  # one job of the three fails: so does the sweep
    )
    return root / "multirun", proc


@pytest.mark.e2e
def test_sweep_writes_summary_rows_best_first_with_the_failed_job_last(sweep):
    sweep_dir, proc = sweep
    assert proc.returncode == 1, proc.stderr[-3000:]  # a failed job still fails the sweep (Hydra's behaviour)
    with open(sweep_dir / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    # The two jobs that ran, by the AUC their metrics.json holds, highest first; then the failed one.
    aucs = {n: json.loads((sweep_dir / str(n) / "metrics.json").read_text())["auc"] for n in (1, 2)}
    ranked = sorted(aucs, key=lambda n: -aucs[n])
    assert [r["job"] for r in rows] == [str(n) for n in ranked] + ["0"]
    assert [r["rank"] for r in rows] == ["1", "2", ""]
    assert [r["status"] for r in rows] == ["COMPLETED", "COMPLETED", "FAILED"]
    assert [r["trainer.batch_size"] for r in rows] == [{1: "16", 2: "256"}[n] for n in ranked] + ["0"]
    for row, n in zip(rows, ranked):
        metrics = json.loads((sweep_dir / str(n) / "metrics.json").read_text())
        assert float(row["objective"]) == float(row["auc"]) == metrics["auc"]  # objective: auc (conf/config.yaml)
        assert float(row["logloss"]) == metrics["logloss"]
        assert float(row["examples_per_sec"]) == metrics["examples_per_sec"]
        assert row["error"] == ""
        assert f"trainer.batch_size={row['trainer.batch_size']}" in row["overrides"].split()
    failed = rows[-1]
    assert failed["objective"] == "" and failed["auc"] == ""
    assert "batch_size" in failed["error"] and failed["error"].split(":")[0].endswith("Error"), failed["error"]
    # The overrides every job shares are not repeated as columns.
    assert "ps" not in rows[0] and "trainer.max_steps" not in rows[0]


@pytest.mark.e2e
def test_sweep_prints_and_writes_the_same_markdown_table(sweep):
    sweep_dir, proc = sweep
    md = (sweep_dir / "summary.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 3  # header, rule, three jobs
    assert "objective: auc (maximised)" in md
    assert "ps=local" in md  # the shared overrides, listed once
    assert table[-1].split("|")[3].strip() == "FAILED"
    assert md.strip() in proc.stdout  # what the user reads at the end of the sweep
    first_auc = float(table[2].split("|")[5])
    assert not math.isnan(first_auc)


@pytest.mark.e2e
def test_a_sweep_into_a_used_folder_summarises_its_own_jobs_only(tmp_path):
    """Every job completes (the summary comes from on_multirun_end, exit 0); a second, smaller
    sweep into the same folder leaves the first one's job 1 behind, and the table skips it."""
    common = ("trainer.max_steps=2", "trainer.threads=1", "ps=local", "progress=false", "checkpoint.save=false",
              "metrics=off", f"dataset.dir={tmp_path / 'data'}", "dataset.generate.train_rows=1000",
              "dataset.generate.test_rows=300", "dataset.generate.vocab=50", f"hydra.sweep.dir={tmp_path / 'm'}")
    recps_train("-m", "seed=1,2", *common, env={"HYDRA_FULL_ERROR": "0"}, timeout=500)
    with open(tmp_path / "m" / "summary.csv", newline="") as f:
        assert sorted(r["seed"] for r in csv.DictReader(f)) == ["1", "2"]
    second = recps_train("-m", "seed=3", *common, env={"HYDRA_FULL_ERROR": "0"}, timeout=500)
    assert (tmp_path / "m" / "1" / "sweep_job.json").is_file()  # the first sweep's, left in place
    with open(tmp_path / "m" / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["status"], r["rank"]) for r in rows] == [("0", "COMPLETED", "1")]
    assert "seed=3" in rows[0]["overrides"].split()
    assert "| 1 | 0 | COMPLETED |" in second.stdout


def test_a_loss_objective_ranks_the_lowest_first(tmp_path):
    from recps.sweep import SweepJob, summary_table, write_summary

    def job(n: int, value: float, objective: str) -> SweepJob:
        return SweepJob(job=n, status="COMPLETED", overrides=[f"optimizer.lr={n}"], objective=objective,
                        shown=["logloss", "auc"], folder=tmp_path / str(n), metrics={"logloss": value, "auc": 1 - value})

    jobs = [job(0, 0.52, "logloss"), job(1, 0.47, "logloss"), job(2, 0.61, "logloss")]
    assert [j.job for j in sorted(jobs, key=SweepJob.sort_key)] == [1, 0, 2]
    columns, rows, _ = summary_table(sorted(jobs, key=SweepJob.sort_key))
    assert [r[columns.index("job")] for r in rows] == [1, 0, 2]
    assert "objective: logloss (minimised)" in write_summary(tmp_path, jobs)
    assert [j.job for j in sorted([job(0, 0.52, "auc"), job(1, 0.47, "auc")], key=SweepJob.sort_key)] == [1, 0]
