"""benchmarks.stream_bench cannot rot: a CI-sized run of the real command (2 passes of 2,000 rows
on file://), its records and its summary."""

from __future__ import annotations

import json

import pytest

from benchmarks import stream_bench

pytestmark = pytest.mark.slow


def test_a_small_stream_bench_runs_and_summarises(tmp_path, capsys):
    jsonl = tmp_path / "out.jsonl"
    assert stream_bench.main(["--fs", "file", "--passes", "2", "--rows", "2000", "--repeat", "1",
                              "--dir", str(tmp_path / "work"), "--jsonl", str(jsonl)]) == 0
    stream, batch = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert stream["kind"] == "stream" and batch["kind"] == "batch"
    assert stream["passes"] == 2 and stream["examples"] == batch["examples"] == 4000
    assert stream["examples_per_sec"] > 0 and batch["examples_per_sec"] > 0
    assert 0 < stream["delta_share_median"] <= stream["delta_share_max"] and stream["base_rows"] > 0 and stream["batch_model_rows"] > 0
    assert stream["rss_first_mib"] > 0 and stream["restart_s"] > 0
    table = capsys.readouterr().out.split("\n| fs |", 1)[1]
    assert "| file | 2 x 2000 |" in table
    assert stream_bench.main(["--markdown", str(jsonl)]) == 0
