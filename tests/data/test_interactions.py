"""recps.data.interactions: leave-last-out by timestamp, histories that never look ahead,
genres, the catalogue, exclusions, log Q; the real MovieLens split when ../shared/data has it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from recps.config import PROJECT_ROOT
from recps.data.interactions import (
    FEATURES,
    InteractionLog,
    build_retrieval_data,
    histories,
    leave_last_out,
    prepare_interactions,
    read_movies,
)
from recps.errors import ConfigError, DataError

MOVIELENS = PROJECT_ROOT.parent / "shared" / "data" / "movielens_latest_small"

# Users 10 (5 rows; two share the last timestamp 40), 20 (1 row: no test), 30 (2 rows).
RATINGS = pd.DataFrame({
    "userId": [10, 10, 10, 10, 10, 20, 30, 30],
    "movieId": [101, 103, 102, 105, 104, 101, 103, 101],
    "rating": [4.0, 2.0, 5.0, 3.0, 1.0, 5.0, 4.0, 4.5],
    "timestamp": [10, 20, 5, 40, 40, 7, 3, 1],
})
MOVIES = pd.DataFrame({
    "movieId": [101, 102, 103, 104, 105, 999],
    "genres": ["Comedy|Drama", "(no genres listed)", "Drama", "Action|Comedy", "Action", "Horror"],
})


def toy_log(**kw) -> InteractionLog:
    return InteractionLog.from_frames(RATINGS, MOVIES, **kw)


def test_rows_sort_by_user_then_time_with_ties_in_file_order():
    log = toy_log()
    raw_items = log.item_ids[log.item].tolist()
    assert log.user_ids.tolist() == [10, 20, 30]
    assert log.item_ids.tolist() == [101, 102, 103, 104, 105]  # 999 has no rating: not a catalogue item
    # user 10: t=5 (102), 10 (101), 20 (103), 40 (105, then 104: file order); user 20; user 30: t=1, 3
    assert raw_items == [102, 101, 103, 105, 104, 101, 101, 103]
    assert log.time.tolist() == [5, 10, 20, 40, 40, 7, 1, 3]


def test_leave_last_out_takes_each_users_last_row():
    is_test = leave_last_out(toy_log())
    assert is_test.tolist() == [False, False, False, False, True, False, False, True]  # user 20 has one row


def test_histories_hold_the_latest_earlier_items_only():
    log = toy_log()
    lengths, values = histories(log, 2)
    assert lengths.tolist() == [0, 1, 2, 2, 2, 0, 0, 1]
    rows = np.split(values, np.cumsum(lengths)[:-1])
    items = log.item.tolist()
    assert [r.tolist() for r in rows] == [[], items[0:1], items[0:2], items[1:3], items[2:4], [], [], items[6:7]]
    long_lengths, _ = histories(log, 100)
    assert long_lengths.tolist() == [0, 1, 2, 3, 4, 0, 0, 1]
    with pytest.raises(ConfigError, match=r"history_length=-1"):
        histories(log, -1)


def test_genres_skip_the_no_genre_marker_and_unrated_movies():
    log = toy_log()
    names = log.genre_names
    assert names == ("Action", "Comedy", "Drama")  # Horror belongs to unrated 999 only
    per_item = [sorted(names[g] for g in log.genre_values[a:b])
                for a, b in zip(log.genre_offsets[:-1], log.genre_offsets[1:])]
    assert per_item == [["Comedy", "Drama"], [], ["Drama"], ["Action", "Comedy"], ["Action"]]


def test_min_rating_filters_interactions():
    log = toy_log(min_rating=4.0)
    assert len(log) == 5 and sorted(log.item_ids[log.item].tolist()) == [101, 101, 101, 102, 103]
    with pytest.raises(DataError, match=r"no interaction left with rating >= 9"):
        toy_log(min_rating=9.0)


def test_retrieval_data_split_features_labels_and_exclusions():
    data = build_retrieval_data(toy_log(), history_length=3, shuffle=False)
    train, test = data.train, data.test
    assert data.schema.feature_names == FEATURES and data.schema.num_dense == 0
    assert len(train) == 6 and len(test) == 2
    cat = train.catalogue
    assert len(cat) == 5 and cat is test.catalogue
    # Training counts per item index 0..4 = movies 101..105: 101 x3, 102, 103, 105 once; 104 is a test item.
    assert cat.counts.tolist() == [3, 1, 1, 0, 1]
    expected_log_q = [math.log((c + 1) / (6 + 5)) for c in (3, 1, 1, 0, 1)]
    assert cat.log_q.tolist() == pytest.approx(expected_log_q, rel=1e-6)

    (q,) = list(test.query_batches(batch_size=8))
    batch = q.batch
    assert batch.sparse["user"].values().tolist() == [0, 2]
    assert batch.sparse["item"].values().tolist() == [3, 2]  # movies 104 and 103
    assert q.targets.tolist() == [3, 2]
    # User 10's three latest items before its test row: 101, 103, 105; user 30's: 101.
    assert batch.sparse["history"].to_padded_dense(3, padding_value=-1).tolist() == [[0, 2, 4], [0, -1, -1]]
    assert batch.labels[:, 0].tolist() == [1.0, 1.0]
    assert batch.labels[:, 1].tolist() == pytest.approx([expected_log_q[3], expected_log_q[2]], rel=1e-6)
    # User 10 trained on items 1, 0, 2, 4; user 30 on item 0 (its target 2 is not excluded).
    pairs = sorted(zip(q.exclude_rows.tolist(), q.exclude_cols.tolist()))
    assert pairs == [(0, 0), (0, 1), (0, 2), (0, 4), (1, 0)]


def test_examples_per_user_keeps_each_users_latest_training_rows():
    data = build_retrieval_data(toy_log(), history_length=3, shuffle=False, examples_per_user=2)
    (batch,) = list(data.train.batches(16, 0, 1, 0))
    pairs = list(zip(batch.sparse["user"].values().tolist(), batch.sparse["item"].values().tolist()))
    assert pairs == [(0, 2), (0, 4), (1, 0), (2, 0)]  # user 10's latest two training rows: 103, 105
    # Histories still reach back over all training rows: 105's history holds 102, 101, 103.
    assert batch.sparse["history"].to_padded_dense(3, padding_value=-1).tolist()[1] == [1, 0, 2]
    assert data.train.catalogue.counts.tolist() == [3, 1, 1, 0, 1]  # popularity: every training row
    example_counts = [2, 0, 1, 0, 1]  # log Q: the examples, what in-batch negatives are drawn from
    expected = [math.log((example_counts[i] + 1) / (4 + 5)) for i in (2, 4, 0, 0)]
    assert batch.labels[:, 1].tolist() == pytest.approx(expected, rel=1e-6)
    (q,) = list(data.test.query_batches(8))
    assert len(q.exclude_rows) == 5  # exclusions still cover every training item
    with pytest.raises(ConfigError, match=r"examples_per_user=-1"):
        build_retrieval_data(toy_log(), examples_per_user=-1)


def test_a_target_seen_in_training_is_not_excluded():
    """Repeat consumption: a user's test item that also appears in its training rows stays rankable."""
    ratings = pd.DataFrame({"userId": [1, 1, 1], "movieId": [5, 6, 5], "timestamp": [1, 2, 3]})
    data = build_retrieval_data(InteractionLog.from_frames(ratings), history_length=5, shuffle=False)
    (q,) = list(data.test.query_batches(4))
    assert q.targets.tolist() == [0]
    assert list(zip(q.exclude_rows.tolist(), q.exclude_cols.tolist())) == [(0, 1)]


def test_catalogue_features_fill_item_side_only():
    cat = build_retrieval_data(toy_log(), shuffle=False).train.catalogue
    kjt = cat.features(torch.tensor([3, 1]))
    d = kjt.to_dict()
    assert kjt.keys() == list(FEATURES) and kjt.stride() == 2
    assert d["user"].lengths().tolist() == [0, 0] and d["history"].lengths().tolist() == [0, 0]
    assert d["item"].values().tolist() == [3, 1]
    assert d["genres"].lengths().tolist() == [2, 0]  # 104: Action, Comedy; 102: none
    assert cat.rows_of(torch.tensor([4, 0])).tolist() == [4, 0]
    with pytest.raises(DataError, match=r"item keys \[77\] are not in the catalogue of 5 items"):
        cat.rows_of(torch.tensor([1, 77]))


def test_training_batches_are_the_train_rows():
    data = build_retrieval_data(toy_log(), shuffle=True, seed=3)
    seen = []
    for shard in range(2):
        for batch in data.train.batches(2, shard, 2, epoch=0):
            seen += list(zip(batch.sparse["user"].values().tolist(), batch.sparse["item"].values().tolist()))
    assert sorted(seen) == [(0, 0), (0, 1), (0, 2), (0, 4), (1, 0), (2, 0)]


def test_bad_inputs_raise_clear_errors(tmp_path: Path):
    with pytest.raises(DataError, match=r"no such file; MovieLens is read in place from ../shared/data"):
        InteractionLog.read_movielens(tmp_path / "ratings.csv")
    (tmp_path / "r.csv").write_text("user,movie\n1,2\n")
    with pytest.raises(DataError, match=r"r.csv: no column 'userId' \(dataset.ratings_layout.user_key\), .*"
                                        r"in its header \['user', 'movie'\]"):
        InteractionLog.read_movielens(tmp_path / "r.csv")
    with pytest.raises(DataError, match=r"no columns \['timestamp'\]"):
        InteractionLog.from_frames(RATINGS.drop(columns="timestamp"))
    single = RATINGS.iloc[[0, 5]]  # two users with one rating each
    with pytest.raises(DataError, match=r"leave-last-out leaves no test query"):
        build_retrieval_data(InteractionLog.from_frames(single))


@pytest.mark.skipif(not MOVIELENS.is_dir(), reason=f"{MOVIELENS} is absent (see ../shared/data/README.md)")
def test_movielens_latest_small_split():
    data = prepare_interactions("movielens", MOVIELENS / "ratings.csv", MOVIELENS / "movies.csv")
    train, test = data.train, data.test
    assert (len(train), len(test), len(train.catalogue)) == (100_836 - 610, 610, 9_724)
    assert int(train.catalogue.counts.sum()) == len(train)
    ratings = pd.read_csv(MOVIELENS / "ratings.csv")
    last_time = ratings.groupby("userId")["timestamp"].max()
    # Every test query is its user's latest rating: no training row of that user is later.
    log = InteractionLog.from_frames(ratings)
    is_test = leave_last_out(log)
    assert log.user_ids[log.user[is_test]].tolist() == last_time.index.tolist()
    assert log.time[is_test].tolist() == last_time.tolist()
    excluded = sum(int(q.exclude_rows.numel()) for q in test.query_batches(256))
    assert excluded == len(train)  # MovieLens has one rating per (user, movie): every training item is excluded


# ---- files by configuration: MovieLens-100K's u.data / u.item (issue 18 point 8) -----------------

ML100K_GENRES = ["unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary",
                 "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller",
                 "War", "Western"]


def write_ml100k(folder: Path) -> tuple[Path, Path]:
    """RATINGS / MOVIES as MovieLens-100K ships them: u.data (TAB, no header, RATINGS' rows in
    order), u.item ("|", latin-1, no header, a 0/1 flag per genre)."""
    u_data = folder / "u.data"
    u_data.write_text("".join(f"{r.userId}\t{r.movieId}\t{r.rating:g}\t{r.timestamp}\n" for r in RATINGS.itertuples()))
    lines = []
    for m in MOVIES.itertuples():
        flags = ["1" if g in m.genres.split("|") else "0" for g in ML100K_GENRES]
        lines.append("|".join([str(m.movieId), f"Café {m.movieId} (1995)", "01-Jan-1995", "", "http://x"] + flags))
    u_item = folder / "u.item"
    u_item.write_bytes(("\n".join(lines) + "\n").encode("latin-1"))
    return u_data, u_item


def test_movielens_100k_files_read_by_configuration_as_the_csvs_do(tmp_path: Path):
    """conf/dataset/movielens_100k.yaml reads u.data / u.item into the same log (users, items, times,
    genres) and the same retrieval data as ratings.csv / movies.csv with the default layout."""
    from hydra import compose, initialize_config_dir

    from recps.config import register_resolvers
    from recps.job.build import prepare_dataset

    u_data, u_item = write_ml100k(tmp_path)
    RATINGS.to_csv(tmp_path / "ratings.csv", index=False)
    MOVIES.to_csv(tmp_path / "movies.csv", index=False)
    register_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=two_tower", "dataset=movielens_100k", f"dataset.ratings={u_data}", f"dataset.movies={u_item}"])
    ml100k = InteractionLog.read_movielens(u_data, u_item, ratings_layout=cfg.dataset.ratings_layout,
                                           movies_layout=cfg.dataset.movies_layout)
    csvs = InteractionLog.read_movielens(tmp_path / "ratings.csv", tmp_path / "movies.csv")
    for field in ("user", "item", "time", "user_ids", "item_ids", "genre_offsets", "genre_values"):
        assert getattr(ml100k, field).tolist() == getattr(csvs, field).tolist(), field
    assert ml100k.genre_names == csvs.genre_names == ("Action", "Comedy", "Drama")
    # items 101..105: Comedy|Drama, none, Drama, Action|Comedy, Action
    assert np.diff(ml100k.genre_offsets).tolist() == [2, 0, 1, 2, 1]

    data = prepare_dataset(cfg.dataset, seed=0)  # the config's _target_ and every key, as a run builds it
    reference = prepare_interactions("movielens", tmp_path / "ratings.csv", tmp_path / "movies.csv", shuffle=True)
    for split in ("train", "test"):
        got, want = getattr(data, split).examples, getattr(reference, split).examples
        assert torch.equal(got.keys, want.keys) and torch.equal(got.labels, want.labels), split
        assert all(torch.equal(a, b) for a, b in zip(got.seq_values, want.seq_values)), split
    min_rated = InteractionLog.read_movielens(u_data, ratings_layout=cfg.dataset.ratings_layout, min_rating=4.0)
    assert len(min_rated) == int((RATINGS["rating"] >= 4.0).sum())


def test_layout_errors_name_the_key_and_the_file(tmp_path: Path):
    u_data, u_item = write_ml100k(tmp_path)
    cols = ["userId", "movieId", "rating", "timestamp"]
    with pytest.raises(ConfigError, match=r"dataset.ratings_layout.header=false needs dataset.ratings_layout.columns: "
                                          r"every column of .*u.data in file order"):
        InteractionLog.read_movielens(u_data, ratings_layout={"separator": "\t", "header": False})
    with pytest.raises(DataError, match=r"u.data: cannot parse it as dataset.ratings_layout says \(separator '\\t', "
                                        r"header=false, columns \['userId', 'movieId', 'timestamp'\]\): "
                                        r".*Expected 3 columns, got 4"):
        InteractionLog.read_movielens(u_data, ratings_layout={"separator": "\t", "header": False, "rating_key": None,
                                                              "columns": ["userId", "movieId", "timestamp"]})
    with pytest.raises(ConfigError, match=r"dataset.ratings_layout.user_key='user' is not among "
                                          r"dataset.ratings_layout.columns .* \(file .*u.data\)"):
        InteractionLog.read_movielens(u_data, ratings_layout={"separator": "\t", "header": False, "columns": cols,
                                                              "user_key": "user"})
    with pytest.raises(ConfigError, match=r"dataset.ratings_layout has unknown keys \['sep'\] \(file .*u.data\)"):
        InteractionLog.read_movielens(u_data, ratings_layout={"sep": "\t"})
    with pytest.raises(ConfigError, match=r"dataset.ratings_layout.separator='::' \(file .*u.data\); use one character"):
        InteractionLog.read_movielens(u_data, ratings_layout={"separator": "::"})
    # Comma-separated by default: the first line is read as one header column.
    with pytest.raises(DataError, match=r"u.data: no column 'userId' \(dataset.ratings_layout.user_key\), 'movieId' "
                                        r"\(dataset.ratings_layout.item_key\).*separator ','"):
        InteractionLog.read_movielens(u_data)
    layout = {"separator": "|", "header": False, "encoding": "latin-1", "genres_key": None,
              "columns": ["movieId", "title", "date", "video_date", "url", *ML100K_GENRES]}
    with pytest.raises(ConfigError, match=r"dataset.movies_layout \(file .*u.item\): set one of genres_key .* and "
                                          r"genre_columns"):
        read_movies(u_item, {**layout, "genres_key": "title", "genre_columns": ML100K_GENRES})
    with pytest.raises(DataError, match=r"u.item: genre flag column 'date' \(dataset.movies_layout.genre_columns\) "
                                        r"holds '01-Jan-1995' in data row 1; flags are 0 or 1"):
        read_movies(u_item, {**layout, "genre_columns": ["Action", "date"]})
    with pytest.raises(DataError, match=r"u.item: column 'title' \(dataset.movies_layout.item_key\) holds "
                                        r"'Café 101 \(1995\)' in data row 1; it needs integers"):
        read_movies(u_item, {**layout, "item_key": "title", "genre_columns": ML100K_GENRES})
    with pytest.raises(ConfigError, match=r"dataset.movies_layout.genre_columns=\[\]"):
        read_movies(u_item, {**layout, "genre_columns": []})
