"""Interaction logs (MovieLens-style) -> user histories, a leave-last-out split, retrieval data.

The recipe of the retrieval models' proof (two-tower, YouTube-DNN, NCF on MovieLens), with
pandas/numpy only: no Python loop per user, row or key.

    ratings.csv (userId, movieId, rating, timestamp) ──► keep rating >= min_rating (0: every
        rating is an implicit interaction) ──► users, items -> dense indices (sorted raw ids)
        ──► rows sorted by (user, timestamp); ties keep the file's order (MovieLens: movieId)
    leave-last-out: each user's last row is its test query, the rest are training rows;
        a user with a single row has no test query (its row trains)
    history of a row = the L most recent items of the same user before it (oldest first), so a
        training row never sees its own or a later item, and a test row sees training items only

Examples, one per row; the KeyedJaggedTensor features (`FEATURES`):

    user     1 key       user index in [0, U)
    item     1 key       item index in [0, C): the positive, a row of the `Catalogue`
    history  0..L keys   item indices
    genres   0..G keys   genre indices of `item` (movies.csv; "(no genres listed)" has none)
    labels   (N, 2)      [1.0 (an observed interaction), log Q(item)]: Q is the item's share of
                         the training rows, add-one smoothed over the catalogue; the in-batch
                         sampling probability that the log-Q correction subtracts

Keys are the dense indices themselves (a local table folds keys modulo its rows: with rows >= C
no two items share a row). Evaluation ranks the whole catalogue for each test query and
excludes the user's training items, except the query's own target item (`RetrievalSource`).

Files by configuration (`ratings_layout`, `movies_layout`; defaults: MovieLens latest's CSVs):

    ratings   separator, header (false: `columns` names every column in file order), columns,
              user_key, item_key, time_key, rating_key (null: no ratings; min_rating must be 0)
              MovieLens-100K's u.data: separator "\t", header false,
              columns [userId, movieId, rating, timestamp]
    movies    the item features, the same layout keys plus encoding, item_key, and either
              genres_key (one column of genre names joined by genre_separator: movies.csv) or
              genre_columns (one 0/1 flag column per genre, the column name is the genre:
              u.item's 19 flags, separator "|", header false, encoding latin-1)

Shapes: U users, C items (catalogue rows), N rows, L history length, G genres of an item.

Example:
    >>> import pandas as pd
    >>> ratings = pd.DataFrame({"userId": [7, 7, 7, 9, 9], "movieId": [30, 10, 20, 10, 30],
    ...                         "rating": [4.0, 3.0, 5.0, 1.0, 2.0], "timestamp": [3, 1, 2, 5, 4]})
    >>> log = InteractionLog.from_frames(ratings)
    >>> log.item.tolist(), log.time.tolist()                # user 7's rows by time, then user 9's
    ([0, 1, 2, 2, 0], [1, 2, 3, 4, 5])
    >>> leave_last_out(log).tolist()
    [False, False, True, False, True]
    >>> lengths, values = histories(log, 2)
    >>> lengths.tolist(), values.tolist()                   # row 2 sees items 0, 1; row 4 sees 2
    ([0, 1, 2, 0, 1], [0, 0, 1, 2])
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pcsv
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recps.data.batch import Batch
from recps.data.dataset import ExamplesSource, PreparedData
from recps.data.reader import Examples
from recps.data.schema import Schema
from recps.errors import ConfigError, DataError

__all__ = [
    "FEATURES",
    "RATINGS_LAYOUT",
    "MOVIES_LAYOUT",
    "read_catalogue",
    "read_ratings",
    "read_movies",
    "InteractionLog",
    "leave_last_out",
    "histories",
    "Catalogue",
    "QueryBatch",
    "RetrievalSource",
    "build_retrieval_data",
    "prepare_interactions",
]

log = logging.getLogger(__name__)

#: KJT feature names of the retrieval examples: single-valued slots, then sequences.
FEATURES = ("user", "item", "history", "genres")
_NO_GENRE = "(no genres listed)"

#: dataset.ratings_layout's keys and defaults: MovieLens latest's ratings.csv.
RATINGS_LAYOUT: dict[str, Any] = {
    "separator": ",", "header": True, "columns": None, "encoding": "utf-8",
    "user_key": "userId", "item_key": "movieId", "rating_key": "rating", "time_key": "timestamp",
}
#: dataset.movies_layout's keys and defaults: MovieLens latest's movies.csv.
MOVIES_LAYOUT: dict[str, Any] = {
    "separator": ",", "header": True, "columns": None, "encoding": "utf-8",
    "item_key": "movieId", "genres_key": "genres", "genre_separator": "|", "genre_columns": None,
}


def _csr_gather(offsets: np.ndarray, values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lengths (R,), values) of CSR rows `rows`, in that order (no loop per row)."""
    starts = offsets[rows]  # (R,)
    lengths = offsets[rows + 1] - starts  # (R,)
    out_starts = np.cumsum(lengths) - lengths  # (R,)
    take = np.repeat(starts - out_starts, lengths) + np.arange(int(lengths.sum()))  # (V,)
    return lengths.astype(np.int64), values[take]


@dataclass(frozen=True)
class InteractionLog:
    """Interactions in dense indices, rows sorted by (user, time); ties keep the file order.

    Attributes:
        user: (N,) int64 user index.
        item: (N,) int64 item index.
        time: (N,) int64 timestamp.
        user_ids: (U,) raw user ids; user_ids[index] is the id.
        item_ids: (C,) raw item ids (every item with an interaction); item_ids[index] is the id.
        genre_offsets: (C + 1,) int64 CSR offsets of each item's genres.
        genre_values: (V,) int64 genre indices.
        genre_names: the G genre names, genre index -> name.
    """

    user: np.ndarray
    item: np.ndarray
    time: np.ndarray
    user_ids: np.ndarray
    item_ids: np.ndarray
    genre_offsets: np.ndarray
    genre_values: np.ndarray
    genre_names: tuple[str, ...] = ()

    def __len__(self) -> int:
        return int(self.user.shape[0])

    @property
    def num_users(self) -> int:
        return int(self.user_ids.shape[0])

    @property
    def num_items(self) -> int:
        return int(self.item_ids.shape[0])

    @classmethod
    def from_frames(cls, ratings: pd.DataFrame, movies: pd.DataFrame | None = None,
                    min_rating: float = 0.0, where: str = "ratings") -> "InteractionLog":
        """From a ratings frame (userId, movieId, timestamp[, rating]) and optional movies (movieId, genres)."""
        missing = [c for c in ("userId", "movieId", "timestamp") if c not in ratings.columns]
        if missing:
            raise DataError(f"{where}: no columns {missing} (it has {list(ratings.columns)}); "
                            "give a MovieLens-style ratings file: userId,movieId,rating,timestamp")
        frame = ratings
        if min_rating > 0:
            if "rating" not in frame.columns:
                raise DataError(f"{where}: dataset.min_rating={min_rating} but there is no rating column; "
                                "set min_rating to 0")
            frame = frame[frame["rating"].to_numpy() >= min_rating]
        if len(frame) == 0:
            raise DataError(f"{where}: no interaction left with rating >= {min_rating}; lower dataset.min_rating")
        raw_user = frame["userId"].to_numpy(np.int64)
        raw_item = frame["movieId"].to_numpy(np.int64)
        time = frame["timestamp"].to_numpy(np.int64)
        user_ids, user = np.unique(raw_user, return_inverse=True)
        item_ids, item = np.unique(raw_item, return_inverse=True)
        # Stable: rows of one user with the same timestamp keep the file order.
        order = np.lexsort((time, user))
        genre_offsets = np.zeros(item_ids.shape[0] + 1, np.int64)
        genre_values = np.zeros(0, np.int64)
        genre_names: tuple[str, ...] = ()
        if movies is not None:
            genre_offsets, genre_values, genre_names = _genres(movies, item_ids)
        return cls(user=user[order].astype(np.int64), item=item[order].astype(np.int64), time=time[order],
                   user_ids=user_ids, item_ids=item_ids, genre_offsets=genre_offsets,
                   genre_values=genre_values, genre_names=genre_names)

    @classmethod
    def read_movielens(cls, ratings: str | os.PathLike, movies: str | os.PathLike | None = None,
                       min_rating: float = 0.0, ratings_layout: Mapping[str, Any] | None = None,
                       movies_layout: Mapping[str, Any] | None = None) -> "InteractionLog":
        """Reads a ratings file (and an item-features file for genres) laid out as the layouts say
        (None: MovieLens latest's ratings.csv / movies.csv; see the module docstring)."""
        frame = read_ratings(ratings, ratings_layout)
        genres = None if movies is None else read_movies(movies, movies_layout)
        return cls.from_frames(frame, genres, min_rating=min_rating, where=str(ratings))


def _layout(given: Mapping[str, Any] | None, defaults: Mapping[str, Any], key: str, path: str) -> dict[str, Any]:
    """`defaults` updated with `given` (`key`, e.g. dataset.ratings_layout), its values checked; ConfigError names
    the key and file."""
    layout = dict(defaults)
    given = dict(given or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ConfigError(f"{key} has unknown keys {unknown} (file {path}); its keys are {sorted(defaults)}")
    layout.update(given)
    sep = layout["separator"]
    if not isinstance(sep, str) or len(sep) != 1:
        raise ConfigError(f"{key}.separator={sep!r} (file {path}); use one character, e.g. ',' or '\\t'")
    if not isinstance(layout["header"], bool):
        raise ConfigError(f"{key}.header={layout['header']!r} (file {path}); use true (the first line names "
                          f"the columns) or false (then {key}.columns names them)")
    columns = layout["columns"]
    if columns is not None and (isinstance(columns, str) or not all(isinstance(c, str) for c in columns)):
        raise ConfigError(f"{key}.columns={columns!r} (file {path}); give every column's name in file order")
    if columns is None and not layout["header"]:
        raise ConfigError(f"{key}.header=false needs {key}.columns: every column of {path} in file "
                          "order (MovieLens-100K's u.data: [userId, movieId, rating, timestamp])")
    return layout


def _read_columns(path: str | os.PathLike, layout: Mapping[str, Any], wanted: Mapping[str, str],
                  key: str) -> pd.DataFrame:
    """The columns `wanted` (layout key -> column name) of a delimited file, parsed by pyarrow."""
    path = str(path)
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file; MovieLens is read in place from ../shared/data next to "
                        f"the checkout (set {key.rsplit('.', 1)[0]}.ratings / .movies to where it is)")
    columns = None if layout["columns"] is None else [str(c) for c in layout["columns"]]
    if columns is not None:
        for name, column in wanted.items():
            if column not in columns:
                raise ConfigError(f"{key}.{name}={column!r} is not among {key}.columns {columns} "
                                  f"(file {path}); set it to one of them")
    options = dict(
        read_options=pcsv.ReadOptions(column_names=columns, skip_rows=1 if columns and layout["header"] else 0,
                                      encoding=str(layout["encoding"])),
        parse_options=pcsv.ParseOptions(delimiter=layout["separator"]),
        convert_options=pcsv.ConvertOptions(include_columns=list(dict.fromkeys(wanted.values()))),
    )
    how = (f"separator {layout['separator']!r}, header={str(layout['header']).lower()}"
           + (f", columns {columns}" if columns else ""))
    try:
        table = pcsv.read_csv(path, **options)
    except KeyError:  # pyarrow's ArrowKeyError: a wanted column is not in the header
        with open(path, encoding=str(layout["encoding"]), errors="replace") as f:
            header = f.readline().rstrip("\r\n").split(layout["separator"])
        missing = [f"{column!r} ({key}.{name})" for name, column in wanted.items() if column not in header]
        raise DataError(f"{path}: no column {', '.join(missing)} in its header {header} ({how}); set those keys, "
                        f"{key}.separator, or {key}.header=false with .columns") from None
    except (pa.ArrowInvalid, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot parse it as {key} says ({how}): {' '.join(str(exc).split())}; "
                        f"fix {key} (columns lists every column in file order) or the file") from None
    frame = table.to_pandas()
    return frame.rename(columns={column: name for name, column in wanted.items()})


def _integers(frame: pd.DataFrame, name: str, column: str, key: str, path: str) -> np.ndarray:
    """(N,) int64 of frame[name]; DataError naming the column, its key and the first bad row."""
    values = frame[name]
    if pd.api.types.is_integer_dtype(values) and not values.isna().any():
        return values.to_numpy(np.int64)
    numbers = pd.to_numeric(values, errors="coerce")
    bad = numbers.isna().to_numpy() | (numbers.to_numpy(np.float64, na_value=np.nan) % 1 != 0)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise DataError(f"{path}: column {column!r} ({key}.{name}) holds {values.iloc[row]!r} in data row "
                        f"{row + 1}; it needs integers: check {key}.columns / separator")
    return numbers.to_numpy(np.int64)


def read_ratings(path: str | os.PathLike, layout: Mapping[str, Any] | None = None,
                 where: str = "dataset") -> pd.DataFrame:
    """A ratings file laid out as `layout` says (<where>.ratings_layout; None: ratings.csv's) as a
    frame of userId, movieId, timestamp (int64) and rating (float64; absent when rating_key is null).
    `where`: the config node the layout comes from, named in errors (the funnel's: pipeline.world)."""
    key = f"{where}.ratings_layout"
    layout = _layout(layout, RATINGS_LAYOUT, key, str(path))
    wanted = {name: str(layout[name]) for name in ("user_key", "item_key", "time_key", "rating_key")
              if layout[name] is not None}
    for name in ("user_key", "item_key", "time_key"):
        if name not in wanted:
            raise ConfigError(f"{key}.{name} is null (file {path}); name the file's column")
    frame = _read_columns(path, layout, wanted, key)
    out = pd.DataFrame({
        "userId": _integers(frame, "user_key", wanted["user_key"], key, str(path)),
        "movieId": _integers(frame, "item_key", wanted["item_key"], key, str(path)),
        "timestamp": _integers(frame, "time_key", wanted["time_key"], key, str(path)),
    })
    if "rating_key" in wanted:
        rating = pd.to_numeric(frame["rating_key"], errors="coerce")
        if rating.isna().any():
            row = int(np.flatnonzero(rating.isna().to_numpy())[0])
            raise DataError(f"{path}: column {wanted['rating_key']!r} ({key}.rating_key) holds "
                            f"{frame['rating_key'].iloc[row]!r} in data row {row + 1}; it needs numbers")
        out["rating"] = rating.to_numpy(np.float64)
    return out


def read_movies(path: str | os.PathLike, layout: Mapping[str, Any] | None = None, where: str = "dataset"
                ) -> pd.DataFrame:
    """An item-features file laid out as `layout` says (<where>.movies_layout; None: movies.csv's)
    as one row per (item, genre): columns movieId (int64) and genre (str). `where`: as read_ratings'."""
    return read_catalogue(path, layout, where)[1]


def read_catalogue(path: str | os.PathLike, layout: Mapping[str, Any] | None = None, where: str = "dataset"
                   ) -> tuple[np.ndarray, pd.DataFrame]:
    """An item-features file read once: (every item id of the file (F,) int64, with a genre or not;
    `read_movies`' (item, genre) rows)."""
    key = f"{where}.movies_layout"
    layout = _layout(layout, MOVIES_LAYOUT, key, str(path))
    flags, joined = layout["genre_columns"], layout["genres_key"]
    if (flags is None) == (joined is None):
        raise ConfigError(f"{key} (file {path}): set one of genres_key (one column of genre names "
                          f"joined by genre_separator; is {joined!r}) and genre_columns (one 0/1 column per genre; "
                          f"is {flags!r}), the other null")
    if layout["item_key"] is None:
        raise ConfigError(f"{key}.item_key is null (file {path}); name the file's item id column")
    wanted = {"item_key": str(layout["item_key"])}
    if flags is not None:
        if isinstance(flags, str) or not flags or not all(isinstance(c, str) for c in flags):
            raise ConfigError(f"{key}.genre_columns={flags!r} (file {path}); list the genre flag "
                              "columns' names (each names its genre)")
        wanted.update({f"genre_columns[{i}]": str(c) for i, c in enumerate(flags)})
    else:
        wanted["genres_key"] = str(joined)
    frame = _read_columns(path, layout, wanted, key)
    items = _integers(frame, "item_key", wanted["item_key"], key, str(path))
    if flags is None:
        sep = layout["genre_separator"]
        if not isinstance(sep, str) or not sep:
            raise ConfigError(f"{key}.genre_separator={sep!r} (file {path}); use a string, e.g. '|'")
        names = frame["genres_key"].fillna("").astype(str).str.split(sep, regex=False)
        pairs = pd.DataFrame({"movieId": items, "genre": names}).explode("genre")
        pairs = pairs[(pairs["genre"].str.len() > 0) & (pairs["genre"] != _NO_GENRE)]
        return items, pd.DataFrame({"movieId": pairs["movieId"].to_numpy(np.int64),
                                    "genre": pairs["genre"].to_numpy(str)})
    names = [f"genre_columns[{i}]" for i in range(len(flags))]
    marks = frame[names].apply(pd.to_numeric, errors="coerce").to_numpy(np.float64, na_value=np.nan)  # (C, G)
    bad = ~np.isin(marks, (0.0, 1.0))
    if bad.any():
        row, col = (int(x[0]) for x in np.nonzero(bad))
        raise DataError(f"{path}: genre flag column {flags[col]!r} ({key}.genre_columns) holds "
                        f"{frame[names[col]].iloc[row]!r} in data row {row + 1}; flags are 0 or 1: check "
                        f"{key}.columns / separator")
    row, col = np.nonzero(marks == 1.0)  # (P,) each: an item row and one of its genres
    return items, pd.DataFrame({"movieId": items[row], "genre": np.asarray(flags, dtype=str)[col]})


def _genres(movies: pd.DataFrame, item_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """CSR genre indices (offsets (C + 1,), values) of `item_ids`, and the sorted genre names.

    `movies`: one row per (movieId, genre) (`read_movies`), or MovieLens' movies.csv frame
    (movieId, genres joined by "|")."""
    if "movieId" in movies.columns and "genre" in movies.columns:
        pairs = movies
    elif "movieId" in movies.columns and "genres" in movies.columns:
        pairs = movies[["movieId", "genres"]].assign(genre=movies["genres"].fillna("").str.split("|")).explode("genre")
        pairs = pairs[(pairs["genre"].str.len() > 0) & (pairs["genre"] != _NO_GENRE)]
    else:
        raise DataError(f"movies: no movieId/genres columns (it has {list(movies.columns)}); give MovieLens' movies.csv")
    raw = pairs["movieId"].to_numpy(np.int64)
    row = np.searchsorted(item_ids, raw)
    known = (row < item_ids.shape[0]) & (item_ids[np.minimum(row, item_ids.shape[0] - 1)] == raw)
    names, genre = np.unique(pairs["genre"].to_numpy(str)[known], return_inverse=True)
    row = row[known]
    order = np.lexsort((genre, row))  # each item's genres in name order
    counts = np.bincount(row, minlength=item_ids.shape[0])
    offsets = np.zeros(item_ids.shape[0] + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets, genre[order].astype(np.int64), tuple(str(n) for n in names)


def leave_last_out(log: InteractionLog) -> np.ndarray:
    """(N,) bool: True on each user's last row (its test query), for users with at least two rows."""
    n = len(log)
    last = np.ones(n, bool)
    last[:-1] = log.user[1:] != log.user[:-1]
    first = np.ones(n, bool)
    first[1:] = log.user[1:] != log.user[:-1]
    return last & ~first


def histories(log: InteractionLog, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(lengths (N,), values) of every row's history: the user's `length` latest items before it."""
    if length < 0:
        raise ConfigError(f"dataset.history_length={length}; use 0 (no history) or more")
    n = len(log)
    first = np.ones(n, bool)
    first[1:] = log.user[1:] != log.user[:-1]
    start = np.maximum.accumulate(np.where(first, np.arange(n), 0))  # (N,) the user's first row
    lengths = np.minimum(np.arange(n) - start, length)  # (N,)
    # Row r takes items[r - lengths[r] : r]; the output position of each value, shifted back.
    out_starts = np.cumsum(lengths) - lengths  # (N,)
    take = np.repeat(np.arange(n) - lengths - out_starts, lengths) + np.arange(int(lengths.sum()))  # (V,)
    return lengths.astype(np.int64), log.item[take]


class Catalogue:
    """The C candidate items, one row each, with their item-side features and training counts.

    Args:
        feature_names: the KJT keys of the data set's batches (item-side and query-side ones).
        item_feature: the feature whose key names the item (one key per row).
        features: item-side feature -> (lengths (C,), values) CSR; must contain `item_feature`.
        counts: (C,) int64, training rows per item.

    `features(rows)` is a KJT over every name in `feature_names` with stride R: the item-side
    features of those items and empty bags for the others (a query-side embedding pools to 0).
    """

    def __init__(self, feature_names: tuple[str, ...], item_feature: str,
                 features: Mapping[str, tuple[torch.Tensor, torch.Tensor]], counts: torch.Tensor) -> None:
        if item_feature not in features:
            raise ConfigError(f"Catalogue: item_feature={item_feature!r} is not among its features {sorted(features)}")
        self.feature_names = tuple(feature_names)
        self.item_feature = item_feature
        self._features = {k: (lengths.to(torch.int64), values.to(torch.int64)) for k, (lengths, values) in features.items()}
        self._offsets = {k: _offsets(lengths) for k, (lengths, _) in self._features.items()}
        lengths, keys = self._features[item_feature]
        if not bool((lengths == 1).all()):
            raise DataError(f"Catalogue: feature {item_feature!r} must have one key per item")
        self.keys = keys  # (C,) int64 item keys
        self.counts = counts.to(torch.int64)  # (C,)
        self._sorted_keys, self._key_order = torch.sort(keys)

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    @property
    def log_q(self) -> torch.Tensor:
        """(C,) float32: log of each item's share of the training rows, add-one smoothed."""
        return torch.from_numpy(_log_share(self.counts.numpy()))

    def rows_of(self, keys: torch.Tensor) -> torch.Tensor:
        """Catalogue rows (K,) of item keys (K,); raises DataError for a key not in the catalogue."""
        keys = keys.contiguous()
        pos = torch.searchsorted(self._sorted_keys, keys).clamp(max=len(self) - 1)  # (K,)
        found = self._sorted_keys[pos] == keys
        if not bool(found.all()):
            bad = keys[~found][:3].tolist()
            raise DataError(f"item keys {bad} are not in the catalogue of {len(self)} items; "
                            "build the catalogue from the same interaction log as the batches")
        return self._key_order[pos]

    def features(self, rows: torch.Tensor | None = None) -> KeyedJaggedTensor:
        """KJT (stride R) of the item-side features of catalogue rows `rows` (all when None)."""
        rows = torch.arange(len(self)) if rows is None else rows.to(torch.int64)
        r = int(rows.shape[0])
        lengths, values = [], []
        for name in self.feature_names:
            if name not in self._features:
                lengths.append(torch.zeros(r, dtype=torch.int64))
                continue
            offsets = self._offsets[name]
            feat_lengths, feat_values = self._features[name]
            picked = feat_lengths.index_select(0, rows)  # (R,)
            starts = offsets.index_select(0, rows)  # (R,)
            out_starts = _offsets(picked)[:-1]
            take = torch.repeat_interleave(starts - out_starts, picked) + torch.arange(int(picked.sum()))
            lengths.append(picked)
            values.append(feat_values.index_select(0, take))
        return KeyedJaggedTensor(keys=list(self.feature_names),
                                 values=torch.cat(values) if values else torch.zeros(0, dtype=torch.int64),
                                 lengths=torch.cat(lengths), stride=r)


def _log_share(counts: np.ndarray) -> np.ndarray:
    """(C,) float32 log((count + 1) / (total + C)): add-one smoothed, finite for unseen items."""
    c = counts.astype(np.float64)
    return np.log((c + 1.0) / (c.sum() + c.shape[0])).astype(np.float32)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=out[1:])
    return out  # (R + 1,)


@dataclass
class QueryBatch:
    """Test queries with what ranking them needs.

    Attributes:
        batch: the queries' Batch (B rows).
        targets: (B,) int64 catalogue row of each query's held-out item.
        exclude_rows, exclude_cols: (K,) int64 pairs (query, catalogue row) not to rank: the
            user's training items other than its target.
    """

    batch: Batch
    targets: torch.Tensor
    exclude_rows: torch.Tensor
    exclude_cols: torch.Tensor


class RetrievalSource(ExamplesSource):
    """An `ExamplesSource` of retrieval examples that knows its catalogue (and, for test, what to exclude).

    Args:
        examples: one row per (user, item) example, features `FEATURES`.
        catalogue: the candidate items.
        exclude_offsets, exclude_items: CSR (N + 1,), (V,) of catalogue rows each example must
            not rank (None: exclude nothing).
    """

    def __init__(self, examples: Examples, catalogue: Catalogue, shuffle: bool = True, seed: int = 0,
                 exclude_offsets: torch.Tensor | None = None, exclude_items: torch.Tensor | None = None) -> None:
        super().__init__(examples, shuffle=shuffle, seed=seed)
        self.catalogue = catalogue
        self.exclude_offsets = exclude_offsets
        self.exclude_items = exclude_items

    def query_batches(self, batch_size: int) -> Iterator[QueryBatch]:
        """Every example in order, batch by batch, with targets and exclusions (for evaluation)."""
        if batch_size < 1:
            raise ConfigError(f"eval batch_size={batch_size}; use a positive integer")
        ex = self.examples
        item = ex.feature_names.index(self.catalogue.item_feature)
        for start in range(0, len(ex), batch_size):
            stop = min(start + batch_size, len(ex))
            part = ex.select(slice(start, stop))
            targets = self.catalogue.rows_of(part.keys[:, item])  # (B,)
            rows = torch.zeros(0, dtype=torch.int64)
            cols = torch.zeros(0, dtype=torch.int64)
            if self.exclude_offsets is not None:
                offs = self.exclude_offsets[start:stop + 1]  # (B + 1,)
                counts = offs[1:] - offs[:-1]  # (B,)
                rows = torch.repeat_interleave(torch.arange(stop - start), counts)  # (K,)
                cols = self.exclude_items[int(offs[0]):int(offs[-1])]  # (K,)
                keep = cols != targets.index_select(0, rows)  # never exclude the target itself
                rows, cols = rows[keep], cols[keep]
            yield QueryBatch(part.to_batch(), targets, rows, cols)


def build_retrieval_data(log_: InteractionLog, history_length: int = 50, seed: int = 0,
                         shuffle: bool = True, examples_per_user: int = 0) -> PreparedData:
    """Leave-last-out retrieval data: training and test sources over one catalogue.

    `examples_per_user` > 0 keeps only each user's latest that many training rows as
    examples (their histories still reach back over all training rows), so that a few very
    active users do not dominate the loss (YouTube-DNN, section 3.4: "a fixed number of
    training examples per user"). The catalogue's counts (popularity, sampling) cover every
    training row; the labels' log Q covers the examples, the in-batch sampling distribution.
    """
    if examples_per_user < 0:
        raise ConfigError(f"dataset.examples_per_user={examples_per_user}; use 0 (all rows) or more")
    n = len(log_)
    is_test = leave_last_out(log_)
    if not bool(is_test.any()):
        raise DataError("no user has two interactions: leave-last-out leaves no test query; use more data")
    hist_lengths, hist_values = histories(log_, history_length)
    genre_lengths, genre_values = _csr_gather(log_.genre_offsets, log_.genre_values, log_.item)
    train_rows = np.flatnonzero(~is_test)
    example_rows = train_rows
    if examples_per_user:
        last = np.ones(n, bool)
        last[:-1] = log_.user[1:] != log_.user[:-1]
        end = np.minimum.accumulate(np.where(last, np.arange(n), n)[::-1])[::-1]  # (N,) the user's last row
        from_end = end - np.arange(n) - is_test[end]  # (N,) 0 = the user's latest training row
        example_rows = train_rows[from_end[train_rows] < examples_per_user]
    counts = np.bincount(log_.item[train_rows], minlength=log_.num_items)  # (C,)
    example_counts = np.bincount(log_.item[example_rows], minlength=log_.num_items)  # (C,)
    t = torch.from_numpy
    catalogue = Catalogue(
        FEATURES, "item",
        {"item": (torch.ones(log_.num_items, dtype=torch.int64), torch.arange(log_.num_items)),
         "genres": (t(np.diff(log_.genre_offsets)), t(log_.genre_values))},
        t(counts),
    )
    log_q = _log_share(example_counts)  # (C,)
    examples = Examples(
        feature_names=FEATURES,
        dense=torch.zeros(n, 0),
        keys=t(np.stack([log_.user, log_.item], axis=1)),  # (N, 2)
        labels=t(np.stack([np.ones(n, np.float32), log_q[log_.item]], axis=1)),  # (N, 2)
        seq_lengths=(t(hist_lengths), t(genre_lengths)),
        seq_values=(t(hist_values), t(genre_values)),
    )
    # Exclusions of each test row: its user's training items (rows sorted by user, so the
    # training rows of the user of test row i are one contiguous run).
    test_rows = np.flatnonzero(is_test)
    train_user = log_.user[train_rows]
    per_user = np.zeros(log_.num_users + 1, np.int64)
    np.cumsum(np.bincount(train_user, minlength=log_.num_users), out=per_user[1:])
    ex_lengths, ex_items = _csr_gather(per_user, log_.item[train_rows], log_.user[test_rows])
    ex_offsets = np.zeros(test_rows.shape[0] + 1, np.int64)
    np.cumsum(ex_lengths, out=ex_offsets[1:])
    train = RetrievalSource(examples.select(t(example_rows)), catalogue, shuffle=shuffle, seed=seed)
    test = RetrievalSource(examples.select(t(test_rows)), catalogue, shuffle=False, seed=seed,
                           exclude_offsets=t(ex_offsets), exclude_items=t(ex_items))
    schema = Schema(labels=("label", "log_q"), sparse=FEATURES[:2], sequence=FEATURES[2:], hash_values=False)
    log.info("interactions: %d users, %d items, %d training rows (%d examples), %d test queries, history <= %d",
             log_.num_users, log_.num_items, train_rows.shape[0], len(train), len(test), history_length)
    return PreparedData(schema, train, test)


def prepare_interactions(name: str, ratings: str | os.PathLike, movies: str | os.PathLike | None = None,
                         min_rating: float = 0.0, history_length: int = 50, examples_per_user: int = 0,
                         shuffle: bool = True, seed: int = 0, ratings_layout: Mapping[str, Any] | None = None,
                         movies_layout: Mapping[str, Any] | None = None) -> PreparedData:
    """The `_target_` of conf/dataset/movielens*.yaml: reads the files and builds the split.

    Args:
        name: the data set's name (messages).
        ratings, movies: the ratings file and the item-features file (genres; None: no genres).
        ratings_layout, movies_layout: how they are laid out (see the module docstring; None:
            MovieLens latest's ratings.csv and movies.csv).
        min_rating: keep ratings >= this (0: every rating is an implicit interaction).
        history_length: L, the most recent training items a row's history holds.
        examples_per_user: train on each user's latest that many rows only (0: all rows).
        shuffle: shuffle the training rows per epoch (seeded by `seed`, shard and epoch).
    """
    log_ = InteractionLog.read_movielens(ratings, movies, float(min_rating), ratings_layout, movies_layout)
    log.info("dataset %s: %d interactions with rating >= %s", name, len(log_), min_rating)
    return build_retrieval_data(log_, int(history_length), seed=int(seed), shuffle=bool(shuffle),
                                examples_per_user=int(examples_per_user))
