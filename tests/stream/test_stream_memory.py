"""A stream worker hands the memory a pass freed back to the OS after the pass.

glibc's malloc keeps what a thread frees in that thread's arena when live allocations sit above it;
the pass's reader and training threads are new every pass, so each pass could leave its freed data
resident in another arena. recps.stream.pass_loop._release_freed_memory (malloc_trim) runs after
every pass.

The scenario runs in a fresh interpreter: inside the test process, memory that earlier tests freed
is already resident and the pass's blocks reuse it, so RSS would not move at all (CI saw 2629 ->
2629 MiB) and the test would show nothing either way."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e  # every test here starts a process

BLOCKS = 100  # 1 MiB each

SCENARIO = f"""
import json, threading
import torch
from recps.stream.pass_loop import _release_freed_memory, _rss_mib

kept = []

def a_pass():  # on a new thread, as a pass's reader and training threads
    first = torch.ones(1 << 20)  # 4 MiB, mmapped; its free raises glibc's mmap threshold above 1 MiB
    del first
    blocks = []
    for _ in range({BLOCKS}):
        blocks.append(torch.ones(1 << 18))  # 1 MiB, from the thread's arena, every page touched
        kept.append(torch.ones(16))  # a small live tensor after each: the freed blocks cannot merge into the top
    blocks.clear()

before = _rss_mib()
thread = threading.Thread(target=a_pass)
thread.start()
thread.join()
held = _rss_mib()
_release_freed_memory()
print(json.dumps({{"before": before, "held": held, "after": _rss_mib()}}))
"""


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
                    reason="glibc's malloc_trim and Linux's VmRSS")
def test_memory_a_pass_thread_freed_leaves_the_process_after_release():
    done = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    before, held, after = rss["before"], rss["held"], rss["after"]
    assert held - before > 0.8 * BLOCKS, (f"glibc returned the freed blocks by itself (RSS {before} -> {held} MiB): "
                                          "this test no longer shows what the release is for")
    assert held - after > 0.8 * BLOCKS, f"RSS {before} MiB before the pass, {held} after it, {after} after the release"
