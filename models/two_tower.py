"""Two-tower retrieval (DSSM style): a query tower and a candidate tower meet in a dot product.

Papers: Huang et al., "Learning Deep Structured Semantic Models for Web Search using
Clickthrough Data" (DSSM), CIKM 2013, https://dl.acm.org/doi/10.1145/2505515.2505665;
Yi et al., "Sampling-Bias-Corrected Neural Modeling for Large Corpus Item Recommendations",
RecSys 2019, https://dl.acm.org/doi/10.1145/3298689.3346996 (L2-normalised towers, a
temperature, in-batch softmax with the log-Q correction). The losses (in-batch / sampled
softmax, log-Q) live in `recps.tasks.RetrievalTask`; this module only scores.

Shapes: B batch, C candidates, D embedding dim, E output dim, I dense inputs,
Fq / Fc query / candidate features. A feature with several keys (a history) is the mean of
their embeddings.

    sparse KJT ─► injected EmbeddingBagCollection (one lookup) ─► mean per feature (B, D)
      query features (user, history) (B, Fq·D) ─┬─ concat ─► MLP ─► L2 norm ─► queries (B, E)
      dense (B, I) ─────────────────────────────┘
      candidate features (item, genres) (B, Fc·D) ─► MLP ─► L2 norm ─► candidates (B, E)

    score(queries (B, E), candidates (C, E)) = queries @ candidates.T / temperature ─► logits (B, C)
    score_pairs(queries (B, E), candidates (B, E)) ─► row b against row b ─► logits (B,)
    forward(dense, sparse) = score_pairs(encode(dense, sparse)) ─► logits (B,)

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=50, feature_names=[f])
    ...     for f in ("user", "item", "history", "genres")])
    >>> model = TwoTower(ebc, dense_in_features=0, hidden=(16,), out_dim=4)
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(     # 2 rows; row 1 has an empty history
    ...     keys=["user", "item", "history", "genres"], values=torch.tensor([1, 2, 7, 9, 3, 4, 5, 6]),
    ...     lengths=torch.tensor([1, 1, 1, 1, 2, 0, 1, 1]))
    >>> queries, candidates = model.encode(torch.zeros(2, 0), kjt)
    >>> queries.shape, model.score(queries, candidates).shape, model(torch.zeros(2, 0), kjt).shape
    (torch.Size([2, 4]), torch.Size([2, 2]), torch.Size([2]))
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import collection_layout, mlp
from models._retrieval import check_features, mean_pooled

__all__ = ["TwoTower"]


class TwoTower(nn.Module):
    """Query and candidate MLP towers over an injected embedding-bag collection.

    Args:
        embedding_bag_collection: pools each feature to (B, D); torchrec's
            EmbeddingBagCollection or recps' PS-backed one.
        dense_in_features: I, dense inputs of the query tower (0: none).
        query_features: features of the query tower (user side).
        candidate_features: features of the candidate tower (item side).
        hidden: hidden layer sizes of each tower (ReLU); then a linear layer to `out_dim`.
        out_dim: E.
        temperature: logits are cosine / temperature when `normalize` (Yi et al. tune it; a
            cosine alone spans [-1, 1], too flat for a softmax over many items).
        normalize: L2-normalise both towers' outputs.
    """

    def __init__(
        self,
        embedding_bag_collection: nn.Module,
        dense_in_features: int = 0,
        query_features: Sequence[str] = ("user", "history"),
        candidate_features: Sequence[str] = ("item", "genres"),
        hidden: Sequence[int] = (128,),
        out_dim: int = 64,
        temperature: float = 0.05,
        normalize: bool = True,
    ) -> None:
        super().__init__()
        names, dim = collection_layout(embedding_bag_collection, "TwoTower")
        check_features(names, query_features, "TwoTower", "query_features")
        check_features(names, candidate_features, "TwoTower", "candidate_features")
        if not temperature > 0:
            raise ValueError(f"TwoTower: temperature={temperature}; use a positive value, e.g. 0.05")
        self.sparse_arch = embedding_bag_collection
        self.query_features = list(query_features)
        self.candidate_features = list(candidate_features)
        self.temperature = float(temperature)
        self.normalize = bool(normalize)
        self.query_tower = mlp(len(self.query_features) * dim + dense_in_features, hidden, out_features=out_dim)
        self.candidate_tower = mlp(len(self.candidate_features) * dim, hidden, out_features=out_dim)

    def encode(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries (B, E), candidates (B, E)) of every row, from one lookup."""
        pooled = self.sparse_arch(sparse)  # KeyedTensor, values (B, F*D)
        q = torch.cat([mean_pooled(pooled, sparse, self.query_features), dense], dim=1)  # (B, Fq*D + I)
        c = mean_pooled(pooled, sparse, self.candidate_features)  # (B, Fc*D)
        queries = self.query_tower(q)  # (B, E)
        candidates = self.candidate_tower(c)  # (B, E)
        if self.normalize:
            queries, candidates = F.normalize(queries, dim=1), F.normalize(candidates, dim=1)
        return queries, candidates

    def score(self, queries: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Logits (B, C) of every query (B, E) against every candidate (C, E)."""
        return queries @ candidates.t() / self.temperature  # (B, C)

    def score_pairs(self, queries: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Logits (B,) of query b (B, E) against candidate b (B, E)."""
        return (queries * candidates).sum(1) / self.temperature  # (B,)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Logits (B,) of each row's own (query, item) pair."""
        return self.score_pairs(*self.encode(dense, sparse))  # (B,)
