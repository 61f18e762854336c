"""A pass's data: wait for its splits' donefiles (bounded), list its files, read this worker's share."""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

from recps import fs as rfs
from recps.data.reader import Examples, expand_paths, load_tensors
from recps.data.schema import Schema
from recps.errors import DataError

__all__ = ["wait_for_splits", "pass_files", "worker_files", "load_share"]

log = logging.getLogger("recps.stream")


def wait_for_splits(folders: Sequence[str], donefile: str, *, sleep_s: float, timeout_s: float,
                    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> float:
    """Wait until every folder holds `donefile`, polling every `sleep_s`; returns the seconds waited.

    A file system that does not answer (an HDFS NameNode down or restarting, a timeout: recps.fs's
    TransientFileSystemError) counts as "not ready yet": the wait goes on, logged once per outage,
    within the same bound. Raises DataError naming the first split not ready after `timeout_s`
    (and the last file system error, if the split could not even be looked at); a definite error
    (refused permission, a bad URL) at once."""
    start = clock()
    logged = False
    for folder in folders:
        marker = rfs.join(folder, donefile)
        outage: rfs.TransientFileSystemError | None = None
        while True:
            try:
                ready = rfs.exists(marker)
                if outage is not None:
                    log.warning("stream: %s answers again after %.0f s", marker, clock() - start)
                    outage = None
                if ready:
                    break
            except rfs.TransientFileSystemError as e:
                if outage is None:
                    log.warning("stream: %s cannot be looked at (%s); waiting on, at most %g s in all "
                                "(stream.wait_timeout_s)", marker, e, timeout_s)
                outage = e
            waited = clock() - start
            if waited >= timeout_s:
                if outage is not None:
                    raise DataError(f"stream split {folder}: its file system did not answer for the last of "
                                    f"{waited:.0f} s (stream.wait_timeout_s={timeout_s:g}): {outage}. Bring the "
                                    "file system back and run the same command again: the job resumes after its "
                                    "last committed pass") from outage
                raise DataError(f"stream split {folder} has no {donefile} after {waited:.0f} s (stream.wait_timeout_s="
                                f"{timeout_s:g}); is its producer running? Raise stream.wait_timeout_s, check "
                                "stream.root / stream.layout, or end the stream earlier (stream.end_day)")
            if not logged and outage is None:
                log.info("stream: waiting for %s (every %g s, at most %g s)", marker, sleep_s, timeout_s)
                logged = True
            sleep(min(sleep_s, max(0.0, timeout_s - waited)))
    return clock() - start


def pass_files(folders: Sequence[str]) -> list[str]:
    """The data files of the pass's split folders, in order (names starting with '_' or '.' skipped)."""
    files: list[str] = []
    for folder in folders:
        try:
            found = expand_paths([folder])
        except DataError:
            found = []
        if not found:
            raise DataError(f"stream split {folder} is marked ready but holds no data file; the producer wrote "
                            "its donefile without data: remove the donefile and rewrite the split")
        files.extend(found)
    return files


def worker_files(files: Sequence[str], worker: int, workers: int, whole_pass: bool) -> tuple[list[str], int, int]:
    """(files, row shard, of shards) this worker reads: its files (round robin) when the pass has at
    least one file per worker and `whole_pass` is false; else every file, and its row shard."""
    if not whole_pass and len(files) >= workers:
        return list(files[worker::workers]), 0, 1
    return list(files), worker, workers


def load_share(files: Sequence[str], schema: Schema, error_budget: float) -> Examples:
    return load_tensors(list(files), schema, error_budget=error_budget)
