"""KeyIndex against a Python dict: special keys, growth, deletion by rebuild."""

import torch

from recps.ps.table import KeyIndex
from recps.ps.table.key_index import MAX_LOAD


def test_special_keys_round_trip():
    keys = torch.tensor([-1, 0, -(2**63), 2**63 - 1, 2**62 + 1, -2])
    index = KeyIndex()
    index.insert(keys, torch.arange(6) + 100)
    assert index.lookup(keys).tolist() == [100, 101, 102, 103, 104, 105]
    assert index.lookup(torch.tensor([5, 2**62])).tolist() == [-1, -1]
    assert len(index) == 6
    got = dict(zip(*(t.tolist() for t in index.entries())))
    assert got == {k: 100 + i for i, k in enumerate(keys.tolist())}


def test_growth_keeps_every_key_and_load_bounded():
    g = torch.Generator().manual_seed(0)
    index = KeyIndex()
    reference = {}
    for step in range(8):
        keys = torch.randint(-(2**63), 2**63 - 1, (5000,), generator=g, dtype=torch.int64).unique()
        keys = keys[index.lookup(keys) < 0]
        slots = torch.arange(len(reference), len(reference) + keys.numel())
        index.insert(keys, slots)
        reference.update(zip(keys.tolist(), slots.tolist()))
        assert len(index) <= MAX_LOAD * index.capacity
    all_keys = torch.tensor(list(reference))
    assert index.lookup(all_keys).tolist() == list(reference.values())


def test_retain_deletes_by_slot_and_frees_buckets():
    index = KeyIndex()
    keys = torch.arange(-500, 500)  # includes -1
    index.insert(keys, torch.arange(1000))
    alive = torch.arange(1000) % 3 == 0
    index.retain(alive)
    slots = index.lookup(keys)
    expect = torch.where(alive, torch.arange(1000), -1)
    assert torch.equal(slots, expect)
    assert len(index) == int(alive.sum())
    # A deleted key can be inserted again with a new slot.
    index.insert(torch.tensor([-1 if not alive[499] else 7]), torch.tensor([5000]))
    assert index.lookup(torch.tensor([-1])).item() in (5000, 499)
    index.clear()
    assert len(index) == 0 and index.lookup(keys).eq(-1).all()
