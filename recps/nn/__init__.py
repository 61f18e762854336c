"""Worker-side embedding collections for local (single-process) training."""

from recps.nn.local_embedding import LocalEmbeddingBagCollection

__all__ = ["LocalEmbeddingBagCollection"]
