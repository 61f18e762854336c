"""NCF (NeuMF): generalized matrix factorization and an MLP over user and item embeddings.

Paper: He et al., "Neural Collaborative Filtering", WWW 2017, https://arxiv.org/abs/1708.05031
(NeuMF, section 3.4): GMF and MLP learn separate embeddings; the last layer reads the
concatenation of GMF's element-wise product and the MLP's output. The paper trains with a
pointwise log loss over sampled negatives; here the loss is the task's (recps.tasks:
sampled / in-batch softmax), this module only scores.

One table row per id holds both embeddings: columns [0, Dg) are the GMF embedding,
[Dg, D) the MLP embedding (disjoint parameters, one lookup).

Shapes: B batch, C candidates, D table width = Dg + Dm, H MLP layer sizes.

    sparse KJT ─► injected EmbeddingBagCollection ─► user (B, D), item (B, D)
      GMF: user[:, :Dg] ⊙ item[:, :Dg] ─────────────────────────────── (·, Dg) ─┐
      MLP: [user[:, Dg:], item[:, Dg:]] ─► ReLU layers H ───────────── (·, H_last) ─┴─ concat ─► Linear ─► logits

    score(users (B, D), items (C, D)) ─► every pair ─► logits (B, C); the MLP's first layer is
    split into its user and item halves, so it runs on B + C rows, not B·C.
    score_pairs(users (B, D), items (B, D)) ─► row b against row b ─► logits (B,)
    forward(dense, sparse) = score_pairs(encode(dense, sparse)) ─► logits (B,)

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=50, feature_names=[f])
    ...     for f in ("user", "item")])
    >>> model = NCF(ebc, dense_in_features=0, hidden=(8, 4))
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["user", "item"], values=torch.tensor([1, 2, 7, 9]), lengths=torch.tensor([1, 1, 1, 1]))
    >>> users, items = model.encode(torch.zeros(2, 0), kjt)
    >>> model.score(users, items).shape, model(torch.zeros(2, 0), kjt).shape
    (torch.Size([2, 2]), torch.Size([2]))
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import collection_layout, mlp
from models._retrieval import check_features

__all__ = ["NCF"]


class NCF(nn.Module):
    """NeuMF over an injected embedding-bag collection with a user and an item feature.

    Args:
        embedding_bag_collection: pools each feature to (B, D); torchrec's
            EmbeddingBagCollection or recps' PS-backed one.
        dense_in_features: must be 0 (NCF reads ids only); the engine passes the data's count.
        user_feature, item_feature: the id features.
        gmf_dim: Dg, the GMF part of each row (default D // 2); the MLP gets the other D - Dg.
        hidden: ReLU layer sizes of the MLP tower (the paper's towers halve: 4f, 2f, f).
        dropout: dropout after each MLP layer.
    """

    def __init__(
        self,
        embedding_bag_collection: nn.Module,
        dense_in_features: int = 0,
        user_feature: str = "user",
        item_feature: str = "item",
        gmf_dim: int | None = None,
        hidden: Sequence[int] = (32, 16, 8),
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        names, dim = collection_layout(embedding_bag_collection, "NCF")
        check_features(names, [user_feature], "NCF", "user_feature")
        check_features(names, [item_feature], "NCF", "item_feature")
        if dense_in_features:
            raise ValueError(f"NCF: the data has {dense_in_features} dense inputs; NCF reads user and item ids "
                             "only: use a data set without dense columns or another model")
        gmf_dim = dim // 2 if gmf_dim is None else int(gmf_dim)
        if not 0 < gmf_dim < dim:
            raise ValueError(f"NCF: gmf_dim={gmf_dim} with table width D={dim}; use 0 < gmf_dim < D "
                             "(the rest of each row is the MLP embedding)")
        if not hidden:
            raise ValueError("NCF: hidden is empty; give the MLP tower at least one layer, e.g. [32, 16, 8]")
        self.sparse_arch = embedding_bag_collection
        self.user_feature, self.item_feature = user_feature, item_feature
        self.gmf_dim = gmf_dim
        mlp_dim = dim - gmf_dim
        # The first MLP layer over [user_mlp, item_mlp] is W_u·user + W_i·item + b: kept as two
        # halves so that scoring B users against C items costs B + C products, not B·C.
        self.mlp_user = nn.Linear(mlp_dim, hidden[0])
        self.mlp_item = nn.Linear(mlp_dim, hidden[0], bias=False)
        self.mlp_rest = nn.Sequential(nn.ReLU(), nn.Dropout(dropout) if dropout > 0 else nn.Identity(),
                                      mlp(hidden[0], hidden[1:], dropout=dropout))
        self.head = nn.Linear(gmf_dim + hidden[-1], 1)

    def encode(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(users (B, D), items (B, D)): the rows' user and item embeddings, from one lookup."""
        pooled = self.sparse_arch(sparse)  # KeyedTensor, values (B, F*D)
        return pooled[self.user_feature], pooled[self.item_feature]  # (B, D), (B, D)

    def score(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Logits (B, C) of every user (B, D) against every item (C, D)."""
        g = self.gmf_dim
        w = self.head.weight.squeeze(0)  # (Dg + H_last,) the head over [gmf, tower], split below
        gmf = (users[:, :g] * w[:g]) @ items[:, :g].t()  # (B, C)
        first = self.mlp_user(users[:, g:]).unsqueeze(1) + self.mlp_item(items[:, g:]).unsqueeze(0)  # (B, C, H0)
        tower = self.mlp_rest(first)  # (B, C, H_last)
        return gmf + tower @ w[g:] + self.head.bias  # (B, C)

    def score_pairs(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Logits (B,) of user b (B, D) against item b (B, D): NeuMF as in the paper."""
        g = self.gmf_dim
        gmf = users[:, :g] * items[:, :g]  # (B, Dg)
        tower = self.mlp_rest(self.mlp_user(users[:, g:]) + self.mlp_item(items[:, g:]))  # (B, H_last)
        return self.head(torch.cat([gmf, tower], dim=1)).squeeze(1)  # (B,)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Logits (B,) of each row's own (user, item) pair."""
        return self.score_pairs(*self.encode(dense, sparse))  # (B,)
