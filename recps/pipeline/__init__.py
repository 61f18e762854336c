"""The recommendation funnel (issue 16): recall -> coarse rank -> fine rank -> fusion on one PS layer, a mode per stage.

    python -m recps.train pipeline=video_funnel            # trains and evaluates every stage (recps.pipeline.runner)
    python -m recps.pipeline.recommend RUN_DIR --users 1,2  # serves the trained funnel (recps.pipeline.recommend)

Modules: config (the stages, checked before any process starts), data (users, items, exposures,
held-out requests), funnel (stage exports, the cascade), evaluate (end-to-end metrics), runner (the
cluster job), recommend (serving), ann (the recall stage's item index), incremental (the streaming
funnel) and incremental_entry (its entry: the composed config into incremental's typed values).
"""

__all__ = ["enabled", "run_pipeline"]


def enabled(cfg) -> bool:
    from recps.pipeline.stages import enabled as _enabled  # deferred: `import recps.pipeline` stays light for recps.train

    return _enabled(cfg)


def run_pipeline(cfg, out_dir):
    """recps.train's entry with pipeline != none: the streaming funnel (stream.enabled, every stage pass by
    pass: recps.pipeline.incremental) or the funnel trained once (recps.pipeline.runner)."""
    if cfg.get("stream") is not None and bool(cfg.stream.get("enabled", False)):
        from recps.pipeline.incremental_entry import run_funnel_stream  # deferred: torch, torchrec; a funnel's only

        return run_funnel_stream(cfg, out_dir)
    from recps.pipeline.runner import run_pipeline as _run  # deferred: torch, torchrec only for a pipeline run

    return _run(cfg, out_dir)
