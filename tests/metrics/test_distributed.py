"""allreduce_metrics over a real gloo group: 2 processes x 2 threads' partial states each.

Rank 0's merged values must equal the single-process values on the union of the data.
"""

import datetime
import json
import math
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recps.errors import ConfigError
from recps.metrics import MetricCollection, allreduce_metrics, merge_states

CTR = ["auc", "gauc", "pnr", "logloss", "accuracy", "mae", "rmse", "actual_ctr", "predicted_ctr", "copc", "calibration"]
RETRIEVAL = ["recall@5", "ndcg@5", "mrr"]
WORLD, THREADS, BATCHES = 2, 2, 12


def _batch(i):
    """Batch i of the global data, the same in every process."""
    rng = np.random.default_rng(1000 + i)
    y = (rng.random(300) < 0.25).astype(np.float32)
    p = (1 / (1 + np.exp(-(rng.normal(size=300) + 1.5 * y - 1.0)))).astype(np.float32)
    g = rng.integers(0, 50, size=300)  # every user shows up on both ranks
    scores = rng.random((64, 20))
    targets = rng.integers(0, 20, size=64)
    return torch.from_numpy(p), torch.from_numpy(y), torch.from_numpy(g), torch.from_numpy(scores), torch.from_numpy(targets)


def _feed(ctr, ret, batches):
    for i in batches:
        p, y, g, scores, targets = _batch(i)
        ctr.update(p, y, groups=g)
        ret.update(scores, targets)


def _worker(rank, port, out_dir):
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        threads = [(MetricCollection(CTR), MetricCollection(RETRIEVAL)) for _ in range(THREADS)]
        for t, (ctr, ret) in enumerate(threads):  # batch i -> rank i % 2, thread (i // 2) % 2
            _feed(ctr, ret, [i for i in range(BATCHES) if i % WORLD == rank and (i // WORLD) % THREADS == t])
        local_ctr = merge_states([c for c, _ in threads])
        local_ret = merge_states([r for _, r in threads])
        before = local_ctr.compute()
        merged = {**allreduce_metrics(local_ctr).compute(), **allreduce_metrics(local_ret).compute()}
        assert local_ctr.compute() == before  # the local part is left as it was
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump({"merged": merged, "local_auc": before["auc"]}, f)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_workers_two_threads_merge_equals_single_process(tmp_path, monkeypatch):
    # Spawned children unpickle _worker by module name (pytest's importlib mode names this
    # module from the rootdir); put that root on the sys.path they inherit, whatever the cwd.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[__name__.count(".")]))
    ctx = mp.start_processes(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail("gloo metric workers did not finish within 180 s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]

    ctr, ret = MetricCollection(CTR), MetricCollection(RETRIEVAL)
    _feed(ctr, ret, range(BATCHES))
    single = {**ctr.compute(), **ret.compute()}
    assert set(results[0]["merged"]) == set(single)
    for name, value in single.items():
        assert math.isfinite(value)
        assert results[0]["merged"][name] == pytest.approx(value, rel=1e-6, abs=1e-6), name
        assert results[1]["merged"][name] == results[0]["merged"][name]  # every rank agrees
    assert results[0]["local_auc"] != pytest.approx(single["auc"], abs=1e-9)  # a real merge happened


def test_allreduce_needs_a_process_group():
    with pytest.raises(ConfigError, match="torch.distributed is not initialized"):
        allreduce_metrics(MetricCollection(["auc"]))
