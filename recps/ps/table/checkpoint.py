"""On-disk format of table checkpoints: one folder per table shard, raw arrays, a manifest.

Layout written by `SparseTable.save(path, ...)` / `DenseTable.save(path, ...)`:

    path/shard-00000-of-00002/manifest.json     format version, kind, mode, dims, row count,
                             /keys.bin          per file: dtype, shape, bytes, sha256
                             /values.bin ...
    path/shard-00001-of-00002/...

`path` is a local path or any fsspec URL (recps.fs: hdfs://, webhdfs://, memory://, s3:// ...).
Arrays are raw little-endian C-order bytes (no pickle), so a reader in any language can
load them. A shard folder is written under a hidden temporary name and renamed into place only
after every file and the manifest are written (and, on a local disk, flushed to it), so a reader
sees the old folder or the complete new one (on file systems whose rename cannot replace a
folder, such as HDFS, the old one is removed first: save each checkpoint into its own folder).
Readers verify sizes and sha256 checksums and refuse a mismatch with an error that names the file.
Temporaries a writer killed mid-save (kill -9) left in a table folder are swept, and logged, by the
next save or load of it (recps.fs.sweep_temporaries: only recps's temporary names, only those no
live writer can be using). A write that fails (a full disk, a refused permission) removes the temporary folder and raises
naming the shard folder, the file being written and what is left there (recps.fs.write_error);
a transient failure (an HDFS NameNode busy) is raised as it is, for the caller to retry.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shutil
import sys
import time
import uuid
from dataclasses import dataclass

import torch
from fsspec.implementations.local import LocalFileSystem

from recps import fs as rfs
from recps.errors import PSError

__all__ = ["FORMAT_VERSION", "SPEC_FILE", "CheckpointError", "ShardWriter", "ShardReader", "SparseRows", "list_shards",
           "saved_tables", "read_spec", "read_table",
           "shard_dirname"]

FORMAT_VERSION = 1
SPEC_FILE = "spec.json"  # a table's spec, next to its shard folders (written by the PS server 0)
_COMMIT_RECORD = "manifest.json"  # a committed PS checkpoint's record (recps.job.checkpoint.MANIFEST): its "tables"
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


def _join(fs, *parts: str) -> str:
    return os.path.join(*parts) if isinstance(fs, LocalFileSystem) else posixpath.join(*parts)


class ShardWriter:
    """Writes one shard folder atomically; arrays are appended chunk by chunk.

    Use as a context manager: the folder appears under its final name only if the block
    ends without an exception and `commit()` was called. `path`: a local path or fsspec URL.
    """

    def __init__(self, path: str | os.PathLike, shard: int, num_shards: int) -> None:
        if not 0 <= shard < num_shards:
            raise CheckpointError(f"save: shard={shard} is outside [0, num_shards={num_shards})")
        self.fs, self.root = rfs.resolve(path)
        self.local = isinstance(self.fs, LocalFileSystem)
        name = shard_dirname(shard, num_shards)
        self.final = _join(self.fs, self.root, name)
        self.tmp = _join(self.fs, self.root, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._files: dict[str, dict] = {}
        self._handles: dict[str, tuple] = {}
        self._committed = False
        self._writing = "the folder"  # what a failure names: the file being written
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            rfs.sweep_temporaries(self.root, self.fs)  # what a writer killed mid-save left here
            self.fs.makedirs(self.tmp, exist_ok=True)
        except BaseException as e:
            error = self._failed(e)
            if error is e:
                raise
            raise error from e

    def _open(self, name: str):
        path = _join(self.fs, self.tmp, name)
        return open(path, "wb") if self.local else self.fs.open(path, "wb")

    def declare(self, name: str, dtype: torch.dtype, row_shape: tuple[int, ...]) -> None:
        """Create an (initially empty) array `name` with rows of shape `row_shape`."""
        self._writing = f"{name}.bin"
        self._handles[name] = (self._open(f"{name}.bin"), hashlib.sha256())
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
        self._writing = f"{name}.bin"
        handle.write(data)
        digest.update(data)
        spec["shape"][0] += rows.shape[0]
        spec["bytes"] += data.nbytes

    def commit(self, header: dict) -> dict:
        """Flush arrays, write the manifest, rename into place; returns the manifest.

        The arrays' closes and the manifest's write run at once (rfs.concurrently): on HDFS each
        close waits for the NameNode to complete the file (about 0.5 s here), so a shard costs
        one such wait, not one per file. The folder's rename below is what commits it."""
        for name, (_, digest) in self._handles.items():
            self._files[name]["sha256"] = digest.hexdigest()
        manifest = {
            "format_version": FORMAT_VERSION,
            **header,
            "files": self._files,
            "created_unix": time.time(),
        }
        handles, self._handles = [h for h, _ in self._handles.values()], {}
        self._writing = "manifest.json and the arrays' last bytes"

        def close(handle) -> None:
            if self.local:
                handle.flush()
                os.fsync(handle.fileno())
            handle.close()

        def write_manifest() -> None:
            with self._open("manifest.json") as f:
                f.write(json.dumps(manifest, indent=1, sort_keys=True).encode())
                if self.local:
                    f.flush()
                    os.fsync(f.fileno())

        try:
            rfs.concurrently([write_manifest, *(lambda h=h: close(h) for h in handles)])
        except BaseException:
            self._handles = {str(i): (h, None) for i, h in enumerate(handles)}  # abort() closes what is open
            raise
        self._writing = "the rename into place"
        if self.local:
            rfs.fsync_dir(self.tmp)
            old = None
            if os.path.exists(self.final):
                old = _join(self.fs, self.root, f".{os.path.basename(self.final)}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
                os.replace(self.final, old)
            os.replace(self.tmp, self.final)
            rfs.fsync_dir(self.root)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        else:
            if self.fs.exists(self.final):  # HDFS cannot rename over a folder
                self.fs.rm(self.final, recursive=True)
            self.fs.mv(self.tmp, self.final, recursive=True)
        self._committed = True
        return manifest

    def abort(self) -> None:
        for handle, _ in self._handles.values():
            try:
                handle.close()
            except Exception:  # noqa: BLE001 - the failure that led here matters more
                pass
        self._handles = {}
        try:
            if self.local:
                shutil.rmtree(self.tmp, ignore_errors=True)
            elif self.fs.exists(self.tmp):
                self.fs.rm(self.tmp, recursive=True)
        except Exception:  # noqa: BLE001 - as above
            pass

    def _failed(self, exc: BaseException) -> BaseException:
        """Abort, then what to raise for `exc` (recps.fs.write_error: naming the shard folder, the
        file being written and what is left there; transient failures unchanged)."""
        self.abort()

        def left() -> str:
            there = ("the shard folder there is as it was before this save" if self.fs.exists(self.final)
                     else "nothing was written there")
            return there + ("; the temporary folder was removed" if not self.fs.exists(self.tmp)
                            else f"; the temporary {rfs.display(self.fs, self.tmp)} is left: delete it")

        return rfs.write_error(exc, f"{rfs.display(self.fs, self.final)} ({self._writing})", left)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._committed:
            return
        if exc is None or not isinstance(exc, OSError):
            self.abort()
            return
        error = self._failed(exc)
        if error is not exc:
            raise error from exc


def list_shards(path: str | os.PathLike) -> list[str]:
    """The complete set of shard folders under `path` (URLs or local paths, in shard order);
    refuses gaps or mixes."""
    fs, root = rfs.resolve(path)
    shown = rfs.display(fs, root)
    if not fs.isdir(root):
        raise CheckpointError(f"load: checkpoint folder {shown} does not exist")
    rfs.sweep_temporaries(root, fs)  # what a writer killed mid-save left here
    found: dict[int, dict[int, str]] = {}
    for info in fs.ls(root, detail=True):
        name = info["name"].rstrip("/").rsplit("/", 1)[-1]
        m = _SHARD_RE.match(name)
        if m and info.get("type") == "directory":
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = rfs.join(os.fspath(path), name)
    if not found:
        raise CheckpointError(f"load: no shard-XXXXX-of-XXXXX folder in {shown}; was the table saved there?")
    if len(found) > 1:
        raise CheckpointError(
            f"load: {shown} mixes saves with {sorted(found)} shards; save each checkpoint into its own folder"
        )
    num_shards, shards = next(iter(found.items()))
    missing = sorted(set(range(num_shards)) - set(shards))
    if missing:
        raise CheckpointError(f"load: {shown} has {num_shards} shards but shard(s) {missing} are missing")
    return [shards[i] for i in range(num_shards)]


def saved_tables(path: str | os.PathLike) -> list[str]:
    """The tables of the checkpoint folder `path` (one sub-folder per table), for a load that
    restores them all; each has its spec.json and shard folders, or CheckpointError names the
    table and what it lacks (a table is never dropped in silence).

    A committed checkpoint (recps.job.checkpoint: `path/manifest.json`) lists its tables; the
    folders are checked against that list. Without one, every sub-folder holding a spec.json
    or a shard folder is a table."""
    fs, root = rfs.resolve(path)
    shown = rfs.display(fs, root)
    if not fs.isdir(root):
        raise CheckpointError(f"load: checkpoint folder {shown} does not exist; pass the folder a save wrote")
    record = _join(fs, root, _COMMIT_RECORD)
    listed: list[str] | None = None
    if fs.isfile(record):
        try:
            listed = [str(t) for t in json.loads(fs.cat_file(record))["tables"]]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"load: {rfs.display(fs, record)} is unreadable ({type(e).__name__}: {e}); "
                                  "restore it or load another checkpoint") from None
    found = {}  # table -> (has spec.json, has a shard folder)
    for info in fs.ls(root, detail=True):
        name = info["name"].rstrip("/").rsplit("/", 1)[-1]
        if info.get("type") != "directory" or name.startswith((".", "_")):
            continue
        entries = [e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(_join(fs, root, name), detail=False)]
        found[name] = (SPEC_FILE in entries, any(_SHARD_RE.match(e) for e in entries))
    tables = listed if listed is not None else sorted(n for n, (spec, shards) in found.items() if spec or shards)
    if not tables:
        raise CheckpointError(f"load: {shown} holds no table (no sub-folder with {SPEC_FILE} or shard folders); "
                              "pass the folder a save wrote")
    for table in tables:
        spec, shards = found.get(table, (False, False))
        where = f"table {table!r} of {shown}" + (f" (listed in its {_COMMIT_RECORD})" if listed is not None else "")
        if table not in found:
            raise CheckpointError(f"load: {where} has no folder {rfs.display(fs, _join(fs, root, table))}; "
                                  "restore it or load another checkpoint")
        if not spec:
            raise CheckpointError(f"load: {where} has no {SPEC_FILE} "
                                  f"({rfs.display(fs, _join(fs, root, table, SPEC_FILE))} is missing), so the table "
                                  "cannot be created; restore it or load another checkpoint")
        if not shards:
            raise CheckpointError(f"load: {where} has no shard-XXXXX-of-XXXXX folder; the save did not complete: "
                                  "load another checkpoint")
    return list(tables)


def read_spec(table_dir: str | os.PathLike) -> str:
    """The text of `table_dir/spec.json`; CheckpointError names the file when it is missing or unreadable."""
    fs, root = rfs.resolve(table_dir)
    spec = _join(fs, root, SPEC_FILE)
    try:
        return fs.cat_file(spec).decode()
    except FileNotFoundError:
        raise CheckpointError(f"load: {rfs.display(fs, spec)} is missing: table {posixpath.basename(root.rstrip('/'))!r} "
                              "cannot be created from the checkpoint; restore it, or create the table first") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"load: {rfs.display(fs, spec)} is not text ({e}); restore it or load another "
                              "checkpoint") from None


class ShardReader:
    """Reads and verifies one shard folder written by ShardWriter (a local path or URL)."""

    def __init__(self, shard_dir: str | os.PathLike) -> None:
        self.fs, self.path = rfs.resolve(shard_dir)
        self.dir = rfs.display(self.fs, self.path)
        manifest_path = _join(self.fs, self.path, "manifest.json")
        shown = rfs.display(self.fs, manifest_path)
        try:
            raw = self.fs.cat_file(manifest_path)
        except FileNotFoundError:
            raise CheckpointError(f"load: {shown} is missing; the save did not complete") from None
        except OSError as e:
            raise CheckpointError(f"load: {shown} is unreadable ({e}); restore it or re-save") from e
        self.manifest_sha256 = hashlib.sha256(raw).hexdigest()
        try:
            self.manifest = json.loads(raw)
        except ValueError as e:
            raise CheckpointError(f"load: {shown} is unreadable ({e}); restore it or re-save") from e
        version = self.manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"load: {shown} has format_version={version}, this recps reads {FORMAT_VERSION}"
            )

    def has(self, name: str) -> bool:
        return name in self.manifest["files"]

    def read(self, name: str) -> torch.Tensor:
        """Array `name`, after checking its byte count and sha256 against the manifest."""
        spec = self.manifest["files"].get(name)
        if spec is None:
            raise CheckpointError(f"load: {self.dir} has no array {name!r}; the manifest lists {sorted(self.manifest['files'])}")
        path = _join(self.fs, self.path, f"{name}.bin")
        shown = rfs.display(self.fs, path)
        try:
            size = self.fs.size(path)
        except FileNotFoundError:
            size = -1
        if size != spec["bytes"]:
            raise CheckpointError(
                f"load: {shown} has {size} bytes, the manifest says {spec['bytes']}: the file is truncated "
                f"or replaced; restore it or load another checkpoint"
            )
        out = torch.empty(spec["shape"], dtype=_DTYPES[spec["dtype"]])
        buf = memoryview(out.view(torch.uint8).reshape(-1).numpy())
        digest = hashlib.sha256()
        with (open(path, "rb") if isinstance(self.fs, LocalFileSystem) else self.fs.open(path, "rb")) as f:
            pos = 0
            while pos < spec["bytes"]:
                n = _read_into(f, buf[pos : pos + _IO_CHUNK])
                if not n:
                    raise CheckpointError(f"load: {shown} ended early at byte {pos}; restore it")
                digest.update(buf[pos : pos + n])
                pos += n
        if digest.hexdigest() != spec["sha256"]:
            raise CheckpointError(
                f"load: checksum mismatch in {shown}: sha256 {digest.hexdigest()[:16]}..., manifest "
                f"{spec['sha256'][:16]}...; the file is corrupted, restore it or load another checkpoint"
            )
        return out


@dataclass(frozen=True)
class SparseRows:
    """A sparse table as a checkpoint holds it, read without a server: `keys` (N,) int64 ascending,
    `values` (N, D) float32 and, when asked for, the optimizer `state` (N, S). A delta save also
    has `deleted` (X,) int64 ascending: the keys deleted since the save before it, which a reader
    applying the delta removes after writing its rows (as SparseTable.load does); None otherwise."""

    keys: torch.Tensor
    values: torch.Tensor
    state: torch.Tensor | None = None
    deleted: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.keys.numel())

    def lookup(self, keys: torch.Tensor, default: float = 0.0) -> torch.Tensor:
        """(K, D) rows of int64 `keys` (the table's keys); `default` fills the rows of absent ones."""
        keys = keys.reshape(-1).to(torch.int64)
        at = torch.searchsorted(self.keys, keys).clamp_(max=max(len(self) - 1, 0))
        out = torch.full((keys.numel(), self.values.shape[1]), float(default), dtype=self.values.dtype)
        if len(self):
            found = self.keys[at] == keys
            out[found] = self.values[at[found]]
        return out


def read_table(path: str | os.PathLike, with_state: bool = False) -> SparseRows | dict[str, torch.Tensor]:
    """One table saved under `path` (any of its save modes, every shard verified), in this process:
    a sparse table's rows (SparseRows), a dense table's parameters by name. The serving side of a
    checkpoint: no server, no optimizer state unless `with_state`."""
    readers = [ShardReader(d) for d in list_shards(path)]
    if readers[0].manifest.get("kind") == "dense":
        params: dict[str, torch.Tensor] = {}
        for r in readers:
            for name, spec in r.manifest["params"].items():
                params[name] = r.read(f"value.{spec['file']}").reshape(spec["shape"])
        return params
    keys, values, state, deleted = [], [], [], []
    for r in readers:
        keys.append(r.read("keys"))
        values.append(r.read("values").to(torch.float32))
        if with_state:
            if not r.has("state"):
                raise CheckpointError(f"load: {r.dir} holds no optimizer state (a {r.manifest['mode']!r} save); "
                                      "read it with with_state=False")
            state.append(r.read("state"))
        if r.manifest.get("mode") == "delta" and r.has("deleted"):
            deleted.append(r.read("deleted"))
    all_keys = torch.cat(keys)
    order = torch.argsort(all_keys)
    gone = torch.sort(torch.cat(deleted)).values if deleted else None
    return SparseRows(all_keys[order], torch.cat(values)[order], torch.cat(state)[order] if with_state else None, gone)


def _read_into(f, view: memoryview) -> int:
    """f.readinto(view), or read + copy for file objects without it (hdfs-native's)."""
    try:
        return f.readinto(view)
    except (NotImplementedError, AttributeError):
        data = f.read(len(view))
        view[: len(data)] = data
        return len(data)
