"""YouTube-DNN candidate generation: a user vector from the watch history, scored against item softmax weights.

Paper: Covington, Adams and Sargin, "Deep Neural Networks for YouTube Recommendations",
RecSys 2016, https://dl.acm.org/doi/10.1145/2959100.2959190 (section 3): the next watch is
a class of an extreme multiclass softmax; the user vector is a ReLU tower over the average
of the watched items' embeddings (and other user features); the classes' output
embeddings are a separate table; training uses sampled softmax with importance weighting
(the log-Q correction), serving a nearest-neighbour search over the output embeddings.
The softmax losses live in `recps.tasks.RetrievalTask`; this module only scores.

Here the tower's last layer is linear (no ReLU) so that the user vector can point anywhere
the item embeddings do; there is no per-item softmax bias (the log-Q-corrected softmax and
unnormalised item vectors carry popularity through their norms).

Shapes: B batch, C candidates, D embedding dim, I dense inputs, Fq query features.

    sparse KJT ─► injected EmbeddingBagCollection (one lookup) ─► mean per feature (B, D)
      watch history (+ other query features) (B, Fq·D) ─┬─ concat ─► ReLU MLP ─► Linear ─► users (B, D)
      dense (B, I) (e.g. example age) ──────────────────┘
      item feature: the item's output embedding (softmax weights) ──────────────────► items (B, D)

    score(users (B, D), items (C, D)) = users @ items.T ─► logits (B, C)
    score_pairs(users (B, D), items (B, D)) ─► row b against row b ─► logits (B,)
    forward(dense, sparse) = score_pairs(encode(dense, sparse)) ─► logits (B,)

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=50, feature_names=[f])
    ...     for f in ("item", "history")])
    >>> model = YouTubeDNN(ebc, dense_in_features=1, hidden=(16,))
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["item", "history"], values=torch.tensor([4, 5, 1, 2, 3]), lengths=torch.tensor([1, 1, 2, 1]))
    >>> users, items = model.encode(torch.ones(2, 1), kjt)
    >>> users.shape, model.score(users, items).shape, model(torch.ones(2, 1), kjt).shape
    (torch.Size([2, 8]), torch.Size([2, 2]), torch.Size([2]))
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import collection_layout, mlp
from models._retrieval import check_features, mean_pooled

__all__ = ["YouTubeDNN"]


class YouTubeDNN(nn.Module):
    """A ReLU tower from averaged history embeddings to a user vector; items are their output embeddings.

    Args:
        embedding_bag_collection: pools each feature to (B, D); torchrec's
            EmbeddingBagCollection or recps' PS-backed one.
        dense_in_features: I, dense inputs of the user tower (0: none).
        query_features: features of the user tower (the watch history first; more may follow).
        item_feature: the feature whose embedding is the item's softmax weight vector.
        hidden: ReLU layer sizes of the user tower (the paper: 1024-512-256); then a linear
            layer to D.
        dropout: dropout after each ReLU layer.
    """

    def __init__(
        self,
        embedding_bag_collection: nn.Module,
        dense_in_features: int = 0,
        query_features: Sequence[str] = ("history",),
        item_feature: str = "item",
        hidden: Sequence[int] = (256, 128),
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        names, dim = collection_layout(embedding_bag_collection, "YouTubeDNN")
        check_features(names, query_features, "YouTubeDNN", "query_features")
        check_features(names, [item_feature], "YouTubeDNN", "item_feature")
        if item_feature in query_features:
            raise ValueError(f"YouTubeDNN: item_feature={item_feature!r} is also a query feature; the "
                             "user tower must not see the item it predicts")
        self.sparse_arch = embedding_bag_collection
        self.query_features = list(query_features)
        self.item_feature = item_feature
        self.user_tower = mlp(len(self.query_features) * dim + dense_in_features, hidden, out_features=dim,
                              dropout=dropout)

    def encode(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(users (B, D), items (B, D)) of every row, from one lookup."""
        pooled = self.sparse_arch(sparse)  # KeyedTensor, values (B, F*D)
        x = torch.cat([mean_pooled(pooled, sparse, self.query_features), dense], dim=1)  # (B, Fq*D + I)
        return self.user_tower(x), pooled[self.item_feature]  # (B, D), (B, D)

    def score(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Logits (B, C) of every user vector (B, D) against every item embedding (C, D)."""
        return users @ items.t()  # (B, C)

    def score_pairs(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Logits (B,) of user b (B, D) against item b (B, D)."""
        return (users * items).sum(1)  # (B,)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Logits (B,) of each row's own (user, item) pair."""
        return self.score_pairs(*self.encode(dense, sparse))  # (B,)
