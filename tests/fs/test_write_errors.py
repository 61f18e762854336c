"""recps.fs.write_atomic when the write fails (issue 15 point 5): the error names the target, the
reason and what is left there, and no temporary remains. Real failures where this process may
mount a tmpfs (a full one, a read-only one), injected ones elsewhere; a transient failure is
raised as it was, so retry_transient still retries it. A rewritten error is a recps FileSystemError
(entry points print it on one line) of the original's class (a PermissionError stays one)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import uuid
from pathlib import Path

import pytest

import recps.fs as rfs

MiB = 1 << 20


@contextlib.contextmanager
def tmpfs(path: Path, size: int, readonly: bool = False):
    """A tmpfs of `size` bytes at `path` for the block; skips where this process may not mount one."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if readonly else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (mount: {proc.stderr.strip() or proc.returncode})")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@pytest.mark.e2e
def test_a_full_file_system_names_the_target_and_keeps_the_old_file(tmp_path):
    with tmpfs(tmp_path / "small", MiB) as mount:
        target = mount / "d" / "record.bin"
        with pytest.raises(OSError, match=rf"^cannot write {target}: OSError: \[Errno 28\] No space left on device; "
                                          r"nothing was written there; the temporary was removed$") as e:
            rfs.write_atomic(str(target), os.urandom(3 * MiB))
        assert e.value.errno == errno.ENOSPC and isinstance(e.value, rfs.FileSystemError)  # a recps error: one line
        assert os.listdir(target.parent) == []
        rfs.write_atomic(str(target), b"old")
        with pytest.raises(OSError, match=rf"^cannot write {target}: .*No space left on device; the file there is as "
                                          r"it was before this write; the temporary was removed$"):
            rfs.write_atomic(str(target), os.urandom(3 * MiB), overwrite=True)
        assert target.read_bytes() == b"old" and os.listdir(target.parent) == ["record.bin"]


@pytest.mark.e2e
def test_a_read_only_file_system_names_the_target(tmp_path):
    with tmpfs(tmp_path / "ro", MiB, readonly=True) as mount:
        with pytest.raises(OSError, match=rf"^cannot write {mount / 'r.json'}: OSError: \[Errno 30\] Read-only file "
                                          r"system.*; nothing was written there") as e:
            rfs.write_atomic(str(mount / "r.json"), b"{}")
        assert e.value.errno == errno.EROFS


def test_an_injected_refusal_keeps_its_class_and_names_the_target(monkeypatch):
    url = f"memory://recps-write-errors-{uuid.uuid4().hex[:8]}/r.json"
    fs, path = rfs.resolve(url)

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied (injected)")

    monkeypatch.setattr(fs, "open", refuse)
    with pytest.raises(PermissionError, match=rf"^cannot write {url.replace('//', '///')}: PermissionError: \[Errno 13\] "
                                              r"Permission denied \(injected\); nothing was written there") as e:
        rfs.write_atomic(url, b"{}")
    assert e.value.errno == errno.EACCES and isinstance(e.value, rfs.FileSystemPermissionError)


def test_a_transient_failure_is_raised_as_it_was_and_retried(monkeypatch):
    url = f"memory://recps-write-errors-{uuid.uuid4().hex[:8]}/r.json"
    fs, path = rfs.resolve(url)
    real_open, calls = fs.open, []
    reset = ConnectionResetError(errno.ECONNRESET, "Connection reset by peer (injected)")

    def flaky(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 1:
            raise reset
        return real_open(*args, **kwargs)

    monkeypatch.setattr(fs, "open", flaky)
    with pytest.raises(ConnectionResetError) as e:
        rfs.write_atomic(url, b"{}")
    assert e.value is reset  # unchanged: callers classify it as transient
    rfs.retry_transient(lambda: rfs.write_atomic(url, b'{"ok": 1}'), "write r.json", retries=2, backoff_s=0.01)
    assert rfs.read_bytes(url) == b'{"ok": 1}' and fs.ls(path.rsplit("/", 1)[0], detail=False) == [path]
