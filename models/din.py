"""DIN: the Deep Interest Network, target attention over the user's behaviour history.

Paper: Zhou et al., "Deep Interest Network for Click-Through Rate Prediction", KDD 2018,
https://arxiv.org/abs/1706.06978. The user's interest is not one vector: for each candidate
(the target) a local activation unit weighs every past behaviour by its relevance to that
target, v_U(A) = sum_j a(e_j, v_A) * e_j, and the weights are NOT normalised by a softmax
(the paper keeps the sum's intensity: a user with many relevant behaviours scores higher).
The activation unit is an MLP over [e_j, v_A, e_j - v_A, e_j * v_A] (the authors' code; the
paper draws the product as an "out product" joined to both inputs); the activations are
Dice (the paper's, a PReLU whose switch point follows the batch's statistics) or PReLU.

Shapes: B rows, L the batch's longest history, N its real history positions (sum of lengths),
D embedding dim, Ft target fields (e.g. item_id, category), E = Ft*D, Fo other features,
I dense inputs.

    sparse KJT ─► EmbeddingCollection (injected, unpooled) ─┬─ target fields ─► concat ─► target t (B, E)
                                                             ├─ history fields (+ flags) ─► h (B, L, E), mask (B, L)
                                                             └─ other features ─► mean of keys ─► others (B, Fo*D)
    real positions of h (N, E), t per position (N, E)
        ─► activation unit: MLP([h, t, h - t, h * t]) ─► a (N,)        (padded positions: weight 0, never computed)
    weighted sum  Σ_j a_j h_j ─► interest (B, E)
    [others, t, interest, dense] (B, Fo*D + 2E + I) ─► MLP (Dice | PReLU) ─► Linear ─► logits (B,)

Only real history positions enter the activation unit, so padding (its content, or more of
it) changes nothing, in training too (Dice's batch statistics see real positions only). A row
with an empty history has interest 0. Rows are history-length-free: there is no max_len.

The paper's other contribution, mini-batch aware regularisation, is a training rule (L2 on the
rows a batch touches); here the injected collection's optimizer owns the rows.

Example:
    >>> import torch
    >>> from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
    >>> _ = torch.manual_seed(0)
    >>> ec = EmbeddingCollection(tables=[           # one table per entity: target and history share rows
    ...     EmbeddingConfig(name="t_item", embedding_dim=4, num_embeddings=50,
    ...                     feature_names=["item_id", "history_item_id"]),
    ...     EmbeddingConfig(name="t_category", embedding_dim=4, num_embeddings=10,
    ...                     feature_names=["category", "history_category"]),
    ...     EmbeddingConfig(name="t_user", embedding_dim=4, num_embeddings=20, feature_names=["user_id"])])
    >>> model = DIN(ec, hidden=(16, 8), attention_hidden=(8,)).eval()
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(   # 2 rows; histories of 3 and 0 items
    ...     keys=["user_id", "item_id", "category", "history_item_id", "history_category"],
    ...     values=torch.tensor([1, 2,  7, 8,  3, 4,  5, 6, 7,  1, 2, 3]),
    ...     lengths=torch.tensor([1, 1,  1, 1,  1, 1,  3, 0,  3, 0]))
    >>> model(torch.zeros(2, 0), kjt).shape
    torch.Size([2])
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._behaviour import BehaviourFeatures
from models._layers import check_dense

__all__ = ["DIN", "Dice"]


class Dice(nn.Module):
    """Dice (the DIN paper's eq. 9): f(s) = p(s)*s + (1 - p(s))*alpha*s, p(s) = sigmoid of s
    standardised by the batch's mean and variance (running estimates in eval), per unit.

    Input (M, H): M rows (examples, or real history positions), H units."""

    def __init__(self, width: int, eps: float = 1e-8) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(width, eps=eps, affine=False)
        self.alpha = nn.Parameter(torch.zeros(width))

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(self.norm(s))  # (M, H)
        return p * s + (1 - p) * self.alpha * s  # (M, H)


def _mlp(in_features: int, hidden: Sequence[int], activation: str, dropout: float = 0.0) -> nn.Sequential:
    """Linear + Dice/PReLU per hidden size, then a Linear to 1 (no activation)."""
    layers: list[nn.Module] = []
    width = in_features
    for size in hidden:
        layers += [nn.Linear(width, size), Dice(size) if activation == "dice" else nn.PReLU(size)]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = size
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


class DIN(nn.Module):
    """DIN over an injected, unpooled EmbeddingCollection.

    Args:
        embedding_collection: embeds every key (torchrec EmbeddingCollection, recps' local or
            PS-backed one); one dim D for every table.
        dense_in_features: I, dense inputs joined to the MLP's input (0: none).
        target_features: the candidate's features, one key per row (item, its category, ...).
        history_features: the history's features, one per target feature in the same order,
            0..L keys per row, oldest first (their order does not matter to DIN).
        history_flags: per-position features of the history (e.g. click / long view as keys
            0/1); each one's row is added to the position's item field.
        other_features: features that join the MLP as the mean of their keys' rows; None: every
            feature of the collection that the lists above do not name (user_id, ...).
        attention_hidden: the activation unit's layer sizes (the authors' code: 80, 40).
        hidden: the MLP's layer sizes (the paper: 200, 80).
        activation: "dice" (the paper's) or "prelu", in both MLPs.
        dropout: after each layer of the MLP.

    forward(dense (B, I), sparse KJT) -> logits (B,).
    """

    def __init__(
        self,
        embedding_collection: nn.Module,
        dense_in_features: int = 0,
        target_features: Sequence[str] = ("item_id", "category"),
        history_features: Sequence[str] = ("history_item_id", "history_category"),
        history_flags: Sequence[str] = (),
        other_features: Sequence[str] | None = None,
        attention_hidden: Sequence[int] = (80, 40),
        hidden: Sequence[int] = (200, 80),
        activation: str = "dice",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if activation not in ("dice", "prelu"):
            raise ValueError(f"DIN: activation={activation!r}; use 'dice' (the paper's) or 'prelu'")
        self.features = BehaviourFeatures(embedding_collection, "DIN", target_features, history_features,
                                          history_flags, other_features)
        e = self.features.width
        self.dense_in_features = int(dense_in_features)
        self.sparse_arch = embedding_collection
        self.attention = _mlp(4 * e, attention_hidden, activation)
        self.over_arch = _mlp(len(self.features.others) * self.features.dim + 2 * e + self.dense_in_features, hidden,
                              activation, dropout)

    def interest(self, target: torch.Tensor, history: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, E): Σ_j a(h_j, t) h_j over the real positions (mask (B, L)) of history (B, L, E), target t (B, E)."""
        h = history[mask]  # (N, E)
        t = target.unsqueeze(1).expand_as(history)[mask]  # (N, E)
        a = self.attention(torch.cat([h, t, h - t, h * t], dim=1)).squeeze(1)  # (N,)
        weights = history.new_zeros(mask.shape)  # (B, L)
        weights[mask] = a
        return (weights.unsqueeze(2) * history).sum(1)  # (B, E): no softmax, as the paper

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Logits (B,) of each row's target given its history."""
        check_dense(dense, self.dense_in_features, "DIN")
        x = self.features.embed(self.sparse_arch, sparse)
        interest = self.interest(x.target, x.history, x.mask)  # (B, E)
        joined = torch.cat([x.others, x.target, interest, dense], dim=1)  # (B, Fo*D + 2E + I)
        return self.over_arch(joined).squeeze(1)  # (B,)
