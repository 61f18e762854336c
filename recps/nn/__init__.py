"""Worker-side embedding collections for local (single-process) training, and batch placement."""

from recps.nn.local_embedding import LocalEmbeddingBagCollection
from recps.nn.local_sequence import LocalEmbeddingCollection
from recps.nn.placement import BatchPlacement

__all__ = ["BatchPlacement", "LocalEmbeddingBagCollection", "LocalEmbeddingCollection"]
