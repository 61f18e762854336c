"""Readers that turn files into `Batch(dense, sparse, labels)`, and the synthetic generator."""

from recps.data.batch import Batch
from recps.data.schema import Schema

__all__ = ["Batch", "Schema"]
