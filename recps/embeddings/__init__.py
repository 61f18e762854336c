"""Worker-side embedding collections for local (single-process) training, and batch placement."""

from recps.embeddings.local_embedding import LocalEmbeddingBagCollection
from recps.embeddings.local_sequence import LocalEmbeddingCollection
from recps.embeddings.placement import BatchPlacement

__all__ = ["BatchPlacement", "LocalEmbeddingBagCollection", "LocalEmbeddingCollection"]
