"""`ps=local` for sequence models: an EmbeddingCollection (no pooling) over FBGEMM's fused TBE.

torchrec's FusedEmbeddingCollection refuses CPU, so this collection looks every key up as a
bag of one key in a `LocalEmbeddingBagCollection` (FusedEmbeddingBagCollection): the
sum of one row is the row, and the fused optimizer still updates the rows inside the
backward pass, as the trainer expects of every collection. Same interface as torchrec's
EmbeddingCollection and recps' `PSEmbeddingCollection`:

    KJT (F features, B rows, N_f keys of feature f) ──► {feature: JaggedTensor(values (N_f, D), lengths (B,))}

Shapes: B rows of the KJT, F features, N_f keys of feature f, M = max_f N_f, D embedding dim.

Example:
    >>> import torch
    >>> from torchrec import KeyedJaggedTensor
    >>> ec = LocalEmbeddingCollection(["item"], embedding_dim=4, num_embeddings=10, optimizer="sgd", lr=1.0)
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(["item"], torch.tensor([3, 5, 3]), torch.tensor([2, 1]))
    >>> out = ec(kjt)["item"]
    >>> out.values().shape, out.lengths().tolist()
    (torch.Size([3, 4]), [2, 1])
    >>> bool((out.values()[0] == out.values()[2]).all())   # key 3 twice: the same row
    True
    >>> two = LocalEmbeddingCollection(["a", "b"], embedding_dim=4, num_embeddings=10)
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([1, 2, 3, 4, 4]), torch.tensor([1, 0, 2, 2]))
    >>> out = two(kjt)                                   # a: 1 key, b: 4 keys (M = 4 bags per feature)
    >>> [(f, tuple(jt.values().shape), jt.lengths().tolist()) for f, jt in out.items()]
    [('a', (1, 4), [1, 0]), ('b', (4, 4), [2, 2])]
    >>> bool((out["b"].values()[2] == out["b"].values()[3]).all())
    True
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from recps.errors import ConfigError
from recps.embeddings.local_embedding import LocalEmbeddingBagCollection

__all__ = ["LocalEmbeddingCollection"]


class LocalEmbeddingCollection(nn.Module):
    """One table `t_<name>` per feature, rows trained in the backward pass by FBGEMM.

    Args: as `LocalEmbeddingBagCollection` (keys are folded into `num_embeddings` rows
    with a modulo; readers that number items 0..C-1 give num_embeddings=C, a bijection).
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
        self.bags = LocalEmbeddingBagCollection(feature_names, embedding_dim, num_embeddings, optimizer=optimizer,
                                                lr=lr, eps=eps, init_std=init_std, device=device)
        self.feature_names = list(self.bags.feature_names)
        self.input_device = self.bags.input_device  # where forward() reads the KJT
        self.embedding_dim = self.bags.embedding_dim
        self._configs = [EmbeddingConfig(name=c.name, embedding_dim=c.embedding_dim, num_embeddings=c.num_embeddings,
                                         feature_names=list(c.feature_names))
                         for c in self.bags.embedding_bag_configs()]

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self._configs)

    @property
    def fused_optimizer(self):
        return self.bags.fused_optimizer

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """KJT of int64 keys → {feature: JaggedTensor(values (N_f, D), lengths (B,))}."""
        names = self.feature_names
        if list(features.keys()) != names:
            missing = [n for n in names if n not in features.keys()]
            if missing:
                raise ConfigError(f"LocalEmbeddingCollection: the batch has no features {missing}; batch features "
                                  f"are {features.keys()}; align dataset.schema and the model")
            features = features.permute([features.keys().index(n) for n in names])
        batch = features.stride()
        lengths = features.lengths().view(len(names), batch)  # (F, B)
        counts = lengths.sum(1)  # (F,)
        most = int(counts.max()) if counts.numel() else 0
        # Feature f's N_f keys become N_f bags of one key, then M - N_f empty bags (sum = 0).
        ones = (torch.arange(most, device=counts.device)[None, :] < counts[:, None]).to(lengths.dtype)  # (F, M)
        bags = KeyedJaggedTensor(keys=names, values=features.values(), lengths=ones.reshape(-1), stride=most)
        rows = self.bags(bags).values()  # (M, F*D)
        dim = self.embedding_dim
        return {name: JaggedTensor(values=rows[: int(counts[f]), f * dim:(f + 1) * dim], lengths=lengths[f])
                for f, name in enumerate(names)}
