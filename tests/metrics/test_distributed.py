"""allreduce_metrics over a real gloo group: 2 processes x 2 threads' partial states each.

Rank 0's merged values must equal the single-process values on the union of the data, with
pickle refused in both processes (torch.distributed's object collectives unpickle what a peer
sent: issue 15 point 5); also when one rank holds no example, and collections that differ
between ranks fail on every rank naming them instead of mixing columns.
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


def _no_pickle(*args, **kwargs):
    raise RuntimeError("pickle used by a collective (torch.distributed's object collectives)")


def _worker(rank, port, out_dir):
    from torch.distributed import distributed_c10d

    # all_gather_object, broadcast_object_list, ... pickle through these two: refuse them here.
    distributed_c10d._pickler = distributed_c10d._unpickler = _no_pickle
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    out = {}
    try:
        threads = [(MetricCollection(CTR), MetricCollection(RETRIEVAL)) for _ in range(THREADS)]
        for t, (ctr, ret) in enumerate(threads):  # batch i -> rank i % 2, thread (i // 2) % 2
            _feed(ctr, ret, [i for i in range(BATCHES) if i % WORLD == rank and (i // WORLD) % THREADS == t])
        local_ctr = merge_states([c for c, _ in threads])
        local_ret = merge_states([r for _, r in threads])
        before = local_ctr.compute()
        merged = {**allreduce_metrics(local_ctr).compute(), **allreduce_metrics(local_ret).compute()}
        assert local_ctr.compute() == before  # the local part is left as it was
        out.update(merged=merged, local_auc=before["auc"])

        # Every example on rank 0: rank 1's grouped columns are empty (the words are padded).
        ctr, ret = MetricCollection(CTR), MetricCollection(RETRIEVAL)
        _feed(ctr, ret, range(BATCHES) if rank == 0 else [])
        out["one_rank"] = {**allreduce_metrics(ctr).compute(), **allreduce_metrics(ret).compute()}

        # Rank 1 built other grouped metrics: both ranks refuse, neither waits forever.
        other = MetricCollection(["gauc", "pnr"] if rank == 0 else ["pnr", "gauc"])
        _feed(other, MetricCollection(RETRIEVAL), [rank])
        try:
            allreduce_metrics(other)
            out["mismatch"] = None
        except ConfigError as e:
            out["mismatch"] = str(e)
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    """What each of the 2 gloo ranks wrote (see _worker), and the single-process values."""
    out_dir = tmp_path_factory.mktemp("gloo")
    mp_path = str(Path(__file__).resolve().parents[__name__.count(".")])
    # Spawned children unpickle _worker by module name (pytest's importlib mode names this
    # module from the rootdir); put that root on the sys.path they inherit, whatever the cwd.
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.syspath_prepend(mp_path)
        ctx = mp.start_processes(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + 180
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    pytest.fail("gloo metric workers did not finish within 180 s")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    ctr, ret = MetricCollection(CTR), MetricCollection(RETRIEVAL)
    _feed(ctr, ret, range(BATCHES))
    return results, {**ctr.compute(), **ret.compute()}


def _same(merged: dict, single: dict) -> None:
    assert set(merged) == set(single)
    for name, value in single.items():
        assert math.isfinite(value)
        assert merged[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name


@pytest.mark.e2e
def test_two_workers_two_threads_merge_equals_single_process_without_pickle(gloo_results):
    results, single = gloo_results
    _same(results[0]["merged"], single)
    assert results[1]["merged"] == results[0]["merged"]  # every rank agrees
    assert results[0]["local_auc"] != pytest.approx(single["auc"], abs=1e-9)  # a real merge happened


@pytest.mark.e2e
def test_a_rank_without_examples_merges_to_the_other_ranks_values(gloo_results):
    results, single = gloo_results
    for r in range(WORLD):
        _same(results[r]["one_rank"], single)


@pytest.mark.e2e
def test_ranks_with_other_grouped_metrics_fail_on_every_rank(gloo_results):
    results, _ = gloo_results
    assert "allreduce_metrics: ranks [1] hold other grouped metrics than rank 0" in results[0]["mismatch"]
    assert "ranks [0] hold other grouped metrics than rank 1" in results[1]["mismatch"]
    assert "build every rank's collection from the same metric names" in results[0]["mismatch"]


def test_allreduce_needs_a_process_group():
    with pytest.raises(ConfigError, match="torch.distributed is not initialized"):
        allreduce_metrics(MetricCollection(["auc"]))
