"""Vectorized 64-bit hashing: key partition across shards and deterministic initial values.

Everything here is a pure function of its inputs (no global random state), so a server
shard, a GEO worker's local replica and a re-sharded checkpoint all compute the same
answer for the same key. The mixer is splitmix64 (Steele, Lea, Flood, 2014), written in
int64 tensor ops: multiplication wraps modulo 2^64 and logical right shifts are emulated
with a mask, so results equal the textbook unsigned version bit for bit. It is written once, in
`recps.splitmix` (light: torch and numpy only, so the data generators need not load the tables);
`splitmix64` and `splitmix64_numpy` are re-exported here.

Shapes: K keys, D embedding dim.

>>> partition(torch.tensor([0, 1, -1, 2**62 + 5]), 3).tolist() == partition(torch.tensor([0, 1, -1, 2**62 + 5]), 3).tolist()
True
>>> Initializer("uniform", low=-0.1, high=0.1)(torch.tensor([7, -1]), 4, seed=3).shape
torch.Size([2, 4])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from recps.errors import ConfigError
from recps.ps.table._kernels import NORMAL, UNIFORM, init_rows
from recps.splitmix import _GAMMA, _MASK64, _s64, _splitmix64_int, _srl, splitmix64, splitmix64_numpy  # noqa: F401

__all__ = ["splitmix64", "splitmix64_numpy", "partition", "Initializer", "PARTITION_SCHEME"]

# Name written into checkpoint manifests: a loader refuses a checkpoint partitioned otherwise.
PARTITION_SCHEME = "splitmix64-salted-mod/v1"

# Distinct salts keep the partition hash, the initializer hash and the seed mix independent.
_PARTITION_SALT = _s64(0x5BD1E9955BD1E995)
_INIT_SALT = _s64(0x2545F4914F6CDD1D)


def partition(keys: torch.Tensor, num_shards: int) -> torch.Tensor:
    """Shard id in [0, num_shards) of each int64 key: stable, well mixed, any key value.

    The cluster routes keys to servers with this function and checkpoints re-shard with it,
    so it must never change silently (its name is `PARTITION_SCHEME`).

    Args:
        keys: (K,) int64.
        num_shards: number of shards, >= 1.
    Returns:
        (K,) int64 shard ids.
    """
    if num_shards < 1:
        raise ConfigError(f"partition: num_shards={num_shards}; it must be >= 1")
    if keys.dtype != torch.int64:
        raise ConfigError(f"partition: keys have dtype {keys.dtype}; pass int64 keys")
    if num_shards == 1:
        return torch.zeros_like(keys)
    h = splitmix64(keys ^ _PARTITION_SALT)  # (K,)
    return _srl(h, 1) % num_shards  # top 63 bits, non-negative


_KINDS = ("uniform", "normal", "zeros")


@dataclass(frozen=True)
class Initializer:
    """Initial row values as a deterministic function of (key, column, seed).

    kind="uniform": U[low, high); kind="normal": N(mean, std); kind="zeros".
    Each (key, column) gets its own splitmix64 stream, so a row never depends on which
    other keys were created with it, in what order, or on which process.
    """

    kind: str = "uniform"
    low: float = -0.01
    high: float = 0.01
    mean: float = 0.0
    std: float = 0.01

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError(f"Initializer: kind={self.kind!r}; use one of {_KINDS}")
        if self.kind == "uniform" and not self.low <= self.high:
            raise ConfigError(f"Initializer: low={self.low} > high={self.high}; swap them")
        if self.kind == "normal" and not self.std >= 0:
            raise ConfigError(f"Initializer: std={self.std}; it must be >= 0")

    def __call__(self, keys: torch.Tensor, dim: int, seed: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        """(K,) int64 keys -> (K, D) float32 initial values (written into `out` if given)."""
        k = keys.numel()
        if out is None:
            out = torch.empty(k, dim, dtype=torch.float32)  # (K, D)
        if self.kind == "zeros" or k == 0:
            return out.zero_()
        # One compiled pass (recps.ps.table._kernels): ~12x faster than the ~15 torch ops per
        # chunk it replaced, and bit for bit the same uniform values.
        a, b = (self.low, self.high - self.low) if self.kind == "uniform" else (self.mean, self.std)
        init_rows(keys.contiguous().numpy().view(np.uint64), np.uint64(_splitmix64_int(seed ^ _INIT_SALT) & _MASK64),
                  UNIFORM if self.kind == "uniform" else NORMAL, np.float32(a), np.float32(b), out.numpy())
        return out
