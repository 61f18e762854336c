"""On-disk format of table checkpoints: one folder per table shard, raw arrays, a manifest.

Layout written by `SparseTable.save(path, ...)` / `DenseTable.save(path, ...)`:

    path/shard-00000-of-00002/manifest.json     format version, kind, mode, dims, row count,
                             /keys.bin          per file: dtype, shape, bytes, sha256
                             /values.bin ...
    path/shard-00001-of-00002/...

Arrays are raw little-endian C-order bytes (no pickle), so a reader in any language can
load them. A shard folder is written under a temporary name and renamed into place only
after every file and the manifest are flushed (atomic on POSIX), so a reader sees either
the old folder or the complete new one. Readers verify sizes and sha256 checksums and
refuse a mismatch with an error that names the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
import uuid
from pathlib import Path

import torch

from recps.errors import PSError

__all__ = ["FORMAT_VERSION", "CheckpointError", "ShardWriter", "ShardReader", "list_shards", "shard_dirname"]

FORMAT_VERSION = 1
_SHARD_RE = re.compile(r"^shard-(\d{5})-of-(\d{5})$")
_IO_CHUNK = 64 << 20

if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("recps table checkpoints assume a little-endian machine")


class CheckpointError(PSError):
    """A checkpoint is missing, incomplete, corrupted or does not fit the table loading it."""


def shard_dirname(shard: int, num_shards: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}"


_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "int64": torch.int64,
}


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise CheckpointError(f"dtype {dtype} cannot be written to a checkpoint; use one of {sorted(_DTYPES)}")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardWriter:
    """Writes one shard folder atomically; arrays are appended chunk by chunk.

    Use as a context manager: the folder appears under its final name only if the block
    ends without an exception and `commit()` was called.
    """

    def __init__(self, path: str | os.PathLike, shard: int, num_shards: int) -> None:
        if not 0 <= shard < num_shards:
            raise CheckpointError(f"save: shard={shard} is outside [0, num_shards={num_shards})")
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.final = self.root / shard_dirname(shard, num_shards)
        self.tmp = self.root / f".{self.final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        self._files: dict[str, dict] = {}
        self._handles: dict[str, tuple] = {}
        self._committed = False

    def declare(self, name: str, dtype: torch.dtype, row_shape: tuple[int, ...]) -> None:
        """Create an (initially empty) array `name` with rows of shape `row_shape`."""
        handle = open(self.tmp / f"{name}.bin", "wb")
        self._handles[name] = (handle, hashlib.sha256())
        self._files[name] = {"dtype": _dtype_name(dtype), "shape": [0, *row_shape], "bytes": 0}

    def append(self, name: str, rows: torch.Tensor) -> None:
        """Append rows (n, *row_shape) to array `name`."""
        spec = self._files[name]
        if list(rows.shape[1:]) != spec["shape"][1:] or _dtype_name(rows.dtype) != spec["dtype"]:
            raise CheckpointError(
                f"save: array {name} declared {spec['dtype']} rows of {spec['shape'][1:]}, "
                f"got {rows.dtype} {list(rows.shape)}"
            )
        data = memoryview(rows.detach().contiguous().view(torch.uint8).reshape(-1).numpy())
        handle, digest = self._handles[name]
        handle.write(data)
        digest.update(data)
        spec["shape"][0] += rows.shape[0]
        spec["bytes"] += data.nbytes

    def commit(self, header: dict) -> dict:
        """Flush arrays, write the manifest, rename into place; returns the manifest."""
        for name, (handle, digest) in self._handles.items():
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
            self._files[name]["sha256"] = digest.hexdigest()
        self._handles = {}
        manifest = {
            "format_version": FORMAT_VERSION,
            **header,
            "files": self._files,
            "created_unix": time.time(),
        }
        tmp_manifest = self.tmp / "manifest.json.tmp"
        with open(tmp_manifest, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_manifest, self.tmp / "manifest.json")
        _fsync_dir(self.tmp)
        old = None
        if self.final.exists():
            old = self.root / f".{self.final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(self.final, old)
        os.replace(self.tmp, self.final)
        _fsync_dir(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._committed = True
        return manifest

    def abort(self) -> None:
        for handle, _ in self._handles.values():
            handle.close()
        self._handles = {}
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._committed:
            self.abort()


def list_shards(path: str | os.PathLike) -> list[Path]:
    """The complete set of shard folders under `path`, in shard order; refuses gaps or mixes."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"load: checkpoint folder {root} does not exist")
    found: dict[int, dict[int, Path]] = {}
    for child in root.iterdir():
        m = _SHARD_RE.match(child.name)
        if m and child.is_dir():
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = child
    if not found:
        raise CheckpointError(f"load: no shard-XXXXX-of-XXXXX folder in {root}; was the table saved there?")
    if len(found) > 1:
        raise CheckpointError(
            f"load: {root} mixes saves with {sorted(found)} shards; save each checkpoint into its own folder"
        )
    num_shards, shards = next(iter(found.items()))
    missing = sorted(set(range(num_shards)) - set(shards))
    if missing:
        raise CheckpointError(f"load: {root} has {num_shards} shards but shard(s) {missing} are missing")
    return [shards[i] for i in range(num_shards)]


class ShardReader:
    """Reads and verifies one shard folder written by ShardWriter."""

    def __init__(self, shard_dir: str | os.PathLike) -> None:
        self.dir = Path(shard_dir)
        manifest_path = self.dir / "manifest.json"
        if not manifest_path.is_file():
            raise CheckpointError(f"load: {manifest_path} is missing; the save did not complete")
        try:
            with open(manifest_path) as f:
                self.manifest = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"load: {manifest_path} is unreadable ({e}); restore it or re-save") from e
        version = self.manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"load: {manifest_path} has format_version={version}, this recps reads {FORMAT_VERSION}"
            )

    def has(self, name: str) -> bool:
        return name in self.manifest["files"]

    def read(self, name: str) -> torch.Tensor:
        """Array `name`, after checking its byte count and sha256 against the manifest."""
        spec = self.manifest["files"].get(name)
        if spec is None:
            raise CheckpointError(f"load: {self.dir} has no array {name!r}; the manifest lists {sorted(self.manifest['files'])}")
        path = self.dir / f"{name}.bin"
        size = path.stat().st_size if path.is_file() else -1
        if size != spec["bytes"]:
            raise CheckpointError(
                f"load: {path} has {size} bytes, the manifest says {spec['bytes']}: the file is truncated "
                f"or replaced; restore it or load another checkpoint"
            )
        out = torch.empty(spec["shape"], dtype=_DTYPES[spec["dtype"]])
        buf = memoryview(out.view(torch.uint8).reshape(-1).numpy())
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            pos = 0
            while pos < spec["bytes"]:
                n = f.readinto(buf[pos : pos + _IO_CHUNK])
                if not n:
                    raise CheckpointError(f"load: {path} ended early at byte {pos}; restore it")
                digest.update(buf[pos : pos + n])
                pos += n
        if digest.hexdigest() != spec["sha256"]:
            raise CheckpointError(
                f"load: checksum mismatch in {path}: sha256 {digest.hexdigest()[:16]}..., manifest "
                f"{spec['sha256'][:16]}...; the file is corrupted, restore it or load another checkpoint"
            )
        return out
