"""benchmarks/word2vec_bench.py cannot rot: every recps system's overrides compose into a valid
job config, the table's ratios and medians are arithmetic on the results, and a missing gensim
is named with its fix. (The runs themselves take minutes: `python -m benchmarks.word2vec_bench`.)"""

from __future__ import annotations

import pytest

from benchmarks import word2vec_bench as bench
from recps.config import compose_config, check_target_args


@pytest.mark.parametrize("system", ["local", "geo", "geo_1t"])
def test_recps_systems_compose_to_the_documented_settings(system):
    cfg = compose_config(bench.recps_overrides(system, epochs=3, seed=1, corpus="zipf", k_steps=20))
    check_target_args(cfg.model, "model", injected=("embedding_bag_collection",), engine_keys=("embedding_dim",))
    s = bench.SETTINGS
    assert (cfg.model.embedding_dim, cfg.task.window, cfg.task.negatives, cfg.task.subsample) == (
        s["dim"], s["window"], s["negatives"], s["sample"])
    assert (cfg.trainer.batch_size, cfg.trainer.epochs, cfg.dataset.min_count) == (s["batch"], 3, s["min_count"])
    assert not cfg.dataset.train[0].endswith(".bz2")  # the zipf corpus: a missing file falls back to it
    if system == "local":
        assert (cfg.ps.name, cfg.trainer.threads) == ("local", 2)
    else:
        assert (cfg.ps.name, cfg.cluster.servers, cfg.cluster.workers, cfg.ps.k_steps, cfg.ps.delta_scale) == (
            "geo", 1, 2, 20, 1.0)
        assert cfg.trainer.threads == (2 if system == "geo" else 1)


def result(system: str, words_per_sec: float, cpu: float, spearman: float) -> dict:
    return {"system": system, "corpus": "wiki", "epochs": 5, "tokens": 1000, "words_per_sec": words_per_sec,
            "words_per_cpu_second": cpu, "spearman": spearman, "analogy": 0.01, "peak_rss_mib": 100.0,
            "load_1min_before": 1.0, "load_1min_after": 2.0}


def test_markdown_reports_every_run_the_median_and_ratios():
    results = [result("gensim2", 100.0, 200.0, 0.2), result("geo", 150.0, 100.0, 0.4),
               result("gensim2", 300.0, 200.0, 0.3), result("geo", 250.0, 300.0, 0.5), result("geo", 200.0, 200.0, 0.6)]
    text = bench.markdown(results, "cmd")
    gensim_row = next(line for line in text.splitlines() if line.startswith("| gensim | 2 workers"))
    geo_row = next(line for line in text.splitlines() if line.startswith("| recps ps=geo | 1 server + 2 workers x 2"))
    assert "100 / 300 (median **200**) | 1.00 |" in gensim_row
    assert "150 / 250 / 200 (median **200**) | 1.00 | 100 / 300 / 200 (median **200**) | 1.00 |" in geo_row
    assert "0.400 / 0.500 / 0.600 (median **0.500**)" in geo_row
    # Reference figures: the GEO median (200) against gensim 2 workers' 140k-180k (midpoint 160k).
    assert "| gensim 2 workers | 140,000-180,000 | 0.00 |" in text


def test_missing_gensim_is_named_with_its_fix(monkeypatch):
    monkeypatch.setattr(bench, "have_gensim", lambda: False)
    with pytest.raises(SystemExit):
        bench.main(["--systems", "gensim2"])
    assert "requirements/bench.txt" in bench.NO_GENSIM
