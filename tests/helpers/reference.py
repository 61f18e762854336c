"""The plain-torch twin of a small PS-backed CTR-DNN: the data, the model and the SGD reference that
the GEO tests (tests/ps/modes/test_geo.py) and the device tests (tests/test_cuda.py) compare the
PS modes against, equal to float tolerance."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedTensor

from models import CTRDNN
from recps.data.reader import Examples
from recps.ps.embedding import PSEmbeddingBagCollection, salted_keys
from recps.ps.table import Initializer

__all__ = ["FEATURES", "DIM", "INIT", "examples", "ReferenceEBC", "make_model", "reference_sgd"]

FEATURES = ["C1", "C2", "C3", "C4"]
DIM = 9  # not a multiple of 4: the TBE pads to 12 and must not change the arithmetic
INIT = {"kind": "uniform", "low": -0.1, "high": 0.1}


def examples(n: int, vocab: int = 40, seed: int = 0) -> Examples:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, vocab, (n, len(FEATURES)), generator=g)  # small vocabulary: many repeats
    dense = torch.randn(n, 3, generator=g)
    labels = ((keys[:, 0] % 3 == 0) ^ (dense[:, 0] > 0.5)).float().unsqueeze(1)
    return Examples(tuple(FEATURES), dense, keys, labels)


class ReferenceEBC(nn.Module):
    """Plain torch: every key of `data` as a row of one Parameter, initialized as the servers do."""

    def __init__(self, ps_ebc: PSEmbeddingBagCollection, data: Examples, seed: int = 0) -> None:
        super().__init__()
        self._configs = ps_ebc.embedding_bag_configs()
        all_keys = torch.cat([salted_keys(data.keys[:, i], f"t_{f}") for i, f in enumerate(FEATURES)])
        self.keys = torch.unique(all_keys)  # (U,) sorted
        self.weight = nn.Parameter(Initializer(**INIT)(self.keys, DIM, seed=seed))  # (U, D)

    def embedding_bag_configs(self):
        return self._configs

    def forward(self, kjt) -> KeyedTensor:
        b = kjt.stride()
        per_feature = kjt.values().view(len(FEATURES), b)  # one key per bag here
        ps_keys = torch.cat([salted_keys(per_feature[i], f"t_{f}") for i, f in enumerate(FEATURES)])
        idx = torch.searchsorted(self.keys, ps_keys)  # (F*B,)
        pooled = F.embedding_bag(idx, self.weight, torch.arange(idx.numel()), mode="sum")  # (F*B, D)
        values = pooled.view(len(FEATURES), b, DIM).transpose(0, 1).reshape(b, -1)  # (B, F*D)
        return KeyedTensor(keys=FEATURES, length_per_key=[DIM] * len(FEATURES), values=values)


def make_model(ebc, seed: int = 1) -> CTRDNN:
    torch.manual_seed(seed)
    return CTRDNN(ebc, dense_in_features=3, hidden=(16, 8))


def reference_sgd(ps_ebc: PSEmbeddingBagCollection, data: Examples, lr: float, dense_lr: float):
    """The plain-torch twin of a PS CTR-DNN: (its ReferenceEBC, the model, SGD at lr on the rows and
    dense_lr on the dense parameters)."""
    ref_ebc = ReferenceEBC(ps_ebc, data)
    ref = make_model(ref_ebc)
    ref_opt = torch.optim.SGD([{"params": [ref_ebc.weight], "lr": lr},
                               {"params": [p for n, p in ref.named_parameters() if n != "sparse_arch.weight"]}],
                              lr=dense_lr)
    return ref_ebc, ref, ref_opt


