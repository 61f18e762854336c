"""recps.serve.versions.apply_delta: a delta's rows are written over or added, then its deleted keys go
(SparseTable.load's order), and neither input changes (the served version is never written); over real
saves (a base, a delta after a shrink, an empty delta) it holds exactly what SparseTable.load makes."""

from __future__ import annotations

import torch

from recps.job.checkpoint import SparseRows
from recps.ps.table import AdagradRule, CtrAccessor, Initializer, SparseTable
from recps.ps.table.checkpoint import read_table
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


def test_applied_saves_hold_what_the_tables_own_load_holds(tmp_path):
    d = 4
    acc = CtrAccessor(base_threshold=2.0, delta_threshold=0.25, delete_threshold=0.1)

    def table() -> SparseTable:
        return SparseTable(d, optimizer=AdagradRule(lr=0.1), seed=11, initializer=Initializer("normal", std=0.1),
                           accessor=acc)

    keys = torch.arange(-60, 60)
    trainer, g = table(), torch.Generator().manual_seed(0)
    for _ in range(3):  # a clicked key (key % 3 == 0) reaches score 3, the others 0.3
        trainer.push(keys, torch.randn(keys.numel(), d, generator=g), shows=torch.ones(keys.numel()),
                     clicks=(keys % 3 == 0).float())
    trainer.save(tmp_path / "base", "base")
    changed = keys[::5]
    trainer.push(changed, torch.ones(changed.numel(), d), shows=torch.full((changed.numel(),), 5.0),
                 clicks=torch.zeros(changed.numel()))
    trainer.push(torch.tensor([5000, 5001]), torch.ones(2, d), shows=torch.full((2,), 5.0), clicks=torch.full((2,), 3.0))
    trainer.set_stats(keys[::4], show=0.0, click=0.0)  # clicked or not: shrink deletes them
    assert trainer.shrink() > 0
    trainer.save(tmp_path / "delta1", "delta")
    trainer.save(tmp_path / "delta2", "delta")  # nothing changed since: empty

    served, reference = read_table(tmp_path / "base"), table()
    reference.load(tmp_path / "base")
    for delta in ("delta1", "delta2"):
        served = apply_delta(served, read_table(tmp_path / delta))
        reference.load(tmp_path / delta)
    expected = torch.sort(reference.keys()).values
    assert torch.equal(served.keys, expected) and not torch.isin(served.keys, keys[::4]).any()
    assert torch.equal(served.values, reference.pull(expected, create=False))
