"""The debug dump's file format: one binary file and one text index per (role, rank, thread).

    <run dir>/dump/
        worker0000-thread000.bin    the records' raw bytes, back to back (C order, native byte
                                    order: little-endian on x86-64 and ARM)
        worker0000-thread000.idx    text: a version line, a header line, then one line per
                                    record, tab-separated, in the order the bytes were written:

    #recps-dump 1
    step  batch  name  dtype  shape  offset  nbytes
    3     3      grad/over_arch.0.weight  float32  16,44  1234560  2816

`step` is the trainer's global step, `batch` the thread's own batch count (1, 2, ...),
`name` the record (see ``recps.debug.dump`` for the names), `dtype` a torch dtype name
without ``torch.``, `shape` comma-separated sizes (``-`` for a scalar), `offset`/`nbytes`
where the bytes lie in the .bin file. Nothing else goes into the files (no time, no host,
no path), so two runs that compute the same numbers write byte-identical files, and a
record is read with one seek, or as a slice of an mmap (``read_record``), without torch.

Servers write the same way under role ``server`` (``server0000-thread000``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

import numpy as np

from recps.errors import DataError

__all__ = ["Record", "DumpWriter", "dump_name", "read_index", "read_record", "dump_files", "iter_bin", "INDEX_HEADER", "VERSION"]

VERSION = 1
INDEX_HEADER = "step\tbatch\tname\tdtype\tshape\toffset\tnbytes"
_FILE_RE = re.compile(r"^(?P<role>[a-z]+)(?P<rank>\d{4})-thread(?P<thread>\d{3})\.idx$")

# torch dtype name -> numpy dtype; bfloat16 has no numpy twin and is read through torch.
_NUMPY = {
    "float64": np.float64, "float32": np.float32, "float16": np.float16,
    "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8,
    "bool": np.bool_,
}


def dump_name(role: str, rank: int, thread: int) -> str:
    """The files' stem: ``worker0001-thread002``."""
    if not role.isalpha() or not role.islower():
        raise DataError(f"dump role {role!r}: use lowercase letters (worker, server)")
    return f"{role}{int(rank):04d}-thread{int(thread):03d}"


@dataclass(frozen=True)
class Record:
    """One index line: where record `name` of `step` lies in the .bin file."""

    step: int
    batch: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def line(self) -> str:
        shape = ",".join(str(s) for s in self.shape) if self.shape else "-"
        return f"{self.step}\t{self.batch}\t{self.name}\t{self.dtype}\t{shape}\t{self.offset}\t{self.nbytes}\n"


class DumpWriter:
    """Appends records to ``<folder>/<role><rank>-thread<thread>.{bin,idx}`` (truncated at open).

    Not thread-safe: one writer per training thread, used by that thread only.
    """

    def __init__(self, folder: str | os.PathLike, role: str, rank: int, thread: int) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = dump_name(role, rank, thread)
        self.bin_path = self.folder / f"{stem}.bin"
        self.idx_path = self.folder / f"{stem}.idx"
        self._bin: IO[bytes] | None = open(self.bin_path, "wb", buffering=1 << 20)
        self._idx: IO[str] | None = open(self.idx_path, "w", encoding="utf-8", newline="\n")
        self._idx.write(f"#recps-dump {VERSION}\n{INDEX_HEADER}\n")
        self._offset = 0
        self.records = 0

    def write(self, step: int, batch: int, name: str, tensor) -> None:
        """Appends `tensor` (any torch tensor; copied to CPU, C order) as record `name`."""
        import torch  # deferred: reading a dump (the diff CLI) needs no torch

        if "\t" in name or "\n" in name:
            raise DataError(f"dump record name {name!r} contains a tab or newline")
        if self._bin is None or self._idx is None:
            raise DataError(f"dump {self.bin_path} is closed")
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()  # (nbytes,) the tensor's own bytes, no copy
        self._bin.write(memoryview(raw))
        record = Record(int(step), int(batch), name, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                        self._offset, int(raw.nbytes))
        self._idx.write(record.line())
        self._offset += record.nbytes
        self.records += 1

    def flush(self) -> None:
        if self._bin is not None and self._idx is not None:
            self._bin.flush()
            self._idx.flush()

    def close(self) -> None:
        """Flushes and closes both files (idempotent)."""
        for f in (self._bin, self._idx):
            if f is not None:
                f.close()
        self._bin = self._idx = None


def read_index(path: str | os.PathLike) -> list[Record]:
    """The records of a ``.idx`` file, in file order; DataError names the bad line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DataError(f"dump index {path}: cannot read it ({exc})") from exc
    if len(lines) < 2 or lines[0] != f"#recps-dump {VERSION}" or lines[1] != INDEX_HEADER:
        raise DataError(f"dump index {path}: not a recps dump index of version {VERSION} (first lines {lines[:2]})")
    records = []
    for number, line in enumerate(lines[2:], start=3):
        parts = line.split("\t")
        try:
            if len(parts) != 7:
                raise ValueError(f"{len(parts)} fields, expected 7")
            step, batch, name, dtype, shape, offset, nbytes = parts
            dims = () if shape == "-" else tuple(int(s) for s in shape.split(","))
            records.append(Record(int(step), int(batch), name, dtype, dims, int(offset), int(nbytes)))
        except ValueError as exc:
            raise DataError(f"dump index {path}, line {number}: {exc}: {line!r}") from exc
    return records


def read_record(data: np.ndarray | memoryview | bytes, record: Record) -> np.ndarray:
    """Record `record` of a .bin file's bytes (e.g. ``np.memmap(path, np.uint8, "r")``) as an array
    of its dtype and shape (bfloat16 comes back as float32)."""
    raw = np.frombuffer(data, dtype=np.uint8, count=record.nbytes, offset=record.offset)
    if record.dtype in _NUMPY:
        return raw.view(_NUMPY[record.dtype]).reshape(record.shape)
    import torch  # deferred: bfloat16 and other dtypes numpy lacks; reading the others needs no torch

    dtype = getattr(torch, record.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise DataError(f"dump record {record.name!r}: unknown dtype {record.dtype!r}")
    t = torch.frombuffer(bytearray(raw.tobytes()), dtype=dtype).reshape(record.shape)
    return t.to(torch.float32).numpy() if t.is_floating_point() else t.numpy()


def dump_files(run: str | os.PathLike) -> dict[tuple[str, int, int], Path]:
    """``{(role, rank, thread): .idx path}`` of a run folder (or its ``dump/`` folder), sorted."""
    run = Path(run)
    folder = run / "dump" if (run / "dump").is_dir() else run
    if not folder.is_dir():
        raise DataError(f"{run}: no such folder; pass a run folder (with dump/) or its dump folder")
    found = {}
    for path in folder.iterdir():
        m = _FILE_RE.match(path.name)
        if m:
            found[(m["role"], int(m["rank"]), int(m["thread"]))] = path
    if not found:
        raise DataError(f"{folder}: no dump files (*-thread*.idx); was the run made with debug=dump?")
    return dict(sorted(found.items()))


def iter_bin(idx_path: Path) -> Iterator[tuple[Record, np.ndarray]]:
    """(record, its bytes as uint8) pairs of one file, in order (mmap; nothing read twice)."""
    records = read_index(idx_path)
    bin_path = idx_path.with_suffix(".bin")
    size = bin_path.stat().st_size if bin_path.exists() else -1
    end = max((r.offset + r.nbytes for r in records), default=0)
    if size < end:
        raise DataError(f"dump {bin_path}: {size} bytes but the index needs {end}; the run stopped while writing?")
    data = np.memmap(bin_path, dtype=np.uint8, mode="r") if size > 0 else np.zeros(0, np.uint8)
    for r in records:
        yield r, data[r.offset : r.offset + r.nbytes]
