"""Stale temporaries: a writer killed with kill -9 mid-save leaves its hidden temporary in the
checkpoint folder; the next save (or load) there removes it and logs it. Only recps's own
temporary names are touched, and only those no live writer can be using: this process's own, a
running writer's, and (a folder shared over NFS) a recent one newer than this process stay."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from recps import fs as rfs
from recps.fs.stale import STALE_AFTER_S, process_started
from recps.ps.table import SparseTable, make_rule

pytestmark = pytest.mark.e2e  # every test here starts a process

# A save of a table big enough to be caught mid-write (SAVING is printed just before it starts).
SAVER = r"""
import sys, torch
from recps.ps.table import SparseTable, make_rule
t = SparseTable(16, optimizer=make_rule("sgd", lr=1.0))
t.pull(torch.arange(int(sys.argv[2])))
print("SAVING", flush=True)
t.save(sys.argv[1], "full", shard=0, num_shards=1)
print("SAVED", flush=True)
"""


def _temporaries(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if rfs.is_temporary(n))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(30)
    return p.pid


@pytest.mark.slow
def test_a_save_killed_mid_write_leaves_a_temporary_that_the_next_save_sweeps(tmp_path):
    folder = tmp_path / "ckpt" / "emb"
    killed = subprocess.Popen([sys.executable, "-c", SAVER, str(folder), "600000"], stdout=subprocess.PIPE, text=True)
    assert killed.stdout.readline().strip() == "SAVING"
    deadline = time.monotonic() + 60
    while not (folder.is_dir() and _temporaries(folder)):  # the shard's temporary folder exists: the write is under way
        assert time.monotonic() < deadline and killed.poll() is None, "the save ended before it could be killed"
        time.sleep(0.005)
    killed.kill()  # kill -9
    killed.wait(30)
    left = _temporaries(folder)
    assert len(left) == 1 and left[0].startswith(".shard-00000-of-00001.tmp-" + str(killed.pid)), left
    assert not (folder / "shard-00000-of-00001").exists()

    # The restarted job saves into the same folder: the dead writer's temporary goes, and is logged.
    again = subprocess.run([sys.executable, "-c", SAVER, str(folder), "1000"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "SAVED" in again.stdout, again.stderr
    assert _temporaries(folder) == [], again.stderr
    assert f"removed the stale temporary {folder / left[0]}: its writer, pid {killed.pid}, is not running" in again.stderr
    table = SparseTable(16, optimizer=make_rule("sgd", lr=1.0))
    assert table.load(str(folder), shard=0, num_shards=1) == 1000


def test_only_temporaries_no_live_writer_can_use_are_swept(tmp_path, caplog):
    dead = _dead_pid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while process_started(sleeper.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        names = {
            "own": f".spec.json.tmp-{os.getpid()}-0123abcd",  # this process's writer may be running
            "live": f".shard-00000-of-00002.tmp-{sleeper.pid}-0123abcd",  # a running writer
            "recent_dead": f".manifest.json.tmp-{dead}-0123abcd",  # dead writer, but recent: NFS guard
            "old_dead": f".manifest.json.tmp-{dead}-fedcba98",  # dead writer, older than STALE_AFTER_S
            "old_dead_aside": f".manifest.json.tmp-{dead}-fedcba99.old",  # write_atomic's old record aside
            "replaced": f".shard-00001-of-00002.old-{dead}-00ff00ff",  # ShardWriter's replaced folder
            "reused": f".spec.json.tmp-{sleeper.pid}-aaaabbbb",  # the pid now runs a younger process
        }
        for key, name in names.items():
            path = tmp_path / name
            if "shard" in name:
                path.mkdir()
                (path / "keys.bin").write_bytes(b"x")
            else:
                path.write_bytes(b"x")
        old = time.time() - STALE_AFTER_S - 120
        for key in ("old_dead", "old_dead_aside", "replaced", "reused"):
            for p in [tmp_path / names[key], *((tmp_path / names[key]).glob("*"))]:
                os.utime(p, (old, old))
        others = ["shard-00000-of-00002", ".hidden", "x.tmp", f".a.tmp-{dead}-nothex!", f"a.tmp-{dead}-0123abcd", "spec.json"]
        for name in others:
            (tmp_path / name).write_bytes(b"keep")
        with caplog.at_level(logging.WARNING, logger="recps.fs"):
            removed = rfs.sweep_temporaries(tmp_path)
        assert sorted(os.path.basename(p) for p in removed) == sorted(names[k] for k in ("old_dead", "old_dead_aside",
                                                                                           "replaced", "reused"))
        left = sorted(os.listdir(tmp_path))
        assert left == sorted([names["own"], names["live"], names["recent_dead"], *others])
        assert f"pid {sleeper.pid} now belongs to a process started after it" in caplog.text
        assert caplog.text.count("removed the stale temporary") == 4
        assert rfs.sweep_temporaries(tmp_path) == []  # nothing more to do
        assert rfs.sweep_temporaries(tmp_path / "missing") == []  # a folder not there yet: nothing
    finally:
        sleeper.kill()
        sleeper.wait(10)


def test_a_load_sweeps_the_table_folder_too(tmp_path, caplog):
    table = SparseTable(4, optimizer=make_rule("sgd", lr=1.0))
    table.pull(torch.arange(10))
    table.save(str(tmp_path), "full", shard=0, num_shards=1)
    stale = tmp_path / f".shard-00000-of-00001.tmp-{_dead_pid()}-0123abcd"
    stale.mkdir()
    old = time.time() - STALE_AFTER_S - 10
    os.utime(stale, (old, old))
    with caplog.at_level(logging.WARNING, logger="recps.fs"):
        assert SparseTable(4, optimizer=make_rule("sgd", lr=1.0)).load(str(tmp_path), shard=0, num_shards=1) == 10
    assert not stale.exists() and f"removed the stale temporary {stale}" in caplog.text
