"""The disk tier of a sparse table (issue 31): a table with `memory_budget=` holds the same rows as
the all-RAM table, bit for bit, whatever tier each row is in.

Budget 10^3 rows over 10^5 keys (most rows live on disk, nearly every request promotes and evicts).
Each mode's server verbs are driven through real in-process servers (threads, no process) with the
same requests to a tiered and an all-RAM server: sync (two workers' pushes of one step, summed with
duplicates), async (a client's unique pushes: the compiled update), GEO (deltas). Then checkpoints
cross between the two kinds of table, save modes 1-3 and shrink select and delete the same keys,
and a bad budget fails with one line naming the value and the fix.
"""

from __future__ import annotations

import json
import re
import os
from pathlib import Path

import pytest
import torch

from recps.errors import ConfigError, PSError
from recps.ps.modes import server_halves
from recps.ps.node import PSClient, PSServer, TableConfig
from recps.ps.table import CountFilterEntry, CtrAccessor, RowWiseAdagradRule, SparseTable
from recps.ps.table.checkpoint import ShardReader, list_shards
from recps.ps.table.tier import parse_memory_budget

BUDGET = 1_000
KEYS = 100_000
BATCH = 4_096
DIM = 8
ACCESSOR = dict(nonclk_coeff=0.1, click_coeff=1.0, base_threshold=0.5, delta_threshold=0.3, delete_threshold=0.6,
                delete_after_unseen_days=1.0, delta_keep_days=1.0)


def requests(seed: int, batches: int):
    """(keys (K,), grads (K, D), shows (K,), clicks (K,)) batches: a skewed stream over KEYS keys."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(batches):
        hot = torch.randint(0, 2_000, (BATCH // 4,), generator=g)  # repeats: rows that stay hot
        cold = torch.randint(0, KEYS, (BATCH - BATCH // 4,), generator=g)
        keys = torch.cat([hot, cold])
        clicks = (torch.rand(BATCH, generator=g) < 0.3).float()
        yield keys, torch.randn(BATCH, DIM, generator=g), torch.ones(BATCH), clicks


def assert_same_rows(tiered: SparseTable, ram: SparseTable) -> torch.Tensor:
    """Every row, its optimizer state and its statistics are equal bit for bit; returns the keys."""
    keys = torch.sort(ram.keys()).values
    assert torch.equal(torch.sort(tiered.keys()).values, keys)
    assert len(tiered) == len(ram) == keys.numel()
    assert torch.equal(tiered.pull(keys, create=False), ram.pull(keys, create=False))
    assert torch.equal(tiered.state(keys), ram.state(keys))
    a, b = tiered.stats(keys), ram.stats(keys)
    assert a.keys() == b.keys() and all(torch.equal(a[c], b[c]) for c in a)
    return keys


# ------------------------------------------------------------------------------ every mode, via servers


def _unique(keys, grads, shows, clicks):
    """A client's push: duplicates merged (the worker sums them before it sends)."""
    uniq, inverse = torch.unique(keys, return_inverse=True)
    g = torch.zeros(uniq.numel(), DIM).index_add_(0, inverse, grads)
    s = torch.zeros(uniq.numel()).index_add_(0, inverse, shows)
    c = torch.zeros(uniq.numel()).index_add_(0, inverse, clicks)
    return uniq, g, s, c


@pytest.mark.parametrize("mode", ["sync", "async", "geo"])
def test_every_mode_holds_the_all_ram_rows_bit_for_bit(mode):
    halves = server_halves()
    with PSServer(token="t", halves=halves, num_threads=0) as tiered_server, \
            PSServer(token="t", halves=halves, num_threads=0) as ram_server:
        clients = [PSClient([s.endpoint], token="t") for s in (tiered_server, ram_server)]
        try:
            for client, budget in zip(clients, (BUDGET, None)):
                client.create_sparse_table("emb", DIM, optimizer={"name": "rowwise_adagrad", "lr": 0.05},
                                           accessor=ACCESSOR, mode=mode, memory_budget=budget)
            for step, (keys, grads, shows, clicks) in enumerate(requests(seed=1, batches=24)):
                pulled = [c.pull("emb", keys).wait(30) for c in clients]
                assert torch.equal(pulled[0], pulled[1])
                for client in clients:
                    if mode == "sync":  # two workers' halves of one step, in order on one connection
                        half = BATCH // 2
                        parts = [_unique(keys[w * half:(w + 1) * half], grads[w * half:(w + 1) * half],
                                         shows[w * half:(w + 1) * half], clicks[w * half:(w + 1) * half]) for w in range(2)]
                        handles = [client.push("emb", k, g, shows=s, clicks=c,
                                               meta={"step": step, "worker": w, "workers": 2, "timeout_s": 30})
                                   for w, (k, g, s, c) in enumerate(parts)]
                        for h in handles:
                            h.wait(30)
                    else:
                        uniq, g, s, c = _unique(keys, grads, shows, clicks)
                        client.push("emb", uniq, g if mode == "async" else g * 0.01, shows=s, clicks=c).wait(30)
            tiered, ram = tiered_server.sparse("emb"), ram_server.sparse("emb")
            assert_same_rows(tiered, ram)
            tier = tiered.tier_stats()
            assert tier["rows_memory"] <= BUDGET and tier["rows_disk"] == len(ram) - tier["rows_memory"]
            assert tier["promotions"] > 0 and tier["evictions"] > 0 and 0.0 < tier["hit_rate"] < 1.0
            assert ram.tier_stats() is None
            served = clients[0].stats(timeout=30)["servers"][0]["tables"]["emb"]  # the server's stats verb
            assert served["tier"]["rows_disk"] == tier["rows_disk"] and served["rows"] == len(ram)
            assert "tier" not in clients[1].stats(timeout=30)["servers"][0]["tables"]["emb"]
        finally:
            for c in clients:
                c.close()


# ------------------------------------------------------------------------------ tables


def trained_pair(entry=None, dtype=torch.float32, batches=12) -> tuple[SparseTable, SparseTable]:
    """A tiered and an all-RAM table after the same pulls, pushes (with duplicates) and GEO deltas."""
    kw = dict(dim=DIM, optimizer=RowWiseAdagradRule(lr=0.05), accessor=CtrAccessor(**ACCESSOR), entry=entry, dtype=dtype)
    tiered, ram = SparseTable(memory_budget=BUDGET, **kw), SparseTable(**kw)
    for i, (keys, grads, shows, clicks) in enumerate(requests(seed=2, batches=batches)):
        for t in (tiered, ram):
            t.pull(keys)
            if i % 3 == 2:
                t.push_delta(keys, grads * 0.01, shows=shows, clicks=clicks)
            else:
                t.push(keys, grads, shows=shows, clicks=clicks)
    return tiered, ram


def test_admission_and_half_precision_rows_are_equal():
    tiered, ram = trained_pair(entry=CountFilterEntry(2), dtype=torch.float16, batches=8)
    keys = assert_same_rows(tiered, ram)
    assert keys.numel() > 4 * BUDGET  # most rows on disk
    tiered.close()


def test_compiled_updates_without_accessor_are_equal():
    """Unique pushes and GEO deltas of a table without accessor take the compiled loop (_kernels)."""
    kw = dict(dim=DIM, optimizer=RowWiseAdagradRule(lr=0.05), capacity=KEYS)  # capacity: capped at the budget
    tiered, ram = SparseTable(memory_budget=BUDGET, **kw), SparseTable(**kw)
    assert tiered.capacity < 2 * BUDGET
    for i, (keys, grads, _, _) in enumerate(requests(seed=4, batches=6)):
        uniq = torch.unique(keys)
        for t in (tiered, ram):
            t.pull(keys)
            (t.push_delta if i % 2 else t.push)(uniq, grads[: uniq.numel()], unique=True)
    assert_same_rows(tiered, ram)
    tiered.close()


def saved(path: str) -> dict:
    """{array name: tensor} of a one-shard checkpoint, rows sorted by key."""
    (shard,) = list_shards(path)
    reader = ShardReader(shard)
    out = {n: reader.read(n) for n in reader.manifest["files"]}
    order = torch.argsort(out["keys"])
    for n in ("keys", "values", "state", "meta"):
        if n in out:
            out[n] = out[n][order]
    if "deleted" in out:
        out["deleted"] = torch.sort(out["deleted"]).values
    return out


def test_save_modes_shrink_and_checkpoints_cross_tiers(tmp_path):
    tiered, ram = trained_pair(batches=6)
    for step, mode in enumerate(("delta", "base", "batch", "delta", "full")):
        if step == 3:
            assert tiered.shrink() == ram.shrink() > 0  # the same rows deleted (on disk too)
        a, b = str(tmp_path / f"tiered-{step}"), str(tmp_path / f"ram-{step}")
        assert tiered.save(a, mode)["rows"] == ram.save(b, mode)["rows"]
        sa, sb = saved(a), saved(b)
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[n], sb[n]) for n in sa), mode  # the same keys selected, the same bytes
        assert_same_rows(tiered, ram)  # and the same statistics after the save
    # a checkpoint written tiered loads all-RAM, and the reverse; a delta on top of each
    ram_from_tiered = SparseTable(dim=DIM, optimizer=RowWiseAdagradRule(lr=0.05), accessor=CtrAccessor(**ACCESSOR))
    ram_from_tiered.load(str(tmp_path / "tiered-4"))
    tiered_from_ram = SparseTable(dim=DIM, optimizer=RowWiseAdagradRule(lr=0.05), accessor=CtrAccessor(**ACCESSOR),
                                  memory_budget=BUDGET // 2)  # a restart may choose another budget
    tiered_from_ram.load(str(tmp_path / "ram-4"))
    assert_same_rows(tiered_from_ram, ram)
    assert_same_rows(tiered, ram_from_tiered)
    assert tiered_from_ram.tier_stats()["rows_memory"] <= BUDGET // 2
    for keys, grads, shows, clicks in requests(seed=3, batches=2):
        for t in (tiered, ram):
            t.push(keys, grads, shows=shows, clicks=clicks)
    tiered.save(str(tmp_path / "tiered-delta"), "delta")
    ram.save(str(tmp_path / "ram-delta"), "delta")
    ram_from_tiered.load(str(tmp_path / "tiered-delta"))
    tiered_from_ram.load(str(tmp_path / "ram-delta"))
    assert_same_rows(tiered_from_ram, ram_from_tiered)
    for t in (tiered, tiered_from_ram):
        folder = t.tier_stats()["disk_path"]
        assert os.path.isdir(folder)
        t.close()
        assert not os.path.exists(folder)  # the store goes with the table


# ------------------------------------------------------------------------------ bad budgets


@pytest.mark.parametrize("value, message", [
    ("4XB", "ps.table.memory_budget='4XB' is not a size: give a row count (1000000) or a number with a unit"),
    (0, "ps.table.memory_budget=0: the budget must hold at least 1 row; give a row count >= 1, or null for RAM only"),
    (1.5, "ps.table.memory_budget=1.5: give a row count (an integer such as 1000000), a size with a unit"),
])
def test_a_bad_budget_fails_at_config_time_naming_value_and_fix(value, message):
    with pytest.raises(ConfigError) as e:
        TableConfig(memory_budget=value)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_byte_budget_becomes_rows_of_the_tables_width():
    assert parse_memory_budget("4GiB", "b") == ("bytes", 4 << 30)
    assert parse_memory_budget("2500", "b") == ("rows", 2500)
    config = TableConfig(memory_budget="1MiB", accessor={})
    rows = config.budget_rows(DIM)
    assert 1 << 20 // 200 < rows < (1 << 20) // 60  # a row of dim 8 with its state and statistics: 60-200 bytes
    assert config.spec(DIM, "async")["memory_budget"] == rows
    assert "memory_budget" not in TableConfig().spec(DIM, "async")  # RAM-only specs are as before
    with pytest.raises(ConfigError, match=r"ps.table.memory_budget='64B' holds no row: a row of dim 8 takes \d+ bytes"):
        TableConfig(memory_budget="64B").budget_rows(DIM)


def test_recps_train_checks_the_budget_before_anything_starts():
    """validate_config (what recps.train runs first) refuses a size too small for one row of the
    model's width, and takes a good one."""
    from recps.config import compose_config, validate_config

    bad = ["model=deepfm", "ps=async", "ps.table.memory_budget=10B"]
    with pytest.raises(ConfigError, match=r"^ps.table.memory_budget='10B' holds no row: a row of dim \d+ takes"):
        validate_config(compose_config(bad), bad)
    good = ["model=deepfm", "ps=async", "ps.table.memory_budget=4GiB"]
    validate_config(compose_config(good), good)


# ------------------------------------------------------------------------------ observable


def test_a_jobs_metrics_and_closing_lines_report_its_disk_tiers(tmp_path, in_process_cluster):
    """A PS job whose table is over its budget (the counting model's thousands of rows, a 200-row budget):
    metrics.json's "disk_tier" holds the table's tiers after training, merged over the servers (rows
    per tier adding up to the checkpoint's rows, lookups, hit rate, promotions, evictions, bytes),
    and the run's closing output has a line for it; an all-RAM job has neither."""
    from recps.config import compose_config
    from recps.job.checkpoint import read_ps_checkpoint
    from recps.train import summary_lines
    from tests.helpers.counting import COUNTING_TASK

    base = ["model=lr", f"task._target_={COUNTING_TASK}", "ps=async", "ps.table.init_std=0", "metrics=off",
            "progress=false", "trainer.threads=1", "cluster.workers=1", "trainer.batch_size=16",
            f"dataset.dir={tmp_path / 'data'}", "dataset.generate.train_rows=1600", "dataset.generate.test_rows=200",
            "dataset.generate.vocab=500"]
    tiered = compose_config([*base, "ps.table.memory_budget=200"])
    metrics = in_process_cluster(tiered, tmp_path / "tiered", token="tiers")
    on_disk = json.loads((tmp_path / "tiered" / "metrics.json").read_text())["disk_tier"]
    assert on_disk == metrics["disk_tier"] and list(on_disk) == ["embedding_d1"]
    tier = on_disk["embedding_d1"]
    rows = len(read_ps_checkpoint(str(tmp_path / "tiered" / "checkpoint"), tables=["embedding_d1"])["embedding_d1"])
    assert tier["servers"] == 1 and tier["memory_budget"] == 200
    assert 0 < tier["rows_memory"] <= 200 and tier["rows_memory"] + tier["rows_disk"] == rows > 1000
    assert tier["promotions"] > 0 and tier["evictions"] >= tier["rows_disk"] and tier["disk_bytes"] >= 0
    assert tier["hit_rate"] == tier["memory_hits"] / (tier["memory_hits"] + tier["disk_hits"]) and 0 < tier["hit_rate"] < 1
    lines = summary_lines(tiered, metrics)
    assert lines[-1] == (f"disk tier of table embedding_d1: {tier['rows_memory']} rows in memory (budget 200), "
                         f"{tier['rows_disk']} on disk ({tier['disk_bytes'] / 2**20:.1f} MiB), hit rate "
                         f"{tier['hit_rate']:.3f}, {tier['promotions']} promotions, {tier['evictions']} evictions")
    ram = in_process_cluster(compose_config(base), tmp_path / "ram", token="tiers")
    assert "disk_tier" not in ram and not any(line.startswith("disk tier") for line in summary_lines(tiered, ram))


def test_the_funnels_closing_lines_name_their_disk_tiers():
    """A funnel's (recps.pipeline.runner) and a streaming funnel's (recps.pipeline.incremental) closing
    output ends with a line per table with a disk tier, merged over the servers."""
    from recps.pipeline.incremental import summary_lines as stream_lines
    from recps.pipeline.runner import summary_lines

    tier = {"rows_memory": 9, "rows_disk": 91, "memory_budget": 10, "hit_rate": 0.5, "promotions": 3, "evictions": 94,
            "disk_bytes": 0, "servers": 2}
    line = ("disk tier of table fine_emb: 9 rows in memory (budget 10 over 2 servers), 91 on disk (0.0 MiB), hit rate "
            "0.500, 3 promotions, 94 evictions")
    funnel = {"stage_order": [], "stages": {}, "stages_trained": {}, "funnel": {"ndcg@10": 0.1617}, "requests": 500,
              "baselines": {}}
    assert summary_lines({**funnel, "disk_tier": {"fine_emb": tier}})[-1] == line
    assert not any(x.startswith("disk tier") for x in summary_lines(funnel))
    assert stream_lines({"disk_tier": {"fine_emb": tier}}) == [line]


def test_a_new_store_removes_the_stores_of_processes_that_are_gone(tmp_path):
    """A kill -9 leaves a store behind (no clean-up runs): the next store created in the same folder removes
    those whose owner (host, pid) is this host's and gone; a live process's, another host's and a folder
    without an owner file stay."""
    import socket

    from recps.ps.table.tier import ColdStore

    def store(name: str, owner: str | None):
        folder = tmp_path / f"recps-tier-emb-{name}"
        (folder / "db").mkdir(parents=True)
        if owner is not None:
            (folder / "owner").write_text(owner + "\n")
        return folder

    host = socket.gethostname()
    gone = store("gone", f"{host} {2**22 + 1}")  # above Linux's PID_MAX_LIMIT: never a live process
    alive = store("alive", f"{host} {os.getppid()}")
    elsewhere = store("elsewhere", f"another-{host} {2**22 + 1}")
    unowned = store("unowned", None)
    new = ColdStore(4, "emb", str(tmp_path))
    try:
        assert not gone.exists() and alive.exists() and elsewhere.exists() and unowned.exists()
        assert (Path(new.path) / "owner").read_text() == f"{host} {os.getpid()}\n"
    finally:
        new.close()
    assert not Path(new.path).exists()


# ------------------------------------------------------------------------------ failures of the store


def _flushed(table: SparseTable) -> None:
    """RocksDB writes its files when a memtable flushes (64 MiB of rows, or this call): now."""
    table._cold._db.flush()


def test_a_full_disk_fails_naming_the_store_and_keeps_every_row(tmp_path):
    """The store's files may not grow (RLIMIT_FSIZE: the write fails as on a full disk, EFBIG for ENOSPC): the
    flush fails, then every eviction's write, each with one line naming the store's folder, what was kept (the
    rows are still in memory) and the fix. Nothing is lost: a checkpoint written then holds the all-RAM rows."""
    import resource
    import signal

    kw = dict(dim=DIM, optimizer=RowWiseAdagradRule(lr=0.05), accessor=CtrAccessor(**ACCESSOR), name="emb")
    tiered, ram = SparseTable(memory_budget=BUDGET, tier_dir=str(tmp_path), **kw), SparseTable(**kw)
    try:
        for t in (tiered, ram):
            t.pull(torch.arange(5_000))
        path = tiered.tier_stats()["disk_path"]
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        try:
            with pytest.raises(Exception, match="File too large"):
                _flushed(tiered)
            for _ in range(2):  # the store refuses every later write too
                with pytest.raises(PSError, match=(
                        rf"^table emb: disk tier write failed at {re.escape(path)} \(IO error: .*File too large\); the "
                        r"rows are still in memory; free disk space there or set \$RECPS_TIER_DIR to another folder, then "
                        r"resume the job from its last checkpoint$")):
                    tiered.pull(torch.arange(5_000, 6_000))
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)
        ram.pull(torch.arange(5_000, 6_000))
        assert tiered.tier_stats()["rows_memory"] > BUDGET  # over the budget: what could not go to disk
        tiered.save(str(tmp_path / "kept"), mode="full")  # reads the store only
        loaded = SparseTable(**kw)
        loaded.load(str(tmp_path / "kept"))
        assert assert_same_rows(loaded, ram).numel() == 6_000
    finally:
        tiered.close()
    assert not os.path.exists(path)  # closed and removed, although RocksDB's close repeats the error


def test_an_unreadable_store_fails_naming_it_and_moves_no_row(tmp_path):
    """The store's file is corrupt: a pull that needs a row on disk, and a save (whose scan RocksDB ends early
    without an error), fail with one line naming the folder, what was kept and the fix; no row moved."""
    kw = dict(dim=DIM, optimizer=RowWiseAdagradRule(lr=0.05), name="emb")
    tiered = SparseTable(memory_budget=BUDGET, tier_dir=str(tmp_path), **kw)
    try:
        tiered.pull(torch.arange(20_000))
        _flushed(tiered)
        before = tiered.tier_stats()
        path = before["disk_path"]
        (sst,) = Path(path, "db").glob("*.sst")
        with open(sst, "r+b") as f:  # the data blocks' middle: checksums fail
            size = sst.stat().st_size
            f.seek(size // 4)
            f.write(b"\xff" * (size // 2))
        fix = (r"the store cannot be read \(RocksDB's LOG in that folder says why\); resume the job from its last "
               r"checkpoint \(a restart makes a new store\)$")
        with pytest.raises(PSError, match=rf"^table emb: disk tier read failed at {re.escape(path)} \(Corruption: .*\); "
                                          rf"the table is unchanged; {fix}"):
            tiered.pull(torch.arange(0, 20_000, 7))
        with pytest.raises(PSError, match=rf"^table emb: disk tier read failed at {re.escape(path)} \((Corruption: .*|"
                                          rf"the scan ended after \d+ of its {before['rows_disk']} rows)\); \d* ?(of its "
                                          rf"\d+ rows were read; )?the save, shrink or keys\(\) that scanned them stopped "
                                          rf"there; {fix}"):
            tiered.save(str(tmp_path / "ckpt"), mode="full")
        after = tiered.tier_stats()
        assert (after["rows_memory"], after["rows_disk"]) == (before["rows_memory"], before["rows_disk"])
    finally:
        tiered.close()
