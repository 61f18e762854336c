"""A drifting synthetic click stream: time-partitioned Criteo text whose planted truth moves.

`write_stream(out, days, hours, rows)` (CLI: `python -m recps.data.generators drifting ...`)
writes to any fsspec URL (recps.fs), for each of `days` calendar days from `start_day` and
each split of `split_interval` minutes in the day's first `hours` hours, one split folder
(`recps.data.partitions.split_path`):

    <out>/_stream.json                      what the stream is (written first, see below)
    <out>/20261201/0000/part-00000 ...      `files_per_split` Criteo text parts, `rows` rows in all
    <out>/20261201/0000/_SUCCESS            the empty data donefile, written last
    <out>/20261201/0100/...

The world is recps.data.generators.ctr's, reused as it is (a `SyntheticConfig`: its key draws,
missing fields, dense counts, hashed per-key weights, planted pairwise term, calibrated
scales and bias, and its text line format, so the Criteo reader reads the parts unchanged).
On top of it three things drift with the clock t, in hours since `start_day` 00:00 (the
rows of a split all sit at its start time):

- new keys: a row draws synthetic's Zipf rank j in 1..V_s per slot (V = `vocab`), and rank
  j's key is replaced by a never-seen one every 1/key_churn hours, staggered: at time t
  rank j holds key id j + V_s * g with generation g = floor(t * key_churn + phase(s, j)),
  phase a hashed uniform in [0, 1). A key keeps its rank (its popularity) for its whole
  life and its successor inherits it, so every hour a `key_churn` share of the keys, evenly
  over popular and rare ranks, is new, and the share of a split's keys unseen on an
  earlier day grows linearly with the time since (then saturates at 1). At t = 0 every
  generation is 0: the stream starts as synthetic's world itself (ids = ranks), where its
  calibration holds. (A window of ids sliding along the Zipf ladder was tried and dropped:
  it moves every key's popularity by the shift each hour, so the head key changed hourly
  and the click rate swung between 0.34 and 0.42 from hour to hour.)
- click rates: each key's first-order weight and pairwise vector turn on a circle,
  w(t) = cos(theta) w + sin(theta) w' with theta = weight_rotation * t / 24 and w' a
  second hashed N(0, 1) per key: every weight stays N(0, 1) (the calibration holds at any
  t) and correlates cos(weight_rotation) with itself a day earlier.
- the bias: re-solved at each split's time so that the mean click probability stays
  `target_ctr` (synthetic's calibration sample, its keys and weights seen at time t; churn
  and rotation would otherwise carry the mean away, measured by up to 0.08 a day with 100
  keys a slot, as its few head keys change; ~15 ms a split), plus a daily cycle
  ctr_cycle * sin(2 pi t / 24). So the stream's click rate swings daily around target_ctr
  while each key's click rate moves.

`StreamDrift` holds the three rates; `StreamDrift.none()` is the static world. synthetic.py's
internals take a rank per slot and one weight per key, so the churn, the rotation and the
cycle live here, built from its parts (`_draw`, `_Truth`, `_calibrate`, `_table`); at t = 0
(and with no drift at any t) the logits are its `_Truth.logits`.

Measured (defaults, vocab 100, 2,000-20,000 rows a split): on day 2 hours 0..3, 0.18, 0.20,
0.21, 0.22 of the present sparse keys were never seen on day 1 (hours 0..3); the click
rates of the 1,082 keys seen >= 100 times on both days moved by 0.034 on average, a mean
squared z-score of 1.47 (1.00 without drift); the true model frozen at day 1's end, blind to
the new keys, scores day 2 at AUC 0.716 against the best reachable 0.774.

Determinism: the rows of a split are rows [0, rows) of the world's stream
2**30 + day_index * 1440 + minute (synthetic's seeded 4096-row blocks), cut into the parts
in order. A split's bytes depend on (world, drift, its day index and minute, rows, the part
count) only: not on `days` or `hours` (a longer stream extends a shorter one), and the parts
concatenated are the same for any `files_per_split`.

Writing: every file goes through `recps.fs.write_atomic` (a temporary beside it, renamed),
so a crash leaves no partial file under its final name (readers skip the hidden
temporaries). A split's parts are written together (`rfs.concurrently`: on HDFS their
closes overlap), then `_SUCCESS`, so a reader polling for the donefile never sees half a
split. The sidecar `_stream.json` is written first, before any split, so a consumer can read
what is coming (days, split folders, world, drift) as soon as the stream starts; the
donefiles say what is there. Existing complete splits (their `_SUCCESS` present) or a
different sidecar are refused, before anything is written, unless overwrite=True; a rewrite
removes the donefile first (the split reads as not ready meanwhile) and deletes parts beyond
the new count. A split without donefile (a crashed run's) is rewritten without asking.

Memory: a part is formatted in memory before its atomic write (~260 bytes of text a row,
plus the draws of one 65,536-row chunk): raise `files_per_split` for very large splits.
Speed: ~370k rows/s on file:// (2 days x 4 hours x 2,000 rows: 0.6 s, calibration included).

Shape letters: N rows, S = 26 sparse slots, J = 13 dense columns, K = interaction_dim.

Example:
    >>> info = write_stream("memory://doc-stream", days=2, hours=1, rows=100, files_per_split=1, vocab=50)
    >>> info.split_paths()
    ['memory://doc-stream/20261201/0000', 'memory://doc-stream/20261202/0000']
    >>> load_stream_info("memory://doc-stream") == info
    True
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import io
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow.csv as pa_csv

from recps import quiet_libraries
from recps import fs as rfs
from recps.data.generators import ctr as synthetic
from recps.data.partitions import DEFAULT_DONEFILE, LAYOUTS, split_path
from recps.data.schema import CRITEO_SPARSE
from recps.errors import ConfigError, DataError

__all__ = [
    "SIDECAR",
    "DEFAULT_START_DAY",
    "StreamDrift",
    "DEFAULT_DRIFT",
    "StreamInfo",
    "write_stream",
    "load_stream_info",
    "true_logits",
    "true_probs",
    "main",
]

log = logging.getLogger(__name__)

SIDECAR = "_stream.json"
DEFAULT_START_DAY = "20261201"
FORMAT_VERSION = 1
PART_NAME = "part-{:05d}"

_STREAM_BASE = 2**30  # a split's row stream: apart from generate's 0/1 and the calibration's 2**31
_MINUTES = 24 * 60
_MAX_DAYS = (2**31 - _STREAM_BASE) // _MINUTES  # streams stay below the calibration's
_MAX_KEY = 2**32 - 1  # ids live in 32-bit words (8 hex characters)
# Purposes of the second (rotated-in) weights; synthetic's own purposes are 1..5.
_P_WEIGHT_ALT, _P_PAIR_ALT, _P_PHASE = 0x12, 0x13, 0x14
_S = len(CRITEO_SPARSE)
_CSV_OPTIONS = dict(include_header=False, delimiter="\t", quoting_style="none")  # as synthetic.generate


# --------------------------------------------------------------------------- drift


@dataclass(frozen=True)
class StreamDrift:
    """How the world moves with the clock t (hours since the stream's first day, 00:00).

    Attributes:
        key_churn: share of each slot's keys replaced by never-seen keys (of the same
            popularity) every hour (>= 0; 0.01: a key lives 100 hours).
        weight_rotation: radians a day by which every key's weights turn towards an
            independent second draw (a key's weight correlates cos(weight_rotation) with
            itself a day earlier).
        ctr_cycle: amplitude (logit, >= 0) of the bias's daily sine cycle.
    """

    key_churn: float = 0.01
    weight_rotation: float = 0.5
    ctr_cycle: float = 0.1

    def __post_init__(self) -> None:
        for name in ("key_churn", "weight_rotation", "ctr_cycle"):
            value = getattr(self, name)
            try:
                x = float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"stream drift {name}={value!r} is not a number; fix it") from None
            if not math.isfinite(x) or (name != "weight_rotation" and x < 0):
                raise ConfigError(f"stream drift {name}={value!r}; use a finite value"
                                  + ("" if name == "weight_rotation" else " >= 0"))
            object.__setattr__(self, name, x)

    @classmethod
    def none(cls) -> "StreamDrift":
        """The static world: no new keys, fixed weights, a constant bias."""
        return cls(0.0, 0.0, 0.0)

    @classmethod
    def parse(cls, value: Any) -> "StreamDrift":
        """A StreamDrift from itself, a mapping, None (the defaults), "none" (no drift) or
        "key_churn=0.05,weight_rotation=1" (the defaults with those fields changed)."""
        if isinstance(value, StreamDrift):
            return value
        if value is None:
            return cls()
        if isinstance(value, Mapping):
            items = dict(value)
        elif isinstance(value, str):
            if value.strip().lower() == "none":
                return cls.none()
            items = {}
            for part in filter(None, (p.strip() for p in value.split(","))):
                name, eq, number = part.partition("=")
                if not eq:
                    raise ConfigError(f"stream drift {part!r} is not name=value; write e.g. "
                                      f"'key_churn=0.01,weight_rotation=0.5,ctr_cycle=0.1' or 'none'")
                items[name.strip()] = number.strip()
        else:
            raise ConfigError(f"stream drift={value!r}; give a StreamDrift, a mapping, 'none' or 'name=value,...'")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(items) - set(known))
        if unknown:
            raise ConfigError(f"stream drift names unknown fields {unknown}; known fields are {known}")
        return cls(**items)

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


DEFAULT_DRIFT = StreamDrift()


# ------------------------------------------------------------------------ the stream


def _parse_day(day: str, what: str) -> dt.date:
    try:
        if not (isinstance(day, str) and len(day) == 8 and day.isdigit()):
            raise ValueError
        return dt.datetime.strptime(day, "%Y%m%d").date()
    except ValueError:
        raise ConfigError(f"stream {what}={day!r}; days are YYYYMMDD dates (e.g. {DEFAULT_START_DAY})") from None


@dataclass(frozen=True)
class StreamInfo:
    """What `write_stream` wrote, as its sidecar `<out>/_stream.json` describes it.

    Attributes:
        out: the stream root (not in the sidecar: a copied stream keeps its description).
        days: the YYYYMMDD days, consecutive from the first (the clock's origin).
        hours: splits cover each day's first `hours` hours.
        rows: rows a split (all parts together). split_interval: minutes a split.
        layout: split folder layout (recps.data.partitions). files_per_split: parts a split.
        drift: the drift rates. config: the synthetic world (seed, vocab = keys alive per slot, ...).
        bias, scales: the world's calibrated true model at t = 0.
        donefile: the data donefile written last in each split.
    """

    out: str
    days: tuple[str, ...]
    hours: int
    rows: int
    split_interval: int
    layout: str
    files_per_split: int
    drift: StreamDrift
    config: synthetic.SyntheticConfig
    bias: float
    scales: tuple[float, float, float]
    donefile: str = DEFAULT_DONEFILE

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def vocab(self) -> tuple[int, ...]:
        return self.config.vocab

    @property
    def start_day(self) -> str:
        return self.days[0]

    @property
    def minutes(self) -> list[int]:
        """The splits' start minutes within a day."""
        return list(range(0, self.hours * 60, self.split_interval))

    @property
    def splits(self) -> list[tuple[str, int]]:
        """(day, minute) of every split, in time order."""
        return [(day, minute) for day in self.days for minute in self.minutes]

    def split_path(self, day: str, minute: int) -> str:
        return split_path(self.out, day, minute, self.layout)

    def split_paths(self) -> list[str]:
        return [self.split_path(day, minute) for day, minute in self.splits]

    def part_paths(self, day: str, minute: int) -> list[str]:
        folder = self.split_path(day, minute)
        return [rfs.join(folder, PART_NAME.format(i)) for i in range(self.files_per_split)]

    def day_index(self, day: str) -> int:
        return (_parse_day(day, "day") - _parse_day(self.start_day, "start_day")).days

    def hours_since_start(self, day: str, minute: int) -> float:
        """The clock t of a split: hours from the first day's 00:00 to the split's start."""
        return self.day_index(day) * 24 + minute / 60

    def truth(self) -> synthetic._Truth:
        return synthetic._Truth(self.config, self.bias, self.scales)

    def to_json(self) -> dict[str, Any]:
        return {
            "generator": "recps.data.generators.drifting",
            "format_version": FORMAT_VERSION,
            "start_day": self.start_day,
            "days": list(self.days),
            "hours": self.hours,
            "split_interval": self.split_interval,
            "layout": self.layout,
            "files_per_split": self.files_per_split,
            "rows": self.rows,
            "donefile": self.donefile,
            "splits": [split_path("", d, m, self.layout) for d, m in self.splits],  # under the root
            "drift": self.drift.to_dict(),
            "world": self.config.to_dict(),
            "bias": self.bias,
            "scales": list(self.scales),
            "schema": synthetic._schema_dict("text"),
        }


def _plan(out: str, days: int, hours: int, rows: int, start_day: str, seed: int, split_interval: int,
          layout: str, files_per_split: int, vocab: Any, drift: Any, world: Mapping[str, Any]) -> StreamInfo:
    """Validates the arguments into the StreamInfo of the stream to write (calibrates the world)."""
    def whole(name: str, value: Any, low: int, high: int | None = None) -> int:
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low or (
                high is not None and value > high):
            span = f">= {low}" if high is None else f"in {low}..{high}"
            raise ConfigError(f"stream {name}={value!r}; use a whole number {span}")
        return int(value)

    days = whole("days", days, 1, _MAX_DAYS)
    hours = whole("hours", hours, 1, 24)
    files_per_split = whole("files_per_split", files_per_split, 1)
    rows = whole("rows", rows, 1)
    if rows < files_per_split:
        raise ConfigError(f"stream rows={rows} a split cannot fill files_per_split={files_per_split} parts "
                          f"(an empty part is not a data file); raise rows or lower files_per_split")
    split_interval = whole("split_interval", split_interval, 1, 60)
    if 60 % split_interval:
        raise ConfigError(f"stream split_interval={split_interval} minutes does not divide an hour; "
                          f"use a divisor of 60 (5, 10, 15, 30, 60, ...)")
    if layout not in LAYOUTS:
        raise ConfigError(f"stream layout={layout!r}; use one of {LAYOUTS}")
    if layout != "hhmm" and split_interval != 60:
        raise ConfigError(f"stream layout={layout!r} holds hourly splits, but split_interval={split_interval}; "
                          f"use layout=hhmm for splits shorter than an hour")
    first = _parse_day(start_day, "start_day")
    drift = StreamDrift.parse(drift)
    config = synthetic.SyntheticConfig(seed=seed, vocab=vocab, **world)
    last_t = (days - 1) * 24 + (hours * 60 - split_interval) / 60
    top = (math.floor(last_t * drift.key_churn) + 2) * max(config.vocab)  # ids j + V * g, g <= this - 1
    if top > _MAX_KEY:
        raise ConfigError(f"stream key_churn={drift.key_churn} over {days} days with vocab {max(config.vocab)} "
                          f"needs key ids up to {top}, past {_MAX_KEY} (ids are 32-bit words); lower key_churn, "
                          f"vocab or days")
    truth = synthetic._calibrate(config)
    return StreamInfo(
        out=str(out), days=tuple((first + dt.timedelta(days=i)).strftime("%Y%m%d") for i in range(days)),
        hours=hours, rows=rows, split_interval=split_interval, layout=layout, files_per_split=files_per_split,
        drift=drift, config=config, bias=truth.bias, scales=truth.scales,
    )


# ---------------------------------------------------------------------- the drifting truth


class _World:
    """The drifting truth of a stream: the key ids and the logits at a time t."""

    def __init__(self, info: StreamInfo) -> None:
        self.info = info
        self.truth = info.truth()
        c = info.config
        self.vocab = np.asarray(c.vocab, dtype=np.int64)  # (S,)
        self.phase_salt = synthetic._salts(c.seed, _P_PHASE, _S)  # (S,)
        self._sample: dict[str, np.ndarray] | None = None  # synthetic's calibration rows, drawn once
        self._bias: dict[float, float] = {}  # t -> bias(t)
        self.weight_alt = synthetic._salts(c.seed, _P_WEIGHT_ALT, _S)  # (S,)
        self.pair_alt = synthetic._salts(c.seed, _P_PAIR_ALT, _S * c.interaction_dim).reshape(_S, -1)  # (S, K)

    def generations(self, ranks: np.ndarray, t: float) -> np.ndarray:
        """(N, S) int64: which key (0 = the first) holds each rank (N, S) uint32 at time t."""
        phase = synthetic._fmix32(ranks ^ self.phase_salt).astype(np.float64) * 2.0**-32  # (N, S) in [0, 1)
        return np.floor(t * self.info.drift.key_churn + phase).astype(np.int64)  # (N, S)

    def ids(self, ranks: np.ndarray, t: float) -> np.ndarray:
        """Zipf ranks (N, S) uint32 (0 = missing) -> key ids (N, S) uint32 (0 = missing) at time t."""
        ids = ranks + self.vocab * self.generations(ranks, t)  # (N, S) int64
        return (ids * (ranks > 0)).astype(np.uint32)  # (N, S)

    def logits(self, words: np.ndarray, present: np.ndarray, dense: np.ndarray, t: float) -> np.ndarray:
        """True logits (N,) at time t; words (N, S) uint32, present (N, S), dense (N, J) with NaN."""
        return self.bias(t) + self.centred(words, present, dense, t)  # (N,)

    def bias(self, t: float) -> float:
        """The bias at time t: the mean click probability of synthetic's calibration sample, its
        keys and weights seen at time t, is target_ctr; plus the daily cycle."""
        if t not in self._bias:
            if len(self._bias) > 4096:
                self._bias.clear()
            if self._sample is None:
                self._sample = synthetic._draw(self.info.config, synthetic._STREAM_CALIBRATION, 0,
                                               synthetic.CALIBRATION_ROWS)
            draw = self._sample
            centred = self.centred(self.truth.encode(self.ids(draw["ranks"], t)), draw["present"], draw["dense"], t)
            lo, hi = -40.0, 40.0  # mean sigmoid(b + centred) increases with b: bisection, as synthetic's _fit
            for _ in range(64):
                mid = 0.5 * (lo + hi)
                if synthetic._sigmoid(mid + centred).mean() < self.info.config.target_ctr:
                    lo = mid
                else:
                    hi = mid
            self._bias[t] = 0.5 * (lo + hi) + self.info.drift.ctr_cycle * math.sin(2 * math.pi * t / 24)
        return self._bias[t]

    def centred(self, words: np.ndarray, present: np.ndarray, dense: np.ndarray, t: float) -> np.ndarray:
        """The logits (N,) at time t before the bias: synthetic's `_Truth.components` @ scales
        with every hashed normal x replaced by cos(theta) x + sin(theta) x' (x' from the
        second salts)."""
        truth, drift = self.truth, self.info.drift
        theta = drift.weight_rotation * t / 24
        cos, sin = math.cos(theta), math.sin(theta)

        def normals(w: np.ndarray, salt: np.ndarray, alt: np.ndarray) -> np.ndarray:
            x = synthetic._word_normal(w, salt)
            return x if sin == 0 else cos * x + sin * synthetic._word_normal(w, alt)

        w = normals(words, truth.weight_salt, self.weight_alt)  # (N, S)
        sparse = (w * present) @ truth.importance  # (N,)
        dense_term = np.log(np.fmax(dense, 0.0) + 1.0) @ truth.dense_weights  # (N,)
        pair = np.zeros(len(words))  # (N,)
        for a, b in truth.pairs:
            ua = normals(words[:, a, None], truth.pair_salt[a], self.pair_alt[a])  # (N, K)
            ub = normals(words[:, b, None], truth.pair_salt[b], self.pair_alt[b])  # (N, K)
            both = present[:, a] & present[:, b]  # (N,)
            pair += ((ua * ub).sum(axis=1) * both) / math.sqrt(self.info.config.interaction_dim)
        comp = np.stack([sparse, dense_term, pair], axis=1)  # (N, 3)
        return comp @ np.asarray(truth.scales)  # (N,)

    def part(self, day: str, minute: int, start: int, stop: int) -> bytes:
        """Rows [start, stop) of a split as Criteo text (synthetic.generate's line format)."""
        t = self.info.hours_since_start(day, minute)
        stream = _STREAM_BASE + self.info.day_index(day) * _MINUTES + minute
        sink = io.BytesIO()
        options = pa_csv.WriteOptions(**_CSV_OPTIONS)
        with pa_csv.CSVWriter(sink, synthetic._ARROW_SCHEMA, write_options=options) as writer:
            for lo in range(start, stop, synthetic.DEFAULT_CHUNK_ROWS):
                hi = min(stop, lo + synthetic.DEFAULT_CHUNK_ROWS)
                draw = synthetic._draw(self.info.config, stream, lo, hi)
                words = self.truth.encode(self.ids(draw["ranks"], t))  # (N, S)
                logits = self.logits(words, draw["present"], draw["dense"], t)  # (N,)
                labels = (draw["u_label"] < synthetic._sigmoid(logits)).astype(np.int8)  # (N,)
                writer.write_table(synthetic._table(words, draw["present"], draw["dense"], labels))
        return sink.getvalue()


# --------------------------------------------------------------------------- writing


def _sidecar_url(out: str) -> str:
    return rfs.join(out, SIDECAR)


def _check_sidecar(info: StreamInfo, overwrite: bool) -> bool:
    """Whether the sidecar must be (re)written; refuses a different one unless overwrite."""
    url = _sidecar_url(info.out)
    if not rfs.exists(url):
        return True
    try:
        old = json.loads(rfs.read_bytes(url))
    except json.JSONDecodeError:
        old = None
    new = info.to_json()
    if old == new:
        return False
    if not overwrite:
        changed = sorted(k for k in set(new) | set(old or {}) if (old or {}).get(k) != new.get(k))
        raise FileExistsError(f"{url} describes another stream (differs in {changed}); write this stream "
                              f"elsewhere or pass overwrite=True (--overwrite) to replace it")
    return True


def _write_split(world: _World, day: str, minute: int, complete: bool) -> None:
    info = world.info
    folder = info.split_path(day, minute)
    done = rfs.join(folder, info.donefile)
    fs, folder_path = rfs.resolve(folder)
    if complete:  # rewriting (overwrite): the split reads as not ready until its donefile is back
        fs.rm_file(rfs.resolve(done)[1])
    cuts = [info.rows * i // info.files_per_split for i in range(info.files_per_split + 1)]
    parts = [world.part(day, minute, lo, hi) for lo, hi in zip(cuts, cuts[1:])]
    urls = info.part_paths(day, minute)
    rfs.concurrently([functools.partial(rfs.write_atomic, u, b, overwrite=True) for u, b in zip(urls, parts)])
    keep = {PART_NAME.format(i) for i in range(info.files_per_split)}
    for stale in fs.glob(folder_path.rstrip("/") + "/part-*"):
        if stale.rstrip("/").rsplit("/", 1)[-1] not in keep:
            fs.rm_file(stale)  # a longer earlier run's part; this split has fewer now
    rfs.write_atomic(done, b"", overwrite=True)


def write_stream(
    out: str,
    days: int,
    hours: int,
    rows: int,
    *,
    start_day: str = DEFAULT_START_DAY,
    seed: int = 0,
    split_interval: int = 60,
    layout: str = "hhmm",
    files_per_split: int = 2,
    vocab: int | Sequence[int] = synthetic.DEFAULT_VOCAB,
    drift: StreamDrift | Mapping[str, float] | str | None = DEFAULT_DRIFT,
    overwrite: bool = False,
    **world: Any,
) -> StreamInfo:
    """Writes a drifting stream under `out` (any recps.fs URL); returns what it wrote.

    `days` calendar days from `start_day` (YYYYMMDD), each day's first `hours` hours in splits
    of `split_interval` minutes (a divisor of 60; layouts hh/hive need 60), `rows` rows a
    split in `files_per_split` parts. `vocab`: keys alive at once per slot (one number or 26);
    `drift`: see StreamDrift; `world`: the other SyntheticConfig arguments (zipf_a, missing,
    signal, target_ctr, ...). Raises ConfigError for a bad argument and FileExistsError,
    before writing anything, for a complete split or a different sidecar already there
    unless overwrite=True. Splits are written in time order, each one's donefile last.
    """
    t0 = time.perf_counter()
    info = _plan(str(out), days, hours, rows, start_day, seed, split_interval, layout, files_per_split,
                 vocab, drift, world)
    complete = [rfs.exists(rfs.join(info.split_path(d, m), info.donefile)) for d, m in info.splits]
    if any(complete) and not overwrite:
        done = [path for path, c in zip(info.split_paths(), complete) if c]
        more = f" (and {len(done) - 1} more split(s))" if len(done) > 1 else ""
        raise FileExistsError(f"stream split {done[0]} is complete (its {info.donefile} exists){more}; it is "
                              f"never overwritten: write elsewhere or pass overwrite=True (--overwrite)")
    if _check_sidecar(info, overwrite):
        rfs.write_atomic(_sidecar_url(info.out), json.dumps(info.to_json(), indent=1) + "\n", overwrite=True)
    world_ = _World(info)
    for (day, minute), was_complete in zip(info.splits, complete):
        _write_split(world_, day, minute, was_complete)
        log.debug("stream %s: split %s/%04d written", info.out, day, minute)
    seconds = time.perf_counter() - t0
    total = info.rows * len(info.splits)
    log.info("stream %s: %d splits, %d rows in %.1f s (%.0f rows/s)", info.out, len(info.splits), total,
             seconds, total / max(seconds, 1e-9))
    return info


def load_stream_info(out: str) -> StreamInfo:
    """The StreamInfo of the stream under `out`, from its sidecar."""
    url = _sidecar_url(str(out))
    try:
        meta = json.loads(rfs.read_bytes(url))
    except rfs.FileSystemError:
        raise DataError(f"{url} not found; write_stream writes it before the first split (is {out} a "
                        f"stream root?)") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{url} is not valid JSON ({e}); rewrite the stream") from None
    if meta.get("generator") != "recps.data.generators.drifting" or meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{url} is not a recps.data.generators.drifting sidecar of format_version "
                        f"{FORMAT_VERSION}; rewrite the stream")
    return StreamInfo(
        out=str(out), days=tuple(meta["days"]), hours=meta["hours"], rows=meta["rows"],
        split_interval=meta["split_interval"], layout=meta["layout"], files_per_split=meta["files_per_split"],
        drift=StreamDrift(**meta["drift"]), config=synthetic.SyntheticConfig(**meta["world"]),
        bias=meta["bias"], scales=tuple(meta["scales"]), donefile=meta["donefile"],
    )


# ------------------------------------------------------------------------ the true model


def true_logits(columns: Any, info: StreamInfo, day: str, minute: int, *,
                truth_at: tuple[str, int] | None = None) -> np.ndarray:
    """True logits (N,) float64 of rows read back from split (day, minute) of a stream.

    `columns`: as for `synthetic.true_logits` (a DataFrame read with C* as str, a pyarrow
    Table or a dict of arrays). `truth_at`: (day, minute) of another split whose truth
    (weights, bias) scores the rows instead, e.g. a model frozen then (blank the keys it
    never saw). Raises DataError for a key that split (day, minute) does not hold (rows of
    another split or another stream)."""
    world = _World(info)
    t = info.hours_since_start(day, minute)
    scored_at = t if truth_at is None else info.hours_since_start(*truth_at)
    read = [synthetic._hex_words(synthetic._column(columns, name), name) for name in CRITEO_SPARSE]
    words = np.stack([w for w, _ in read], axis=1)  # (N, S) uint32
    present = np.stack([p for _, p in read], axis=1)  # (N, S) bool
    with np.errstate(over="ignore"):
        keys = world.truth.decode(words).astype(np.int64)  # (N, S)
    ranks = (((keys - 1) % world.vocab + 1) * present).astype(np.uint32)  # (N, S), 0 = missing
    bad = np.argwhere(present & ((keys < 1) | (world.ids(ranks, t) != keys)))
    if len(bad):
        row, s = (int(x) for x in bad[0])
        raise DataError(f"{CRITEO_SPARSE[s]} row {row} holds {int(words[row, s]):08x}, no key of split "
                        f"{day}/{minute:04d} of stream {info.out} (seed={info.seed}); pass the split these "
                        f"rows came from")
    return world.logits(words, present, synthetic._dense_matrix(columns), scored_at)  # (N,)


def true_probs(columns: Any, info: StreamInfo, day: str, minute: int, *,
               truth_at: tuple[str, int] | None = None) -> np.ndarray:
    """sigmoid(true_logits(...)): the click probabilities (N,) of a split's rows."""
    return synthetic._sigmoid(true_logits(columns, info, day, minute, truth_at=truth_at))


# ---------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recps.data.generators drifting",
        description="Write a drifting, time-partitioned synthetic click stream (Criteo text, a "
        "_SUCCESS donefile per split, <out>/_stream.json describing it).",
    )
    parser.add_argument("--days", type=int, required=True, help="calendar days from --start-day")
    parser.add_argument("--hours", type=int, required=True, help="each day's first HOURS hours (<= 24)")
    parser.add_argument("--rows", type=int, required=True, help="rows a split (all its parts)")
    parser.add_argument("--out", required=True, help="stream root: a path or any fsspec URL")
    parser.add_argument("--start-day", default=DEFAULT_START_DAY, help="first day, YYYYMMDD")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split-interval", type=int, default=60, help="minutes a split (a divisor of 60)")
    parser.add_argument("--layout", choices=LAYOUTS, default="hhmm")
    parser.add_argument("--files-per-split", type=int, default=2)
    parser.add_argument("--vocab", default=str(synthetic.DEFAULT_VOCAB),
                        help="keys alive at once per slot: one number or 26")
    parser.add_argument("--zipf-a", default=str(synthetic.DEFAULT_ZIPF_A), help="Zipf exponent: one number or 26")
    parser.add_argument("--missing", type=float, default=synthetic.DEFAULT_MISSING, help="probability a field is empty")
    parser.add_argument("--signal", type=float, default=synthetic.DEFAULT_SIGNAL, help="std of the true logit")
    parser.add_argument("--ctr", type=float, default=synthetic.DEFAULT_TARGET_CTR, help="target click rate")
    parser.add_argument("--format", choices=("text",), default="text", dest="fmt", help="streams are Criteo text")
    parser.add_argument(
        "--drift", default=None,
        help="'none', or name=value pairs changing the defaults "
        f"({','.join(f'{k}={v}' for k, v in DEFAULT_DRIFT.to_dict().items())})",
    )
    parser.add_argument("--overwrite", action="store_true", help="rewrite complete splits and the sidecar")
    args = parser.parse_args(argv)
    quiet_libraries()  # the libraries' import-time lines a user cannot act on
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        info = write_stream(
            args.out, args.days, args.hours, args.rows, start_day=args.start_day, seed=args.seed,
            split_interval=args.split_interval, layout=args.layout, files_per_split=args.files_per_split,
            vocab=args.vocab, drift=args.drift, overwrite=args.overwrite, zipf_a=args.zipf_a,
            missing=args.missing, signal=args.signal, target_ctr=args.ctr,
        )
    except (ConfigError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{info.out}: {len(info.days)} days x {len(info.minutes)} splits of {info.rows} rows "
        f"({info.files_per_split} parts each), drift {info.drift.to_dict()}; described in {_sidecar_url(info.out)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
