"""Bookkeeping shared by the retrieval models (two-tower, YouTube-DNN, NCF); no forward pass here.

The retrieval models follow one protocol, which `recps.tasks.RetrievalTask` drives:

    encode(dense (B, I), sparse KJT) -> (queries (B, ...), candidates (B, ...))
        both sides of every row from ONE lookup in the injected collection (a PS-backed
        collection pulls and pushes once per step); a row may fill only one side's features
        (catalogue rows have no query features: their query side is garbage, never used)
    score(queries (B, ...), candidates (C, ...)) -> logits (B, C)   every query against every candidate
    score_pairs(queries (B, ...), candidates (B, ...)) -> (B,)     query b against candidate b only
    forward(dense, sparse) -> logits (B,)                          each row's own (query, item) pair

Shapes: B batch, C candidates, D embedding dim, F features.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

__all__ = ["check_features", "mean_pooled"]


def check_features(available: Sequence[str], wanted: Sequence[str], model: str, arg: str) -> None:
    """Raises ValueError naming the features of `wanted` that the collection does not serve."""
    if not wanted:
        raise ValueError(f"{model}: {arg} is empty; name at least one feature of {list(available)}")
    missing = [f for f in wanted if f not in available]
    if missing:
        raise ValueError(
            f"{model}: {arg} names features {missing} that the injected collection does not serve; "
            f"it serves {list(available)}: fix {arg} or the dataset's features"
        )


def mean_pooled(pooled: KeyedTensor, sparse: KeyedJaggedTensor, names: Sequence[str]) -> torch.Tensor:
    """(B, len(names)*D): each feature's sum-pooled bag divided by its key count (an empty bag is 0).

    The collections sum-pool (FBGEMM TBE, PS); a mean keeps a history of 3 and of 50 items on
    one scale. Single-key features are unchanged.
    """
    keys = sparse.keys()
    lengths = sparse.lengths().view(len(keys), -1)  # (F, B) feature-major, as in every KJT
    parts = []
    for name in names:
        count = lengths[keys.index(name)].clamp(min=1).to(pooled.values().dtype)  # (B,)
        parts.append(pooled[name] / count.unsqueeze(1))  # (B, D)
    return torch.cat(parts, dim=1)  # (B, len(names)*D)
