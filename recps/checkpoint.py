"""Checkpoints: of a local job (ps=local) and of a parameter-server job (ps=sync|async|geo).

A local checkpoint is a folder with `checkpoint.pt` (tensors and plain containers only, loaded
with `weights_only=True`) and `config.yaml` (the composed config that produced it), so
`recps.evaluate` can rebuild the model from the folder alone.

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
import os
import time
from typing import TYPE_CHECKING, Sequence

import torch
from omegaconf import OmegaConf

from recps import fs as rfs
from recps.errors import ConfigError

if TYPE_CHECKING:
    from recps.job import Job

__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_file", "find_checkpoint", "commit_ps_checkpoint",
           "verify_ps_checkpoint", "read_recorded", "committed_checkpoints", "read_ps_checkpoint", "MANIFEST", "FORMAT_VERSION"]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"  # a PS checkpoint's commit record
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
    """Writes `folder/checkpoint.pt` and `folder/config.yaml` atomically (any fsspec URL); returns the folder."""
    folder = os.fspath(folder)
    state = {
        "format_version": FORMAT_VERSION,
        "model": job.model.state_dict(),
        "optimizer": job.optimizer.state_dict(),
        "embedding_optimizer": job.collection.fused_optimizer.state_dict(),
        "epochs_done": job.epochs_done,
        "steps_done": job.steps_done,
        "model_target": str(job.cfg.model._target_),
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    rfs.write_atomic(rfs.join(folder, "checkpoint.pt"), buffer.getbuffer(), overwrite=True)
    rfs.write_atomic(rfs.join(folder, "config.yaml"), OmegaConf.to_yaml(job.cfg, resolve=True), overwrite=True)
    return folder


def load_checkpoint(job: "Job", path: str | os.PathLike) -> None:
    """Restores a job built from a compatible config (same model and table shapes)."""
    file = checkpoint_file(path)
    state = torch.load(io.BytesIO(rfs.read_bytes(file)), map_location="cpu", weights_only=True)
    if state.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{file}: checkpoint format {state.get('format_version')}, this recps reads "
                          f"{FORMAT_VERSION}; re-train or use the recps version that wrote it")
    if state["model_target"] != str(job.cfg.model._target_):
        raise ConfigError(f"{file} holds a {state['model_target']} but model={job.cfg.model._target_}; "
                          "resume with the same model config")
    try:
        job.model.load_state_dict(state["model"])
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise ConfigError(f"{file} does not fit this model ({first}); resume with the config it was "
                          f"trained with ({rfs.join(parent_url(file), 'config.yaml')})") from exc
    job.optimizer.load_state_dict(state["optimizer"])
    job.collection.fused_optimizer.load_state_dict(state["embedding_optimizer"])
    job.epochs_done = int(state["epochs_done"])
    job.steps_done = int(state["steps_done"])


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


def commit_ps_checkpoint(folder: str, tables: Sequence[str], cfg, progress: dict, save=None) -> dict:
    """Write config.yaml, then the manifest (last, atomically, never over a committed one) of the
    tables the servers saved into `folder`. Returns the manifest. `save`: a call that has the
    servers save the tables now; it runs while config.yaml is written (on HDFS each file's close
    is a fixed wait, rfs.concurrently)."""
    config = OmegaConf.to_yaml(cfg, resolve=True).encode()
    write_config = lambda: rfs.write_atomic(rfs.join(folder, "config.yaml"), config, overwrite=True)  # noqa: E731
    rfs.concurrently([write_config] + ([save] if save is not None else []))
    state_files = [w["state_file"] for w in progress.get("workers", ()) if w.get("state_file")]
    records = _records(folder, tables, state_files)
    records["config.yaml"] = {"bytes": len(config), "sha256": _sha256(config)}
    manifest = {"format_version": FORMAT_VERSION, "kind": "ps", "tables": list(tables), "progress": progress,
                "model_target": str(cfg.model._target_), "files": records, "created_unix": time.time()}
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
                man = json.loads(fs.cat_file(man_path))
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


def read_recorded(folder: str, manifest: dict, rel: str) -> bytes:
    """The bytes of `folder/rel`, a file the committed `manifest` records; refuses, naming the
    file, one that is missing or whose size or sha256 differs from the record."""
    url = rfs.join(folder, rel)
    fs, path = rfs.resolve(url)
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        raise ConfigError(f"{url} is missing from the committed checkpoint; restore it "
                          "or take another checkpoint") from None
    record = manifest["files"][rel]
    if len(data) != record["bytes"] or _sha256(data) != record["sha256"]:
        raise ConfigError(f"{url} does not match {MANIFEST} (sha256 {_sha256(data)[:16]}..., recorded "
                          f"{record['sha256'][:16]}...): it is corrupted or replaced; restore it or take another "
                          "checkpoint")
    return data


def read_ps_checkpoint(folder: str, tables: Sequence[str] | None = None, with_state: bool = False) -> dict:
    """The tables of the committed PS checkpoint `folder` (any fsspec URL), read in this process
    without a server, for serving or inspection: {sparse table: recps.ps.table.SparseRows (keys,
    values, and the optimizer state if `with_state`), dense table: {parameter name: tensor}}.
    `tables`: which (default: all the manifest lists). A sparse table's keys are the PS's:
    `recps.ps.embedding.salted_keys(ids, torchrec_table)` of the feature ids, in the PS table
    `embedding_d<dim>` of that width."""
    from recps.ps.table.checkpoint import read_table

    manifest = verify_ps_checkpoint(folder, needed=tables or ())
    return {t: read_table(rfs.join(folder, t), with_state=with_state) for t in (tables or manifest["tables"])}
