"""Readers that turn files into `Batch(dense, sparse, labels)`; generated worlds in `generators/`.

Names are imported on first use, so a module that needs only the schema or the hashing does
not pay for importing the readers (and torchrec).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Batch": "recps.data.batch",
    "Schema": "recps.data.schema",
    "Examples": "recps.data.reader",
    "ReaderStats": "recps.data.reader",
    "TabularReader": "recps.data.reader",
    "TensorBatches": "recps.data.reader",
    "expand_paths": "recps.data.reader",
    "load_tensors": "recps.data.reader",
    "hash_strings": "recps.data.hashing",
    "missing_key": "recps.data.hashing",
    "slot_salt": "recps.data.hashing",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'recps.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
