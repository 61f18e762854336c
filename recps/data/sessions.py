"""Session data: click logs → item-id sequences, an item vocabulary, and two batch sources.

Files: delimited text with three columns used (names configurable): session id, item id,
time. GRU4Rec's preparation of RecSys Challenge 2015 (rsc15) writes
`SessionId<TAB>ItemId<TAB>Time` with a header; the raw `yoochoose-clicks.dat` is
`SessionId,Timestamp,ItemId,Category` without one and with ISO-8601 times
(`header=False`, `columns=[SessionId, Time, ItemId, Category]`, `separator=","`,
`time_format="datetime"`). Reading is vectorized with pandas: clicks sort by
(session, time) (stable: ties keep file order), the train split's items make the
vocabulary (ids 0..C-1 in sorted raw-id order), and GRU4Rec's evaluation protocol
filters the test split: clicks on items unseen in training are dropped, then sessions
left with fewer than `min_length` (2) clicks.

The order within a session and the day of the split may be two columns: public click logs
often date each click for the split and give a timestamp or sequence number for the order
(DIGINETICA's eventdate and timeframe; SR-GNN's preprocessing sorts by the latter and splits
by the former). `order_key` names the column that orders a session's clicks (`order_format`:
number or datetime); `time_key` then only places sessions in time for the splits. Without
`order_key` the time column does both.

The test split is either its own files, or, with `test_days` = N, the sessions of the
training files whose last click lies within N days (N x 86,400 s) of the latest click:
GRU4Rec's and SR-GNN's split of one click file (`split_last_days`). `valid_days` = V holds
out a validation split the same way from what is left for training (the sessions ending in
its last V days): the run trains on the rest and evaluates on the validation split, never
reading the test split's metrics, so that settings are chosen without it; then the same
settings without `valid_days` train on all training sessions and evaluate on the test split.

Bad rows (a wrong field count, a missing or non-numeric value) are skipped, counted and
logged with their file and line; beyond `error_budget` the reader raises DataError.

Shapes: M clicks, S sessions, C items, B lanes / rows in a batch, W the longest row of a
batch, N = the positions of a batch (sum of its row lengths).

Two batch sources over the same `Sessions`, both `BatchSource`s of the trainer; the KJT
holds one feature (`item` by default), values are item ids 0..C-1; labels are the ids of
the next items as float32 (exact below 2^24 items):

SessionParallelSource, GRU4Rec's session-parallel mini-batches (Hidasi et al. 2016, §3.1.1).
B lanes each walk through one session, one click per step; a lane that reaches the last
click of its session continues with the next session, and `session_start` tells the model
to reset that lane's hidden state. An epoch is ceil((M - S) / B) steps (the targets over the
lanes; per shard its share), so its length is known in advance; a lane that finds the
sessions used up wraps around to the first ones (GRU4Rec's loop stops there instead; either
way about B sessions are in flight when an epoch ends, and shuffling per epoch rotates them).

    lane 0:  a1 a2 a3 | d1 d2 ...            batch t = SessionParallelBatch(
    lane 1:  b1 b2 | e1 e2 e3 ...                sparse  KJT lengths (B,) = 1, the clicks at t
    lane 2:  c1 c2 c3 c4 | f1 ...                labels  (B, 1) the clicks at t+1
             t=0  1  2  3                        session_start (B,) bool: a new session in the lane)

SequenceSource, whole sessions for models that read a prefix at once (SASRec; GRU4Rec's
evaluation). A session of n clicks is one row: inputs = its first n-1 clicks (jagged KJT),
labels (B, W) = the clicks that follow each input, -1 on padding. With `max_len` = L and
n-1 > L, the first row holds the first L inputs and every later target gets a row of its L
preceding clicks in which only the last position is scored (label -1 elsewhere), so every
target is predicted exactly once from at most L clicks of its prefix.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> def write(name, rows):   # (session, item, time) rows
    ...     lines = ["SessionId\\tItemId\\tTime"] + ["\\t".join(map(str, r)) for r in rows]
    ...     _ = (d / name).write_text("\\n".join(lines) + "\\n")
    >>> write("train.txt", [(1, 30, 1), (1, 10, 2), (2, 20, 3), (2, 30, 4), (2, 10, 5)])
    >>> write("test.txt", [(7, 10, 9), (7, 99, 10), (7, 20, 11), (8, 99, 12), (8, 30, 13)])
    >>> data = prepare_sessions("toy", [d / "train.txt"], [d / "test.txt"])
    >>> data.vocabulary.raw_ids.tolist(), data.train_sessions.items.tolist()
    ([10, 20, 30], [2, 0, 1, 2, 0])
    >>> data.test_sessions.items.tolist()  # item 99 is unseen in train; session 8 is left with one click
    [0, 1]
    >>> batch = next(SessionParallelSource(data.train_sessions, shuffle=False).batches(2, 0, 1, 0))
    >>> batch.sparse.values().tolist(), batch.labels.squeeze(1).tolist(), batch.session_start.tolist()
    ([2, 1], [0.0, 2.0], [True, True])
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import pandas as pd
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recps.data.batch import Batch
from recps.data.reader import expand_paths
from recps.data.schema import Schema
from recps.errors import ConfigError, DataError

__all__ = [
    "ItemVocabulary",
    "Sessions",
    "SessionParallelBatch",
    "SessionParallelSource",
    "SequenceSource",
    "SessionData",
    "read_clicks",
    "split_last_days",
    "read_train_test",
    "build_sessions",
    "prepare_sessions",
]

log = logging.getLogger(__name__)

#: Largest vocabulary whose ids float32 labels hold exactly.
MAX_ITEMS = 2**24
_BATCHINGS = ("session_parallel", "sequences")
_TIME_FORMATS = ("number", "datetime")
DAY_SECONDS = 86_400
_MAX_IN_MESSAGE = 3


@dataclass(frozen=True)
class ItemVocabulary:
    """Raw item ids ↔ ids 0..C-1 (the position in the sorted raw ids).

    raw_ids: (C,) sorted unique raw ids (int64, or strings as an object array).
    """

    raw_ids: np.ndarray

    @classmethod
    def from_items(cls, raw: Any) -> "ItemVocabulary":
        return cls(np.unique(np.asarray(raw)))

    def __len__(self) -> int:
        return int(self.raw_ids.shape[0])

    def encode(self, raw: Any) -> np.ndarray:
        """(M,) raw ids → (M,) int64 ids, -1 where the raw id is not in the vocabulary."""
        return pd.Index(self.raw_ids).get_indexer(np.asarray(raw)).astype(np.int64)

    def decode(self, ids: Any) -> np.ndarray:
        """(M,) ids 0..C-1 → (M,) raw ids."""
        return self.raw_ids[np.asarray(ids, dtype=np.int64)]


@dataclass(frozen=True)
class Sessions:
    """Sessions as one flat click array.

    items: (M,) int64 item ids, session after session, in time order.
    offsets: (S+1,) int64; session s is items[offsets[s]:offsets[s+1]].
    session_ids: (S,) the raw session ids.
    """

    items: torch.Tensor
    offsets: torch.Tensor
    session_ids: np.ndarray

    @property
    def num_sessions(self) -> int:
        return int(self.offsets.numel() - 1)

    @property
    def num_clicks(self) -> int:
        return int(self.items.numel())

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]  # (S,)

    @property
    def num_targets(self) -> int:
        """Next-click predictions of the sessions: M - S."""
        return self.num_clicks - self.num_sessions

    def item_counts(self, num_items: int) -> torch.Tensor:
        """(C,) clicks per item (the most-popular baseline ranks by these)."""
        return torch.bincount(self.items, minlength=num_items)


@dataclass
class SessionParallelBatch(Batch):
    """A `Batch` of session-parallel lanes; `session_start` (B,) bool marks lanes whose
    click begins a new session (their recurrent state must start from zero)."""

    session_start: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "SessionParallelBatch":
        moved = super().to(device, non_blocking=non_blocking)
        return SessionParallelBatch(moved.dense, moved.sparse, moved.labels,
                                    self.session_start.to(device, non_blocking=non_blocking))


def _check_sharding(batch_size: int, shard_index: int, num_shards: int) -> None:
    if batch_size < 1:
        raise ConfigError(f"trainer.batch_size={batch_size}; use 1 or more")
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ConfigError(f"shard {shard_index} of {num_shards}: need num_shards >= 1 and "
                          "0 <= shard_index < num_shards")


def _order(n: int, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    if not shuffle:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


class SessionParallelSource:
    """GRU4Rec's session-parallel mini-batches over `sessions` (see the module docstring).

    Shard k of n walks the sessions order[k::n] (order: shuffled per (seed, epoch) when
    `shuffle`) in `batch_size` lanes. An epoch of the shard is its share of the M - S targets,
    ceil(len(range(k, M - S, n)) / batch_size) steps, known before it starts (sync mode needs
    the same step count on every thread; `len()` is M - S); a lane that finds the shard's
    sessions used up wraps around to its first ones.
    """

    def __init__(self, sessions: Sessions, feature: str = "item", shuffle: bool = True, seed: int = 0) -> None:
        if bool((sessions.lengths < 2).any()):
            raise DataError(f"SessionParallelSource: {int((sessions.lengths < 2).sum())} sessions have fewer than 2 "
                            "clicks (nothing to predict); build the sessions with min_length >= 2")
        self.sessions = sessions
        self.feature = feature
        self.shuffle = shuffle
        self.seed = seed

    def __len__(self) -> int:
        return self.sessions.num_targets

    def batches(self, batch_size: int, shard_index: int, num_shards: int, epoch: int) -> Iterator[SessionParallelBatch]:
        _check_sharding(batch_size, shard_index, num_shards)
        items, offsets = self.sessions.items, self.sessions.offsets
        mine = _order(self.sessions.num_sessions, self.shuffle, self.seed, epoch)[shard_index::num_shards]  # (S_k,)
        starts, ends = offsets[mine], offsets[mine + 1]  # (S_k,)
        steps = -(-len(range(shard_index, self.sessions.num_targets, num_shards)) // batch_size)
        if steps == 0 or mine.numel() == 0:
            return
        lanes = batch_size
        first = torch.arange(lanes) % mine.numel()  # (B,) the lanes' first sessions
        cur, end = starts[first], ends[first]  # (B,) click index, session end per lane
        fresh = torch.ones(lanes, dtype=torch.bool)  # (B,)
        taken = lanes
        empty_dense = torch.zeros(lanes, 0)
        one = torch.ones(lanes, dtype=torch.int64)
        for _ in range(steps):
            sparse = KeyedJaggedTensor(keys=[self.feature], values=items[cur], lengths=one, stride=lanes)
            labels = items[cur + 1].to(torch.float32)[:, None]  # (B, 1)
            yield SessionParallelBatch(empty_dense, sparse, labels, fresh)
            cur = cur + 1
            done = cur + 1 >= end  # (B,) the lane's session has no target left
            k = int(done.sum())
            if k:
                nxt = (taken + torch.arange(k)) % mine.numel()  # (k,) the next sessions, wrapping around
                cur = cur.masked_scatter(done, starts[nxt])
                end = end.masked_scatter(done, ends[nxt])
                taken += k
            fresh = done


class SequenceSource:
    """Rows of whole sessions (windows of `max_len` clicks for longer ones); see the module docstring.

    Shard k of n takes rows order[k::n] (order: shuffled per (seed, epoch) when `shuffle`).
    `item_counts` (C,): the training clicks per item, on an evaluation split's source (the
    baselines of recps.tasks.next_item rank by them). `bucket` > 1 groups rows of similar length: each run of `bucket` batches of the shard is
    sorted by row length before it is cut into batches, and the batches are visited in a
    shuffled order (rsc15's training rows average 3 inputs but reach 57: a random batch of 128
    pads to 8.1 positions per real one, a bucketed one to 1.4, and SASRec trains 2.4x faster).
    """

    def __init__(self, sessions: Sessions, feature: str = "item", max_len: int | None = None,
                 shuffle: bool = True, seed: int = 0, bucket: int = 32,
                 item_counts: torch.Tensor | None = None) -> None:
        if max_len is not None and int(max_len) < 1:
            raise ConfigError(f"dataset.max_len={max_len}; use a positive length or null (whole sessions)")
        if bool((sessions.lengths < 2).any()):
            raise DataError(f"SequenceSource: {int((sessions.lengths < 2).sum())} sessions have fewer than 2 clicks "
                            "(nothing to predict); build the sessions with min_length >= 2")
        self.sessions = sessions
        self.feature = feature
        self.max_len = None if max_len is None else int(max_len)
        self.shuffle = shuffle
        self.seed = seed
        if int(bucket) < 1:
            raise ConfigError(f"SequenceSource: bucket={bucket}; use 1 (no length bucketing) or more batches")
        self.bucket = int(bucket)
        self.item_counts = item_counts  # (C,) training clicks per item: an evaluation split's baselines rank by it
        self.row_start, self.row_len, self.row_first = self._rows()  # (R,) each

    def _rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row: index of its first input click, its length, its first scored position."""
        starts = self.sessions.offsets[:-1]  # (S,)
        inputs = self.sessions.lengths - 1  # (S,)
        if self.max_len is None or inputs.numel() == 0 or int(inputs.max()) <= self.max_len:
            return starts, inputs, torch.zeros_like(inputs)
        cap = self.max_len
        head_len = inputs.clamp(max=cap)  # (S,)
        extra = (inputs - cap).clamp(min=0)  # (S,) targets beyond the first window
        owner = torch.repeat_interleave(torch.arange(starts.numel()), extra)  # (E,)
        first_extra = torch.cumsum(extra, 0) - extra  # (S,)
        j = torch.arange(owner.numel()) - first_extra[owner] + cap + 1  # (E,) target index in its session
        tail_start = starts[owner] + j - cap  # (E,)
        row_start = torch.cat([starts, tail_start])
        row_len = torch.cat([head_len, torch.full_like(tail_start, cap)])
        row_first = torch.cat([torch.zeros_like(head_len), torch.full_like(tail_start, cap - 1)])
        return row_start, row_len, row_first

    def __len__(self) -> int:
        return int(self.row_start.numel())

    def batches(self, batch_size: int, shard_index: int, num_shards: int, epoch: int) -> Iterator[Batch]:
        _check_sharding(batch_size, shard_index, num_shards)
        mine = _order(len(self), self.shuffle, self.seed, epoch)[shard_index::num_shards]  # (R_k,)
        if mine.numel() == 0:
            return
        if self.bucket > 1:
            # Rows of similar length share a batch (a batch pads to its longest row): sort each
            # window of `bucket` batches by length, then visit the batches in a shuffled order.
            window = batch_size * self.bucket
            parts = []
            for chunk in mine.split(window):
                parts.append(chunk[torch.sort(self.row_len[chunk], stable=True).indices])
            mine = torch.cat(parts)
            batches = list(mine.split(batch_size))
            visit = _order(len(batches), self.shuffle, self.seed + 1, epoch).tolist()
            batches = [batches[i] for i in visit]
        else:
            batches = list(mine.split(batch_size))
        for rows in batches:
            yield self._batch(rows)

    def _batch(self, rows: torch.Tensor) -> Batch:
        starts, lengths, first = self.row_start[rows], self.row_len[rows], self.row_first[rows]  # (B,) each
        b, n = rows.numel(), int(lengths.sum())
        row_of = torch.repeat_interleave(torch.arange(b), lengths, output_size=n)  # (N,)
        row_first_click = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths, output_size=n)  # (N,)
        pos = torch.arange(n) - row_first_click  # (N,) position in its row
        click = starts[row_of] + pos  # (N,) index of each input click
        items = self.sessions.items
        width = int(lengths.max()) if b else 0
        labels = torch.full((b, width), -1.0)  # (B, W)
        scored = pos >= first[row_of]  # (N,)
        labels[row_of[scored], pos[scored]] = items[click[scored] + 1].to(torch.float32)
        sparse = KeyedJaggedTensor(keys=[self.feature], values=items[click], lengths=lengths, stride=b)
        return Batch(torch.zeros(b, 0), sparse, labels)


def _bad_lines(caught: Sequence[warnings.WarningMessage]) -> list[str]:
    out = []
    for w in caught:
        out += [line.strip() for line in str(w.message).splitlines() if line.strip().startswith("Skipping line")]
    return out


def _ids(column: pd.Series, integer: bool) -> pd.Series:
    if not integer:
        return column
    return pd.to_numeric(column, errors="coerce")


def _seconds(column: pd.Series, time_format: str) -> pd.Series:
    """float64 seconds of a time column: a number as it is, or ISO-8601 text (NaN: unparsable)."""
    if time_format == "number":
        return pd.to_numeric(column, errors="coerce")
    stamps = pd.to_datetime(column.where(column != ""), utc=True, errors="coerce", format="ISO8601")
    return (stamps - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(seconds=1)


def _check_layout(paths: Any, header: Any, columns: Any, separator: Any, time_format: Any,
                  keys: dict[str, str], order_format: Any = "number") -> list[str] | None:
    """Validates the layout options (ConfigError naming the key and the files); returns the columns."""
    if order_format not in _TIME_FORMATS:
        raise ConfigError(f"dataset.order_format={order_format!r} (files {paths!r}); use 'number' (a timestamp or "
                          "sequence number, e.g. 1396860669.277 or 17) or 'datetime' (ISO-8601 text)")
    if not isinstance(header, bool):
        raise ConfigError(f"dataset.header={header!r} (files {paths!r}); use true (the first line names the "
                          "columns) or false (then dataset.columns names them)")
    if not isinstance(separator, str) or len(separator) != 1:
        raise ConfigError(f"dataset.separator={separator!r} (files {paths!r}); use one character, e.g. '\\t' or ','")
    if time_format not in _TIME_FORMATS:
        raise ConfigError(f"dataset.time_format={time_format!r} (files {paths!r}); use 'number' (seconds, e.g. "
                          "1396860669.277) or 'datetime' (ISO-8601 text, e.g. 2014-04-07T10:51:09.277Z)")
    if columns is None:
        if not header:
            raise ConfigError(f"dataset.header=false needs dataset.columns: every column of {paths!r} in file "
                              "order (e.g. [SessionId, Time, ItemId, Category] for yoochoose-clicks.dat)")
        return None
    if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
        raise ConfigError(f"dataset.columns={columns!r} (files {paths!r}); give a list of column names in file order")
    columns = list(columns)
    for key, name in keys.items():
        if name not in columns:
            raise ConfigError(f"dataset.{key}={name!r} is not among dataset.columns {columns} (files {paths!r}); "
                              f"set dataset.{key} to one of them")
    return columns


def read_clicks(
    paths: Any,
    session_key: str = "SessionId",
    item_key: str = "ItemId",
    time_key: str = "Time",
    separator: str = "\t",
    integer_ids: bool = True,
    error_budget: float | int = 0.001,
    header: bool = True,
    columns: Sequence[str] | None = None,
    time_format: str = "number",
    order_key: str | None = None,
    order_format: str = "number",
) -> pd.DataFrame:
    """Reads click files (local paths or fsspec URLs) into a frame sorted by (session, order).

    Layout: `separator` (one character); `header` True: the first line names the columns
    (with `columns` given too, that line is skipped and `columns` name them instead), False:
    `columns` names every column in file order; `time_format` "number" (seconds) or "datetime"
    (ISO-8601 text, read as seconds since 1970 UTC). `order_key`: the column that orders a
    session's clicks (a timestamp or sequence number; `order_format` as time_format's), when
    it is not the time column (None: the time orders them).

    Returns columns `session`, `item` (int64 when `integer_ids`, else strings) and `time`
    (float64 seconds, what the splits read), rows sorted by session, then order (stable: ties keep
    file order). Raises DataError when the bad rows exceed `error_budget` (a fraction of the rows
    when a float in [0, 1], else a count).
    """
    if isinstance(error_budget, bool) or not isinstance(error_budget, (int, float)) or error_budget < 0 or (
            isinstance(error_budget, float) and error_budget > 1):
        raise ConfigError(f"dataset.error_budget={error_budget!r}; use a fraction in [0, 1] or a row count >= 0")
    if order_key is not None and (not isinstance(order_key, str) or not order_key):
        raise ConfigError(f"dataset.order_key={order_key!r} (files {paths!r}); name the column that orders a "
                          "session's clicks, or null (the time column orders them)")
    used = {"session_key": session_key, "item_key": item_key, "time_key": time_key}
    if order_key is not None:
        used["order_key"] = order_key
    names = _check_layout(paths, header, columns, separator, time_format, used, order_format)
    files = expand_paths(paths)
    if not files:
        raise ConfigError(f"no click files at {paths!r}; check the dataset's train/test paths")
    first_row_line = 2 if header else 1
    frames, examples, n_bad, rows = [], [], 0, 0
    for path in files:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                frame = pd.read_csv(path, sep=separator, dtype=str, on_bad_lines="warn", keep_default_na=False,
                                    header=0 if header else None, names=names, index_col=False)
            except FileNotFoundError as exc:
                raise DataError(f"click file {path} does not exist; check the dataset's train/test paths") from exc
        missing = [c for c in used.values() if c not in frame.columns]
        if missing:
            raise DataError(f"{path}: no columns {missing} in the header {list(frame.columns)}; set the dataset's "
                            f"{' / '.join(used)} (and separator, or header=false with columns)")
        skipped = _bad_lines(caught)  # wrong field counts: pandas skipped them
        part = pd.DataFrame({
            "session": _ids(frame[session_key], integer_ids),
            "item": _ids(frame[item_key], integer_ids),
            "time": _seconds(frame[time_key], time_format),
        })
        if order_key is not None:
            part["order"] = _seconds(frame[order_key], order_format)
        broken = (part.isna().any(axis=1) | (frame[[session_key, item_key]] == "").any(axis=1)).to_numpy()
        n_bad += len(skipped) + int(broken.sum())
        examples += [f"{path}: {line}" for line in skipped[:_MAX_IN_MESSAGE]]
        # Row r of the frame is about line r + first_row_line (skipped lines shift it).
        kind = "numeric" if time_format == "number" else "ISO-8601 time"
        examples += [f"{path}: row {r + first_row_line}: a missing or non-{kind} value"
                     for r in np.flatnonzero(broken)[:_MAX_IN_MESSAGE]]
        rows += len(frame) + len(skipped)
        frames.append(part[~broken])
    clicks = pd.concat(frames, ignore_index=True)
    if n_bad:
        quoted = "; ".join(examples[:_MAX_IN_MESSAGE])
        limit = error_budget * rows if isinstance(error_budget, float) else error_budget
        if n_bad > limit:
            raise DataError(f"{n_bad} bad rows of {rows} in {files} exceed dataset.error_budget={error_budget} "
                            f"(e.g. {quoted}); fix the files or raise the budget")
        log.warning("skipped %d bad rows of %d in %s (e.g. %s)", n_bad, rows, files, quoted)
    if integer_ids:
        clicks = clicks.astype({"session": np.int64, "item": np.int64})
    if order_key is None:
        return clicks.sort_values(["session", "time"], kind="stable", ignore_index=True)
    return clicks.sort_values(["session", "order"], kind="stable", ignore_index=True).drop(columns="order")


def split_last_days(clicks: pd.DataFrame, days: float,
                    key: str = "dataset.test_days") -> tuple[pd.DataFrame, pd.DataFrame]:
    """(train, test) clicks: a session is test when its last click is at or after the latest
    click minus `days` x 86,400 s (GRU4Rec's rsc15 preparation with days=1; SR-GNN's split).

    `clicks` as `read_clicks` returns them; whole sessions go to one side, each keeps its order.
    `key` names the setting in an error (dataset.test_days, dataset.valid_days).
    """
    if isinstance(days, bool) or not isinstance(days, (int, float)) or not days > 0:
        raise ConfigError(f"{key}={days!r}; use a positive number of days (or null)")
    if len(clicks) == 0:
        return clicks, clicks
    ends = clicks.groupby("session", sort=False)["time"].transform("max").to_numpy()  # (M,) the session's last click
    test = ends >= float(clicks["time"].max()) - float(days) * DAY_SECONDS  # (M,)
    return clicks[~test].reset_index(drop=True), clicks[test].reset_index(drop=True)


def read_train_test(name: str, train: Sequence[str | os.PathLike], test: Sequence[str | os.PathLike],
                    test_days: float | None = None, **read: Any) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(train, test) clicks of a dataset config: `test` files, or the last `test_days` days of
    `train` (`split_last_days`); `read`: `read_clicks`' layout arguments."""
    if test_days is None:
        if not test:
            raise ConfigError(f"dataset {name!r} has no test files; set dataset.test, or dataset.test_days=N to "
                              "hold out the sessions of the last N days of dataset.train")
        return read_clicks(list(train), **read), read_clicks(list(test), **read)
    if test:
        raise ConfigError(f"dataset {name!r}: dataset.test_days={test_days!r} splits dataset.train, but dataset.test "
                          f"also names {list(map(str, test))}; set dataset.test=[] or dataset.test_days=null")
    clicks = read_clicks(list(train), **read)
    train_clicks, test_clicks = split_last_days(clicks, test_days)
    log.info("dataset %s: the last %s days hold %d of %d sessions (test)", name, test_days,
             test_clicks["session"].nunique(), clicks["session"].nunique())
    return train_clicks, test_clicks


def build_sessions(clicks: pd.DataFrame, vocabulary: ItemVocabulary, min_length: int = 2) -> Sessions:
    """Sessions of `clicks` (sorted by session, time) over `vocabulary`: clicks on unknown items
    are dropped, then sessions shorter than `min_length`."""
    ids = vocabulary.encode(clicks["item"].to_numpy())  # (M,)
    known = ids >= 0
    sessions = clicks["session"].to_numpy()[known]
    ids = ids[known]
    if ids.size == 0:
        return Sessions(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), sessions[:0])
    first = np.flatnonzero(np.r_[True, sessions[1:] != sessions[:-1]])  # (S,)
    lengths = np.diff(np.r_[first, ids.size])  # (S,)
    keep = lengths >= min_length
    ids = ids[np.repeat(keep, lengths)]
    lengths = lengths[keep]
    offsets = np.r_[0, np.cumsum(lengths)]
    return Sessions(torch.from_numpy(ids), torch.from_numpy(offsets.astype(np.int64)), sessions[first[keep]])


@dataclass
class SessionData:
    """What `recps.job` trains and evaluates on: as `PreparedData`, plus the vocabulary.

    train: the batching the model asks for; test: a non-shuffled `SequenceSource` of the split the
    run evaluates on: the test split, or with `valid_days` the validation split (`evaluated_on`
    says which; test_sessions then holds the validation sessions).
    num_embeddings: C, the rows the item table needs (ids are 0..C-1).
    """

    schema: Schema
    vocabulary: ItemVocabulary
    train_sessions: Sessions
    test_sessions: Sessions
    train: SessionParallelSource | SequenceSource
    test: SequenceSource
    best_auc: float | None = None
    evaluated_on: str = "test"

    @property
    def num_embeddings(self) -> int:
        return len(self.vocabulary)


def prepare_sessions(
    name: str,
    train: Sequence[str | os.PathLike],
    test: Sequence[str | os.PathLike],
    batching: str = "sequences",
    max_len: int | None = None,
    feature: str = "item",
    session_key: str = "SessionId",
    item_key: str = "ItemId",
    time_key: str = "Time",
    separator: str = "\t",
    integer_ids: bool = True,
    min_length: int = 2,
    shuffle: bool = True,
    bucket: int = 32,
    error_budget: float | int = 0.001,
    seed: int = 0,
    header: bool = True,
    columns: Sequence[str] | None = None,
    time_format: str = "number",
    test_days: float | None = None,
    order_key: str | None = None,
    order_format: str = "number",
    valid_days: float | None = None,
) -> SessionData:
    """Reads train and test click files into sessions and builds the sources.

    Args:
        batching: "session_parallel" (GRU4Rec's training) or "sequences" (SASRec's).
        max_len: L, the most clicks a sequence row holds (SASRec's positions); None: whole sessions.
        bucket: sequence rows of similar length share a batch (see `SequenceSource`).
        test_days: None: `test` files are the test split; N: `test` must be empty and the
            sessions of `train` whose last click is within the last N days are (`split_last_days`).
        valid_days: None: the run evaluates on the test split; V: the sessions of the training
            clicks (what test_days left) ending within their last V days are the validation split,
            held out of training, and the run evaluates on it instead (see the module docstring).
        order_key, order_format: the column that orders a session's clicks when the time column
            (`time_key`, what the splits read) does not (see `read_clicks`).
        Others: the file layout (see `read_clicks`), `min_length` of a kept session, `shuffle`
        the training order per epoch, `seed`.
    """
    if batching not in _BATCHINGS:
        raise ConfigError(f"dataset.batching={batching!r}; use one of {_BATCHINGS} (the model config sets it: "
                          "GRU4Rec trains session-parallel, SASRec on sequences)")
    read = dict(session_key=session_key, item_key=item_key, time_key=time_key, separator=separator,
                integer_ids=integer_ids, error_budget=error_budget, header=header, columns=columns,
                time_format=time_format, order_key=order_key, order_format=order_format)
    train_clicks, test_clicks = read_train_test(name, train, test, test_days, **read)
    split = "test"
    if valid_days is not None:
        everything = train_clicks["session"].nunique()
        train_clicks, test_clicks = split_last_days(train_clicks, valid_days, "dataset.valid_days")
        split = "validation"
        log.info("dataset %s: the validation split is the last %s days of the training clicks, %d of their %d "
                 "sessions; the run trains on the rest and evaluates on it, not on the test split "
                 "(dataset.valid_days=%s)", name, valid_days, test_clicks["session"].nunique(), everything, valid_days)
    vocabulary = ItemVocabulary.from_items(train_clicks["item"].to_numpy())
    if len(vocabulary) >= MAX_ITEMS:
        raise DataError(f"dataset {name!r} has {len(vocabulary)} items; labels hold ids exactly below {MAX_ITEMS}")
    train_sessions = build_sessions(train_clicks, vocabulary, min_length)
    test_sessions = build_sessions(test_clicks, vocabulary, min_length)
    if train_sessions.num_sessions == 0 or test_sessions.num_sessions == 0:
        raise DataError(f"dataset {name!r}: {train_sessions.num_sessions} train / {test_sessions.num_sessions} {split} "
                        f"sessions with >= {min_length} known clicks; check the files and min_length"
                        + (", or give dataset.valid_days more days" if split == "validation" else ""))
    log.info("dataset %s: %d items; train %d sessions, %d clicks; %s %d sessions, %d clicks (%d next-click targets)",
             name, len(vocabulary), train_sessions.num_sessions, train_sessions.num_clicks, split,
             test_sessions.num_sessions, test_sessions.num_clicks, test_sessions.num_targets)
    if batching == "session_parallel":
        train_source = SessionParallelSource(train_sessions, feature, shuffle, seed)
    else:
        train_source = SequenceSource(train_sessions, feature, max_len, shuffle, seed, bucket)  # type: ignore[assignment]
    schema = Schema(labels=("next_item",), sequence=(feature,), separator=separator)
    evaluation = SequenceSource(test_sessions, feature, max_len, shuffle=False, seed=seed, bucket=bucket,
                                item_counts=train_sessions.item_counts(len(vocabulary)))
    return SessionData(schema, vocabulary, train_sessions, test_sessions, train_source, evaluation,
                       evaluated_on=split)
