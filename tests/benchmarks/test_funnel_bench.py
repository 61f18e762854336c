"""benchmarks.funnel_bench cannot rot: its --quick run of the real funnel (100 users x 500 items, one cluster
run in the seed's mix of modes), the record it reads from the run's metrics.json and the served funnel, its
Markdown and its SVG; and the mode table's overrides really put every stage in the mode asked for."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from recps.config import compose_config
from recps.pipeline.stages import pipeline_specs

from benchmarks import funnel_bench


@pytest.mark.parametrize("label", ["sync", "async", "geo", "mix"])
def test_mode_overrides_put_each_stage_in_its_mode(label):
    specs = pipeline_specs(compose_config(["pipeline=video_funnel", *funnel_bench.mode_overrides(label)]))
    assert {s.name: s.mode.name for s in specs} == funnel_bench.MODES[label]


def test_an_unknown_mode_label_fails_naming_it_and_the_choices():
    with pytest.raises(ValueError, match=r"'hogwild'.*mix, sync, async, geo"):
        funnel_bench.main(["--quick", "--modes", "mix,hogwild"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_quick_funnel_bench_runs_serves_and_summarises(tmp_path, capsys):
    out, svg = tmp_path / "funnel.jsonl", tmp_path / "funnel.svg"
    argv = ["--quick", "--world-root", str(tmp_path / "worlds"), "--tmp", str(tmp_path), "--out", str(out),
            "--svg", str(svg)]
    assert funnel_bench.main(argv) == 0
    (record,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert (record["users"], record["items"], record["label"]) == (100, 500, "mix")
    assert record["stage_order"] == ["recall", "coarse", "fine", "fusion"]
    assert record["modes"] == funnel_bench.MODES["mix"]
    stages = record["stages"]
    assert [stages[s]["keep"] for s in record["stage_order"]] == [100, 30, 15, 10]
    hits = [stages[s]["hits"] for s in record["stage_order"]]
    assert record["positives"] >= hits[0] and hits == sorted(hits, reverse=True)  # a stage keeps a subset
    for s in record["stage_order"]:
        assert stages[s]["train_s"] > 0 and stages[s]["examples"] > 0 and stages[s]["examples_per_sec"] > 0
        assert 0.0 <= stages[s]["pass_through"] <= 1.0
    assert record["train_s"] == pytest.approx(sum(stages[s]["train_s"] for s in stages), abs=0.1)
    assert {"most_popular", "recall_alone", "recall_without_coarse", "ideal"} <= set(record["baselines"])
    assert record["baselines"]["ideal"]["utility_ndcg@10"] == pytest.approx(1.0)
    assert 0.0 <= record["funnel"]["ndcg@10"] <= 1.0
    serving = record["serving"]
    assert 0 < serving["request_p50_ms"] <= serving["request_p99_ms"] and serving["users_per_s"] > 0
    assert set(serving["stages_ms"]) == set(record["stage_order"])
    # 500 items: below the exact threshold, the funnel's index is exact search, so it finds exactly its answer.
    assert serving["index"] == {"kind": "exact", "items": 500, "k": 100, "nlist": None, "threads": 1}
    assert serving["ann_recall"] == 1.0
    table = capsys.readouterr().out
    assert "| recall | geo | 100 | " in table and "| fusion | sync | 10 | " in table
    assert "| 100 users x 500 items | mix | geo / async / async / sync | " in table
    root = ET.fromstring(svg.read_bytes())  # a well-formed SVG, the stages named in order
    assert root.tag.endswith("svg")
    text = svg.read_text()
    assert text.index("catalogue") < text.index("recall") < text.index("coarse") < text.index("fusion")
    assert funnel_bench.main(["--markdown", str(out)]) == 0  # the tables again, from the JSON line
    assert capsys.readouterr().out.strip() == table.strip()
