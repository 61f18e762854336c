"""Recomputations of a stream's outcome from its data and its saved tables (tests/stream and the
stream recovery test of tests/cluster): the statistics a saved table holds, the shows and clicks
of one hourly split."""

from __future__ import annotations

import torch

from recps import fs as rfs
from recps.data.reader import expand_paths, load_tensors
from recps.data.schema import Schema
from recps.ps.embedding import salted_keys
from recps.ps.table.checkpoint import ShardReader, list_shards

__all__ = ["TABLE", "stats", "pass_counts"]

TABLE = "embedding_d11"  # deepfm's one PS table (every feature is 11 wide: conf/model/deepfm.yaml)


def stats(folder: str, table: str = TABLE) -> dict[str, torch.Tensor]:
    """keys and the accessor's statistics of the PS table in a saved folder, over every shard."""
    from recps.ps.table.accessor import META_COLUMNS

    keys, meta = [], []
    for shard in list_shards(rfs.join(folder, table)):
        r = ShardReader(shard)
        keys.append(r.read("keys"))
        meta.append(r.read("meta").reshape(keys[-1].numel(), -1))
    k, m = torch.cat(keys), torch.cat(meta)
    order = torch.argsort(k)
    out = {"keys": k[order]}
    out.update({name: m[order, i].double() for i, name in enumerate(META_COLUMNS) if i < m.shape[1]})
    return out


def pass_counts(root: str, day: str, hour: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys, shows, clicks) of one hourly split: every occurrence of a key, its example's label."""
    ex = load_tensors(expand_paths([rfs.join(root, day, f"{hour:02d}00")]), Schema.from_config({"format": "criteo"}),
                      error_budget=0.0)
    salted = torch.cat([salted_keys(ex.keys[:, i], f"t_{f}") for i, f in enumerate(ex.feature_names[:ex.keys.shape[1]])])
    labels = ex.labels[:, 0].double().repeat(ex.keys.shape[1])
    keys, inverse = torch.unique(salted, return_inverse=True)
    shows = torch.bincount(inverse, minlength=keys.numel()).double()
    clicks = torch.zeros(keys.numel(), dtype=torch.float64).index_add_(0, inverse, labels)
    return keys, shows, clicks
