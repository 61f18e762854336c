"""SparseTable verbs in ps-lite's spirit: push n times, pull, compare; admission; shrink."""

import threading

import pytest
import torch

from recps.errors import ConfigError
from recps.ps.table import (
    CountFilterEntry,
    CtrAccessor,
    Initializer,
    ProbabilityEntry,
    SGDRule,
    SparseTable,
)

ZEROS = Initializer("zeros")


def test_push_n_times_then_pull_is_arithmetic():
    table = SparseTable(3, optimizer=SGDRule(lr=1.0), initializer=ZEROS)
    keys = torch.tensor([7, -1, 2**62 + 11, 7])  # key 7 twice per push
    grads = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5], [-1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    n = 5
    for _ in range(n):
        assert table.push(keys, grads) == 3
    got = table.pull(torch.tensor([7, -1, 2**62 + 11]))
    expect = -n * torch.tensor([[2.0, 3.0, 4.0], [0.5, 0.5, 0.5], [-1.0, 0.0, 1.0]])
    assert torch.equal(got, expect)
    assert len(table) == 3


def test_push_delta_adds_and_leaves_state():
    table = SparseTable(2, seed=9)
    keys = torch.tensor([1, 2, 1])
    before = table.pull(torch.tensor([1, 2]))
    table.push_delta(keys, torch.ones(3, 2))
    after = table.pull(torch.tensor([1, 2]))
    torch.testing.assert_close(after - before, torch.tensor([[2.0, 2.0], [1.0, 1.0]]))


def test_replicas_with_the_same_seed_agree_regardless_of_order():
    a = SparseTable(4, seed=5, initializer=Initializer("normal", std=0.1))
    b = SparseTable(4, seed=5, initializer=Initializer("normal", std=0.1))
    keys = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    va = a.pull(keys)
    b.pull(keys.flip(0)[:3])
    assert torch.equal(b.pull(keys), va)
    assert not torch.equal(SparseTable(4, seed=6).pull(keys), va)


def test_pull_without_create_reads_zeros_and_adds_nothing():
    table = SparseTable(2)
    assert table.pull(torch.tensor([1, 2]), create=False).eq(0).all()
    assert len(table) == 0
    assert table.contains(torch.tensor([1])).tolist() == [False]


def test_input_errors_name_the_problem():
    table = SparseTable(4, name="emb")
    with pytest.raises(ConfigError, match=r"emb.push: grads has shape \(2, 3\), expected \(2, 4\)"):
        table.push(torch.tensor([1, 2]), torch.zeros(2, 3))
    with pytest.raises(ConfigError, match="keys have dtype torch.float32"):
        table.pull(torch.tensor([1.0]))
    with pytest.raises(ConfigError, match=r"emb.pull: keys have shape \(2, 2\); pass a 1-D tensor"):
        table.pull(torch.zeros(2, 2, dtype=torch.int64))  # recps.ps.table.keys.as_keys, the one key check
    assert table.pull(torch.tensor([3], dtype=torch.int32)).shape == (1, 4)  # narrower integers are widened
    with pytest.raises(ConfigError, match="no accessor"):
        table.push(torch.tensor([1]), torch.zeros(1, 4), shows=torch.ones(1))
    with pytest.raises(ConfigError, match="no accessor"):
        table.shrink()
    with pytest.raises(ConfigError, match="dim=0"):
        SparseTable(0)
    with pytest.raises(ConfigError, match="dtype=bfloat16; use torch.float32 or torch.float16"):
        SparseTable(2, dtype="bfloat16")
    assert SparseTable(2, dtype="float16").dtype == torch.float16


def test_growth_and_many_keys_round_trip():
    table = SparseTable(2, optimizer=SGDRule(lr=1.0), initializer=ZEROS)
    g = torch.Generator().manual_seed(1)
    keys = torch.randint(-(2**63), 2**63 - 1, (50_000,), generator=g).unique()
    for chunk in keys.split(7000):
        table.push(chunk, -chunk[:, None].remainder(1000).float().expand(-1, 2))
    assert len(table) == keys.numel()
    expect = keys.remainder(1000).float()[:, None].expand(-1, 2)
    assert torch.equal(table.pull(keys), expect)
    assert set(table.keys().tolist()) == set(keys.tolist())


def test_count_filter_admits_after_n_sightings_and_drops_pushes_before():
    table = SparseTable(2, optimizer=SGDRule(lr=1.0), initializer=Initializer("uniform", low=1, high=2), entry=CountFilterEntry(3))
    key = torch.tensor([77])
    for sighting in (1, 2):
        assert table.pull(key).eq(0).all(), f"sighting {sighting} must read zeros"
        assert table.push(key, torch.ones(1, 2)) == 0  # dropped
    assert len(table) == 0
    admitted = table.pull(key)  # third sighting
    assert admitted.ge(1).all() and len(table) == 1
    # Duplicates in one request count as several sightings.
    assert table.pull(torch.tensor([5, 5, 5])).ne(0).all()
    assert table.push(key, torch.ones(1, 2)) == 1
    torch.testing.assert_close(table.pull(key), admitted - 1)


def test_probability_entry_admits_a_fraction():
    table = SparseTable(2, entry=ProbabilityEntry(0.25), seed=0)
    keys = torch.arange(20_000)
    table.pull(keys)
    assert abs(len(table) / keys.numel() - 0.25) < 0.02
    assert table.pull(keys, create=False).ne(0).any(dim=1).sum() == len(table)
    # A key sighted many times in one request is admitted with probability 1 - 0.75^n.
    table.pull(torch.arange(10**6, 10**6 + 2000).repeat_interleave(8))
    frac = table.contains(torch.arange(10**6, 10**6 + 2000)).float().mean().item()
    assert abs(frac - (1 - 0.75**8)) < 0.03


def accessor_table(**kw):
    acc = CtrAccessor(
        nonclk_coeff=0.1, click_coeff=1.0, show_click_decay_rate=0.5, delete_threshold=1.0, delete_after_unseen_days=2, **kw
    )
    return SparseTable(2, accessor=acc, initializer=ZEROS, optimizer=SGDRule(lr=1.0))


def test_show_click_from_pushes_and_score():
    table = accessor_table()
    keys = torch.tensor([1, 1, 2])
    table.push(keys, torch.zeros(3, 2), shows=torch.tensor([1.0, 2.0, 4.0]), clicks=torch.tensor([1.0, 0.0, 1.0]))
    table.push(torch.tensor([2]), torch.zeros(1, 2), shows=torch.ones(1), clicks=torch.zeros(1))  # a batch's: 1 show, no click
    s = table.stats(torch.tensor([1, 2, 3]))
    assert s["show"].tolist() == [3.0, 5.0, 0.0]
    assert s["click"].tolist() == [1.0, 1.0, 0.0]
    assert s["exists"].tolist() == [True, True, False]
    assert s["delta_score"][:2].tolist() == pytest.approx([0.1 * 2 + 1.0, 0.1 * 4 + 1.0])


@pytest.mark.parametrize("stats", [{}, {"shows": torch.ones(1)}, {"clicks": torch.zeros(1)}])
def test_a_table_with_accessor_takes_shows_and_clicks_from_its_caller(stats):
    """The table defaults nothing: a push without both statistics fails naming the fix, and changes nothing
    (recps.ps.embedding.key_statistics decides them once, where the batch enters)."""
    table = accessor_table()
    table.push(torch.tensor([2]), torch.zeros(1, 2), shows=torch.ones(1), clicks=torch.zeros(1))
    before = table.stats(torch.tensor([2]))
    with pytest.raises(ConfigError, match=r"has an accessor: give the keys' shows and clicks"):
        table.push(torch.tensor([2]), torch.ones(1, 2), **stats)
    after = table.stats(torch.tensor([2]))
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert table.pull(torch.tensor([2])).tolist() == [[0.0, 0.0]]


def test_shrink_on_hand_made_statistics(tmp_path):
    table = accessor_table()
    keys = torch.arange(6)
    table.pull(keys)
    # score after decay 0.5: key0 (10,0)->0.5 del; key1 (4,2)->1.1 keep; key2 (0,4)->2 keep but unseen 3 > 2 del;
    # key3 (30,0)->1.5 keep, unseen 2 keep; key4 (2,2)->1 keep (not < 1); key5 (1,0) -> 0.05 del.
    table.set_stats(
        keys,
        show=torch.tensor([10.0, 4, 4, 30, 2, 1]),
        click=torch.tensor([0.0, 2, 4, 0, 2, 0]),
        unseen_days=torch.tensor([0.0, 0, 3, 2, 1, 0]),
    )
    assert table.shrink() == 3
    assert table.contains(keys).tolist() == [False, True, False, True, True, False]
    s = table.stats(torch.tensor([1, 3, 4]))
    assert s["show"].tolist() == [2.0, 15.0, 1.0]
    assert s["unseen_days"].tolist() == [0.0, 2.0, 1.0]  # shrink counts no day (Paddle's): a batch save does
    assert len(table) == 3
    table.save(tmp_path / "day", "batch")  # the day's end: every row one more unseen day
    assert table.stats(torch.tensor([1, 3, 4]))["unseen_days"].tolist() == [1.0, 3.0, 2.0]
    # Next day: key3 is now unseen 3 > 2 and goes; key1 score 0.1*0.5+1*0.5 = 0.55 < 1 goes.
    table.push(torch.tensor([4]), torch.zeros(1, 2), shows=torch.tensor([0.0]), clicks=torch.tensor([2.0]))
    assert table.shrink() == 2
    assert table.keys().tolist() == [4]
    assert table.stats(torch.tensor([4]))["unseen_days"].tolist() == [0.0]  # pushed since the batch save


def test_deleted_slots_are_reused_and_rows_start_fresh():
    table = accessor_table()
    table.pull(torch.arange(100))
    table.push(torch.arange(100), torch.ones(100, 2), shows=torch.ones(100), clicks=torch.zeros(100))
    cap = table.capacity
    table.set_stats(torch.arange(50), show=0.0)
    assert table.shrink() >= 50
    table.pull(torch.arange(1000, 1050))
    assert table.capacity == cap
    assert table.pull(torch.arange(1000, 1050)).eq(0).all()  # fresh initial values, not old rows
    assert table.stats(torch.arange(1000, 1050))["show"].eq(0).all()
    assert table.pull(torch.tensor([0]), create=False).eq(0).all()


def test_count_filter_candidates_age_out_at_shrink():
    acc = CtrAccessor(delete_after_unseen_days=1, show_click_decay_rate=1.0)
    table = SparseTable(2, accessor=acc, entry=CountFilterEntry(3))
    table.pull(torch.tensor([9, 9]))
    table.shrink()  # candidate 9: unseen 0 -> kept, 1 day
    table.shrink()  # unseen 1 -> kept, 2 days
    table.shrink()  # unseen 2 > 1 -> dropped
    table.pull(torch.tensor([9, 9]))
    assert len(table) == 0  # counting restarted from zero
    table.pull(torch.tensor([9]))
    assert len(table) == 1


def test_concurrent_pushes_from_threads_lose_nothing():
    table = SparseTable(4, optimizer=SGDRule(lr=1.0), initializer=ZEROS)
    keys = torch.arange(-50, 50)
    n_threads, n_pushes = 4, 30

    def worker():
        for _ in range(n_pushes):
            table.push(keys, -torch.ones(keys.numel(), 4))
            table.pull(keys + 1000)

    threads = [threading.Thread(target=worker) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert table.pull(keys).eq(n_threads * n_pushes).all()
    assert len(table) == 200
