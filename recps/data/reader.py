"""One reader for every tabular format: Criteo raw text, CSV (with or without a header), Parquet.

A `Schema` says which columns are labels, dense inputs, single-valued sparse slots and
multi-valued sequence slots; the reader turns files into `Batch(dense, sparse, labels)`:

    dense   (B, I) float32   missing -> 0, then schema.dense_transform (log1p: sign(x)*log1p(|x|))
    sparse  KeyedJaggedTensor, keys = schema.feature_names (sparse slots, then sequences),
            feature-major: feature 0's B lengths, then feature 1's, ...; values int64 keys
            (hashed per slot, see recps.data.hashing); a sparse slot always has length 1
            (a missing value gets the slot's "missing" key); a sequence has 0..L keys.
    labels  (B, T) float32

Pipeline (no Python loop per row): pyarrow parses blocks of text (or Parquet row groups)
in a background thread; a second thread keeps this shard's rows, casts numbers and
hashes strings column by column; the caller's thread slices the parsed rows into batches.

Sharding: shard k of n keeps the rows whose global row index (counting parsed rows over
all files, in order) satisfies index % n == k; the n shards partition the data exactly.
A line with the wrong number of fields belongs to the shard with line_number % n == k.

Bad rows (wrong field count, a non-numeric dense or label value, a missing label, a
non-integer key when schema.hash_values is False) are skipped, counted and logged with
their file and line. When the bad rows exceed `error_budget` the reader raises DataError.

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
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

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

__all__ = ["Examples", "TabularReader", "TensorBatches", "ReaderStats", "load_tensors", "expand_paths"]

log = logging.getLogger(__name__)

_BLOCK_SIZE = 4 << 20  # bytes of text pyarrow parses at a time (~16k Criteo rows)
_PARQUET_BATCH = 65536  # rows per Parquet record batch
_MISMATCH_LINES = 1000  # this many leading bad lines in a file = the schema does not fit it
_MIN_ROWS_FOR_FRACTION = 10_000  # a fractional budget is judged mid-stream only past this many rows
_MAX_LOGGED = 20  # bad rows logged one by one per iteration; the rest are counted
_MAX_IN_MESSAGE = 3  # bad rows quoted in the budget error
_QUEUE_DEPTH = 2  # chunks each pipeline stage may run ahead


# ----------------------------------------------------------------------------- rows in memory


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
        rows = torch.as_tensor(rows, dtype=torch.int64)
        seq_lengths, seq_values = [], []
        for lengths, values, offsets in zip(self.seq_lengths, self.seq_values, self._seq_offsets):
            starts = offsets[rows]  # (M,) where each selected row's keys begin
            picked = lengths[rows]  # (M,)
            # Position of every output key in `values`: its row's start plus its rank in the row.
            out_starts = _offsets(picked)[:-1]  # (M,)
            gather = torch.repeat_interleave(starts - out_starts, picked) + torch.arange(int(picked.sum()))
            seq_lengths.append(picked)
            seq_values.append(values[gather])
        return dataclasses.replace(
            self,
            dense=self.dense[rows],
            keys=self.keys[rows],
            labels=self.labels[rows],
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
            dense=torch.cat([p.dense for p in parts]),
            keys=torch.cat([p.keys for p in parts]),
            labels=torch.cat([p.labels for p in parts]),
            seq_lengths=tuple(torch.cat([p.seq_lengths[q] for p in parts]) for q in range(len(first.seq_lengths))),
            seq_values=tuple(torch.cat([p.seq_values[q] for p in parts]) for q in range(len(first.seq_values))),
        )

    def to_batch(self) -> Batch:
        """All rows as one Batch (B = N); the KJT is feature-major."""
        b = len(self)
        values = [self.keys.t().reshape(-1)]  # (S * B,) slot 0's B keys, then slot 1's, ...
        lengths = [torch.ones(self.keys.shape[1] * b, dtype=torch.int64)]  # (S * B,)
        values.extend(self.seq_values)
        lengths.extend(self.seq_lengths)
        sparse = KeyedJaggedTensor(
            keys=list(self.feature_names),
            values=torch.cat(values) if len(values) > 1 else values[0],
            lengths=torch.cat(lengths) if len(lengths) > 1 else lengths[0],
            stride=b,
        )
        return Batch(dense=self.dense.contiguous(), sparse=sparse, labels=self.labels.contiguous())


class TensorBatches:
    """Batches sliced from pre-parsed `Examples`, with no per-example Python work.

    Shard k of n takes rows k, k + n, k + 2n, ... (the same rule as TabularReader).
    With shuffle=True, each iteration draws a new order from (seed, shard, epoch).

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
    ) -> None:
        _check_batching(batch_size, shard_index, num_shards)
        self.examples = examples
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
            g = torch.Generator().manual_seed(_seed(self.seed, self.shard_index, self.epoch))
            rows = rows[torch.randperm(rows.numel(), generator=g)]
        self.epoch += 1
        contiguous = not self.shuffle and self.num_shards == 1
        n = rows.numel()
        stop = n - n % self.batch_size if self.drop_last else n
        for i in range(0, stop, self.batch_size):
            if contiguous:
                yield ex.select(slice(i, min(i + self.batch_size, n))).to_batch()
            elif not self._has_seq:
                idx = rows[i:i + self.batch_size]
                yield Examples(ex.feature_names, ex.dense[idx], ex.keys[idx], ex.labels[idx]).to_batch()
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
    base = path.rstrip("/").rsplit("/", 1)[-1]
    return not base.startswith((".", "_"))  # Hadoop convention: _SUCCESS, .crc, _temporary


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
            found = sorted(p for p in fs.glob(path) if fs.isfile(p) and _is_data_file(p))
            if not found:
                raise DataError(f"{spec}: the pattern matches no file; check the dataset path")
        elif fs.isdir(path):
            found = sorted(p for p in fs.find(path) if _is_data_file(p))
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
    bad_rows: int = 0  # rows skipped
    files: int = 0  # files finished
    first_bad: list[str] = dataclasses.field(default_factory=list)  # "file:line (reason)" of the first few


@dataclass
class _FileState:
    """Per-file bookkeeping shared by the parse thread and the convert thread."""

    src: _Source
    first_line: int  # physical line number of the first data row (1-based); 0 for Parquet
    dropped: list = dataclasses.field(default_factory=list)  # (line, fields, text) of wrong-width lines
    expected_fields: int = 0
    rows: int = 0  # parsed (well-formed) rows seen so far


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


class TabularReader:
    """Streams `Batch`es from text (Criteo, CSV) or Parquet files described by a Schema.

    Args:
        paths: a path, URL (file://, hdfs://, s3://, ...), glob or folder, or a list of them;
            files are read in the given order (globs and folders sorted).
        schema: the columns and parsing options.
        batch_size: B; the last batch may be smaller unless drop_last.
        shard_index, num_shards: this reader keeps rows with global index % num_shards == shard_index.
        error_budget: bad rows tolerated: a float in [0, 1] is a fraction of the rows read
            (judged after 10,000 rows and at the end), an int >= 0 a count.
        drop_last: drop the last incomplete batch.
        shuffle_buffer: rows to collect and shuffle before batching (0: file order).
        seed: shuffling seed; each iteration (epoch) draws a new order from (seed, shard, epoch).
        block_size: bytes of text parsed at a time.
        timeout_s: longest wait for the next chunk of data before raising DataError.

    Iterating yields batches; `stats` then holds the counts of that iteration.
    """

    def __init__(
        self,
        paths: Any,
        schema: Schema,
        batch_size: int,
        *,
        shard_index: int = 0,
        num_shards: int = 1,
        error_budget: float | int = 0.01,
        drop_last: bool = False,
        shuffle_buffer: int = 0,
        seed: int = 0,
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
        if schema.format != "parquet" and not schema.header and not schema.columns:
            raise ConfigError(
                "dataset.schema.header=false needs dataset.schema.columns (every column in file order); set it"
            )
        self.sources = _resolve(paths)
        self.schema = schema
        self.batch_size = batch_size
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.error_budget = error_budget
        self.drop_last = drop_last
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.epoch = 0
        self.stats = ReaderStats()
        self._needed = list(schema.labels + schema.dense + schema.sparse + schema.sequence)

    # -- public ------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        rng = np.random.default_rng([self.seed, self.shard_index, self.epoch])
        self.epoch += 1
        pending: list[Examples] = []
        count = 0
        target = self.batch_size + self.shuffle_buffer
        for chunk in self.chunks():
            pending.append(chunk)
            count += len(chunk)
            if count < target:
                continue
            pool = Examples.cat(pending)
            if self.shuffle_buffer:
                pool = pool.select(torch.from_numpy(rng.permutation(len(pool))))
            # Emit what the buffer holds beyond shuffle_buffer, in whole batches.
            n_out = (count - self.shuffle_buffer) // self.batch_size * self.batch_size
            for i in range(0, n_out, self.batch_size):
                yield pool.select(slice(i, i + self.batch_size)).to_batch()
            rest = pool.select(slice(n_out, len(pool)))
            pending, count = [rest], len(rest)
        if count:
            pool = Examples.cat(pending)
            if self.shuffle_buffer:
                pool = pool.select(torch.from_numpy(rng.permutation(len(pool))))
            stop = count - count % self.batch_size if self.drop_last else count
            for i in range(0, stop, self.batch_size):
                yield pool.select(slice(i, min(i + self.batch_size, count))).to_batch()

    def chunks(self) -> Iterator[Examples]:
        """This shard's rows as parsed chunks (file order, one per parsed block), checked against the budget."""
        self.stats = ReaderStats()
        name = f"reader shard {self.shard_index}/{self.num_shards}"
        blocks = _prefetch(self._blocks(), f"{name} (parse)", self.timeout_s)
        yield from _prefetch(self._convert_all(blocks), f"{name} (convert)", self.timeout_s)

    # -- parse stage: files -> Arrow record batches of the needed columns ---------------

    def _blocks(self) -> Iterator[tuple[_FileState, pa.RecordBatch | None]]:
        """(file state, record batch) items; a (state, None) item ends each file."""
        for src in self.sources:
            _check_not_empty(src)
            if self.schema.format == "parquet":
                yield from self._parquet_blocks(src)
            else:
                yield from self._text_blocks(src)

    def _text_blocks(self, src: _Source) -> Iterator[tuple[_FileState, pa.RecordBatch | None]]:
        s = self.schema
        names = self._text_columns(src)
        state = _FileState(src, first_line=2 if s.header else 1, expected_fields=len(names))
        run = {"next": state.first_line}  # leading run of consecutive wrong-width lines

        def on_invalid(row: Any) -> str:
            state.dropped.append((row.number, row.actual_columns, row.text[:200]))
            if state.rows == 0 and row.number == run["next"]:
                run["next"] += 1
                if run["next"] - state.first_line >= _MISMATCH_LINES:
                    return "error"  # the first lines all fail: stop parsing, report the mismatch
            return "skip"

        read_options = pcsv.ReadOptions(
            use_threads=False,  # the line numbers of bad rows are only known single-threaded
            block_size=self.block_size,
            column_names=None if s.header else list(names),
        )
        parse_options = pcsv.ParseOptions(
            delimiter=s.separator,
            quote_char=False if s.format == "criteo" else '"',
            invalid_row_handler=on_invalid,
        )
        convert_options = pcsv.ConvertOptions(
            include_columns=self._needed,
            column_types={c: pa.string() for c in self._needed},
            null_values=[""],
            strings_can_be_null=True,
            quoted_strings_can_be_null=True,
        )
        stream = None
        try:
            stream = _open_binary(src)
            reader = pcsv.open_csv(stream, read_options=read_options, parse_options=parse_options,
                                   convert_options=convert_options)
            for rb in reader:
                state.rows += rb.num_rows
                yield state, rb
        except pa.ArrowInvalid as e:
            if state.rows == 0 and len(state.dropped) >= _MISMATCH_LINES:
                raise self._mismatch(state) from None
            if "Empty CSV file" in str(e):
                raise DataError(f"{src.name}: the file is empty; remove it from the dataset paths or regenerate it") from None
            raise DataError(f"{src.name}: cannot parse the file: {_one_line(e)}; fix the file or dataset.schema") from None
        except OSError as e:
            raise DataError(f"{src.name}: cannot read the file: {_one_line(e)}; check the path and permissions") from None
        finally:
            if stream is not None:
                stream.close()
        if state.rows == 0:
            if state.dropped:
                raise self._mismatch(state)
            raise DataError(
                f"{src.name}: the file has no data rows; remove it from the dataset paths or regenerate it"
            )
        yield state, None

    def _text_columns(self, src: _Source) -> tuple[str, ...]:
        """Column names of a text file (its header, or schema.columns), checked against the schema."""
        s = self.schema
        if not s.header:
            return tuple(s.columns or ())
        try:
            with _open_binary(src) as stream:
                head = b""
                while b"\n" not in head and len(head) < (64 << 20):
                    piece = stream.read(1 << 16)
                    if not piece:
                        break
                    head += piece
        except OSError as e:
            raise DataError(f"{src.name}: cannot read the file: {_one_line(e)}; check the path and permissions") from None
        line = head.split(b"\n", 1)[0].rstrip(b"\r")
        if not line.strip():
            raise DataError(f"{src.name}: the file is empty (no header line); remove it or regenerate it")
        try:
            names = pcsv.read_csv(
                io.BytesIO(line + b"\n"),
                parse_options=pcsv.ParseOptions(delimiter=s.separator, quote_char='"'),
                read_options=pcsv.ReadOptions(use_threads=False),
            ).column_names
        except pa.ArrowInvalid as e:
            raise DataError(f"{src.name}: cannot parse the header line: {_one_line(e)}; fix the file") from None
        missing = [c for c in self._needed if c not in names]
        if missing:
            shown = names if len(names) <= 12 else names[:12] + ["..."]
            raise DataError(
                f"{src.name}: the header lacks columns {missing} that dataset.schema uses "
                f"(header: {shown}, separator {s.separator!r}); fix dataset.schema or the file"
            )
        return tuple(names)

    def _mismatch(self, state: _FileState) -> DataError:
        s = self.schema
        widths = sorted({fields for _, fields, _ in state.dropped[:_MISMATCH_LINES]})
        line = state.dropped[0][0]
        return DataError(
            f"{state.src.name}: no line matches dataset.schema: lines have {widths} fields "
            f"(first at line {line}) but the schema expects {state.expected_fields} "
            f"(format {s.format!r}, separator {s.separator!r}, header={s.header}); "
            f"fix dataset.schema (columns, separator, format) to match the file"
        )

    def _parquet_blocks(self, src: _Source) -> Iterator[tuple[_FileState, pa.RecordBatch | None]]:
        state = _FileState(src, first_line=0)
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
        if pf.metadata.num_rows == 0:
            raise DataError(f"{src.name}: the Parquet file has no rows; remove it from the dataset paths or regenerate it")
        try:
            for rb in pf.iter_batches(batch_size=_PARQUET_BATCH, columns=self._needed):
                state.rows += rb.num_rows
                yield state, rb
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{src.name}: cannot read the Parquet file: {_one_line(e)}; fix the file") from None
        yield state, None

    # -- convert stage: record batches -> this shard's Examples -------------------------

    def _convert_all(self, blocks: Iterable[tuple[_FileState, pa.RecordBatch | None]]) -> Iterator[Examples]:
        stats = self.stats
        global_row = 0  # parsed rows of all earlier blocks, over all files
        file_row = 0  # parsed rows of earlier blocks of the current file
        drained = 0  # dropped lines of the current file already counted
        current = None
        logged = [0]
        for state, rb in blocks:
            if state is not current:
                current, file_row, drained = state, 0, 0
            # Wrong-width lines found so far in this file (the parser may be a block ahead).
            new = state.dropped[drained:]
            drained += len(new)
            for line, fields, text in new:
                if line % self.num_shards == self.shard_index:
                    self._record_bad(f"{state.src.name}:{line}", f"{fields} fields, expected {state.expected_fields}",
                                     text, logged)
            if rb is None:
                stats.files += 1
                continue
            n = rb.num_rows
            picked = np.arange((self.shard_index - global_row) % self.num_shards, n, self.num_shards)
            global_row += n
            if picked.size:
                part = rb if picked.size == n else rb.take(pa.array(picked))
                chunk = self._convert(part, state, file_row + picked, logged)
                stats.rows += len(chunk)
                if len(chunk):
                    yield chunk
            file_row += n
            self._check_budget(final=False)
        self._check_budget(final=True)

    def _convert(self, rb: pa.RecordBatch, state: _FileState, ordinals: np.ndarray, logged: list[int]) -> Examples:
        """One block of this shard's rows -> Examples; bad rows dropped, counted and logged."""
        s = self.schema
        m = rb.num_rows
        bad = np.zeros(m, bool)
        problems: list[tuple[str, np.ndarray]] = []  # (column reason, bad mask) for messages

        labels = np.empty((m, len(s.labels)), np.float32)  # (M, T)
        for j, c in enumerate(s.labels):
            values, missing, wrong = _parse_floats(rb.column(c), c)
            labels[:, j] = values
            problems += [(f"label {c} is missing", missing), (f"label {c} is not a number", wrong)]
            bad |= missing | wrong

        dense = np.zeros((len(s.dense), m), np.float32)  # (I, M): one contiguous row per column
        for j, c in enumerate(s.dense):
            values, missing, wrong = _parse_floats(rb.column(c), c)
            dense[j] = np.where(missing | wrong, 0.0, values)
            problems.append((f"dense {c} is not a finite number", wrong))
            bad |= wrong
        if s.dense_transform == "log1p":
            dense = np.copysign(np.log1p(np.abs(dense)), dense)  # sign(x) * log(1 + |x|)

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

        chunk = Examples(
            feature_names=s.feature_names,
            dense=torch.from_numpy(dense).t(),  # (M, I) view
            keys=torch.from_numpy(keys).t(),  # (M, S) view; to_batch's feature-major flatten is then a plain copy
            labels=torch.from_numpy(labels),
            seq_lengths=tuple(seq_lengths),
            seq_values=tuple(seq_values),
        )
        if not bad.any():
            return chunk
        self._report_bad_rows(rb, state, ordinals, bad, problems, logged)
        return chunk.select(torch.from_numpy(np.flatnonzero(~bad)))

    def _report_bad_rows(self, rb: pa.RecordBatch, state: _FileState, ordinals: np.ndarray, bad: np.ndarray,
                         problems: list[tuple[str, np.ndarray]], logged: list[int]) -> None:
        where = np.flatnonzero(bad)
        shown = where[:_MAX_LOGGED]  # only these get a line number and a message
        if state.first_line:  # text: physical line numbers, stepping over wrong-width lines
            dropped = np.sort(np.array([d[0] for d in state.dropped], dtype=np.int64))
            target = state.first_line + ordinals[shown]
            lines = target.copy()
            while True:  # the line of valid row r is the smallest L with L - #(dropped <= L) = first + r
                again = target + np.searchsorted(dropped, lines, side="right")
                if np.array_equal(again, lines):
                    break
                lines = again
            places = [f"{state.src.name}:{int(x)}" for x in lines]
        else:
            places = [f"{state.src.name} row {int(x) + 1}" for x in ordinals[shown]]
        for place, i in zip(places, shown):
            reason = next(r for r, mask in problems if mask[i])
            row = rb.slice(int(i), 1).to_pylist()[0]
            self._record_bad(place, reason, str(row), logged)
        self.stats.bad_rows += len(where) - len(shown)

    def _record_bad(self, place: str, reason: str, text: str, logged: list[int]) -> None:
        self.stats.bad_rows += 1
        if len(self.stats.first_bad) < _MAX_IN_MESSAGE:
            self.stats.first_bad.append(f"{place} ({reason})")
        if logged[0] < _MAX_LOGGED:
            logged[0] += 1
            more = "; later bad rows are counted, not logged" if logged[0] == _MAX_LOGGED else ""
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
) -> Examples:
    """Parses whole files into memory (this shard's rows, in file order), for `TensorBatches`."""
    reader = TabularReader(paths, schema, batch_size=1, shard_index=shard_index, num_shards=num_shards,
                           error_budget=error_budget)
    parts = list(reader.chunks())
    if not parts:
        s = schema
        return Examples(s.feature_names, torch.zeros(0, len(s.dense)), torch.zeros(0, len(s.sparse), dtype=torch.int64),
                        torch.zeros(0, len(s.labels)), tuple(torch.zeros(0, dtype=torch.int64) for _ in s.sequence),
                        tuple(torch.zeros(0, dtype=torch.int64) for _ in s.sequence))
    return Examples.cat(parts)
