"""One reader for every tabular format: Criteo raw text, CSV (with or without a header), Parquet.

A `Schema` says which columns are labels, dense inputs, single-valued sparse slots and
multi-valued sequence slots; the reader turns files into `Batch(dense, sparse, labels)`:

    dense   (B, I) float32   missing -> 0, then schema.dense_transform (log1p: sign(x)*log1p(|x|))
    sparse  KeyedJaggedTensor, keys = schema.feature_names (sparse slots, then sequences),
            feature-major: feature 0's B lengths, then feature 1's, ...; values int64 keys
            (hashed per slot, see recps.data.hashing); a sparse slot always has length 1
            (a missing value gets the slot's "missing" key); a sequence has 0..L keys.
    labels  (B, T) float32

Pipeline (no Python loop per row): a background thread reads blocks of whole lines (or
Parquet record batches); a pool of `threads` parses blocks with pyarrow and converts this
shard's rows (casts numbers, hashes strings column by column); the iterating thread puts
blocks back in file order, keeps the books (row index, bad rows, budget) and slices rows
into batches.

Sharding: shard k of n keeps the rows whose global row index (counting parsed rows over
all files, in order) satisfies index % n == k; the n shards partition the data exactly.
A line with the wrong number of fields belongs to the shard with line_number % n == k.

Bad rows (wrong field count, a non-numeric dense or label value, a missing label, a dense
or label value that overflows float32, the training dtype (1e308), a label outside
schema.label_range (the task's: binary [0, 1]), a non-integer key when schema.hash_values is
False) are skipped, counted and logged with their file and line. When the bad rows exceed
`error_budget` the reader raises DataError.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "a.csv").write_text("y,x,c\\n1,2.5,a\\n0,,b\\n")
    >>> schema = Schema(labels=("y",), dense=("x",), sparse=("c",))
    >>> [b.batch_size for b in TabularReader([d / "a.csv"], schema, batch_size=1)]
    [1, 1]
    >>> ex = load_tensors(d / "a.csv", schema)
    >>> ex.dense.tolist(), ex.labels.tolist(), ex.keys.shape
    ([[2.5], [0.0]], [[1.0], [0.0]], torch.Size([2, 1]))
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import queue
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import fsspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import torch
from fsspec.implementations.local import LocalFileSystem
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recps.data.batch import Batch
from recps.data.hashing import hash_strings
from recps.data.schema import Schema
from recps.errors import ConfigError, DataError

__all__ = ["Examples", "TabularReader", "TensorBatches", "ReaderStats", "load_tensors", "empty_examples", "expand_paths"]

log = logging.getLogger(__name__)

_BLOCK_SIZE = 4 << 20  # bytes of text pyarrow parses at a time (~16k Criteo rows)
_PARQUET_BATCH = 65536  # rows per Parquet record batch
_MISMATCH_LINES = 1000  # this many leading bad lines in a file = the schema does not fit it
_MIN_ROWS_FOR_FRACTION = 10_000  # a fractional budget is judged mid-stream only past this many rows
_MAX_LOGGED = 20  # bad rows logged one by one per iteration; the rest are counted
_MAX_IN_MESSAGE = 3  # bad rows quoted in the budget error
_QUEUE_DEPTH = 2  # blocks the read thread may run ahead


# ----------------------------------------------------------------------------- rows in memory


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor; numpy's strided copy is ~5x faster than torch's for
    transposed int64 (26 us against 110 us for (512, 26))."""
    if x.is_contiguous():
        return x
    if x.device.type != "cpu":
        return x.contiguous()
    return torch.from_numpy(np.ascontiguousarray(x.numpy()))


def _cat_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenates (M_i, C) tensors along rows, keeping the first one's column-major layout."""
    first = parts[0]
    if first.dim() == 2 and first.shape[1] > 1 and first.stride(0) == 1:
        return torch.cat([p.t() for p in parts], dim=1).t()  # (C, M) storage, (M, C) view
    return torch.cat(list(parts))


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=out[1:])
    return out  # (N + 1,)


@dataclass(frozen=True)
class Examples:
    """Parsed rows held in memory (N rows); what `load_tensors` returns and batches come from.

    Attributes:
        feature_names: the KJT keys: the S single-valued slots, then the Q sequence slots.
        dense: (N, I) float32, transformed.
        keys: (N, S) int64, one key per single-valued slot.
        labels: (N, T) float32.
        seq_lengths: Q tensors (N,) int64, keys per row of each sequence slot.
        seq_values: Q tensors (V_q,) int64, the keys of each sequence slot, row after row.
    """

    feature_names: tuple[str, ...]
    dense: torch.Tensor
    keys: torch.Tensor
    labels: torch.Tensor
    seq_lengths: tuple[torch.Tensor, ...] = ()
    seq_values: tuple[torch.Tensor, ...] = ()

    def __post_init__(self) -> None:
        # (N + 1,) per sequence slot: where each row's keys begin in seq_values.
        object.__setattr__(self, "_seq_offsets", tuple(_offsets(x) for x in self.seq_lengths))

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def select(self, rows: slice | torch.Tensor | np.ndarray) -> "Examples":
        """The rows `rows` (a slice with step 1, or an index tensor), in that order."""
        if isinstance(rows, slice):
            start, stop, step = rows.indices(len(self))
            if step == 1:
                stop = max(start, stop)
                seq_values = [values[int(offsets[start]):int(offsets[stop])]
                              for offsets, values in zip(self._seq_offsets, self.seq_values)]
                return dataclasses.replace(
                    self,
                    dense=self.dense[start:stop],
                    keys=self.keys[start:stop],
                    labels=self.labels[start:stop],
                    seq_lengths=tuple(x[start:stop] for x in self.seq_lengths),
                    seq_values=tuple(seq_values),
                )
            rows = torch.arange(start, stop, step)
        # index_select, not rows-indexing: tensor[idx] costs ~25 ms on (200k, 26) in torch 2.13 CPU.
        rows = torch.as_tensor(rows, dtype=torch.int64)
        seq_lengths, seq_values = [], []
        for lengths, values, offsets in zip(self.seq_lengths, self.seq_values, self._seq_offsets):
            starts = offsets.index_select(0, rows)  # (M,) where each selected row's keys begin
            picked = lengths.index_select(0, rows)  # (M,)
            # Position of every output key in `values`: its row's start plus its rank in the row.
            out_starts = _offsets(picked)[:-1]  # (M,)
            gather = torch.repeat_interleave(starts - out_starts, picked) + torch.arange(int(picked.sum()))
            seq_lengths.append(picked)
            seq_values.append(values.index_select(0, gather))
        return dataclasses.replace(
            self,
            dense=self.dense.index_select(0, rows),
            keys=self.keys.index_select(0, rows),
            labels=self.labels.index_select(0, rows),
            seq_lengths=tuple(seq_lengths),
            seq_values=tuple(seq_values),
        )

    @staticmethod
    def cat(parts: Sequence["Examples"]) -> "Examples":
        """Concatenates rows of examples that share feature names."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        return Examples(
            feature_names=first.feature_names,
            dense=_cat_rows([p.dense for p in parts]),
            keys=_cat_rows([p.keys for p in parts]),
            labels=_cat_rows([p.labels for p in parts]),
            seq_lengths=tuple(torch.cat([p.seq_lengths[q] for p in parts]) for q in range(len(first.seq_lengths))),
            seq_values=tuple(torch.cat([p.seq_values[q] for p in parts]) for q in range(len(first.seq_values))),
        )

    def to_batch(self) -> Batch:
        """All rows as one Batch (B = N); the KJT is feature-major."""
        b = len(self)
        values = [_contiguous(self.keys.t()).view(-1)]  # (S * B,) slot 0's B keys, then slot 1's, ...
        lengths = [torch.ones(self.keys.shape[1] * b, dtype=torch.int64)]  # (S * B,)
        values.extend(self.seq_values)
        lengths.extend(self.seq_lengths)
        sparse = KeyedJaggedTensor(
            keys=list(self.feature_names),
            values=torch.cat(values) if len(values) > 1 else values[0],
            lengths=torch.cat(lengths) if len(lengths) > 1 else lengths[0],
            stride=b,
        )
        return Batch(dense=_contiguous(self.dense), sparse=sparse, labels=_contiguous(self.labels))

    def row_major(self) -> "Examples":
        """The same rows with dense, keys and labels stored row by row (fast random row access)."""
        return dataclasses.replace(self, dense=_contiguous(self.dense), keys=_contiguous(self.keys),
                                   labels=_contiguous(self.labels))


class TensorBatches:
    """Batches sliced from pre-parsed `Examples`, with no per-example Python work.

    Shard k of n takes rows k, k + n, k + 2n, ... (the same rule as TabularReader).
    With shuffle=True, each iteration draws a new order from (seed, shard, epoch); `seed_shard`
    names another shard for it (a worker's rows alone: recps.data.dataset.WorkerExamplesSource).

    Example:
        >>> ex = Examples(("c",), torch.zeros(5, 0), torch.arange(5).view(5, 1), torch.zeros(5, 1))
        >>> [b.sparse.values().tolist() for b in TensorBatches(ex, 2, shard_index=1, num_shards=2)]
        [[1, 3]]
    """

    def __init__(
        self,
        examples: Examples,
        batch_size: int,
        *,
        shard_index: int = 0,
        num_shards: int = 1,
        drop_last: bool = False,
        shuffle: bool = False,
        seed: int = 0,
        seed_shard: int | None = None,
    ) -> None:
        _check_batching(batch_size, shard_index, num_shards)
        self.examples = examples
        self.seed_shard = shard_index if seed_shard is None else seed_shard  # the shard the order is drawn for
        self.batch_size = batch_size
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self._has_seq = bool(examples.seq_lengths)

    def __len__(self) -> int:
        rows = len(range(self.shard_index, len(self.examples), self.num_shards))
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        ex = self.examples
        rows = torch.arange(self.shard_index, len(ex), self.num_shards)  # (R,)
        if self.shuffle:
            g = torch.Generator().manual_seed(_seed(self.seed, self.seed_shard, self.epoch))
            rows = rows.index_select(0, torch.randperm(rows.numel(), generator=g))
        self.epoch += 1
        contiguous = not self.shuffle and self.num_shards == 1
        n = rows.numel()
        stop = n - n % self.batch_size if self.drop_last else n
        for i in range(0, stop, self.batch_size):
            if contiguous:
                yield ex.select(slice(i, min(i + self.batch_size, n))).to_batch()
            elif not self._has_seq:
                idx = rows[i:i + self.batch_size]
                yield Examples(ex.feature_names, ex.dense.index_select(0, idx), ex.keys.index_select(0, idx),
                               ex.labels.index_select(0, idx)).to_batch()
            else:
                yield ex.select(rows[i:i + self.batch_size]).to_batch()


def _seed(seed: int, shard: int, epoch: int) -> int:
    return int(np.random.SeedSequence([seed, shard, epoch]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def _check_batching(batch_size: int, shard_index: int, num_shards: int) -> None:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r} must be a positive integer")
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ConfigError(f"num_shards={num_shards!r} must be a positive integer")
    if not isinstance(shard_index, int) or not 0 <= shard_index < num_shards:
        raise ConfigError(f"shard_index={shard_index!r} must be in [0, num_shards={num_shards})")


# ----------------------------------------------------------------------------- files


@dataclass(frozen=True)
class _Source:
    name: str  # what messages show: the local path or the URL
    fs: Any  # fsspec filesystem
    path: str  # path inside fs

    @property
    def local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)


def _is_data_file(path: str) -> bool:
    """False for Hadoop's side files (_SUCCESS, .part.crc, _temporary/...) and hidden files."""
    return not any(part.startswith((".", "_")) for part in path.strip("/").split("/") if part)


def _resolve(paths: Any) -> list[_Source]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise DataError("no input files: the dataset path list is empty; set the dataset path")
    sources: list[_Source] = []
    for spec in paths:
        fs, path = fsspec.core.url_to_fs(spec)
        name = (lambda p: p) if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol
        if any(ch in spec for ch in "*?["):
            matches = fs.glob(path, detail=True)  # one listing, not one call per file
            found = sorted(p for p, info in matches.items()
                           if info.get("type") == "file" and _is_data_file(p.rsplit("/", 1)[-1]))
            if not found:
                raise DataError(f"{spec}: the pattern matches no file; check the dataset path")
        elif fs.isdir(path):
            root = path.rstrip("/")
            found = sorted(p for p in fs.find(path) if _is_data_file(p[len(root):]))
            if not found:
                raise DataError(f"{spec}: the folder holds no data file; check the dataset path")
        elif fs.exists(path):
            found = [path]
        else:
            raise DataError(f"{spec}: no such file; check the dataset path")
        sources.extend(_Source(name(p), fs, p) for p in found)
    return sources


def expand_paths(paths: Any) -> list[str]:
    """The files a list of paths / globs / folders / fsspec URLs names, in reading order.

    Raises DataError for a path that does not exist or a pattern that matches nothing.
    Files whose name starts with "." or "_" (_SUCCESS, .crc) are skipped inside folders.
    """
    return [s.name for s in _resolve(paths)]


def _open_binary(src: _Source) -> Any:
    """A readable binary stream; decompresses .gz/.bz2/.zst by extension."""
    if src.local:
        return pa.input_stream(src.path, compression="detect")
    return src.fs.open(src.path, "rb", compression="infer")


def _check_not_empty(src: _Source) -> None:
    try:
        size = src.fs.size(src.path)
    except (OSError, ValueError) as e:
        raise DataError(f"{src.name}: cannot read the file ({e}); check the path and permissions") from None
    if size == 0:
        raise DataError(f"{src.name}: the file is empty; remove it from the dataset paths or regenerate it")


# ----------------------------------------------------------------------------- column parsing


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _parse_floats(arr: pa.Array, column: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values float64 with NaN for missing, missing mask, bad mask) of one column, all (N,)."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if _is_text(arr.type):
        try:
            values = pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False)
        except pa.ArrowInvalid:  # some value is not a number: find which, vectorized
            raw = arr.to_numpy(zero_copy_only=False)
            values = np.asarray(pd.to_numeric(raw, errors="coerce"), dtype=np.float64)
            spelled_nan = pc.fill_null(pc.match_substring_regex(arr, r"^\s*[+-]?nan\s*$", ignore_case=True), False)
            unparsed = ~pd.isna(raw) & np.isnan(values) & ~spelled_nan.to_numpy(zero_copy_only=False)
            values[unparsed] = np.inf  # reported as bad below
    elif pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_boolean(arr.type):
        values = pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False)
    else:
        raise DataError(f"column {column} has type {arr.type}, not numbers; fix dataset.schema (dense/labels) or the file")
    values = np.asarray(values, dtype=np.float64)
    missing = np.isnan(values)
    bad = np.isinf(values)
    return values, missing, bad


def _parse_ints(arr: pa.Array, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(int64 values with 0 for missing, bad mask) of one key column, both (N,)."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if pa.types.is_integer(arr.type):
        return pc.fill_null(pc.cast(arr, pa.int64()), 0).to_numpy(zero_copy_only=False), np.zeros(len(arr), bool)
    if not _is_text(arr.type):
        raise DataError(
            f"column {column} has type {arr.type}, not integer keys; set dataset.schema.hash_values=true or fix the file"
        )
    try:
        values = pc.cast(arr, pa.int64())
        bad = np.zeros(len(arr), bool)
    except pa.ArrowInvalid:  # some value is not an integer: null those, flag their rows
        trimmed = pc.utf8_trim_whitespace(arr)
        ok = pc.match_substring_regex(trimmed, r"^[+-]?[0-9]{1,18}$")
        bad = (pc.fill_null(pc.invert(ok), False)).to_numpy(zero_copy_only=False)
        values = pc.cast(pc.if_else(ok, trimmed, pa.scalar(None, pa.string())), pa.int64())
    return pc.fill_null(values, 0).to_numpy(zero_copy_only=False), np.asarray(bad, bool)


def _split_sequence(arr: pa.Array, separator: str) -> tuple[pa.Array, np.ndarray]:
    """(flat non-empty elements, parent row of each element) of a sequence column."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        lists = arr
    else:
        if not _is_text(arr.type):
            arr = pc.cast(arr, pa.string())
        lists = pc.split_pattern(arr, pattern=separator)
    flat = pc.list_flatten(lists)
    parents = pc.list_parent_indices(lists).to_numpy(zero_copy_only=False)
    if _is_text(flat.type):
        keep = pc.fill_null(pc.greater(pc.utf8_length(flat), 0), False)
    else:
        keep = pc.is_valid(flat)
    if not pc.all(keep).as_py():
        keep_np = keep.to_numpy(zero_copy_only=False)
        flat = flat.filter(keep)
        parents = parents[keep_np]
    return flat, parents


# ----------------------------------------------------------------------------- the reader


@dataclass
class ReaderStats:
    """Counts of one iteration of a reader (this shard only)."""

    rows: int = 0  # rows kept
    all_rows: int = 0  # well-formed rows read, every shard's (the files' total)
    bad_rows: int = 0  # rows skipped
    files: int = 0  # files finished
    first_bad: list[str] = dataclasses.field(default_factory=list)  # "file:line (reason)" of the first few


@dataclass
class _FileState:
    """Per-file bookkeeping, touched only by the thread that iterates the reader."""

    src: _Source
    names: tuple[str, ...] = ()  # text: the columns of a line (header or schema.columns)
    fields: int = 0  # columns a text line must have
    rows: int = 0  # well-formed rows parsed so far
    dropped: list = dataclasses.field(default_factory=list)  # (line, fields) of the first wrong-width lines


@dataclass
class _Block:
    """One piece of one file as read: text lines (whole lines only) or a Parquet record batch."""

    state: _FileState
    index: int  # block number within the file
    first: int  # text: physical line number of its first line (1-based); Parquet: row offset in the file
    data: bytes | None = None  # text
    batch: pa.RecordBatch | None = None  # Parquet
    end: bool = False  # the file ends here (no data)


@dataclass
class _Parsed:
    block: _Block
    batch: pa.RecordBatch | None  # well-formed rows, needed columns as strings (text) or native types
    dropped: list  # (physical line, fields, text) of wrong-width lines
    error: str | None = None


@dataclass
class _Converted:
    examples: Examples
    bad: int  # rows dropped by conversion
    reports: list  # (place, reason, row text) of the first few


class _Stop(Exception):
    pass


def _prefetch(items: Iterator[Any], name: str, timeout_s: float) -> Iterator[Any]:
    """Runs `items` in a daemon thread, `_QUEUE_DEPTH` items ahead of the consumer.

    Exceptions travel to the consumer; closing the consumer stops the producer. A gap of
    more than `timeout_s` between two items raises DataError.
    """
    q: queue.Queue = queue.Queue(maxsize=_QUEUE_DEPTH)
    stop = threading.Event()
    done = object()

    def put(item: Any) -> None:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.2)
                return
            except queue.Full:
                continue
        raise _Stop

    def produce() -> None:
        try:
            for item in items:
                put((True, item))
            put((True, done))
        except _Stop:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            try:
                put((False, e))
            except _Stop:
                pass
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        waited = 0.0
        while True:
            try:
                ok, item = q.get(timeout=0.5)
            except queue.Empty:
                waited += 0.5
                if not thread.is_alive() and q.empty():
                    raise DataError(f"{name} stopped without finishing; see the log above") from None
                if waited >= timeout_s:
                    raise DataError(
                        f"{name}: no data for {timeout_s:.0f} s; check the file system, or raise the reader's timeout_s"
                    ) from None
                continue
            waited = 0.0
            if not ok:
                raise item
            if item is done:
                return
            yield item
    finally:
        stop.set()
        thread.join(timeout=5.0)


def _skipped_lines(first: int, data: bytes, dropped: Sequence[int]) -> np.ndarray:
    """Sorted physical line numbers in a text block that produced no row: blank or wrong-width."""
    raw = np.frombuffer(data, np.uint8)
    ends = np.flatnonzero(raw == 10)  # (L,) where each line's newline is
    starts = np.concatenate([[0], ends[:-1] + 1])
    width = ends - starts
    blank = (width == 0) | ((width == 1) & (raw[np.minimum(starts, len(raw) - 1)] == 13))
    return np.union1d(first + np.flatnonzero(blank), np.asarray(dropped, dtype=np.int64))


def _lines_of_rows(first: int, ordinals: np.ndarray, skipped: np.ndarray) -> np.ndarray:
    """Physical lines of the rows with these ordinals in a block (ordinal r: the r-th row parsed).

    Row r sits on the smallest line L with L - first - #(skipped lines <= L) = r.
    """
    target = first + ordinals
    lines = target.copy()
    while True:
        again = target + np.searchsorted(skipped, lines, side="right")
        if np.array_equal(again, lines):
            return lines
        lines = again


class TabularReader:
    """Streams `Batch`es from text (Criteo, CSV) or Parquet files described by a Schema.

    Args:
        paths: a path, URL (file://, hdfs://, s3://, ...), glob or folder, or a list of them;
            files are read in the given order (globs and folders sorted).
        schema: the columns and parsing options.
        batch_size: B; the last batch may be smaller unless drop_last.
        shard_index, num_shards: this reader keeps rows with global index % num_shards == shard_index.
        shard_width: ... with (global index // shard_width) % num_shards == shard_index instead: runs of
            shard_width rows (a worker of num_shards keeps the rows of its shard_width threads' shards).
        error_budget: bad rows tolerated: a float in [0, 1] is a fraction of the rows read
            (judged after 10,000 rows and at the end), an int >= 0 a count.
        drop_last: drop the last incomplete batch.
        shuffle_buffer: shuffle rows within consecutive windows of at least this many rows
            (0: file order); a window holds whole blocks (about 16k Criteo rows each).
        seed: shuffling seed; each iteration (epoch) draws a new order from (seed, shard, epoch).
        threads: threads that parse and convert blocks in parallel (results stay in file order).
        block_size: bytes of text parsed as one block (whole lines; a longer line grows it).
        timeout_s: longest wait for the next block before raising DataError.

    Text lines must not contain newlines inside quoted values. Iterating yields batches;
    `stats` then holds the counts of that iteration.
    """

    def __init__(
        self,
        paths: Any,
        schema: Schema,
        batch_size: int,
        *,
        shard_index: int = 0,
        num_shards: int = 1,
        shard_width: int = 1,
        error_budget: float | int = 0.01,
        drop_last: bool = False,
        shuffle_buffer: int = 0,
        seed: int = 0,
        threads: int = 2,
        block_size: int = _BLOCK_SIZE,
        timeout_s: float = 600.0,
    ) -> None:
        _check_batching(batch_size, shard_index, num_shards)
        if isinstance(error_budget, bool) or not isinstance(error_budget, (int, float)):
            raise ConfigError(f"dataset.error_budget={error_budget!r} must be a fraction in [0, 1] or a row count")
        if isinstance(error_budget, float) and not 0.0 <= error_budget <= 1.0:
            raise ConfigError(
                f"dataset.error_budget={error_budget!r}: a float is a fraction of rows and must be in [0, 1]; "
                f"write an integer for a row count"
            )
        if isinstance(error_budget, int) and error_budget < 0:
            raise ConfigError(f"dataset.error_budget={error_budget!r} must be >= 0")
        if shuffle_buffer < 0:
            raise ConfigError(f"shuffle_buffer={shuffle_buffer!r} must be >= 0")
        if threads < 1 or block_size < 1:
            raise ConfigError(f"threads={threads!r} and block_size={block_size!r} must be positive")
        if isinstance(shard_width, bool) or not isinstance(shard_width, int) or shard_width < 1:
            raise ConfigError(f"shard_width={shard_width!r} must be a positive integer (rows per run of a shard)")
        if schema.format != "parquet" and not schema.header and not schema.columns:
            raise ConfigError(
                "dataset.schema.header=false needs dataset.schema.columns (every column in file order); set it"
            )
        self.sources = _resolve(paths)
        self.schema = schema
        self.batch_size = batch_size
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.shard_width = shard_width
        self.error_budget = error_budget
        self.drop_last = drop_last
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.threads = threads
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.epoch = 0
        self.stats = ReaderStats()
        self._needed = list(schema.labels + schema.dense + schema.sparse + schema.sequence)
        self._logged = 0

    # -- public ------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        b = self.batch_size
        carry: Examples | None = None  # fewer than B rows left over from earlier chunks
        for chunk in self._windows():
            start = 0
            if carry is not None:  # top the carry up to one batch from this chunk's head
                start = min(b - len(carry), len(chunk))
                carry = Examples.cat([carry, chunk.select(slice(0, start))])
                if len(carry) < b:
                    continue
                yield carry.to_batch()
                carry = None
            stop = start + (len(chunk) - start) // b * b
            for i in range(start, stop, b):  # batches are views of the chunk until to_batch
                yield chunk.select(slice(i, i + b)).to_batch()
            if stop < len(chunk):
                carry = chunk.select(slice(stop, len(chunk)))
        if carry is not None and not self.drop_last:
            yield carry.to_batch()

    def _windows(self) -> Iterator[Examples]:
        """chunks(), or with shuffle_buffer: windows of that many rows, each shuffled."""
        if not self.shuffle_buffer:
            yield from self.chunks()
            return
        rng = np.random.default_rng([self.seed, self.shard_index, self.epoch])
        self.epoch += 1
        pending: list[Examples] = []
        count = 0
        for chunk in self.chunks():
            pending.append(chunk)
            count += len(chunk)
            if count >= self.shuffle_buffer:
                pool = Examples.cat(pending)
                yield pool.select(torch.from_numpy(rng.permutation(count)))
                pending, count = [], 0
        if count:
            pool = Examples.cat(pending)
            yield pool.select(torch.from_numpy(rng.permutation(count)))

    def chunks(self) -> Iterator[Examples]:
        """This shard's rows as parsed chunks (file order, one per block), checked against the budget.

        One background thread reads blocks of whole lines; a pool of `threads` parses them
        (pyarrow) and converts this shard's rows (cast, hash); this generator puts results
        back in file order, keeps the books (row index, bad rows, budget) and yields.
        """
        self.stats = ReaderStats()
        self._logged = 0
        name = f"reader shard {self.shard_index}/{self.num_shards}"
        raw = _prefetch(self._read_blocks(), f"{name} (read)", self.timeout_s)
        pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix=f"recps-{name}")
        depth = self.threads + 1  # blocks in flight per stage
        parsing: deque[Future] = deque()
        converting: deque[Future] = deque()
        global_row = 0  # well-formed rows of all earlier blocks, over all files
        exhausted = False
        try:
            while True:
                while not exhausted and len(parsing) < depth:
                    block = next(raw, None)
                    if block is None:
                        exhausted = True
                    else:
                        parsing.append(pool.submit(self._parse, block))
                # Hand parsed blocks to conversion in order; block only when nothing else is pending.
                while parsing and len(converting) < depth and (parsing[0].done() or not converting):
                    parsed = self._result(parsing.popleft())
                    batch = self._account(parsed)
                    if batch is None:
                        continue
                    n = batch.num_rows
                    picked = self._picked(global_row, n)
                    global_row += n
                    self.stats.all_rows = global_row
                    if picked.size:
                        part = batch if picked.size == n else batch.take(pa.array(picked))
                        converting.append(pool.submit(self._convert, part, parsed, picked))
                if converting:
                    done = self._result(converting.popleft())
                    for place, reason, text in done.reports:
                        self._record_bad(place, reason, text)
                    self.stats.bad_rows += done.bad - len(done.reports)
                    self.stats.rows += len(done.examples)
                    self._check_budget(final=False)
                    if len(done.examples):
                        yield done.examples
                elif exhausted and not parsing:
                    break
            self._check_budget(final=True)
        finally:
            for future in list(parsing) + list(converting):
                future.cancel()
            pool.shutdown(wait=False, cancel_futures=True)
            raw.close()

    def _picked(self, first: int, n: int) -> np.ndarray:
        """Which of the n rows from global index `first` on are this shard's (int64 positions)."""
        if self.shard_width == 1:
            return np.arange((self.shard_index - first) % self.num_shards, n, self.num_shards)
        at = np.arange(first, first + n, dtype=np.int64)  # (n,)
        return np.flatnonzero((at // self.shard_width) % self.num_shards == self.shard_index)

    def _result(self, future: Future) -> Any:
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise DataError(
                f"reader shard {self.shard_index}/{self.num_shards}: a block took more than {self.timeout_s:.0f} s "
                f"to parse; check the machine's load, or raise the reader's timeout_s"
            ) from None

    # -- read stage (one thread): files -> blocks of whole lines / Parquet record batches

    def _read_blocks(self) -> Iterator[_Block]:
        for src in self.sources:
            _check_not_empty(src)
            if self.schema.format == "parquet":
                yield from self._parquet_blocks(src)
            else:
                yield from self._text_blocks(src)

    def _text_blocks(self, src: _Source) -> Iterator[_Block]:
        s = self.schema
        state = _FileState(src)
        if not s.header:
            state.names = tuple(s.columns or ())
            state.fields = len(state.names)
        try:
            stream = _open_binary(src)
        except OSError as e:
            raise DataError(f"{src.name}: cannot read the file: {_one_line(e)}; check the path and permissions") from None
        try:
            index, line, pending, first_read = 0, 1, b"", True
            while True:
                piece = stream.read(self.block_size)
                if first_read:
                    first_read = False
                    if not piece:
                        raise DataError(f"{src.name}: the file is empty; remove it from the dataset paths or "
                                        f"regenerate it")
                    if piece.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark is not data
                        piece = piece[3:]
                pending += piece
                at_end = not piece
                if s.header and not state.names:  # the first line names the columns
                    newline = pending.find(b"\n")
                    if newline < 0 and not at_end:
                        continue  # a header longer than a block
                    head, pending = (pending, b"") if newline < 0 else (pending[:newline], pending[newline + 1:])
                    state.names = self._check_header(src, head)
                    state.fields = len(state.names)
                    line = 2
                cut = len(pending) if at_end else pending.rfind(b"\n") + 1  # whole lines only
                if cut > 0:
                    data, pending = pending[:cut], pending[cut:]
                    yield _Block(state, index, line, data=data)
                    index += 1
                    line += data.count(b"\n") + (not data.endswith(b"\n"))
                if at_end:
                    break
        except OSError as e:
            raise DataError(f"{src.name}: cannot read the file: {_one_line(e)}; check the path and permissions") from None
        finally:
            stream.close()
        yield _Block(state, index, line, end=True)

    def _check_header(self, src: _Source, head: bytes) -> tuple[str, ...]:
        """The header's column names, checked against the schema."""
        s = self.schema
        if not head.strip():
            raise DataError(f"{src.name}: the first line (the header) is blank; fix the file or set dataset.schema.header")
        try:
            names = pcsv.read_csv(
                io.BytesIO(head.rstrip(b"\r") + b"\n"),
                parse_options=pcsv.ParseOptions(delimiter=s.separator, quote_char='"'),
                read_options=pcsv.ReadOptions(use_threads=False),
            ).column_names
        except (pa.ArrowInvalid, UnicodeDecodeError) as e:  # not text (a Parquet file read as CSV), not UTF-8
            raise DataError(f"{src.name}: cannot parse the header line: {_one_line(e)}; fix the file or "
                            f"dataset.schema.format ({s.format!r})") from None
        missing = [c for c in self._needed if c not in names]
        if missing:
            shown = names if len(names) <= 12 else names[:12] + ["..."]
            raise DataError(
                f"{src.name}: the header lacks columns {missing} that dataset.schema uses "
                f"(header: {shown}, separator {s.separator!r}); fix dataset.schema or the file"
            )
        return tuple(names)

    def _parquet_blocks(self, src: _Source) -> Iterator[_Block]:
        state = _FileState(src)
        try:
            handle = src.path if src.local else src.fs.open(src.path, "rb")
            pf = pq.ParquetFile(handle)
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(
                f"{src.name}: not a readable Parquet file ({_one_line(e)}); fix dataset.schema.format or the file"
            ) from None
        names = pf.schema_arrow.names
        missing = [c for c in self._needed if c not in names]
        if missing:
            shown = names if len(names) <= 12 else names[:12] + ["..."]
            raise DataError(
                f"{src.name}: the Parquet file lacks columns {missing} that dataset.schema uses "
                f"(it has {shown}); fix dataset.schema or the file"
            )
        index, row = 0, 0
        try:
            for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, columns=self._needed):
                yield _Block(state, index, row, batch=batch)
                index, row = index + 1, row + batch.num_rows
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{src.name}: cannot read the Parquet file: {_one_line(e)}; fix the file") from None
        yield _Block(state, index, row, end=True)

    # -- parse stage (pool): a text block -> a record batch of well-formed rows -----------

    def _parse(self, block: _Block) -> _Parsed:
        if block.end or block.batch is not None:
            return _Parsed(block, block.batch, [])
        s = self.schema
        dropped: list = []
        leading = [0]  # wrong-width lines at the very start of the file, in a row

        def on_invalid(row: Any) -> str:
            line = block.first + row.number - 1
            dropped.append((line, row.actual_columns, row.text[:200]))
            if block.index == 0 and row.number == leading[0] + 1:
                leading[0] += 1
                if leading[0] >= _MISMATCH_LINES:
                    return "error"  # the file's first lines all fail: stop, report the mismatch
            return "skip"

        # Numbers are parsed as numbers; if a value is not one, the block is parsed again as
        # text and _convert finds the rows (rare; a block costs ~10 ms).
        numeric = {c: pa.float64() for c in s.labels + s.dense}
        if not s.hash_values:
            numeric.update({c: pa.int64() for c in s.sparse})
        for types in (numeric, {}):
            dropped.clear()
            leading[0] = 0
            try:
                table = pcsv.read_csv(
                    pa.BufferReader(block.data),
                    read_options=pcsv.ReadOptions(
                        column_names=list(block.state.names),
                        use_threads=False,  # blocks run in parallel instead; row numbers stay known
                        block_size=len(block.data) + 1,
                    ),
                    parse_options=pcsv.ParseOptions(
                        delimiter=s.separator,
                        quote_char=False if s.format == "criteo" else '"',
                        invalid_row_handler=on_invalid,
                    ),
                    convert_options=pcsv.ConvertOptions(
                        include_columns=self._needed,
                        column_types={c: types.get(c, pa.string()) for c in self._needed},
                        null_values=[""],
                        strings_can_be_null=True,
                        quoted_strings_can_be_null=True,
                    ),
                )
                break
            except pa.ArrowInvalid as e:
                if leading[0] >= _MISMATCH_LINES or not types:
                    return _Parsed(block, None, dropped, error=_one_line(e))
        batches = table.combine_chunks().to_batches()
        return _Parsed(block, batches[0] if batches and table.num_rows else None, dropped)

    def _account(self, parsed: _Parsed) -> pa.RecordBatch | None:
        """In file order: counts wrong-width lines, ends files, raises on a schema mismatch."""
        block, state = parsed.block, parsed.block.state
        for line, fields, text in parsed.dropped:
            if len(state.dropped) < _MISMATCH_LINES:
                state.dropped.append((line, fields))
            if (line // self.shard_width) % self.num_shards == self.shard_index:
                self._record_bad(f"{state.src.name}:{line}", f"{fields} fields, expected {state.fields}", text)
        if parsed.error is not None:
            if state.rows == 0 and len(state.dropped) >= _MISMATCH_LINES:
                raise self._mismatch(state)
            raise DataError(f"{state.src.name}: cannot parse the file: {parsed.error}; fix the file or dataset.schema")
        if block.end:
            if state.rows == 0:
                if state.dropped:
                    raise self._mismatch(state)
                raise DataError(f"{state.src.name}: the file has no data rows; remove it from the dataset paths or "
                                f"regenerate it")
            self.stats.files += 1
            return None
        if parsed.batch is not None:
            state.rows += parsed.batch.num_rows
        return parsed.batch

    def _mismatch(self, state: _FileState) -> DataError:
        s = self.schema
        widths = sorted({fields for _, fields in state.dropped})
        which = f"its first {_MISMATCH_LINES} lines do not match" if len(state.dropped) >= _MISMATCH_LINES \
            else "no line matches"
        return DataError(
            f"{state.src.name}: {which} dataset.schema: lines have {widths} fields "
            f"(first at line {state.dropped[0][0]}) but the schema expects {state.fields} "
            f"(format {s.format!r}, separator {s.separator!r}, header={s.header}); "
            f"fix dataset.schema (columns, separator, format) to match the file"
        )

    # -- convert stage (pool): this shard's rows -> Examples ----------------------------

    def _convert(self, rb: pa.RecordBatch, parsed: _Parsed, ordinals: np.ndarray) -> _Converted:
        """Casts numbers, hashes keys, splits sequences; rows with bad values are dropped."""
        try:
            return self._convert_columns(rb, parsed, ordinals)
        except DataError as e:  # a column of the wrong type: name the file
            raise DataError(f"{parsed.block.state.src.name}: {e}") from None

    def _convert_columns(self, rb: pa.RecordBatch, parsed: _Parsed, ordinals: np.ndarray) -> _Converted:
        s = self.schema
        m = rb.num_rows
        bad = np.zeros(m, bool)
        problems: list[tuple[str, np.ndarray]] = []  # (reason, (M,) mask) for messages

        # Values are judged as training sees them: after the cast to float32 (1e308 is finite in
        # float64, inf in float32) and, for dense inputs, after the transform.
        labels = np.empty((m, len(s.labels)), np.float32)  # (M, T)
        for j, c in enumerate(s.labels):
            values, missing, wrong = _parse_floats(rb.column(c), c)
            with np.errstate(over="ignore", invalid="ignore"):
                labels[:, j] = values  # the cast to float32
            col = labels[:, j]
            present = ~(missing | wrong)
            overflow = present & ~np.isfinite(col)
            problems += [(f"label {c} is missing", missing), (f"label {c} is not a number", wrong),
                         (f"label {c} overflows float32 (|x| > 3.4e38)", overflow)]
            bad |= missing | wrong | overflow
            if c in s.label_range:
                lo, hi = s.label_range[c]
                outside = present & ~overflow & ((col < lo) | (col > hi))
                problems.append((f"label {c} is outside [{lo:g}, {hi:g}] (dataset.schema.label_range: the task's)",
                                 outside))
                bad |= outside

        dense = np.zeros((len(s.dense), m), np.float32)  # (I, M): one contiguous row per column
        wrong_dense = np.zeros((len(s.dense), m), bool)  # (I, M)
        for j, c in enumerate(s.dense):
            values, missing, wrong = _parse_floats(rb.column(c), c)
            with np.errstate(over="ignore", invalid="ignore"):
                dense[j] = np.where(missing | wrong, 0.0, values)  # the cast to float32: overflow -> inf
            wrong_dense[j] = wrong
            problems.append((f"dense {c} is not a finite number", wrong))
            bad |= wrong
        if s.dense_transform == "log1p":
            dense = np.copysign(np.log1p(np.abs(dense)), dense)  # sign(x) * log(1 + |x|)
        overflow = ~np.isfinite(dense) & ~wrong_dense  # (I, M)
        if overflow.any():
            for j in np.flatnonzero(overflow.any(axis=1)):
                problems.append((f"dense {s.dense[j]} overflows float32 (|x| > 3.4e38), the training dtype",
                                 overflow[j]))
                bad |= overflow[j]
            dense[overflow] = 0.0  # the rows are dropped; no inf travels further

        keys = np.empty((len(s.sparse), m), np.int64)  # (S, M)
        for j, c in enumerate(s.sparse):
            if s.hash_values:
                keys[j] = hash_strings(rb.column(c), c)
            else:
                keys[j], wrong = _parse_ints(rb.column(c), c)
                problems.append((f"sparse {c} is not an integer key", wrong))
                bad |= wrong

        seq_lengths, seq_values = [], []
        for c in s.sequence:
            flat, parents = _split_sequence(rb.column(c), s.sequence_separator)
            if s.hash_values:
                values = hash_strings(flat, c)
            else:
                values, wrong_flat = _parse_ints(flat, c)
                wrong = np.zeros(m, bool)
                wrong[parents[wrong_flat]] = True
                problems.append((f"sequence {c} holds a non-integer key", wrong))
                bad |= wrong
            seq_lengths.append(torch.from_numpy(np.bincount(parents, minlength=m).astype(np.int64)))  # (M,)
            seq_values.append(torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)))

        examples = Examples(
            feature_names=s.feature_names,
            dense=torch.from_numpy(dense).t(),  # (M, I) view
            keys=torch.from_numpy(keys).t(),  # (M, S) view; to_batch's feature-major flatten is a plain copy
            labels=torch.from_numpy(labels),
            seq_lengths=tuple(seq_lengths),
            seq_values=tuple(seq_values),
        )
        if not bad.any():
            return _Converted(examples, 0, [])
        where = np.flatnonzero(bad)
        shown = where[:_MAX_LOGGED]  # only these get a line number and a message
        block = parsed.block
        if block.data is not None:  # text: physical line numbers, stepping over blank and wrong-width lines
            skipped = _skipped_lines(block.first, block.data, [d[0] for d in parsed.dropped])
            places = [f"{block.state.src.name}:{int(x)}" for x in _lines_of_rows(block.first, ordinals[shown], skipped)]
        else:
            places = [f"{block.state.src.name} row {block.first + int(x) + 1}" for x in ordinals[shown]]
        reports = [(place, next(r for r, mask in problems if mask[i]), str(rb.slice(int(i), 1).to_pylist()[0]))
                   for place, i in zip(places, shown)]
        return _Converted(examples.select(torch.from_numpy(np.flatnonzero(~bad))), len(where), reports)

    # -- books ----------------------------------------------------------------------------

    def _record_bad(self, place: str, reason: str, text: str) -> None:
        self.stats.bad_rows += 1
        if len(self.stats.first_bad) < _MAX_IN_MESSAGE:
            self.stats.first_bad.append(f"{place} ({reason})")
        if self._logged < _MAX_LOGGED:
            self._logged += 1
            more = "; later bad rows are counted, not logged" if self._logged == _MAX_LOGGED else ""
            log.warning("skipped bad row %s: %s: %.120s%s", place, reason, text, more)

    def _check_budget(self, final: bool) -> None:
        stats = self.stats
        seen = stats.rows + stats.bad_rows
        if isinstance(self.error_budget, float):
            if not final and seen < _MIN_ROWS_FOR_FRACTION:
                return
            allowed, what = self.error_budget * seen, f"{self.error_budget:.2%} of {seen} rows"
        else:
            allowed, what = self.error_budget, f"{self.error_budget} rows"
        if stats.bad_rows > allowed:
            raise DataError(
                f"{stats.bad_rows} bad rows out of {seen} read (shard {self.shard_index}/{self.num_shards}) "
                f"exceed dataset.error_budget={self.error_budget!r} ({what}); first bad rows: "
                f"{'; '.join(stats.first_bad)}; raise dataset.error_budget or fix the file"
            )
        if final and stats.bad_rows:
            log.warning("skipped %d bad rows out of %d (shard %d/%d), within dataset.error_budget=%r",
                        stats.bad_rows, seen, self.shard_index, self.num_shards, self.error_budget)


def load_tensors(
    paths: Any,
    schema: Schema,
    *,
    shard_index: int = 0,
    num_shards: int = 1,
    error_budget: float | int = 0.01,
    threads: int = 2,
) -> Examples:
    """Parses whole files into memory, for `TensorBatches` (training on pre-parsed input).

    Returns this shard's rows in file order, row-major: dense (N, I), keys (N, S), labels (N, T),
    plus the sequence slots. Arguments mean what they mean for TabularReader.
    """
    reader = TabularReader(paths, schema, batch_size=1, shard_index=shard_index, num_shards=num_shards,
                           error_budget=error_budget, threads=threads)
    parts = [part.row_major() for part in reader.chunks()]
    return Examples.cat(parts) if parts else empty_examples(schema)


def empty_examples(schema: Schema) -> Examples:
    """No rows, in `schema`'s columns (a stream job's data before its first pass)."""
    s = schema
    return Examples(s.feature_names, torch.zeros(0, len(s.dense)), torch.zeros(0, len(s.sparse), dtype=torch.int64),
                    torch.zeros(0, len(s.labels)), tuple(torch.zeros(0, dtype=torch.int64) for _ in s.sequence),
                    tuple(torch.zeros(0, dtype=torch.int64) for _ in s.sequence))
