"""recps.embeddings.LocalEmbeddingBagCollection: its direct TBE lookup equals torchrec's forward exactly."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recps.embeddings import LocalEmbeddingBagCollection

NAMES = ["C1", "C2", "C3"]


def _batch(g: torch.Generator, batch: int) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (len(NAMES) * batch,), generator=g)  # empty bags and multi-key bags
    values = torch.randint(0, 2 ** 40, (int(lengths.sum()),), generator=g)  # raw 64-bit-like keys
    return KeyedJaggedTensor(keys=NAMES, values=values, lengths=lengths)


@pytest.mark.parametrize("dim, optimizer", [(9, "rowwise_adagrad"), (8, "adagrad"), (4, "sgd")])
def test_the_direct_lookup_trains_as_torchrecs_forward(dim, optimizer):
    """Outputs, gradients' effect on the rows (the fused optimizer) and the dense gradient: equal bit
    for bit over several steps, with and without the direct lookup."""
    collections = []
    for direct in (True, False):
        torch.manual_seed(0)
        c = LocalEmbeddingBagCollection(NAMES, dim, 50, optimizer=optimizer, lr=0.1, init_std=0.1)
        assert c._lookup is not None  # torchrec groups these tables into one lookup
        if not direct:
            c._lookup = None  # torchrec's FusedEmbeddingBagCollection.forward
        collections.append(c)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        kjt, up = _batch(g, 6), torch.randn(6, len(NAMES) * dim, generator=g)
        outs = []
        for c in collections:
            x = torch.zeros(6, len(NAMES) * dim, requires_grad=True)
            out = c(kjt)
            (out.values() * (up + x)).sum().backward()
            outs.append((out.values().detach(), out.keys(), out.length_per_key()))
        assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1:] == outs[1][1:]
        for (name, a), (_, b) in zip(collections[0].fused.state_dict().items(),
                                     collections[1].fused.state_dict().items()):
            assert torch.equal(a, b), name
    torch.manual_seed(0)
    untrained = LocalEmbeddingBagCollection(NAMES, dim, 50, optimizer=optimizer, lr=0.1, init_std=0.1)
    key = "embedding_bags.t_C1.weight"
    assert not torch.equal(collections[0].fused.state_dict()[key], untrained.fused.state_dict()[key])  # rows trained


def test_keys_in_another_order_are_selected_first():
    torch.manual_seed(0)
    c = LocalEmbeddingBagCollection(NAMES, 4, 50, init_std=0.1)
    kjt = _batch(torch.Generator().manual_seed(2), 3)
    permuted = kjt.permute([2, 0, 1])  # C3, C1, C2
    with torch.no_grad():
        assert torch.equal(c(permuted).values(), c(kjt).values())


def test_the_lookup_adds_no_module_or_state():
    """Checkpoints hold each table once, under torchrec's names, as before the direct lookup."""
    c = LocalEmbeddingBagCollection(NAMES, 9, 50)
    assert list(c.state_dict()) == [f"fused.embedding_bags.t_{n}.weight" for n in NAMES]
    assert [n for n, _ in c.named_parameters()] == list(c.state_dict())
