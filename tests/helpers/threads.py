"""Threads and waits for tests that watch other threads or processes: `run_threads` and
`call_in_threads` (each thread joined with a bound; a thread still running fails the test),
`wait_until` (an event awaited with a bound, never an elapsed time)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

__all__ = ["run_threads", "call_in_threads", "wait_until"]


def run_threads(fns: Sequence[Callable[[], object]], timeout: float = 60.0) -> None:
    """Each of `fns` in a thread of its own (daemons: a stuck one does not hold the run), each joined
    for at most `timeout` s; raises the first error one raised, and fails naming the threads still
    running when their bound passed (a thread that never returns is a failure, not a pass)."""
    errors: list[BaseException] = []

    def run(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,), name=f"run_threads-{i}", daemon=True)
               for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        raise AssertionError(f"{', '.join(stuck)} of {len(threads)} still running after {timeout} s each")


def call_in_threads(fns: Sequence[Callable[[], object]], timeout: float = 30.0) -> list:
    """Each of `fns` on a thread of its own at once; returns their results, or the exception each
    raised, in order. A thread still running `timeout` s after the start fails the test naming it
    (its None would otherwise read as a result)."""
    out: list = [None] * len(fns)

    def run(i, fn):
        try:
            out[i] = fn()
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, fn), name=f"call_in_threads-{i}", daemon=True)
               for i, fn in enumerate(fns)]
    deadline = time.monotonic() + timeout
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        raise AssertionError(f"{', '.join(stuck)} of {len(threads)} still running {timeout} s after the start")
    return out


def wait_until(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.02):
    """Polls `condition` until it returns a true value (returned) or `timeout` s pass; then fails
    naming `what` was awaited. For an event another thread or process causes: wait for it, with a
    bound, never for an elapsed time."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout} s for {what}; it did not happen")
        time.sleep(interval)
