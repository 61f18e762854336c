"""The debug dump says how much it will write before it writes it (issue 18 point 9), and its
limits (debug.every_steps, debug.params) write less, in dumps the diff still reads.

Batches of one size throughout (4,096 rows, 2 threads x 8 batches of 256): every dumped step writes
the same records, so the estimate logged after the first step is held to 0.5% of the bytes the
run leaves in dump/ (.bin and .idx; the index lines' numbers are estimated at their widest).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from recps.config import PROJECT_ROOT, register_resolvers
from recps.debug import DebugDump, build_dump, diff_runs, dump_files, read_index
from recps.debug import dump as dump_module
from recps.job.build import build_job
from recps.job.loop import dense_parameters
from tests.helpers.cli import run_module

ROWS, BATCH, THREADS = 4096, 256, 2
STEPS = ROWS // BATCH  # 16 over both threads
SIZED = [
    "ps=local", f"dataset.generate.train_rows={ROWS}", "dataset.generate.test_rows=500", "dataset.generate.vocab=1000",
    "ps.num_embeddings=1000", "model.hidden=[16,16]", f"trainer.batch_size={BATCH}", f"trainer.threads={THREADS}",
    "progress=false", "checkpoint.save=false", "metrics=off",
    "debug=dump", "debug.modules=[over_arch]", "debug.fields=[keys,dense,labels,logits,predictions,loss]",
]
TOLERANCE = 0.005
_UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}


def config(*overrides: str):
    register_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=[*SIZED, *overrides])


class Estimates(logging.Handler):
    """The dump's estimate lines, with the dump folder's size at the moment each was logged."""

    def __init__(self, folder: Path) -> None:
        super().__init__(logging.INFO)
        self.folder, self.seen = folder, []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "debug dump: " in message:
            self.seen.append((record.levelno, message, folder_bytes(self.folder)))


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir()) if folder.is_dir() else 0


def logged_bytes(message: str, label: str) -> float:
    """`73.34 MB` after `label` in an estimate line, in bytes."""
    m = re.search(rf"{label}(\d+(?:\.\d+)?) (B|kB|MB|GB)", message)
    assert m, (label, message)
    return float(m[1]) * _UNITS[m[2]]


def train(tmp_path: Path, *overrides: str) -> tuple[DebugDump, list, object]:
    """One fit with the dump `overrides` configure: (dump, its estimate log lines, the job)."""
    cfg = config(*overrides)
    job = build_job(cfg)
    dump = build_dump(cfg.debug, tmp_path, task=job.task, collection=job.collection)
    handler = Estimates(tmp_path / "dump")
    logger = logging.getLogger(dump_module.__name__)
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    try:
        job.trainer.observers = [dump]
        stats = job.trainer.fit(job.data.train, BATCH, progress=False)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
        dump.close()
    assert stats.steps == STEPS
    return dump, handler.seen, job


def test_the_estimate_is_logged_at_the_start_and_is_what_the_run_writes(tmp_path):
    dump, seen, job = train(tmp_path)
    ((level, message, written_then),) = seen
    est = dump.estimate
    # Computed, not measured: the dense parameters' bytes (values, then gradients) from the model ...
    params = sum(p.numel() * p.element_size() for _, p in dense_parameters(job.model, job.collection))
    assert est.param_bytes == est.grad_bytes == params
    # ... plus the step's other records, times the steps the plan selects (all 16 here).
    assert (est.planned, est.steps) == (STEPS, STEPS)
    assert est.total_bytes == STEPS * (est.step_bytes + est.index_bytes)
    written = folder_bytes(tmp_path / "dump")
    assert abs(est.total_bytes - written) <= TOLERANCE * written, (est, written)
    # Logged before the disk holds more than one step (the line is the user's chance to stop it).
    assert written_then <= est.step_bytes + est.index_bytes + 1000
    assert level == logging.INFO  # a few MB: no warning
    assert logged_bytes(message, "debug dump: ") == pytest.approx(est.total_bytes, rel=0.01)
    assert f"{STEPS} of the {STEPS} planned steps" in message
    assert logged_bytes(message, "dense parameters ") == pytest.approx(params, rel=0.01)
    assert "debug.every_steps=N" in message and "debug.params=[glob,...]" in message


def test_every_steps_and_params_write_less_and_the_estimate_follows(tmp_path):
    full, _, _ = train(tmp_path / "full")
    dump, ((_, message, _),), _ = train(tmp_path / "limited", "debug.every_steps=5", "debug.params=[over_arch.0.*]")
    est = dump.estimate
    written = folder_bytes(tmp_path / "limited" / "dump")
    assert abs(est.total_bytes - written) <= TOLERANCE * written, (est, written)
    assert f"4 of the {STEPS} planned steps" in message  # steps 1, 6, 11, 16
    assert written < full.estimate.total_bytes / 4  # the limits limit the disk, not only the log line
    recs = [r for idx in dump_files(tmp_path / "limited").values() for r in read_index(idx)]
    assert sorted({r.step for r in recs}) == [1, 6, 11, 16]
    assert {r.name for r in recs if r.name.startswith(("param/", "grad/"))} == {
        "param/over_arch.0.weight", "param/over_arch.0.bias", "grad/over_arch.0.weight", "grad/over_arch.0.bias"}


@pytest.mark.e2e
def test_the_diff_reads_limited_dumps(tmp_path):
    """One thread (reproducible), steps 1, 4, 7, ..., one layer's parameters: two equal runs do not
    diverge; a run with another learning rate diverges at step 1's first selected parameter."""
    limits = ["trainer.threads=1", "debug.every_steps=3", "debug.params=[over_arch.0.*]"]
    runs = {}
    for name, extra in (("a", []), ("b", []), ("lr", ["optimizer.lr=0.01"])):
        cfg = config(*limits, *extra)
        job = build_job(cfg)
        dump = build_dump(cfg.debug, tmp_path / name, task=job.task, collection=job.collection)
        job.trainer.observers = [dump]
        job.trainer.fit(job.data.train, BATCH, progress=False)
        dump.close()
        runs[name] = tmp_path / name
        steps = sorted({r.step for idx in dump_files(runs[name]).values() for r in read_index(idx)})
        assert steps == list(range(1, STEPS + 1, 3))
    same = diff_runs(runs["a"], runs["b"])
    assert same.divergence is None and same.records > 0
    proc = run_module("recps.debug", "diff", str(runs["a"]), str(runs["lr"]), timeout=120, check=1)
    assert proc.stdout.startswith("first divergence: step 1 (batch 1), worker 0, thread 0, param/over_arch.0.bias "), proc.stdout


def test_a_large_dump_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(dump_module, "WARN_BYTES", 1 << 20)  # the default run's 1.4 GB, scaled to this one
    dump, ((level, message, _),), _ = train(tmp_path)
    assert dump.estimate.total_bytes > 1 << 20 and level == logging.WARNING, message


@pytest.mark.parametrize("every,start,end", [(1, 1, 0), (3, 1, 0), (5, 2, 17), (4, 10, 0), (7, 0, 6), (2, 30, 0)])
def test_selected_steps_counts_the_steps_selected(tmp_path, every, start, end):
    dump = DebugDump(tmp_path, fields=["loss"], every_steps=every, start_step=start, end_step=end)
    for first, last in ((1, 40), (13, 29), (5, 4), (1, 1)):
        assert dump.selected_steps(first, last) == sum(dump._selected(s) for s in range(first, last + 1))
