"""Vectorized 64-bit hashing: key partition across shards and deterministic initial values.

Everything here is a pure function of its inputs (no global random state), so a server
shard, a GEO worker's local replica and a re-sharded checkpoint all compute the same
answer for the same key. The mixer is splitmix64 (Steele, Lea, Flood, 2014), written in
int64 tensor ops: multiplication wraps modulo 2^64 and logical right shifts are emulated
with a mask, so results equal the textbook unsigned version bit for bit.

Shapes: K keys, D embedding dim.

>>> partition(torch.tensor([0, 1, -1, 2**62 + 5]), 3).tolist() == partition(torch.tensor([0, 1, -1, 2**62 + 5]), 3).tolist()
True
>>> Initializer("uniform", low=-0.1, high=0.1)(torch.tensor([7, -1]), 4, seed=3).shape
torch.Size([2, 4])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from recps.errors import ConfigError

__all__ = ["splitmix64", "partition", "Initializer", "PARTITION_SCHEME"]

# Name written into checkpoint manifests: a loader refuses a checkpoint partitioned otherwise.
PARTITION_SCHEME = "splitmix64-salted-mod/v1"

_MASK64 = (1 << 64) - 1


def _s64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GAMMA = _s64(0x9E3779B97F4A7C15)
_MUL1 = _s64(0xBF58476D1CE4E5B9)
_MUL2 = _s64(0x94D049BB133111EB)
# Distinct salts keep the partition hash, the initializer hash and the seed mix independent.
_PARTITION_SALT = _s64(0x5BD1E9955BD1E995)
_INIT_SALT = _s64(0x2545F4914F6CDD1D)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer of (x + golden gamma), elementwise on int64 tensors (bits as uint64).

    >>> splitmix64(torch.tensor([0])).item() == _s64(0xE220A8397B1DCDAF)
    True
    """
    z = x + _GAMMA
    z = (z ^ _srl(z, 30)) * _MUL1
    z = (z ^ _srl(z, 27)) * _MUL2
    return z ^ _srl(z, 31)


def _splitmix64_int(x: int) -> int:
    """splitmix64 on one Python int (used for seeds), same bits as the tensor version."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return _s64(z ^ (z >> 31))


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

    def __call__(self, keys: torch.Tensor, dim: int, seed: int = 0) -> torch.Tensor:
        """(K,) int64 keys -> (K, D) float32 initial values."""
        k = keys.numel()
        if self.kind == "zeros" or k == 0:
            return torch.zeros(k, dim, dtype=torch.float32)
        base = splitmix64(keys + _splitmix64_int(seed ^ _INIT_SALT))  # (K,)
        cols = torch.arange(1, dim + 1, dtype=torch.int64) * _GAMMA  # (D,) wraps, fine
        h = splitmix64(base[:, None] + cols[None, :])  # (K, D)
        # 24 high bits -> exactly representable float32 in [0, 1).
        hi = _srl(h, 40).to(torch.float64) * (1.0 / (1 << 24))  # (K, D)
        if self.kind == "uniform":
            return (self.low + (self.high - self.low) * hi).to(torch.float32)
        # Box-Muller with a second, independent 24-bit field of the same hash.
        lo = ((h >> 8) & 0xFFFFFF).to(torch.float64) * (1.0 / (1 << 24))  # (K, D)
        radius = torch.sqrt(-2.0 * torch.log1p(-hi))  # log(1 - u), u < 1 so finite
        z = radius * torch.cos((2.0 * math.pi) * lo)  # (K, D) standard normal
        return (self.mean + self.std * z).to(torch.float32)
