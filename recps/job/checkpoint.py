"""The checkpoint formats: of a local job (ps=local; save and load) and of a parameter-server job (ps=sync|async|geo; commit, verify, find).

A local checkpoint is a folder with `checkpoint.pt` (tensors and plain containers only, loaded
with `weights_only=True`), `config.yaml` (the composed config that produced it), so
`recps.evaluate` can rebuild the model from the folder alone, and `checkpoint.json`, its record
(kind "local", the byte count and sha256 of both files), written last. A load verifies both files
against the record before it unpickles anything and refuses, naming the file, one that differs
(overwritten rows, a damaged header, a truncated copy) or a folder without a readable record (a
save that did not finish). A save stages both files as temporaries beside their targets first:
a failed write (a full disk, a refused permission) removes them, raises naming the file and
leaves the checkpoint that was there as it was; only then is the old record removed, the files
renamed into place and the new record written.

A PS checkpoint is a folder (a local path or any fsspec URL, recps.fs) that the servers write
their shards into, committed by one manifest written last and atomically:

    <folder>/<table>/spec.json, shard-SSSSS-of-NNNNN/...   each server's shard (recps.ps.table)
    <folder>/config.yaml                                   the composed config
    <folder>/progress/worker-XXXXX.json                    each worker's steps and positions
    <folder>/workers/worker-XXXXX.pt                       what only a worker holds (geo)
    <folder>/manifest.json                                 kind "ps", tables, progress, and the
                                                           sha256 of every spec.json, shard
                                                           manifest (which holds the sha256 of
                                                           each array), worker state file and
                                                           config.yaml

A folder without manifest.json is not a checkpoint (a save that did not finish); readers refuse
it, and refuse a shard or spec whose checksum differs from the manifest, naming the file.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import posixpath
import time
import uuid
from typing import TYPE_CHECKING, Sequence

import torch
from fsspec.implementations.local import LocalFileSystem

from recps import fs as rfs
from recps.errors import ConfigError
from recps.ps.modes.dense import load_optimizer_state
from recps.ps.table.checkpoint import SparseRows, read_table

if TYPE_CHECKING:
    from recps.job.parts import Job
    from recps.job.settings import JobSettings

__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_file", "find_checkpoint", "commit_ps_checkpoint",
           "verify_ps_checkpoint", "read_recorded", "committed_checkpoints", "prune_step_checkpoints",
           "read_ps_checkpoint", "SparseRows", "MANIFEST", "LOCAL_RECORD", "FORMAT_VERSION"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"  # a PS checkpoint's commit record
LOCAL_RECORD = "checkpoint.json"  # a local checkpoint's record: sha256 of checkpoint.pt and config.yaml
LOCAL_FILES = ("checkpoint.pt", "config.yaml")
SPEC_FILE = "spec.json"  # recps.ps.node.server.SPEC_FILE


def checkpoint_file(path: str | os.PathLike) -> str:
    """The checkpoint.pt of a local checkpoint folder (or the file itself); raises if absent."""
    kind, found = find_checkpoint(path)
    if kind != "local":
        raise ConfigError(f"{found} is a parameter-server checkpoint; resume it with the ps mode it was trained "
                          "with (ps=sync|async|geo), or evaluate it with python -m recps.evaluate")
    return found


def parent_url(url: str) -> str:
    """The folder holding `url` (a path or URL)."""
    return url.rstrip("/").rsplit("/", 1)[0] if "://" in url else os.path.dirname(url)


def save_checkpoint(job: "Job", folder: str | os.PathLike) -> str:
    """Writes `folder/checkpoint.pt`, `config.yaml` and their record `checkpoint.json` (any
    fsspec URL); returns the folder. Both files are staged first, so a write that fails leaves the
    checkpoint that was there as it was (see the module docstring); the error names the file."""
    folder = os.fspath(folder)
    state = {
        "format_version": FORMAT_VERSION,
        "model": job.model.state_dict(),
        "optimizer": job.optimizer.state_dict(),
        "embedding_optimizer": job.collection.fused_optimizer.state_dict(),
        "epochs_done": job.epochs_done,
        "steps_done": job.steps_done,
        "model_target": job.settings.model_target,
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payloads = {"checkpoint.pt": buffer.getbuffer(), "config.yaml": job.settings.config_yaml.encode()}
    record = {"format_version": FORMAT_VERSION, "kind": "local", "model_target": state["model_target"],
              "steps_done": job.steps_done, "created_unix": time.time(),
              "files": {name: {"bytes": len(data), "sha256": _sha256(data)} for name, data in payloads.items()}}
    fs, root = rfs.resolve(folder)
    staged: dict[str, str] = {}  # final path -> temporary
    try:
        for name, data in payloads.items():
            target = _fs_join(fs, root, name)
            staged[target] = _stage(fs, target, data)
    except BaseException as exc:
        _discard(fs, staged.values())
        error = rfs.write_error(exc, rfs.display(fs, _fs_join(fs, root, name)), lambda: (
            "the checkpoint already there is kept as it was"
            if fs.exists(_fs_join(fs, root, LOCAL_RECORD)) else "no checkpoint was saved there")
            + "; the temporaries were removed")
        if error is exc:
            raise
        raise error from exc
    target = _fs_join(fs, root, LOCAL_RECORD)
    try:
        if fs.exists(target):
            fs.rm_file(target)  # from here until the new record, a load refuses the folder
        for target, tmp in staged.items():
            _publish(fs, tmp, target)
        target = _fs_join(fs, root, LOCAL_RECORD)
        rfs.write_atomic(rfs.join(folder, LOCAL_RECORD), json.dumps(record, indent=1, sort_keys=True), overwrite=True)
    except BaseException as exc:
        _discard(fs, staged.values())
        error = rfs.write_error(exc, rfs.display(fs, target), f"{rfs.display(fs, root)} holds no complete checkpoint "
                                f"now (its {LOCAL_RECORD} is missing, so a load refuses it); save again")
        if error is exc:
            raise
        raise error from exc
    return folder


def load_checkpoint(job: "Job", path: str | os.PathLike) -> None:
    """Restores a job built from a compatible config (same model and table shapes), after checking
    checkpoint.pt and config.yaml against their record (checkpoint.json); refuses, naming the file,
    a checkpoint that differs from it or has none."""
    file = checkpoint_file(path)
    folder = parent_url(file)
    record = _local_record(folder, file)
    read_recorded(folder, record, "config.yaml", record_name=LOCAL_RECORD)
    data = read_recorded(folder, record, "checkpoint.pt", record_name=LOCAL_RECORD)
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - its sha256 matched: written by another torch, or not by recps.train
        raise ConfigError(f"{file} matches its {LOCAL_RECORD} but torch cannot read it ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}); load it with the torch and recps "
                          "that wrote it, or re-train") from exc
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        version = state.get("format_version") if isinstance(state, dict) else type(state).__name__
        raise ConfigError(f"{file}: checkpoint format {version}, this recps reads "
                          f"{FORMAT_VERSION}; re-train or use the recps version that wrote it")
    if state["model_target"] != job.settings.model_target:
        raise ConfigError(f"{file} holds a {state['model_target']} but model={job.settings.model_target}; "
                          "resume with the same model config")
    try:
        job.model.load_state_dict(state["model"])
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise ConfigError(f"{file} does not fit this model ({first}); resume with the config it was "
                          f"trained with ({rfs.join(parent_url(file), 'config.yaml')})") from exc
    changed = load_optimizer_state(job.optimizer, state["optimizer"])  # moments from the file, settings from the config
    changed += [f"embedding {c}" for c in load_optimizer_state(job.collection.fused_optimizer,
                                                                 state["embedding_optimizer"])]
    if changed:
        log.info("%s: resumed with the configured %s (the checkpoint had the former)", file, ", ".join(changed))
    job.epochs_done = int(state["epochs_done"])
    job.steps_done = int(state["steps_done"])


def _local_record(folder: str, file: str) -> dict:
    """The record (checkpoint.json) of the local checkpoint in `folder`; refuses, naming it, one
    that is missing, unreadable or of another kind."""
    url = rfs.join(folder, LOCAL_RECORD)
    fs, path = rfs.resolve(url)
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        raise ConfigError(f"{url} is missing: {file} has no checksum record, so it is not loaded (the save did "
                          "not finish, or a recps from before checksummed checkpoints wrote it); take another "
                          "checkpoint or re-train") from None
    try:
        record = json.loads(raw)
        files = record["files"]
        if record.get("kind") != "local" or not all(isinstance(files[n]["sha256"], str) and int(files[n]["bytes"]) >= 0
                                                    for n in LOCAL_FILES):
            raise ValueError(f"kind {record.get('kind')!r}, files {sorted(files)}")
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{url} is damaged ({type(exc).__name__}: {exc}): {file} cannot be verified, so it is not "
                          "loaded; restore the record or take another checkpoint") from None
    if record.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{url}: checkpoint format {record.get('format_version')}, this recps reads "
                          f"{FORMAT_VERSION}; re-train or use the recps version that wrote it")
    return record


def _fs_join(fs, root: str, name: str) -> str:
    return os.path.join(root, name) if isinstance(fs, LocalFileSystem) else posixpath.join(root, name)


def _stage(fs, target: str, data) -> str:
    """Write `data` to a hidden temporary beside `target` (flushed to disk on a local one); its
    path. A failure removes it."""
    parent, name = (os.path if isinstance(fs, LocalFileSystem) else posixpath).split(target)
    tmp = _fs_join(fs, parent, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        fs.makedirs(parent, exist_ok=True)
        if isinstance(fs, LocalFileSystem):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            with fs.open(tmp, "wb") as f:
                f.write(bytes(data))
    except BaseException:
        _discard(fs, [tmp])
        raise
    return tmp


def _publish(fs, tmp: str, target: str) -> None:
    """Rename the staged `tmp` over `target` (atomic on a local disk; elsewhere the old file is
    removed first: the caller removed the record before, so a load refuses the folder meanwhile)."""
    if isinstance(fs, LocalFileSystem):
        os.replace(tmp, target)
        rfs.fsync_dir(os.path.dirname(target))
        return
    if fs.exists(target):
        fs.rm_file(target)
    fs.mv(tmp, target)


def _discard(fs, temporaries) -> None:
    for tmp in temporaries:
        try:
            if fs.exists(tmp):
                fs.rm_file(tmp)
        except Exception:  # noqa: BLE001 - the write's own error matters more
            pass


# ------------------------------------------------------------------------- PS checkpoints


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _child_names(fs, path: str) -> list[str]:
    return sorted(info["name"].rstrip("/").rsplit("/", 1)[-1] for info in fs.ls(path, detail=True)
                  if info.get("type") == "directory")


def _records(folder: str, tables: Sequence[str], extra: Sequence[str] = ()) -> dict[str, dict]:
    """relative path -> {bytes, sha256} of each table's spec.json and shard manifests, and of the
    files `extra` names (relative paths: the workers' state files)."""
    fs, root = rfs.resolve(folder)
    records = {}
    rels = [f"{table}/{name}" for table in tables
            for name in [SPEC_FILE, *(f"{d}/manifest.json" for d in _child_names(fs, f"{root.rstrip('/')}/{table}")
                                      if d.startswith("shard-"))]]
    for rel in [*rels, *extra]:
        try:
            data = fs.cat_file(f"{root.rstrip('/')}/{rel}")
        except FileNotFoundError:
            raise ConfigError(f"checkpoint {folder}: {rel} is missing after the save; "
                              "did every server and worker write to the same file system?") from None
        records[rel] = {"bytes": len(data), "sha256": _sha256(data)}
    return records


def commit_ps_checkpoint(folder: str, tables: Sequence[str], settings: JobSettings, progress: dict, save=None) -> dict:
    """Write config.yaml (settings.config_yaml), then the manifest (last, atomically, never over a
    committed one) of the tables the servers saved into `folder`, recording settings.model_target.
    Returns the manifest. `save`: a call that has the servers save the tables now; it runs while
    config.yaml is written (on HDFS each file's close is a fixed wait, rfs.concurrently)."""
    config = settings.config_yaml.encode()
    write_config = lambda: rfs.write_atomic(rfs.join(folder, "config.yaml"), config, overwrite=True)  # noqa: E731
    rfs.concurrently([write_config] + ([save] if save is not None else []))
    state_files = [w["state_file"] for w in progress.get("workers", ()) if w.get("state_file")]
    records = _records(folder, tables, state_files)
    records["config.yaml"] = {"bytes": len(config), "sha256": _sha256(config)}
    manifest = {"format_version": FORMAT_VERSION, "kind": "ps", "tables": list(tables), "progress": progress,
                "model_target": settings.model_target, "files": records, "created_unix": time.time()}
    rfs.write_atomic(rfs.join(folder, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def is_committed(folder: str) -> bool:
    return rfs.exists(rfs.join(folder, MANIFEST))


def committed_checkpoints(folder: str) -> list[str]:
    """`folder` if it is a committed checkpoint, and its sub-folders that are (a run's step-N/)."""
    fs, root = rfs.resolve(folder)
    if not fs.isdir(root):
        return []
    found = [folder] if is_committed(folder) else []
    return found + [rfs.join(folder, name) for name in _child_names(fs, root)
                    if fs.isfile(f"{root.rstrip('/')}/{name}/{MANIFEST}")]


def prune_step_checkpoints(root: str, keep_last: int) -> list[str]:
    """Remove the committed `<root>/step-N/` checkpoints but the `keep_last` with the most steps (N);
    returns the folders removed. Each goes manifest first, so a removal cut short leaves a folder
    that no reader takes for a checkpoint; one that cannot be removed is logged and left (training
    goes on: retention never fails a job). Folders without a manifest, and `root`'s own checkpoint,
    are not touched."""
    if keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={keep_last}: keep at least 1 (the last committed checkpoint is "
                          "what a restart resumes from), or null to keep all")
    fs, base = rfs.resolve(root)
    steps = []
    for folder in committed_checkpoints(root):
        name = folder.rstrip("/").rsplit("/", 1)[-1]
        if folder != root and name.startswith("step-") and name[5:].isdigit():
            steps.append((int(name[5:]), folder))
    removed = []
    for _, folder in sorted(steps)[:-keep_last]:
        path = f"{base.rstrip('/')}/{folder.rstrip('/').rsplit('/', 1)[-1]}"
        try:
            fs.rm(f"{path}/{MANIFEST}")
            fs.rm(path, recursive=True)
        except (OSError, RuntimeError) as e:  # hdfs-native raises RuntimeError for some failures
            log.warning("checkpoint.keep_last=%d: could not remove %s (%s: %s); it stays", keep_last, folder,
                        type(e).__name__, e)
            continue
        removed.append(folder)
    return removed


def find_checkpoint(path: str | os.PathLike) -> tuple[str, str]:
    """("local", checkpoint.pt) or ("ps", folder) for a checkpoint folder, its checkpoint.pt, or a
    folder of PS checkpoints (the committed one with the most steps). Raises naming the path."""
    url = os.fspath(path)
    fs, root = rfs.resolve(url)
    if url.endswith("checkpoint.pt") and fs.isfile(root):
        return "local", url
    if fs.isfile(f"{root.rstrip('/')}/checkpoint.pt"):
        return "local", rfs.join(url, "checkpoint.pt")
    if fs.isfile(f"{root.rstrip('/')}/{MANIFEST}"):
        return "ps", url
    if fs.isdir(root):
        found = []
        for name in _child_names(fs, root):
            man_path = f"{root.rstrip('/')}/{name}/{MANIFEST}"
            if fs.isfile(man_path):
                try:
                    man = json.loads(fs.cat_file(man_path))
                    int(man.get("progress", {}).get("steps", 0))
                except (ValueError, TypeError, AttributeError) as e:  # UnicodeDecodeError, JSONDecodeError included
                    raise ConfigError(f"{rfs.join(url, name, MANIFEST)} is damaged ({type(e).__name__}: {e}); restore "
                                      f"it, move {rfs.join(url, name)} away, or pass the checkpoint folder to take") from None
                found.append((int(man.get("progress", {}).get("steps", 0)), man.get("created_unix", 0), name))
        if found:
            return "ps", rfs.join(url, max(found)[2])
        if any(fs.isfile(f"{root.rstrip('/')}/{n}/{SPEC_FILE}") for n in _child_names(fs, root)):
            raise ConfigError(f"{url} holds table shards but no {MANIFEST}: the save did not finish (or the run "
                              "is from before committed checkpoints); take an earlier committed checkpoint")
    raise ConfigError(f"no checkpoint at {url} (looked for checkpoint.pt, {MANIFEST}, or folders holding one); "
                      "pass the checkpoint folder a run wrote")


def verify_ps_checkpoint(folder: str, needed: Sequence[str] = (), worker_states: bool = True) -> dict:
    """The manifest of a committed PS checkpoint, after checking that it has every table of
    `needed` and that each spec, shard manifest, config and (with `worker_states`) worker state
    file matches its recorded checksum (the shards' arrays are checked against their manifests
    when the servers read them; a worker reads the state files it needs with `read_recorded`)."""
    man_url = rfs.join(folder, MANIFEST)
    try:
        manifest = json.loads(rfs.read_bytes(man_url))
    except rfs.FileSystemError:
        raise ConfigError(f"{man_url} is missing: {folder} is not a committed checkpoint (the save did not "
                          "finish); take an earlier committed checkpoint") from None
    except ValueError as e:
        raise ConfigError(f"{man_url} is unreadable ({e}); take another checkpoint") from e
    if manifest.get("format_version") != FORMAT_VERSION or manifest.get("kind") != "ps":
        raise ConfigError(f"{man_url}: format {manifest.get('format_version')} kind {manifest.get('kind')!r}; this "
                          f"recps reads PS checkpoints of format {FORMAT_VERSION}")
    missing = [t for t in needed if t not in manifest["tables"]]
    if missing:
        raise ConfigError(f"{folder} has no table {missing} (it holds {manifest['tables']}); resume with the model "
                          "and features it was trained with, or start fresh")
    states = {w["state_file"] for w in manifest["progress"].get("workers", ()) if w.get("state_file")}
    for rel in manifest["files"]:
        if worker_states or rel not in states:
            read_recorded(folder, manifest, rel)
    return manifest


def read_recorded(folder: str, manifest: dict, rel: str, record_name: str = MANIFEST) -> bytes:
    """The bytes of `folder/rel`, a file the committed `manifest` (the record `record_name`)
    records; refuses, naming the file, one that is missing or whose size or sha256 differs."""
    url = rfs.join(folder, rel)
    fs, path = rfs.resolve(url)
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        raise ConfigError(f"{url} is missing from the committed checkpoint; restore it "
                          "or take another checkpoint") from None
    record = manifest["files"][rel]
    if len(data) != record["bytes"] or _sha256(data) != record["sha256"]:
        raise ConfigError(f"{url} does not match {record_name} ({len(data)} bytes, sha256 {_sha256(data)[:16]}...; "
                          f"recorded {record['bytes']} bytes, sha256 {record['sha256'][:16]}...): it is corrupted or "
                          "replaced; restore it or take another checkpoint")
    return data


def read_ps_checkpoint(folder: str, tables: Sequence[str] | None = None, with_state: bool = False) -> dict:
    """The tables of the committed PS checkpoint `folder` (any fsspec URL), read in this process
    without a server, for serving or inspection: {sparse table: recps.ps.table.SparseRows (keys,
    values, and the optimizer state if `with_state`), dense table: {parameter name: tensor}}.
    `tables`: which (default: all the manifest lists). A sparse table's keys are the PS's:
    `recps.ps.embedding.salted_keys(ids, torchrec_table)` of the feature ids, in the PS table
    `embedding_d<dim>` of that width."""
    manifest = verify_ps_checkpoint(folder, needed=tables or ())
    return {t: read_table(rfs.join(folder, t), with_state=with_state) for t in (tables or manifest["tables"])}
