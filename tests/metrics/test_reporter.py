"""MetricsReporter under the real Trainer: per-thread states merged at reports, reports in step
order, pass states reset, files; and the sum over workers through gloo (2 processes) and
through a real parameter server (2 worker clients), with workers that take different
numbers of steps.

The model is a fixed linear layer trained with lr=0, so its logits do not depend on how the
Hogwild threads interleave and the expected values are computed directly from the batches.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recps.data.batch import Batch
from recps.errors import ConfigError, DataError
from recps.metrics import MetricCollection
from recps.metrics.reporter import GlooMerger, MetricsReporter, build_reporter, check_metrics_config
from recps.tasks import BinaryTask
from recps.job.loop import LocalDenseUpdater, Trainer

from tests.helpers.cluster import servers_and_workers
NAMES = ["auc", "logloss", "accuracy", "actual_ctr", "predicted_ctr", "copc", "mae", "rmse"]
DENSE, ROWS = 5, 32


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DENSE, 1)
        gen = torch.Generator().manual_seed(0)  # the same weights in every process and thread
        with torch.no_grad():  # (not the global RNG: two workers in threads would race on it)
            self.linear.weight.copy_(torch.randn(1, DENSE, generator=gen))
            self.linear.bias.copy_(torch.randn(1, generator=gen))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.linear(dense).squeeze(1)  # (B,)


def make_batches(worker: int, count: int) -> list[Batch]:
    """`count` batches of worker `worker` (different data per worker)."""
    gen = torch.Generator().manual_seed(1000 + worker)
    out = []
    for _ in range(count):
        dense = torch.randn(ROWS, DENSE, generator=gen)  # (B, I)
        labels = (torch.rand(ROWS, generator=gen) < torch.sigmoid(dense[:, 0] - 1.0)).float()  # (B,)
        sparse = KeyedJaggedTensor.from_lengths_sync(keys=["C1"], values=torch.arange(ROWS), lengths=torch.ones(ROWS, dtype=torch.int64))
        out.append(Batch(dense=dense, sparse=sparse, labels=labels[:, None]))
    return out


class ListSource:
    """Batch i of an epoch goes to thread i % threads."""

    def __init__(self, batches: list[Batch]) -> None:
        self.all = batches

    def batches(self, batch_size, shard_index, num_shards, epoch):
        return iter(self.all[shard_index::num_shards])


def trainer(threads: int, observers) -> Trainer:
    model = Tiny()
    params = list(model.parameters())
    updater = LocalDenseUpdater(params, torch.optim.SGD(params, lr=0.0))
    return Trainer(model, nn.Identity(), BinaryTask(), updater, threads=threads, observers=observers)


def expected(batches: list[Batch]) -> dict[str, float]:
    model, ref = Tiny(), MetricCollection(NAMES)
    with torch.no_grad():
        for b in batches:
            ref.update(torch.sigmoid(model(b.dense, b.sparse)), b.labels[:, 0])
    return ref.compute()


def assert_values(report: dict, want: dict[str, float], rel: float) -> None:
    for name, value in want.items():
        assert report[name] == pytest.approx(value, rel=rel, abs=rel), name


def test_one_thread_step_reports_hold_exactly_the_steps_so_far():
    batches = make_batches(0, 7)
    rep = MetricsReporter(NAMES, BinaryTask(), threads=1, every_steps=3)
    trainer(1, [rep]).fit(ListSource(batches), ROWS, progress=False)
    assert [(r["kind"], r["step"], r["pass"], r["examples"]) for r in rep.reports] == [
        ("step", 3, 0, 3 * ROWS), ("step", 6, 0, 6 * ROWS), ("pass", 7, 0, 7 * ROWS)]
    assert_values(rep.reports[0], expected(batches[:3]), 1e-12)
    assert_values(rep.reports[1], expected(batches[:6]), 1e-12)
    assert_values(rep.reports[2], expected(batches), 1e-12)


def test_threads_merge_to_the_values_of_all_batches_and_passes_reset():
    batches = make_batches(0, 9)
    rep = MetricsReporter(NAMES, BinaryTask(), threads=2, every_steps=4)
    trainer(2, [rep]).fit(ListSource(batches), ROWS, epochs=2, progress=False)
    kinds = [(r["kind"], r["step"]) for r in rep.reports]
    assert [k for k in kinds if k[0] == "step"] == [("step", 4), ("step", 8), ("step", 12), ("step", 16)]
    passes = [r for r in rep.reports if r["kind"] == "pass"]
    assert [p["pass"] for p in passes] == [0, 1]
    for p in passes:  # each pass alone: states were dropped after pass 0's report
        assert p["examples"] == 9 * ROWS
        assert_values(p, expected(batches), 1e-12)


def test_a_late_thread_does_not_repeat_or_skip_a_report():
    """Steps handed over out of order: a report waits for every step it covers, and the batch that
    completes them makes every report due, once each."""
    rep = MetricsReporter(["auc"], BinaryTask(), threads=2, every_steps=2)
    batch = make_batches(0, 1)[0]
    logits = torch.linspace(-2, 2, ROWS)
    rep.on_batch(1, 2, 0, batch, logits, 0.0)  # step 1 is still in thread 0: no report yet
    rep.on_batch(1, 4, 0, batch, logits, 0.0)
    assert rep.reports == []
    rep.on_batch(0, 1, 0, batch, logits, 0.0)  # steps 1..2 complete: report 2 (and step 4, handed over)
    rep.on_batch(0, 3, 0, batch, logits, 0.0)  # steps 1..4 complete: report 4
    assert [(r["step"], r["examples"]) for r in rep.reports] == [(2, 3 * ROWS), (4, 4 * ROWS)]


def test_a_step_report_after_a_pass_report_covers_the_next_pass():
    """Thread 1 ended pass 0 (and the pass report dropped its states) but has not trained a batch of
    pass 1 yet: the step report thread 0 makes in pass 1 covers pass 1, not the emptied pass 0
    (was: 'step metrics, step 4, pass 0, 0 examples: auc=nan')."""
    rep = MetricsReporter(["auc"], BinaryTask(), threads=2, every_steps=4)
    batch = make_batches(0, 1)[0]
    logits = torch.linspace(-2, 2, ROWS)
    rep.on_batch(0, 1, 0, batch, logits, 0.0)
    rep.on_batch(1, 2, 0, batch, logits, 0.0)
    rep.on_epoch_end(0, 0)
    rep.on_epoch_end(1, 0)  # pass 0 reported
    rep.on_batch(0, 3, 1, batch, logits, 0.0)
    rep.on_batch(0, 4, 1, batch, logits, 0.0)
    assert [(r["kind"], r["step"], r["pass"], r["examples"]) for r in rep.reports] == [
        ("pass", 2, 0, 2 * ROWS), ("step", 4, 1, 2 * ROWS)]


def test_no_report_of_zero_examples(caplog):
    """A pass without a batch is not reported (nor logged)."""
    rep = MetricsReporter(["auc"], BinaryTask(), threads=1, every_steps=1)
    with caplog.at_level(logging.INFO, logger="recps.metrics.reporter"):
        rep.on_epoch_end(0, 0)
    assert rep.reports == [] and "0 examples" not in caplog.text


def test_a_resumed_run_reports_on_the_steps_of_the_run_it_continues():
    """Resumed at step 10 with every_steps=4: reports at 12 (the pass's 2 steps so far) and 16, a pass
    report at 17, as the run it continues would have labelled them (issue 32.3: "step 400" held 100 steps)."""
    batches = make_batches(0, 7)
    rep = MetricsReporter(NAMES, BinaryTask(), threads=1, every_steps=4, step_base=10)
    trainer(1, [rep]).fit(ListSource(batches), ROWS, progress=False, first_epoch=1)
    assert [(r["kind"], r["step"], r["pass"], r["examples"]) for r in rep.reports] == [
        ("step", 12, 1, 2 * ROWS), ("step", 16, 1, 6 * ROWS), ("pass", 17, 1, 7 * ROWS)]
    assert_values(rep.reports[0], expected(batches[:2]), 1e-12)


class TwoHeads(nn.Module):
    """Two logit columns (B, 2) from fixed weights: click and conversion towers."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DENSE, 2)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(2, DENSE, generator=gen))
            self.linear.bias.zero_()

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.linear(dense)  # (B, 2)


def test_multi_task_metrics_per_task_column():
    from recps.tasks.multitask import MultiTask

    batches = make_batches(0, 5)
    for i, b in enumerate(batches):  # a second label column: conversions, rarer than clicks
        conv = (torch.rand(ROWS, generator=torch.Generator().manual_seed(i)) < 0.3).float() * b.labels[:, 0]
        b.labels = torch.stack([b.labels[:, 0], conv], dim=1)  # (B, 2)
    task = MultiTask(label_indices=(0, 1), label_names=("click", "conversion"))
    rep = MetricsReporter(["auc", "logloss"], task, threads=1, every_steps=0)
    model = TwoHeads()
    params = list(model.parameters())
    Trainer(model, nn.Identity(), task, LocalDenseUpdater(params, torch.optim.SGD(params, lr=0.0)),
            observers=[rep]).fit(ListSource(batches), ROWS, progress=False)
    (report,) = rep.reports
    assert report["examples"] == 5 * ROWS
    assert set(report) == {"kind", "step", "pass", "examples", "auc/click", "logloss/click", "auc/conversion",
                           "logloss/conversion"}
    with torch.no_grad():
        probs = torch.sigmoid(torch.cat([model(b.dense, b.sparse) for b in batches]))  # (N, 2)
    labels = torch.cat([b.labels for b in batches])  # (N, 2)
    for j, name in enumerate(["click", "conversion"]):
        want = MetricCollection(["auc", "logloss"])
        want.update(probs[:, j], labels[:, j])
        assert report[f"auc/{name}"] == pytest.approx(want.compute()["auc"], rel=1e-12)
        assert report[f"logloss/{name}"] == pytest.approx(want.compute()["logloss"], rel=1e-12)
    assert report["auc/click"] != pytest.approx(report["auc/conversion"], abs=1e-3)


def test_log_jsonl_and_undefined_values(tmp_path, caplog):
    batches = make_batches(0, 4)
    for b in batches:
        b.labels.fill_(1.0)  # one class: AUC is undefined
    rep = MetricsReporter(["auc", "logloss"], BinaryTask(), threads=1, every_steps=2, out_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger="recps.metrics.reporter"):
        trainer(1, [rep]).fit(ListSource(batches), ROWS, progress=False)
    lines = [json.loads(line) for line in (tmp_path / "train_metrics.jsonl").read_text().splitlines()]
    assert lines == rep.reports
    assert [(r["kind"], r["step"]) for r in lines] == [("step", 2), ("step", 4), ("pass", 4)]
    assert all(r["auc"] is None and math.isfinite(r["logloss"]) for r in lines)
    logged = [m for m in caplog.messages if "metrics, step" in m]
    assert len(logged) == 3 and "step metrics, step 2, pass 0, 64 examples: auc=nan logloss=" in logged[0]


def _has_tensorboard() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_tensorboard(), reason="tensorboard is not installed (pip install tensorboard)")
def test_tensorboard_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rep = MetricsReporter(["auc", "logloss"], BinaryTask(), threads=1, every_steps=2, out_dir=tmp_path, tensorboard=True)
    trainer(1, [rep]).fit(ListSource(make_batches(0, 5)), ROWS, progress=False)
    rep.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/auc")] == [2, 4]
    assert [e.value for e in events.Scalars("train/logloss")] == pytest.approx([r["logloss"] for r in rep.reports[:2]])
    assert [e.step for e in events.Scalars("pass/examples")] == [0]
    assert events.Scalars("pass/examples")[0].value == 5 * ROWS


@pytest.mark.skipif(_has_tensorboard(), reason="tensorboard is installed")
def test_tensorboard_missing_names_the_install(tmp_path):
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        MetricsReporter(["auc"], BinaryTask(), threads=1, out_dir=tmp_path, tensorboard=True)
    assert not (tmp_path / "tensorboard").exists()


def test_config_errors_and_off():
    with pytest.raises(ConfigError, match="gauc"):
        MetricsReporter(["auc", "gauc"], BinaryTask())
    with pytest.raises(ConfigError, match="every_steps=-1"):
        MetricsReporter(["auc"], BinaryTask(), every_steps=-1)
    cfg = OmegaConf.load(Path(__file__).resolve().parents[2] / "conf" / "metrics" / "default.yaml")
    check_metrics_config(cfg)
    assert build_reporter(OmegaConf.merge(cfg, {"enabled": False}), task=BinaryTask(), threads=1, out_dir=None) is None
    with pytest.raises(ConfigError, match="every_step"):
        check_metrics_config(OmegaConf.merge(cfg, {"every_step": 5}))
    with pytest.raises(ConfigError, match="merge='nccl'"):
        check_metrics_config(OmegaConf.merge(cfg, {"merge": "nccl"}))
    rep = build_reporter(cfg, task=BinaryTask(), threads=2, out_dir=None)
    assert rep.every_steps == cfg.every_steps and rep.threads == 2
    rep = MetricsReporter(["auc"], BinaryTask(), threads=1, every_steps=1)
    with pytest.raises(DataError, match=r"gives \(32, 3\) per batch.*set metrics=off"):
        rep.on_batch(0, 1, 0, make_batches(0, 1)[0], torch.zeros(ROWS, 3), 0.0)  # scores over 3 items: a ranking task


def test_cluster_refuses_gloo_merge_before_starting_anything(tmp_path):
    from hydra import compose, initialize_config_dir

    from recps.cluster.driver import run_distributed
    from recps.config import PROJECT_ROOT, register_resolvers

    register_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["ps=sync", "metrics.merge=gloo"])
    with pytest.raises(ConfigError, match="metrics.merge=gloo with ps=sync.*use metrics.merge=auto"):
        run_distributed(cfg, tmp_path)
    assert not list(tmp_path.iterdir())  # no process, no file


# ---- several workers ---------------------------------------------------------------------------

WORKER_BATCHES = (7, 11)  # uneven: worker 0 ends while worker 1 still makes step reports
EVERY = 2


def _gloo_worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=90))
    try:
        rep = MetricsReporter(NAMES, BinaryTask(), threads=2, every_steps=EVERY, merger=GlooMerger())
        trainer(2, [rep]).fit(ListSource(make_batches(rank, WORKER_BATCHES[rank])), ROWS, progress=False)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rep.reports))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_two_workers(reports: list[list[dict]]) -> None:
    want = expected(make_batches(0, WORKER_BATCHES[0]) + make_batches(1, WORKER_BATCHES[1]))
    for rank, reps in enumerate(reports):
        steps = [r["step"] for r in reps if r["kind"] == "step"]
        assert steps == list(range(EVERY, WORKER_BATCHES[rank] + 1, EVERY)), rank
        (last,) = [r for r in reps if r["kind"] == "pass"]
        assert last["examples"] == sum(WORKER_BATCHES) * ROWS
        assert_values(last, want, 1e-6)
    ended = [r for r in reports[1] if r["kind"] == "step" and r["step"] > WORKER_BATCHES[0] // EVERY * EVERY]
    assert ended  # worker 1's reports made after worker 0 ended hold all of worker 0's data
    for r in ended:  # (and at least the batches of its steps but one still in another thread)
        assert (WORKER_BATCHES[0] + r["step"] - 1) * ROWS <= r["examples"] <= sum(WORKER_BATCHES) * ROWS


@pytest.mark.e2e
def test_gloo_two_workers_two_threads_uneven_steps(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[__name__.count(".")]))
    ctx = mp.start_processes(_gloo_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 240
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail("gloo reporter workers did not finish within 240 s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    _check_two_workers([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)])


def test_parameter_server_two_workers_uneven_steps():
    from recps.metrics.ps_merger import PSMerger

    reports: list[list[dict]] = [[], []]

    def work(rank: int, client) -> None:
        rep = MetricsReporter(NAMES, BinaryTask(), threads=1, every_steps=EVERY, merger=PSMerger(client))
        trainer(1, [rep]).fit(ListSource(make_batches(rank, WORKER_BATCHES[rank])), ROWS, progress=False)
        reports[rank] = rep.reports

    servers_and_workers(work)
    _check_two_workers(reports)
