"""Large tensors on transparent huge pages.

Tables do random row gathers and hash probes over gigabytes; with 4 KiB pages almost every
access is a TLB miss. Measured here (10M keys, batches of 100k): hash lookups 1.6-2x faster
and single-column scatters ~10x faster when the buffer is advised MADV_HUGEPAGE (the
machine's THP mode is `madvise`). Pages stay untouched until written, so capacity reserved
for growth costs no resident memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch

__all__ = ["alloc"]

_log = logging.getLogger(__name__)
_HUGE = 2 << 20  # 2 MiB
_MADV_HUGEPAGE = 14
_MIN_HUGE_BYTES = 8 << 20  # below this, alignment padding is not worth it

_libc = None
if sys.platform.startswith("linux"):
    try:
        try:  # glibc's soname first: find_library runs `ldconfig -p` in a subprocess at import
            _libc = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:  # another libc (musl ...): ask the loader's cache
            _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    except OSError:  # pragma: no cover - exotic libc
        _libc = None


def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialized contiguous tensor; advised onto huge pages when large (Linux only).

    The result is a view into a 2 MiB-aligned slice of a byte buffer it keeps alive.
    """
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if _libc is None or nbytes < _MIN_HUGE_BYTES:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + _HUGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % _HUGE
    if _libc.madvise(raw.data_ptr() + start, nbytes - nbytes % _HUGE, _MADV_HUGEPAGE) != 0:
        _log.debug("madvise(MADV_HUGEPAGE) failed, errno %d; using normal pages", ctypes.get_errno())
    return raw[start : start + nbytes].view(dtype).view(shape)
