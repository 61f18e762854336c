"""recps.data.generators.ctr: determinism, the planted truth, key distributions, file formats."""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from sklearn.metrics import roc_auc_score

from recps.data.generators import ctr as syn
from recps.data.schema import CRITEO_DENSE, CRITEO_SPARSE, Schema
from recps.errors import ConfigError, DataError

COLUMNS = Schema.criteo().columns


def read_text(path: str) -> pd.DataFrame:
    """A generated text file as Criteo columns; C* stay strings, empty fields are NaN."""
    return pd.read_csv(path, sep="\t", header=None, names=COLUMNS, dtype={c: str for c in CRITEO_SPARSE})


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> syn.GeneratorInfo:
    path = tmp_path_factory.mktemp("syn") / "data.txt"
    return syn.generate(path, 20_000, seed=11)


def test_same_seed_gives_identical_bytes(tmp_path):
    for fmt in ("text", "parquet"):
        a = syn.generate(tmp_path / f"a.{fmt}", 5_000, seed=7, fmt=fmt)
        b = syn.generate(tmp_path / f"b.{fmt}", 5_000, seed=7, fmt=fmt)
        assert read_bytes(a.path) == read_bytes(b.path), fmt
        assert (a.best_auc, a.ctr, a.bias, a.scales) == (b.best_auc, b.ctr, b.bias, b.scales)


def test_different_seed_or_stream_gives_different_rows(tmp_path):
    a = syn.generate(tmp_path / "a.txt", 2_000, seed=1)
    b = syn.generate(tmp_path / "b.txt", 2_000, seed=2)
    c = syn.generate(tmp_path / "c.txt", 2_000, seed=1, stream=1)
    lines = [set(read_bytes(x.path).splitlines()) for x in (a, b, c)]
    assert not lines[0] & lines[1] and not lines[0] & lines[2]
    # Another seed is another world: the same rank is written as another string.
    assert a.bias != b.bias and a.bias == c.bias


def test_chunked_writing_equals_single_chunk(tmp_path):
    # 10,000 rows cut at 999 and 4,500 rows straddle the 4,096-row random blocks.
    rows = 10_000
    whole = syn.generate(tmp_path / "whole.txt", rows, seed=3, chunk_rows=rows)
    for chunk in (999, 4_500):
        part = syn.generate(tmp_path / f"part{chunk}.txt", rows, seed=3, chunk_rows=chunk)
        assert read_bytes(part.path) == read_bytes(whole.path)
        assert part.best_auc == whole.best_auc
    pq_whole = syn.generate(tmp_path / "whole.parquet", rows, seed=3, fmt="parquet", chunk_rows=rows)
    pq_part = syn.generate(tmp_path / "part.parquet", rows, seed=3, fmt="parquet", chunk_rows=999)
    assert pq.read_table(pq_part.path).equals(pq.read_table(pq_whole.path))
    # A prefix of the rows is the prefix of the file: rows depend on their index only.
    head = syn.generate(tmp_path / "head.txt", 5_000, seed=3)
    assert read_bytes(whole.path).startswith(read_bytes(head.path))


def test_best_auc_is_the_auc_of_the_true_model_on_the_file(text_file):
    df = read_text(text_file.path)
    info = syn.load_info(text_file.path)
    assert info == text_file
    probs = syn.true_probs(df, info)
    assert len(df) == 20_000 and info.best_auc_method == "exact"
    assert roc_auc_score(df["label"], probs) == pytest.approx(info.best_auc, abs=1e-12)
    assert df["label"].mean() == pytest.approx(info.ctr, abs=1e-12)
    # Labels are Bernoulli(true prob): their mean tracks the mean probability.
    assert abs(df["label"].mean() - probs.mean()) < 4 * np.sqrt(0.25 / len(df))


def test_defaults_give_a_realistic_ctr_and_auc(text_file):
    assert 0.22 <= text_file.ctr <= 0.28
    assert 0.75 <= text_file.best_auc <= 0.81
    meta = json.loads(read_bytes(text_file.meta_path))
    assert meta["rows"] == 20_000 and meta["seed"] == 11 and meta["vocab"] == [syn.DEFAULT_VOCAB] * 26
    assert meta["best_auc"] == text_file.best_auc and meta["ctr"] == text_file.ctr


def test_signal_scale_moves_the_best_auc(tmp_path):
    weak = syn.generate(tmp_path / "weak.txt", 20_000, seed=4, signal=0.6)
    strong = syn.generate(tmp_path / "strong.txt", 20_000, seed=4, signal=2.0)
    assert weak.best_auc + 0.1 < strong.best_auc
    low_ctr = syn.generate(tmp_path / "low.txt", 20_000, seed=4, target_ctr=0.05)
    assert low_ctr.ctr == pytest.approx(0.05, abs=0.01)


def test_histogram_auc_matches_exact_auc(tmp_path):
    info = syn.generate(tmp_path / "h.txt", 20_000, seed=11, chunk_rows=6_000, exact_auc_rows=0)
    assert info.best_auc_method.startswith("histogram")
    df = read_text(info.path)
    assert roc_auc_score(df["label"], syn.true_logits(df, info)) == pytest.approx(info.best_auc, abs=1e-6)


def test_text_is_criteo_raw_format(text_file):
    lines = read_bytes(text_file.path).decode("ascii").split("\n")
    assert lines[-1] == "" and len(lines) == 20_001  # one line per row, final newline
    fields = np.array([line.split("\t") for line in lines[:5_000]])  # (5000, 40)
    assert fields.shape == (5_000, 40)
    assert set(fields[:, 0]) == {"0", "1"}
    dense = fields[:, 1:14]
    assert all(v == "" or v.isdigit() for v in dense.ravel())
    cats = fields[:, 14:]
    assert all(v == "" or (len(v) == 8 and set(v) <= set("0123456789abcdef")) for v in cats.ravel())
    meta = json.loads(read_bytes(text_file.meta_path))
    assert Schema.from_config(meta["schema"]) == Schema.criteo()


def test_parquet_holds_the_same_rows_as_text(tmp_path):
    text = syn.generate(tmp_path / "d.txt", 3_000, seed=5)
    par = syn.generate(tmp_path / "d.parquet", 3_000, seed=5, fmt="parquet")
    assert (text.best_auc, text.ctr) == (par.best_auc, par.ctr)
    table = pq.read_table(par.path)
    assert table.column_names == list(COLUMNS)
    assert str(table.schema.field("label").type) == "int32"
    assert {str(table.schema.field(c).type) for c in CRITEO_DENSE} == {"int64"}
    assert {str(table.schema.field(c).type) for c in CRITEO_SPARSE} == {"string"}
    from_text, from_parquet = read_text(text.path), table.to_pandas()
    for c in ("label",) + CRITEO_DENSE:
        np.testing.assert_array_equal(from_text[c].to_numpy(float), from_parquet[c].to_numpy(float))
    for c in CRITEO_SPARSE:
        assert from_text[c].fillna("").tolist() == from_parquet[c].fillna("").tolist()
    np.testing.assert_array_equal(syn.true_logits(table, par), syn.true_logits(from_text, text))
    meta = json.loads(read_bytes(par.meta_path))
    assert Schema.from_config(meta["schema"]) == Schema.criteo(format="parquet", separator=",")


def test_vocab_bound_and_zipf_shape(tmp_path):
    vocab = [3, 50, 1_000, 10**9, 1_000] + [100] * 21
    zipf_a = [1.1] * 4 + [1.0] + [1.1] * 21  # a == 1 takes the logarithmic inverse CDF
    info = syn.generate(tmp_path / "v.txt", 20_000, seed=2, vocab=vocab, zipf_a=zipf_a, missing=0.0)
    ranks = syn.decode_ranks(read_text(info.path), info)  # (N, S)
    assert ranks.min() >= 1
    assert (ranks.max(axis=0) <= np.array(vocab)).all()
    assert ranks[:, 0].max() == 3 and len(np.unique(ranks[:, 1])) == 50
    assert ranks[:, 3].max() > 10**6  # the 10**9 slot reaches deep into its tail
    # Head heavier than tail; frequencies of the top ranks follow r**-a.
    for slot, a in ((2, 1.1), (4, 1.0)):
        counts = np.bincount(ranks[:, slot], minlength=1_001)[1:]  # (1000,)
        assert counts[0] > counts[1] > counts[3] > counts[9] > counts[99]
        assert counts[:10].sum() > counts[500:].sum()
        top = np.arange(2, 31)  # integral of x**-a over [r, r+1) ~ (r + 1/2)**-a
        slope = np.polyfit(np.log(top + 0.5), np.log(counts[top - 1]), 1)[0]
        assert slope == pytest.approx(-a, abs=0.15), slot


def test_huge_vocab_is_cheap_and_collision_free(tmp_path):
    info = syn.generate(tmp_path / "huge.txt", 20_000, seed=9, vocab=10**9, zipf_a=0.5, missing=0.0)
    df = read_text(info.path)
    ranks = syn.decode_ranks(df, info)
    # Distinct ranks give distinct strings (rank -> word is a bijection per slot).
    for s, c in enumerate(CRITEO_SPARSE[:4]):
        assert df[c].nunique() == len(np.unique(ranks[:, s]))
    assert ranks.max() > 10**8


def test_missing_fields_at_the_configured_rate(tmp_path):
    rates = {"I1": 0.3, "I12": 0.7, "C5": 0.5, "C26": 0.1}
    info = syn.generate(tmp_path / "m.txt", 20_000, seed=6, missing=rates)
    df = read_text(info.path)
    observed = df.isna().mean()
    for column in CRITEO_DENSE + CRITEO_SPARSE:
        rate = rates.get(column, 0.0)
        assert abs(observed[column] - rate) <= 4 * np.sqrt(rate * (1 - rate) / len(df)) + 1e-12, column
    everywhere = syn.generate(tmp_path / "m2.txt", 20_000, seed=6, missing=0.2)
    assert read_text(everywhere.path).iloc[:, 1:].isna().mean().between(0.18, 0.22).all()


def test_interaction_term_is_planted(tmp_path):
    """With only the pairwise term, the label depends on C1 x C2 jointly, not on either alone."""
    info = syn.generate(
        tmp_path / "pair.txt", 20_000, seed=8, vocab=4, zipf_a=0.0, missing=0.0, signal=2.0,
        shares=(0, 0, 1), interactions=[("C1", "C2")],
    )
    df = read_text(info.path)
    logits = syn.true_logits(df, info)
    by_pair = pd.Series(logits).groupby([df["C1"], df["C2"]]).agg(["min", "max"])
    assert len(by_pair) == 16 and np.allclose(by_pair["min"], by_pair["max"])  # a function of the pair
    per_c1 = pd.Series(logits).groupby(df["C1"]).agg(["min", "max"])
    assert (per_c1["max"] - per_c1["min"] > 0.1).all()  # but not of C1 alone
    assert info.best_auc > 0.7


def test_split_and_cache(tmp_path):
    train, test = syn.generate_split(tmp_path / "split", 3_000, 1_000, seed=4)
    assert (train.stream, test.stream) == (0, 1)
    assert os.path.basename(train.path) == "train.txt" and os.path.basename(test.path) == "test.txt"
    assert train.bias == test.bias and train.scales == test.scales  # one world
    assert not set(read_bytes(train.path).splitlines()) & set(read_bytes(test.path).splitlines())
    before = os.stat(train.path).st_mtime_ns
    again = syn.ensure_split(tmp_path / "split", 3_000, 1_000, seed=4)
    assert again == (train, test) and os.stat(train.path).st_mtime_ns == before
    other = syn.ensure_split(tmp_path / "split", 3_000, 1_000, seed=4, vocab=20)
    assert other[0].vocab == (20,) * 26 and syn.load_info(train.path).vocab == (20,) * 26


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(vocab=0), "each slot needs 1..4294967295 keys"),
        (dict(vocab=[10] * 5), "synthetic vocab has 5 values; give one number or 26"),
        (dict(vocab=10.5), "synthetic vocab value 10.5 is not a whole number of keys"),
        (dict(zipf_a=-1.0), "use finite exponents >= 0"),
        (dict(missing={"C99": 0.1}), "synthetic missing names unknown columns ['C99']"),
        (dict(missing=1.0), "use values in [0, 1)"),
        (dict(target_ctr=1.5), "synthetic target_ctr=1.5; use a value in (0, 1)"),
        (dict(interactions=[("C1", "C1")]), "is not a pair of two different slots"),
        (dict(fmt="csv"), "synthetic fmt='csv' is not one of ['parquet', 'text']"),
        (dict(rows=0), "synthetic rows=0; ask for at least 1 row"),
    ],
)
def test_config_errors_name_value_and_fix(tmp_path, kwargs, message):
    kwargs = {"rows": 10, **kwargs}
    with pytest.raises(ConfigError) as err:
        syn.generate(tmp_path / "x.txt", kwargs.pop("rows"), **kwargs)
    assert message in str(err.value)


def test_true_logits_rejects_rows_of_another_world(tmp_path, text_file):
    df = read_text(text_file.path)
    other = syn.generate(tmp_path / "o.txt", 10, seed=12)
    with pytest.raises(DataError, match=r"C1 row 0 holds [0-9a-f]{8}, which is no key of the world seed=12"):
        syn.true_logits(df, other)
    bad = df.head(3).copy()
    bad.loc[1, "C2"] = "xyz"
    with pytest.raises(DataError, match="C2 row 1 holds 'xyz', not 8 hex characters"):
        syn.true_logits(bad, text_file)
    with pytest.raises(DataError, match="true_logits needs column 'C1'"):
        syn.true_logits(df.drop(columns=["C1"]), text_file)
    with pytest.raises(DataError, match="regenerate the file"):
        syn.load_info(tmp_path / "missing.txt")


def test_cli_writes_file_split_and_prints_best_auc(tmp_path, capsys):
    out = tmp_path / "cli.txt"
    assert syn.main(["--rows", "2000", "--out", str(out), "--seed", "3", "--vocab", "50"]) == 0
    info = syn.load_info(out)
    printed = capsys.readouterr().out
    assert f"best reachable AUC {info.best_auc:.4f}" in printed and info.vocab == (50,) * 26
    assert syn.main(["--rows", "1000", "--out", str(tmp_path / "s"), "--format", "parquet",
                     "--test-fraction", "0.2", "--vocab", ",".join(["7"] * 26)]) == 0
    train, test = syn.load_info(tmp_path / "s" / "train.parquet"), syn.load_info(tmp_path / "s" / "test.parquet")
    assert (train.rows, test.rows, train.fmt) == (800, 200, "parquet") and train.vocab == (7,) * 26
    assert syn.main(["--rows", "10", "--out", str(out), "--vocab", "1,2"]) == 2
    assert "synthetic vocab has 2 values" in capsys.readouterr().err
