"""The tiny streaming funnel the pipeline tests train (tests/pipeline/test_stream_funnel*.py,
test_stream_validation.py, test_counts.py): its days, the modes its stages run in, and its overrides of
pipeline=video_funnel stream=hourly (a world of 120 users x 600 items, one epoch a stage; fusion as
video_funnel.yaml has it: trained on each pass as the stream's validation period, from the second pass on)."""

from __future__ import annotations

__all__ = ["DAY", "DAY2", "DAY3", "STAGES", "STREAM_FUSION", "TINY"]

DAY, DAY2, DAY3 = "20261201", "20261202", "20261203"
STAGES = {"recall": "geo", "coarse": "async", "fine": "async", "fusion": "sync"}
# The fusion streams trained before a stream had a validation period (docs/funnel.md, "Streaming funnel"): on
# the pass's exposures, scored by the stages freshly trained on them, reading no item_cf and no counting features.
# Not needed to run a stream any more; benchmarks/RESULTS.md compares it with the default ("Streaming funnel:
# fusion on each pass as its validation period")
STREAM_FUSION = ["pipeline.stages.fusion.inputs.train_on=[exposures]",
                 "pipeline.stages.fusion.inputs.scores=[recall,coarse,fine]",
                 "pipeline.stages.fusion.inputs.score_norm=none", "pipeline.validation_fraction=null",
                 "pipeline.refresh=null", "pipeline.stages.fusion.inputs.counts=[]",
                 "pipeline.stages.fusion.ps.table.accessor=null"]
TINY = [
    "pipeline=video_funnel", "stream=hourly", "cluster.workers=1",
    "pipeline.world.users=120", "pipeline.world.items=600", "pipeline.world.creators=60",
    "pipeline.world.metric_users=40", "pipeline.world.impressions_per_user=30",
    "pipeline.world.random_items_per_user=100",  # the held-out random bucket, within the tiny catalogue
    "pipeline.world.short_term_weight=0", "pipeline.world.cross_scale=0",  # the world before issue 29.4
    "pipeline.stages.recall.keep=80", "pipeline.stages.coarse.keep=30", "pipeline.stages.fine.keep=15",
    "pipeline.stages.coarse.inputs.candidates_per_user=10", "pipeline.stages.fine.inputs.candidates_per_user=10",
    "pipeline.stages.fusion.inputs.candidates_per_user=5",
    *(f"pipeline.stages.{s}.inputs.candidate_users=0" for s in ("coarse", "fine", "fusion")),
    *(f"pipeline.stages.{s}.trainer.batch_size=128" for s in STAGES),
    "pipeline.stages.recall.trainer.epochs=1", "pipeline.stages.coarse.trainer.epochs=1",
    "pipeline.stages.fine.trainer.epochs=1", "pipeline.stages.fusion.trainer.epochs=1",
    "pipeline.eval_users=0", "pipeline.eval_batch_users=128",
    f"stream.start_day={DAY}", "stream.hours=1", "stream.data_sleep_second=0.2", "stream.wait_timeout_s=60",
    "stream.shrink=false",  # the day end keeps every row: the resumed model is pass 1's exactly
]
