"""Compare the dumps of two runs and name the first place where they part.

Files are matched by (role, rank, thread) and records by position in each file's index.
In each pair of files the first record that differs (in name, dtype, shape, step, or in
its bytes; with ``atol`` > 0, by more than atol) is that file's divergence; the run's first
divergence is the earliest of those by (step, role, rank, thread, position). A file that
only one run has diverges at its first record; a run that stops early, at the first record
the other has beyond it.

    >>> import tempfile, torch
    >>> from recps.debug.format import DumpWriter
    >>> runs = [tempfile.mkdtemp() for _ in range(2)]
    >>> for run, w in zip(runs, (1.0, 1.5)):
    ...     out = DumpWriter(f"{run}/dump", "worker", 0, 0)
    ...     out.write(1, 1, "param/w", torch.tensor([1.0, 2.0]))
    ...     out.write(2, 2, "param/w", torch.tensor([w, 2.0]))
    ...     out.close()
    >>> print(diff_runs(*runs).divergence.describe())
    step 2 (batch 2), worker 0, thread 0, param/w float32 (2,): max abs difference 0.5
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recps.debug.format import Record, dump_files, iter_bin, read_record

__all__ = ["Divergence", "DiffResult", "diff_runs"]


@dataclass(frozen=True)
class Divergence:
    """Where two runs part. `max_abs_diff` is None when the records do not even match in
    name, dtype or shape, or one run lacks the record (`reason` says which)."""

    step: int
    batch: int
    role: str
    rank: int
    thread: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    max_abs_diff: float | None
    reason: str = "values"
    position: int = 0

    def describe(self) -> str:
        where = f"step {self.step} (batch {self.batch}), {self.role} {self.rank}, thread {self.thread}, {self.name}"
        if self.max_abs_diff is not None:
            return f"{where} {self.dtype} {self.shape}: max abs difference {self.max_abs_diff:.6g}"
        return f"{where}: {self.reason}"

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "batch": self.batch, "role": self.role, "rank": self.rank, "thread": self.thread,
                "name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "max_abs_diff": self.max_abs_diff, "reason": self.reason}


@dataclass(frozen=True)
class DiffResult:
    """The first divergence (None: identical) and how much was compared to find it."""

    divergence: Divergence | None
    files: int
    records: int
    bytes: int


def diff_runs(run_a: str | os.PathLike, run_b: str | os.PathLike, atol: float = 0.0) -> DiffResult:
    """Compares the dumps of two runs (run folders or their dump/ folders); see the module docstring."""
    files_a, files_b = dump_files(run_a), dump_files(run_b)
    found: list[Divergence] = []
    records = nbytes = 0
    for key in sorted(set(files_a) | set(files_b)):
        if key not in files_b or key not in files_a:
            only, present = ("A", files_a[key]) if key not in files_b else ("B", files_b[key])
            first = next(iter_bin(present), None)
            if first is not None:
                found.append(_structural(key, first[0], 0, f"only run {only} has the file {present.name}"))
            continue
        div, n, size = _diff_file(key, files_a[key], files_b[key], atol)
        records, nbytes = records + n, nbytes + size
        if div is not None:
            found.append(div)
    first = min(found, key=lambda d: (d.step, d.role, d.rank, d.thread, d.position), default=None)
    return DiffResult(first, len(set(files_a) | set(files_b)), records, nbytes)


def _diff_file(key: tuple[str, int, int], idx_a: Path, idx_b: Path, atol: float) -> tuple[Divergence | None, int, int]:
    """(first divergence or None, records compared, bytes compared) of one pair of files."""
    it_a, it_b = iter_bin(idx_a), iter_bin(idx_b)
    position = nbytes = 0
    while True:
        a, b = next(it_a, None), next(it_b, None)
        if a is None and b is None:
            return None, position, nbytes
        if a is None or b is None:
            rec, run, other = (b[0], "B", "A") if a is None else (a[0], "A", "B")
            return _structural(key, rec, position, f"only run {run} has it (run {other} ends before)"), position, nbytes
        (ra, bytes_a), (rb, bytes_b) = a, b
        if (ra.step, ra.batch, ra.name, ra.dtype, ra.shape) != (rb.step, rb.batch, rb.name, rb.dtype, rb.shape):
            reason = (f"record {position} differs: A has {_label(ra)}, B has {_label(rb)}")
            return _structural(key, ra if ra.step <= rb.step else rb, position, reason), position, nbytes
        nbytes += ra.nbytes
        if not np.array_equal(bytes_a, bytes_b):
            diff = _max_abs_diff(read_record(bytes_a, _at0(ra)), read_record(bytes_b, _at0(rb)))
            if not (atol > 0 and diff <= atol):
                return Divergence(ra.step, ra.batch, *key, ra.name, ra.dtype, ra.shape, diff, "values", position), position + 1, nbytes
        position += 1


def _at0(r: Record) -> Record:
    """The record as if its bytes started at 0 (we hold exactly its bytes)."""
    return Record(r.step, r.batch, r.name, r.dtype, r.shape, 0, r.nbytes)


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    # at least 1-d: a 0-d record (the loss, a scalar parameter) would make `d` a numpy scalar
    x, y = np.atleast_1d(a.astype(np.float64)), np.atleast_1d(b.astype(np.float64))  # (N...)
    nan_x, nan_y = np.isnan(x), np.isnan(y)
    d = np.abs(x - y)
    d[nan_x & nan_y] = 0.0  # NaN on both sides (other payload bits): the same
    d[nan_x ^ nan_y] = math.inf  # NaN on one side only
    return float(d.max()) if d.size else 0.0


def _label(r: Record) -> str:
    return f"{r.name} {r.dtype} {r.shape} at step {r.step} (batch {r.batch})"


def _structural(key: tuple[str, int, int], r: Record, position: int, reason: str) -> Divergence:
    return Divergence(r.step, r.batch, *key, r.name, r.dtype, r.shape, None, reason, position)
