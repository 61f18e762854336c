"""The streaming funnel's entry: `python -m recps.train pipeline=video_funnel stream=hourly ...`.

recps.pipeline.run_pipeline calls `run_funnel_stream` with the composed config: the checks before any process
starts, the launch (or this process's role), the summary. It is the builder of the streaming funnel: a
worker's body (recps.pipeline.incremental.funnel_stream_work) takes the typed FunnelStreamWork built here.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from recps.cluster.driver import environment_role, run_distributed
from recps.cluster.launch import run_in_fork
from recps.config import cluster_checkpoint_every
from recps.errors import ConfigError
from recps.job.settings import build_settings, node_settings
from recps.pipeline.data import FunnelData
from recps.pipeline.held_out import evaluate_funnel
from recps.pipeline.incremental import FunnelStreamWork, funnel_stream_work, summary_lines
from recps.pipeline.runner import load_world
from recps.pipeline.stages import check_data, eval_settings, pipeline_specs, schedule
from recps.stream import StreamConfig, check_stream_out, nothing_left, with_start_day

__all__ = ["run_funnel_stream"]


def run_funnel_stream(cfg: DictConfig, out_dir: Path) -> float:
    """recps.pipeline.run_pipeline's entry with stream.enabled: check, launch (or be one of the cluster's
    processes), print each pass's funnel metrics; returns pipeline.objective of the last evaluated pass."""
    if cfg.ps.table.get("accessor") is None:
        raise ConfigError("stream=hourly needs the tables' CTR accessor (deltas, bases and shrink select by it); "
                          "ps.table.accessor is null: drop that override (stream=hourly sets it)")
    # A bad stream key fails here, before any process starts.
    values = with_start_day(OmegaConf.to_container(cfg.stream, resolve=True))
    cfg.stream.start_day = values["start_day"]  # the cluster's processes read it from the config
    config = StreamConfig.from_config(values)
    _check(cfg)
    specs = pipeline_specs(cfg)  # a bad stage too
    if any(len(group) > 1 for group in schedule(cfg, specs)):
        raise ConfigError(f"pipeline.schedule={OmegaConf.to_container(cfg.pipeline.schedule)}: a stream trains its "
                          "stages one after another each pass; drop pipeline.schedule (null) with stream=hourly")
    _fill_accessors(cfg, specs)
    if environment_role(cfg) is None and (left := run_in_fork(lambda: nothing_left(config),
                                                              "reading the stream's records")):
        print(f"[recps] {left}")  # decided from the records: no cluster starts
        return float("nan")

    def before_launch(c: DictConfig, mode, d: Path) -> None:
        check_stream_out(config)  # the records and the root first: the world may take a while to generate
        check_data(specs, load_world(c))

    metrics = run_distributed(cfg, out_dir, work=_funnel_stream_worker, before_launch=before_launch)
    if metrics is None:
        return float("nan")
    for line in summary_lines(metrics, int(cfg.pipeline.top_n)):
        print(f"[recps] {line}")  # entry point: the lines a user reads
    print(f"[recps] metrics: {Path(out_dir) / 'metrics.json'}, per pass: {Path(out_dir) / 'stream_metrics.jsonl'}")
    value = metrics.get(str(cfg.pipeline.get("objective") or "ndcg@10"))
    return float(value) if isinstance(value, (int, float)) else float("nan")


def _funnel_stream_worker(cfg: DictConfig, role, out_dir: Path, data=None, observers=()) -> dict[str, Any] | None:
    """A worker of the streaming funnel (recps.cluster.driver.run_role's `work`): recps.pipeline.incremental's
    funnel_stream_work with the typed values of the composed config; `data`: an in-process cluster's world."""
    work = FunnelStreamWork(
        config=StreamConfig.from_config(OmegaConf.to_container(cfg.stream, resolve=True)),
        specs=pipeline_specs(cfg),  # after _fill_accessors: each stage's mode has the stream's accessor
        settings=build_settings(cfg), node=node_settings(cfg), pipeline=str(cfg.pipeline.name),
        top_n=int(cfg.pipeline.top_n), index=OmegaConf.to_container(cfg.pipeline.index, resolve=True),
        load_world=lambda: data if isinstance(data, FunnelData) else load_world(cfg),
        evaluate=partial(evaluate_funnel, settings=eval_settings(cfg)))
    return funnel_stream_work(work, role, Path(out_dir))


def _fill_accessors(cfg: DictConfig, specs: Sequence) -> None:
    """stream=hourly sets the CTR accessor (what deltas, bases and shrink select by) on ps.table; a stage
    whose ps.table.accessor is null takes it (the stages' ps groups are composed apart from cfg.ps)."""
    accessor = cfg.ps.table.get("accessor")
    for s in specs:
        node = cfg.pipeline.stages[s.name].ps.table
        if node.get("accessor") is None:
            node.accessor = OmegaConf.create(OmegaConf.to_container(accessor, resolve=True))


def _check(cfg: DictConfig) -> None:
    """The combinations a streaming funnel refuses, before any process starts."""
    steps, seconds = cluster_checkpoint_every(cfg)
    if steps is not None or seconds is not None:
        raise ConfigError("cluster.checkpoint_every is set with pipeline=... stream=hourly: the streaming funnel "
                          "checkpoints every stage after a pass (stream.checkpoint_per_pass); drop "
                          "cluster.checkpoint_every")
    if cfg.trainer.get("resume"):
        raise ConfigError(f"trainer.resume={cfg.trainer.resume} with stream=hourly: a stream resumes from its "
                          f"records in stream.out ({cfg.stream.get('out')}); drop trainer.resume")
    for name, stage in cfg.pipeline.stages.items():
        if stage.ps.get("checkpoint_every_steps") or stage.ps.get("checkpoint_every_seconds"):
            raise ConfigError(f"pipeline.stages.{name}.ps.checkpoint_every_*: the streaming funnel checkpoints "
                              "after each pass (stream.checkpoint_per_pass); drop it")
