"""Start-up of a PS run (issue 17.4): the cluster's processes are forked from the launcher's preloaded
image (recps.launch), and each worker parses only its own training rows (recps.data.dataset).

The figures are benchmarks/startup_bench.py's (benchmarks/RESULTS.md, "Start-up"); these tests pin
what must not change with them: the batches every thread trains on, and a run's numbers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recps.data.dataset import LazyExamplesSource, WorkerExamplesSource, prepare_data
from recps.data.sharding import WorkerShards
from recps.data.generators.ctr import ensure_split
from tests.helpers.cli import CliRun, recps_train

pytestmark = pytest.mark.timeout(300)


def _dataset(tmp_path: Path, train_rows: int = 1003, test_rows: int = 101) -> dict:
    ensure_split(tmp_path, train_rows, test_rows, seed=0, vocab=500)
    return {"name": "tiny", "schema": {"format": "criteo"}, "train": [str(tmp_path / "train.txt")],
            "test": [str(tmp_path / "test.txt")], "test_fraction": 0.0, "error_budget": 0.001}


def _batches(source, worker: int, workers: int, thread: int, threads: int, epoch: int):
    return list(WorkerShards(source, worker, workers).batches(64, thread, threads, epoch))


@pytest.mark.parametrize("workers, threads", [(2, 2), (3, 2), (2, 1)])
def test_a_workers_own_rows_give_its_threads_the_same_batches(tmp_path, workers, threads):
    """Every thread of every worker trains the same batches, in the same shuffled order, whether its
    worker parsed every row or only its own (1003 rows: the last round of shards is incomplete)."""
    cfg = _dataset(tmp_path)
    everything = prepare_data(cfg, seed=7)
    seen = 0
    for w in range(workers):
        mine = prepare_data(cfg, seed=7, worker=(w, workers, threads), test=w == 0)
        assert isinstance(mine.train, WorkerExamplesSource)
        assert len(mine.train) == len(everything.train) == 1003  # the shard plans count every row
        seen += len(mine.train.examples)
        assert isinstance(mine.test, LazyExamplesSource) == (w == 0)  # worker 0 reads them when it evaluates
        assert len(mine.test) == (101 if w == 0 else 0)
        if w == 0:
            assert torch.equal(mine.test.examples.keys, everything.test.examples.keys)
        for t in range(threads):
            for epoch in (0, 1):
                want = _batches(everything.train, w, workers, t, threads, epoch)
                got = _batches(mine.train, w, workers, t, threads, epoch)
                assert len(got) == len(want) > 0
                for a, b in zip(got, want):
                    assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
                    assert torch.equal(a.sparse.values(), b.sparse.values())
                    assert torch.equal(a.sparse.lengths(), b.sparse.lengths())
    assert seen == 1003  # each row parsed by exactly one worker
    with pytest.raises(Exception, match="holds worker 0 of 2's rows only"):
        next(prepare_data(cfg, seed=7, worker=(0, 2, 2)).train.batches(64, 2, 4, 0))


def _train(tmp_path: Path, name: str, env: dict[str, str]) -> tuple[CliRun, dict]:
    run = recps_train("ps=sync", "cluster.workers=2", "trainer.threads=1", "progress=false",
                      "checkpoint.save=false", "trainer.max_steps=6", "metrics.enabled=false", f"dataset.dir={tmp_path / 'data'}",
                      "dataset.generate.train_rows=3000", "dataset.generate.test_rows=500", "dataset.generate.vocab=100",
                      f"hydra.run.dir={tmp_path / name}", env=env, timeout=240)
    return run, run.metrics()


@pytest.mark.e2e
def test_forked_and_execd_clusters_train_the_same(tmp_path):
    """The cluster forked from the launcher's image trains what one of exec'd processes trains (ps=sync,
    one thread per worker: deterministic), and its processes start at their role (no imports)."""
    forked, a = _train(tmp_path, "forked", {})
    execd, b = _train(tmp_path, "exec", {"RECPS_LAUNCH_FORK": "0"})
    for name in ("server0", "worker0", "worker1"):
        assert f"started {name} (pid " in forked.stdout
    assert forked.stdout.count(") forked from this image") == 3, forked.stdout
    assert "forked from this image" not in execd.stdout
    assert "worker 0's" in (tmp_path / "forked" / "cluster.log").read_text()  # it parsed its own rows
    for key in ("auc", "logloss", "train_loss", "first_losses", "train_steps", "train_examples"):
        assert a[key] == b[key], (key, a[key], b[key])
