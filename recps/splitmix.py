"""splitmix64 (Steele, Lea, Flood, 2014) in int64 tensor ops, written once for the whole engine.

Multiplication wraps modulo 2^64 and logical right shifts are emulated with a mask, so results
equal the textbook unsigned version bit for bit. The PS tables (recps.ps.table.hashing: key
partitions, initial values), the embedding collections' key salting and the synthetic data
generators all call it; this module imports only torch and numpy.

>>> int(splitmix64_numpy(np.uint64(0))) == 0xE220A8397B1DCDAF
True
"""

from __future__ import annotations

import functools

import numpy as np
import torch

__all__ = ["splitmix64", "splitmix64_numpy"]

_MASK64 = (1 << 64) - 1


def _s64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GAMMA = _s64(0x9E3779B97F4A7C15)
_MUL1 = _s64(0xBF58476D1CE4E5B9)
_MUL2 = _s64(0x94D049BB133111EB)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


_CHUNK = 1 << 16  # elements per pass: temporaries stay in L2 (5x faster than whole-tensor ops here)


def _mix_into(z: torch.Tensor, t: torch.Tensor) -> None:
    """splitmix64 finalizer in place on z (int64 bits as uint64), t a scratch buffer."""
    torch.bitwise_right_shift(z, 30, out=t)
    t.bitwise_and_((1 << 34) - 1)
    z.bitwise_xor_(t).mul_(_MUL1)
    torch.bitwise_right_shift(z, 27, out=t)
    t.bitwise_and_((1 << 37) - 1)
    z.bitwise_xor_(t).mul_(_MUL2)
    torch.bitwise_right_shift(z, 31, out=t)
    t.bitwise_and_((1 << 33) - 1)
    z.bitwise_xor_(t)


def splitmix64(x: torch.Tensor, add: torch.Tensor | int = 0) -> torch.Tensor:
    """splitmix64 finalizer of (x + add + golden gamma), elementwise on int64 tensors (bits as
    uint64); `add` broadcasts against x. Returns a new contiguous int64 tensor.

    >>> splitmix64(torch.tensor([0])).item() == _s64(0xE220A8397B1DCDAF)
    True
    """
    if isinstance(add, torch.Tensor):
        x, add = torch.broadcast_tensors(x, add)
    out = torch.empty(x.shape, dtype=torch.int64)
    flat, flat_x = out.view(-1), x.reshape(-1)
    flat_add = add.reshape(-1) if isinstance(add, torch.Tensor) else None
    scratch = torch.empty(min(_CHUNK, flat.numel()), dtype=torch.int64)
    for start in range(0, flat.numel(), _CHUNK):
        end = min(start + _CHUNK, flat.numel())
        z = flat[start:end]
        torch.add(flat_x[start:end], flat_add[start:end] if flat_add is not None else add, out=z)
        z.add_(_GAMMA)
        _mix_into(z, scratch[: end - start])
    return out


def splitmix64_numpy(x: np.ndarray | int) -> np.ndarray:
    """`splitmix64` for numpy callers (the synthetic data generators): uint64 values in
    (anything `np.asarray(x, dtype=np.uint64)` takes), uint64 of x's shape out; a 0-d input
    gives a numpy scalar, as numpy's own ufuncs do. The same bits, computed by `splitmix64`
    on an int64 view of a private copy (torch warns on read-only numpy memory).

    >>> int(splitmix64_numpy(np.uint64(0))) == 0xE220A8397B1DCDAF
    True
    """
    z = np.array(x, dtype=np.uint64, order="C")  # the copy torch reads from
    return splitmix64(torch.from_numpy(z.view(np.int64))).numpy().view(np.uint64)[()]


@functools.lru_cache(maxsize=256)
def _splitmix64_int(x: int) -> int:
    """splitmix64 of one Python int (a seed), as int64; cached: every Initializer call asks for it."""
    return int(splitmix64(torch.tensor([_s64(x)]))[0])


