"""The generated "video world": users, items, a known label model and biased impression logs.

A world where the ideal ranking is known, for the recommendation funnel (issue 16, point 4a):
users and items with latent factors and categorical features, click and long-view labels drawn
from a stated model, impressions exposed like production's (popular items shown far more), a
held-out test period, and the best reachable metrics computed from the truth.

The world (U users, I items, d = `dim`; user ids and item ids are the row indices 0..U-1, 0..I-1):

    items    creator k ~ uniform over `creators`; category c = the creator's (creators stay in
             one category; category shares ∝ 1/(rank+1)); duration bucket ~ uniform over
             `durations`; quality q_i ~ N(0, item_bias_scale) (the item's own click bias)
             v_i = (0.7·center[c] + 0.5·offset[k] + 0.5·noise_i) / (s·√d)
             popularity w_i = max(u_i, 1/I)^(-popularity_skew) · exp(popularity_quality · q_i),
             u_i ~ U(0, 1) (Zipf-like: the r-th most popular of I has w ∝ (r/I)^-skew), stored as
             the exposure share w_i / Σw
    users    age ~ uniform over `ages`, region ~ uniform over `regions`, activity ~ uniform over
             4 levels; two favourite categories f1, f2 drawn by the category shares
             u = (0.4·age_vec[age] + 0.3·region_vec[region] + 0.6·center[f1] + 0.4·center[f2]
                  + 0.5·noise) / √d
    s        one scale fitted on a fixed sample of (user, item) pairs so that the affinity
             a(u, i) = u · v_i has standard deviation 1 over random pairs

The label model (`click_prob`, `long_view_prob`, `utility`):

    z_click(u, i, t) = click_bias + click_scale · a(u, i) + q_i + activity_effect[activity_u]
                       + G[age_u, category_i]                        (cross_scale; a feature cross)
                       + w_s · min(1, s_u[category_i](t))            (short_term_weight; the history)
    s_u[c](t)     = Σ over u's train clicks e in category c with t_e < t of 2^(-(t - t_e) / h)
                    (h = short_term_half_life_days): recent clicks predict the next ones, a
                    short-term interest that decays; no fixed user/item factor product holds it
    z_lv(u, i)    = long_view_bias + long_view_scale · a(u, i) + duration_effect[duration_i]
    P(click)      = σ(z_click)
    P(long view)  = σ(z_click) · σ(z_lv)        a long view follows a click (ESMM's funnel):
                                                 σ(z_lv) is the post-click long-view rate
    utility(u, i) = P(click) + long_view_weight · P(long view)   (what the funnel maximises)

activity_effect = (-0.4, 0, 0.3, 0.6) over levels 0..3; duration_effect runs linearly from +0.8
(shortest) to -0.8 (longest): short videos are watched through more often. No position term.
G (7 ages x C categories) ~ cross_scale · N(0, 1) from its own stream. short_term_weight = 0 and
cross_scale = 0 give the world before issue 29 (the same labels; request times differ by < R s).
Labels are drawn request after request in time order (`_sequential_clicks`: a loop over each user's
R requests, vectorized over users), so the state of an impression is its user's clicks of earlier
requests (a request's own clicks never enter its state). For held-out lists (`ideal_topn`,
`utility`, `click_prob` without times, the random bucket) the state is as of the user's held-out
request (`request_time`: its first test request's time): the whole train history.

Impressions (the logging policy; it does not read the state): every user gets R = impressions_per_user / request_size train
requests and `test_requests_per_user` test requests of `request_size` impressions each, n items
in all, distinct per user. Exposure ∝ popularity × exp(exposure_relevance · a(u, i)), drawn by
sampling-importance-resampling: candidate_factor · n candidates by popularity (with replacement),
duplicates dropped, then n of them without replacement by Gumbel-top-n on
exposure_relevance · a(u, i). The n items are shuffled over the user's requests, whose times are
sorted uniform draws over 30 days made strictly increasing (+ their rank in seconds); the last
`test_requests_per_user` requests are the test period (so a test item is never one the user saw in train). Labels: click = 1[u1 < P(click)],
long_view = click · 1[u2 < σ(z_lv)].

Random bucket (`random_items_per_user` = M > 0; the held-out evaluation the funnel is measured on):
each user also gets M impressions from a uniform logging policy, M distinct items drawn uniformly
from the items the user did not see in training, labelled by the same model. Every item is shown
with the same probability M / (I - seen), whatever any list holds, so a list's hits among the
bucket's clicks estimate (up to that constant) the clicks the list would get if shown: unbiased
where the logged test clicks (exposed by the popularity-biased policy) reward imitating exposure.
This is the random traffic production systems keep for counterfactual evaluation (as the
random-exposure logs of Yahoo! R3, Coat and KuaiRand).

Best reachable metrics (`world.metrics`, world.json "best"):

    auc.click, auc.long_view   the true P(click) / P(long view) against the test impressions'
                               labels (exact AUC, ties 1/2): no model of the features and the
                               history beats it in expectation
    auc_without_history.click  (short_term_weight > 0) the static logit's AUC: the best of a
                               model that does not see the user's history
    ideal.ndcg@10, ideal.hr@10 the ideal funnel's list (`ideal_topn`: the 10 items of highest
                               true utility over all I items, the user's train-seen items
                               excluded) against the user's held-out positives (test impressions
                               with click = 1), binary gains, NDCG = DCG / ideal DCG of
                               min(#positives, 10) hits, HR = 1[any positive in the list];
                               averaged over the first `metric_users` users (by id) that have a
                               test positive (users are i.i.d., so this is an unbiased sample)
    ideal.utility@10           the ideal list's mean true utility per slot
    most_popular.*             the same for the most-popular list (train-seen excluded), plus its
                               utility_ndcg@10 (`VideoWorld.utility_ndcg`; the ideal's is 1)

Caveat: held-out positives exist only where the logging policy exposed, so a list that imitates
the exposure (popularity) can hit more of them than the ideal list does; the ideal's NDCG/HR is
the truth-optimal list's score, not an upper bound for every list. `utility_ndcg` is the bounded
measure: a list's DCG of true utility over the ideal list's (1.0 for the ideal).

Randomness: every quantity comes from numpy generators seeded by (seed, purpose, block) with
fixed blocks (65,536 items, 1,024 users), so a world depends on its config only, and items and
users are generated in memory-bounded chunks (10^7 items: factors 640 MB at d = 16).

Files (`write` / `load`; `out` a local path or an fsspec URL, every file written whole to a
temporary and renamed into place (recps.fs.write_atomic), world.json last, holding the config,
sizes, SHA-256 of every file and the best metrics; `load` checks the checksums):

    world.json            config, sizes, files {name: sha256}, rates, best, seconds, schema
    users.parquet         user_id, age, region, activity (int64), user_bias (float32)
    items.parquet         item_id, category, creator, duration (int64), popularity (float64
                          exposure share), item_bias (float32 = q_i), log_popularity (float32)
    user_factors.npy      (U, d) float32        item_factors.npy   (I, d) float32
    train.parquet         impressions of the train requests, rows by (user, time):
    test.parquet          the same columns for the test requests:
                          request_id, user_id, item_id, time (int64 seconds), click, long_view
                          (int32), category, creator, duration, age, region, activity (int64),
                          log_popularity (float32, log10 of popularity / max popularity),
                          p_click, p_long_view (float32: the truth, not features)
    seen_offsets.npy      (U + 1,) int64        seen_items.npy     sorted train items per user (CSR)
    random.parquet        (only with random_items_per_user > 0) the random bucket, rows by user:
                          user_id, item_id, click, long_view (int32), p_click, p_long_view (float32)
    recall/ratings.csv    userId, itemId, rating, timestamp: every clicked impression (train and
                          test; rating = 1 + long_view) in (user, time) order, for
                          recps.data.interactions (leave-last-out takes each user's last click)
    recall/items.csv      itemId, genres ("c<category>") of every item

Shape letters: U users, I items, d factors, B users in a chunk, M candidates per user, N rows.

Example:
    >>> import tempfile
    >>> cfg = VideoWorldConfig(users=200, items=3000, creators=300, seed=1, metric_users=50)
    >>> world = generate(cfg)
    >>> world.train.shape[0] == 200 * cfg.impressions_per_user
    True
    >>> out = write(world, tempfile.mkdtemp())
    >>> same = load(out)
    >>> bool((same.train["click"].to_numpy() == world.train["click"].to_numpy()).all())
    True
    >>> 0.5 < world.metrics["auc"]["click"] < 1
    True
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import torch

from recps import quiet_libraries
from recps import fs
from recps.data.generators.ctr import _exact_auc
from recps.errors import ConfigError, DataError

__all__ = [
    "VideoWorldConfig",
    "VideoWorld",
    "WorldInfo",
    "generate",
    "write",
    "load",
    "read_info",
    "ensure_split",
    "ensure_world",
    "world_home",
    "tune_split",
    "prepare_recall",
    "ideal_metrics",
    "best_summary",
    "topn_metrics",
    "schema",
    "main",
]

log = logging.getLogger(__name__)

GENERATOR = "recps.data.generators.video_world"
FORMAT_VERSION = 1
META = "world.json"
AGES = 7
ACTIVITY_LEVELS = 4
ACTIVITY_EFFECT = (-0.4, 0.0, 0.3, 0.6)
TIME0 = 1_700_000_000  # the first request's earliest time (seconds)
SPAN_S = 30 * 86400  # requests fall in 30 days
LABELS = ("click", "long_view")
SPARSE = ("user_id", "item_id", "category", "creator", "duration", "age", "region", "activity")
DENSE = ("log_popularity",)
IMPRESSION_COLUMNS = ("request_id", "user_id", "item_id", "time") + LABELS + SPARSE[2:] + DENSE + ("p_click",
                                                                                                  "p_long_view")

_ITEM_BLOCK = 65536
_USER_BLOCK = 1024
_SCALE_PAIRS = 65536
# purposes of the seeded generators (each its own stream)
(_P_CENTERS, _P_CREATORS, _P_ITEMS, _P_USERS, _P_SCALE, _P_EXPOSE, _P_LABELS, _P_TIMES, _P_RANDOM, _P_RANDOM_LABELS,
 _P_CROSS, _P_TUNE_RANDOM, _P_TUNE_RANDOM_LABELS) = range(1, 14)
DAY_S = 86400
RANDOM_COLUMNS = ("user_id", "item_id", "click", "long_view", "p_click", "p_long_view")


@dataclass(frozen=True)
class VideoWorldConfig:
    """Sizes and knobs of a video world (see the module docstring for the model they enter).

    Attributes:
        users, items: U and I (items up to 10^7 and beyond; generated in chunks).
        dim: d, the latent factors' width.
        categories, creators: item categories and creators (creators <= items).
        regions: user regions; durations: item duration buckets.
        impressions_per_user: train impressions per user (a multiple of request_size).
        request_size: impressions per request.
        test_requests_per_user: held-out requests per user (the last ones in time).
        history_length: L, the recall data's history length (recps.data.interactions).
        seed: everything random follows from it.
        click_bias, click_scale: z_click's intercept and the affinity's weight in it.
        item_bias_scale: std of the items' own click bias q_i.
        long_view_bias, long_view_scale: z_lv's intercept and affinity weight.
        long_view_weight: w in utility = P(click) + w · P(long view).
        popularity_skew: the Zipf-like exponent of exposure popularity (0: uniform).
        popularity_quality: how much an item's quality raises its popularity (log scale).
        exposure_relevance: the logging policy's weight on affinity (0: popularity only).
        candidate_factor: popularity candidates drawn per impression before resampling.
        metric_users: users (with a test positive) the ideal funnel's metrics average over.
        random_items_per_user: M, each user's held-out random-bucket impressions: M distinct items drawn
            uniformly from the items the user did not see in training (a uniform logging policy, the
            random traffic counterfactual evaluation keeps), labelled by the same model (0: none).
        short_term_weight: w_s, the click logit a click in the item's category adds right after it (the
            short-term interest; decays, saturates at w_s; 0: off, the labels of the old world).
        short_term_half_life_days: h, the short-term interest halves every h days.
        cross_scale: std of the age x category table G added to z_click (a user feature x item feature
            interaction; 0: off).
    """

    users: int = 20_000
    items: int = 200_000
    dim: int = 16
    categories: int = 50
    creators: int = 10_000
    regions: int = 30
    durations: int = 5
    impressions_per_user: int = 200
    request_size: int = 10
    test_requests_per_user: int = 1
    history_length: int = 50
    seed: int = 0
    click_bias: float = -3.0
    click_scale: float = 1.5
    item_bias_scale: float = 0.5
    long_view_bias: float = -1.0
    long_view_scale: float = 1.0
    long_view_weight: float = 2.0
    popularity_skew: float = 0.8
    popularity_quality: float = 0.5
    exposure_relevance: float = 1.0
    candidate_factor: int = 8
    metric_users: int = 300
    random_items_per_user: int = 0
    short_term_weight: float = 2.0
    short_term_half_life_days: float = 5.0
    cross_scale: float = 0.5

    def __post_init__(self) -> None:
        ints = ("users", "items", "dim", "categories", "creators", "regions", "durations", "impressions_per_user",
                "request_size", "test_requests_per_user", "history_length", "seed", "candidate_factor", "metric_users",
                "random_items_per_user")
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or (
                    isinstance(value, float) and not value.is_integer()):
                raise ConfigError(f"video_world {name}={value!r} is not an integer; give a whole number")
            object.__setattr__(self, name, int(value))
        for name in ("users", "items", "dim", "categories", "creators", "regions", "durations",
                     "impressions_per_user", "request_size", "candidate_factor"):
            if getattr(self, name) < 1:
                raise ConfigError(f"video_world {name}={getattr(self, name)}; use a value >= 1")
        for name in ("test_requests_per_user", "history_length", "seed", "metric_users", "random_items_per_user"):
            if getattr(self, name) < 0:
                raise ConfigError(f"video_world {name}={getattr(self, name)}; use a value >= 0")
        if self.impressions_per_user % self.request_size:
            raise ConfigError(f"video_world impressions_per_user={self.impressions_per_user} is not a multiple of "
                              f"request_size={self.request_size}; make it one (requests hold request_size impressions)")
        if self.creators > self.items:
            raise ConfigError(f"video_world creators={self.creators} > items={self.items}; every creator needs an "
                              f"item: set creators <= items")
        if self.categories > self.creators:
            raise ConfigError(f"video_world categories={self.categories} > creators={self.creators}; set "
                              f"categories <= creators")
        if 4 * self.random_items_per_user > self.items:
            raise ConfigError(f"video_world random_items_per_user={self.random_items_per_user} > items/4 = "
                              f"{self.items // 4}; lower it (the random bucket is a uniform sample of the catalogue; "
                              f"a quarter of it measures a list's clicks as well as all of it)")
        n = self.per_user
        if self.items < 4 * n:
            raise ConfigError(f"video_world items={self.items} < 4 x the {n} distinct items each user is shown "
                              f"(impressions_per_user + test_requests_per_user x request_size); raise items or "
                              f"lower impressions_per_user")
        floats = ("click_bias", "click_scale", "item_bias_scale", "long_view_bias", "long_view_scale",
                  "long_view_weight", "popularity_skew", "popularity_quality", "exposure_relevance",
                  "short_term_weight", "short_term_half_life_days", "cross_scale")
        for name in floats:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) or \
                    not math.isfinite(float(value)):
                raise ConfigError(f"video_world {name}={value!r}; give a finite number")
            object.__setattr__(self, name, float(value))
        for name in ("click_scale", "item_bias_scale", "long_view_scale", "long_view_weight", "popularity_skew",
                     "exposure_relevance", "short_term_weight", "cross_scale"):
            if getattr(self, name) < 0:
                raise ConfigError(f"video_world {name}={getattr(self, name)}; use a value >= 0")
        if self.short_term_half_life_days <= 0:
            raise ConfigError(f"video_world short_term_half_life_days={self.short_term_half_life_days}; use a value "
                              f"> 0 (turn the short-term interest off with short_term_weight=0)")

    @property
    def per_user(self) -> int:
        """Distinct items shown to each user: train plus test impressions."""
        return self.impressions_per_user + self.test_requests_per_user * self.request_size

    @property
    def requests_per_user(self) -> int:
        return self.impressions_per_user // self.request_size + self.test_requests_per_user

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "video_world") -> "VideoWorldConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**values)


# ----------------------------------------------------------------------------- randomness


def _rng(seed: int, purpose: int, block: int = 0) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, purpose, block]))


def _sigmoid(x: np.ndarray | torch.Tensor):
    if isinstance(x, torch.Tensor):
        return torch.sigmoid(x)
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _category_shares(c: int) -> np.ndarray:
    w = 1.0 / np.arange(1, c + 1, dtype=np.float64)
    return w / w.sum()


def _centers(cfg: VideoWorldConfig) -> dict[str, np.ndarray]:
    """The small shared tables: category centers, creator offsets and categories, age/region vectors."""
    r = _rng(cfg.seed, _P_CENTERS)
    d = cfg.dim
    out = {
        "center": r.standard_normal((cfg.categories, d)),  # (C, d)
        "age": r.standard_normal((AGES, d)),  # (7, d)
        "region": r.standard_normal((cfg.regions, d)),  # (R, d)
    }
    rc = _rng(cfg.seed, _P_CREATORS)
    out["offset"] = rc.standard_normal((cfg.creators, d))  # (K, d)
    cats = rc.choice(cfg.categories, size=cfg.creators, p=_category_shares(cfg.categories))  # (K,)
    cats[: cfg.categories] = np.arange(cfg.categories)  # every category has a creator
    out["creator_category"] = cats.astype(np.int64)
    return out


def _item_block(cfg: VideoWorldConfig, shared: dict[str, np.ndarray], b: int) -> dict[str, np.ndarray]:
    """Items b·65536 .. of the world: features, raw factors (before the affinity scale), weights."""
    lo = b * _ITEM_BLOCK
    n = min(_ITEM_BLOCK, cfg.items - lo)
    r = _rng(cfg.seed, _P_ITEMS, b)
    creator = r.integers(0, cfg.creators, n)  # (n,)
    creator[: max(0, min(n, cfg.creators - lo))] = np.arange(lo, lo + max(0, min(n, cfg.creators - lo)))
    category = shared["creator_category"][creator]  # (n,)
    duration = r.integers(0, cfg.durations, n)  # (n,)
    quality = cfg.item_bias_scale * r.standard_normal(n)  # (n,)
    noise = r.standard_normal((n, cfg.dim))  # (n, d)
    factors = 0.7 * shared["center"][category] + 0.5 * shared["offset"][creator] + 0.5 * noise  # (n, d)
    u = np.maximum(r.random(n), 1.0 / cfg.items)  # (n,)
    weight = u ** (-cfg.popularity_skew) * np.exp(cfg.popularity_quality * quality)  # (n,)
    return {"creator": creator.astype(np.int64), "category": category, "duration": duration.astype(np.int64),
            "quality": quality.astype(np.float32), "factors": (factors / math.sqrt(cfg.dim)).astype(np.float32),
            "weight": weight}


def _user_block(cfg: VideoWorldConfig, shared: dict[str, np.ndarray], b: int) -> dict[str, np.ndarray]:
    lo = b * _USER_BLOCK
    n = min(_USER_BLOCK, cfg.users - lo)
    r = _rng(cfg.seed, _P_USERS, b)
    age = r.integers(0, AGES, n)
    region = r.integers(0, cfg.regions, n)
    activity = r.integers(0, ACTIVITY_LEVELS, n)
    fav = r.choice(cfg.categories, size=(n, 2), p=_category_shares(cfg.categories))  # (n, 2)
    noise = r.standard_normal((n, cfg.dim))  # (n, d)
    factors = (0.4 * shared["age"][age] + 0.3 * shared["region"][region] + 0.6 * shared["center"][fav[:, 0]]
               + 0.4 * shared["center"][fav[:, 1]] + 0.5 * noise) / math.sqrt(cfg.dim)  # (n, d)
    return {"age": age.astype(np.int64), "region": region.astype(np.int64), "activity": activity.astype(np.int64),
            "factors": factors.astype(np.float32)}


# ----------------------------------------------------------------------------- the world


@dataclass
class VideoWorld:
    """A generated world: tables, factors, the label model, impressions and the seen sets.

    Attributes:
        config: what generated it.
        users: DataFrame user_id, age, region, activity (int64), user_bias (float32), U rows.
        items: DataFrame item_id, category, creator, duration (int64), popularity (float64 share),
            item_bias (float32), log_popularity (float32), I rows.
        user_factors: (U, d) float32. item_factors: (I, d) float32 (affinity a = u · v).
        item_bias: (I,) float32 (q_i). user_bias: (U,) float32 (activity_effect[activity]).
        train, test: impressions (IMPRESSION_COLUMNS), rows by (user, time).
        seen_offsets (U + 1,) int64, seen_items: each user's train items, sorted (CSR).
        metrics: the best reachable metrics (module docstring); rates: mean labels per split.
    """

    config: VideoWorldConfig
    users: pd.DataFrame
    items: pd.DataFrame
    user_factors: np.ndarray
    item_factors: np.ndarray
    train: pd.DataFrame
    test: pd.DataFrame
    seen_offsets: np.ndarray
    seen_items: np.ndarray
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    rates: dict[str, Any] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    random: pd.DataFrame = dataclasses.field(default_factory=lambda: pd.DataFrame({c: [] for c in RANDOM_COLUMNS}))

    @property
    def item_bias(self) -> np.ndarray:
        return self.items["item_bias"].to_numpy(np.float32)

    @property
    def user_bias(self) -> np.ndarray:
        return self.users["user_bias"].to_numpy(np.float32)

    @property
    def duration_effect(self) -> np.ndarray:
        """(durations,) float32: from +0.8 (shortest) to -0.8 (longest); 0 with one bucket."""
        k = self.config.durations
        return (np.linspace(0.8, -0.8, k) if k > 1 else np.zeros(1)).astype(np.float32)

    @property
    def seen(self) -> tuple[np.ndarray, np.ndarray]:
        """The train-seen CSR (offsets (U + 1,), items) for `ideal_topn(exclude=...)`."""
        return self.seen_offsets, self.seen_items

    @property
    def cross(self) -> np.ndarray:
        """(AGES, C) float64 G: the age x category term of z_click, cross_scale · N(0, 1) (zeros at 0)."""
        c = self.config
        return c.cross_scale * _rng(c.seed, _P_CROSS).standard_normal((AGES, c.categories))

    # -- the short-term state ------------------------------------------------------------------

    def request_time(self) -> np.ndarray:
        """(U,) int64: each user's held-out request time, its first test request's (its last train time + 1
        without test requests): the time the ideal list and the random bucket's labels are as of."""
        c = self.config
        out = np.full(c.users, TIME0, np.int64)
        for frame, last, shift in ((self.train, True, 1), (self.test, False, 0)):  # test overrides train
            if len(frame):
                user = frame["user_id"].to_numpy(np.int64)  # rows by (user, time)
                first = np.unique(user[::-1] if last else user, return_index=True)[1]
                rows = (len(user) - 1 - first) if last else first
                out[user[rows]] = frame["time"].to_numpy(np.int64)[rows] + shift
        return out

    def short_term_state(self, user_ids: Any, times: Any = None) -> np.ndarray:
        """(P, C) float64 s[p, c] = Σ 2^(-(t_p - t_e)/h) over the train clicks e of user u_p in category c with
        t_e < t_p (strictly before; h = short_term_half_life_days); times=None: each user's request_time().
        Vectorized over the (pair, click) product (P x the users' clicks)."""
        c = self.config
        users = np.asarray(user_ids, np.int64).ravel()
        if times is None:
            return self._held_out_state()[users]
        times = np.broadcast_to(np.asarray(times, np.int64), users.shape).ravel()
        ev_user, ev_time, ev_cat = self._clicks()
        starts = np.searchsorted(ev_user, users)  # (P,) clicks are sorted by user
        counts = np.searchsorted(ev_user, users, side="right") - starts  # (P,)
        rows = np.repeat(np.arange(users.shape[0]), counts)  # (E',)
        idx = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(rows.shape[0])
        dt = times[rows] - ev_time[idx]  # (E',) seconds
        w = np.where(dt > 0, np.exp2(-np.maximum(dt, 0) / (c.short_term_half_life_days * DAY_S)), 0.0)
        flat = np.bincount(rows * c.categories + ev_cat[idx], weights=w, minlength=users.shape[0] * c.categories)
        return flat.reshape(users.shape[0], c.categories)

    def _clicks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(user, time, category) of the train clicks, rows by (user, time)."""
        t = self.train[self.train["click"].to_numpy() > 0]
        return (t["user_id"].to_numpy(np.int64), t["time"].to_numpy(np.int64), t["category"].to_numpy(np.int64))

    def _held_out_state(self) -> np.ndarray:
        """(U, C) float64 the short-term state as of each user's request_time() (cached: train is fixed once made)."""
        cached = self.__dict__.get("_state_cache")
        if cached is None:
            c = self.config
            ev_user, ev_time, ev_cat = self._clicks()
            dt = self.request_time()[ev_user] - ev_time  # (E,) > 0: train clicks precede the request
            w = np.exp2(-dt / (c.short_term_half_life_days * DAY_S))
            cached = np.bincount(ev_user * c.categories + ev_cat, weights=w,
                                 minlength=c.users * c.categories).reshape(c.users, c.categories)
            self.__dict__["_state_cache"] = cached
        return cached

    def short_term(self, user_idx: Any, item_idx: Any, times: Any = None) -> np.ndarray:
        """The short-term logit w_s · min(1, s[u, category_i](t)) of (user, item[, time]) pairs (broadcast);
        times=None: as of each user's request_time()."""
        u, i = self._check_ids(user_idx, item_idx)
        u, i = np.broadcast_arrays(u, i)
        w = self.config.short_term_weight
        if w == 0:
            return np.zeros(u.shape)
        cat = self.items["category"].to_numpy(np.int64)[i]
        if times is None:
            s = self._held_out_state()[u, cat]
        else:
            t = np.broadcast_to(np.asarray(times, np.int64), u.shape)
            state = self.short_term_state(u.ravel(), t.ravel())  # (P, C)
            s = state[np.arange(u.size), cat.ravel()].reshape(u.shape)
        return w * np.minimum(1.0, s)

    # -- the label model, for (user, item) pairs ---------------------------------------------

    def _pair_logits(self, user_idx: Any, item_idx: Any, times: Any = None,
                     short: bool = True) -> tuple[np.ndarray, np.ndarray]:
        u, i = self._check_ids(user_idx, item_idx)
        u, i = np.broadcast_arrays(u, i)
        a = np.einsum("...d,...d->...", self.user_factors[u].astype(np.float64),
                      self.item_factors[i].astype(np.float64))  # (...)
        c = self.config
        z_click = c.click_bias + c.click_scale * a + self.item_bias[i] + self.user_bias[u]
        if c.cross_scale:
            z_click = z_click + self.cross[self.users["age"].to_numpy(np.int64)[u],
                                           self.items["category"].to_numpy(np.int64)[i]]
        if short and c.short_term_weight:
            z_click = z_click + self.short_term(u, i, times)
        dur = self.items["duration"].to_numpy()[i]
        z_lv = c.long_view_bias + c.long_view_scale * a + self.duration_effect[dur]
        return z_click, z_lv

    def _check_ids(self, user_idx: Any, item_idx: Any) -> tuple[np.ndarray, np.ndarray]:
        u = np.asarray(user_idx, dtype=np.int64)
        i = np.asarray(item_idx, dtype=np.int64)
        for name, ids, n in (("user", u, self.config.users), ("item", i, self.config.items)):
            if ids.size and (ids.min() < 0 or ids.max() >= n):
                bad = ids[(ids < 0) | (ids >= n)].ravel()[0]
                raise DataError(f"video world: {name} id {int(bad)} is outside [0, {n}); ids are row indices of "
                                f"the world's {name}s table")
        return u, i

    def click_prob(self, user_idx: Any, item_idx: Any, times: Any = None) -> np.ndarray:
        """P(click) float64 of (user, item) pairs (arrays broadcast against each other) at `times` (the
        short-term state from the train clicks strictly before; None: as of each user's request_time())."""
        return _sigmoid(self._pair_logits(user_idx, item_idx, times)[0])

    def long_view_prob(self, user_idx: Any, item_idx: Any, times: Any = None) -> np.ndarray:
        """P(long view) = P(click) · σ(z_lv) (a long view needs a click)."""
        z_click, z_lv = self._pair_logits(user_idx, item_idx, times)
        return _sigmoid(z_click) * _sigmoid(z_lv)

    def utility(self, user_idx: Any, item_idx: Any, times: Any = None) -> np.ndarray:
        """P(click) + long_view_weight · P(long view): the expected value the funnel maximises (None: as of
        each user's held-out request)."""
        z_click, z_lv = self._pair_logits(user_idx, item_idx, times)
        return _sigmoid(z_click) * (1.0 + self.config.long_view_weight * _sigmoid(z_lv))

    # -- the ideal funnel --------------------------------------------------------------------

    def ideal_topn(self, user_ids: Any, n: int, exclude: tuple[np.ndarray, np.ndarray] | None = None, *,
                   user_chunk: int = 256, item_chunk: int = 16384,
                   return_scores: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """(B, n) int64 item ids of highest true utility over all I items, best first.

        `exclude`: a CSR (offsets (U + 1,), items) indexed by user id whose items are never
        returned (`world.seen`: the train-seen items); None excludes nothing. Computed by
        chunked matrix products (user_chunk x item_chunk utilities at a time, float32) and a
        running torch.topk; return_scores=True also returns the (B, n) utilities.
        """
        users = np.asarray(user_ids, dtype=np.int64).ravel()
        self._check_ids(users, np.zeros(0, np.int64))
        n = int(n)
        if not 1 <= n <= self.config.items:
            raise ConfigError(f"ideal_topn n={n}; use 1 <= n <= items={self.config.items}")
        c = self.config
        V = torch.from_numpy(self.item_factors)  # (I, d)
        user_bias = self.user_bias  # (U,)
        click0 = torch.from_numpy(self.item_bias + np.float32(c.click_bias))  # (I,) z_click's item part
        lv0 = torch.from_numpy(self.duration_effect[self.items["duration"].to_numpy()] + np.float32(c.long_view_bias))
        category = torch.from_numpy(self.items["category"].to_numpy(np.int64, copy=True))  # (I,)
        ids_out = np.empty((users.shape[0], n), np.int64)
        val_out = np.empty((users.shape[0], n), np.float32)
        for s in range(0, users.shape[0], user_chunk):
            ub = users[s: s + user_chunk]  # (B,)
            U = torch.from_numpy(self.user_factors[ub])  # (B, d)
            ubias = torch.from_numpy(user_bias[ub])[:, None]  # (B, 1)
            extra = torch.from_numpy(self._category_logits(ub).astype(np.float32))  # (B, C) cross + short-term
            rows, cols = _csr_pairs(exclude, ub) if exclude is not None else (np.zeros(0, np.int64),) * 2
            best_v = torch.full((ub.shape[0], 0), -math.inf)
            best_i = torch.zeros((ub.shape[0], 0), dtype=torch.int64)
            for lo in range(0, c.items, item_chunk):
                hi = min(c.items, lo + item_chunk)
                a = U @ V[lo:hi].T  # (B, Ic) affinities
                p_click = torch.add(click0[lo:hi], a, alpha=c.click_scale).add_(ubias)  # (B, Ic) logits
                p_click.add_(extra[:, category[lo:hi]]).sigmoid_()  # (B, Ic)
                util = a.mul_(c.long_view_scale).add_(lv0[lo:hi]).sigmoid_()  # (B, Ic) σ(z_lv), in a's memory
                util.mul_(c.long_view_weight).add_(1.0).mul_(p_click)  # (B, Ic) P(click)·(1 + w·σ(z_lv))
                del p_click
                inside = (cols >= lo) & (cols < hi)
                if inside.any():
                    util[torch.from_numpy(rows[inside]), torch.from_numpy(cols[inside] - lo)] = -math.inf
                k = min(n, hi - lo)
                v, i = torch.topk(util, k, dim=1)  # (B, k)
                cat_v = torch.cat([best_v, v], dim=1)
                cat_i = torch.cat([best_i, i + lo], dim=1)
                top_v, pos = torch.topk(cat_v, min(n, cat_v.shape[1]), dim=1)
                best_v, best_i = top_v, torch.gather(cat_i, 1, pos)
            ids_out[s: s + ub.shape[0]] = best_i.numpy()
            val_out[s: s + ub.shape[0]] = best_v.numpy()
        if np.isinf(val_out).any():
            raise DataError(f"ideal_topn: a user has fewer than n={n} items left after exclusion; lower n")
        return (ids_out, val_out) if return_scores else ids_out

    def _category_logits(self, users: np.ndarray) -> np.ndarray:
        """(B, C) float64 the z_click terms that depend on (user, item category) only, as of each user's held-out
        request: G[age_u, c] + w_s · min(1, s[u, c])."""
        c = self.config
        out = np.zeros((users.shape[0], c.categories))
        if c.cross_scale:
            out += self.cross[self.users["age"].to_numpy(np.int64)[users]]
        if c.short_term_weight:
            out += c.short_term_weight * np.minimum(1.0, self._held_out_state()[users])
        return out

    def popular_topn(self, user_ids: Any, n: int, exclude: tuple[np.ndarray, np.ndarray] | None = None
                     ) -> np.ndarray:
        """(B, n) int64: the n most popular items (by exposure share) each user has not in `exclude`."""
        users = np.asarray(user_ids, dtype=np.int64).ravel()
        self._check_ids(users, np.zeros(0, np.int64))
        offsets = exclude[0] if exclude is not None else np.zeros(self.config.users + 1, np.int64)
        widest = int(np.diff(np.asarray(offsets, np.int64)).max(initial=0))
        if not 1 <= n <= self.config.items - widest:
            raise ConfigError(f"popular_topn n={n}; use 1 <= n <= items - the most excluded items of a user "
                              f"({self.config.items} - {widest})")
        order = np.argsort(-self.items["popularity"].to_numpy(), kind="stable")[: n + widest]  # (n + S,)
        cand = np.broadcast_to(order, (users.shape[0], order.shape[0]))  # (B, n + S)
        if exclude is None:
            return cand[:, :n].copy()
        rows, items = _csr_pairs(exclude, users)
        I = self.config.items
        banned = np.isin(np.arange(users.shape[0])[:, None] * I + cand, rows * I + items)  # (B, n + S)
        first = np.argsort(banned, axis=1, kind="stable")[:, :n]  # (B, n): the kept ones, in popularity order
        return np.take_along_axis(cand, first, 1)

    def utility_ndcg(self, user_ids: Any, lists: np.ndarray, exclude: tuple[np.ndarray, np.ndarray] | None = None
                     ) -> np.ndarray:
        """(B,) DCG of true utility of each user's list (B, n) over the ideal list's (1.0 for the ideal)."""
        users = np.asarray(user_ids, dtype=np.int64).ravel()
        lists = np.asarray(lists, dtype=np.int64)
        n = lists.shape[1]
        disc = 1.0 / np.log2(np.arange(n) + 2.0)  # (n,)
        got = (self.utility(users[:, None], lists) * disc).sum(1)  # (B,)
        _, ideal = self.ideal_topn(users, n, exclude, return_scores=True)
        return got / (ideal.astype(np.float64) * disc).sum(1)


def _csr_pairs(csr: tuple[np.ndarray, np.ndarray], users: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, items) of every item of each chosen user's CSR row; rows index `users`."""
    offsets, values = (np.asarray(x, dtype=np.int64) for x in csr)
    starts, ends = offsets[users], offsets[users + 1]  # (B,)
    lengths = ends - starts
    rows = np.repeat(np.arange(users.shape[0]), lengths)  # (P,)
    first = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)  # (P,)
    return rows, values[first + np.arange(rows.shape[0])]


# ----------------------------------------------------------------------------- generation


def generate(cfg: VideoWorldConfig) -> VideoWorld:
    """Generates the world of `cfg` (deterministic in cfg; see the module docstring)."""
    t0 = time.perf_counter()
    shared = _centers(cfg)
    blocks = [_item_block(cfg, shared, b) for b in range(-(-cfg.items // _ITEM_BLOCK))]
    item_f = np.concatenate([b.pop("factors") for b in blocks])  # (I, d)
    cols = {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}
    del blocks
    ublocks = [_user_block(cfg, shared, b) for b in range(-(-cfg.users // _USER_BLOCK))]
    user_f = np.concatenate([b.pop("factors") for b in ublocks])  # (U, d)
    ucols = {k: np.concatenate([b[k] for b in ublocks]) for k in ublocks[0]}
    # the affinity's scale, from a fixed sample of random pairs
    r = _rng(cfg.seed, _P_SCALE)
    pu, pi = r.integers(0, cfg.users, _SCALE_PAIRS), r.integers(0, cfg.items, _SCALE_PAIRS)
    s = float(np.einsum("nd,nd->n", user_f[pu].astype(np.float64), item_f[pi].astype(np.float64)).std()) or 1.0
    item_f /= np.float32(s)
    popularity = cols["weight"] / cols["weight"].sum()  # (I,)
    items = pd.DataFrame({
        "item_id": np.arange(cfg.items, dtype=np.int64), "category": cols["category"], "creator": cols["creator"],
        "duration": cols["duration"], "popularity": popularity, "item_bias": cols["quality"],
        "log_popularity": np.log10(popularity / popularity.max()).astype(np.float32),
    })
    users = pd.DataFrame({
        "user_id": np.arange(cfg.users, dtype=np.int64), "age": ucols["age"], "region": ucols["region"],
        "activity": ucols["activity"],
        "user_bias": np.asarray(ACTIVITY_EFFECT, np.float32)[ucols["activity"]],
    })
    world = VideoWorld(cfg, users, items, user_f, item_f, pd.DataFrame(), pd.DataFrame(),
                       np.zeros(cfg.users + 1, np.int64), np.zeros(0, np.int64))
    t1 = time.perf_counter()
    _impressions(world, popularity)
    if cfg.random_items_per_user:
        world.random = _random_bucket(world)
    t2 = time.perf_counter()
    world.metrics = {"auc": {"click": _exact_auc(world.test["p_click"].to_numpy(), world.test["click"].to_numpy()),
                             "long_view": _exact_auc(world.test["p_long_view"].to_numpy(),
                                                     world.test["long_view"].to_numpy())}}
    if cfg.short_term_weight:  # the best AUC of a model without the user's history (the static logit only)
        t = world.test
        static = world._pair_logits(t["user_id"].to_numpy(), t["item_id"].to_numpy(), short=False)[0]
        world.metrics["auc_without_history"] = {"click": _exact_auc(static, t["click"].to_numpy())}
    world.metrics.update(ideal_metrics(world, cfg.metric_users, baseline=True))
    t3 = time.perf_counter()
    world.rates = {split: {"rows": int(len(f)), "click": float(f["click"].mean()) if len(f) else float("nan"),
                           "long_view": float(f["long_view"].mean()) if len(f) else float("nan")}
                   for split, f in (("train", world.train), ("test", world.test))}
    world.seconds = t3 - t0
    world.rates["seconds"] = {"tables": t1 - t0, "impressions": t2 - t1, "metrics": t3 - t2}
    log.info("video world %d users x %d items: generated in %.1f s (tables %.1f, impressions %.1f, metrics %.1f); %s",
             cfg.users, cfg.items, t3 - t0, t1 - t0, t2 - t1, t3 - t2, best_summary(world.metrics))
    return world


def best_summary(metrics: dict) -> str:
    """world.metrics in a line: the best reachable test AUCs. The ideal and most-popular lists' metrics
    (world.json "best") are left out: they are measured on the logged test clicks of `metric_users` users,
    where most-popular may beat the ideal list (the module docstring's caveat), while a funnel run reports
    both on its own held-out requests (the random bucket).

    >>> best_summary({"auc": {"click": 0.91, "long_view": 0.89}, "auc_without_history": {"click": 0.88},
    ...               "ideal": {"ndcg@10": 0.01}})
    'best reachable test AUC: click 0.9100, long_view 0.8900, click without history 0.8800'
    """
    parts = [f"{label} {value:.4f}" for label, value in (metrics.get("auc") or {}).items()]
    parts += [f"{label} without history {value:.4f}" for label, value in (metrics.get("auc_without_history") or {}).items()]
    return "best reachable test AUC: " + ", ".join(parts)


def _impressions(world: VideoWorld, popularity: np.ndarray) -> None:
    """Fills world.train / test / seen by the logging policy and the label model (user blocks)."""
    cfg = world.config
    n, m = cfg.per_user, cfg.candidate_factor * cfg.per_user
    cdf = np.cumsum(popularity)
    cdf /= cdf[-1]
    R = cfg.requests_per_user
    n_train_req = cfg.impressions_per_user // cfg.request_size
    parts = []
    for b in range(-(-cfg.users // _USER_BLOCK)):
        lo = b * _USER_BLOCK
        users = np.arange(lo, min(cfg.users, lo + _USER_BLOCK), dtype=np.int64)  # (B,)
        B = users.shape[0]
        r = _rng(cfg.seed, _P_EXPOSE, b)
        cand = np.minimum(np.searchsorted(cdf, r.random((B, m)), side="right"), cfg.items - 1)  # (B, M)
        cand.sort(axis=1)
        dup = np.zeros((B, m), bool)
        dup[:, 1:] = cand[:, 1:] == cand[:, :-1]
        short = (~dup).sum(1) < n
        if short.any():
            raise DataError(f"video_world: user {int(users[short][0])} drew fewer than {n} distinct items among "
                            f"{m} popularity candidates; raise candidate_factor={cfg.candidate_factor}, lower "
                            f"popularity_skew={cfg.popularity_skew} or raise items={cfg.items}")
        a = np.einsum("bd,bmd->bm", world.user_factors[users], world.item_factors[cand])  # (B, M)
        score = cfg.exposure_relevance * a - np.log(-np.log(r.random((B, m))))  # (B, M) + Gumbel
        score[dup] = -np.inf
        pick = np.argpartition(-score, n - 1, axis=1)[:, :n]  # (B, n): n without replacement, in any order
        order = np.argsort(r.random((B, n)), axis=1)  # shuffle over the requests
        shown = np.take_along_axis(cand, np.take_along_axis(pick, order, 1), 1)  # (B, n)
        # sorted draws made strictly increasing (+ rank): a user's requests never share a second
        times = np.sort(_rng(cfg.seed, _P_TIMES, b).integers(0, SPAN_S, (B, R)), axis=1) + TIME0 + np.arange(R)
        rl = _rng(cfg.seed, _P_LABELS, b)
        u1, u2 = rl.random((B, n)), rl.random((B, n))
        uu = np.broadcast_to(users[:, None], (B, n))
        z_click, z_lv = world._pair_logits(uu, shown, short=False)  # (B, n) each: the static part
        click = _sequential_clicks(world, shown, times, z_click, u1)  # (B, n), z_click += the short-term term
        p_click, p_lv_after = _sigmoid(z_click), _sigmoid(z_lv)
        long_view = click * (u2 < p_lv_after).astype(np.int32)
        req = np.repeat(np.arange(R), cfg.request_size)  # (n,) request of each slot
        parts.append({
            "request_id": (uu * R + req).ravel(), "user_id": uu.ravel(), "item_id": shown.ravel(),
            "time": np.broadcast_to(times[:, req], (B, n)).ravel(), "click": click.ravel(),
            "long_view": long_view.ravel(), "p_click": p_click.ravel().astype(np.float32),
            "p_long_view": (p_click * p_lv_after).ravel().astype(np.float32),
            "is_test": np.broadcast_to(req >= n_train_req, (B, n)).ravel(),
        })
    cat = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    it, us = world.items, world.users
    frame = {
        "request_id": cat["request_id"].astype(np.int64), "user_id": cat["user_id"].astype(np.int64),
        "item_id": cat["item_id"].astype(np.int64), "time": cat["time"].astype(np.int64),
        "click": cat["click"], "long_view": cat["long_view"],
    }
    for name in ("category", "creator", "duration"):
        frame[name] = it[name].to_numpy()[frame["item_id"]]
    for name in ("age", "region", "activity"):
        frame[name] = us[name].to_numpy()[frame["user_id"]]
    frame["log_popularity"] = it["log_popularity"].to_numpy()[frame["item_id"]]
    frame["p_click"], frame["p_long_view"] = cat["p_click"], cat["p_long_view"]
    all_rows = pd.DataFrame(frame)
    test = cat["is_test"]
    world.train = all_rows[~test].reset_index(drop=True)
    world.test = all_rows[test].reset_index(drop=True)
    # seen CSR: train items per user, sorted (rows are grouped by user already)
    tu, ti = frame["user_id"][~test], frame["item_id"][~test]
    order = np.lexsort((ti, tu))
    world.seen_items = ti[order]
    world.seen_offsets = np.zeros(cfg.users + 1, np.int64)
    np.cumsum(np.bincount(tu, minlength=cfg.users), out=world.seen_offsets[1:])


def _sequential_clicks(world: VideoWorld, shown: np.ndarray, times: np.ndarray, z_click: np.ndarray,
                       u1: np.ndarray) -> np.ndarray:
    """(B, n) int32 clicks of a user block's impressions, drawn request after request in time order (a loop
    over the R requests, vectorized over users), each request's z_click (B, n) raised in place by the
    short-term term w_s · min(1, s[u, category]) of the clicks of the user's earlier requests; s decays by
    2^(-Δt / h) between requests. shown (B, n) items, slot j in request j // request_size; times (B, R)."""
    cfg = world.config
    B, n = shown.shape
    size, C = cfg.request_size, cfg.categories
    click = np.zeros((B, n), np.int32)
    if cfg.short_term_weight == 0:
        click[:] = u1 < _sigmoid(z_click)
        return click
    cat = world.items["category"].to_numpy(np.int64)[shown]  # (B, n)
    state = np.zeros((B, C))  # (B, C) s as of the previous request
    base = np.arange(B)[:, None] * C  # (B, 1)
    last = times[:, 0]
    for r in range(times.shape[1]):
        sl = slice(r * size, (r + 1) * size)
        state *= np.exp2(-(times[:, r] - last) / (cfg.short_term_half_life_days * DAY_S))[:, None]
        last = times[:, r]
        z_click[:, sl] += cfg.short_term_weight * np.minimum(1.0, np.take_along_axis(state, cat[:, sl], 1))
        click[:, sl] = u1[:, sl] < _sigmoid(z_click[:, sl])
        state += np.bincount((base + cat[:, sl]).ravel(), weights=click[:, sl].ravel(),
                             minlength=B * C).reshape(B, C)  # this request's clicks, after its labels
    return click


def _random_bucket(world: VideoWorld, purposes: tuple[int, int] = (_P_RANDOM, _P_RANDOM_LABELS)) -> pd.DataFrame:
    """Each user's random-bucket impressions (RANDOM_COLUMNS, rows by user): M = random_items_per_user
    distinct items drawn uniformly from the items the user did not see in training, labelled by the
    label model as of the user's held-out request (user blocks of 1,024; draws from the (seed, purposes[0],
    block) stream, labels from (seed, purposes[1], block); `tune_split` passes its own two).

    Sampler (vectorized per block): M + 2M²/I + impressions_per_user + 64 uniform draws per user, with
    replacement (the expected repeats are M²/2I); a draw that repeats an earlier one or hits a seen item is
    dropped; the first M left, in draw order, are the bucket (a uniform M-subset of the unseen items;
    M <= I/4 leaves enough, else it fails naming the knob)."""
    cfg = world.config
    m, num = cfg.random_items_per_user, cfg.items
    k = m + -(-2 * m * m // num) + cfg.impressions_per_user + 64
    seen_keys = np.repeat(np.arange(cfg.users, dtype=np.int64), np.diff(world.seen_offsets)) * num + world.seen_items
    parts = []
    for b in range(-(-cfg.users // _USER_BLOCK)):
        lo = b * _USER_BLOCK
        users = np.arange(lo, min(cfg.users, lo + _USER_BLOCK), dtype=np.int64)  # (B,)
        draws = _rng(cfg.seed, purposes[0], b).integers(0, num, (users.shape[0], k))  # (B, k)
        order = np.argsort(draws, axis=1, kind="stable")  # equal items: the earlier draw first
        ranked = np.take_along_axis(draws, order, 1)
        repeat = np.zeros_like(ranked, dtype=bool)
        repeat[:, 1:] = ranked[:, 1:] == ranked[:, :-1]
        drop = np.empty_like(repeat)
        np.put_along_axis(drop, order, repeat, 1)  # (B, k) in draw order
        keys = users[:, None] * num + draws  # (B, k); seen_keys is sorted (users, then items, ascending)
        at = np.minimum(np.searchsorted(seen_keys, keys), max(0, seen_keys.shape[0] - 1))
        drop |= seen_keys[at] == keys if seen_keys.shape[0] else False
        if ((~drop).sum(1) < m).any():
            raise DataError(f"video_world: a user of block {b} has fewer than {m} distinct unseen items among {k} "
                            f"uniform draws; lower random_items_per_user={m}")
        first = np.argsort(drop, axis=1, kind="stable")[:, :m]  # (B, M): the first M kept draws
        shown = np.take_along_axis(draws, first, 1)  # (B, M)
        uu = np.broadcast_to(users[:, None], shown.shape)
        z_click, z_lv = (np.concatenate(z) for z in zip(*(world._pair_logits(uu[i:i + 128], shown[i:i + 128])
                                                          for i in range(0, uu.shape[0], 128))))  # (B, M) each
        p_click, p_lv_after = _sigmoid(z_click), _sigmoid(z_lv)
        rl = _rng(cfg.seed, purposes[1], b)
        u1, u2 = rl.random(shown.shape), rl.random(shown.shape)
        click = (u1 < p_click).astype(np.int32)
        parts.append({"user_id": uu.ravel().astype(np.int64), "item_id": shown.ravel().astype(np.int64),
                      "click": click.ravel(), "long_view": (click * (u2 < p_lv_after)).astype(np.int32).ravel(),
                      "p_click": p_click.ravel().astype(np.float32),
                      "p_long_view": (p_click * p_lv_after).ravel().astype(np.float32)})
    return pd.DataFrame({c: np.concatenate([p[c] for p in parts]) for c in RANDOM_COLUMNS})


def tune_split(world: VideoWorld) -> VideoWorld:
    """The world held out inside its training impressions, for choosing settings without the test split: each
    user's last `test_requests_per_user` train requests become its held-out requests (`test`), the requests
    before them its training impressions (`train`, `seen`), and its random bucket is drawn afresh (its own
    streams, (seed, _P_TUNE_RANDOM / _P_TUNE_RANDOM_LABELS, block)) among the items unseen in that training,
    labelled as of the first held-out request. The world's test requests and random bucket are never read;
    the ideal list, utility and short-term state follow from the new train / test (as of the new request
    time). `metrics` and `rates` are the whole world's (not recomputed)."""
    cfg = world.config
    held = cfg.test_requests_per_user * cfg.request_size  # impressions held out per user
    if held == 0 or cfg.impressions_per_user <= held:
        raise ConfigError(f"video_world tune split: test_requests_per_user={cfg.test_requests_per_user} x "
                          f"request_size={cfg.request_size} must be >= 1 impression and fewer than "
                          f"impressions_per_user={cfg.impressions_per_user} (the train requests it holds out)")
    train = world.train  # rows by (user, time); each user has impressions_per_user of them
    user = train["user_id"].to_numpy(np.int64)
    counts = np.bincount(user, minlength=cfg.users)  # (U,)
    position = np.arange(user.shape[0]) - (np.cumsum(counts) - counts)[user]  # (N,) rank in the user's time order
    is_test = position >= (counts - held)[user]  # (N,) the last `held` impressions: whole requests
    new_train = train[~is_test].reset_index(drop=True)
    tu, ti = user[~is_test], train["item_id"].to_numpy(np.int64)[~is_test]
    order = np.lexsort((ti, tu))
    offsets = np.zeros(cfg.users + 1, np.int64)
    np.cumsum(np.bincount(tu, minlength=cfg.users), out=offsets[1:])
    tuned = VideoWorld(cfg, world.users, world.items, world.user_factors, world.item_factors, new_train,
                       train[is_test].reset_index(drop=True), offsets, ti[order], dict(world.metrics),
                       dict(world.rates), world.seconds)
    if cfg.random_items_per_user:
        tuned.random = _random_bucket(tuned, (_P_TUNE_RANDOM, _P_TUNE_RANDOM_LABELS))
    return tuned


def topn_metrics(lists: np.ndarray, user_ids: np.ndarray, test: pd.DataFrame, k: int = 10) -> dict[str, float]:
    """NDCG@k and HR@k of lists (B, >=k) against each user's held-out positives (test rows with
    click = 1; binary gains; users without a positive must not be passed), averaged over users."""
    users = np.asarray(user_ids, np.int64)
    lists = np.asarray(lists, np.int64)[:, :k]  # (B, k)
    pos = test[test["click"] == 1]
    pu, pi = pos["user_id"].to_numpy(np.int64), pos["item_id"].to_numpy(np.int64)
    # membership of (user row, item) pairs by sorted 128-bit-free keys: row * I + item
    n_items = int(max(lists.max(initial=0), pi.max(initial=0))) + 1
    row_of = np.full(int(max(users.max(initial=0), pu.max(initial=0))) + 1, -1, np.int64)
    row_of[users] = np.arange(users.shape[0])
    keep = row_of[pu] >= 0
    pos_keys = np.unique(row_of[pu[keep]] * n_items + pi[keep])
    counts = np.bincount(row_of[pu[keep]], minlength=users.shape[0])  # (B,) positives per user
    if (counts == 0).any():
        raise DataError(f"topn_metrics: user {int(users[counts == 0][0])} has no held-out positive; pass users "
                        f"with at least one test click")
    keys = np.arange(users.shape[0])[:, None] * n_items + lists  # (B, k)
    hit = np.isin(keys, pos_keys)  # (B, k)
    disc = 1.0 / np.log2(np.arange(k) + 2.0)  # (k,)
    idcg = np.cumsum(disc)[np.minimum(counts, k) - 1]  # (B,)
    return {f"ndcg@{k}": float(((hit * disc).sum(1) / idcg).mean()), f"hr@{k}": float(hit.any(1).mean())}


def ideal_metrics(world: VideoWorld, users: int | Sequence[int] | np.ndarray = 300, k: int = 10,
                  baseline: bool = False) -> dict[str, Any]:
    """The ideal funnel's NDCG@k, HR@k and mean utility per slot against held-out positives.

    `users`: user ids, or a count: the first that many users (by id) with a test positive.
    Train-seen items are excluded from the ideal list (as the funnel filters them).
    baseline=True returns {"ideal": ..., "most_popular": ...}: the same metrics of the
    most-popular list (`popular_topn`) plus its utility_ndcg@k (the ideal's is 1)."""
    with_pos = np.unique(world.test.loc[world.test["click"] == 1, "user_id"].to_numpy(np.int64))
    if isinstance(users, (int, np.integer)):
        chosen = with_pos[: int(users)]
    else:
        chosen = np.asarray(users, np.int64)
    if chosen.shape[0] == 0:
        empty = {f"ndcg@{k}": float("nan"), f"hr@{k}": float("nan"), f"utility@{k}": float("nan"), "users": 0}
        return {"ideal": empty, "most_popular": {**empty, f"utility_ndcg@{k}": float("nan")}} if baseline else empty
    lists, util = world.ideal_topn(chosen, k, world.seen, return_scores=True)
    out = topn_metrics(lists, chosen, world.test, k)
    out[f"utility@{k}"] = float(util.mean())
    out["users"] = int(chosen.shape[0])
    if not baseline:
        return out
    pop = world.popular_topn(chosen, k, world.seen)  # (B, k)
    pop_util = world.utility(chosen[:, None], pop)  # (B, k)
    disc = 1.0 / np.log2(np.arange(k) + 2.0)  # (k,)
    ratio = (pop_util * disc).sum(1) / (util.astype(np.float64) * disc).sum(1)  # (B,)
    base = topn_metrics(pop, chosen, world.test, k)
    base.update({f"utility@{k}": float(pop_util.mean()), f"utility_ndcg@{k}": float(ratio.mean()),
                 "users": int(chosen.shape[0])})
    return {"ideal": out, "most_popular": base}


# ----------------------------------------------------------------------------- files


def schema() -> dict[str, Any]:
    """The reader schema of train.parquet / test.parquet (recps.data.schema.Schema.from_config)."""
    return {"format": "parquet", "labels": list(LABELS), "sparse": list(SPARSE), "dense": list(DENSE),
            "hash_values": False, "dense_transform": "none"}


def _parquet_bytes(frame: pd.DataFrame) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), sink, compression="snappy")
    return sink.getvalue().to_pybytes()


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def _recall_files(world: VideoWorld) -> dict[str, bytes]:
    both = pd.concat([world.train, world.test], ignore_index=True)
    pos = both[both["click"] == 1].sort_values(["user_id", "time"], kind="stable")
    ratings = pa.table({"userId": pos["user_id"].to_numpy(), "itemId": pos["item_id"].to_numpy(),
                        "rating": 1 + pos["long_view"].to_numpy(), "timestamp": pos["time"].to_numpy()})
    names = pa.array([f"c{c}" for c in range(world.config.categories)])  # (C,) genre names
    items = pa.table({"itemId": world.items["item_id"].to_numpy(),
                      "genres": names.take(pa.array(world.items["category"].to_numpy()))})
    return {"recall/ratings.csv": _csv_bytes(ratings), "recall/items.csv": _csv_bytes(items)}


def _csv_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pcsv.write_csv(table, sink, pcsv.WriteOptions(quoting_style="none"))
    return sink.getvalue().to_pybytes()


def write(world: VideoWorld, out: str | os.PathLike) -> str:
    """Writes the world's files under `out` (a path or fsspec URL); returns `out`.

    Every file is written to a temporary beside it and renamed into place; world.json, with the
    SHA-256 of every other file, is written last, so a reader that finds world.json finds the
    whole world (an interrupted write leaves no world.json, or the previous one whose checksums
    then fail)."""
    out = os.fspath(out)
    t0 = time.perf_counter()
    impression_cols = list(IMPRESSION_COLUMNS)
    files = {
        "users.parquet": _parquet_bytes(world.users),
        "items.parquet": _parquet_bytes(world.items),
        "user_factors.npy": _npy_bytes(world.user_factors),
        "item_factors.npy": _npy_bytes(world.item_factors),
        "train.parquet": _parquet_bytes(world.train[impression_cols]),
        "test.parquet": _parquet_bytes(world.test[impression_cols]),
        "seen_offsets.npy": _npy_bytes(world.seen_offsets),
        "seen_items.npy": _npy_bytes(world.seen_items),
        **({"random.parquet": _parquet_bytes(world.random[list(RANDOM_COLUMNS)])} if len(world.random) else {}),
        **_recall_files(world),
    }
    sums = {}
    for name, data in files.items():
        fs.write_atomic(fs.join(out, name), data, overwrite=True)
        sums[name] = hashlib.sha256(data).hexdigest()
    meta = {
        "generator": GENERATOR, "format_version": FORMAT_VERSION, "config": world.config.to_dict(),
        "sizes": {"users": world.config.users, "items": world.config.items, "dim": world.config.dim,
                  "train_rows": int(len(world.train)), "test_rows": int(len(world.test)),
                  "seen": int(world.seen_items.shape[0])},
        "files": sums, "rates": world.rates, "best": world.metrics, "seconds": world.seconds,
        "schema": schema(),
    }
    fs.write_atomic(fs.join(out, META), json.dumps(meta, indent=1) + "\n", overwrite=True)
    log.info("video world written to %s in %.1f s", out, time.perf_counter() - t0)
    return out


def _read(path: str) -> bytes:
    """The bytes of `path`; FileNotFoundError when it is missing (fs.read_bytes raises a FileSystemError)."""
    if not fs.exists(path):
        raise FileNotFoundError(path)
    return fs.read_bytes(path)


def read_info(out: str | os.PathLike) -> dict[str, Any]:
    """world.json of a written world (DataError naming the file and the fix if absent or foreign)."""
    path = fs.join(os.fspath(out), META)
    try:
        meta = json.loads(_read(path))
    except FileNotFoundError:
        raise DataError(f"{path} not found: no complete video world there (world.json is written last); "
                        f"generate it: python -m recps.data.generators video_world --out {os.fspath(out)}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e}); regenerate the world") from None
    if meta.get("generator") != GENERATOR or meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path} is not a {GENERATOR} world of format_version {FORMAT_VERSION}; regenerate it")
    return meta


def load(out: str | os.PathLike, verify: bool = True) -> VideoWorld:
    """The world written under `out`; verify=True checks every file's SHA-256 against world.json."""
    out = os.fspath(out)
    meta = read_info(out)
    data = {}
    for name in ("users.parquet", "items.parquet", "user_factors.npy", "item_factors.npy", "train.parquet",
                 "test.parquet", "seen_offsets.npy", "seen_items.npy", "random.parquet"):
        if name == "random.parquet" and name not in meta["files"]:
            continue  # a world without a random bucket
        path = fs.join(out, name)
        try:
            raw = _read(path)
        except FileNotFoundError:
            raise DataError(f"{path} not found though {META} lists it; regenerate the world") from None
        if verify and hashlib.sha256(raw).hexdigest() != meta["files"][name]:
            raise DataError(f"{path}: SHA-256 differs from {META}'s; the file changed or is partial: regenerate")
        data[name] = pq.read_table(io.BytesIO(raw)).to_pandas() if name.endswith(".parquet") else \
            np.load(io.BytesIO(raw), allow_pickle=False)
    cfg = VideoWorldConfig.from_dict(meta["config"], f"{fs.join(out, META)} config")
    return VideoWorld(cfg, data["users.parquet"], data["items.parquet"], data["user_factors.npy"],
                      data["item_factors.npy"], data["train.parquet"], data["test.parquet"],
                      data["seen_offsets.npy"], data["seen_items.npy"], meta["best"], meta["rates"],
                      float(meta["seconds"]), **({"random": data["random.parquet"]} if "random.parquet" in data else {}))


# ----------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class WorldInfo:
    """What a dataset config learns of a written world (the `ensure_split` protocol)."""

    dir: str
    config: VideoWorldConfig
    meta: dict[str, Any]

    @property
    def best_aucs(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.meta["best"]["auc"].items()}

    @property
    def best_auc(self) -> float:
        return self.best_aucs["click"]

    @property
    def schema(self) -> dict[str, Any]:
        return schema()


def ensure_world(directory: str | os.PathLike, cfg: VideoWorldConfig) -> WorldInfo:
    """The world of `cfg` under `directory`: loaded from world.json if it is that world, else generated and written."""
    directory = os.fspath(directory)
    try:
        meta = read_info(directory)
        if meta["config"] == cfg.to_dict() and all(fs.exists(fs.join(directory, f)) for f in meta["files"]):
            return WorldInfo(directory, cfg, meta)
    except DataError:
        pass
    write(generate(cfg), directory)
    return WorldInfo(directory, cfg, read_info(directory))


def _held_config(directory: str) -> dict[str, Any] | None:
    """The config of the complete world under `directory` (world.json and every file it lists), else None."""
    try:
        meta = read_info(directory)
    except DataError:
        return None
    return meta["config"] if all(fs.exists(fs.join(directory, f)) for f in meta["files"]) else None


def world_home(directory: str | os.PathLike, cfg: VideoWorldConfig) -> str:
    """Where the world of `cfg` lives: `directory`, unless a complete world of another config is there;
    then `<directory>-<digest of cfg>` beside it, so that a world is never overwritten by another one
    (another run may be reading it). The same answer in every process of a job."""
    directory = os.fspath(directory).rstrip("/")
    held = _held_config(directory)
    if held is None or held == cfg.to_dict():
        return directory
    digest = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:10]
    home = f"{directory}-{digest}"
    differ = sorted(k for k in set(held) | set(cfg.to_dict()) if held.get(k) != cfg.to_dict().get(k))
    log.info("video world: %s holds another world (its %s differ); this one lives in %s", directory,
             ", ".join(differ), home)
    return home


def ensure_split(directory: str | os.PathLike, train_rows: int = 0, test_rows: int = 0, *, seed: int = 0,
                 fmt: str = "parquet", **options: Any) -> tuple[WorldInfo, WorldInfo]:
    """A dataset config's `generator` (recps.data.dataset.ensure_generated): the world of
    VideoWorldConfig(seed=seed, **options) under `directory`, as (train info, test info).

    train_rows / test_rows: 0 (the sizes follow from users, impressions_per_user, request_size
    and test_requests_per_user) or exactly those sizes."""
    if fmt != "parquet":
        raise ConfigError(f"video_world fmt={fmt!r}: only 'parquet' is written; drop fmt or set it to parquet")
    cfg = VideoWorldConfig.from_dict({**options, "seed": seed}, "dataset.generate (video_world)")
    want = (cfg.users * cfg.impressions_per_user, cfg.users * cfg.test_requests_per_user * cfg.request_size)
    for name, given, derived in (("train_rows", train_rows, want[0]), ("test_rows", test_rows, want[1])):
        if int(given) not in (0, derived):
            raise ConfigError(f"dataset.generate.{name}={given} but the video world has {derived} such rows "
                              f"(users x impressions); set {name}: 0 (derived) or {derived}")
    info = ensure_world(directory, cfg)
    return info, info


def prepare_recall(name: str, dir: str, generate: dict[str, Any], ratings: str, movies: str,
                   generator: str | None = None, seed: int = 0, **interactions: Any):
    """The `_target_` of conf/dataset/video_world_recall.yaml: ensures the world under `dir`
    (its `generate` block, as video_world.yaml's), then reads its recall/ratings.csv and
    recall/items.csv with recps.data.interactions.prepare_interactions (`interactions`: that
    function's other keys: layouts, min_rating, history_length, examples_per_user, shuffle)."""
    from recps.data.interactions import prepare_interactions  # deferred: torchrec, only for the recall data set

    gen = dict(generate)
    ensure_split(dir, int(gen.pop("train_rows", 0)), int(gen.pop("test_rows", 0)), seed=int(gen.pop("seed", 0)),
                 **gen)
    return prepare_interactions(name, ratings, movies, seed=seed, **interactions)


# ----------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """python -m recps.data.generators video_world --users U --items I --out DIR [--seed S] [--KEY VALUE ...]"""
    p = argparse.ArgumentParser(prog="python -m recps.data.generators video_world", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory or fsspec URL to write the world to")
    defaults = VideoWorldConfig()
    for f in dataclasses.fields(VideoWorldConfig):
        p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=type(getattr(defaults, f.name)),
                       default=getattr(defaults, f.name))
    args = vars(p.parse_args(argv))
    out = args.pop("out")
    quiet_libraries()  # the libraries' import-time lines a user cannot act on
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = VideoWorldConfig(**args)
    except ConfigError as e:
        p.error(str(e))
    t0 = time.perf_counter()
    world = generate(cfg)
    t1 = time.perf_counter()
    write(world, out)
    t2 = time.perf_counter()
    print(json.dumps({"out": out, "generate_s": round(t1 - t0, 2), "write_s": round(t2 - t1, 2),
                      "phases_s": {k: round(v, 2) for k, v in world.rates["seconds"].items()},
                      "train_rows": len(world.train), "test_rows": len(world.test),
                      "rates": {k: v for k, v in world.rates.items() if k != "seconds"}, "best": world.metrics},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
