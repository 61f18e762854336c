"""Synthetic Criteo-like click data with a planted logistic ground truth.

Rows follow Criteo's display-ads schema (`Schema.criteo()`): a 0/1 label, 13 integer
counts I1..I13 and 26 categorical slots C1..C26 holding 8-hex-character strings; an
empty field is a missing value. Text files are TAB-separated without a header, exactly
like Criteo's raw files, so the Criteo reader path reads them; Parquet files hold the
same columns (label int32, I* nullable int64, C* nullable string).

The world (what the data means) is fixed by `SyntheticConfig` and its seed:

- keys: slot s draws a rank r in 1..V_s from a bounded power law (Zipf, exponent a_s)
  by inverse CDF on a continuous rank, floored, so no V-sized table is ever built
  (V up to 2**32 - 1; 10**9 costs the same as 10). The string written is the word
  perm_s(r) in hex, perm_s a seeded bijection of 32-bit words: distinct ranks never
  collide and a file's strings decode back to ranks (`decode_ranks`, `true_logits`).
- truth: logit = bias
      + c_sparse * sum_s  imp_s * w_s(r_s)                  (first order, present slots)
      + c_dense  * sum_j  v_j * log(1 + I_j)                (present dense counts)
      + c_pair   * sum_(a,b) <u_a(r_a), u_b(r_b)> / sqrt(K) (planted pairwise term)
  w_s(r), the K components of u_s(r), and v_j are standard normals: a 16-bit hash of
  (seed, slot, word) picks one of 2**16 normal quantiles. imp_s in [0.3, 1) weighs slots
  unequally. The pairwise term is rank K (`interaction_dim`) between the slot pairs in
  `interactions` (default C1xC2 and C3xC4): what an FM / DeepFM factorisation represents
  and a first-order model cannot. A missing field adds 0 (the reader's missing dense 0
  gives log(1 + 0) = 0 too).
- calibration: on a fixed calibration sample of the same world (`CALIBRATION_ROWS`) the
  three c_* scale their terms to variance shares (`shares`) of `signal`**2, then the bias
  is solved so the mean click probability is `target_ctr`. `signal` sets how separable
  the classes are: the defaults give a best reachable AUC of about 0.78 and a CTR of 0.25.
- labels: label = 1[u < sigmoid(logit)], u uniform.

Learnability: a model estimates one weight per key, so the data a world needs grows
with its keys. The defaults (100 keys a slot, Zipf 1.2) are learnable from ~200k rows
(a first-order logistic regression on one-hot keys comes within ~0.02 AUC of the best
reachable AUC; the rest is the pairwise term). With 10**4 keys a slot, 200k rows leave
the tail keys unlearnt (about 0.06 AUC short); benchmarks use 10**6 and more for load.

The best reachable AUC of a file is the AUC of the true probabilities against its
sampled labels; `generate` computes it (exactly up to `exact_auc_rows` rows, else from a
2**20-bin histogram of the logits, off by ~1e-7), logs it and writes it to a sidecar
`<file>.meta.json` with everything `true_logits` needs and the reader schema.

Randomness comes in blocks of `BLOCK_ROWS` rows, each from its own
`Generator(PCG64(SeedSequence((seed, stream, block))))`: output bytes depend on
(config, stream, rows, fmt) only, never on `chunk_rows`, and a row range can be made
without the rows before it. Memory stays O(chunk_rows) (about 1.5 KB a row in flight)
whatever the file size. Same numpy/pyarrow versions give the same bytes on any machine
(Parquet files name the pyarrow version that wrote them).

Writing: Arrow's CSV writer (TAB, no header, no quoting) is ~60x faster than pandas'
`to_csv` here (measured 0.33 s against 10.4 s for 200k rows); it runs in a writer thread
with the GIL released while numpy draws the next chunk.

Shape letters: N rows in a chunk, S = 26 sparse slots, J = 13 dense columns,
P slot pairs, K = interaction_dim.

Example:
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> info = generate(os.path.join(d, "tiny.txt"), 1000, seed=1, vocab=100)
    >>> info.rows, 0.5 < info.best_auc < 1.0, 0.1 < info.ctr < 0.4
    (1000, True, True)
    >>> load_info(info.path).best_auc == info.best_auc
    True
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import os
import statistics
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import torch

from recps import quiet_libraries
from recps.data.schema import CRITEO_DENSE, CRITEO_SPARSE, Schema
from recps.errors import ConfigError, DataError
from recps.metrics import group_auc, histogram_auc
from recps.splitmix import splitmix64_numpy

__all__ = [
    "BLOCK_ROWS",
    "DEFAULT_VOCAB",
    "DEFAULT_ZIPF_A",
    "SyntheticConfig",
    "GeneratorInfo",
    "generate",
    "generate_split",
    "ensure_split",
    "load_info",
    "true_logits",
    "true_probs",
    "decode_ranks",
    "main",
]

log = logging.getLogger(__name__)

BLOCK_ROWS = 4096  # randomness granularity; part of the output's definition, never change lightly
DEFAULT_CHUNK_ROWS = 16 * BLOCK_ROWS  # rows formatted and written at once (65,536, ~100 MB)
DEFAULT_VOCAB = 100  # learnable from 200k rows; benchmarks ask for 10**6 and more
DEFAULT_ZIPF_A = 1.2
DEFAULT_SIGNAL = 1.2  # best reachable AUC ~0.78 with the other defaults
DEFAULT_TARGET_CTR = 0.25
DEFAULT_MISSING = 0.05
DEFAULT_INTERACTIONS = (("C1", "C2"), ("C3", "C4"))
DEFAULT_SHARES = (0.8, 0.1, 0.1)  # variance of (first-order sparse, dense, pairwise)
CALIBRATION_ROWS = 8 * BLOCK_ROWS  # 32,768: CTR lands within ~0.002 of target_ctr
EXACT_AUC_ROWS = 5_000_000  # (9 bytes a row held) above this, best AUC comes from a logit histogram (O(1) memory)
META_SUFFIX = ".meta.json"
FORMAT_VERSION = 1

_MAX_VOCAB = 2**32 - 1  # ranks live in 32-bit words (the 8 hex chars)
_STREAM_CALIBRATION = 2**31  # the calibration sample's stream, apart from user streams
_HIST_BINS = 2**20
_HIST_LOGIT = 30.0  # histogram covers logits in [-30, 30]; beyond that sigmoid is 0 or 1
_WRITE_TIMEOUT_S = 600.0  # one chunk; a healthy disk takes well under a second
_EXT = {"text": ".txt", "parquet": ".parquet"}

_S = len(CRITEO_SPARSE)
_J = len(CRITEO_DENSE)

# Dense counts are floor(exp(mu + sigma * z)) - 1, clipped at 0: heavy-tailed counts
# with many zeros, loosely shaped like Criteo's I1..I13.
_DENSE_MU = np.array([0.7, 1.5, 1.8, 1.5, 7.5, 3.5, 2.0, 2.5, 4.0, 0.5, 1.3, 0.5, 2.0])
_DENSE_SIGMA = np.array([1.0, 1.8, 1.3, 1.0, 1.8, 1.6, 1.4, 1.2, 1.4, 0.6, 0.9, 1.0, 1.2])
_DENSE_MAX = 10**9

# Purposes of the hashed quantities; each gets its own key family.
_P_HEX, _P_WEIGHT, _P_PAIR, _P_DENSE, _P_IMPORTANCE = 1, 2, 3, 4, 5


# --------------------------------------------------------------------------- hashing


def _family(seed: int, purpose: int, index: np.ndarray) -> np.ndarray:
    """One uint64 key per index (slot, column or slot*K+component) of a purpose."""
    index = np.atleast_1d(np.asarray(index, dtype=np.uint64))
    with np.errstate(over="ignore"):
        base = splitmix64_numpy(np.array([seed], dtype=np.uint64) ^ np.uint64(purpose << 56))
        return splitmix64_numpy(base ^ (index << np.uint64(32)))


@functools.lru_cache(maxsize=1)
def _normal_table() -> np.ndarray:
    """(2**16,) standard-normal quantiles at (i + 0.5) / 2**16; pure-Python arithmetic, so
    the same on every machine."""
    nd = statistics.NormalDist()
    return np.array([nd.inv_cdf((i + 0.5) / 2**16) for i in range(2**16)])


def _normal(z: np.ndarray) -> np.ndarray:
    """Standard normals from uint64 hashes: the top 16 bits pick a quantile (|value| <= 4.3)."""
    return _normal_table()[z >> np.uint64(48)]


_FMIX_C1, _FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35
_FMIX_I1, _FMIX_I2 = pow(_FMIX_C1, -1, 2**32), pow(_FMIX_C2, -1, 2**32)


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finaliser, a bijection of uint32."""
    with np.errstate(over="ignore"):
        h = h ^ (h >> np.uint32(16))
        h = h * np.uint32(_FMIX_C1)
        h = h ^ (h >> np.uint32(13))
        h = h * np.uint32(_FMIX_C2)
        return h ^ (h >> np.uint32(16))


def _fmix32_inverse(h: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = h ^ (h >> np.uint32(16))
        h = h * np.uint32(_FMIX_I2)
        h = h ^ (h >> np.uint32(13)) ^ (h >> np.uint32(26))
        h = h * np.uint32(_FMIX_I1)
        return h ^ (h >> np.uint32(16))


# ------------------------------------------------------------------------ the world


def _per_slot(value: Any, name: str, cast: type) -> tuple:
    """One number, or one per slot C1..C26 (a sequence or a comma-separated string), as a
    tuple of 26 numbers of type `cast` (int or float)."""
    if isinstance(value, str):
        items: list[Any] = [p.strip() for p in value.split(",") if p.strip()]
    elif isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        items = [value]
    else:
        try:
            items = list(value)
        except TypeError:
            raise ConfigError(
                f"synthetic {name}={value!r} is neither a number nor a list; give one number "
                f"or {_S} (one per slot C1..C{_S})"
            ) from None
    if len(items) not in (1, _S):
        raise ConfigError(
            f"synthetic {name} has {len(items)} values; give one number or {_S} (one per slot "
            f"C1..C{_S})"
        )
    out = []
    for item in items:
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            out.append(cast(item))
            continue
        try:
            x = float(item)
        except (TypeError, ValueError):
            raise ConfigError(f"synthetic {name} value {item!r} is not a number; fix it") from None
        if cast is int and not (math.isfinite(x) and x == int(x)):
            raise ConfigError(f"synthetic {name} value {item!r} is not a whole number of keys")
        out.append(cast(x))
    return tuple(out) if len(out) == _S else tuple(out) * _S


@dataclass(frozen=True)
class SyntheticConfig:
    """The planted world: key distributions, missing rates and the true model.

    Scalars given for per-slot or per-column fields are broadcast; after construction
    every field has its full, validated shape.

    Attributes:
        seed: fixes the world (key strings, weights) and, with the stream, the rows.
        vocab: (S,) distinct keys per slot, 1..2**32-1.
        zipf_a: (S,) power-law exponent per slot (>= 0; 0 is uniform, ~1.1 is web-like).
        missing: {column: probability} for I1..I13 and C1..C26 that a field is empty.
        signal: std of the planted logit before the bias (larger -> higher best AUC).
        target_ctr: mean click probability the bias is calibrated to.
        interactions: (P, 2) slot-name pairs carrying the planted rank-K interaction.
        interaction_dim: K.
        shares: relative variance shares of (first-order sparse, dense, pairwise) in
            signal**2 (normalised to sum 1 when calibrating).
    """

    seed: int = 0
    vocab: Any = DEFAULT_VOCAB
    zipf_a: Any = DEFAULT_ZIPF_A
    missing: Any = DEFAULT_MISSING
    signal: float = DEFAULT_SIGNAL
    target_ctr: float = DEFAULT_TARGET_CTR
    interactions: Any = DEFAULT_INTERACTIONS
    interaction_dim: int = 4
    shares: Any = DEFAULT_SHARES

    def __post_init__(self) -> None:
        if not isinstance(self.seed, (int, np.integer)) or not 0 <= int(self.seed) < 2**63:
            raise ConfigError(f"synthetic seed={self.seed!r}; use an integer in [0, 2**63)")
        object.__setattr__(self, "seed", int(self.seed))
        vocab = _per_slot(self.vocab, "vocab", int)
        bad = [(c, v) for c, v in zip(CRITEO_SPARSE, vocab) if not 1 <= v <= _MAX_VOCAB]
        if bad:
            raise ConfigError(
                f"synthetic vocab {dict(bad)} out of range; each slot needs 1..{_MAX_VOCAB} keys "
                f"(ranks are written as 8 hex characters)"
            )
        object.__setattr__(self, "vocab", vocab)
        zipf_a = _per_slot(self.zipf_a, "zipf_a", float)
        bad = [(c, a) for c, a in zip(CRITEO_SPARSE, zipf_a) if not (a >= 0 and math.isfinite(a))]
        if bad:
            raise ConfigError(f"synthetic zipf_a {dict(bad)} invalid; use finite exponents >= 0")
        object.__setattr__(self, "zipf_a", zipf_a)
        object.__setattr__(self, "missing", self._missing(self.missing))
        if not (self.signal >= 0 and math.isfinite(self.signal)):
            raise ConfigError(f"synthetic signal={self.signal!r}; use a finite value >= 0")
        object.__setattr__(self, "signal", float(self.signal))
        if not 0 < self.target_ctr < 1:
            raise ConfigError(f"synthetic target_ctr={self.target_ctr!r}; use a value in (0, 1)")
        object.__setattr__(self, "target_ctr", float(self.target_ctr))
        pairs = tuple(tuple(p) for p in (self.interactions or ()))
        for p in pairs:
            if len(p) != 2 or p[0] == p[1] or not set(p) <= set(CRITEO_SPARSE):
                raise ConfigError(
                    f"synthetic interactions entry {list(p)!r} is not a pair of two different "
                    f"slots among C1..C{_S}"
                )
        object.__setattr__(self, "interactions", pairs)
        if int(self.interaction_dim) < 1:
            raise ConfigError(f"synthetic interaction_dim={self.interaction_dim!r}; use >= 1")
        object.__setattr__(self, "interaction_dim", int(self.interaction_dim))
        shares = tuple(float(s) for s in self.shares)
        if len(shares) != 3 or min(shares) < 0 or sum(shares) <= 0:
            raise ConfigError(
                f"synthetic shares={self.shares!r}; give 3 non-negative variance shares "
                f"(sparse, dense, pairwise) with a positive sum"
            )
        object.__setattr__(self, "shares", shares)  # normalised where used, so JSON round-trips

    @staticmethod
    def _missing(value: Any) -> dict[str, float]:
        columns = CRITEO_DENSE + CRITEO_SPARSE
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(columns))
            if unknown:
                raise ConfigError(
                    f"synthetic missing names unknown columns {unknown}; use I1..I{_J}, C1..C{_S}"
                )
            rates = {c: float(value.get(c, 0.0)) for c in columns}
        else:
            rates = {c: float(value) for c in columns}
        bad = {c: r for c, r in rates.items() if not 0 <= r < 1}
        if bad:
            raise ConfigError(f"synthetic missing rates {bad} out of range; use values in [0, 1)")
        return rates

    def to_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "vocab": list(self.vocab),
            "zipf_a": list(self.zipf_a),
            "missing": dict(self.missing),
            "signal": self.signal,
            "target_ctr": self.target_ctr,
            "interactions": [list(p) for p in self.interactions],
            "interaction_dim": self.interaction_dim,
            "shares": list(self.shares),
        }


def _salts(seed: int, purpose: int, count: int) -> np.ndarray:
    """(count,) uint32 salts of one purpose."""
    return (_family(seed, purpose, np.arange(count)) >> np.uint64(32)).astype(np.uint32)


def _word_normal(words: np.ndarray, salt: np.ndarray) -> np.ndarray:
    """N(0, 1) per (word, salt): a 16-bit hash picks a normal quantile. uint32 in, float64 out."""
    with np.errstate(over="ignore"):
        return _normal_table()[_fmix32(words ^ salt) >> np.uint32(16)]


@dataclass(frozen=True)
class _Truth:
    """The calibrated true model: the config's hashed parameters plus the fitted scalars.

    A key's parameters hash from its written word (rank -> word is a bijection per slot),
    so generation computes them from the words it writes anyway.
    """

    config: SyntheticConfig
    bias: float
    scales: tuple[float, float, float]  # (sparse, dense, pairwise)

    def __post_init__(self) -> None:
        c = self.config
        k = c.interaction_dim
        slots = np.arange(_S)
        put = functools.partial(object.__setattr__, self)
        put("hex_salt", _salts(c.seed, _P_HEX, _S))  # (S,)
        put("weight_salt", _salts(c.seed, _P_WEIGHT, _S))  # (S,)
        imp = (_family(c.seed, _P_IMPORTANCE, slots) >> np.uint64(11)).astype(np.float64) * 2.0**-53
        put("importance", 0.3 + 0.7 * imp)  # (S,) in [0.3, 1)
        put("dense_weights", _normal(_family(c.seed, _P_DENSE, np.arange(_J))))  # (J,)
        put("pair_salt", _salts(c.seed, _P_PAIR, _S * k).reshape(_S, k))  # (S, K)
        index = {name: i for i, name in enumerate(CRITEO_SPARSE)}
        put("pairs", [(index[a], index[b]) for a, b in c.interactions])  # (P, 2)

    def components(self, words: np.ndarray, present: np.ndarray, dense: np.ndarray) -> np.ndarray:
        """Unscaled logit terms (N, 3): first-order sparse, dense, pairwise.

        words: (N, S) uint32 as written; present: (N, S) bool; dense: (N, J) float64
        counts, NaN = missing.
        """
        w = _word_normal(words, self.weight_salt)  # (N, S)
        sparse = (w * present) @ self.importance  # (N,)
        t = np.log(np.fmax(dense, 0.0) + 1.0)  # (N, J); fmax turns NaN (missing) into 0
        dense_term = t @ self.dense_weights  # (N,)
        pair = np.zeros(len(words))  # (N,)
        for a, b in self.pairs:  # P is a handful; each line is vectorized over rows
            ua = _word_normal(words[:, a, None], self.pair_salt[a])  # (N, K)
            ub = _word_normal(words[:, b, None], self.pair_salt[b])  # (N, K)
            both = present[:, a] & present[:, b]  # (N,)
            pair += ((ua * ub).sum(axis=1) * both) / math.sqrt(self.config.interaction_dim)
        return np.stack([sparse, dense_term, pair], axis=1)  # (N, 3)

    def logits(self, words: np.ndarray, present: np.ndarray, dense: np.ndarray) -> np.ndarray:
        """True logits (N,) float64."""
        return self.bias + self.components(words, present, dense) @ np.asarray(self.scales)

    def encode(self, ranks: np.ndarray) -> np.ndarray:
        """(N, S) ranks -> (N, S) uint32 words written as hex (meaningless where rank 0)."""
        with np.errstate(over="ignore"):
            return _fmix32(ranks + self.hex_salt)

    def decode(self, words: np.ndarray) -> np.ndarray:
        """Inverse of `encode`: (N, S) uint32 words -> ranks."""
        with np.errstate(over="ignore"):
            return _fmix32_inverse(words) - self.hex_salt


_CALIBRATED: dict[str, _Truth] = {}  # config JSON -> truth; a split calibrates once


def _calibrate(config: SyntheticConfig) -> _Truth:
    """Fits the term scales and the bias on the calibration sample (deterministic)."""
    key = json.dumps(config.to_dict(), sort_keys=True)
    if key not in _CALIBRATED:
        if len(_CALIBRATED) > 64:
            _CALIBRATED.clear()
        _CALIBRATED[key] = _fit(config)
    return _CALIBRATED[key]


def _fit(config: SyntheticConfig) -> _Truth:
    truth = _Truth(config, 0.0, (1.0, 1.0, 1.0))
    draw = _draw(config, _STREAM_CALIBRATION, 0, CALIBRATION_ROWS)
    comp = truth.components(truth.encode(draw["ranks"]), draw["present"], draw["dense"])  # (N, 3)
    std = comp.std(axis=0)  # (3,)
    total = sum(config.shares)
    scales = tuple(
        float(config.signal * math.sqrt(share / total) / s) if s > 0 else 0.0
        for share, s in zip(config.shares, std)
    )
    centred = comp @ np.asarray(scales)  # (N,), the logit before the bias
    # mean sigmoid(b + centred) is increasing in b: bisection to target_ctr.
    lo, hi = -40.0, 40.0
    for _ in range(64):
        mid = 0.5 * (lo + hi)
        if _sigmoid(mid + centred).mean() < config.target_ctr:
            lo = mid
        else:
            hi = mid
    return _Truth(config, 0.5 * (lo + hi), scales)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # no overflow warnings for large |x|


# ---------------------------------------------------------------------------- rows


def _fill_block(seed: int, stream: int, block: int, out: tuple[np.ndarray, ...]) -> None:
    """Writes the raw draws of one block into `out` views, always in this order:
    u_key (B, S) f64, u_missing (B, J+S) f32, z_dense (B, J) f64, u_label (B,) f64."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence((seed, stream, block))))
    u_key, u_missing, z_dense, u_label = out
    rng.random(out=u_key)
    rng.random(out=u_missing, dtype=np.float32)
    rng.standard_normal(out=z_dense)
    rng.random(out=u_label)


def _zipf_ranks(u: np.ndarray, vocab: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Inverse CDF of density ~ x**-a on [1, V+1), floored: ranks (N, S) uint32 in 1..V.

    P(rank = r) = integral of x**-a over [r, r+1), i.e. ~ r**-a for large r.
    """
    top = vocab + 1.0  # (S,)
    is_log = np.abs(1.0 - a) < 1e-9  # a == 1: the CDF is log(x) / log(V+1)
    one_minus = np.where(is_log, 1.0, 1.0 - a)  # (S,)
    x = u * (top**one_minus - 1.0)  # (N, S)
    x += 1.0
    np.power(x, 1.0 / one_minus, out=x)  # continuous ranks in [1, V+1)
    if is_log.any():
        x[:, is_log] = np.exp(u[:, is_log] * np.log(top[is_log]))
    np.floor(x, out=x)
    np.minimum(x, vocab, out=x)  # x == V+1 only by rounding
    return x.astype(np.uint32)


def _draw(config: SyntheticConfig, stream: int, start: int, stop: int) -> dict[str, np.ndarray]:
    """Rows [start, stop) of a stream: ranks (N, S) uint32 (0 = missing), present (N, S)
    bool, dense (N, J) float64 counts (NaN = missing) and label uniforms u_label (N,)."""
    b0, b1 = start // BLOCK_ROWS, -(-stop // BLOCK_ROWS)
    n = (b1 - b0) * BLOCK_ROWS
    buffers = (
        np.empty((n, _S)), np.empty((n, _J + _S), dtype=np.float32), np.empty((n, _J)), np.empty(n)
    )
    for b in range(b0, b1):
        rows = slice((b - b0) * BLOCK_ROWS, (b - b0 + 1) * BLOCK_ROWS)
        _fill_block(config.seed, stream, b, tuple(x[rows] for x in buffers))
    lo, hi = start - b0 * BLOCK_ROWS, stop - b0 * BLOCK_ROWS
    u_key, u_missing, z_dense, u_label = (x[lo:hi] for x in buffers)
    ranks = _zipf_ranks(u_key, np.asarray(config.vocab, dtype=np.float64), np.asarray(config.zipf_a))
    rates = np.array([config.missing[c] for c in CRITEO_DENSE + CRITEO_SPARSE])  # (J+S,)
    missing = u_missing < rates  # (N, J+S)
    present = ~missing[:, _J:]  # (N, S)
    ranks *= present
    dense = np.exp(_DENSE_MU + _DENSE_SIGMA * z_dense)  # (N, J)
    np.floor(dense, out=dense)
    dense -= 1.0
    np.clip(dense, 0, _DENSE_MAX, out=dense)
    np.copyto(dense, np.nan, where=missing[:, :_J])
    return {"ranks": ranks, "present": present, "dense": dense, "u_label": u_label}


# ----------------------------------------------------------------------- formatting

_HEX_PAIRS = np.array(
    [ord("0123456789abcdef"[i >> 4]) | (ord("0123456789abcdef"[i & 15]) << 8) for i in range(256)],
    dtype=np.uint16,
)  # byte -> its two hex characters, as a little-endian uint16


def _hex_columns(words: np.ndarray, present: np.ndarray) -> list[pa.Array]:
    """(N, S) uint32 words -> S pyarrow string arrays of 8 hex chars, null where not present.

    Built straight from buffers: the characters of one slot are one (N, 8) byte block.
    """
    n = len(words)
    big_endian = np.ascontiguousarray(words.T).astype(">u4")  # (S, N), most significant byte first
    chars = _HEX_PAIRS[big_endian.view(np.uint8).reshape(_S, n, 4)]  # (S, N, 4) uint16 = (S, N, 8) chars
    offsets = pa.py_buffer(np.arange(0, 8 * n + 1, 8, dtype=np.int32))  # (N+1,)
    valid = np.ascontiguousarray(present.T)  # (S, N)
    nulls = n - np.count_nonzero(valid, axis=1)  # (S,)
    bitmaps = np.packbits(valid, axis=1, bitorder="little")  # (S, ceil(N/8))
    return [
        pa.StringArray.from_buffers(
            n, offsets, pa.py_buffer(chars[s]), pa.py_buffer(bitmaps[s]) if nulls[s] else None, int(nulls[s])
        )
        for s in range(_S)
    ]


_ARROW_SCHEMA = pa.schema(
    [pa.field("label", pa.int32(), nullable=False)]
    + [pa.field(c, pa.int64()) for c in CRITEO_DENSE]
    + [pa.field(c, pa.string()) for c in CRITEO_SPARSE]
)


def _table(words: np.ndarray, present: np.ndarray, dense: np.ndarray, labels: np.ndarray) -> pa.Table:
    """One chunk as an Arrow table in file column order (label, I1..I13, C1..C26)."""
    dense_missing = np.ascontiguousarray(np.isnan(dense).T)  # (J, N)
    dense_int = np.ascontiguousarray(np.nan_to_num(dense, nan=0.0).T).astype(np.int64)  # (J, N)
    arrays = [pa.array(labels.astype(np.int32))]
    arrays += [pa.array(dense_int[j], mask=dense_missing[j]) for j in range(_J)]
    arrays += _hex_columns(words, present)
    return pa.Table.from_arrays(arrays, schema=_ARROW_SCHEMA)


# ------------------------------------------------------------------------- the AUC


class _AucAccumulator:
    """AUC of probabilities against labels, fed chunk by chunk.

    Exact (rank statistic with ties at half weight, as sklearn) while the rows fit under
    `exact_rows`; then it folds what it holds into a logit histogram of 2**20 bins, whose
    only error comes from distinct logits that share a bin (counted as ties).
    """

    def __init__(self, exact_rows: int) -> None:
        self.exact_rows = exact_rows
        self.logits: list[np.ndarray] = []
        self.labels: list[np.ndarray] = []
        self.held = 0
        self.hist: np.ndarray | None = None  # (2, bins): negatives, positives

    def add(self, logits: np.ndarray, labels: np.ndarray) -> None:
        if self.hist is None and self.held + len(logits) <= self.exact_rows:
            self.logits.append(logits)
            self.labels.append(labels)
            self.held += len(logits)
            return
        if self.hist is None:
            self.hist = np.zeros((2, _HIST_BINS), dtype=np.int64)
            for lg, lb in zip(self.logits, self.labels):
                self._fold(lg, lb)
            self.logits, self.labels = [], []
        self._fold(logits, labels)

    def _fold(self, logits: np.ndarray, labels: np.ndarray) -> None:
        pos = (np.clip(logits, -_HIST_LOGIT, _HIST_LOGIT) + _HIST_LOGIT) * (_HIST_BINS / (2 * _HIST_LOGIT))
        idx = np.minimum(pos.astype(np.int64), _HIST_BINS - 1)
        self.hist += np.bincount(idx * 2 + labels.astype(np.int64), minlength=2 * _HIST_BINS).reshape(-1, 2).T

    @property
    def method(self) -> str:
        return "exact" if self.hist is None else f"histogram({_HIST_BINS} logit bins)"

    def value(self) -> float:
        if self.hist is None:
            logits = np.concatenate(self.logits) if self.logits else np.zeros(0)
            labels = np.concatenate(self.labels) if self.labels else np.zeros(0, dtype=np.int8)
            return _exact_auc(_sigmoid(logits), labels)
        neg, pos = torch.from_numpy(self.hist.astype(np.float64))  # (bins,) each, ascending logits
        return histogram_auc(pos, neg)


def _exact_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """AUC of scores (N,) against 0/1 labels (N,), ties counted 1/2 (as sklearn's
    roc_auc_score); NaN with one class. recps.metrics' exact `group_auc`, all rows one group."""
    if len(labels) == 0:
        return float("nan")
    preds = torch.from_numpy(np.array(scores, dtype=np.float64))  # (N,)
    y = torch.from_numpy(np.array(labels, dtype=np.float64))  # (N,)
    return float(group_auc(torch.zeros(len(y), dtype=torch.int64), preds, y)["auc"][0])


# ------------------------------------------------------------------------ the files


@dataclass(frozen=True)
class GeneratorInfo:
    """What `generate` wrote and what the data means; also the sidecar JSON's content.

    Attributes:
        path: the data file. meta_path: its `<path>.meta.json` sidecar.
        fmt: "text" (Criteo TAB) or "parquet". rows, stream: as asked.
        config: the world. bias, scales: the calibrated true model (see module doc).
        best_auc: AUC of the true probabilities against the file's labels.
        best_auc_method: "exact" or "histogram(...)". ctr: mean label of the file.
        seconds: generation wall time.
    """

    path: str
    fmt: str
    rows: int
    stream: int
    config: SyntheticConfig
    bias: float
    scales: tuple[float, float, float]
    best_auc: float
    ctr: float
    best_auc_method: str = "exact"
    seconds: float = 0.0
    schema: dict = field(default_factory=dict)

    @property
    def meta_path(self) -> str:
        return self.path + META_SUFFIX

    @property
    def paths(self) -> tuple[str, str]:
        return (self.path, self.meta_path)

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def vocab(self) -> tuple[int, ...]:
        return self.config.vocab

    def truth(self) -> _Truth:
        return _Truth(self.config, self.bias, self.scales)

    def to_json(self) -> dict[str, Any]:
        return {
            "generator": "recps.data.generators.ctr",
            "format_version": FORMAT_VERSION,
            "file": os.path.basename(self.path),
            "format": self.fmt,
            "rows": self.rows,
            "stream": self.stream,
            **self.config.to_dict(),
            "bias": self.bias,
            "scales": list(self.scales),
            "best_auc": self.best_auc,
            "best_auc_method": self.best_auc_method,
            "ctr": self.ctr,
            "seconds": self.seconds,
            "schema": self.schema,
        }


def _schema_dict(fmt: str) -> dict[str, Any]:
    """The reader schema for a generated file, as `Schema.from_config` accepts it."""
    schema = Schema.criteo() if fmt == "text" else Schema.criteo(format="parquet", separator=",")
    out = {f.name: getattr(schema, f.name) for f in dataclasses.fields(schema) if f.name != "extra"}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def load_info(path: str | os.PathLike) -> GeneratorInfo:
    """Reads the sidecar of a generated file (give the data file or the .meta.json)."""
    path = str(path)
    meta_path = path if path.endswith(META_SUFFIX) else path + META_SUFFIX
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise DataError(
            f"{meta_path} not found; it is written next to every file recps.data.generators.ctr "
            f"generates (regenerate the file)"
        ) from None
    except json.JSONDecodeError as e:
        raise DataError(f"{meta_path} is not valid JSON ({e}); regenerate the file") from None
    if meta.get("generator") != "recps.data.generators.ctr" or meta.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{meta_path} is not a recps.data.generators.ctr sidecar of format_version "
            f"{FORMAT_VERSION}; regenerate the file"
        )
    config = SyntheticConfig(**{f.name: meta[f.name] for f in dataclasses.fields(SyntheticConfig)})
    return GeneratorInfo(
        path=meta_path[: -len(META_SUFFIX)],
        fmt=meta["format"],
        rows=meta["rows"],
        stream=meta["stream"],
        config=config,
        bias=meta["bias"],
        scales=tuple(meta["scales"]),
        best_auc=meta["best_auc"],
        ctr=meta["ctr"],
        best_auc_method=meta["best_auc_method"],
        seconds=meta["seconds"],
        schema=meta["schema"],
    )


def _format_and_write(writer: Any, words: np.ndarray, present: np.ndarray, dense: np.ndarray, labels: np.ndarray) -> None:
    writer.write_table(_table(words, present, dense, labels))


def _wait_write(pending: Future | None, path: str) -> None:
    if pending is None:
        return
    try:
        pending.result(timeout=_WRITE_TIMEOUT_S)
    except FutureTimeout:
        raise DataError(
            f"writing one chunk to {path} took over {_WRITE_TIMEOUT_S} s; check the disk or "
            f"lower chunk_rows"
        ) from None


def write_json_atomic(path: str, obj: Any) -> None:
    """`obj` as JSON at `path`, written to a temporary and renamed into place (removed on failure)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def generate(
    path: str | os.PathLike,
    rows: int,
    *,
    seed: int = 0,
    vocab: int | Sequence[int] = DEFAULT_VOCAB,
    zipf_a: float | Sequence[float] = DEFAULT_ZIPF_A,
    missing: float | Mapping[str, float] = DEFAULT_MISSING,
    signal: float = DEFAULT_SIGNAL,
    target_ctr: float = DEFAULT_TARGET_CTR,
    interactions: Sequence[Sequence[str]] = DEFAULT_INTERACTIONS,
    interaction_dim: int = 4,
    shares: Sequence[float] = DEFAULT_SHARES,
    fmt: str = "text",
    stream: int = 0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    exact_auc_rows: int = EXACT_AUC_ROWS,
    config: SyntheticConfig | None = None,
) -> GeneratorInfo:
    """Writes `rows` rows of the world to `path` (and `<path>.meta.json`), streaming.

    The world comes from `config` when given, else from the keyword arguments (see
    `SyntheticConfig`). `stream` selects an independent row sequence of the same world
    (train 0, test 1). Output bytes depend on (world, stream, rows, fmt) only. Files are
    written under a temporary name and renamed, data first, sidecar last, so a present
    sidecar means a complete file.
    """
    if config is None:
        config = SyntheticConfig(
            seed=seed, vocab=vocab, zipf_a=zipf_a, missing=missing, signal=signal,
            target_ctr=target_ctr, interactions=interactions, interaction_dim=interaction_dim,
            shares=shares,
        )
    if fmt not in _EXT:
        raise ConfigError(f"synthetic fmt={fmt!r} is not one of {sorted(_EXT)}; pick one")
    if not isinstance(rows, (int, np.integer)) or rows < 1:
        raise ConfigError(f"synthetic rows={rows!r}; ask for at least 1 row")
    if chunk_rows < 1:
        raise ConfigError(f"synthetic chunk_rows={chunk_rows!r}; use a positive number")
    if not 0 <= stream < _STREAM_CALIBRATION:
        raise ConfigError(f"synthetic stream={stream!r}; use 0 <= stream < 2**31")
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    t0 = time.perf_counter()
    truth = _calibrate(config)
    auc = _AucAccumulator(exact_auc_rows)
    clicks = 0
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as sink:
            if fmt == "text":
                options = pa_csv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
                writer = pa_csv.CSVWriter(sink, _ARROW_SCHEMA, write_options=options)
            else:
                writer = pq.ParquetWriter(sink, _ARROW_SCHEMA, compression="snappy")
            # One writer thread builds chunk i's Arrow table and writes it (numpy and Arrow
            # release the GIL) while this thread draws chunk i+1; at most one write is in
            # flight, so memory stays at about two chunks. Balanced on 2 cores.
            with writer, ThreadPoolExecutor(max_workers=1, thread_name_prefix="synthetic-writer") as pool:
                pending = None
                for start in range(0, rows, chunk_rows):
                    stop = min(rows, start + chunk_rows)
                    draw = _draw(config, stream, start, stop)
                    words = truth.encode(draw["ranks"])  # (N, S)
                    logits = truth.logits(words, draw["present"], draw["dense"])  # (N,)
                    labels = (draw["u_label"] < _sigmoid(logits)).astype(np.int8)  # (N,)
                    auc.add(logits, labels)
                    clicks += int(labels.sum())
                    _wait_write(pending, path)
                    pending = pool.submit(_format_and_write, writer, words, draw["present"], draw["dense"], labels)
                    log.debug("synthetic %s: %d/%d rows", path, stop, rows)
                _wait_write(pending, path)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    info = GeneratorInfo(
        path=path, fmt=fmt, rows=int(rows), stream=stream, config=config, bias=truth.bias,
        scales=truth.scales, best_auc=auc.value(), ctr=clicks / rows,
        best_auc_method=auc.method, seconds=time.perf_counter() - t0, schema=_schema_dict(fmt),
    )
    write_json_atomic(info.meta_path, info.to_json())
    log.info(
        "synthetic %s: %d rows, ctr %.4f, best reachable AUC %.4f, %.0f rows/s",
        path, rows, info.ctr, info.best_auc, rows / max(info.seconds, 1e-9),
    )
    return info


def _split_paths(directory: str | os.PathLike, fmt: str) -> tuple[str, str]:
    if fmt not in _EXT:
        raise ConfigError(f"synthetic fmt={fmt!r} is not one of {sorted(_EXT)}; pick one")
    d = os.fspath(directory)
    return os.path.join(d, "train" + _EXT[fmt]), os.path.join(d, "test" + _EXT[fmt])


def generate_split(
    directory: str | os.PathLike,
    train_rows: int,
    test_rows: int,
    *,
    seed: int = 0,
    fmt: str = "text",
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    **world: Any,
) -> tuple[GeneratorInfo, GeneratorInfo]:
    """Writes `directory/train.{txt,parquet}` (stream 0) and `test.*` (stream 1) of one world.

    `world` takes the keyword arguments of `SyntheticConfig` other than seed.
    """
    config = SyntheticConfig(seed=seed, **world)
    train_path, test_path = _split_paths(directory, fmt)
    train = generate(train_path, train_rows, config=config, fmt=fmt, stream=0, chunk_rows=chunk_rows)
    test = generate(test_path, test_rows, config=config, fmt=fmt, stream=1, chunk_rows=chunk_rows)
    return train, test


def ensure_split(
    directory: str | os.PathLike,
    train_rows: int,
    test_rows: int,
    *,
    seed: int = 0,
    fmt: str = "text",
    **world: Any,
) -> tuple[GeneratorInfo, GeneratorInfo]:
    """`generate_split`, unless `directory` already holds that exact split (by sidecars).

    Meant for caches: training calls this to create its default data set on first use.
    Concurrent callers are safe (files are renamed into place; both write the same bytes).
    """
    config = SyntheticConfig(seed=seed, **world)
    cached = cached_split(_split_paths(directory, fmt), (train_rows, test_rows), load_info,
                          lambda info, rows, stream: (info.config, info.rows, info.stream, info.fmt) == (config, rows, stream, fmt))
    return cached or generate_split(directory, train_rows, test_rows, seed=seed, fmt=fmt, **world)


def cached_split(paths: Sequence[str], rows: Sequence[int], load, matches) -> tuple | None:
    """The (train, test) infos of a split on disk whose metadata `matches(info, rows, stream)`
    (both files present); None when a file or its metadata is missing or different."""
    infos = []
    for path, n, stream in zip(paths, rows, (0, 1)):
        try:
            info = load(path)
        except DataError:
            return None
        if not matches(info, n, stream) or not os.path.exists(path):
            return None
        infos.append(info)
    return infos[0], infos[1]


# ------------------------------------------------------------------- the true model


_NIBBLE = np.full(256, 255, dtype=np.uint8)
for _i, _ch in enumerate(b"0123456789abcdef"):
    _NIBBLE[_ch] = _i
for _i, _ch in enumerate(b"ABCDEF"):
    _NIBBLE[_ch] = 10 + _i


def _column(columns: Any, name: str) -> Any:
    try:
        return columns[name]
    except (KeyError, IndexError, TypeError):
        raise DataError(
            f"true_logits needs column {name!r}; give a DataFrame or mapping with label, "
            f"I1..I{_J}, C1..C{_S} (as read from the generated file)"
        ) from None


def decode_ranks(columns: Any, info: GeneratorInfo) -> np.ndarray:
    """Ranks (N, S) uint32 of the C1..C26 strings of a generated file, 0 where missing.

    Rank r is the r-th most frequent key of its slot (1-based). `columns` maps C1..C26 to
    string arrays (a pandas DataFrame read with `dtype=str`, a pyarrow Table, or a dict);
    None, NaN and "" are missing. Raises DataError for a value that is not a key of
    `info`'s world.
    """
    return _read_keys(columns, info)[1]


def _read_keys(columns: Any, info: GeneratorInfo) -> tuple[np.ndarray, np.ndarray]:
    """(words, ranks), both (N, S) uint32; rank 0 = missing."""
    truth = info.truth()
    words, ranks = [], []
    for s, name in enumerate(CRITEO_SPARSE):
        word, present = _hex_words(_column(columns, name), name)  # (N,) each
        with np.errstate(over="ignore"):
            rank = np.where(present, _fmix32_inverse(word) - truth.hex_salt[s], 0).astype(np.uint32)
        bad = np.flatnonzero(present & ((rank < 1) | (rank > info.config.vocab[s])))
        if len(bad):
            raise DataError(
                f"{name} row {bad[0]} holds {int(word[bad[0]]):08x}, which is no key of the world "
                f"seed={info.config.seed}, vocab={info.config.vocab[s]}; pass the info of the "
                f"file these rows came from"
            )
        words.append(word)
        ranks.append(rank)
    return np.stack(words, axis=1), np.stack(ranks, axis=1)  # (N, S) each


def _hex_words(col: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A column of 8-hex-char strings -> (words (N,) uint32, present (N,) bool).

    None, NaN and "" are missing. Goes through Arrow: the characters of a column of
    8-char strings are one contiguous (N, 8) byte block.
    """
    if isinstance(col, pa.ChunkedArray):
        arr = col.combine_chunks()
    elif isinstance(col, pa.Array):
        arr = col
    else:
        try:
            arr = pa.array(col, from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as e:
            raise DataError(f"{name} is not a column of hex strings ({e}); read C* columns as str") from None
        if isinstance(arr, pa.ChunkedArray):  # pandas' Arrow-backed str columns convert to these
            arr = arr.combine_chunks()
    n = len(arr)
    if pa.types.is_null(arr.type):
        return np.zeros(n, dtype=np.uint32), np.zeros(n, dtype=bool)
    if pa.types.is_large_string(arr.type) or pa.types.is_string_view(arr.type):
        arr = arr.cast(pa.string())
    if not pa.types.is_string(arr.type):
        raise DataError(f"{name} holds {arr.type} values, not hex strings; read C* columns as str")
    lengths = pc.binary_length(arr).to_numpy(zero_copy_only=False)  # (N,) float with NaN for null
    present = np.nan_to_num(lengths, nan=0.0) > 0  # (N,)
    bad = np.flatnonzero(present & (lengths != 8))
    if len(bad):
        raise DataError(
            f"{name} row {bad[0]} holds {arr[int(bad[0])].as_py()!r}, not 8 hex characters; "
            f"true_logits reads files written by recps.data.generators.ctr only"
        )
    filled = pc.if_else(pa.array(present), arr, pa.scalar("00000000"))  # every value 8 chars
    offsets = np.frombuffer(filled.buffers()[1], dtype=np.int32)[filled.offset : filled.offset + n + 1]
    data = np.frombuffer(filled.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    nibbles = _NIBBLE[data.reshape(n, 8)]  # (N, 8)
    if (nibbles == 255).any():
        row = int(np.flatnonzero((nibbles == 255).any(axis=1))[0])
        raise DataError(f"{name} row {row} holds {arr[row].as_py()!r}, which is not hexadecimal")
    shifts = np.arange(28, -1, -4, dtype=np.uint32)  # (8,): the first char is the top nibble
    return (nibbles.astype(np.uint32) << shifts).sum(axis=1, dtype=np.uint32), present


def _dense_matrix(columns: Any) -> np.ndarray:
    cols = []
    for name in CRITEO_DENSE:
        col = _column(columns, name)
        if isinstance(col, (pa.ChunkedArray, pa.Array)):
            col = col.to_numpy(zero_copy_only=False)
        elif hasattr(col, "to_numpy"):
            col = col.to_numpy(dtype=np.float64, na_value=np.nan)
        cols.append(np.asarray(col, dtype=np.float64))
    return np.stack(cols, axis=1)  # (N, J), NaN = missing


def true_logits(columns: Any, info: GeneratorInfo) -> np.ndarray:
    """True logits (N,) float64 of rows read back from a generated file.

    `columns`: a pandas DataFrame (text read with `sep="\\t", header=None,
    names=Schema.criteo().columns, dtype={C*: str}`, or Parquet), a pyarrow Table or a
    dict of arrays; I* may be float with NaN or nullable ints, C* strings with None/NaN/""
    for missing. `info`: `load_info(path)` of that file (any file of the same world works).
    """
    words, ranks = _read_keys(columns, info)  # (N, S) each
    return info.truth().logits(words, ranks > 0, _dense_matrix(columns))


def true_probs(columns: Any, info: GeneratorInfo) -> np.ndarray:
    """sigmoid(true_logits(columns, info)): the click probabilities (N,) of the world."""
    return _sigmoid(true_logits(columns, info))


# ---------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m recps.data.generators ctr",
        description="Write Criteo-like click data with a planted logistic truth; prints the "
        "best reachable AUC and writes <out>.meta.json.",
    )
    parser.add_argument("--rows", type=int, required=True, help="rows in all (train + test)")
    parser.add_argument("--out", required=True, help="file to write; a folder with --test-fraction")
    parser.add_argument("--format", choices=sorted(_EXT), default="text", dest="fmt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", default=str(DEFAULT_VOCAB), help="keys per slot: one number or 26, comma-separated")
    parser.add_argument("--zipf-a", default=str(DEFAULT_ZIPF_A), help="Zipf exponent: one number or 26")
    parser.add_argument("--missing", type=float, default=DEFAULT_MISSING, help="probability a field is empty")
    parser.add_argument("--signal", type=float, default=DEFAULT_SIGNAL, help="std of the true logit")
    parser.add_argument("--ctr", type=float, default=DEFAULT_TARGET_CTR, help="target click rate")
    parser.add_argument(
        "--test-fraction", type=float, default=0.0,
        help="if > 0, --out is a folder receiving train.* and test.* (an independent stream)",
    )
    parser.add_argument("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS)
    args = parser.parse_args(argv)
    quiet_libraries()  # the libraries' import-time lines a user cannot act on
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    world = dict(
        vocab=args.vocab, zipf_a=args.zipf_a, missing=args.missing, signal=args.signal,
        target_ctr=args.ctr,
    )
    try:
        if not 0 <= args.test_fraction < 1:
            raise ConfigError(f"--test-fraction={args.test_fraction}; use a value in [0, 1)")
        if args.test_fraction > 0:
            test_rows = int(round(args.rows * args.test_fraction))
            if test_rows < 1 or test_rows >= args.rows:
                raise ConfigError(
                    f"--test-fraction={args.test_fraction} of --rows={args.rows} leaves no train "
                    f"or no test rows; change either"
                )
            infos = generate_split(
                args.out, args.rows - test_rows, test_rows, seed=args.seed, fmt=args.fmt,
                chunk_rows=args.chunk_rows, **world,
            )
        else:
            infos = (generate(args.out, args.rows, seed=args.seed, fmt=args.fmt, chunk_rows=args.chunk_rows, **world),)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for info in infos:
        print(
            f"{info.path}: {info.rows} rows, ctr {info.ctr:.4f}, best reachable AUC "
            f"{info.best_auc:.4f} ({info.best_auc_method}), {info.rows / info.seconds:,.0f} rows/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
