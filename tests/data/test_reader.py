"""Readers: formats agree, hashing is stable, shards partition, bad rows are handled loudly."""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recps.data import (
    Batch,
    Examples,
    Schema,
    TabularReader,
    TensorBatches,
    expand_paths,
    hash_strings,
    load_tensors,
    missing_key,
    slot_salt,
)
from recps.data.schema import CRITEO_DENSE, CRITEO_SPARSE
from recps.errors import ConfigError, DataError

SHARED_DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
CRITEO = Schema.criteo()
CRITEO_COLUMNS = ("label",) + CRITEO_DENSE + CRITEO_SPARSE


# ----------------------------------------------------------------------------- helpers


def criteo_rows(n: int, seed: int = 0) -> list[list[str]]:
    """n rows of Criteo text fields: label, 13 ints (some missing or negative), 26 categoricals."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        dense = [("" if rng.random() < 0.2 else str(int(rng.integers(-3, 5000)))) for _ in range(13)]
        cats = [("" if rng.random() < 0.15 else f"{int(rng.integers(0, 40)):08x}") for _ in range(26)]
        rows.append([str(int(rng.integers(0, 2)))] + dense + cats)
    return rows


def write_text(path: Path, rows: list[list[str]], sep: str = "\t", header: list[str] | None = None) -> Path:
    lines = ([sep.join(header)] if header else []) + [sep.join(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_parquet(path: Path, rows: list[list[str]], columns=CRITEO_COLUMNS, numeric=()) -> Path:
    """Categoricals as strings (null when empty); `numeric` columns as float64 (null when empty)."""
    data = {}
    for j, name in enumerate(columns):
        values = [r[j] for r in rows]
        if name in numeric:
            data[name] = pa.array([float(v) if v else None for v in values], pa.float64())
        else:
            data[name] = pa.array([v if v else None for v in values], pa.string())
    pq.write_table(pa.table(data), path, row_group_size=7)
    return path


def batches_equal(a: list[Batch], b: list[Batch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x.dense, y.dense)
        assert torch.equal(x.labels, y.labels)
        assert x.sparse.keys() == y.sparse.keys()
        assert torch.equal(x.sparse.values(), y.sparse.values())
        assert torch.equal(x.sparse.lengths(), y.sparse.lengths())


def read(paths, schema, batch_size=16, **kw) -> list[Batch]:
    return list(TabularReader(paths, schema, batch_size, **kw))


def log1p(x: float) -> float:
    return float(np.sign(x) * np.log1p(abs(x)))


# ----------------------------------------------------------------------------- formats


def test_every_format_gives_identical_batches(tmp_path):
    rows = criteo_rows(45)
    header = ["Id"] + list(CRITEO_COLUMNS)
    csv_schema = Schema(labels=("label",), dense=CRITEO_DENSE, sparse=CRITEO_SPARSE, dense_transform="log1p")
    sources = {
        "criteo": (write_text(tmp_path / "a.txt", rows), CRITEO),
        "csv header": (write_text(tmp_path / "b.csv", [[str(i)] + r for i, r in enumerate(rows)], ",", header),
                       csv_schema),
        "csv no header": (write_text(tmp_path / "c.csv", rows, ";"),
                          Schema(**{**csv_schema.__dict__, "header": False, "separator": ";", "columns": CRITEO_COLUMNS})),
        "parquet": (write_parquet(tmp_path / "d.parquet", rows), Schema(**{**csv_schema.__dict__, "format": "parquet"})),
        "parquet numeric": (write_parquet(tmp_path / "e.parquet", rows, numeric=("label",) + CRITEO_DENSE),
                            Schema(**{**csv_schema.__dict__, "format": "parquet"})),
    }
    results = {name: read([path], schema) for name, (path, schema) in sources.items()}
    reference = results.pop("criteo")
    assert [b.batch_size for b in reference] == [16, 16, 13]
    for name, batches in results.items():
        batches_equal(reference, batches)

    # The values themselves: row 0, field by field.
    first = reference[0]
    assert first.labels[0, 0].item() == float(rows[0][0])
    expected_dense = [log1p(float(v)) if v else 0.0 for v in rows[0][1:14]]
    assert first.dense[0].tolist() == pytest.approx(expected_dense, rel=1e-6)
    c1 = first.sparse["C1"].values()  # (B,)
    value = rows[0][14]
    assert c1[0].item() == (int(hash_strings([value], "C1")[0]) if value else missing_key("C1"))
    assert first.sparse.keys() == list(CRITEO_SPARSE)
    assert first.sparse.lengths().tolist() == [1] * (26 * 16)
    # Feature-major: the first B values are C1's for the B rows.
    assert torch.equal(first.sparse.values()[:16], c1)


def test_missing_values_are_zero_and_the_slot_missing_key(tmp_path):
    row = ["1"] + [""] * 13 + [""] * 26
    [batch] = read([write_text(tmp_path / "m.txt", [row])], CRITEO)
    assert batch.dense.tolist() == [[0.0] * 13]
    assert batch.sparse.values().tolist() == [missing_key(c) for c in CRITEO_SPARSE]


def test_urls_globs_folders_and_gzip_read_the_same(tmp_path):
    rows = criteo_rows(30, seed=1)
    plain = write_text(tmp_path / "part-0.txt", rows[:20])
    write_text(tmp_path / "part-1.txt", rows[20:])
    (tmp_path / "_SUCCESS").write_text("")
    with gzip.open(tmp_path / "all.txt.gz", "wt") as f:
        f.write("\n".join("\t".join(r) for r in rows) + "\n")
    reference = read([plain, tmp_path / "part-1.txt"], CRITEO)
    batches_equal(reference, read(str(tmp_path / "part-*.txt"), CRITEO))
    batches_equal(reference, read(["file://" + str(plain), "file://" + str(tmp_path / "part-1.txt")], CRITEO))
    batches_equal(reference, read([tmp_path / "all.txt.gz"], CRITEO))
    with fsspec.open("memory://recps-test/part-0.txt", "wb") as f:  # a non-local file system
        f.write(plain.read_bytes())
    with fsspec.open("memory://recps-test/part-1.txt", "wb") as f:
        f.write((tmp_path / "part-1.txt").read_bytes())
    batches_equal(reference, read("memory://recps-test/part-*.txt", CRITEO))
    (tmp_path / "all.txt.gz").unlink()
    assert expand_paths(tmp_path) == [str(tmp_path / "part-0.txt"), str(tmp_path / "part-1.txt")]


# ----------------------------------------------------------------------------- hashing


def _reference_key(value: str, slot: str) -> int:
    """The documented hash, one Python int at a time."""
    mask = (1 << 64) - 1

    def fmix(h: int) -> int:
        h ^= h >> 33
        h = (h * 0xFF51AFD7ED558CCD) & mask
        h ^= h >> 33
        h = (h * 0xC4CEB9FE1A85EC53) & mask
        return h ^ (h >> 33)

    data = value.encode("utf-8")
    h = fmix(slot_salt(slot) ^ ((len(data) * 0x9E3779B97F4A7C15) & mask))
    for i in range(0, max(len(data), 1), 8):
        h = fmix(h ^ int.from_bytes(data[i:i + 8].ljust(8, b"\0"), "little"))
    return h - (1 << 64) if h >= 1 << 63 else h


def test_hash_matches_its_documented_definition():
    rng = np.random.default_rng(3)
    alphabet = list("abcdefXYZ0123456789_-é€😀")
    values = ["", "a", "68fd1e64"] + ["".join(rng.choice(alphabet, int(rng.integers(0, 40)))) for _ in range(300)]
    assert hash_strings(values, "C7").tolist() == [_reference_key(v, "C7") for v in values]
    # An Arrow slice (non-zero offset), large_string and dictionary arrays hash alike.
    arr = pa.array(["skip"] + values)
    assert hash_strings(arr.slice(1), "C7").tolist() == hash_strings(values, "C7").tolist()
    assert hash_strings(pa.array(values, pa.large_string()), "C7").tolist() == hash_strings(values, "C7").tolist()
    assert hash_strings(arr.slice(1).dictionary_encode(), "C7").tolist() == hash_strings(values, "C7").tolist()
    assert hash_strings(pa.array([123, None]), "C7").tolist() == hash_strings(["123", ""], "C7").tolist()


def test_hash_is_distinct_per_slot():
    values = [f"{i:08x}" for i in range(200)] + [""]
    keys = np.stack([hash_strings(values, slot) for slot in CRITEO_SPARSE])  # (26, 201)
    assert len(np.unique(keys)) == keys.size  # no value collides within or across slots
    assert len({missing_key(s) for s in CRITEO_SPARSE}) == 26


@pytest.mark.e2e
def test_hash_is_stable_across_processes():
    values = ["68fd1e64", "", "a longer value than eight bytes", "é"]
    # Load hashing.py alone (no torch import) in a fresh interpreter with another hash seed.
    path = Path(importlib.util.find_spec("recps.data.hashing").origin)
    code = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('h', {str(path)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"print(json.dumps([m.hash_strings({values!r}, s).tolist() for s in ('C1', 'C2')]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [hash_strings(values, s).tolist() for s in ("C1", "C2")]


# ----------------------------------------------------------------------------- sharding


def _ids(batches: list[Batch]) -> list[int]:
    return [int(x) for b in batches for x in b.dense[:, 0].tolist()]


def test_shards_partition_the_rows(tmp_path):
    schema = Schema(labels=("y",), dense=("id",), sparse=("c",))
    files = []
    for f, (lo, hi) in enumerate([(0, 50), (50, 103)]):
        body = "y,id,c\n" + "".join(f"{i % 2},{i},v{i % 7}\n" for i in range(lo, hi))
        if f == 1:
            body += "1,2,3,4\n"  # one wrong-width line: skipped, owned by one shard
        files.append(tmp_path / f"{f}.csv")
        files[-1].write_text(body)
    everything = _ids(read(files, schema, error_budget=1))
    assert everything == list(range(103))
    for n in (2, 3):
        shards = []
        bad = 0
        for k in range(n):
            # A small block size makes many parsed blocks, so the global row count crosses them.
            reader = TabularReader(files, schema, 8, shard_index=k, num_shards=n, block_size=64, error_budget=1)
            ids = _ids(list(reader))
            assert ids == [i for i in range(103) if i % n == k]
            shards.append(set(ids))
            bad += reader.stats.bad_rows
        assert set.union(*shards) == set(range(103)) and sum(map(len, shards)) == 103
        assert bad == 1  # the bad line is counted by exactly one shard


def test_tensor_batches_match_the_reader(tmp_path):
    path = write_text(tmp_path / "a.txt", criteo_rows(50, seed=2))
    examples = load_tensors(path, CRITEO)
    assert len(examples) == 50
    batches_equal(read([path], CRITEO, batch_size=16), list(TensorBatches(examples, 16)))
    for k in range(3):
        batches_equal(read([path], CRITEO, batch_size=7, shard_index=k, num_shards=3),
                      list(TensorBatches(examples, 7, shard_index=k, num_shards=3)))
    assert len(TensorBatches(examples, 16)) == 4 and len(TensorBatches(examples, 16, drop_last=True)) == 3
    def epoch_order(batches):  # row order of one epoch, told apart by each row's C1..C26 keys
        return [tuple(row) for b in batches for row in b.sparse.values().view(26, -1).t().tolist()]

    shuffled = TensorBatches(examples, 16, shuffle=True, seed=5)
    one, two = epoch_order(shuffled), epoch_order(shuffled)
    assert sorted(one) == sorted(two) == sorted(map(tuple, examples.keys.tolist()))  # every row once
    assert one != two  # a new order each epoch
    assert epoch_order(TensorBatches(examples, 16, shuffle=True, seed=5)) == one  # same seed, same orders


def test_shuffle_buffer_permutes_rows_deterministically(tmp_path):
    schema = Schema(labels=("y",), dense=("id",), sparse=("c",))
    path = tmp_path / "a.csv"
    path.write_text("y,id,c\n" + "".join(f"0,{i},v\n" for i in range(100)))
    plain = _ids(read([path], schema, batch_size=8))
    a = _ids(read([path], schema, batch_size=8, shuffle_buffer=30, seed=1))
    b = _ids(read([path], schema, batch_size=8, shuffle_buffer=30, seed=1))
    assert plain == list(range(100)) and sorted(a) == plain and a == b and a != plain
    dropped = read([path], schema, batch_size=8, drop_last=True)
    assert [x.batch_size for x in dropped] == [8] * 12


# ----------------------------------------------------------------------------- sequences


def test_sequence_columns_are_jagged(tmp_path):
    schema = Schema(labels=("y",), sparse=("u",), sequence=("hist",))
    path = tmp_path / "s.csv"
    path.write_text("y,u,hist\n1,a,x|y|z\n0,b,\n1,,w\n0,c,p||q|\n")
    [batch] = read([path], schema, batch_size=4)
    kjt = batch.sparse
    assert kjt.keys() == ["u", "hist"]
    assert kjt.lengths().tolist() == [1, 1, 1, 1, 3, 0, 1, 2]  # feature-major; empty elements dropped
    assert kjt["hist"].values().tolist() == hash_strings(list("xyzwpq"), "hist").tolist()
    assert kjt["u"].values().tolist() == hash_strings(["a", "b", None, "c"], "u").tolist()
    # The same content as a native Parquet list column.
    pq.write_table(pa.table({"y": [1, 0, 1, 0], "u": ["a", "b", None, "c"],
                             "hist": [["x", "y", "z"], [], ["w"], ["p", "q"]]}), tmp_path / "s.parquet")
    batches_equal([batch], read([tmp_path / "s.parquet"], Schema(**{**schema.__dict__, "format": "parquet"}), 4))
    # Row selection keeps each row's keys together.
    ex = load_tensors(path, schema)
    picked = ex.select(torch.tensor([3, 0]))
    assert picked.seq_lengths[0].tolist() == [2, 3]
    assert picked.seq_values[0].tolist() == hash_strings(list("pqxyz"), "hist").tolist()


def test_integer_keys_without_hashing(tmp_path, caplog):
    schema = Schema(labels=("y",), sparse=("item",), sequence=("hist",), hash_values=False, sequence_separator=" ")
    path = tmp_path / "i.csv"
    path.write_text("y,item,hist\n1,7,1 2 3\n0,,\n1,9,4 x 5\n0,3,6\n")
    with caplog.at_level(logging.WARNING, logger="recps.data.reader"):
        [batch] = read([path], schema, batch_size=8, error_budget=1)
    assert batch.sparse["item"].values().tolist() == [7, 0, 3]  # missing -> 0
    assert batch.sparse["hist"].values().tolist() == [1, 2, 3, 6]
    assert batch.sparse["hist"].lengths().tolist() == [3, 0, 1]
    assert f"{path}:4: sequence hist holds a non-integer key" in caplog.text


# ----------------------------------------------------------------------------- bad rows


BAD_CSV = (
    "Id,label,I1,C1\n"  # line 1
    "0,1,5,a\n"  # 2
    "1,0,6,b,extra\n"  # 3 wrong width
    "2,1,abc,c\n"  # 4 non-numeric dense
    "3,0,7\n"  # 5 wrong width
    "4,,8,d\n"  # 6 missing label
    "5,1,9,e\n"  # 7
    "6,x,1,f\n"  # 8 non-numeric label
    "7,0,2,g\n"  # 9
)
BAD_SCHEMA = Schema(labels=("label",), dense=("I1",), sparse=("C1",))


def test_bad_rows_are_counted_skipped_and_logged(tmp_path, caplog):
    path = tmp_path / "bad.csv"
    path.write_text(BAD_CSV)
    with caplog.at_level(logging.WARNING, logger="recps.data.reader"):
        reader = TabularReader([path], BAD_SCHEMA, 16, error_budget=5)
        [batch] = list(reader)
    assert batch.dense[:, 0].tolist() == [5.0, 9.0, 2.0]
    assert batch.labels[:, 0].tolist() == [1.0, 1.0, 0.0]
    assert reader.stats.rows == 3 and reader.stats.bad_rows == 5
    for expected in (
        f"{path}:3: 5 fields, expected 4",
        f"{path}:4: dense I1 is not a finite number",
        f"{path}:5: 3 fields, expected 4",
        f"{path}:6: label label is missing",
        f"{path}:8: label label is not a number",
    ):
        assert expected in caplog.text
    assert "skipped 5 bad rows out of 8" in caplog.text


def test_error_budget_exceeded_raises(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text(BAD_CSV)
    with pytest.raises(DataError) as err:
        read([path], BAD_SCHEMA, error_budget=4)
    message = str(err.value)
    assert message.startswith("5 bad rows out of 8 read (shard 0/1) exceed dataset.error_budget=4 (4 rows)")
    assert f"first bad rows: {path}:3 (5 fields, expected 4); {path}:5 (3 fields, expected 4); " in message
    assert message.endswith("raise dataset.error_budget or fix the file") and "\n" not in message
    with pytest.raises(DataError, match=r"5 bad rows out of 8 read .* exceed dataset.error_budget=0.5 \(50.00% of 8 rows\)"):
        read([path], BAD_SCHEMA, error_budget=0.5)
    assert len(read([path], BAD_SCHEMA, error_budget=0.7)[0].labels) == 3
    with pytest.raises(ConfigError, match="error_budget=1.5"):
        TabularReader([path], BAD_SCHEMA, 4, error_budget=1.5)


def test_bad_line_numbers_in_criteo_text_count_skipped_lines(tmp_path, caplog):
    rows = criteo_rows(12, seed=4)
    rows[2] = rows[2][:-1]  # line 3: 39 fields
    rows[9][5] = "1.5e"  # line 10: non-numeric I5
    path = write_text(tmp_path / "t.txt", rows)
    with caplog.at_level(logging.WARNING, logger="recps.data.reader"):
        batches = read([path], CRITEO, error_budget=2)
    assert sum(b.batch_size for b in batches) == 10
    assert f"{path}:3: 39 fields, expected 40" in caplog.text
    assert f"{path}:10: dense I5 is not a finite number" in caplog.text


# ----------------------------------------------------------------------------- wrong input


def _one_line_error(call, match: str) -> str:
    with pytest.raises(DataError, match=match) as err:
        call()
    assert "\n" not in str(err.value)
    # No pandas/pyarrow exception chained underneath: the message is the whole story.
    assert err.value.__cause__ is None and (err.value.__context__ is None or err.value.__suppress_context__)
    return str(err.value)


def test_missing_files(tmp_path):
    _one_line_error(lambda: TabularReader([tmp_path / "nope.txt"], CRITEO, 4), f"{tmp_path}/nope.txt: no such file; check the dataset path")
    _one_line_error(lambda: TabularReader(str(tmp_path / "*.txt"), CRITEO, 4), "the pattern matches no file")
    _one_line_error(lambda: TabularReader([], CRITEO, 4), "the dataset path list is empty")


def test_empty_files(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    _one_line_error(lambda: read([tmp_path / "empty.txt"], CRITEO), "empty.txt: the file is empty; remove it")
    (tmp_path / "header.csv").write_text("Id,label,I1,C1\n")
    _one_line_error(lambda: read([tmp_path / "header.csv"], BAD_SCHEMA), "header.csv: the file has no data rows")
    with gzip.open(tmp_path / "empty.txt.gz", "wb"):
        pass
    _one_line_error(lambda: read([tmp_path / "empty.txt.gz"], CRITEO), "the file is empty")


def test_schema_that_does_not_match_the_file(tmp_path):
    csv = tmp_path / "criteo.csv"
    csv.write_text("Id,Label,I1\n1,0,5\n")
    # A Criteo schema on a comma-separated file: no line has 40 TAB-separated fields.
    msg = _one_line_error(lambda: read([csv], CRITEO), "no line matches dataset.schema")
    assert msg == (f"{csv}: no line matches dataset.schema: lines have [1] fields (first at line 1) but the schema "
                   "expects 40 (format 'criteo', separator '\\t', header=False); fix dataset.schema (columns, "
                   "separator, format) to match the file")
    # Header lacks columns.
    msg = _one_line_error(lambda: read([csv], BAD_SCHEMA), r"the header lacks columns \['label', 'C1'\]")
    assert msg.endswith("fix dataset.schema or the file")
    # A big file whose every line is wrong fails after the first lines, not at the end.
    big = tmp_path / "big.txt"
    big.write_text("1\t2\t3\n" * 200_000)
    _one_line_error(lambda: read([big], CRITEO), r"big.txt: its first 1000 lines do not match dataset.schema: lines have \[3\] fields")
    # Parquet without the columns, and a text file read as Parquet.
    pq.write_table(pa.table({"label": [1], "I1": [2.0]}), tmp_path / "p.parquet")
    pschema = Schema(labels=("label",), dense=("I1",), sparse=("C1",), format="parquet")
    _one_line_error(lambda: read([tmp_path / "p.parquet"], pschema), r"the Parquet file lacks columns \['C1'\]")
    _one_line_error(lambda: read([csv], pschema), "not a readable Parquet file")
    with pytest.raises(ConfigError, match="header=false needs dataset.schema.columns"):
        TabularReader([csv], Schema(labels=("label",), header=False), 4)


# ----------------------------------------------------------------------------- real data


def test_criteo_tiny_sample_reads_like_its_criteo_text(tmp_path):
    path = SHARED_DATA / "criteo" / "train.tiny.csv"
    if not path.exists():
        pytest.skip(f"{path} is absent (Criteo's terms forbid committing it); see ../shared/data/README.md")
    schema = Schema(labels=("Label",), dense=CRITEO_DENSE, sparse=CRITEO_SPARSE, dense_transform="log1p")
    reader = TabularReader([path], schema, 512)
    batches = list(reader)
    assert reader.stats.bad_rows == 0
    labels = torch.cat([b.labels for b in batches])
    assert labels.shape == (1999, 1) and labels.sum().item() == 418  # PROVENANCE: 1,999 rows, 418 clicks
    # The same rows as Criteo raw text (drop Id, TAB-separated) give the same batches.
    lines = path.read_text().splitlines()[1:]
    text = tmp_path / "tiny.txt"
    text.write_text("\n".join("\t".join(line.split(",")[1:]) for line in lines) + "\n")
    batches_equal(batches, read([text], CRITEO, batch_size=512))
    # Examples built in memory agree too.
    batches_equal(batches, list(TensorBatches(load_tensors(path, schema), 512)))


def test_examples_cat_and_select_round_trip():
    keys = torch.arange(12).view(6, 2)
    ex = Examples(("a", "b", "s"), torch.zeros(6, 1), keys, torch.ones(6, 1),
                  (torch.tensor([1, 0, 2, 1, 0, 3]),), (torch.arange(7),))
    halves = [ex.select(slice(0, 3)), ex.select(slice(3, 6))]
    back = Examples.cat(halves)
    assert torch.equal(back.keys, keys) and torch.equal(back.seq_values[0], torch.arange(7))
    assert ex.select(slice(2, 4)).seq_values[0].tolist() == [1, 2, 3]
    assert ex.select(torch.tensor([5, 2])).seq_values[0].tolist() == [4, 5, 6, 1, 2]


# ----------------------------------------------------------------------------- blocks and threads


def test_block_boundaries_threads_and_long_lines_do_not_change_rows(tmp_path):
    rows = criteo_rows(40, seed=6)
    path = write_text(tmp_path / "a.txt", rows)
    reference = read([path], CRITEO, batch_size=16, threads=1)
    # Blocks smaller than a line (~150 bytes) grow to whole lines; many blocks run in parallel.
    for block_size, threads in ((100, 2), (1000, 3), (7, 1)):
        batches_equal(reference, read([path], CRITEO, batch_size=16, threads=threads, block_size=block_size))
    header = ["Id"] + list(CRITEO_COLUMNS)
    csv = write_text(tmp_path / "b.csv", [[str(i)] + r for i, r in enumerate(rows)], ",", header)
    schema = Schema(labels=("label",), dense=CRITEO_DENSE, sparse=CRITEO_SPARSE, dense_transform="log1p")
    batches_equal(reference, read([csv], schema, batch_size=16, block_size=5))  # header longer than a block


def test_blank_lines_and_byte_order_mark(tmp_path, caplog):
    path = tmp_path / "blank.csv"
    path.write_bytes(b"\xef\xbb\xbfy,x,c\n1,1,a\n\n\r\n0,2,b\n\n1,oops,c\n0,4,d")  # no final newline
    schema = Schema(labels=("y",), dense=("x",), sparse=("c",))
    with caplog.at_level(logging.WARNING, logger="recps.data.reader"):
        [batch] = read([path], schema, batch_size=8, error_budget=1)
    assert batch.dense[:, 0].tolist() == [1.0, 2.0, 4.0]
    assert f"{path}:7: dense x is not a finite number" in caplog.text  # blank lines 3, 4 and 6 counted


def test_stopping_early_ends_the_reader_threads(tmp_path):
    import threading
    import time

    path = write_text(tmp_path / "a.txt", criteo_rows(400, seed=7))
    reader = TabularReader([path], CRITEO, 4, block_size=200, threads=2)
    for _ in reader:
        break  # the consumer walks away with blocks still in flight
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any("reader shard" in t.name for t in threading.enumerate()):
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if "reader shard" in t.name]
