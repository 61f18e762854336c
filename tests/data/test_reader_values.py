"""Bad values (issue 15 point 6): judged as training sees them, counted in the error budget, named
by file and line.

A dense 1e308 is finite in float64 but inf in float32, the training dtype (it used to pass and turn
the model NaN); a label of 7 is outside a binary task's [0, 1]. Both are bad rows in text and
Parquet files, through TabularReader and load_tensors, and through a composed config (the task's
label_range reaches the reader by conf/dataset's interpolation).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir

from recps.config import PROJECT_ROOT, register_resolvers
from recps.data import Schema, TabularReader, load_tensors
from recps.data.dataset import prepare_data
from recps.errors import ConfigError, DataError
from recps.tasks import BinaryTask
from recps.tasks.multitask import MultiTask

F32_MAX = float(np.finfo(np.float32).max)
SCHEMA = Schema(labels=("y",), dense=("x", "z"), sparse=("c",), label_range=[0, 1])
# line 1 is the header; lines 2.. the rows
CSV = "\n".join([
    "y,x,z,c",
    "1,2.5,0,a",      # 2 good
    "0,1e308,1,b",    # 3 dense x overflows float32
    "7,1,1,c",        # 4 label outside [0, 1]
    "1,1,-1e39,d",    # 5 dense z overflows float32 (negative)
    "0.5,3e38,2,e",   # 6 good: a soft label, a dense value float32 still holds
    "1e308,1,1,f",    # 7 label overflows float32
    "-1,1,1,g",       # 8 label outside [0, 1]
    "0,4,5,h",        # 9 good
]) + "\n"
BAD = {3: "dense x overflows float32", 4: "label y is outside [0, 1]", 5: "dense z overflows float32",
       7: "label y overflows float32", 8: "label y is outside [0, 1]"}


def read_all(paths, schema, **kw):
    reader = TabularReader(paths, schema, 64, **kw)
    batches = list(reader)
    return batches, reader.stats


def test_overflowing_dense_values_and_labels_outside_the_range_are_bad_rows(tmp_path, caplog):
    path = tmp_path / "v.csv"
    path.write_text(CSV)
    with caplog.at_level(logging.WARNING, logger="recps.data.reader"):
        [batch], stats = read_all([path], SCHEMA, error_budget=5)
    assert stats.rows == 3 and stats.bad_rows == 5
    assert batch.labels[:, 0].tolist() == [1.0, 0.5, 0.0]
    assert batch.dense.tolist() == [[2.5, 0.0], [float(np.float32(3e38)), 2.0], [4.0, 5.0]]
    assert torch.isfinite(batch.dense).all() and batch.dense.dtype == torch.float32
    for line, reason in BAD.items():
        assert f"skipped bad row {path}:{line}: {reason}" in caplog.text
    with pytest.raises(DataError, match=rf"5 bad rows out of 8 read .* first bad rows: {path}:3 \(dense x overflows "
                                        rf"float32 .*\); {path}:4 \(label y is outside \[0, 1\] "):
        read_all([path], SCHEMA, error_budget=4)


def test_the_check_follows_the_transform_and_the_dtype(tmp_path):
    # log1p(|x|) of an x that float32 cannot hold is inf as well: the row is bad either way.
    path = tmp_path / "t.csv"
    path.write_text("y,x,z,c\n1,1e308,1,a\n0,1e30,1,b\n")
    log_schema = Schema(labels=("y",), dense=("x", "z"), sparse=("c",), dense_transform="log1p")
    [batch], stats = read_all([path], log_schema, error_budget=1)
    assert stats.bad_rows == 1 and batch.dense[0, 0].item() == pytest.approx(float(np.log1p(np.float32(1e30))))
    # Without a label range a 7 is a value like any other (a regression label); inf never is.
    path.write_text("y,x,z,c\n7,1,1,a\ninf,1,1,b\n-3.5,1,1,c\n")
    [batch], stats = read_all([path], Schema(labels=("y",), dense=("x", "z"), sparse=("c",)), error_budget=1)
    assert batch.labels[:, 0].tolist() == [7.0, -3.5] and stats.bad_rows == 1
    # Per label: only the columns named are checked.
    path.write_text("click,watch,x,c\n1,250.5,1,a\n3,1,1,b\n")
    per_label = Schema(labels=("click", "watch"), dense=("x",), sparse=("c",), label_range={"click": [0, 1]})
    [batch], stats = read_all([path], per_label, error_budget=1)
    assert batch.labels.tolist() == [[1.0, 250.5]] and stats.bad_rows == 1


def test_parquet_rows_are_checked_alike_and_named_by_row(tmp_path, caplog):
    path = tmp_path / "v.parquet"
    table = pa.table({"y": pa.array([1.0, 7.0, 0.0, 1.0]), "x": pa.array([1.0, 2.0, 1e308, 4.0]),
                      "z": pa.array([0.0, 0.0, 0.0, 0.0]), "c": pa.array(["a", "b", "c", "d"])})
    pq.write_table(table, path)
    schema = dataclasses.replace(SCHEMA, format="parquet")
    with pytest.raises(DataError, match=rf"{path}: cannot parse the header line: .*; fix the file or "
                                        r"dataset.schema.format \('csv'\)"):
        load_tensors([path], SCHEMA)  # read as CSV: named, not a raw UnicodeDecodeError
    with caplog.at_level(logging.WARNING, logger="recps.data.reader"):
        ex = load_tensors([path], schema, error_budget=2)
    assert ex.labels[:, 0].tolist() == [1.0, 1.0] and ex.dense[:, 0].tolist() == [1.0, 4.0]
    assert f"{path} row 2: label y is outside [0, 1]" in caplog.text
    assert f"{path} row 3: dense x overflows float32" in caplog.text
    with pytest.raises(DataError, match="2 bad rows out of 4 read"):
        load_tensors([path], schema, error_budget=1)


def test_label_range_values_are_validated():
    with pytest.raises(ConfigError, match=r"dataset.schema.label_range=\[1, 0\] .*lo <= hi"):
        Schema(labels=("y",), label_range=[1, 0])
    with pytest.raises(ConfigError, match=r"names labels \['q'\] that dataset.schema.labels \['y'\] does not list"):
        Schema(labels=("y",), label_range={"q": [0, 1]})
    with pytest.raises(ConfigError, match=r"task.label_range='0-1': give \[lo, hi\]"):
        BinaryTask(label_range="0-1")
    assert BinaryTask().label_range == (0.0, 1.0) and MultiTask().label_range == (0.0, 1.0)
    assert BinaryTask(label_range=None).label_range is None
    assert Schema(**SCHEMA.__dict__).label_range == {"y": (0.0, 1.0)}  # the held form reads back


def compose_cfg(*overrides: str):
    register_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def criteo_csv(path: Path, labels: list[str], first_dense: list[str]) -> Path:
    header = ["Label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    rows = [[y, x] + ["1"] * 12 + ["68fd1e64"] * 26 for y, x in zip(labels, first_dense)]
    path.write_text("\n".join(",".join(r) for r in [header, *rows]) + "\n")
    return path


def test_the_binary_tasks_range_reaches_the_reader_through_the_config(tmp_path):
    train = criteo_csv(tmp_path / "train.csv", ["1", "0", "7", "1", "0", "1"], ["1", "2", "3", "1e308", "5", "6"])
    test = criteo_csv(tmp_path / "test.csv", ["0", "1"], ["1", "2"])
    files = [f"dataset.train=[{train}]", f"dataset.test=[{test}]", "dataset.test_fraction=0"]
    cfg = compose_cfg("dataset=criteo_tiny", "task=binary", *files, "dataset.error_budget=2")
    assert list(cfg.dataset.schema.label_range) == [0, 1]
    data = prepare_data(cfg.dataset)
    assert len(data.train) == 4 and data.train.examples.labels[:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]
    cfg = compose_cfg("dataset=criteo_tiny", "task=binary", *files, "dataset.error_budget=1")
    with pytest.raises(DataError, match=rf"first bad rows: {train}:4 \(label Label is outside \[0, 1\] .*\); "
                                        rf"{train}:5 \(dense I1 overflows float32"):
        prepare_data(cfg.dataset)
    # A task that trains on other values says so: task.label_range=[0, 10] keeps the 7.
    cfg = compose_cfg("dataset=criteo_tiny", "task=binary", *files, "dataset.error_budget=1", "task.label_range=[0,10]")
    assert prepare_data(cfg.dataset).train.examples.labels[:, 0].tolist() == [1.0, 0.0, 7.0, 0.0, 1.0]
