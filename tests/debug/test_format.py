"""The dump files (writer, index, reader) and diff_runs / the CLI on hand-written dumps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from recps.debug import DumpWriter, diff_runs, dump_files, read_index, read_record
from recps.debug.__main__ import main
from recps.errors import DataError


def write(folder, records, role="worker", rank=0, thread=0):
    out = DumpWriter(folder, role, rank, thread)
    for step, name, tensor in records:
        out.write(step, step, name, tensor)
    out.close()
    return out


def test_round_trip_of_every_dtype_and_shape(tmp_path):
    tensors = {
        "f32": torch.randn(3, 4),
        "f64": torch.tensor(2.5, dtype=torch.float64),  # a scalar
        "i64": torch.arange(-3, 3),
        "i32": torch.tensor([[1, 2]], dtype=torch.int32),
        "bool": torch.tensor([True, False, True]),
        "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "empty": torch.zeros(0, 7),
        "strided": torch.arange(12.0).view(3, 4).t(),  # not contiguous: written in C order
    }
    out = write(tmp_path, [(1, name, t) for name, t in tensors.items()])
    records = read_index(out.idx_path)
    assert [r.name for r in records] == list(tensors)
    data = np.fromfile(out.bin_path, dtype=np.uint8)
    assert data.nbytes == sum(r.nbytes for r in records) == records[-1].offset + records[-1].nbytes
    for r in records:
        t = tensors[r.name]
        assert r.shape == tuple(t.shape) and r.dtype == str(t.dtype).removeprefix("torch.")
        np.testing.assert_array_equal(read_record(data, r), t.float().numpy() if r.name == "bf16" else t.numpy())
    lines = out.idx_path.read_text().splitlines()
    assert lines[:2] == ["#recps-dump 1", "step\tbatch\tname\tdtype\tshape\toffset\tnbytes"]
    assert lines[3] == f"1\t1\tf64\tfloat64\t-\t{records[0].nbytes}\t8"


def test_bad_files_are_named(tmp_path):
    out = write(tmp_path / "dump", [(1, "w", torch.ones(4))])
    good = out.idx_path.read_text()
    out.idx_path.write_text(good + "2\t2\tw\tfloat32\tx\t16\t16\n")
    with pytest.raises(DataError, match=r"line 4: invalid literal"):
        read_index(out.idx_path)
    out.idx_path.write_text(good + "2\t2\tw\tfloat32\t4\t16\t16\n")  # the .bin lacks these bytes
    with pytest.raises(DataError, match=r"16 bytes but the index needs 32"):
        diff_runs(tmp_path, tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no dump files"):
        dump_files(tmp_path / "empty")
    with pytest.raises(DataError, match="name .* contains a tab"):
        DumpWriter(tmp_path / "x", "worker", 0, 0).write(1, 1, "a\tb", torch.ones(1))


def test_first_divergence_is_the_earliest_step_over_all_files(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for run, late, early in ((a, 0.0, 0.0), (b, 0.5, 1e-3)):
        # thread 0 diverges at step 4, thread 1 at step 3 (in its second record)
        write(run / "dump", [(1, "x", torch.zeros(2)), (4, "x", torch.tensor([late, 0.0]))], thread=0)
        write(run / "dump", [(2, "x", torch.zeros(2)), (3, "y", torch.zeros(1)), (3, "z", torch.tensor([early]))], thread=1)
    d = diff_runs(a, b).divergence
    assert (d.step, d.role, d.rank, d.thread, d.name) == (3, "worker", 0, 1, "z")
    assert d.max_abs_diff == pytest.approx(1e-3)
    d = diff_runs(a, b, atol=1e-2).divergence  # the small one is tolerated, the big one is not
    assert (d.step, d.thread, d.name, d.max_abs_diff) == (4, 0, "x", 0.5)
    assert diff_runs(a, b, atol=1.0).divergence is None
    assert diff_runs(a, a).divergence is None


def test_structural_divergences(tmp_path):
    a, b, c, d = (tmp_path / n for n in "abcd")
    write(a / "dump", [(1, "x", torch.zeros(2)), (2, "x", torch.zeros(2))])
    write(b / "dump", [(1, "x", torch.zeros(2))])  # stops early
    write(c / "dump", [(1, "x", torch.zeros(3)), (2, "x", torch.zeros(2))])  # other shape
    write(d / "dump", [(1, "x", torch.zeros(2)), (2, "x", torch.zeros(2))])
    write(d / "dump", [(1, "x", torch.zeros(2))], thread=1)  # a file a lacks
    div = diff_runs(a, b).divergence
    assert (div.step, div.name, div.max_abs_diff) == (2, "x", None) and "only run A has it" in div.reason
    div = diff_runs(a, c).divergence
    assert div.step == 1 and "A has x float32 (2,)" in div.reason and "B has x float32 (3,)" in div.reason
    div = diff_runs(a, d).divergence
    assert (div.step, div.thread) == (1, 1) and "only run B has the file worker0000-thread001" in div.reason


def test_nan_on_one_side_is_an_infinite_difference(tmp_path):
    write(tmp_path / "a" / "dump", [(1, "x", torch.tensor([1.0, float("nan")]))])
    write(tmp_path / "b" / "dump", [(1, "x", torch.tensor([1.0, 2.0]))])
    assert diff_runs(tmp_path / "a", tmp_path / "b").divergence.max_abs_diff == float("inf")


def test_a_scalar_record_that_diverges_is_measured(tmp_path):
    """0-d records (the loss, a scalar parameter) get a difference, not a TypeError."""
    write(tmp_path / "a" / "dump", [(1, "loss", torch.tensor(0.5)), (2, "loss", torch.tensor(float("nan")))])
    write(tmp_path / "b" / "dump", [(1, "loss", torch.tensor(0.75)), (2, "loss", torch.tensor(float("nan")))])
    div = diff_runs(tmp_path / "a", tmp_path / "b").divergence
    assert (div.step, div.name, div.shape, div.max_abs_diff) == (1, "loss", (), 0.25)


def test_cli_exit_codes_and_output(tmp_path, capsys):
    write(tmp_path / "a" / "dump", [(1, "x", torch.ones(2)), (2, "param/w", torch.ones(2))])
    write(tmp_path / "b" / "dump", [(1, "x", torch.ones(2)), (2, "param/w", torch.tensor([1.0, 1.25]))])
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "a" / "dump")]) == 0
    assert capsys.readouterr().out.startswith("no divergence: 1 dump files, 2 records")
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert capsys.readouterr().out.strip() == (
        "first divergence: step 2 (batch 2), worker 0, thread 0, param/w float32 (2,): max abs difference 0.25")
    assert main(["diff", "--json", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["identical"] is False and out["divergence"]["step"] == 2 and out["divergence"]["max_abs_diff"] == 0.25
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "missing")]) == 2
    assert "missing: no such folder" in capsys.readouterr().err
    assert main(["show", str(tmp_path / "b"), "--name", "param/*"]) == 0
    assert capsys.readouterr().out == "worker0\tthread0\t2\t2\tparam/w\tfloat32\t2\n"
