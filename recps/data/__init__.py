"""Readers that turn files into `Batch(dense, sparse, labels)`, and the synthetic generator."""

from recps.data.batch import Batch
from recps.data.hashing import hash_strings, missing_key, slot_salt
from recps.data.reader import Examples, ReaderStats, TabularReader, TensorBatches, expand_paths, load_tensors
from recps.data.schema import Schema

__all__ = [
    "Batch",
    "Schema",
    "Examples",
    "ReaderStats",
    "TabularReader",
    "TensorBatches",
    "expand_paths",
    "load_tensors",
    "hash_strings",
    "missing_key",
    "slot_salt",
]
