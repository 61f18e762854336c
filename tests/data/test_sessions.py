"""recps.data.sessions: reading, the test-split protocol, and both batch sources against
plain Python references (what each lane / row must contain, click by click)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from recps.data.sessions import (
    ItemVocabulary,
    SequenceSource,
    SessionParallelBatch,
    SessionParallelSource,
    Sessions,
    build_sessions,
    prepare_sessions,
    read_clicks,
    split_last_days,
)
from recps.errors import ConfigError, DataError

RSC15 = Path(__file__).resolve().parents[3] / "shared" / "data" / "rsc15_yoochoose"


def write(path: Path, rows, header="SessionId\tItemId\tTime") -> Path:
    path.write_text("\n".join([header] + ["\t".join(map(str, r)) for r in rows]) + "\n")
    return path


def sessions_of(lists: list[list[int]]) -> Sessions:
    lengths = [len(s) for s in lists]
    return Sessions(torch.tensor([i for s in lists for i in s], dtype=torch.int64),
                    torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int64), np.arange(len(lists)))


SESSIONS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11], [12, 13, 14], [15, 16], [17, 18, 19, 20, 21]]


# ---- reading -------------------------------------------------------------------------------------


def test_read_sorts_by_session_then_time_keeping_file_order_on_ties(tmp_path):
    f = write(tmp_path / "c.txt", [(2, 20, 5.0), (1, 11, 9.0), (1, 10, 3.0), (2, 21, 5.0), (2, 22, 1.0)])
    clicks = read_clicks([f])
    assert clicks["session"].tolist() == [1, 1, 2, 2, 2]
    assert clicks["item"].tolist() == [10, 11, 22, 20, 21]
    assert clicks["time"].tolist() == [3.0, 9.0, 1.0, 5.0, 5.0]


def test_bad_rows_are_skipped_and_counted_within_budget(tmp_path, caplog):
    rows = [(1, 10, 1), (1, 11, 2), (2, "x", 3), (2, 12, ""), (3, 13, 4), (3, 14, 5)]
    f = tmp_path / "c.txt"
    write(f, rows)
    f.write_text(f.read_text() + "4\t15\t6\t99\n")  # a line with too many fields
    clicks = read_clicks([f], error_budget=3)
    assert clicks["item"].tolist() == [10, 11, 13, 14]
    assert "skipped 3 bad rows" in caplog.text and "c.txt" in caplog.text
    with pytest.raises(DataError, match=r"3 bad rows of 7 .*exceed dataset.error_budget=2.*Skipping line 8"):
        read_clicks([f], error_budget=2)
    with pytest.raises(DataError, match=r"error_budget=0.1"):
        read_clicks([f], error_budget=0.1)  # 3 of 7 rows


def test_missing_columns_and_files_are_named(tmp_path):
    f = write(tmp_path / "c.txt", [(1, 10, 1)], header="session\titem\tts")
    with pytest.raises(DataError, match=r"no columns \['SessionId', 'ItemId', 'Time'\].*session_key"):
        read_clicks([f])
    assert read_clicks([f], session_key="session", item_key="item", time_key="ts")["item"].tolist() == [10]
    with pytest.raises(DataError, match="nope.txt"):
        read_clicks([tmp_path / "nope.txt"])


def test_vocabulary_round_trip_and_unknown_ids():
    vocab = ItemVocabulary.from_items(np.array([30, 10, 20, 10]))
    assert len(vocab) == 3 and vocab.raw_ids.tolist() == [10, 20, 30]
    assert vocab.encode(np.array([20, 99, 30])).tolist() == [1, -1, 2]
    assert vocab.decode([2, 0]).tolist() == [30, 10]


def test_test_split_protocol_drops_unseen_items_then_short_sessions(tmp_path):
    """GRU4Rec's evaluation: unknown items go first, then sessions left with < 2 clicks."""
    train = write(tmp_path / "train.txt", [(1, 10, 1), (1, 20, 2), (2, 30, 3), (2, 10, 4)])
    test = write(tmp_path / "test.txt", [(5, 10, 1), (5, 99, 2), (5, 30, 3),  # 99 unseen: [10, 30]
                                         (6, 99, 4), (6, 20, 5),  # only 20 is left: dropped
                                         (7, 20, 6), (7, 20, 7)])  # repeats are kept
    data = prepare_sessions("toy", [train], [test])
    assert data.num_embeddings == 3
    s = data.test_sessions
    assert data.vocabulary.decode(s.items).tolist() == [10, 30, 20, 20]
    assert s.offsets.tolist() == [0, 2, 4] and s.session_ids.tolist() == [5, 7]
    assert s.num_targets == 2
    assert data.train_sessions.item_counts(3).tolist() == [2, 1, 1]


def test_prepare_refuses_unknown_batching_and_missing_test(tmp_path):
    f = write(tmp_path / "c.txt", [(1, 10, 1), (1, 11, 2)])
    with pytest.raises(ConfigError, match=r"dataset.batching='parallel'.*session_parallel"):
        prepare_sessions("toy", [f], [f], batching="parallel")
    with pytest.raises(ConfigError, match="no test files"):
        prepare_sessions("toy", [f], [])


# ---- layout options and the time split (issue 18 point 8) ---------------------------------------

DAY = 86_400.0


def test_a_headerless_comma_file_with_iso_times_reads_by_configuration(tmp_path):
    """yoochoose-clicks.dat as it ships: SessionId,Timestamp,ItemId,Category, no header, ISO times."""
    f = tmp_path / "clicks.dat"
    f.write_text("2,2014-04-07T10:00:05.000Z,20,0\n"
                 "1,2014-04-07T10:00:09.500Z,11,S\n"
                 "1,2014-04-07T10:00:03.000Z,10,0\n")
    layout = dict(header=False, columns=["SessionId", "Time", "ItemId", "Category"], separator=",",
                  time_format="datetime")
    clicks = read_clicks([f], **layout)
    t0 = 1396864800.0  # 2014-04-07T10:00:00Z
    assert clicks["session"].tolist() == [1, 1, 2]
    assert clicks["item"].tolist() == [10, 11, 20]
    assert clicks["time"].tolist() == [t0 + 3.0, t0 + 9.5, t0 + 5.0]
    with pytest.raises(DataError, match=r"1 bad rows of 3 .*clicks.dat: row 1: a missing or non-ISO-8601 time value"):
        f.write_text("1,yesterday,10,0\n" + f.read_text().split("\n", 1)[1])
        read_clicks([f], error_budget=0, **layout)


def test_layout_options_are_checked_naming_the_key_and_the_files(tmp_path):
    f = write(tmp_path / "c.txt", [(1, 10, 1)])
    with pytest.raises(ConfigError, match=r"dataset.header=false needs dataset.columns: every column of .*c.txt"):
        read_clicks([f], header=False)
    with pytest.raises(ConfigError, match=r"dataset.time_key='Time' is not among dataset.columns \['s', 'i', 't'\] "
                                          r"\(files .*c.txt"):
        read_clicks([f], header=False, columns=["s", "i", "t"], session_key="s", item_key="i")
    with pytest.raises(ConfigError, match=r"dataset.time_format='unix'.*c.txt.*'number'.*'datetime'"):
        read_clicks([f], time_format="unix")
    with pytest.raises(ConfigError, match=r"dataset.separator='::'.*c.txt.*one character"):
        read_clicks([f], separator="::")
    with pytest.raises(ConfigError, match=r"dataset.header='no'"):
        read_clicks([f], header="no")
    # header=true with columns: the header line is skipped, the columns rename
    renamed = read_clicks([f], columns=["s", "i", "t"], session_key="s", item_key="i", time_key="t")
    assert renamed["item"].tolist() == [10]


def test_last_days_split_holds_out_whole_sessions_ending_in_the_last_n_days():
    """GRU4Rec's rsc15 split: a session is test when its last click is >= t_max - N days."""
    t_max = 10 * DAY
    rows = [  # (session, item, time)
        (1, 10, 1 * DAY), (1, 11, 2 * DAY),                # ends 8 days before t_max: train
        (2, 12, 8.5 * DAY), (2, 13, 9.0 * DAY - 1),        # ends 1 s before the 1-day cut: train
        (3, 14, 8.0 * DAY), (3, 15, 9.0 * DAY),            # ends at the 1-day cut: test, its early click too
        (4, 16, 9.5 * DAY), (4, 17, t_max),                # test
    ]
    clicks = pd.DataFrame(rows, columns=["session", "item", "time"])
    train, test = split_last_days(clicks, 1)
    assert train["session"].tolist() == [1, 1, 2, 2] and test["session"].tolist() == [3, 3, 4, 4]
    assert test["item"].tolist() == [14, 15, 16, 17]  # whole sessions, in order
    train, test = split_last_days(clicks, 0.25)  # the last 6 hours
    assert test["session"].unique().tolist() == [4]
    train, test = split_last_days(clicks, 9)
    assert test["session"].unique().tolist() == [1, 2, 3, 4] and len(train) == 0
    for bad in (0, -1, "1", True):
        with pytest.raises(ConfigError, match=r"dataset.test_days="):
            split_last_days(clicks, bad)


def test_prepare_sessions_splits_one_click_file_by_time(tmp_path):
    t = lambda days: 1_400_000_000 + days * DAY  # noqa: E731
    f = write(tmp_path / "all.txt", [
        (1, 10, t(0)), (1, 20, t(0.1)), (1, 30, t(0.2)),     # train
        (2, 20, t(1)), (2, 30, t(1.5)),                      # train
        (3, 10, t(2.5)), (3, 20, t(2.6)), (3, 99, t(2.7)),   # test; 99 is not a training item
        (4, 30, t(3)), (4, 10, t(3)),                        # test (t_max)
    ])
    data = prepare_sessions("toy", [f], [], test_days=1)
    assert data.vocabulary.raw_ids.tolist() == [10, 20, 30]
    assert data.train_sessions.session_ids.tolist() == [1, 2]
    assert data.vocabulary.decode(data.train_sessions.items).tolist() == [10, 20, 30, 20, 30]
    assert data.test_sessions.session_ids.tolist() == [3, 4]
    assert data.vocabulary.decode(data.test_sessions.items).tolist() == [10, 20, 30, 10]  # 99 dropped
    with pytest.raises(ConfigError, match=r"dataset.test_days=1 splits dataset.train, but dataset.test also names "
                                          r"\[.*all.txt'\]; set dataset.test=\[\] or dataset.test_days=null"):
        prepare_sessions("toy", [f], [f], test_days=1)
    with pytest.raises(ConfigError, match=r"no test files; set dataset.test, or dataset.test_days=N"):
        prepare_sessions("toy", [f], [])


def test_the_order_within_a_session_and_the_splits_day_have_their_own_keys(tmp_path):
    """Issue 32.11: a date for the split, a sequence number for the order (DIGINETICA's eventdate and
    timeframe; SR-GNN sorts by the latter and splits by the former)."""
    f = tmp_path / "clicks.csv"
    f.write_text("session,item,date,seq\n"
                 "1,10,2016-05-01,3\n1,20,2016-05-01,1\n1,30,2016-05-01,2\n"     # clicked 20, 30, 10
                 "2,20,2016-05-02,2\n2,10,2016-05-02,1\n"                         # 10, 20
                 "3,30,2016-05-09,2\n3,20,2016-05-09,1\n3,10,2016-05-09,3\n")    # the last day: test
    layout = dict(session_key="session", item_key="item", time_key="date", time_format="datetime", separator=",",
                  order_key="seq")
    clicks = read_clicks([f], **layout)
    assert clicks["item"].tolist() == [20, 30, 10, 10, 20, 20, 30, 10]
    data = prepare_sessions("toy", [f], [], test_days=1, **layout)
    assert data.vocabulary.decode(data.train_sessions.items).tolist() == [20, 30, 10, 10, 20]
    assert data.vocabulary.decode(data.test_sessions.items).tolist() == [20, 30, 10]
    # without order_key the date orders the clicks: a session's clicks of one day keep their file order
    assert read_clicks([f], **{**layout, "order_key": None})["item"].tolist() == [10, 20, 30, 20, 10, 30, 20, 10]
    with pytest.raises(ConfigError, match=r"dataset.order_key='rank' is not among dataset.columns"):
        read_clicks([f], **{**layout, "header": True, "columns": ["session", "item", "date", "seq"],
                            "order_key": "rank"})
    with pytest.raises(DataError, match=r"no columns \['rank'\] in the header.*order_key"):
        read_clicks([f], **{**layout, "order_key": "rank"})
    with pytest.raises(ConfigError, match=r"dataset.order_format='seconds'.*use 'number'"):
        read_clicks([f], **{**layout, "order_format": "seconds"})


def test_a_validation_split_is_held_out_of_training_and_evaluated_instead_of_the_test_split(tmp_path):
    t = lambda days: 1_400_000_000 + days * DAY  # noqa: E731
    f = write(tmp_path / "all.txt", [
        (1, 10, t(0)), (1, 20, t(0.1)), (1, 30, t(0.2)),     # train
        (2, 20, t(1)), (2, 30, t(1.5)), (2, 40, t(1.6)),     # validation (the last day of what test leaves)
        (3, 10, t(2.5)), (3, 20, t(2.6)),                    # test
        (4, 30, t(3)), (4, 10, t(3)),                        # test (t_max)
    ])
    data = prepare_sessions("toy", [f], [], test_days=1, valid_days=1)
    assert data.evaluated_on == "validation" and data.train_sessions.session_ids.tolist() == [1]
    assert data.vocabulary.raw_ids.tolist() == [10, 20, 30]  # 40 is a validation item: unseen in training
    assert data.test_sessions.session_ids.tolist() == [2]
    assert data.vocabulary.decode(data.test_sessions.items).tolist() == [20, 30]
    assert data.test.item_counts.tolist() == [1, 1, 1]  # the baselines rank by the training clicks
    assert prepare_sessions("toy", [f], [], test_days=1).evaluated_on == "test"
    with pytest.raises(ConfigError, match=r"dataset.valid_days=0; use a positive number of days"):
        prepare_sessions("toy", [f], [], test_days=1, valid_days=0)


def test_the_item2vec_session_corpus_takes_the_same_split(tmp_path):
    from recps.data.text import prepare_session_corpus

    t = lambda days: 1_400_000_000 + days * DAY  # noqa: E731
    f = write(tmp_path / "all.txt", [(1, 10, t(0)), (1, 20, t(0.1)), (2, 20, t(2)), (2, 10, t(2.5)), (2, 20, t(3))])
    data = prepare_session_corpus("toy", [f], [], test_days=1)
    assert data.test.queries.tolist() == [1, 0] and data.test.targets.tolist() == [0, 1]


# ---- session-parallel mini-batches ---------------------------------------------------------------


def reference_lanes(sessions: list[list[int]], lanes: int) -> list[tuple[list[int], list[int], list[bool]]]:
    """The session-parallel loop written plainly: (inputs, targets, starts) per step; lanes
    take sessions in order (wrapping around) for ceil(targets / lanes) steps."""
    steps = -(-sum(len(s) - 1 for s in sessions) // lanes)
    taken = 0

    def next_session() -> int:
        nonlocal taken
        taken += 1
        return (taken - 1) % len(sessions)

    current = [next_session() for _ in range(lanes)]
    pos, start, out = [0] * lanes, [True] * lanes, []
    for _ in range(steps):
        out.append(([sessions[s][p] for s, p in zip(current, pos)],
                     [sessions[s][p + 1] for s, p in zip(current, pos)], list(start)))
        start = [False] * lanes
        for lane in range(lanes):
            pos[lane] += 1
            if pos[lane] + 1 >= len(sessions[current[lane]]):
                current[lane], pos[lane], start[lane] = next_session(), 0, True
    return out


@pytest.mark.parametrize("lanes", [1, 2, 3, 7, 10])
def test_session_parallel_batches_match_the_reference_loop(lanes):
    source = SessionParallelSource(sessions_of(SESSIONS), shuffle=False)
    got = [(b.sparse["item"].values().tolist(), b.labels[:, 0].long().tolist(), b.session_start.tolist())
           for b in source.batches(lanes, 0, 1, 0)]
    assert got == reference_lanes(SESSIONS, lanes)


def test_session_parallel_batch_layout():
    batch = next(SessionParallelSource(sessions_of(SESSIONS), feature="click", shuffle=False).batches(3, 0, 1, 0))
    assert isinstance(batch, SessionParallelBatch)
    assert batch.sparse.keys() == ["click"] and batch.sparse.lengths().tolist() == [1, 1, 1]
    assert batch.dense.shape == (3, 0) and batch.labels.shape == (3, 1) and batch.labels.dtype == torch.float32
    moved = batch.to("cpu")
    assert isinstance(moved, SessionParallelBatch) and moved.session_start.tolist() == [True, True, True]


def test_session_parallel_shards_partition_sessions_and_shuffle_per_epoch():
    sessions = [[i, i + 100] for i in range(40)]  # one target each: every step moves every lane on
    source = SessionParallelSource(sessions_of(sessions), shuffle=True, seed=3)

    def firsts(shard, shards, epoch):
        return [i for b in source.batches(4, shard, shards, epoch) for i in b.sparse.values().tolist()]

    shards = [firsts(k, 3, 0) for k in range(3)]
    assert [len(s) for s in shards] == [16, 16, 16]  # ceil(14 / 4), ceil(13 / 4) steps of 4 lanes
    seen = [set(s) for s in shards]
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    assert set().union(*seen) == set(range(40))  # every session read; 2-3 twice (wrapped)
    assert firsts(0, 3, 0) == shards[0]  # deterministic per (seed, shard, epoch)
    assert firsts(0, 3, 1) != shards[0]


def test_session_parallel_steps_match_the_worker_shard_count():
    """Sync mode runs every thread for min(WorkerShards.shard_batches) steps: each shard has that many."""
    from recps.data.sharding import WorkerShards

    source = SessionParallelSource(sessions_of(SESSIONS), shuffle=True)
    for workers, threads, batch in [(1, 1, 3), (1, 2, 2), (2, 2, 1), (3, 1, 4)]:
        for w in range(workers):
            view = WorkerShards(source, w, workers)
            counts = [sum(1 for _ in view.batches(batch, t, threads, 0)) for t in range(threads)]
            assert counts == view.shard_batches(batch, threads)[w * threads:(w + 1) * threads]


def test_session_parallel_refuses_single_click_sessions():
    with pytest.raises(DataError, match="1 sessions have fewer than 2 clicks"):
        SessionParallelSource(sessions_of([[1, 2], [3]]))


# ---- whole-session sequences ---------------------------------------------------------------------


def rows_of(batch) -> list[tuple[list[int], list[int]]]:
    """(inputs, labels of the valid positions) per row of a sequence batch."""
    jt = batch.sparse["item"]
    values, out, start = jt.values().tolist(), [], 0
    for row, n in enumerate(jt.lengths().tolist()):
        out.append((values[start:start + n], batch.labels[row, :n].long().tolist()))
        assert (batch.labels[row, n:] == -1).all()  # padding
        start += n
    return out


def test_sequence_rows_are_sessions_shifted_by_one():
    source = SequenceSource(sessions_of(SESSIONS), shuffle=False, bucket=1)
    rows = [r for b in source.batches(3, 0, 1, 0) for r in rows_of(b)]
    assert rows == [(s[:-1], s[1:]) for s in SESSIONS]
    assert len(source) == len(SESSIONS)


def test_length_buckets_hold_the_same_rows_with_less_padding():
    sessions = [[i] * n for i, n in enumerate([2, 9, 3, 8] * 4)]
    plain = SequenceSource(sessions_of(sessions), shuffle=True, seed=2, bucket=1)
    bucketed = SequenceSource(sessions_of(sessions), shuffle=True, seed=2, bucket=8)  # one window

    def run(source):
        batches = list(source.batches(2, 0, 1, 0))
        return sorted(map(str, (r for b in batches for r in rows_of(b)))), sum(b.labels.numel() for b in batches)

    (rows_plain, padded_plain), (rows_bucketed, padded_bucketed) = run(plain), run(bucketed)
    assert rows_plain == rows_bucketed
    assert padded_bucketed == sum(n - 1 for n in [2, 9, 3, 8] * 4) < padded_plain  # pairs of equal length
    with pytest.raises(ConfigError, match="bucket=0"):
        SequenceSource(sessions_of(sessions), bucket=0)


def test_windows_predict_every_target_once_from_its_last_max_len_clicks():
    source = SequenceSource(sessions_of(SESSIONS), max_len=2, shuffle=False)
    predictions = []  # (context, target) pairs, as a model reads them
    for batch in source.batches(4, 0, 1, 0):
        for inputs, labels in rows_of(batch):
            assert len(inputs) <= 2
            predictions += [(inputs[:p + 1], t) for p, t in enumerate(labels) if t >= 0]
    expected = [(s[max(0, j - 2):j], s[j]) for s in SESSIONS for j in range(1, len(s))]
    assert sorted(predictions) == sorted(expected)


def test_sequence_shards_partition_rows_deterministically():
    source = SequenceSource(sessions_of(SESSIONS), max_len=3, shuffle=True, seed=1)

    def rows(shard, epoch):
        return [tuple(map(tuple, r)) for b in source.batches(2, shard, 2, epoch) for r in rows_of(b)]

    both = rows(0, 0) + rows(1, 0)
    everything = [tuple(map(tuple, r)) for b in SequenceSource(sessions_of(SESSIONS), max_len=3, shuffle=False)
                  .batches(100, 0, 1, 0) for r in rows_of(b)]
    assert sorted(both) == sorted(everything)
    assert rows(0, 0) == rows(0, 0) and rows(0, 1) != rows(0, 0)


def test_sequence_source_refuses_bad_max_len():
    with pytest.raises(ConfigError, match="dataset.max_len=0"):
        SequenceSource(sessions_of(SESSIONS), max_len=0)


def test_build_sessions_on_an_empty_match():
    vocab = ItemVocabulary.from_items(np.array([1]))
    import pandas as pd

    s = build_sessions(pd.DataFrame({"session": [1, 1], "item": [5, 6], "time": [0.0, 1.0]}), vocab)
    assert s.num_sessions == 0 and s.num_clicks == 0


# ---- the real data -------------------------------------------------------------------------------


@pytest.mark.skipif(not RSC15.is_dir(), reason=f"rsc15 not at {RSC15} (../shared/data next to the checkout)")
def test_rsc15_matches_its_provenance_counts():
    data = prepare_sessions("rsc15", [RSC15 / "yoochoose-clicks-100k_train_full.txt"],
                            [RSC15 / "yoochoose-clicks-100k_test.txt"], batching="session_parallel")
    train, test = data.train_sessions, data.test_sessions
    assert (len(data.vocabulary), train.num_sessions, train.num_clicks) == (2933, 17794, 70278)
    assert (test.num_sessions, test.num_clicks, test.num_targets) == (3416, 13568, 10152)
    steps = sum(1 for _ in data.train.batches(64, 0, 1, 0))
    assert steps == -(-train.num_targets // 64) == 821
