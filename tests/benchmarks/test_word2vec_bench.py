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


def curve_result(system: str, rnd: int, spearmans: list[float], seconds_per_pass: float, tokens: int = 1000) -> dict:
    curve = [dict(epoch=e + 1, seconds=seconds_per_pass * (e + 1), words=tokens * (e + 1), spearman=v)
             for e, v in enumerate(spearmans)]
    if system.startswith("geo"):  # a GEO run evaluates at its end only
        curve = curve[-1:]
    r = result(system, tokens * len(spearmans) / curve[-1]["seconds"], 100.0, spearmans[-1])
    return {**r, "round": rnd, "seed": rnd, "epochs": len(spearmans), "seconds": curve[-1]["seconds"], "curve": curve}


def test_equal_spearman_times_each_system_to_the_lower_final_spearman():
    """gensim reaches 0.20 at pass 4 of 5 (8 s); local (1 s a pass) at pass 2; GEO's shorter runs
    (1, 2, ... passes) stop at the first that reaches the target: pass 2 (of 1.5 s a pass)."""
    gensim = curve_result("gensim2", 0, [0.05, 0.10, 0.15, 0.20, 0.21], 2.0)
    local = curve_result("local", 0, [0.15, 0.25, 0.30, 0.33, 0.35], 1.0)
    geo = curve_result("geo", 0, [0.1, 0.22, 0.3, 0.3, 0.4], 1.5)
    geo_spearman = {1: 0.1, 2: 0.22, 3: 0.3}
    calls = []

    def short_run(system, epochs, seed, corpus, k_steps):
        calls.append((system, epochs, seed, k_steps))
        return curve_result(system, 0, [geo_spearman[e] for e in range(1, epochs + 1)], 1.5)

    rows = bench.equal_spearman([gensim, local, geo], k_steps=20, run=short_run, log=lambda line: None)
    assert calls == [("geo", 1, 0, 20), ("geo", 2, 0, 20)]
    by = {r["system"]: r for r in rows}
    assert by["gensim2"]["target"] == by["local"]["target"] == by["geo"]["target"] == 0.21
    assert (by["gensim2"]["epoch"], by["gensim2"]["seconds"], by["gensim2"]["ratio"]) == (5, 10.0, 1.0)
    assert (by["local"]["epoch"], by["local"]["seconds"], by["local"]["words_per_sec"]) == (2, 2.0, 2500.0)
    assert (by["geo"]["epoch"], by["geo"]["seconds"], by["geo"]["ratio"]) == (2, 3.0, pytest.approx(10 / 3))
    assert geo["equal_spearman"] is by["geo"]
    text = bench.markdown([gensim, local, geo], "cmd")
    geo_row = next(line for line in text.splitlines() if line.startswith("| recps ps=geo | 1 server + 2 workers x 2")
                   and "3.3" in line)
    assert "| **0.210** | 2 | **3.0** | 5, 10.0 | **1,667** | **3.33** |" in geo_row


def test_equal_spearman_target_is_the_lower_final_when_the_system_ends_below_gensim():
    gensim = curve_result("gensim2", 0, [0.1, 0.3], 1.0)
    local = curve_result("local", 0, [0.2, 0.25], 1.0)
    rows = bench.equal_spearman([gensim, local], k_steps=20, log=lambda line: None)
    by = {r["system"]: r for r in rows}
    assert by["local"]["target"] == 0.25 and by["local"]["epoch"] == 2 and by["gensim2"]["target"] == 0.3
    assert (by["local"]["gensim_epoch"], by["local"]["ratio"]) == (2, 1.0)
