"""benchmarks.ann_bench cannot rot: a small run of the real command (an IVF index over 5,000 items),
its JSON line and its Markdown row."""

from __future__ import annotations

import json

from benchmarks import ann_bench


def test_a_small_ann_bench_runs_and_summarises(tmp_path, capsys):
    out = tmp_path / "ann.jsonl"
    argv = ["--items", "5000", "--dim", "16", "--k", "200", "--kind", "ivf", "--clusters", "50", "--seen", "20",
            "--latency-users", "20", "--batch", "16", "--batch-users", "32", "--recall-users", "20", "--out", str(out)]
    assert ann_bench.main(argv) == 0
    (record,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert record["kind"] == "ivf" and record["items"] == 5000 and record["k"] == 200
    assert record["recall"] >= 0.95 and record["seen_returned"] == 0
    for side in ("ann", "exact"):
        assert 0 < record[side]["p50_ms"] <= record[side]["p99_ms"] and record[side]["users_per_s"] > 0
    assert ann_bench.main(argv) == 0  # a second run appends a line
    assert len(out.read_text().splitlines()) == 2
    capsys.readouterr()
    assert ann_bench.main(["--markdown", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.count("| 5,000 x 16 | 50 clusters, noise 0.5 | 200 | 20 | ivf nlist ") == 2
