"""GAUC and PNR in any run: training-time global values merged over workers through the
parameter servers (recps.metrics.ps_merger), group ids from a sparse feature
(recps.metrics.groups), and in evaluation.

Equality is exact (==, not approx): the merged columns are the union's rows, bit for bit,
and GAUC/PNR are sort-based, so two workers' merged value is the single process's value
on the same predictions. The CLI test (`python -m recps.train ps=async cluster.workers=2
metrics=grouped`) takes "the same predictions" from both workers' debug dumps.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recps.data.batch import Batch
from recps.errors import ConfigError, DataError
from recps.metrics import MetricCollection
from recps.metrics.groups import batch_groups, evaluate_pointwise
from recps.metrics.reporter import MetricsReporter, build_reporter
from recps.tasks import BinaryTask
from recps.job.loop import LocalDenseUpdater, Trainer
from tests.helpers.cluster import servers_and_workers
from tests.helpers.cli import recps_train

DENSE, ROWS, USERS = 4, 16, 11
GROUPED = ["auc", "gauc", "pnr"]


def make_batches(worker: int, count: int) -> list[Batch]:
    """Batches with a `user` feature (1 in 8 examples has none) and an `item` sequence."""
    gen = torch.Generator().manual_seed(500 + worker)
    out = []
    for _ in range(count):
        dense = torch.randn(ROWS, DENSE, generator=gen)  # (B, I)
        labels = (torch.rand(ROWS, generator=gen) < torch.sigmoid(dense[:, 0])).float()  # (B,)
        users = torch.randint(0, USERS, (ROWS,), generator=gen) * 1_000_003 + 2**40  # (B,) big int64 ids
        has = torch.rand(ROWS, generator=gen) >= 0.125  # (B,)
        user_len = has.to(torch.int64)
        item_len = torch.full((ROWS,), 2, dtype=torch.int64)
        values = torch.cat([users[has], torch.arange(2 * ROWS)])
        sparse = KeyedJaggedTensor.from_lengths_sync(keys=["user", "item"], values=values,
                                                     lengths=torch.cat([user_len, item_len]))
        out.append(Batch(dense=dense, sparse=sparse, labels=labels[:, None]))
    return out


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DENSE, 1)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(1, DENSE, generator=gen))
            self.linear.bias.copy_(torch.randn(1, generator=gen))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.linear(dense).squeeze(1)  # (B,)


class ListSource:
    def __init__(self, batches: list[Batch]) -> None:
        self.all = batches

    def batches(self, batch_size, shard_index, num_shards, epoch):
        return iter(self.all[shard_index::num_shards])


def fit(batches: list[Batch], threads: int, rep: MetricsReporter) -> None:
    model = Tiny()
    params = list(model.parameters())
    trainer = Trainer(model, nn.Identity(), BinaryTask(), LocalDenseUpdater(params, torch.optim.SGD(params, lr=0.0)),
                      threads=threads, observers=[rep])
    trainer.fit(ListSource(batches), ROWS, progress=False)


def single_process(batches: list[Batch]) -> dict[str, float]:
    """One collection over every example: gauc/pnr on the rows that have a user."""
    model, ref = Tiny(), MetricCollection(GROUPED)
    additive = MetricCollection(["auc"])
    with torch.no_grad():
        for b in batches:
            p = torch.sigmoid(model(b.dense, b.sparse))
            ids, has = batch_groups(b, "user")
            ref.update(p[has], b.labels[has, 0], ids[has])
            additive.update(p, b.labels[:, 0])
    return {**ref.compute(), "auc": additive.compute()["auc"]}


def test_batch_groups_reads_one_key_per_example_and_names_a_missing_feature():
    (b,) = make_batches(0, 1)
    ids, has = batch_groups(b, "user")
    assert ids.dtype == torch.int64 and ids.shape == has.shape == (ROWS,)
    assert (ids[has] >= 2**40).all() and (ids[~has] == 0).all() and 0 < int(has.sum()) < ROWS
    with pytest.raises(DataError, match=r"group_key='query' is not a sparse feature of this data \(it has \['user', 'item'\]\)"):
        batch_groups(b, "query")
    with pytest.raises(DataError, match="group_key='item' holds up to 2 keys per example"):
        batch_groups(b, "item")


def test_config_errors_name_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=r"\['gauc'\] group examples by user or query; set metrics.group_key"):
        MetricsReporter(["auc", "gauc"], BinaryTask())
    cfg = {"_target_": "recps.metrics.reporter.MetricsReporter", "metrics": {"pnr": None}, "group_key": "user",
           "merge": "local"}
    with pytest.raises(ConfigError, match=r"metrics.group_key='user' is not a sparse feature of this data \(it has \['C1', 'C2'\]\)"):
        build_reporter(cfg, task=BinaryTask(), threads=1, out_dir=None, feature_names=["C1", "C2"])
    assert build_reporter(cfg, task=BinaryTask(), threads=1, out_dir=None, feature_names=["user"]).group_key == "user"


def test_evaluation_metrics_are_checked_before_training():
    from recps.metrics.groups import check_evaluation_groups

    check_evaluation_groups(["auc", "recall@20", "wordsim353_spearman"], {"group_key": None}, ["C1"])  # none grouped
    with pytest.raises(ConfigError, match=r"\['task.metrics gauc'\] group examples by user or query; set metrics.group_key"):
        check_evaluation_groups(["auc", "gauc"], {"group_key": None}, ["C1"])
    with pytest.raises(ConfigError, match=r"metrics.group_key='user' is not a sparse feature of this data \(it has \['C1'\]\)"):
        check_evaluation_groups(["pnr"], {"group_key": "user"}, ["C1"])
    check_evaluation_groups(["pnr"], {"group_key": "C1"}, ["C1"])


def test_one_worker_two_threads_equals_one_collection():
    batches = make_batches(0, 9)
    rep = MetricsReporter(GROUPED, BinaryTask(), threads=2, every_steps=4, group_key="user")
    fit(batches, 2, rep)
    (last,) = [r for r in rep.reports if r["kind"] == "pass"]
    want = single_process(batches)
    assert last["examples"] == 9 * ROWS
    assert (last["gauc"], last["pnr"]) == (want["gauc"], want["pnr"])
    assert 0.0 < want["gauc"] < 1.0 and 0.0 < want["pnr"] < math.inf


def test_evaluation_groups_by_the_feature_and_skips_examples_without_one():
    batches = make_batches(3, 5)
    model = Tiny()
    with torch.no_grad():
        probs = torch.cat([torch.sigmoid(model(b.dense, b.sparse)) for b in batches])
    targets = torch.cat([b.labels[:, 0] for b in batches])
    got = evaluate_pointwise(["auc", "logloss", "gauc", "pnr"], probs, targets, ListSource(batches), ROWS, "user")
    want = single_process(batches)
    assert (got["gauc"], got["pnr"], got["auc"]) == (want["gauc"], want["pnr"], want["auc"])
    assert evaluate_pointwise(["auc"], probs, targets) == {"auc": want["auc"]}
    with pytest.raises(ConfigError, match="set metrics.group_key"):
        evaluate_pointwise(["gauc"], probs, targets, ListSource(batches), ROWS, None)


def test_ps_merger_carries_columns_bit_for_bit_in_chunks():
    """Uneven parts (one empty in the second merge), several chunks each, extreme values."""
    from recps.metrics.ps_merger import PSMerger

    sizes = [(37, 5), (0, 9)]  # rows per worker in merge 1, merge 2

    def part(rank: int, n: int) -> dict[str, torch.Tensor]:
        g = torch.randint(0, 4, (n,), generator=torch.Generator().manual_seed(rank * 100 + n)) * 2**61 - 2**62
        p = torch.randn(n, generator=torch.Generator().manual_seed(rank * 100 + n + 1), dtype=torch.float64)
        if n:
            g[0], p[0] = -2**63, 1e-310  # the smallest id; a subnormal pred
        y = (torch.rand(n, generator=torch.Generator().manual_seed(rank * 100 + n + 2)) < 0.4).to(torch.float64)
        return {"groups": g, "preds": p, "labels": y}

    merged: dict[int, list[dict]] = {0: [], 1: []}

    def work(rank: int, client) -> None:
        merger = PSMerger(client, chunk_words=16)  # 37 rows x 3 columns x 2 metrics: 15 chunk rounds
        for m in range(2):
            coll = MetricCollection(["gauc", "pnr", "logloss"])
            cols = part(rank, sizes[m][rank])
            for name in ("gauc", "pnr"):
                coll[name].load_state(cols)
            out = merger.merge(coll)
            merged[rank].append({"state": out.grouped_state(), "values": out.compute()})

    servers_and_workers(work)
    for m in range(2):
        union = {k: torch.cat([part(0, sizes[m][0])[k], part(1, sizes[m][1])[k]]) for k in ("groups", "preds", "labels")}
        ref = MetricCollection(["gauc", "pnr"])
        for name in ("gauc", "pnr"):
            ref[name].load_state(union)
        for rank in range(2):
            for name in ("gauc", "pnr"):
                got = merged[rank][m]["state"][name]
                for k, v in union.items():
                    assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.int64), v.view(torch.int64)), (m, rank, name, k)
            values, want = merged[rank][m]["values"], ref.compute()
            assert (values["gauc"], values["pnr"]) == (want["gauc"], want["pnr"])
        assert 0.0 < want["gauc"] < 1.0 and 0.0 < want["pnr"] < math.inf or m == 1  # 9 rows: 1 two-class group


@pytest.mark.slow  # a whole job trained end to end: e2e, not in make test-fast
def test_reporter_through_the_servers_equals_the_single_process_value():
    """Two workers x 2 threads, uneven steps: every report of both workers, GAUC and PNR exact."""
    from recps.metrics.ps_merger import PSMerger

    counts = [7, 12]
    reports: list[list[dict]] = [[], []]

    def work(rank: int, client) -> None:
        rep = MetricsReporter(GROUPED, BinaryTask(), threads=2, every_steps=3, group_key="user",
                              merger=PSMerger(client, chunk_words=64))
        fit(make_batches(rank, counts[rank]), 2, rep)
        reports[rank] = rep.reports

    servers_and_workers(work)
    want = single_process(make_batches(0, counts[0]) + make_batches(1, counts[1]))
    for rank in range(2):
        (last,) = [r for r in reports[rank] if r["kind"] == "pass"]
        assert last["examples"] == sum(counts) * ROWS
        assert (last["gauc"], last["pnr"]) == (want["gauc"], want["pnr"]), rank
        assert last["auc"] == pytest.approx(want["auc"], abs=1e-3)  # bucketed AUC
    steps = [r for r in reports[0] if r["kind"] == "step"]
    assert steps and [r["gauc"] for r in steps] == [r["gauc"] for r in reports[1] if r["kind"] == "step"][: len(steps)]


# ---- the real CLI: ps=async, 2 workers, metrics=grouped ------------------------------------------

CLI_ROWS, CLI_BATCH = 1600, 64


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_two_async_workers_gauc_pnr_equal_the_single_process_value_on_their_predictions(tmp_path):
    from recps.debug import dump_files, read_index, read_record

    out = tmp_path / "run"
    args = [
        "ps=async", "cluster.workers=2", "trainer.threads=1", f"trainer.batch_size={CLI_BATCH}", "model=ctr_dnn",
        "model.hidden=[16,8]", f"dataset.generate.train_rows={CLI_ROWS}", "dataset.generate.test_rows=400",
        "dataset.generate.vocab=50", f"dataset.dir={tmp_path / 'data'}", "metrics=grouped", "metrics.every_steps=0",
        "task.metrics=[auc,gauc,pnr]", "debug=dump", "debug.fields=[keys,labels,predictions]", "debug.params=[]",
        "debug.param_grads=false", "checkpoint.save=false", "progress=false", f"hydra.run.dir={out}",
    ]
    metrics = recps_train(*args, timeout=400).metrics()
    assert (metrics["workers"], metrics["ps"]) == (2, "async")
    (report,) = [r for r in metrics["train_metrics"] if r["kind"] == "pass"]

    # The same predictions, from both workers' dumps: C1 (the first feature) is the group.
    ref = MetricCollection(["gauc", "pnr"])
    rows = 0
    for (role, rank, thread), idx in dump_files(out).items():
        data = np.fromfile(idx.with_suffix(".bin"), dtype=np.uint8)
        recs: dict[int, dict[str, np.ndarray]] = {}
        for r in read_index(idx):
            recs.setdefault(r.step, {})[r.name] = read_record(data, r)
        for step in sorted(recs):
            rec = recs[step]
            b = rec["predictions"].shape[0]
            c1_len = torch.from_numpy(rec["keys.lengths"][:b].astype(np.int64))  # (B,) C1 keys per example
            has = c1_len == 1
            ids = torch.zeros(b, dtype=torch.int64)
            ids[has] = torch.from_numpy(rec["keys.values"][: int(c1_len.sum())].astype(np.int64))
            p = torch.from_numpy(rec["predictions"].astype(np.float64))
            ref.update(p[has], torch.from_numpy(rec["labels"][:, 0].astype(np.float64))[has], ids[has])
            rows += b
    assert rows == report["examples"] == CLI_ROWS
    want = ref.compute()
    assert (report["gauc"], report["pnr"]) == (want["gauc"], want["pnr"])
    assert 0.0 < want["gauc"] < 1.0 and 0.0 < want["pnr"] < math.inf  # defined (one pass of 1,600 rows: barely trained)
    # Evaluation (worker 0, the held-out split): the same metrics, grouped by C1 too.
    assert 0.0 < metrics["gauc"] < 1.0 and metrics["pnr"] > 0.0


def test_funnel_tally_merges_through_the_servers_to_the_union():
    """recps.metrics.funnel: two workers' tallies (their users' pairs) sum on the servers."""
    from recps.metrics.funnel import FunnelTally, hit_rate, merge_tally, ranker_counts, recall_at_k
    from recps.metrics.ps_merger import PSMerger

    lists = torch.tensor([[4, 7, 1, 5], [2, 9, 3, 8], [6, 1, -1, -1]])  # (U, K)
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.8], [0.3, 0.2, 0.5, 0.1], [0.0, 0.0, 9.0, 9.0]])
    offsets, items = torch.tensor([0, 2, 3, 3]), torch.tensor([7, 5, 3])
    names = ["recall@2", "hr@2", "gauc", "pnr"]
    shards = [slice(0, 1), slice(1, 3)]  # worker 0: user 0; worker 1: users 1, 2

    def tally(rows: slice) -> FunnelTally:
        t = FunnelTally(names)
        o = offsets[rows.start:rows.stop + 1]
        t.add(recall_at_k(lists[rows], o, items, 2))
        t.add(hit_rate(lists[rows], o, items, 2))
        t.add(ranker_counts(lists[rows], scores[rows], o, items))
        return t

    got: dict[int, dict] = {}

    def work(rank: int, client) -> None:
        got[rank] = merge_tally(tally(shards[rank]), PSMerger(client)).details()

    servers_and_workers(work)
    want = tally(slice(0, 3)).details()
    assert got[0] == got[1] == want


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_stream_two_workers_evaluates_each_pass_with_gauc_and_pnr(tmp_path):
    """stream=hourly, ps=async, 2 workers, metrics=grouped: every pass's evaluation (each worker its
    rows, merged through the servers) and every pass's training report carry GAUC and PNR."""
    from recps.data.generators.drifting import write_stream

    root, out, run = tmp_path / "clicks", tmp_path / "model", tmp_path / "run"
    write_stream(str(root), days=1, hours=2, rows=1500, start_day="20261201")
    args = ["stream=hourly", f"stream.root={root}", f"stream.out={out}",
           "ps=async", "model=ctr_dnn", "model.hidden=[16,8]", "cluster.workers=2", "trainer.threads=1",
           "trainer.batch_size=128", "stream.start_day=20261201", "stream.end_day=20261201", "stream.hours=2",
           "stream.data_sleep_second=0.2", "metrics=grouped", "metrics.every_steps=0", "cluster.restarts=0",
           f"hydra.run.dir={run}"]
    metrics = recps_train(*args, timeout=420).metrics()
    passes = [p for p in metrics["stream"]["passes"] if "pass" in p]
    assert [p["pass"] for p in passes] == [1, 2]
    for p in passes:
        assert 0.0 < p["eval"]["gauc"] < 1.0 and 0.0 < p["eval"]["pnr"] < math.inf, p["eval"]
        assert p["eval"]["examples"] == 1500
