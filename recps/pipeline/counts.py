"""Counting features (issue 29.3): an item's and a user x category's shows and clicks, read from the servers'
CTR accessor as of the previous pass, as a ranker's dense inputs.

A ranker's `inputs.counts` names counting features (`COUNT_FEATURES`):

    item_id         the item's shows (exposures) and clicks
    user_category   the user's shows and clicks of the item's category

Their statistics live on the parameter servers, in the stage's counting table `<stage>_counts`
(`counts_table`; Fleet.create_counting_table: width 1, nothing trained, the stage's `ps.table.accessor`,
so day-end shrinks decay them as they decay every row's, Paddle's CtrAccessor). Every worker counts its
share of the exposures (rows w, w + W, ...: a show each, its click label as the click; `count_exposures`)
AFTER the examples that must not see them were built, and the statistics are pulled back for every key
(`read_counts`) into a `Counts` snapshot that the funnel reads from then on (training, evaluation, export,
recommend), so that a request sees the counts of what happened before it, never of its own label:

    batch funnel   (a counting stage trains on [validation] only)  the period's past is counted, read, the
                   stages train; then the validation period is counted, read again: the held-out requests
                   and serving see every training exposure
    stream         each pass reads the counts as of the end of the previous pass (evaluation and training
                   alike), then counts its own impressions once every stage trained on it

A counting feature gives three dense columns (`COLUMNS`), after the stage's `scores` columns:

    ctr          (clicks + a) / (shows + a + b),  a = m p, b = m (1 - p): p the clicks / shows of every key of
                 the feature in the snapshot, m = inputs.count_prior (pseudo-shows; an unseen key reads p)
    log_shows    log(1 + shows)
    log_clicks   log(1 + clicks)

Shapes: N pairs, K keys of a feature (I items; U x C users x categories), F counting features.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from recps.errors import ConfigError
from recps.pipeline.stages import COUNT_FEATURES
from recps.ps.embedding import salted_keys

__all__ = ["COUNT_FEATURES", "COLUMNS", "COUNTS_EXPORT", "COUNTS_TRAIN_EXPORT", "Counts", "counts_table", "count_keys", "key_space",
           "count_exposures", "read_counts", "recount", "counts_to_bytes", "counts_from_bytes"]

log = logging.getLogger("recps.pipeline")

COLUMNS = ("ctr", "log_shows", "log_clicks")
COUNTS_EXPORT = "counts.pt"  # <run dir>/funnel/counts.pt: the snapshot serving reads (stage -> Counts)
COUNTS_TRAIN_EXPORT = "counts_train.pt"  # <run dir>/funnel/counts_train.pt: what a batch funnel's stages trained with
COUNT_ROWS = 1 << 20  # exposures counted per push


def counts_table(stage: str) -> str:
    """The stage's counting table on the servers."""
    return f"{stage}_counts"


def _categories(data) -> int:
    return int(data.item_features["category"].max()) + 1 if data.num_items else 1


def key_space(data, feature: str) -> int:
    """K: the keys of counting feature `feature` in `data` (items; users x categories)."""
    if feature == "item_id":
        return data.num_items
    if feature == "user_category":
        return data.num_users * _categories(data)
    raise ConfigError(f"counting feature {feature!r}: use one of {list(COUNT_FEATURES)}")


def count_keys(data, feature: str, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """(N,) int64 the keys of pairs (users (N,), items (N,)) for counting feature `feature`, in [0, K)."""
    if feature == "item_id":
        return items.to(torch.int64)
    if feature == "user_category":
        return users.to(torch.int64) * _categories(data) + data.item_features["category"][items]
    raise ConfigError(f"counting feature {feature!r}: use one of {list(COUNT_FEATURES)}")


def _ps_keys(feature: str, keys: torch.Tensor) -> torch.Tensor:
    """The counting table's keys of `feature`'s keys (one table holds every feature: salted apart)."""
    return salted_keys(keys, f"count_{feature}")


@dataclass(frozen=True)
class Counts:
    """Statistics as of one time: feature -> (shows (K,), clicks (K,)) float32 by count key (`count_keys`).
    `prior`: m, the pseudo-shows of the smoothed CTR."""

    shows: dict[str, torch.Tensor]
    clicks: dict[str, torch.Tensor]
    prior: float

    @cached_property
    def rates(self) -> dict[str, float]:
        """feature -> its CTR over every key (the smoothed CTR's prior mean), once per snapshot."""
        return {f: float(self.clicks[f].sum()) / total if (total := float(s.sum())) > 0 else 0.0
                for f, s in self.shows.items()}

    def columns(self, data, features: Sequence[str], users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """(N, 3F) float32 the dense columns of `features` for pairs (users, items): per feature `COLUMNS`."""
        out = []
        for f in features:
            shows, clicks, p = self.shows[f], self.clicks[f], self.rates[f]  # (K,), (K,), the feature's CTR
            key = count_keys(data, f, users, items)  # (N,)
            s, c = shows[key].to(torch.float64), clicks[key].to(torch.float64)  # (N,)
            a, b = self.prior * p, self.prior * (1.0 - p)
            ctr = (c + a) / (s + a + b) if self.prior > 0 else torch.where(s > 0, c / s.clamp(min=1.0), p)
            out += [ctr, torch.log1p(s), torch.log1p(c)]
        if not out:
            return torch.zeros(int(users.numel()), 0)
        return torch.stack(out, 1).to(torch.float32)  # (N, 3F)


def counts_to_bytes(counts: dict[str, Counts]) -> bytes:
    """stage -> Counts as the bytes of a torch file (<run dir>/funnel/counts.pt)."""
    buffer = io.BytesIO()
    torch.save({n: {"shows": c.shows, "clicks": c.clicks, "prior": c.prior} for n, c in counts.items()}, buffer)
    return buffer.getvalue()


def counts_from_bytes(raw: bytes) -> dict[str, Counts]:
    saved = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    return {n: Counts(dict(c["shows"]), dict(c["clicks"]), float(c["prior"])) for n, c in saved.items()}


def recount(data, features: Sequence[str], users: torch.Tensor, items: torch.Tensor, clicks: torch.Tensor,
            prior: float) -> Counts:
    """The Counts of exposures (users, items, click labels (N,)) computed here, without the servers: what
    the servers' statistics must equal (tests; float32 sums of 0/1 values are exact)."""
    shows_of, clicks_of = {}, {}
    for f in features:
        key = count_keys(data, f, users, items)
        k = key_space(data, f)
        shows_of[f] = torch.bincount(key, minlength=k).to(torch.float32)
        clicks_of[f] = torch.bincount(key, weights=clicks.to(torch.float64), minlength=k).to(torch.float32)
    return Counts(shows_of, clicks_of, float(prior))


def count_exposures(fleet, specs, data, rows: torch.Tensor, worker: int, workers: int, timeout_s: float,
                    name: str) -> None:
    """Count exposures `rows` (indices into data.train_*) into every counting stage's table: this worker's
    share (rows w, w + W, ...), a show each and its click label (column 0, clamped to [0, 1]) as the click;
    then every worker meets (`name`), so that a read after it sees every worker's counts."""
    mine = rows[worker::workers]
    users, items = data.train_user[mine], data.train_item[mine]
    clicks = data.train_labels[mine, 0].clamp(0.0, 1.0).to(torch.float32)
    handles = []
    for s in specs:
        for f in s.counts:
            keys = _ps_keys(f, count_keys(data, f, users, items))
            for i in range(0, keys.numel(), COUNT_ROWS):
                part = slice(i, i + COUNT_ROWS)
                handles.append(fleet.count(counts_table(s.name), keys[part], torch.ones(keys[part].numel()),
                                           clicks[part]))
    for h in handles:
        h.wait(timeout_s)
    fleet.wait_for_workers(name, timeout=timeout_s)


def read_counts(fleet, spec, data, timeout_s: float) -> Counts:
    """The stage's counting features' statistics as the servers hold them now, for every key."""
    shows, clicks = {}, {}
    for f in spec.counts:
        keys = torch.arange(key_space(data, f))
        parts = [fleet.pull_statistics(counts_table(spec.name), _ps_keys(f, keys[i:i + COUNT_ROWS]), timeout_s)
                 for i in range(0, keys.numel(), COUNT_ROWS)]
        stats = torch.cat(parts) if parts else torch.zeros(0, 2)  # (K, 2)
        shows[f], clicks[f] = stats[:, 0].contiguous(), stats[:, 1].contiguous()
    return Counts(shows, clicks, float(spec.count_prior))
