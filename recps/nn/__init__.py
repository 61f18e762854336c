"""Worker-side embedding collections for local (single-process) training."""

from recps.nn.local_embedding import LocalEmbeddingBagCollection
from recps.nn.local_sequence import LocalEmbeddingCollection

__all__ = ["LocalEmbeddingBagCollection", "LocalEmbeddingCollection"]
