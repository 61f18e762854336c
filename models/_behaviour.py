"""Bookkeeping shared by the behaviour-sequence rankers (DIN, BST); no forward pass here.

Both read one KeyedJaggedTensor through an injected, unpooled EmbeddingCollection:

    target features    one key per row each (e.g. item_id, category)          -> target  (B, Ft*D)
    history features   0..L keys per row, oldest first, one per target field
                       (e.g. history_item_id pairs with item_id), equal lengths -> history (B, L, Ft*D)
    history flags      0..L keys per row, the same lengths (e.g. click / long
                       view as key 0 or 1); each flag's row is added to the
                       history position's first field (its item)
    other features     anything else (user_id, exposures, ...), mean of its keys -> others (B, Fo*D)

Shapes: B rows, L the batch's longest history, D embedding dim, Ft target fields, Fo other features.
Position j of row b is real iff mask[b, j] (j < that row's history length); the padded
positions of `history` hold zeros, and the models must not let them matter.

A table may serve a target feature and its history feature both (torchrec's
`EmbeddingConfig(feature_names=["item_id", "history_item_id"])`): the paper's setting, one
row per item whether it is the target or in the history.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from models._layers import collection_layout

__all__ = ["BehaviourFeatures", "BehaviourInputs", "padded"]


class BehaviourInputs(NamedTuple):
    """One batch's embedded behaviour inputs (shapes in the module docstring)."""

    target: torch.Tensor   # (B, Ft*D)
    history: torch.Tensor  # (B, L, Ft*D), zeros where ~mask
    mask: torch.Tensor     # (B, L) bool, True at real positions
    others: torch.Tensor   # (B, Fo*D)


def padded(jt: JaggedTensor, b: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x (B, L, D) with zeros after each row's keys, mask (B, L)) of a JaggedTensor of (N, D) values;
    L = `length` or the longest row."""
    lengths = jt.lengths()  # (B,)
    values = jt.values()  # (N, D)
    longest = int(lengths.max()) if lengths.numel() else 0
    length = longest if length is None else max(int(length), longest)
    mask = torch.arange(length, device=values.device)[None, :] < lengths[:, None]  # (B, L)
    x = values.new_zeros(b, length, values.shape[1])  # (B, L, D)
    x[mask] = values  # row-major mask order = the jagged order
    return x, mask


class BehaviourFeatures:
    """Checks the feature names against the injected collection, then embeds a KJT into BehaviourInputs.

    Args:
        collection: torchrec EmbeddingCollection or recps' local / PS-backed one (unpooled).
        model: the model's name, for messages.
        target_features, history_features, history_flags, other_features: as in the module
            docstring; other_features=None takes every feature the others do not name.
    """

    def __init__(self, collection, model: str, target_features: Sequence[str], history_features: Sequence[str],
                 history_flags: Sequence[str] = (), other_features: Sequence[str] | None = None) -> None:
        names, dim = collection_layout(collection, model)
        self.model = model
        self.dim = dim
        self.target = list(target_features)
        self.history = list(history_features)
        self.flags = list(history_flags)
        if not self.target:
            raise ValueError(f"{model}: target_features is empty; name the target item's features, e.g. "
                             "[item_id, category]")
        if len(self.history) != len(self.target):
            raise ValueError(f"{model}: history_features {self.history} and target_features {self.target} differ "
                             "in number; name one history feature per target feature, in the same order")
        named = [*self.target, *self.history, *self.flags]
        if len(set(named)) != len(named):
            raise ValueError(f"{model}: a feature is named twice among target_features {self.target}, "
                             f"history_features {self.history} and history_flags {self.flags}; name each once")
        if other_features is None:
            other_features = [n for n in names if n not in named]
        self.others = list(other_features)
        missing = [f for f in [*named, *self.others] if f not in names]
        if missing:
            raise ValueError(f"{model}: features {missing} are not served by the injected collection, which serves "
                             f"{names}; fix the model's feature names or the dataset's features")

    @property
    def width(self) -> int:
        """Ft*D, the width of a target or history position."""
        return len(self.target) * self.dim

    def embed(self, collection, sparse: KeyedJaggedTensor) -> BehaviourInputs:
        """One lookup of every feature; padding, pairing and pooling as the module docstring says."""
        b = sparse.stride()
        out = collection(sparse)  # {feature: JaggedTensor of (N_f, D)}
        lengths = out[self.history[0]].lengths()  # (B,)
        for f in [*self.history[1:], *self.flags]:
            if not torch.equal(out[f].lengths(), lengths):
                raise ValueError(f"{self.model}: history feature {f!r} has other row lengths than "
                                 f"{self.history[0]!r}; every history feature and flag needs one key per "
                                 "history position (fix the reader's history columns)")
        target = torch.cat([_mean(out[f], b) for f in self.target], dim=1)  # (B, Ft*D)
        first, mask = padded(out[self.history[0]], b)  # (B, L, D), (B, L)
        parts = [first, *(padded(out[f], b)[0] for f in self.history[1:])]  # Ft x (B, L, D)
        for f in self.flags:
            parts[0] = parts[0] + padded(out[f], b)[0]  # (B, L, D): the flag joins the item field
        history = torch.cat(parts, dim=2)  # (B, L, Ft*D)
        others = (torch.cat([_mean(out[f], b) for f in self.others], dim=1) if self.others
                  else history.new_zeros(b, 0))  # (B, Fo*D)
        return BehaviourInputs(target, history, mask, others)


def _mean(jt: JaggedTensor, b: int) -> torch.Tensor:
    """(B, D): the mean of each row's keys' rows (one key: the row itself; none: zeros)."""
    x, mask = padded(jt, b)  # (B, L, D), (B, L)
    return x.sum(1) / mask.sum(1, keepdim=True).clamp(min=1).to(x.dtype)  # (B, D)
