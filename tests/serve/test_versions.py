"""recps.serve.versions.apply_delta: a delta's rows are written over or added, then its deleted keys go
(SparseTable.load's order), and neither input changes (the served version is never written)."""

from __future__ import annotations

import torch

from recps.job.checkpoint import SparseRows
from recps.serve.versions import apply_delta


def rows(keys, values, deleted=None) -> SparseRows:
    k = torch.tensor(keys, dtype=torch.int64)
    order = torch.argsort(k)
    v = torch.tensor(values, dtype=torch.float32).reshape(len(keys), -1)
    return SparseRows(k[order], v[order], deleted=None if deleted is None else torch.tensor(deleted, dtype=torch.int64))


def test_a_delta_overwrites_adds_then_deletes_without_changing_its_inputs():
    held = rows([5, -3, 9, 2], [[1.0], [2.0], [3.0], [4.0]])
    delta = rows([9, 7, 2], [[30.0], [70.0], [40.0]], deleted=[-3, 2, 11])  # 2: written, then deleted
    before = (held.keys.clone(), held.values.clone(), delta.keys.clone(), delta.values.clone())
    out = apply_delta(held, delta)
    assert out.keys.tolist() == [5, 7, 9]  # ascending, as SparseRows.lookup needs
    assert out.values.reshape(-1).tolist() == [1.0, 70.0, 30.0]
    assert all(torch.equal(a, b) for a, b in zip(before, (held.keys, held.values, delta.keys, delta.values)))
    assert out.lookup(torch.tensor([7, -3, 5])).reshape(-1).tolist() == [70.0, 0.0, 1.0]  # -3 deleted: a zero row


def test_a_delta_on_nothing_is_its_own_rows():
    delta = rows([4, 1], [[1.0, 2.0], [3.0, 4.0]], deleted=[])
    out = apply_delta(None, delta)
    assert out.keys.tolist() == [1, 4] and out.values.tolist() == [[3.0, 4.0], [1.0, 2.0]]
    empty = SparseRows(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2))
    assert torch.equal(apply_delta(empty, delta).values, out.values)
