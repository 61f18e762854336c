"""Save modes and shrink of a table with a CTR accessor follow Paddle's CtrCommonAccessor.

Rows are pushed with chosen shows and clicks; the test recomputes every row's statistics from
those pushes (vectorised, float64) and the rows each mode must write from the formulas:

    score = nonclk_coeff * (show - click) + click_coeff * click
    delta (1): score >= base_threshold & delta_score >= delta_threshold & unseen_days <= delta_keep_days
    base  (2): the same with delta_threshold = 0
    full  (0), batch (3): every row; batch then adds an unseen day to every row

Coefficients are multiples of 1/8 and counts integers, so the table's float32 sums are exact
and rows exactly at a threshold are selected (>=) as the recomputation says.
hypothesis is not installed here: the selection property runs over seeded random tables.
"""

from __future__ import annotations

import pytest
import torch

from recps.errors import ConfigError
from recps.fs import retry_transient
from recps.ps.table import SAVE_MODES, CtrAccessor, Initializer, SGDRule, SparseTable
from recps.ps.table import checkpoint
from recps.ps.table.checkpoint import read_table

D = 2
N = 3000  # keys per random table
COLUMNS = ("show", "click", "unseen_days", "delta_score", "dirty")


def table_with(acc: CtrAccessor) -> SparseTable:
    return SparseTable(D, optimizer=SGDRule(lr=1.0), initializer=Initializer("normal", std=0.1), seed=3, accessor=acc)


def random_pushes(table: SparseTable, seed: int, pushes: int = 3) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Push N random keys `pushes` times with duplicates, random shows and clicks (clicks <= shows)
    and set random unseen days. Returns (keys (N,), expected {column: (N,) float64})."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randperm(10 * N, generator=g)[:N].to(torch.int64) * 7919 - 10**6  # (N,) distinct
    acc = table.accessor
    show = torch.zeros(N, dtype=torch.float64)
    click = torch.zeros(N, dtype=torch.float64)
    table.push(keys, torch.zeros(N, D), shows=torch.zeros(N), clicks=torch.zeros(N))  # every key gets a row
    for _ in range(pushes):
        ids = torch.randint(0, N, (2 * N,), generator=g)  # (2N,) duplicates on purpose
        shows = torch.randint(0, 4, (ids.numel(),), generator=g).to(torch.float32)
        clicks = torch.minimum(torch.randint(0, 3, (ids.numel(),), generator=g).to(torch.float32), shows)
        table.push(keys[ids], torch.randn(ids.numel(), D, generator=g), shows=shows, clicks=clicks)
        show.index_add_(0, ids, shows.double())
        click.index_add_(0, ids, clicks.double())
    unseen = torch.randint(0, 6, (N,), generator=g).double()
    table.set_stats(keys, unseen_days=unseen.float())
    score = acc.nonclk_coeff * (show - click) + acc.click_coeff * click  # (N,)
    # delta_score sums each push's score; the score is linear in (show, click): it is the total's score.
    return keys, {"show": show, "click": click, "unseen_days": unseen, "delta_score": score.clone(), "score": score}


def expected_rows(acc: CtrAccessor, mode: str, s: dict) -> torch.Tensor:
    """(N,) bool: the rows `mode` writes, recomputed from the formulas in the module docstring."""
    if mode in ("full", "batch"):
        return torch.ones_like(s["score"], dtype=torch.bool)
    threshold = acc.delta_threshold if mode == "delta" else 0.0
    return (s["score"] >= acc.base_threshold) & (s["delta_score"] >= threshold) & (s["unseen_days"] <= acc.delta_keep_days)


def saved_keys(path) -> torch.Tensor:
    return read_table(path).keys  # ascending


def stats64(table: SparseTable, keys: torch.Tensor) -> dict[str, torch.Tensor]:
    return {c: v.double() for c, v in table.stats(keys).items() if c != "exists"}


ACCESSORS = [
    CtrAccessor(nonclk_coeff=0.125, click_coeff=1.0, base_threshold=1.5, delta_threshold=0.25, delta_keep_days=16),
    CtrAccessor(nonclk_coeff=0.125, click_coeff=1.0, base_threshold=2.0, delta_threshold=1.0, delta_keep_days=3),
    CtrAccessor(nonclk_coeff=0.25, click_coeff=0.5, base_threshold=0.5, delta_threshold=0.0, delta_keep_days=0),
    CtrAccessor(nonclk_coeff=0.0, click_coeff=2.0, base_threshold=0.0, delta_threshold=4.0, delta_keep_days=2.5),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("acc", ACCESSORS, ids=lambda a: f"bt{a.base_threshold}-dt{a.delta_threshold}-keep{a.delta_keep_days}")
def test_delta_base_full_batch_write_the_recomputed_rows(tmp_path, acc, seed):
    table = table_with(acc)
    keys, s = random_pushes(table, seed)
    order = torch.argsort(keys)
    keys, s = keys[order], {c: v[order] for c, v in s.items()}  # ascending, as read_table returns
    for c in ("show", "click", "unseen_days", "delta_score"):
        assert torch.equal(stats64(table, keys)[c], s[c]), c  # the table counted what was pushed

    # delta: exactly the recomputed rows; afterwards their delta_score is 0, every other row's unchanged.
    want = expected_rows(acc, "delta", s)
    assert 0 < int(want.sum()) < N  # each threshold leaves some rows out
    man = table.save(tmp_path / "delta", "delta")
    assert man["rows"] == int(want.sum())
    assert torch.equal(saved_keys(tmp_path / "delta"), keys[want])
    s["delta_score"] = torch.where(want, 0.0, s["delta_score"])
    after = stats64(table, keys)
    assert torch.equal(after["delta_score"], s["delta_score"])
    assert torch.equal(after["dirty"], (~want).double())  # written rows are no longer dirty
    for c in ("show", "click", "unseen_days"):
        assert torch.equal(after[c], s[c]), c
    # A second delta right away: with delta_threshold > 0 nothing new; with 0, the same rows again.
    again = table.save(tmp_path / "delta_again", "delta")["rows"]
    if acc.delta_threshold > 0:
        assert again == 0
    else:
        assert again == int(expected_rows(acc, "delta", s).sum()) == int(want.sum())

    # base: delta's rule with delta_threshold 0, delta_score of the written rows reset.
    s["delta_score"] = stats64(table, keys)["delta_score"]
    base = expected_rows(acc, "base", s)
    assert torch.equal(base, (s["score"] >= acc.base_threshold) & (s["unseen_days"] <= acc.delta_keep_days))
    man = table.save(tmp_path / "base", "base")
    assert man["rows"] == int(base.sum()) and set(man["files"]) == {"keys", "values"}
    assert torch.equal(saved_keys(tmp_path / "base"), keys[base])
    s["delta_score"] = torch.where(base, 0.0, s["delta_score"])
    assert torch.equal(stats64(table, keys)["delta_score"], s["delta_score"])

    # full: every row, nothing changes. batch: every row, then one unseen day more for each.
    before = stats64(table, keys)
    assert table.save(tmp_path / "full", "full")["rows"] == N
    assert torch.equal(saved_keys(tmp_path / "full"), keys)
    full_after = stats64(table, keys)
    assert all(torch.equal(before[c], full_after[c]) for c in before)
    assert table.save(tmp_path / "batch", "batch")["rows"] == N
    assert torch.equal(saved_keys(tmp_path / "batch"), keys)
    batch_after = stats64(table, keys)
    assert torch.equal(batch_after["unseen_days"], before["unseen_days"] + 1)
    assert all(torch.equal(before[c], batch_after[c]) for c in ("show", "click", "delta_score", "dirty"))
    # The batch model holds the statistics as they were before its save (Paddle's), like the full one.
    on_disk = table_with(acc)
    on_disk.load(tmp_path / "batch")
    assert all(torch.equal(stats64(on_disk, keys)[c], before[c]) for c in before)
    # A day later every row is one day staler: delta_keep_days now leaves out those at the limit.
    s["unseen_days"] = before["unseen_days"] + 1
    table.save(tmp_path / "delta_after_batch", "delta")
    assert torch.equal(saved_keys(tmp_path / "delta_after_batch"), keys[expected_rows(acc, "delta", s)])


def test_delta_keep_days_counts_batch_saves(tmp_path):
    """A row pushed and then left alone leaves deltas and bases after delta_keep_days + 1 batch saves."""
    acc = CtrAccessor(nonclk_coeff=0.125, base_threshold=1.0, delta_threshold=0.5, delta_keep_days=1)
    table = table_with(acc)
    keys = torch.tensor([10, 20])
    table.push(keys, torch.zeros(2, D), shows=torch.tensor([8.0, 8.0]), clicks=torch.tensor([4.0, 4.0]))  # score 4.5
    for day in range(3):
        table.save(tmp_path / f"batch{day}", "batch")
        table.push(torch.tensor([20]), torch.zeros(1, D), shows=torch.tensor([4.0]), clicks=torch.tensor([1.0]))
    # key 10 unseen 3 days > 1, key 20 pushed after the last batch save (unseen 0).
    assert table.stats(keys)["unseen_days"].tolist() == [3.0, 0.0]
    assert table.save(tmp_path / "base", "base")["rows"] == 1
    assert saved_keys(tmp_path / "base").tolist() == [20]
    table.push(keys, torch.zeros(2, D), shows=torch.tensor([4.0, 4.0]), clicks=torch.tensor([1.0, 1.0]))  # seen again
    assert table.save(tmp_path / "delta", "delta")["rows"] == 2
    assert table.stats(keys)["delta_score"].tolist() == [0.0, 0.0]


def test_dirty_selects_the_delta_of_a_table_without_accessor(tmp_path):
    table = SparseTable(D, optimizer=SGDRule(lr=1.0), initializer=Initializer("zeros"))
    table.push(torch.arange(10), torch.ones(10, D))
    assert table.save(tmp_path / "b", "base")["rows"] == 10  # every row, and the delta chain starts
    table.push(torch.tensor([3, 4]), torch.ones(2, D))
    assert table.save(tmp_path / "d1", "delta")["rows"] == 2
    assert table.save(tmp_path / "d2", "delta")["rows"] == 0
    assert table.save(tmp_path / "batch", "batch")["rows"] == 10  # no statistics to age: nothing changes
    assert table.stats(torch.arange(10))["dirty"].eq(0).all()


class FailOnce:
    """ShardWriter.append that raises TimeoutError (a transient failure) at its `at`-th call, once."""

    def __init__(self, monkeypatch, at: int) -> None:
        self.calls, self.at, self.real = 0, at, checkpoint.ShardWriter.append
        monkeypatch.setattr(checkpoint.ShardWriter, "append", self)

    def __get__(self, writer, owner):
        return lambda name, rows: self(writer, name, rows)

    def __call__(self, writer, name, rows):
        self.calls += 1
        if self.calls == self.at:
            raise TimeoutError("datanode slow to report the block")
        return self.real(writer, name, rows)


@pytest.mark.parametrize("mode", ["delta", "base", "batch"])
def test_a_failed_write_changes_no_statistics_and_its_retry_writes_the_same_rows(tmp_path, monkeypatch, mode):
    acc = CtrAccessor(nonclk_coeff=0.125, base_threshold=1.5, delta_threshold=0.25, delta_keep_days=4)
    table = table_with(acc)
    keys, s = random_pushes(table, seed=5)
    keys, s = torch.sort(keys).values, {c: v[torch.argsort(keys)] for c, v in s.items()}
    want = expected_rows(acc, mode, s)
    before = stats64(table, keys)
    # Fail in the middle: after the first chunks of 256 rows were copied and written.
    fail = FailOnce(monkeypatch, at=9)
    with pytest.raises(TimeoutError):
        table.save(tmp_path / "first", mode, chunk_rows=256)
    assert fail.calls == 9
    failed = stats64(table, keys)
    assert all(torch.equal(before[c], failed[c]) for c in before), "a failed save changed statistics"
    # What the server does: the same save again (retry_transient); this time it fails once more, then commits.
    fail.calls, fail.at = 0, 5
    man = retry_transient(lambda: table.save(tmp_path / "retried", mode, chunk_rows=256), "test save", retries=2, backoff_s=0.0)
    assert man["rows"] == int(want.sum())
    assert torch.equal(saved_keys(tmp_path / "retried"), keys[want])
    after = stats64(table, keys)
    if mode == "batch":
        assert torch.equal(after["unseen_days"], before["unseen_days"] + 1)  # once, not per attempt
        assert torch.equal(after["delta_score"], before["delta_score"])
    else:
        assert torch.equal(after["delta_score"], torch.where(want, 0.0, before["delta_score"]))
        assert torch.equal(after["unseen_days"], before["unseen_days"])


def test_push_during_a_delta_keeps_its_delta_score(tmp_path, monkeypatch):
    """A row written by a delta and pushed before the commit keeps the delta_score of that push."""
    acc = CtrAccessor(nonclk_coeff=0.125, base_threshold=1.0, delta_threshold=0.5)
    table = table_with(acc)
    keys = torch.arange(4)
    table.push(keys, torch.zeros(4, D), shows=torch.full((4,), 8.0), clicks=torch.full((4,), 2.0))  # score 2.75
    real_commit = checkpoint.ShardWriter.commit

    def commit_after_a_push(writer, header):
        table.push(torch.tensor([1]), torch.zeros(1, D), shows=torch.tensor([8.0]), clicks=torch.tensor([0.0]))  # +1.0
        return real_commit(writer, header)

    monkeypatch.setattr(checkpoint.ShardWriter, "commit", commit_after_a_push)
    assert table.save(tmp_path / "d", "delta")["rows"] == 4
    assert table.stats(keys)["delta_score"].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_shrink_decays_deletes_by_score_and_counts_no_day():
    acc = CtrAccessor(nonclk_coeff=0.125, click_coeff=1.0, show_click_decay_rate=0.5, delete_threshold=1.0,
                      delete_after_unseen_days=2)
    table = table_with(acc)
    keys, s = random_pushes(table, seed=7)
    show, click = s["show"] * 0.5, s["click"] * 0.5  # (N,) decayed
    stale = s["unseen_days"] > 2
    low = acc.nonclk_coeff * (show - click) + acc.click_coeff * click < acc.delete_threshold  # (N,)
    doomed = low | stale
    assert bool((low & ~stale).any()) and bool((stale & ~low).any()) and not bool(doomed.all())
    before = stats64(table, keys)
    assert table.shrink() == int(doomed.sum())
    assert torch.equal(table.contains(keys), ~doomed)
    after = stats64(table, keys[~doomed])
    assert torch.equal(after["show"], show[~doomed]) and torch.equal(after["click"], click[~doomed])
    assert torch.equal(after["unseen_days"], before["unseen_days"][~doomed])  # shrink counts no day
    assert torch.equal(after["delta_score"], before["delta_score"][~doomed])  # nor touches delta_score
    # The count-filter candidates' ageing stays in shrink (recps.ps.table.sparse.SparseTable.shrink).


def test_rows_left_alone_for_more_than_delete_after_unseen_days_batch_saves_are_shrunk(tmp_path):
    acc = CtrAccessor(show_click_decay_rate=1.0, delete_threshold=0.0, delete_after_unseen_days=2)
    table = table_with(acc)
    keys = torch.arange(100)
    table.push(keys, torch.zeros(100, D), shows=torch.ones(100), clicks=torch.zeros(100))
    for day in range(3):
        assert table.shrink() == 0  # unseen 0, 1, 2: not more than 2
        if day == 2:
            table.push(keys[:10], torch.zeros(10, D), shows=torch.ones(10), clicks=torch.zeros(10))  # seen on the third day
        table.save(tmp_path / f"day{day}", "batch")
    assert table.stats(keys)["unseen_days"].tolist() == [1.0] * 10 + [3.0] * 90
    assert table.shrink() == 90
    assert table.keys().tolist() == keys[:10].tolist()


def test_accessor_delta_keep_days_is_validated_and_in_config():
    assert CtrAccessor().delta_keep_days == 16.0 and CtrAccessor().config()["delta_keep_days"] == 16.0
    with pytest.raises(ConfigError, match=r"delta_keep_days=-1; it must be >= 0"):
        CtrAccessor(delta_keep_days=-1)


def test_bad_mode_lists_the_four_modes(tmp_path):
    assert SAVE_MODES == ("full", "delta", "base", "batch")
    with pytest.raises(ConfigError, match=r"mode='xbox'; use one of \('full', 'delta', 'base', 'batch'\)"):
        table_with(CtrAccessor()).save(tmp_path / "x", "xbox")
