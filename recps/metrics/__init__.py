"""Metrics whose states add up (or concatenate) and merge across threads, workers and servers.

    >>> import torch
    >>> from recps.metrics import MetricCollection
    >>> m = MetricCollection(["auc", "logloss", "accuracy", "copc"])
    >>> m.update(torch.tensor([0.9, 0.2, 0.6, 0.4]), torch.tensor([1.0, 0.0, 0.0, 1.0]))
    >>> {k: round(v, 4) for k, v in m.compute().items()}
    {'auc': 0.75, 'logloss': 0.5403, 'accuracy': 0.5, 'copc': 0.9524}

See ``base`` for the protocol, ``collection`` for merging, ``distributed`` for all-reduce,
``ps_merger`` for merging through the parameter servers, ``groups`` for where GAUC/PNR get
their group ids (``metrics.group_key``), ``funnel`` for a pipeline's per-stage metrics.
"""

from recps.metrics.base import GroupedMetric, Metric, prepare_pointwise
from recps.metrics.collection import METRICS, MetricCollection, build_metric, merge_states
from recps.metrics.distributed import allreduce_metrics
from recps.metrics.funnel import FunnelTally, merge_tally
from recps.metrics.grouped import PNR, GroupedAUC, group_auc, pair_counts
from recps.metrics.groups import batch_groups, evaluate_pointwise
from recps.metrics.pointwise import (
    AUC,
    COPC,
    MAE,
    RMSE,
    Accuracy,
    ActualCTR,
    Calibration,
    LogLoss,
    PredictedCTR,
    histogram_auc,
)
from recps.metrics.retrieval import MRR, NDCGAtK, RankedTargets, RecallAtK, rank_lists, rank_scores

__all__ = [
    "Metric",
    "GroupedMetric",
    "prepare_pointwise",
    "METRICS",
    "MetricCollection",
    "build_metric",
    "merge_states",
    "allreduce_metrics",
    "AUC",
    "LogLoss",
    "Accuracy",
    "MAE",
    "RMSE",
    "ActualCTR",
    "PredictedCTR",
    "COPC",
    "Calibration",
    "histogram_auc",
    "GroupedAUC",
    "PNR",
    "group_auc",
    "pair_counts",
    "batch_groups",
    "evaluate_pointwise",
    "FunnelTally",
    "merge_tally",
    "RecallAtK",
    "NDCGAtK",
    "MRR",
    "RankedTargets",
    "rank_scores",
    "rank_lists",
]
