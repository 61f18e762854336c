"""The debug dump on real local training (DeepFM, FBGEMM tables, tiny generated data).

- two runs with the same seed (one through the Python API, one through `python -m recps.train`)
  write byte-identical dumps, and the diff says so;
- a run whose gradient of one layer is perturbed at one step diverges exactly there;
- Hogwild threads each write their own file, every step exactly once;
- the CLI run logs its periodic metrics and puts them in metrics.json.
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
from recps.debug import build_dump, diff_runs, dump_files, read_index, read_record
from recps.errors import ConfigError
from recps.job.build import build_job, run_training
from recps.job.observer import TrainObserver
from tests.helpers.cli import recps_train, run_module

ROWS, BATCH = 3000, 256
STEPS = math.ceil(ROWS / BATCH)  # 12
BASE = [
    "ps=local", f"dataset.generate.train_rows={ROWS}", "dataset.generate.test_rows=1000", "dataset.generate.vocab=1000",
    "ps.num_embeddings=1000", "model.hidden=[16,16]", f"trainer.batch_size={BATCH}", "trainer.threads=1",
    "progress=false", "checkpoint.save=false",
]
DUMP = ["debug=dump", "debug.modules=[over_arch,sparse_arch]", "debug.module_grads=true", "debug.tables=[t_C1]"]


def config(*overrides: str):
    register_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=[*BASE, *overrides])


def records(run: Path) -> list[tuple]:
    """(file key, record, array) of every record of a run, in file order."""
    out = []
    for key, idx in dump_files(run).items():
        data = np.fromfile(idx.with_suffix(".bin"), dtype=np.uint8)
        out += [(key, r, read_record(data, r)) for r in read_index(idx)]
    return out


@pytest.fixture(scope="module")
def api_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("api")
    return out, run_training(config(*DUMP, "metrics.every_steps=4"), out)


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, api_run) -> Path:
    out = tmp_path_factory.mktemp("cli")
    # The child's torch runs as many intra-op threads as this process (an xdist worker runs 1,
    # tests/conftest.py): sums split over another number of threads round differently.
    recps_train(*BASE, *DUMP, "metrics.every_steps=4", f"hydra.run.dir={out}", timeout=400,
                env={"OMP_NUM_THREADS": str(torch.get_num_threads())})
    return out


@pytest.mark.e2e
def test_same_seed_gives_byte_identical_dumps(api_run, cli_run):
    a, b = api_run[0] / "dump", cli_run / "dump"
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) == ["worker0000-thread000.bin", "worker0000-thread000.idx"]
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    result = diff_runs(api_run[0], cli_run)
    assert result.divergence is None and result.records == len(read_index(a / names[1]))
    proc = run_module("recps.debug", "diff", str(api_run[0]), str(cli_run), timeout=120)
    assert proc.stdout.startswith("no divergence: 1 dump files"), proc.stdout + proc.stderr


def test_dump_holds_the_steps_in_the_configured_order(api_run):
    run, metrics = api_run
    recs = records(run)
    steps = [r.step for _, r, _ in recs]
    assert steps == sorted(steps) and sorted(set(steps)) == list(range(1, STEPS + 1))
    step1 = [(r.name, r.shape) for _, r, _ in recs if r.step == 1]
    names = [n for n, _ in step1]
    assert names[:10] == ["keys.values", "keys.lengths", "labels", "logits", "predictions", "loss",
                          "out/over_arch", "out/sparse_arch", "grad/out/over_arch", "grad/out/sparse_arch"]
    grads = [n for n in names if n.startswith("grad/") and not n.startswith("grad/out/")]
    params = [n for n in names if n.startswith("param/")]
    assert grads == sorted(grads) and [g[5:] for g in grads] == [p[6:] for p in params]
    assert "param/over_arch.0.weight" in params and not any("fused" in n for n in params)  # tables are not dense
    assert names[-2:] == ["table/t_C1.ids", "table/t_C1.rows"]
    shapes = dict(step1)
    assert shapes["labels"] == (BATCH, 1) and shapes["out/sparse_arch"] == (BATCH, 26 * 11)
    by = {(r.step, r.name): x for _, r, x in recs}
    np.testing.assert_allclose(by[1, "predictions"], 1 / (1 + np.exp(-by[1, "logits"].astype(np.float64))), rtol=1e-6)
    # the loss the dump holds is the loss the trainer saw
    assert [float(by[s, "loss"]) for s in range(1, 11)] == pytest.approx(metrics["first_losses"], rel=1e-7)
    # table rows: key mod num_embeddings, values after the step's update, so they move
    ids1, ids2 = by[1, "table/t_C1.ids"], by[2, "table/t_C1.ids"]
    assert np.all(np.diff(ids1) > 0) and ids1.max() < 1000
    common = np.intersect1d(ids1, ids2)
    assert common.size and not np.array_equal(by[1, "table/t_C1.rows"][np.isin(ids1, common)],
                                              by[2, "table/t_C1.rows"][np.isin(ids2, common)])


@pytest.mark.e2e
def test_cli_run_logs_periodic_metrics_and_writes_them_to_metrics_json(cli_run):
    log = (cli_run / "train.log").read_text()
    assert log.count("step metrics, step ") == STEPS // 4 and log.count("pass metrics, step ") == 1
    assert f"pass metrics, step {STEPS}, pass 0, {ROWS} examples: auc=" in log
    metrics = json.loads((cli_run / "metrics.json").read_text())
    reports = metrics["train_metrics"]
    assert [(r["kind"], r["step"], r["examples"]) for r in reports] == [
        ("step", 4, 4 * BATCH), ("step", 8, 8 * BATCH), ("step", 12, ROWS), ("pass", 12, ROWS)]
    assert set(reports[0]) == {"kind", "step", "pass", "examples", "auc", "logloss", "accuracy", "actual_ctr",
                               "predicted_ctr", "copc"}
    lines = [json.loads(line) for line in (cli_run / "train_metrics.jsonl").read_text().splitlines()]
    assert lines == reports


class PlantGradient(TrainObserver):
    """Adds `delta` to one parameter's gradient at the thread's `at`-th batch (before the update)."""

    def __init__(self, param: str, at: int, delta: float) -> None:
        self.param, self.at, self.delta, self.seen = param, at, delta, 0

    def on_fit_start(self, replicas):
        self.replica = replicas[0]

    def after_backward(self, thread):
        self.seen += 1
        if self.seen == self.at:
            self.replica.get_parameter(self.param).grad += self.delta


@pytest.mark.e2e
def test_diff_finds_a_planted_divergence_at_its_step_and_layer(api_run, tmp_path):
    cfg = config(*DUMP)
    job = build_job(cfg)
    dump = build_dump(cfg.debug, tmp_path, task=job.task, collection=job.collection)
    job.trainer.observers = [PlantGradient("dense_linear.weight", at=3, delta=0.25), dump]
    job.trainer.fit(job.data.train, BATCH, progress=False)
    dump.close()
    assert all(not m._forward_hooks for m in job.model.modules())  # the dump unhooked itself
    d = diff_runs(api_run[0], tmp_path).divergence
    assert (d.step, d.batch, d.role, d.rank, d.thread, d.name) == (3, 3, "worker", 0, 0, "grad/dense_linear.weight")
    assert d.max_abs_diff == pytest.approx(0.25, abs=1e-6)
    proc = run_module("recps.debug", "diff", str(api_run[0]), str(tmp_path), timeout=120, check=1)
    assert proc.stdout.startswith("first divergence: step 3 (batch 3), worker 0, thread 0, grad/dense_linear.weight float32 (1, 13)")


@pytest.mark.e2e
def test_diff_of_two_learning_rates_names_the_first_step_and_tensor(api_run, tmp_path):
    """The case `recps.debug diff` exists for: the same run but the dense optimizer's lr. Step 1's
    forward and gradients come from equal initial values; its parameters are dumped after the
    update, so the first divergence is step 1's first dense parameter (here `param/bias`, a 0-d
    record: the one that crashed the diff before)."""
    out = tmp_path / "lr"
    run_training(config(*DUMP, "metrics.every_steps=4", "optimizer.lr=0.01"), out)
    d = diff_runs(api_run[0], out).divergence
    assert d is not None and (d.step, d.reason) == (1, "values") and d.max_abs_diff > 0
    step1 = [r.name for _, r, _ in records(api_run[0]) if r.step == 1]
    assert d.name == next(n for n in step1 if n.startswith("param/"))  # everything before it is equal
    proc = run_module("recps.debug", "diff", str(api_run[0]), str(out), timeout=120, check=1)
    assert proc.stdout.startswith(f"first divergence: step 1 (batch 1), worker 0, thread 0, {d.name} "), proc.stdout


def test_hogwild_threads_write_their_own_files(tmp_path):
    cfg = config("trainer.threads=2", "debug=dump", "debug.fields=[labels,loss]", "debug.params=[bias]",
                 "debug.every_steps=2")
    job = build_job(cfg)
    dump = build_dump(cfg.debug, tmp_path, task=job.task, collection=job.collection)
    job.trainer.observers = [dump]
    stats = job.trainer.fit(job.data.train, BATCH, progress=False)
    dump.close()
    files = dump_files(tmp_path)
    assert list(files) == [("worker", 0, 0), ("worker", 0, 1)]
    steps = []
    for idx in files.values():
        recs = read_index(idx)
        assert [r.name for r in recs] == ["labels", "loss", "grad/bias", "param/bias"] * (len(recs) // 4)
        batches = [r.batch for r in recs[::4]]
        assert batches == sorted(batches) and len(set(batches)) == len(batches)
        steps += [r.step for r in recs[::4]]
    assert sorted(steps) == list(range(1, stats.steps + 1, 2))  # steps 1, 3, 5 ..., once, in one of the files


def test_off_builds_nothing_and_config_errors_are_named(tmp_path):
    assert build_dump(config().debug, tmp_path) is None
    with pytest.raises(ConfigError, match=r"debug.fields=.*unknown \['label'\]"):
        build_dump(config("debug=dump", "debug.fields=[label]").debug, tmp_path)
    with pytest.raises(ConfigError, match="unexpected keyword argument 'fieldz'"):
        build_dump(config("debug=dump", "+debug.fieldz=[labels]").debug, tmp_path)
    cfg = config("debug=dump", "debug.modules=[over_arc]")
    job = build_job(cfg)
    dump = build_dump(cfg.debug, tmp_path, task=job.task, collection=job.collection)
    with pytest.raises(ConfigError, match=r"no submodule 'over_arc'; its top-level modules are .*'over_arch'"):
        dump.on_fit_start([job.model])
    dump = build_dump(config("debug=dump", "debug.params=[over.*]").debug, tmp_path, collection=job.collection,
                      task=job.task)
    with pytest.raises(ConfigError, match=r"\['over.\*'\] match no dense parameter"):
        dump.on_fit_start([job.model])
    assert not (tmp_path / "dump").exists()  # names are checked before any file is opened
