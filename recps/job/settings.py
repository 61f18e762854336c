"""A job's settings, typed: what the job's code (and its cluster's processes: NodeSettings) reads of the
composed config, built once (`build_settings`, `node_settings`).

Light on purpose (omegaconf only, no torch): the cluster's launcher reads them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

__all__ = ["TrainerSettings", "CheckpointSettings", "JobSettings", "NodeSettings", "build_settings", "checkpoint_dir",
           "node_settings"]


@dataclass(frozen=True)
class TrainerSettings:
    """conf `trainer:`: how the loop runs (recps.config validated every value)."""

    epochs: int = 1
    max_steps: int = -1
    batch_size: int = 256
    threads: int = 1
    eval_batch_size: int = 4096
    resume: str | None = None
    precision: str = "fp32"
    progress: bool = False  # a progress bar (ps=local only; the cluster's workers log lines instead)


@dataclass(frozen=True)
class CheckpointSettings:
    """conf `checkpoint:`: whether and where the job's checkpoint goes, how many mid-run ones stay."""

    save: bool = True
    dir: str | None = None
    keep_last: int | None = None

    def folder(self, out_dir: str | Path) -> str:
        """checkpoint.dir (a path or fsspec URL), else <run dir>/checkpoint."""
        return str(self.dir or Path(out_dir) / "checkpoint")


@dataclass(frozen=True)
class JobSettings:
    """What the job's code reads of the composed config, typed, built once (build_settings)."""

    trainer: TrainerSettings
    checkpoint: CheckpointSettings
    model_target: str
    ps: str
    device: str = "cpu"
    seed: int = 0
    metrics: dict | None = None  # conf/metrics, resolved (recps.metrics.reporter builds from it)
    debug: dict | None = None  # conf/debug, resolved (recps.debug.dump)
    config_yaml: str = ""  # the composed config, resolved: what a checkpoint records as config.yaml

    @property
    def group_key(self) -> str | None:
        return (self.metrics or {}).get("group_key")


def _plain(node) -> dict | None:
    return None if node is None else OmegaConf.to_container(node, resolve=True)


def build_settings(cfg: DictConfig) -> JobSettings:
    """The JobSettings of a composed (validated) config."""
    t = cfg.trainer
    c = cfg.checkpoint
    return JobSettings(
        trainer=TrainerSettings(epochs=int(t.epochs), max_steps=int(t.max_steps), batch_size=int(t.batch_size),
                                threads=int(t.threads), eval_batch_size=int(t.eval_batch_size),
                                resume=str(t.resume) if t.get("resume") else None,
                                precision=str(t.get("precision", "fp32")), progress=bool(cfg.get("progress", False))),
        checkpoint=CheckpointSettings(save=bool(c.save), dir=str(c.dir) if c.get("dir") else None,
                                      keep_last=None if c.get("keep_last") is None else int(c.keep_last)),
        model_target=str(cfg.model._target_), ps=str(cfg.ps.name), device=str(cfg.device), seed=int(cfg.seed),
        metrics=_plain(cfg.get("metrics")), debug=_plain(cfg.get("debug")),
        config_yaml=OmegaConf.to_yaml(cfg, resolve=True))


def checkpoint_dir(cfg: DictConfig, out_dir: str | Path) -> str:
    """Where the run's checkpoint goes: checkpoint.dir (a path or fsspec URL), else <run dir>/checkpoint."""
    return str(cfg.checkpoint.get("dir") or Path(out_dir) / "checkpoint")


@dataclass(frozen=True)
class NodeSettings:
    """conf `cluster:` as a node reads it (node_settings builds it), and the
    training threads per worker (whether this machine is crowded)."""

    connect_timeout_s: float
    dead_after_s: float
    server_threads: int | None = None  # a server's handler threads (None: chosen from the cores here)
    server_torch_threads: int | None = None  # a server's intra-op threads (None: torch's, or 1 when crowded)
    trainer_threads: int = 1


def node_settings(cfg: DictConfig) -> NodeSettings:
    """The NodeSettings of a composed config (conf `cluster:`, trainer.threads)."""
    c = cfg.cluster
    server_threads, torch_threads = c.get("server_threads"), c.get("server_torch_threads")
    return NodeSettings(connect_timeout_s=float(c.connect_timeout_s), dead_after_s=float(c.dead_after_s),
                        server_threads=None if server_threads is None else int(server_threads),
                        server_torch_threads=None if torch_threads is None else int(torch_threads),
                        trainer_threads=int(cfg.trainer.threads))
