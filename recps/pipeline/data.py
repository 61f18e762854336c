"""What a funnel trains and is evaluated on: users and items with their features, exposures with labels,
held-out requests with their positives, and what each user has already seen.

A `FunnelData` is built by the `_target_` of `pipeline.world` (conf/pipeline/*.yaml):

- `movielens(ratings, movies, ...)`: MovieLens latest-small as real data. Each user's ratings in time
  order; the last `test_fraction` are held out. Every training rating is an exposure (label click =
  rating >= `click_rating`, long_view = rating >= `long_view_rating`); a held-out rating >= click_rating
  is a positive of the user's request. Items: item_id and category (the first genre).
- `video_world(...)`: the generated video world (recps.data.generators.video_world), whose click and long-view
  labels come from a known model (its ideal ranking is known).

Shapes: U users, I items, N exposures, R held-out requests (one per test user), E interactions, L the
history length.
Pairs of (user, item) become `Examples` with one key per feature (`pair_examples`): the stage's
features, user side then item side, as its model names them.

Behaviour history (issue 29.1; models/_behaviour.py reads it): each user's training exposures are its
interactions (`History`: item, time, click, long view). An example at time t sees the user's last L
interactions with time < t, oldest first (`FunnelData.history_at`, vectorized): strictly before, so
nothing of its own request (same time), its own label or later; interactions at the same time are
ordered by item id (deterministic) and come or go together. A held-out request's history is the whole
training history (`HELD_OUT`: after every training exposure; nothing of the test period is an
interaction). As sequence features (one key per position, names in `HISTORY_FEATURES`):

    history_item_id     the item                      history_category   its category
    history_click       1 if it was clicked, else 0   history_long_view  1 if watched through, else 0

L = `history_length` (pipeline.world.history_length, >= 1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from recps.data.generators.video_world import VideoWorldConfig, ensure_world, load, tune_split, world_home
from recps.data.interactions import read_catalogue, read_ratings
from recps.data.reader import Examples
from recps.errors import ConfigError
from recps.targets import check_target_args

__all__ = ["FunnelData", "Csr", "History", "HISTORY_FEATURES", "HELD_OUT", "movielens", "video_world", "video_world_dir",
           "pair_examples", "csr_from_pairs", "exposure_bucket", "latest_share", "load_world", "ValidationPeriod", "validation_period"]

HISTORY_FEATURES = ("history_item_id", "history_category", "history_click", "history_long_view")
HELD_OUT = torch.iinfo(torch.int64).max  # the time of a held-out request: after every training exposure

log = logging.getLogger("recps.pipeline")


@dataclass(frozen=True)
class Csr:
    """Rows of item indices: row r holds items[offsets[r]:offsets[r + 1]] (offsets (R + 1,), items (V,))."""

    offsets: torch.Tensor
    items: torch.Tensor

    def rows(self, rows: torch.Tensor) -> "Csr":
        """The CSR of rows `rows` (K,), in that order (vectorized gather)."""
        rows = rows.to(torch.int64)
        starts, stops = self.offsets[rows], self.offsets[rows + 1]  # (K,)
        lengths = stops - starts  # (K,)
        out = torch.zeros(rows.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=out[1:])
        take = torch.repeat_interleave(starts - out[:-1], lengths) + torch.arange(int(out[-1]))  # (V',)
        return Csr(out, self.items[take])

    def row_ids(self) -> torch.Tensor:
        """(V,) the row of each entry."""
        return torch.repeat_interleave(torch.arange(self.offsets.numel() - 1), self.offsets.diff())

    def padded(self, fill: int = -1) -> torch.Tensor:
        """(R, max length) items, `fill` after each row's end."""
        lengths = self.offsets.diff()
        width = int(lengths.max()) if lengths.numel() else 0
        out = torch.full((lengths.numel(), max(width, 1)), fill, dtype=torch.int64)
        rows = self.row_ids()
        cols = torch.arange(self.items.numel()) - self.offsets[rows]
        out[rows, cols] = self.items
        return out


def csr_from_pairs(rows: torch.Tensor, items: torch.Tensor, num_rows: int) -> Csr:
    """The Csr of (row, item) pairs, unique items per row, sorted."""
    key = torch.unique(rows.to(torch.int64) * (int(items.max()) + 1 if items.numel() else 1) + items.to(torch.int64))
    width = int(items.max()) + 1 if items.numel() else 1
    r, i = key // width, key % width
    offsets = torch.zeros(num_rows + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(r, minlength=num_rows), 0, out=offsets[1:])
    return Csr(offsets, i)


@dataclass(frozen=True)
class History:
    """Each user's interactions, oldest first: user u's are entries offsets[u]:offsets[u + 1], sorted by
    (time, item). offsets (U + 1,), item, time, click, long_view (E,) int64; `rank` (E,) the dense rank of
    each entry's time among `times` (the sorted distinct times, (K,))."""

    offsets: torch.Tensor
    item: torch.Tensor
    time: torch.Tensor
    click: torch.Tensor
    long_view: torch.Tensor
    times: torch.Tensor
    rank: torch.Tensor

    @classmethod
    def of(cls, user: torch.Tensor, item: torch.Tensor, time: torch.Tensor, labels: torch.Tensor,
           num_users: int) -> "History":
        """From interactions (user, item, time (E,), labels (E, >=2): click, long view), in any order."""
        user, item, time = (x.to(torch.int64) for x in (user, item, time))
        order = torch.from_numpy(np.lexsort((item.numpy(), time.numpy(), user.numpy())))  # (E,) by (user, time, item)
        offsets = torch.zeros(num_users + 1, dtype=torch.int64)
        torch.cumsum(torch.bincount(user, minlength=num_users), 0, out=offsets[1:])
        times, rank = torch.unique(time[order], return_inverse=True)  # (K,), (E,)
        flags = (labels[order, :2] > 0).to(torch.int64)  # (E, 2)
        return cls(offsets, item[order], time[order], flags[:, 0].contiguous(), flags[:, 1].contiguous(), times, rank)

    def at(self, users: torch.Tensor, times: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(lengths (N,), entries (V,)): for row n the indices of user[n]'s last `length` interactions with
        time < times[n], oldest first (entries row after row). One searchsorted over (user, time rank) keys."""
        users, times = users.to(torch.int64), times.to(torch.int64)
        k = self.times.numel() + 1
        user_of = torch.repeat_interleave(torch.arange(self.offsets.numel() - 1), self.offsets.diff())  # (E,)
        keys = user_of * k + self.rank  # (E,) ascending: entries are sorted by (user, time)
        before = torch.searchsorted(self.times, times, side="left")  # (N,) distinct times < t
        end = torch.searchsorted(keys, users * k + before, side="left")  # (N,) one past the last entry < t
        start = torch.maximum(self.offsets[users], end - int(length))  # (N,)
        lengths = end - start  # (N,)
        out = torch.zeros(users.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=out[1:])
        entries = torch.repeat_interleave(start - out[:-1], lengths) + torch.arange(int(out[-1]))  # (V,)
        return lengths, entries


@dataclass
class FunnelData:
    """Users, items, exposures and held-out requests of a funnel.

    Attributes:
        name: for messages.
        user_features: feature -> (U,) int64 key of each user.
        item_features: feature -> (I,) int64 key of each item.
        train_user, train_item: (N,) int64 exposures.
        train_labels: (N, T) float32, columns `label_names` (click, long_view).
        seen: Csr over users: the items each user was exposed to in training (never recommended again).
        test_users: (R,) int64 users of the held-out requests.
        test_positives: Csr over requests: the held-out items the user liked (what the funnel is evaluated
            on; `evaluated_on` names where they come from).
        logged_positives: Csr over requests: the logged held-out positives, when test_positives are not
            those (the generated world's random bucket); reported too (logged_* metrics). None otherwise.
        test_shown: Csr over requests: every item the held-out requests showed (clicked or not): the rankers'
            AUCs count only these (the others have no label). None: unknown (every candidate counts).
        evaluated_on: "logged" (the held-out requests of the logging policy) or "random_bucket".
        ideal: (users (B,), n, exclude Csr) -> (B, n) item ids of the best list the world's model knows
            (None: real data, unknown).
        utility_ndcg: (users (B,), lists (B, n)) -> (B,) DCG of the lists' true utility over the ideal
            list's (1.0: the ideal; None: unknown).
        click_prob: (users (N,), items (N,)) -> (N,) the world's true P(click) of the pairs as of the held-out
            request (None: unknown): ranking a stage's input by it keeps the most clicks in expectation, the
            ceiling of that stage's pass-through (recps.pipeline.held_out, `ideal_pass_through`).
        train_time: (N,) int64 each exposure's time (None: unknown; then no history features).
        history: the users' interactions (`History`, from the exposures), None without train_time.
        history_length: L, the most recent interactions a history feature holds.
    """

    name: str
    user_features: dict[str, torch.Tensor]
    item_features: dict[str, torch.Tensor]
    train_user: torch.Tensor
    train_item: torch.Tensor
    train_labels: torch.Tensor
    seen: Csr
    test_users: torch.Tensor
    test_positives: Csr
    label_names: tuple[str, ...] = ("click", "long_view")
    logged_positives: Csr | None = None
    test_shown: Csr | None = None
    evaluated_on: str = "logged"
    ideal: Callable[[torch.Tensor, int, Csr], torch.Tensor] | None = field(default=None, repr=False)
    utility_ndcg: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    click_prob: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    train_time: torch.Tensor | None = None
    history: History | None = field(default=None, repr=False)
    history_length: int = 50

    def __post_init__(self) -> None:
        if isinstance(self.history_length, bool) or not isinstance(self.history_length, (int, np.integer)) \
                or self.history_length < 1:
            raise ConfigError(f"pipeline.world.history_length={self.history_length!r}; use an integer >= 1 (the "
                              f"interactions a history feature holds)")
        self.history_length = int(self.history_length)
        if self.history is None and self.train_time is not None:
            self.history = History.of(self.train_user, self.train_item, self.train_time, self.train_labels,
                                      self.num_users)

    @property
    def num_users(self) -> int:
        return int(next(iter(self.user_features.values())).numel())

    @property
    def num_items(self) -> int:
        return int(next(iter(self.item_features.values())).numel())

    @property
    def feature_names(self) -> tuple[str, ...]:
        return (*self.user_features, *self.item_features)

    @property
    def sequence_feature_names(self) -> tuple[str, ...]:
        """The history features (`HISTORY_FEATURES`) when the data has a history, else ()."""
        return HISTORY_FEATURES if self.history is not None else ()

    def request_times(self, users: torch.Tensor) -> torch.Tensor:
        """(R,) the time of held-out requests of `users` (HELD_OUT): their history is the whole training history."""
        return torch.full((int(users.numel()),), HELD_OUT, dtype=torch.int64)

    def history_at(self, users: torch.Tensor, times: torch.Tensor,
                   features: Sequence[str] = HISTORY_FEATURES) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{feature: (lengths (N,), values (V,))} of the history features `features` of rows (user, time): each
        row's last history_length interactions strictly before its time, oldest first (module docstring).
        Exposures: times = train_time[rows]; held-out requests: request_times(users)."""
        if self.history is None:
            raise ConfigError(f"the data {self.name!r} has no exposure times, so no history features {list(features)}; "
                              f"build it with train_time")
        if times is None or times.shape != users.shape:
            raise ValueError(f"history_at: times {None if times is None else tuple(times.shape)} must match users "
                             f"{tuple(users.shape)}: pass train_time[rows] for exposures, request_times(users) for "
                             f"held-out requests")
        lengths, entries = self.history.at(users, times, self.history_length)
        h = self.history
        items = h.item[entries]  # (V,)
        values = {"history_item_id": lambda: items, "history_category": lambda: self.item_features["category"][items],
                  "history_click": lambda: h.click[entries], "history_long_view": lambda: h.long_view[entries]}
        unknown = [f for f in features if f not in values]
        if unknown:
            raise ValueError(f"history_at: {unknown} are not history features; they are {list(HISTORY_FEATURES)}")
        return {f: (lengths, values[f]()) for f in features}

    def popularity(self) -> torch.Tensor:
        """(I,) training clicks per item (label column 0)."""
        clicked = self.train_labels[:, 0] > 0
        return torch.bincount(self.train_item[clicked], minlength=self.num_items)

    def check_features(self, stage: str, features: Sequence[str]) -> None:
        missing = [f for f in features if f not in self.user_features and f not in self.item_features
                   and f not in self.sequence_feature_names]
        if missing:
            raise ConfigError(f"pipeline.stages.{stage}.inputs.features: {missing} are not features of the data "
                              f"{self.name!r} (it has {[*self.feature_names, *self.sequence_feature_names]}); "
                              f"name some of those")


@dataclass(frozen=True)
class ValidationPeriod:
    """The training data split in time for what is tuned on it (issue 29.5): `fit` holds each user's earlier
    training exposures as its training rows (seen items, history and the `exposures` bucket recomputed from
    them) and, as its requests, the users with a click in their latest `fraction` of training exposures
    (`fit.test_users`; their clicks `fit.test_positives`): the stages that train on `validation` learn to
    rank what the funnel trained on `fit` retrieves for them, the way the held-out requests are served.
    `labels[j]` (a Csr over those requests): the period's items whose label column j is set; `shown`: every
    item the period showed them (clicked or not); `rows` (P,): the period's exposures, indices into the
    data's train_* rows."""

    fit: FunnelData
    labels: tuple[Csr, ...]
    fraction: float
    rows: torch.Tensor | None = None
    shown: Csr | None = None


def latest_share(users: np.ndarray | torch.Tensor, fraction: float, spare_one: bool = True) -> np.ndarray:
    """(N,) bool: each user's latest floor(count x fraction) rows, at least one (with `spare_one`, never all
    of a user's rows), for rows grouped by user in time order: the one split of the held-out ratings, the
    validation period and EASE's validation rows."""
    users = np.asarray(users, dtype=np.int64)  # (N,)
    counts = np.bincount(users)  # (U,)
    position = np.arange(users.size) - (np.cumsum(counts) - counts)[users]  # (N,) rank in the user's time order
    held = np.maximum(1, np.floor(counts * float(fraction)).astype(np.int64))  # (U,)
    if spare_one:
        held = np.minimum(held, counts - 1)
    return position >= (counts - held)[users]


def validation_period(data: FunnelData, fraction: float) -> ValidationPeriod:
    """Each user's latest `fraction` of training exposures (at least one, never all of them; in time order,
    ties in the data's row order) becomes the validation period; the held-out requests are never read."""
    if not 0.0 < float(fraction) < 1.0:
        raise ConfigError(f"pipeline.validation_fraction={fraction}; use a value in (0, 1): each user's latest "
                          "share of training exposures the validation stages train on")
    n = int(data.train_user.numel())
    times = data.train_time if data.train_time is not None else torch.arange(n)
    order = torch.from_numpy(np.lexsort((np.arange(n), times.numpy(), data.train_user.numpy())))  # (N,)
    latest = torch.zeros(n, dtype=torch.bool)
    latest[order] = torch.from_numpy(latest_share(data.train_user[order], fraction))  # (N,) in the data's row order
    fit_rows, period_rows = (~latest).nonzero().squeeze(1), latest.nonzero().squeeze(1)
    p_user, p_item, p_labels = data.train_user[period_rows], data.train_item[period_rows], data.train_labels[period_rows]
    requests = torch.unique(p_user[p_labels[:, 0] > 0])  # (R,) users with a click in the period
    slot = torch.searchsorted(requests, p_user)  # (P,)
    asked = (slot < requests.numel()) & (requests[slot.clamp(max=max(0, requests.numel() - 1))] == p_user)

    def period_csr(mask: torch.Tensor) -> Csr:
        return csr_from_pairs(slot[asked & mask], p_item[asked & mask], int(requests.numel()))

    item_features = dict(data.item_features)
    f_user, f_item = data.train_user[fit_rows], data.train_item[fit_rows]
    if "exposures" in item_features:
        item_features["exposures"] = exposure_bucket(f_item, data.num_items)
    fit = FunnelData(
        name=f"{data.name} (validation fit)", user_features=data.user_features, item_features=item_features,
        train_user=f_user, train_item=f_item, train_labels=data.train_labels[fit_rows],
        seen=csr_from_pairs(f_user, f_item, data.num_users), test_users=requests,
        test_positives=period_csr(p_labels[:, 0] > 0), label_names=data.label_names,
        train_time=None if data.train_time is None else data.train_time[fit_rows], history_length=data.history_length)
    labels = tuple(period_csr(p_labels[:, j] > 0) for j in range(p_labels.shape[1]))
    log.info("validation period: each user's latest %.0f%% of training exposures, %d rows, %d requests (%d clicks); "
             "%d exposures before it", 100 * float(fraction), int(period_rows.numel()), int(requests.numel()),
             int(labels[0].items.numel()), int(fit_rows.numel()))
    return ValidationPeriod(fit, labels, float(fraction), period_rows, period_csr(torch.ones_like(asked)))


def pair_examples(data: FunnelData, features: Sequence[str], users: torch.Tensor, items: torch.Tensor,
                  labels: torch.Tensor | None = None, dense: torch.Tensor | None = None,
                  times: torch.Tensor | None = None) -> Examples:
    """Examples (N rows) of (user, item) pairs: one key per feature (user side from `users`, item side
    from `items`), `labels` (N, T) (zeros when None), `dense` (N, I) (none when None).

    History features (`HISTORY_FEATURES`) become sequence slots, after the single-valued ones (the
    `Examples` order), as of `times` (N,): the exposures' `data.train_time[rows]`, or
    `data.request_times(users)` for held-out requests; without `times` they fail (never a silent
    "everything", which would leak the future into training rows)."""
    n = int(users.numel())
    single = [f for f in features if f not in HISTORY_FEATURES]
    sequence = [f for f in features if f in HISTORY_FEATURES]
    cols = []
    for f in single:
        table, index = (data.user_features[f], users) if f in data.user_features else (data.item_features[f], items)
        cols.append(table[index])  # (N,)
    keys = torch.stack(cols, 1) if cols else torch.zeros(n, 0, dtype=torch.int64)  # (N, S)
    seq = data.history_at(users, times, sequence) if sequence else {}
    return Examples(feature_names=(*single, *sequence), dense=dense if dense is not None else torch.zeros(n, 0),
                    keys=keys.contiguous(),
                    labels=labels if labels is not None else torch.zeros(n, len(data.label_names)),
                    seq_lengths=tuple(seq[f][0] for f in sequence), seq_values=tuple(seq[f][1] for f in sequence))


def exposure_bucket(items: torch.Tensor, num_items: int) -> torch.Tensor:
    """(I,) int64 the bucket of each item's training exposures, floor(log2(1 + count)): the item statistics
    feature production rankers read (from the training impressions only)."""
    counts = torch.bincount(items, minlength=num_items).to(torch.float64)  # (I,)
    return torch.floor(torch.log2(1.0 + counts)).to(torch.int64)


# --------------------------------------------------------------------------------------- MovieLens


def movielens(ratings: str, movies: str, test_fraction: float = 0.2, click_rating: float = 4.0,
              long_view_rating: float = 4.5, max_users: int = 0, seed: int = 0, history_length: int = 50,
              tune: bool = False, ratings_layout: Mapping | None = None, movies_layout: Mapping | None = None
              ) -> FunnelData:
    """MovieLens latest-small (or any ratings/movies pair in its layout) as funnel data; see the module doc.
    The items are every movie of `movies` (recall retrieves over all of them). `max_users` > 0 keeps the
    first that many users (tests). A rating's history: the user's training ratings with an earlier timestamp
    (the same second: neither, whatever the file's row order), the last `history_length`.
    `tune`: for choosing settings without the test split, the held-out ratings are dropped and the split is
    made again inside the training ratings (each user's last test_fraction of them held out).
    `ratings_layout`, `movies_layout`: how the files are laid out (separator, header, column names, genre
    flags: recps.data.interactions.RATINGS_LAYOUT / MOVIES_LAYOUT; None: MovieLens latest's CSVs), so any
    MovieLens-style file is read as it ships (conf/dataset/movielens_100k.yaml shows MovieLens-100K's)."""
    if not 0.0 < float(test_fraction) < 1.0:
        raise ConfigError(f"pipeline.world.test_fraction={test_fraction}; use a value in (0, 1)")
    frame = read_ratings(ratings, ratings_layout, where="pipeline.world")
    listed, genres = read_catalogue(movies, movies_layout, where="pipeline.world")
    raw_user = frame["userId"].to_numpy(np.int64)
    if max_users:
        keep = raw_user <= np.unique(raw_user)[: int(max_users)].max()
        frame = frame[keep]
        raw_user = raw_user[keep]
    user_ids, user = np.unique(raw_user, return_inverse=True)
    # The catalogue: every movie of the movies file (rated or not, with genres or "(no genres listed)"), so
    # recall retrieves over all of them; a rating of a movie the movies file lacks adds it.
    rated = frame["movieId"].to_numpy(np.int64)
    item_ids = np.union1d(listed, rated)
    item = np.searchsorted(item_ids, rated)
    rating = frame["rating"].to_numpy(np.float64)
    stamp = frame["timestamp"].to_numpy(np.int64)
    order = np.lexsort((stamp, user))  # the split's order (ties: file order); History sorts (user, time, item)
    user, item, rating, stamp = user[order], item[order], rating[order], stamp[order]
    is_test = latest_share(user, test_fraction, spare_one=False)  # a one-rating user is held out whole
    if tune:  # the test ratings go; the training ratings are split again the same way
        user, item, rating, stamp = user[~is_test], item[~is_test], rating[~is_test], stamp[~is_test]
        is_test = latest_share(user, test_fraction, spare_one=False)
    # Category: the first genre (in name order) of each item; items without one: category 0.
    first = genres.sort_values(["movieId", "genre"]).drop_duplicates("movieId")
    names, genre_index = np.unique(first["genre"].to_numpy(str), return_inverse=True)
    cat = np.zeros(item_ids.size, np.int64)
    pos = np.searchsorted(item_ids, first["movieId"].to_numpy(np.int64))
    ok = (pos < item_ids.size) & (item_ids[np.minimum(pos, item_ids.size - 1)] == first["movieId"].to_numpy(np.int64))
    cat[pos[ok]] = genre_index[ok] + 1
    t = torch.from_numpy
    train = ~is_test
    labels = np.stack([rating[train] >= click_rating, rating[train] >= long_view_rating], 1).astype(np.float32)
    num_users = int(user_ids.size)
    seen = csr_from_pairs(t(user[train]), t(item[train]), num_users)
    liked = is_test & (rating >= click_rating)
    test_users = np.unique(user[liked])
    request = np.searchsorted(test_users, user[liked])
    positives = csr_from_pairs(t(request), t(item[liked]), int(test_users.size))
    log.info("funnel data movielens%s: %d users, %d items, %d exposures, %d held-out requests (%d positives)",
             " (tune: held out inside the training ratings, the test ratings dropped)" if tune else "",
             num_users, item_ids.size, int(train.sum()), test_users.size, int(liked.sum()))
    return FunnelData(
        name="movielens (tune)" if tune else "movielens",
        user_features={"user_id": torch.arange(num_users)},
        item_features={"item_id": torch.arange(item_ids.size), "category": t(cat),
                       "exposures": exposure_bucket(t(item[train]), int(item_ids.size))},
        train_user=t(user[train]).contiguous(), train_item=t(item[train]).contiguous(), train_labels=t(labels),
        seen=seen, test_users=t(test_users), test_positives=positives,
        train_time=t(stamp[train]).contiguous(), history_length=history_length,
    )


def _world_home(dir: str, config: Mapping[str, Any]) -> tuple[str, VideoWorldConfig]:
    try:
        wcfg = VideoWorldConfig(**config)
    except TypeError as exc:
        raise ConfigError(f"pipeline.world: {exc}; its keys are recps.data.generators.video_world."
                          "VideoWorldConfig's fields") from exc
    return world_home(dir, wcfg), wcfg


def video_world_dir(dir: str, tune: bool = False, **config) -> str:
    """The folder that holds (or will hold) the world `video_world` reads for the same arguments: `dir`, or a
    sibling when `dir` holds a world of another config (recps.data.generators.video_world.world_home)."""
    return _world_home(dir, config)[0]


def video_world(dir: str, tune: bool = False, **config) -> FunnelData:
    """The generated video world (recps.data.generators.video_world) under `dir` (generated there once, by the
    launcher, when its world.json is not of this config) as funnel data: users (user_id, age, region,
    activity), items (item_id, category, creator, duration), train impressions with labels click and
    long_view, held-out requests (the test impressions the user clicked), the train-seen items, and the
    world's ideal list (`ideal_topn`, seen items excluded). With a random bucket (`random_items_per_user` > 0)
    the held-out positives are its clicks (`logged_positives`: the logged test clicks), else the test clicks.
    `tune`: for choosing settings without the test split, the world is held out inside its training impressions
    (`tune_split`: each user's last train requests held out, a random bucket of their own drawn for them); the
    test requests and the random bucket are never read."""
    home, wcfg = _world_home(dir, config)
    ensure_world(home, wcfg)
    world = tune_split(load(home)) if tune else load(home)
    t = lambda frame, col: torch.from_numpy(frame[col].to_numpy(np.int64, copy=True))  # noqa: E731
    users, items, train, test = world.users, world.items, world.train, world.test
    clicked = test[test["click"].to_numpy() > 0]
    bucket = world.random
    random_clicks = bucket[bucket["click"].to_numpy() > 0]
    # requests: the users with a held-out positive (in the random bucket when the world has one)
    test_users = np.unique((random_clicks if len(bucket) else clicked)["user_id"].to_numpy(np.int64))

    def per_request(frame) -> Csr:
        user = frame["user_id"].to_numpy(np.int64)
        request = np.searchsorted(test_users, user)
        ok = (request < test_users.size) & (test_users[np.minimum(request, test_users.size - 1)] == user)
        return csr_from_pairs(torch.from_numpy(request[ok]), torch.from_numpy(frame["item_id"].to_numpy(np.int64)[ok]),
                              int(test_users.size))

    positives = per_request(random_clicks if len(bucket) else clicked)
    logged = per_request(clicked) if len(bucket) else None
    shown = per_request(bucket if len(bucket) else test)
    seen = Csr(torch.from_numpy(world.seen_offsets.astype(np.int64)), torch.from_numpy(world.seen_items.astype(np.int64)))

    def ideal(user_ids: torch.Tensor, n: int, exclude: Csr | None = None) -> torch.Tensor:
        return torch.from_numpy(world.ideal_topn(user_ids.numpy(), n, exclude=world.seen))

    def utility_ndcg(user_ids: torch.Tensor, lists: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(world.utility_ndcg(user_ids.numpy(), lists.clamp(min=0).numpy(), world.seen))

    def click_prob(user_ids: torch.Tensor, item_ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(world.click_prob(user_ids.numpy(), item_ids.numpy()))  # as of the held-out request

    labels = torch.from_numpy(np.stack([train["click"].to_numpy(np.float32), train["long_view"].to_numpy(np.float32)], 1))
    log.info("funnel data video_world%s: %d users, %d items, %d impressions, %d held-out requests (%d positives, %s)",
             " (tune: held out inside the training impressions, the test requests dropped)" if tune else "",
             len(users), len(items), len(train), test_users.size, int(positives.items.numel()),
             "random bucket" if len(bucket) else "logged")
    return FunnelData(
        name="video_world (tune)" if tune else "video_world",
        user_features={f: t(users, f) for f in ("user_id", "age", "region", "activity")},
        item_features={**{f: t(items, f) for f in ("item_id", "category", "creator", "duration")},
                       "exposures": exposure_bucket(t(train, "item_id"), len(items))},
        train_user=t(train, "user_id"), train_item=t(train, "item_id"), train_labels=labels,
        seen=seen, test_users=torch.from_numpy(test_users), test_positives=positives, ideal=ideal,
        utility_ndcg=utility_ndcg, click_prob=click_prob, logged_positives=logged, test_shown=shown,
        evaluated_on="random_bucket" if len(bucket) else "logged",
        train_time=t(train, "time"), history_length=wcfg.history_length,
    )


def load_world(cfg) -> FunnelData:
    """The funnel's data, `pipeline.world` of the composed config (its `_target_`: movielens, video_world),
    its arguments bound to the constructor's signature first."""
    check_target_args(cfg.pipeline.world, "pipeline.world")
    return instantiate(OmegaConf.to_container(cfg.pipeline.world, resolve=True), _convert_="all")
