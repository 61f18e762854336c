"""Small pieces shared by the zoo: reading the injected collection's layout, an MLP.

A model's forward pass stays in its own file; only this bookkeeping is shared.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

__all__ = ["check_dense", "collection_layout", "mlp"]


def collection_layout(collection: nn.Module, model: str) -> tuple[list[str], int]:
    """Feature names and the common embedding dim D of an injected embedding collection.

    Works for torchrec's EmbeddingBagCollection / EmbeddingCollection and recps'
    PS-backed twins (anything with `embedding_bag_configs()` or `embedding_configs()`).
    """
    if hasattr(collection, "embedding_bag_configs"):
        configs = collection.embedding_bag_configs()
    elif hasattr(collection, "embedding_configs"):
        configs = collection.embedding_configs()
    else:
        raise TypeError(
            f"{model}: the injected collection {type(collection).__name__} has neither "
            "embedding_bag_configs() nor embedding_configs(); pass a torchrec "
            "EmbeddingBagCollection or a recps PS-backed collection"
        )
    names = [name for cfg in configs for name in cfg.feature_names]
    dims = sorted({cfg.embedding_dim for cfg in configs})
    if len(dims) != 1:
        raise ValueError(
            f"{model}: embedding tables have dims {dims}; this model needs one dim for every "
            "table, set the same embedding_dim on all of them"
        )
    return names, dims[0]


def check_dense(dense, expected: int, model: str) -> None:
    """Raises if the dense input (B, I) does not have the I columns the model was built for."""
    if dense.dim() != 2 or dense.shape[1] != expected:
        raise ValueError(
            f"{model}: dense input has shape {tuple(dense.shape)} but the model was built with "
            f"dense_in_features={expected}; pass (B, {expected}) dense inputs, or build the model "
            "with the dataset schema's number of dense columns"
        )


def mlp(in_features: int, hidden: Sequence[int], out_features: int | None = None,
        dropout: float = 0.0) -> nn.Sequential:
    """Linear+ReLU per hidden size, then an optional linear head with no activation."""
    layers: list[nn.Module] = []
    width = in_features
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = size
    if out_features is not None:
        layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)


