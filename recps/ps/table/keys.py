"""Feature keys: the one validation and cast of user keys, the one de-duplication.

Shapes: N keys with duplicates, U unique keys.

`as_keys` is called where keys enter the PS from a caller (PSClient's verbs, SparseTable's
public methods); code behind those boundaries passes int64 (N,) tensors on.

`unique_keys` is torch.unique with the inverse (and counts): measured against sort +
unique_consecutive + scatter of the permutation (1 thread, random int64 keys, 200 calls each,
alternating; /tmp script of session 6): 13,312 keys of 8,000 distinct 0.9-1.1 ms vs 0.8-1.3 ms,
100,000 of 60,000 3.0-4.1 ms vs 2.9-3.3 ms, 1,000 of 900 0.018 ms vs 0.024 ms: within noise at
batch sizes, simpler and faster on small requests, so it is the one used everywhere.

>>> [t.tolist() for t in unique_keys(torch.tensor([7, 3, 7]))]
[[3, 7], [1, 0, 1]]
>>> as_keys(torch.tensor([1, 2], dtype=torch.int32), "pull").dtype
torch.int64
"""

from __future__ import annotations

import torch

from recps.errors import ConfigError

__all__ = ["as_keys", "unique_keys"]

_INTEGER_DTYPES = (torch.int32, torch.int16, torch.int8, torch.uint8)


def as_keys(keys, where: str) -> torch.Tensor:
    """User keys -> contiguous (N,) int64; narrower integers are widened, anything else refused."""
    keys = torch.as_tensor(keys)
    if keys.dim() != 1:
        raise ConfigError(f"{where}: keys have shape {tuple(keys.shape)}; pass a 1-D tensor (flatten them)")
    if keys.dtype in _INTEGER_DTYPES:
        keys = keys.to(torch.int64)
    if keys.dtype != torch.int64:
        raise ConfigError(f"{where}: keys have dtype {keys.dtype}; pass int64 keys")
    return keys.contiguous()


def unique_keys(keys: torch.Tensor, counts: bool = False):
    """(N,) int64 -> sorted unique (U,), inverse (N,) with uniq[inverse] == keys[, counts (U,)]."""
    return torch.unique(keys, sorted=True, return_inverse=True, return_counts=counts)
