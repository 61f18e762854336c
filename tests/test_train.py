"""The real CLI end to end: `python -m recps.train` and `python -m recps.evaluate` on tiny inputs.

Every test spawns the entry points as a user would (a subprocess, Hydra on the command
line). Each spawn pays ~8-10 s of imports, so runs are batched: one `-m` sweep trains both
models once, and the other tests reuse its run folders. Output goes to pytest's tmp folders
(`hydra.run.dir` / `hydra.sweep.dir`, `dataset.dir`), never into the checkout.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from recps.config import PROJECT_ROOT
from tests.helpers.cli import CliRun, run_module

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

CRITEO_TINY = PROJECT_ROOT.parent / "shared" / "data" / "criteo" / "train.tiny.csv"
CRITEO_TINY_ROWS = 1999  # data rows in train.tiny.csv (the header excluded)
TRAIN_ROWS, TEST_ROWS = 5000, 1000
MODELS = ("deepfm", "ctr_dnn")


def recps(module: str, *args: str, timeout: float = 300, check: int | None = None) -> CliRun:
    """`python -m module *args` with HYDRA_FULL_ERROR=0 (tests.helpers.cli.run_module); `check=0`
    fails the test, naming the command and the tail of its output, unless it exits 0."""
    return run_module(module, *args, env={"HYDRA_FULL_ERROR": "0"}, timeout=timeout, check=check)


def small_synthetic(data_dir: Path) -> list[str]:
    """Overrides for a small generated data set in `data_dir`, trained in one local process."""
    return [
        "ps=local", "progress=false", f"dataset.dir={data_dir}",
        f"dataset.generate.train_rows={TRAIN_ROWS}", f"dataset.generate.test_rows={TEST_ROWS}",
        "dataset.generate.vocab=100",
    ]


def sweep_runs(sweep_dir: Path, expected: int) -> list[Path]:
    """The job folders of a basic-launcher sweep (0, 1, ...), in job order."""
    runs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    assert len(runs) == expected, [p.name for p in sweep_dir.iterdir()]
    return runs


def metrics_of(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def checkpoint_state(run: Path) -> dict:
    return torch.load(run / "checkpoint" / "checkpoint.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict[str, Path]:
    """`-m model=deepfm,ctr_dnn trainer.max_steps=50`: one process, two runs; model name -> run folder."""
    root = tmp_path_factory.mktemp("sweep")
    recps("recps.train", "-m", "model=deepfm,ctr_dnn", "trainer.max_steps=50",
                *small_synthetic(root / "data"), f"hydra.sweep.dir={root / 'multirun'}", check=0)
    runs = sweep_runs(root / "multirun", 2)
    return {metrics_of(run)["model"].removeprefix("models.").lower(): run for run in runs}


def test_sweep_makes_one_run_per_model_with_metrics(sweep):
    assert set(sweep) == {"deepfm", "ctrdnn"}
    for name, run in sweep.items():
        metrics = metrics_of(run)
        assert 0.5 < metrics["auc"] <= 1.0, (name, metrics["auc"])  # vocab 100 is learnable in 5k rows
        assert 0.0 < metrics["logloss"] < 0.69, (name, metrics["logloss"])  # better than a coin
        assert metrics["examples_per_sec"] > 0
        # 5,000 rows, 2 threads x ceil(2,500 / 512) = 10 steps: one epoch ends before max_steps=50.
        assert metrics["train_examples"] == TRAIN_ROWS
        assert metrics["train_steps"] == 10
        assert metrics["ps"] == "local"
        assert 0.5 < metrics["best_reachable_auc"] < 1.0
        assert (run / "checkpoint" / "checkpoint.pt").is_file()
        assert (run / "checkpoint" / "config.yaml").is_file()


def test_evaluate_reproduces_the_runs_test_auc(sweep):
    run = sweep["deepfm"]
    proc = recps("recps.evaluate", str(run / "checkpoint"), check=0)
    evaluated = json.loads(proc.stdout)
    trained = metrics_of(run)
    for key in ("auc", "logloss", "accuracy"):
        assert evaluated[key] == pytest.approx(trained[key], abs=1e-6), key


def test_resume_continues_counts_and_restores_the_saved_weights(sweep, tmp_path):
    """trainer.epochs=0 from a checkpoint saves the loaded state back unchanged; epochs=1 goes on."""
    run = sweep["deepfm"]
    saved = checkpoint_state(run)
    data_dir = run.parent.parent / "data"  # the sweep's generated data set
    recps("recps.train", "-m", "trainer.epochs=0,1", f"trainer.resume={run / 'checkpoint'}",
                *small_synthetic(data_dir), f"hydra.sweep.dir={tmp_path}", check=0)
    same, more = sweep_runs(tmp_path, 2)

    loaded = checkpoint_state(same)
    assert loaded["epochs_done"] == saved["epochs_done"] == 1
    assert loaded["steps_done"] == saved["steps_done"] == 10
    assert loaded["model"].keys() == saved["model"].keys()
    for key, tensor in saved["model"].items():
        assert torch.equal(loaded["model"][key], tensor), key
    assert metrics_of(same)["auc"] == pytest.approx(metrics_of(run)["auc"], abs=1e-9)

    trained_on = checkpoint_state(more)
    assert trained_on["epochs_done"] == 2
    assert trained_on["steps_done"] == 20
    changed = [k for k, t in saved["model"].items() if not torch.equal(trained_on["model"][k], t)]
    assert changed, "one more epoch changed no weight"


def test_a_resume_takes_the_saved_moments_and_the_configured_learning_rate(sweep, tmp_path):
    """optimizer.lr changed on a resume: the optimizer keeps the saved state (Adam's moments, step
    counts) and takes the new lr (torch's load_state_dict alone would bring the saved lr back), as the
    servers' tables do; the log says what changed."""
    run = sweep["deepfm"]
    saved = checkpoint_state(run)["optimizer"]
    data_dir = run.parent.parent / "data"
    out = tmp_path / "resumed"
    proc = recps("recps.train", "trainer.epochs=0", "optimizer.lr=0.000123", f"trainer.resume={run / 'checkpoint'}",
                       *small_synthetic(data_dir), f"hydra.run.dir={out}", check=0)
    loaded = checkpoint_state(out)["optimizer"]
    assert [g["lr"] for g in loaded["param_groups"]] == [0.000123] * len(saved["param_groups"])
    assert [g["lr"] for g in saved["param_groups"]] != [0.000123] * len(saved["param_groups"])
    assert loaded["state"].keys() == saved["state"].keys()
    for i, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(loaded["state"][i][key]), torch.as_tensor(value)), (i, key)
    assert "resumed with the configured lr" in proc.stdout + proc.stderr


def test_cfg_job_starts_nothing(tmp_path):
    """With the default config (an async PS cluster) `--cfg job` prints and launches nothing."""
    run_dir, data_dir = tmp_path / "run", tmp_path / "data"
    start = time.monotonic()
    proc = recps("recps.train", "--cfg", "job", f"hydra.run.dir={run_dir}", f"dataset.dir={data_dir}",
                       timeout=120, check=0)
    seconds = time.monotonic() - start
    assert "_target_: models.DeepFM" in proc.stdout
    assert "name: async" in proc.stdout
    assert not run_dir.exists() and not data_dir.exists()
    assert "fbgemm" not in proc.stderr.lower()  # torch/fbgemm were never imported
    assert seconds < 60, seconds


@pytest.mark.parametrize("ps", ["async", "sync"])
def test_a_users_config_folder_works_under_a_ps_mode(tmp_path, ps):
    """`--config-dir` with the user's own data set config: the cluster's processes run the composed
    config itself (<run dir>/recps-job.yaml), so they find what the parent found."""
    conf = tmp_path / "myconf" / "dataset"
    conf.mkdir(parents=True)
    text = (PROJECT_ROOT / "conf" / "dataset" / "synthetic.yaml").read_text().replace("name: synthetic", "name: mine")
    (conf / "mine.yaml").write_text(text)
    run = tmp_path / "run"
    recps("recps.train", "--config-dir", str(tmp_path / "myconf"), "dataset=mine", f"ps={ps}",
                "progress=false", "checkpoint.save=false", "trainer.max_steps=4", f"dataset.dir={tmp_path / 'data'}",
                f"dataset.generate.train_rows={TRAIN_ROWS}", f"dataset.generate.test_rows={TEST_ROWS}",
                "dataset.generate.vocab=100", f"hydra.run.dir={run}", timeout=300, check=0)
    assert "name: mine" in (run / "recps-job.yaml").read_text()
    assert metrics_of(run)["ps"] == ps and metrics_of(run)["train_steps"] > 0


def test_wrong_override_is_one_line_naming_it(tmp_path):
    proc = recps("recps.train", "model.hiden=[8]", f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode != 0
    first = proc.stderr.strip().splitlines()[0]
    assert "model.hiden" in first, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not CRITEO_TINY.is_file(),
                    reason=f"Criteo sample {CRITEO_TINY} absent (it is not redistributable, never in the repo)")
def test_criteo_tiny_trains_and_evaluates_both_models_on_80_20(tmp_path):
    recps("recps.train", "-m", "model=deepfm,ctr_dnn", "dataset=criteo_tiny", "ps=local", "progress=false",
                "trainer.epochs=2", f"hydra.sweep.dir={tmp_path}", check=0)
    test_rows = round(CRITEO_TINY_ROWS * 0.2)
    for run in sweep_runs(tmp_path, 2):
        metrics = metrics_of(run)
        assert metrics["train_examples"] == 2 * (CRITEO_TINY_ROWS - test_rows), metrics
        assert 0.0 < metrics["auc"] < 1.0 and 0.0 < metrics["logloss"] < 1.0, metrics
        evaluated = json.loads(recps("recps.evaluate", str(run / "checkpoint"), check=0).stdout)
        assert evaluated["auc"] == pytest.approx(metrics["auc"], abs=1e-6)


# ---------------------------------------------------------- errors before processes (issue 18, point 3)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The failed run's stderr: one line, no traceback; returns it."""
    assert proc.returncode == 1, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.parametrize("override, message", [
    ("trainer.batch_size=-1", "recps.train: ConfigError: trainer.batch_size=-1: give the examples per batch "
                              "(per thread), 1 or more"),
    ("cluster.workers=0", "recps.train: ConfigError: cluster.workers=0; it must be an integer >= 1"),
])
def test_a_bad_value_under_a_ps_mode_fails_before_any_process_starts(tmp_path, override, message):
    """The default ps=async: the launcher refuses the value itself; no server or worker ever starts."""
    run = tmp_path / "run"
    proc = recps("recps.train", override, "progress=false", f"dataset.dir={tmp_path / 'data'}",
                 f"hydra.run.dir={run}", timeout=120)
    assert one_line_error(proc) == message
    assert "[worker0]" not in proc.stdout and "[server0]" not in proc.stdout, proc.stdout
    assert not (run / "cluster.log").exists() and not (run / "recps-job.yaml").exists()
    assert not (tmp_path / "data").exists()  # nor was the data set generated


def test_a_misspelled_key_names_the_closest_and_its_plus_form_does_not_train(tmp_path):
    proc = recps("recps.train", "trainer.thread=2", f"hydra.run.dir={tmp_path / 'a'}", timeout=120)
    assert one_line_error(proc).startswith(
        "recps.train: trainer.thread=2: trainer has no key 'thread'; did you mean trainer.threads?")
    # Hydra's own message suggests +trainer.thread=2: that must not train with the key ignored.
    proc = recps("recps.train", "+trainer.thread=2", "ps=local", f"hydra.run.dir={tmp_path / 'b'}", timeout=120)
    assert one_line_error(proc).startswith(
        "recps.train: ConfigError: trainer.thread=2 (from the override +trainer.thread=2) is read by nothing and "
        "would be ignored; did you mean trainer.threads?")
    assert not (tmp_path / "b" / "metrics.json").exists()


def test_hydra_full_error_shows_the_traceback(tmp_path):
    proc = run_module("recps.train", "trainer.batch_size=-1", "ps=local", f"hydra.run.dir={tmp_path / 'run'}",
                      env={"HYDRA_FULL_ERROR": "1"}, timeout=120, check=1)
    assert "Traceback" in proc.stderr and "in validate_config" in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "recps.errors.ConfigError: trainer.batch_size=-1: give the examples per batch (per thread), 1 or more")


def test_a_worker_that_fails_is_named_with_what_it_said(tmp_path):
    """What only a worker can find (here: rows that do not match the schema) ends the run with the
    worker's own message."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.txt", "test.txt"):
        (data / name).write_text("not\ta\trow\n" * 50)
    run = tmp_path / "run"
    proc = recps("recps.train", f"dataset.dir={data}", "dataset.generate=null", "progress=false",
                 "checkpoint.save=false", f"hydra.run.dir={run}", timeout=300)
    last = one_line_error(proc)
    assert last.startswith("recps.train: LaunchError: worker0 (pid "), last
    assert f"exited with code 1: DataError: {data / 'train.txt'}: no line matches dataset.schema" in last, last
    assert last.endswith(f"its output is in {run / 'cluster.log'}")


def test_missing_data_files_are_named_before_any_process_starts(tmp_path):
    run = tmp_path / "run"
    proc = recps("recps.train", f"dataset.dir={tmp_path / 'none'}", "dataset.generate=null", "progress=false",
                 "checkpoint.save=false", f"hydra.run.dir={run}", timeout=300)
    last = one_line_error(proc)
    assert last == (f"recps.train: DataError: dataset.train: {tmp_path / 'none' / 'train.txt'}: no such file; "
                    "check the dataset path (or generate it: dataset.generate)"), last
    assert "[server0]" not in proc.stdout + proc.stderr and "[worker0]" not in proc.stdout + proc.stderr
