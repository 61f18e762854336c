"""Save/load: full, delta and base round trips, re-sharding, refusal of bad files, and a
full save that stays consistent while a writer thread keeps pushing."""

import json
import threading
import time

import pytest
import torch

from recps.errors import ConfigError
from recps.ps.table import (
    AdagradRule,
    AdamRule,
    CheckpointError,
    CountFilterEntry,
    CtrAccessor,
    DenseTable,
    Initializer,
    SGDRule,
    SparseTable,
    partition,
)
from recps.ps.table.checkpoint import read_table

D = 4


def make(rule=None, **kw):
    kw.setdefault("accessor", CtrAccessor(base_threshold=2.0, delta_threshold=0.0, delete_threshold=0.1))
    return SparseTable(D, optimizer=rule or AdagradRule(lr=0.1), seed=11, initializer=Initializer("normal", std=0.1), **kw)


def counted(table, n, shows=None, clicks=None) -> dict:
    """The statistics a push of n keys to `table` carries: none without an accessor; else `shows`
    (default one per key) and `clicks` (default none), as recps.ps.embedding counts a batch."""
    if table.accessor is None:
        return {}
    return {"shows": torch.ones(n) if shows is None else shows, "clicks": torch.zeros(n) if clicks is None else clicks}


def trained(keys, steps=3, **kw):
    table = make(**kw)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        table.push(keys, torch.randn(keys.numel(), D, generator=g), **counted(table, keys.numel(), clicks=(keys % 3 == 0).float()))
    return table


def assert_same_rows(a: SparseTable, b: SparseTable, keys):
    assert len(a) == len(b)
    assert sorted(a.keys().tolist()) == sorted(b.keys().tolist())
    assert torch.equal(a.pull(keys, create=False), b.pull(keys, create=False))
    assert torch.equal(a.state(keys), b.state(keys))
    sa, sb = a.stats(keys), b.stats(keys)
    for c in sa:
        assert torch.equal(sa[c], sb[c]), c


KEYS = torch.cat([torch.arange(-100, 100), torch.tensor([2**62 + 1, -(2**63), 2**63 - 1])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_full_round_trip_restores_everything(tmp_path, dtype):
    table = trained(KEYS, dtype=dtype, entry=CountFilterEntry(1))
    table.pull(torch.tensor([10**9]))  # a row that was never pushed
    man = table.save(tmp_path / "ckpt", "full")
    assert man["rows"] == len(table) and man["mode"] == "full" and man["dim"] == D
    assert set(man["files"]) >= {"keys", "values", "state", "meta"}
    on_disk = json.loads((tmp_path / "ckpt" / "shard-00000-of-00001" / "manifest.json").read_text())
    assert on_disk["files"]["values"]["sha256"] == man["files"]["values"]["sha256"]
    restored = make(dtype=dtype, entry=CountFilterEntry(1))
    assert restored.load(tmp_path / "ckpt") == len(table)
    assert_same_rows(table, restored, torch.cat([KEYS, torch.tensor([10**9])]))
    # Training continues identically after the restore.
    g = torch.randn(KEYS.numel(), D)
    table.push(KEYS, g, **counted(table, KEYS.numel()))
    restored.push(KEYS, g, **counted(restored, KEYS.numel()))
    assert torch.equal(table.pull(KEYS), restored.pull(KEYS))


def test_delta_chain_reproduces_the_table(tmp_path):
    # Paddle's delta: score >= base_threshold (2), delta_score >= delta_threshold (0.25), seen within 16 days.
    # After 3 pushes a clicked key (key % 3 == 0) has score 3, another 0.3 (below the base threshold).
    acc = CtrAccessor(base_threshold=2.0, delta_threshold=0.25, delete_threshold=0.1)
    table = trained(KEYS, accessor=acc)
    table.save(tmp_path / "base", "base")  # serving export starts the chain
    serving = make(accessor=acc)
    serving.load(tmp_path / "base")
    # Day goes on: some rows change, some are new, some are deleted by shrink.
    changed = KEYS[::5]
    table.push(changed, torch.ones(changed.numel(), D), **counted(table, changed.numel(), shows=torch.full((changed.numel(),), 5.0)))  # delta_score +0.5
    table.push(torch.tensor([5000, 5001]), torch.ones(2, D), shows=torch.tensor([5.0, 5.0]), clicks=torch.tensor([3.0, 3.0]))
    table.set_stats(KEYS[1:20:2], show=0.0, click=0.0)
    deleted = table.shrink()
    assert deleted == 10
    man = table.save(tmp_path / "delta1", "delta")
    gone = set(KEYS[1:20:2].tolist())
    expect = {k for k in changed.tolist() if k % 3 == 0 and k not in gone} | {5000, 5001}  # changed, above base
    assert man["rows"] == len(expect)
    assert set(read_table(tmp_path / "delta1").keys.tolist()) == expect
    assert man["files"]["deleted"]["shape"] == [10]
    assert read_table(tmp_path / "delta1").deleted.tolist() == sorted(gone)  # a reader applying it removes them
    assert read_table(tmp_path / "base").deleted is None  # a base starts the chain: nothing to delete
    # Nothing changed since: the next delta is empty (its rows' delta_score was reset to 0 < 0.25).
    assert table.save(tmp_path / "delta2", "delta")["rows"] == 0
    serving.load(tmp_path / "delta1")
    serving.load(tmp_path / "delta2")
    exported = table.keys()
    base_kept = serving.keys()
    # The serving copy holds exactly the rows of the base (score >= 2) plus the delta rows, minus deletions,
    # each with the trainer's values.
    assert set(base_kept.tolist()) <= set(exported.tolist())
    assert torch.equal(serving.pull(base_kept, create=False), table.pull(base_kept, create=False))
    assert not serving.contains(KEYS[1:20:2]).any()


def test_base_exports_values_above_threshold_only(tmp_path):
    table = trained(KEYS)
    s = table.stats(KEYS)
    score = 0.1 * (s["show"] - s["click"]) + s["click"]
    expect = set(KEYS[score >= 2.0].tolist())
    assert 0 < len(expect) < KEYS.numel()
    man = table.save(tmp_path / "base", "base")
    assert set(man["files"]) == {"keys", "values"} and man["rows"] == len(expect)
    served = make(rule=SGDRule())  # base carries no optimizer state: any rule may load it
    served.load(tmp_path / "base")
    assert set(served.keys().tolist()) == expect
    keys = torch.tensor(sorted(expect))
    assert torch.equal(served.pull(keys), table.pull(keys))


@pytest.mark.parametrize("mode", ["full", "batch"])
@pytest.mark.parametrize("accessor", [None, CtrAccessor(base_threshold=2.0, delta_threshold=0.25)])
def test_full_save_keeps_the_delta_chain(tmp_path, accessor, mode):
    """Without an accessor a delta holds the rows pushed since the base; with one, those whose
    delta_score reached 0.25 (here the same 7: shows 2, clicks 2 add 2.0 and lift every score above 2)."""
    table = trained(KEYS, accessor=accessor)
    table.save(tmp_path / "base", "base")
    counts = {} if accessor is None else {"shows": torch.full((7,), 2.0), "clicks": torch.full((7,), 2.0)}
    table.push(KEYS[:7], torch.ones(7, D), **counts)
    table.save(tmp_path / "ckpt", mode)  # a checkpoint must not reset what the next delta owes
    restarted = make(accessor=accessor)
    restarted.load(tmp_path / "ckpt")
    assert table.save(tmp_path / "d_live", "delta")["rows"] == 7
    assert restarted.save(tmp_path / "d_restart", "delta")["rows"] == 7
    assert torch.equal(read_table(tmp_path / "d_live").keys, torch.sort(KEYS[:7]).values)
    assert torch.equal(read_table(tmp_path / "d_restart").keys, torch.sort(KEYS[:7]).values)


def test_reshard_two_to_three(tmp_path):
    keys = torch.randint(-(2**63), 2**63 - 1, (3000,), generator=torch.Generator().manual_seed(3)).unique()
    full = trained(keys)
    full.save(tmp_path / "one", "full")
    # 1 -> 2: two servers load their part, then save as shards of 2.
    for i in range(2):
        shard = make()
        shard.load(tmp_path / "one", shard=i, num_shards=2)
        shard.save(tmp_path / "two", "full", shard=i, num_shards=2)
    new = [make() for _ in range(3)]
    loaded = [t.load(tmp_path / "two", shard=i, num_shards=3) for i, t in enumerate(new)]
    assert sum(loaded) == keys.numel()
    for i, t in enumerate(new):
        mine = keys[partition(keys, 3) == i]
        assert 800 < mine.numel() < 1200
        assert sorted(t.keys().tolist()) == sorted(mine.tolist())
        assert torch.equal(t.pull(mine, create=False), full.pull(mine))
        assert torch.equal(t.state(mine), full.state(mine))
        assert torch.equal(t.stats(mine)["show"], full.stats(mine)["show"])


def test_same_server_count_reads_only_its_own_shard(tmp_path):
    keys = torch.arange(4000, dtype=torch.int64) * 7919
    full = trained(keys)
    full.save(tmp_path / "one", "full")
    for i in range(2):  # as two servers save: each holds its partition
        shard = make()
        shard.load(tmp_path / "one", shard=i, num_shards=2)
        shard.save(tmp_path / "two", "full", shard=i, num_shards=2)
    # Shard 1's values are gone: shard 0 loads without reading them; shard 1 is refused, named.
    (tmp_path / "two" / "shard-00001-of-00002" / "values.bin").unlink()
    zero = make()
    mine = keys[partition(keys, 2) == 0]
    assert zero.load(tmp_path / "two", shard=0, num_shards=2) == mine.numel()
    assert torch.equal(zero.pull(mine, create=False), full.pull(mine))
    with pytest.raises(CheckpointError, match="shard-00001-of-00002"):
        make().load(tmp_path / "two", shard=1, num_shards=2)


def test_shards_not_split_by_partition_are_all_read(tmp_path):
    keys = torch.arange(3000, dtype=torch.int64)
    halves = [keys[:1500], keys[1500:]]  # not partition's split: each shard holds keys of both servers
    tables = [trained(h) for h in halves]
    for i, t in enumerate(tables):
        t.save(tmp_path / "ckpt", "full", shard=i, num_shards=2)
    for i in range(2):
        t = make()
        mine = keys[partition(keys, 2) == i]
        assert t.load(tmp_path / "ckpt", shard=i, num_shards=2) == mine.numel()
        assert sorted(t.keys().tolist()) == sorted(mine.tolist())


def corrupt(path, name, how):
    f = path / "shard-00000-of-00001" / f"{name}.bin"
    data = bytearray(f.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) - 3]
    f.write_bytes(bytes(data))
    return f


@pytest.mark.parametrize("how,message", [("flip", "checksum mismatch"), ("truncate", "truncated")])
def test_corrupted_or_truncated_file_is_refused_and_table_untouched(tmp_path, how, message):
    table = trained(KEYS)
    table.save(tmp_path / "ckpt", "full")
    bad = corrupt(tmp_path / "ckpt", "values", how)
    other = make()
    other.pull(torch.tensor([1, 2, 3]))
    before = other.pull(torch.tensor([1, 2, 3]))
    with pytest.raises(CheckpointError, match=message) as err:
        other.load(tmp_path / "ckpt")
    assert str(bad) in str(err.value)
    assert len(other) == 3 and torch.equal(other.pull(torch.tensor([1, 2, 3])), before)


def test_mismatches_are_refused_with_clear_errors(tmp_path):
    trained(KEYS).save(tmp_path / "ckpt", "full")
    with pytest.raises(CheckpointError, match=r"dim=4, table sparse has dim=8; build the table"):
        SparseTable(8).load(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="optimizer='adagrad'.*'adam'"):
        make(rule=AdamRule()).load(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="does not exist"):
        make().load(tmp_path / "nowhere")
    (tmp_path / "ckpt" / "shard-00000-of-00001" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        make().load(tmp_path / "ckpt")
    trained(KEYS).save(tmp_path / "two", "full", shard=1, num_shards=2)
    with pytest.raises(CheckpointError, match=r"shard\(s\) \[0\] are missing"):
        make().load(tmp_path / "two")
    with pytest.raises(ConfigError, match="mode='incremental'"):
        make().save(tmp_path / "x", "incremental")


def test_failed_save_leaves_no_folder_and_keeps_delta_owed(tmp_path, monkeypatch):
    table = trained(KEYS)
    from recps.ps.table import checkpoint

    def boom(self, header):
        raise OSError("disk full")

    before = table.stats(KEYS)
    monkeypatch.setattr(checkpoint.ShardWriter, "commit", boom)
    with pytest.raises(OSError, match="disk full"):
        table.save(tmp_path / "d", "delta")
    assert list((tmp_path / "d").iterdir()) == []
    after = table.stats(KEYS)
    assert all(torch.equal(before[c], after[c]) for c in before)  # dirty, delta_score: as before the save
    monkeypatch.undo()
    # delta_threshold 0: the rows at base_threshold 2 or above, i.e. the clicked keys (score 3).
    score = 0.1 * (before["show"] - before["click"]) + before["click"]
    assert table.save(tmp_path / "d", "delta")["rows"] == int((score >= 2.0).sum()) == int((KEYS % 3 == 0).sum())


def test_save_replaces_an_existing_folder_atomically(tmp_path):
    table = trained(KEYS)
    table.save(tmp_path / "ckpt", "full")
    table.push(KEYS, torch.ones(KEYS.numel(), D), **counted(table, KEYS.numel()))
    table.save(tmp_path / "ckpt", "full")
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["shard-00000-of-00001"]
    restored = make()
    restored.load(tmp_path / "ckpt")
    assert torch.equal(restored.pull(KEYS), table.pull(KEYS))


def test_full_save_is_row_consistent_while_a_writer_pushes(tmp_path):
    """Adagrad with a constant gradient 1: after n pushes a row's state is n and its value is
    init - lr * sum_{i<=n} 1/sqrt(i). A torn row (value and state from different pushes)
    breaks that identity. Small chunks force the save to interleave with pushes."""
    lr, n_keys = 0.01, 20_000
    table = SparseTable(1, optimizer=AdagradRule(lr=lr, eps=0.0), initializer=Initializer("zeros"))
    keys = torch.arange(n_keys)
    table.pull(keys)
    stop = threading.Event()
    pushes = [0]

    def writer():
        g = torch.Generator().manual_seed(0)
        while not stop.is_set():
            chosen = keys[torch.rand(n_keys, generator=g) < 0.3]
            table.push(chosen, torch.ones(chosen.numel(), 1))
            pushes[0] += 1

    thread = threading.Thread(target=writer)
    thread.start()
    during = []
    try:
        while pushes[0] < 2:
            time.sleep(0.01)
        # Save until one save overlapped pushes (the first almost always does), at most 20 times.
        while len(during) < 3 or (max(during) == 0 and len(during) < 20):
            before = pushes[0]
            table.save(tmp_path / f"c{len(during)}", "full", chunk_rows=500)
            during.append(pushes[0] - before)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert max(during) > 0, "the writer must push while a save is running"
    harmonic = torch.cumsum(1.0 / torch.arange(1, 10_000, dtype=torch.float64).sqrt(), 0)
    for i in range(len(during)):
        restored = SparseTable(1, optimizer=AdagradRule(lr=lr, eps=0.0))
        restored.load(tmp_path / f"c{i}")
        counts = restored.state(keys)[:, 0].double()  # (K,) pushes seen by each saved row
        assert counts.max() > 0
        n = counts.round().long()
        expect = torch.where(n > 0, -lr * harmonic[(n - 1).clamp(min=0)], torch.zeros_like(counts))
        torch.testing.assert_close(restored.pull(keys)[:, 0].double(), expect, atol=1e-5, rtol=1e-4)


def test_dense_table_round_trip_and_reshard_by_name(tmp_path):
    g = torch.Generator().manual_seed(0)
    params = {"mlp.0.weight": torch.randn(3, 2, generator=g), "mlp.0.bias": torch.randn(3, generator=g), "t": torch.tensor(2.0)}
    table = DenseTable(params, optimizer=AdamRule(lr=0.1))
    table.push({n: torch.ones_like(v) for n, v in params.items()})
    # Two servers, each holding part of the parameters, save their shard.
    DenseTable({"mlp.0.weight": table.pull()["mlp.0.weight"]}, optimizer=AdamRule(lr=0.1)).save(
        tmp_path / "split", shard=0, num_shards=2
    )
    table.save(tmp_path / "all", "full")
    restored = DenseTable({n: torch.zeros_like(v) for n, v in params.items()}, optimizer=AdamRule(lr=0.1))
    assert restored.load(tmp_path / "all") == 3
    for n, v in table.pull().items():
        assert torch.equal(restored.pull()[n], v)
    grads = {n: torch.full_like(v, 0.5) for n, v in params.items()}
    table.push(grads)
    restored.push(grads)
    assert all(torch.equal(restored.pull()[n], v) for n, v in table.pull().items())
    with pytest.raises(CheckpointError, match=r"shape \[3, 2\] in the checkpoint"):
        DenseTable({"mlp.0.weight": torch.zeros(2, 2)}, optimizer=AdamRule(lr=0.1)).load(tmp_path / "all")
    with pytest.raises(CheckpointError, match="missing"):
        restored.load(tmp_path / "split")


def test_dense_state_of_another_layout_is_refused_naming_the_fix(tmp_path):
    """A checkpoint whose Adam state has the older per-row layout (rows, 2D+1) does not load into
    the one-row layout of per-element rules; a base export (values only) does."""
    table = DenseTable({"w": torch.ones(3, 2)}, optimizer=AdamRule(lr=0.1))
    table._state["w"] = AdamRule().init_state(3, 2)  # (3, 5): what the table kept before per_element
    table.save(tmp_path / "old", "full")
    table.save(tmp_path / "base", "base")
    fresh = DenseTable({"w": torch.zeros(3, 2)}, optimizer=AdamRule(lr=0.1))
    with pytest.raises(CheckpointError, match=r"state of w has shape \(3, 5\).*keeps \(1, 13\).*base export"):
        fresh.load(tmp_path / "old")
    assert torch.equal(fresh.pull()["w"], torch.zeros(3, 2))  # nothing changed on the refusal
    assert fresh.load(tmp_path / "base") == 1
    assert torch.equal(fresh.pull()["w"], torch.ones(3, 2))


def test_dense_sync_buffer_sums_contributions():
    table = DenseTable({"w": torch.zeros(2)}, optimizer=SGDRule(lr=1.0))
    assert table.apply_accumulated() == 0
    assert table.accumulate({"w": torch.tensor([1.0, 2.0])}) == 1
    assert table.accumulate({"w": torch.tensor([3.0, 4.0])}) == 2
    assert table.pull()["w"].tolist() == [0.0, 0.0]  # nothing applied until the step
    assert table.apply_accumulated() == 2
    assert table.pull()["w"].tolist() == [-4.0, -6.0]
    with pytest.raises(ConfigError, match="unknown parameter 'v'"):
        table.accumulate({"v": torch.zeros(2)})


def test_full_checkpoint_keeps_count_filter_candidates(tmp_path):
    table = make(entry=CountFilterEntry(3))
    table.pull(torch.tensor([8, 8, 9]))  # key 8 seen twice, key 9 once
    assert len(table) == 0
    table.save(tmp_path / "ckpt", "full")
    restored = make(entry=CountFilterEntry(3))
    restored.load(tmp_path / "ckpt")
    restored.pull(torch.tensor([8, 9]))
    assert restored.contains(torch.tensor([8, 9])).tolist() == [True, False]
