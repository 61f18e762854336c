"""Compiled loops of the sparse table's hot paths (numba, nopython, GIL released).

Why (benchmarks/RESULTS.md, "Session 5"): a server's pull that creates ~1,800 rows and a
row-wise Adagrad push of ~6,000 rows cost 3-4 ms and 2-2.5 ms as ~30 small torch ops each,
most of it per-op overhead and passes over (K, D) temporaries. One loop per verb does the
same arithmetic in one pass.

- `init_rows`: the Initializer's values, one splitmix64 stream per (key, column), bit for bit
  what `hashing.splitmix64` computes (the test checks it against that reference).
- `apply_rule`: SGD, Adagrad, row-wise Adagrad or a GEO delta on rows addressed by unique
  slots, in place in the table's (C, W) row array, with L2 and bounds as the torch rules.

Every function takes numpy views of the table's torch tensors (no copy) and is compiled once
per machine: `cache=True` keeps the machine code next to this file (or in NUMBA_CACHE_DIR).
Loading it still costs a process ~1 CPU-second at the first call (numba's own start-up), so
servers and GEO workers call `warm_up_kernels()` before they serve or train, not at a first batch.

Shapes: K keys, D embedding dim, C row capacity, W row width.
"""

from __future__ import annotations

import math
import threading

import numba
import numpy as np

__all__ = ["init_rows", "apply_rule", "warm_up_kernels", "RULE_CODES", "DELTA", "UNIFORM", "NORMAL"]

UNIFORM, NORMAL = 0, 1
# Rules with a compiled update; others (Adam on sparse rows) keep the torch path.
SGD, ADAGRAD, ROWWISE_ADAGRAD, DELTA = 0, 1, 2, 3
RULE_CODES = {"sgd": SGD, "adagrad": ADAGRAD, "rowwise_adagrad": ROWWISE_ADAGRAD}

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_TWO_PI = np.float32(2.0 * math.pi)
_ULP23 = np.float32(1.0 / (1 << 23))

_jit = numba.njit(cache=True, nogil=True, fastmath=False, error_model="numpy")


@_jit
def _mix(z):
    z = (z ^ (z >> np.uint64(30))) * _MUL1
    z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


@_jit
def _unit(bits):
    """The low 23 bits m -> m / 2^23, a float32 in [0, 1), exactly."""
    return np.float32(bits & np.uint64(0x7FFFFF)) * _ULP23


@_jit
def init_rows(keys, add, kind, a, b, out):
    """Initial values of (K,) uint64 keys into out (K, D) float32 (a view may be strided).

    add: the seed's mix (uint64); kind UNIFORM: a = low, b = high - low; NORMAL: a = mean, b = std.
    """
    dim = out.shape[1]
    a, b = np.float32(a), np.float32(b)
    for i in range(keys.shape[0]):
        base = _mix(keys[i] + add + _GAMMA)
        for c in range(dim):
            h = _mix(base + np.uint64(c + 1) * _GAMMA + _GAMMA)
            u = _unit(h >> np.uint64(41))  # the high word's top 23 bits
            if kind == UNIFORM:
                out[i, c] = u * b + a
            else:  # Box-Muller; the low word is the angle's uniform
                angle = math.cos(_unit(h >> np.uint64(9)) * _TWO_PI)
                radius = math.sqrt(math.log1p(-u) * np.float32(-2.0))
                out[i, c] = radius * angle * b + a


@_jit
def apply_rule(rows, slots, x, rule, dim, scol, dirty, lr, eps, l2, low, high, clamp):
    """Update rows[slots[i]] with x[i] (K, D) for unique slots (-1: skipped), in place.

    rows (C, W) float32: values in [0, dim), rule state from scol, the dirty flag at `dirty`.
    rule: a RULE_CODES value or DELTA (value += x, state untouched). Arithmetic in float32.
    """
    lr32, eps32, l2_32 = np.float32(lr), np.float32(eps), np.float32(l2)
    lo32, hi32 = np.float32(low), np.float32(high)
    inv_dim = np.float32(1.0) / np.float32(dim)
    for i in range(slots.shape[0]):
        s = slots[i]
        if s < 0:
            continue
        if rule == ROWWISE_ADAGRAD:  # one accumulator per row:, the mean squared gradient
            total = np.float32(0.0)
            for c in range(dim):
                g = x[i, c] + l2_32 * rows[s, c]
                total += g * g
            acc = rows[s, scol] + total * inv_dim
            rows[s, scol] = acc
            step = lr32 / (np.float32(math.sqrt(acc)) + eps32)
            for c in range(dim):
                g = x[i, c] + l2_32 * rows[s, c]
                rows[s, c] -= g * step
        else:
            for c in range(dim):
                g = x[i, c]
                if rule == DELTA:
                    rows[s, c] += g
                    continue
                g += l2_32 * rows[s, c]
                if rule == SGD:
                    rows[s, c] -= lr32 * g
                else:
                    acc = rows[s, scol + c] + g * g
                    rows[s, scol + c] = acc
                    rows[s, c] -= lr32 * g / (np.float32(math.sqrt(acc)) + eps32)
        if clamp and rule != DELTA:  # bounds apply to the rule's updates, not to GEO deltas
            for c in range(dim):
                rows[s, c] = min(max(rows[s, c], lo32), hi32)
        rows[s, dirty] = np.float32(1.0)


_warm = threading.Lock()
_warmed = False


def warm_up_kernels() -> None:
    """Load (or compile) every kernel for the argument types the tables pass; idempotent."""
    global _warmed
    with _warm:
        if _warmed:
            return
        rows = np.zeros((2, 4), np.float32)  # (C, W): D=2 values, 1 state column, dirty flag
        keys = np.zeros(1, np.uint64)
        for out in (rows[:1, :2], np.zeros((1, 2), np.float32)):  # a row block's view, a fresh array
            init_rows(keys, np.uint64(0), UNIFORM, np.float32(0.0), np.float32(1.0), out)
        apply_rule(rows, np.zeros(1, np.int64), np.zeros((1, 2), np.float32), SGD, 2, 2, 3, 0.1, 0.0, 0.0, 0.0, 0.0, False)
        _warmed = True
