"""Debug dump and global training metrics of a real cluster: `python -m recps.train ps=sync
cluster.workers=2` (1 server + 2 workers x 1 thread on 127.0.0.1, tiny generated data, 19 steps).

- two runs with the same seed write byte-identical dumps (every file of every worker), and
  `python -m recps.debug diff` says so;
- a run whose dense learning rate differs diverges first at step 1, worker 0, at the first
  parameter record after the update, by exactly delta-lr x the mean of both workers' gradients
  (the servers' sync step), which `python -m recps.debug diff` reports;
- worker 0's step and pass reports (merged over both workers through the parameter server)
  equal MetricCollection on the union of both workers' dumped predictions and labels up to
  that step, to 1e-6; only worker 0 logs and writes them; TensorBoard gets them with
  metrics.tensorboard=true; the checkpoint holds the model's tables only (not the merge tables).

One thread per worker, on purpose: sync mode with several threads per worker is not
deterministic in what the dump records. The trainer numbers a worker's steps over its
threads in the order they finish (which of two threads gets step 2k-1 or 2k races), and
the step's sparse gradients are concatenated in the threads' arrival order, so rows that
several threads touch are summed in a varying order. With one thread, each worker's steps
are numbered 1, 2, ... and the server sums at most one gradient per key and worker, two
workers' sums being the same in either order.

Each run costs three process start-ups (~10 s of imports each); three runs in all.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from recps.config import PROJECT_ROOT, register_resolvers
from recps.debug import dump_files, read_index, read_record
from recps.metrics import MetricCollection
from recps.metrics.collection import build_metric
from tests.helpers.cli import recps_train, run_module

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROWS, BATCH, WORKERS, EVERY, LR, PLANTED_LR = 1200, 32, 2, 5, 0.1, 0.15
STEPS = math.ceil(ROWS / WORKERS / BATCH)  # 19 per worker (sync: each takes its shard's batches)
BASE = [
    "ps=sync", f"cluster.workers={WORKERS}", "trainer.threads=1", f"trainer.batch_size={BATCH}",
    "model=ctr_dnn", "model.hidden=[16,8]", "optimizer=sgd", f"dataset.generate.train_rows={ROWS}",
    "dataset.generate.test_rows=300", "dataset.generate.vocab=500", "debug=dump", f"metrics.every_steps={EVERY}",
    "checkpoint.save=false", "progress=false",
]


def cluster_run(factory, name: str, *overrides: str) -> Path:
    """`python -m recps.train` with BASE + overrides in a fresh run folder; the folder."""
    out = factory.mktemp(name)
    data = factory.getbasetemp() / "cluster-dump-data"  # generated once, by the first run's launcher
    recps_train(*BASE, f"dataset.dir={data}", *overrides, f"hydra.run.dir={out}", timeout=400)
    return out


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> Path:
    return cluster_run(tmp_path_factory, "a", f"optimizer.lr={LR}")


@pytest.fixture(scope="module")
def run_b(tmp_path_factory) -> Path:
    return cluster_run(tmp_path_factory, "b", f"optimizer.lr={LR}")


@pytest.fixture(scope="module")
def run_c(tmp_path_factory) -> Path:
    """The planted difference: the dense learning rate; also TensorBoard and a checkpoint."""
    return cluster_run(tmp_path_factory, "c", f"optimizer.lr={PLANTED_LR}", "metrics.tensorboard=true",
                       "checkpoint.save=true")


def records(run: Path) -> dict[tuple[int, int, str], np.ndarray]:
    """{(worker, step, record name): array} of a run's dump."""
    out = {}
    for (role, rank, thread), idx in dump_files(run).items():
        assert (role, thread) == ("worker", 0)
        data = np.fromfile(idx.with_suffix(".bin"), dtype=np.uint8)
        for r in read_index(idx):
            out[rank, r.step, r.name] = read_record(data, r)
    return out


def metric_specs() -> dict:
    """conf/metrics/default's metrics, as the reporter builds them."""
    register_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=BASE)
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg.metrics.metrics, resolve=True)


def test_worker0_reports_the_metrics_of_the_union_of_both_workers(run_a):
    metrics = json.loads((run_a / "metrics.json").read_text())
    assert (metrics["workers"], metrics["threads"], metrics["train_steps"]) == (WORKERS, 1, STEPS)
    reports = metrics["train_metrics"]
    assert [(r["kind"], r["step"]) for r in reports] == [
        *(("step", s) for s in range(EVERY, STEPS + 1, EVERY)), ("pass", STEPS)]
    lines = [json.loads(line) for line in (run_a / "train_metrics.jsonl").read_text().splitlines()]
    assert lines == reports

    recs = records(run_a)
    specs = metric_specs()
    for report in reports:
        # The union: both workers' predictions of steps 1..report step, one collection.
        ref = MetricCollection([build_metric(name, **(kw or {})) for name, kw in specs.items()])
        steps = range(1, report["step"] + 1)
        probs = torch.from_numpy(np.concatenate([recs[w, s, "predictions"] for w in range(WORKERS) for s in steps]))
        labels = torch.from_numpy(np.concatenate([recs[w, s, "labels"][:, 0] for w in range(WORKERS) for s in steps]))
        ref.update(probs, labels)
        assert report["examples"] == probs.numel() == min(report["step"] * BATCH, ROWS // WORKERS) * WORKERS
        want = ref.compute()
        assert set(want) == set(report) - {"kind", "step", "pass", "examples"}
        for name, value in want.items():
            assert report[name] == pytest.approx(value, abs=1e-6, rel=0), (report["kind"], report["step"], name)
    assert 0.0 < reports[-1]["auc"] < 1.0 and reports[-1]["logloss"] > 0  # defined values, not NaN

    # Worker 0 tells; worker 1 computes the same global values but neither logs nor writes them.
    log = (run_a / "cluster.log").read_text().splitlines()
    told = [line for line in log if " metrics, step " in line]
    assert len(told) == len(reports) and all(line.startswith("[worker0] ") for line in told)
    assert not (run_a / "tensorboard").exists()


def test_two_sync_runs_write_byte_identical_dumps(run_a, run_b):
    names = sorted(p.name for p in (run_a / "dump").iterdir())
    assert names == sorted(p.name for p in (run_b / "dump").iterdir()) == [
        f"worker{w:04d}-thread000.{ext}" for w in range(WORKERS) for ext in ("bin", "idx")]
    for name in names:
        assert (run_a / "dump" / name).read_bytes() == (run_b / "dump" / name).read_bytes(), name
    # every step of each worker, once, in order; the workers saw different examples
    for w in range(WORKERS):
        steps = [r.step for r in read_index(run_a / "dump" / f"worker{w:04d}-thread000.idx")]
        assert sorted(set(steps)) == list(range(1, STEPS + 1)) and steps == sorted(steps)
    recs = records(run_a)
    assert not np.array_equal(recs[0, 1, "keys.values"], recs[1, 1, "keys.values"])
    # ... and trained one model: after each sync step both hold the servers' parameters
    assert np.array_equal(recs[0, 3, "param/over_arch.0.weight"], recs[1, 3, "param/over_arch.0.weight"])
    proc = run_module("recps.debug", "diff", str(run_a), str(run_b), timeout=120)
    assert proc.stdout.startswith(f"no divergence: {WORKERS * 1} dump files"), proc.stdout


def test_diff_finds_a_planted_learning_rate_at_step_1_first_parameter(run_a, run_c):
    proc = run_module("recps.debug", "diff", "--json", str(run_a), str(run_c), timeout=120, check=1)
    d = json.loads(proc.stdout)["divergence"]
    # Step 1: keys, labels, logits, loss and gradients agree (same initial values); the update differs.
    first = "over_arch.0.bias"  # parameters are dumped sorted by name
    assert (d["step"], d["batch"], d["role"], d["rank"], d["thread"], d["name"]) == (
        1, 1, "worker", 0, 0, f"param/{first}")
    recs = records(run_a)
    mean_grad = (recs[0, 1, f"grad/{first}"].astype(np.float64) + recs[1, 1, f"grad/{first}"]) / WORKERS
    assert d["max_abs_diff"] == pytest.approx((PLANTED_LR - LR) * np.abs(mean_grad).max(), rel=1e-4)
    text = run_module("recps.debug", "diff", str(run_a), str(run_c), timeout=120, check=1).stdout
    assert text.startswith(f"first divergence: step 1 (batch 1), worker 0, thread 0, param/{first} float32 (16,)")


def test_tensorboard_and_checkpoint_of_a_cluster_run(run_c):
    metrics = json.loads((run_c / "metrics.json").read_text())
    last = metrics["train_metrics"][-1]
    events = list((run_c / "tensorboard").glob("events.out.tfevents.*"))
    # worker 0's training reports, and the launcher's held-out metrics (test/) after the run
    assert len(events) == 2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accs = [EventAccumulator(str(e)) for e in events]
    for a in accs:
        a.Reload()
    acc, final = sorted(accs, key=lambda a: "pass/auc" not in a.Tags()["scalars"])
    assert [t for t in acc.Tags()["scalars"] if t.startswith("test/")] == []
    (test_auc,) = final.Scalars("test/auc")
    assert (test_auc.step, test_auc.value) == (STEPS, pytest.approx(metrics["auc"], abs=1e-6))
    (auc,) = acc.Scalars("pass/auc")
    assert (auc.step, auc.value) == (0, pytest.approx(last["auc"], abs=1e-6))
    assert [e.step for e in acc.Scalars("train/logloss")] == list(range(EVERY, STEPS + 1, EVERY))
    # The servers also hold the run's stats and the metric merge tables; the checkpoint does not.
    saved = sorted(p.name for p in (run_c / "checkpoint").iterdir() if p.is_dir())
    assert saved and not [n for n in saved if n.startswith(("recps.metrics", "recps_stats"))], saved
