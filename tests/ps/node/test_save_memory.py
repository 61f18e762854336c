"""A server's resident memory stays flat over many saves (the stream job saves a delta and a full
checkpoint every pass).

Each save used to write its tables on fresh threads (rfs.concurrently), and glibc's malloc hands
each new thread whichever of its arenas is free, up to 8 x cores of them: every save left its row
copies' freed memory in other arenas, where it stays resident. The server's heap in use did not
grow (mallinfo2: 189 MiB in use after every pass of 26 tables x 20k rows) but its free memory did,
so RSS rose by ~10 MiB a save pass with a 16-core machine's arena cap and did not level off. Now the
tables are written by the server's own save threads, the same ones every save.

The child process runs with MALLOC_ARENA_MAX=128, the cap glibc gives a 16-core machine (this test
may run on 2 cores, where the cap of 16 arenas hides most of it). Measured here, 16 tables x 20k
rows, RSS growth from the 2nd to the 12th delta + full save pass: 106, 145 and 118 MiB before,
11, 18 and 13 MiB after.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # every test here starts a process

REPO = Path(__file__).resolve().parents[3]
TABLES, ROWS, PASSES = 16, 20_000, 12
GROWTH_BOUND_MIB = 50.0

# One server and its client in a fresh process: TABLES sparse tables of ROWS rows (dim 11, row-wise
# Adagrad, CTR accessor), then PASSES times a delta and a full save (each into its own folder,
# removed after) and a push to half the rows; prints VmRSS after each pass.
_CHILD = """
import json, os, shutil, sys, tempfile
import torch
from recps.ps.modes import server_halves
from recps.ps.node import PSClient, PSServer

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

tables, rows, passes = (int(a) for a in sys.argv[1:4])
root = tempfile.mkdtemp(prefix="recps-save-memory-")
out = []
try:
    with PSServer(token="m", halves=server_halves(), storage_roots=[root]) as server, \\
            PSClient([server.endpoint], token="m") as client:
        gen = torch.Generator().manual_seed(0)
        keys = torch.arange(rows, dtype=torch.int64)
        for t in range(tables):
            client.create_sparse_table(f"t{t}", dim=11, optimizer={"name": "rowwise_adagrad", "lr": 0.05},
                                       accessor={"base_threshold": 0.0, "delta_threshold": 0.0})
            client.push(f"t{t}", keys, torch.randn(rows, 11, generator=gen), shows=torch.ones(rows),
                        clicks=torch.zeros(rows)).wait()
        for i in range(passes):
            for mode in ("delta", "full"):
                folder = os.path.join(root, f"{i}-{mode}")
                saved = client.save(folder, mode=mode)
                assert sorted(saved) == sorted(f"t{t}" for t in range(tables)), saved
                shutil.rmtree(folder)
            for t in range(tables):
                client.push(f"t{t}", keys[: rows // 2], torch.randn(rows // 2, 11, generator=gen),
                            shows=torch.ones(rows // 2), clicks=torch.zeros(rows // 2)).wait()
            out.append(round(rss_mib(), 1))
finally:
    shutil.rmtree(root, ignore_errors=True)
print(json.dumps(out))
"""


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
                    reason="measures VmRSS under glibc's malloc arenas (Linux, glibc)")
def test_server_rss_stays_flat_over_many_delta_and_full_saves():
    env = dict(os.environ, MALLOC_ARENA_MAX="128", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(TABLES), str(ROWS), str(PASSES)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rss = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rss) == PASSES
    growth = rss[-1] - rss[1]  # after the first pass's warm-up (tables, kernels, first arenas)
    assert growth < GROWTH_BOUND_MIB, (
        f"server RSS grew {growth:.1f} MiB over {PASSES - 2} delta + full save passes of {TABLES} tables x "
        f"{ROWS} rows (bound {GROWTH_BOUND_MIB} MiB; VmRSS per pass {rss})")
