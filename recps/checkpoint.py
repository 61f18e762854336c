"""Checkpoints of a local job: model (dense + embedding tables), optimizers, progress, config.

A checkpoint is a folder with `checkpoint.pt` (tensors and plain containers only, loaded
with `weights_only=True`) and `config.yaml` (the composed config that produced it), so
`recps.evaluate` can rebuild the model from the folder alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import OmegaConf

from recps.errors import ConfigError

if TYPE_CHECKING:
    from recps.job import Job

__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_file", "FORMAT_VERSION"]

FORMAT_VERSION = 1


def checkpoint_file(path: str | os.PathLike) -> Path:
    """`path` itself if it is a file, else `path/checkpoint.pt`; raises if absent."""
    p = Path(path)
    file = p if p.is_file() else p / "checkpoint.pt"
    if not file.is_file():
        raise ConfigError(f"no checkpoint at {p} (looked for {file}); pass the checkpoint folder a run wrote")
    return file


def save_checkpoint(job: "Job", folder: str | os.PathLike) -> Path:
    """Writes `folder/checkpoint.pt` and `folder/config.yaml` atomically; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        "format_version": FORMAT_VERSION,
        "model": job.model.state_dict(),
        "optimizer": job.optimizer.state_dict(),
        "embedding_optimizer": job.collection.fused_optimizer.state_dict(),
        "epochs_done": job.epochs_done,
        "steps_done": job.steps_done,
        "model_target": str(job.cfg.model._target_),
    }
    tmp = folder / "checkpoint.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, folder / "checkpoint.pt")
    tmp_cfg = folder / "config.yaml.tmp"
    tmp_cfg.write_text(OmegaConf.to_yaml(job.cfg, resolve=True))
    os.replace(tmp_cfg, folder / "config.yaml")
    return folder


def load_checkpoint(job: "Job", path: str | os.PathLike) -> None:
    """Restores a job built from a compatible config (same model and table shapes)."""
    file = checkpoint_file(path)
    state = torch.load(file, map_location="cpu", weights_only=True)
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
                          f"trained with ({file.parent / 'config.yaml'})") from exc
    job.optimizer.load_state_dict(state["optimizer"])
    job.collection.fused_optimizer.load_state_dict(state["embedding_optimizer"])
    job.epochs_done = int(state["epochs_done"])
    job.steps_done = int(state["steps_done"])
