"""`ps=local`: torchrec's FusedEmbeddingBagCollection (FBGEMM TBE with a fused optimizer).

Raw 64-bit feature keys are folded into `num_embeddings` rows per table (keys from the
readers are already well-mixed hashes, so a modulo is a fair bucketing). FBGEMM's TBE
needs row widths that are multiples of 4; other widths (CTR-DNN's 9) are padded inside
the kernel and sliced off the output, and the row-wise Adagrad rate is rescaled so the
padding does not change the arithmetic (its state is a mean over the padded width).

Shapes: B batch, F features, D embedding dim, P padded width (multiple of 4).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
from torch import nn
import torchrec.optim as trec_optim
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recps.errors import ConfigError

__all__ = ["LocalEmbeddingBagCollection", "EMBEDDING_OPTIMIZERS"]

# FBGEMM's CPU TBE trains with these only (Adam, LAMB and NONE are refused on CPU).
EMBEDDING_OPTIMIZERS: Mapping[str, type] = {
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "rowwise_adagrad": trec_optim.RowWiseAdagrad,
}


class LocalEmbeddingBagCollection(nn.Module):
    """One sum-pooled table per feature, trained in the backward pass by FBGEMM.

    Args:
        feature_names: the F sparse features, in KJT order; table `t_<name>` serves each.
        embedding_dim: D.
        num_embeddings: rows per table; keys are folded with a modulo.
        optimizer: "sgd", "adagrad" or "rowwise_adagrad".
        lr: learning rate; eps: Adagrad epsilon.
        init_std: rows start uniform in ±init_std·√3 (std init_std); 0 keeps torchrec's default.
        device: "cpu" or "cuda" ("cuda:N"): where the rows live and the TBE computes (FBGEMM's CPU
            TBE, or its CUDA TBE: EmbeddingLocation.DEVICE, ComputeDevice.CUDA); the batch's KJT
            must be there too (`input_device`, recps.embeddings.placement).
    """

    def __init__(
        self,
        feature_names: Sequence[str],
        embedding_dim: int,
        num_embeddings: int,
        optimizer: str = "rowwise_adagrad",
        lr: float = 0.05,
        eps: float = 1e-8,
        init_std: float = 0.0,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__()
        if optimizer not in EMBEDDING_OPTIMIZERS:
            raise ConfigError(
                f"ps.table.optimizer.name={optimizer!r}: FBGEMM's fused optimizers here are "
                f"{sorted(EMBEDDING_OPTIMIZERS)}; pick one of them"
            )
        if num_embeddings < 1 or embedding_dim < 1:
            raise ConfigError(
                f"num_embeddings={num_embeddings}, embedding_dim={embedding_dim}; both must be >= 1"
            )
        self.feature_names = list(feature_names)
        self.input_device = torch.device(device)  # where forward() reads the KJT: the TBE's device
        self.embedding_dim = int(embedding_dim)
        self.num_embeddings = int(num_embeddings)
        self.padded_dim = -(-self.embedding_dim // 4) * 4
        kwargs: dict = {"lr": lr}
        if optimizer != "sgd":
            kwargs["eps"] = eps
        if optimizer == "rowwise_adagrad" and self.padded_dim != self.embedding_dim:
            # state = mean(g²) over P columns = (D/P)·mean over D; scale lr and eps by √(D/P).
            scale = math.sqrt(self.embedding_dim / self.padded_dim)
            kwargs = {"lr": lr * scale, "eps": eps * scale}
        self._configs = [
            EmbeddingBagConfig(name=f"t_{name}", embedding_dim=self.embedding_dim,
                               num_embeddings=self.num_embeddings, feature_names=[name])
            for name in self.feature_names
        ]
        padded = [
            EmbeddingBagConfig(name=c.name, embedding_dim=self.padded_dim,
                               num_embeddings=c.num_embeddings, feature_names=c.feature_names)
            for c in self._configs
        ]
        self.fused = FusedEmbeddingBagCollection(
            tables=padded,
            optimizer_type=EMBEDDING_OPTIMIZERS[optimizer],
            optimizer_kwargs=kwargs,
            device=self.input_device,
        )
        if self.input_device.type != "cpu":
            # torchrec drew the rows' first values with the GPU's generator, where on the CPU it draws
            # them with the host's: the same draws here keep the host's generator where a CPU run has
            # it, so that the rows below and the dense layers built next start as on the CPU.
            for weight in self.fused.state_dict().values():
                torch.empty(weight.shape, dtype=weight.dtype).uniform_()
        if init_std > 0:
            bound = init_std * math.sqrt(3.0)
            with torch.no_grad():
                for weight in self.fused.state_dict().values():
                    # Drawn on the host (torch's CPU generator) and copied: a GPU's rows start equal to
                    # the CPU's (the same draws as an in-place uniform_ on the CPU, which this is there).
                    weight.copy_(torch.empty(weight.shape, dtype=weight.dtype).uniform_(-bound, bound))
        self._lookup = _single_lookup(self.fused, self.feature_names)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """Table configs with the true (unpadded) dim, as the models read them."""
        return list(self._configs)

    @property
    def fused_optimizer(self):
        return self.fused.fused_optimizer()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """KJT of raw int64 keys → KeyedTensor with values (B, F*D)."""
        if list(features.keys()) != self.feature_names:
            features = _select(features, self.feature_names)
        rows = torch.remainder(features.values(), self.num_embeddings)  # (sum of lengths,)
        if self._lookup is not None and not features.variable_stride_per_key():
            # What FusedEmbeddingBagCollection.forward computes, without its per-feature split and
            # re-concatenation (26 JaggedTensors a step, ~100 small ops): the same TBE call on the
            # same int32 indices and offsets, so the same values and the same row updates.
            offsets = features.offsets()  # (F*B + 1,) the cumsum of the lengths
            pooled = self._lookup(rows.int(), offsets.int(), None)  # (B, F*P)
        else:
            folded = KeyedJaggedTensor(
                keys=self.feature_names, values=rows, lengths=features.lengths(),
                stride=features.stride(),
            )
            pooled = self.fused(folded).values()  # (B, F*P)
        if self.padded_dim != self.embedding_dim:
            batch = pooled.shape[0]
            pooled = pooled.view(batch, len(self.feature_names), self.padded_dim)  # (B, F, P)
            pooled = pooled[:, :, : self.embedding_dim].reshape(batch, -1)  # (B, F*D)
        return KeyedTensor(
            keys=self.feature_names,
            length_per_key=[self.embedding_dim] * len(self.feature_names),
            values=pooled,
        )


def _select(features: KeyedJaggedTensor, names: list[str]) -> KeyedJaggedTensor:
    missing = [n for n in names if n not in features.keys()]
    if missing:
        raise ConfigError(
            f"the batch has no sparse features {missing} that the embedding tables expect; "
            f"batch features are {features.keys()}; align dataset.schema and the model"
        )
    return features.permute([features.keys().index(n) for n in names])


def _single_lookup(fused: FusedEmbeddingBagCollection, feature_names: list[str]):
    """The one batched TBE lookup of `fused` that serves every feature in `feature_names` order,
    called as lookup(indices, offsets, None) -> (B, F*P); None when torchrec grouped the tables
    otherwise (several lookups, another order, weighted bags): forward then goes through `fused`."""
    modules = getattr(fused, "_emb_modules", None)
    groups = getattr(fused, "_key_to_tables", None)
    if getattr(fused, "_is_weighted", True) or not modules or groups is None or len(modules) != 1:
        return None
    order = [name for tables in groups.values() for table in tables for name in table.feature_names]
    # The bound call, not the module: an nn.Module attribute would register it as a submodule (its
    # weights a second time in state_dict and checkpoints).
    return modules[0].__call__ if order == list(feature_names) else None

