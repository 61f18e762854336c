"""benchmarks/compute_bench.py cannot rot: the FLOP count against the hand count, the summary's
arithmetic on made-up records, and a tiny end-to-end run of the real command (written under tmp)."""

from __future__ import annotations

import doctest
import json

import pytest
import torch

from recps.config import PROJECT_ROOT

from benchmarks import compute_bench
from benchmarks.compute_bench import CONFIGS, ctr_dnn_flop_per_example, summarize
from tests.helpers.cli import run_module


def test_doctests():
    assert doctest.testmod(compute_bench, verbose=False).failed == 0


def test_ctr_dnn_flop_count_is_counted_from_its_layers():
    """conf/model/ctr_dnn.yaml on the Criteo schema: 26 x 9 + 13 = 247 inputs, MLP 512-256-128-32, a
    1-wide head; 2 FLOP per multiply-add forward, twice that backward: the issue's ~1.8 MFLOP."""
    shapes = [(247, 512), (512, 256), (256, 128), (128, 32), (32, 1)]
    assert ctr_dnn_flop_per_example() == 6 * sum(i * o for i, o in shapes) == 1_766_592


def _train(config, precision, rate, auc, rnd=1, flop=1_000_000):
    mode, topology = CONFIGS[config]
    return {"kind": "train", "config": config, "precision": precision, "round": rnd, "mode": mode,
            "topology": topology, "examples_per_sec": rate, "examples_per_cpu_second": rate // 2, "auc": auc,
            "flop_per_example": flop, "gflops": rate * flop / 1e9}


def test_summary_medians_fractions_and_targets():
    records = [{"kind": "peak", "dtype": "fp32", "gflops": 90.0, "threads": 2},
               {"kind": "peak", "dtype": "fp32", "gflops": 100.0, "threads": 2},
               {"kind": "peak", "dtype": "bf16", "gflops": 200.0, "threads": 2}]
    for rnd, (f, b) in enumerate([(80_000, 120_000), (70_000, 140_000), (75_000, 130_000)], start=1):
        records += [_train("local-1T", "fp32", f, 0.7000, rnd), _train("local-1T", "bf16", b, 0.7015, rnd)]
    records += [_train("geo-1S+2Wx1T", "fp32", 60_000, 0.70), _train("async-1S+2Wx1T", "fp32", 54_000, 0.69),
                _train("local-2T", "fp32", 57_000, 0.70)]
    summary, targets = summarize(records)
    assert summary["peak_gflops"] == {"fp32": 100.0, "bf16": 200.0}  # the best probe
    local = summary["configs"]["local-1T"]
    assert local["fp32"]["examples_per_sec"] == 75_000 and local["bf16"]["examples_per_sec"] == 130_000  # medians
    assert local["fp32"]["roofline_fraction"] == 0.75 and local["bf16"]["roofline_fraction"] == 0.65
    assert records[3]["roofline_fraction"] == 0.8  # each run: 80,000 x 1 MFLOP / 100 GFLOP/s
    # per CPU-second against one core (100 GFLOP/s over 2 cores): 40,000 x 1 MFLOP / 50 GFLOP/s
    assert records[3]["cpu_roofline_fraction"] == 0.8 and local["fp32"]["cpu_roofline_fraction"] == 0.75
    assert local["fp32"]["examples_per_cpu_second"] == 37_500
    got = {t["target"]: (t["value"], t["met"]) for t in targets}
    assert got["local-1T fp32 >= 75% of the fp32 roofline"] == (0.75, True)
    assert got["geo-1S+2Wx1T fp32 >= 75% of the fp32 roofline"] == (0.6, False)
    speedup = got["local-1T bf16 >= 1.6x fp32 examples/s (CPU with bf16 units)"]
    assert speedup[0] == round(130_000 / 75_000, 3)
    assert speedup[1] is (True if compute_bench.cpu_info()["bf16_units"] else None)
    assert got["local-1T bf16 AUC within 0.002 of fp32"] == (0.0015, True)
    assert got["async fp32 >= 85% of GEO examples/s"] == (0.9, True)
    assert got["async fp32 >= 85% of GEO examples/s (per CPU-s)"] == (0.9, True)
    assert got["local-1T fp32 >= 75% of the fp32 roofline (per CPU-s)"] == (0.75, True)
    assert got["local-2T fp32 >= GEO 1S+2Wx1T examples/s (Hogwild)"] == (0.95, False)
    assert got["local-2T fp32 >= GEO 1S+2Wx1T examples/s (Hogwild) (per CPU-s)"] == (0.95, False)
    assert "local-2T bf16 >= GEO 1S+2Wx1T examples/s (Hogwild)" not in got  # no bf16 runs of either


def test_precisions_pick_the_runs_and_a_bad_one_is_refused_before_any_run():
    with pytest.raises(ValueError, match="fp8"):
        compute_bench.run(precisions=("fp8",))
    with pytest.raises(ValueError, match="precisions"):
        compute_bench.run(precisions=())


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_run_end_to_end(tmp_path):
    """`python -m benchmarks.compute_bench` on a tiny world, one round: both probes and every
    configuration in both precisions, in alternating order, with sane fields; the checkout's
    benchmarks/results is not written."""
    out, mine = tmp_path / "compute.json", PROJECT_ROOT / "benchmarks" / "results" / "compute_bench.json"
    before = mine.stat().st_mtime_ns if mine.exists() else None
    proc = run_module("benchmarks.compute_bench", "--rows", "2000", "--vocab", "100", "--rounds", "1", "--probe-size", "256",
                      "--probe-reps", "3", "--probe-trials", "2", "--data-dir", str(tmp_path / "data"), "--out",
                      str(out), timeout=580)
    result = json.loads(out.read_text())
    assert result["cpu"]["cores"] >= 1 and result["cpu"]["model"] and isinstance(result["cpu"]["bf16_units"], bool)
    assert set(result["cpu"]["flags"]) >= {"avx512_bf16", "amx_bf16"}
    peaks = [r for r in result["records"] if r["kind"] == "peak"]
    assert [p["dtype"] for p in peaks] == ["fp32", "bf16"] and all(p["gflops"] > 0 and p["size"] == 256 for p in peaks)
    runs = [r for r in result["records"] if r["kind"] == "train"]
    assert [(r["config"], r["precision"]) for r in runs] == [(c, p) for c in CONFIGS for p in ("fp32", "bf16")]
    for r in runs:
        assert r["examples_per_sec"] > 0 and 0.4 < r["auc"] < 1 and r["train_examples"] == 2000, r
        assert r["flop_per_example"] == 1_766_592
        assert r["gflops"] == pytest.approx(r["examples_per_sec"] * 1_766_592 / 1e9, abs=0.01)
        peak = max(p["gflops"] for p in peaks if p["dtype"] == r["precision"])  # a tiny probe is no peak: arithmetic only
        assert r["roofline_fraction"] == round(r["gflops"] / peak, 4) > 0, r
        assert r["cpu_roofline_fraction"] == round(r["examples_per_cpu_second"] * 1_766_592 / 1e9 / (peak / peaks[0]["threads"]), 4)
    assert {t["target"].split(" ")[0] for t in result["targets"]} >= {"local-1T", "geo-1S+2Wx1T", "async"}
    assert "| local-1T | fp32 |" in proc.stdout and "| target | value | met |" in proc.stdout
    assert (mine.stat().st_mtime_ns if mine.exists() else None) == before


# ------------------------------------------------------------------------------ --device cuda


def test_cuda_summary_medians_speedups_and_auc_differences():
    tbe = [{"kind": "tbe", "device": d, "batch": 8, "features": 2, "dim": 4, "keys_per_sec": v}
           for d, v in (("cuda", 900), ("cuda", 1100), ("cpu", 100), ("cpu", 300))]
    train = [{"kind": "train", "config": "ctr_dnn local-1T", "device": d, "precision": "fp32", "examples_per_sec": v,
              "auc": a} for d, v, a in (("cuda", 4000, 0.75), ("cpu", 1000, 0.7510))]
    s = compute_bench.cuda_summarize(tbe + train)
    assert s["tbe"] == {"B=8 F=2 D=4": {"cuda_keys_per_sec": 1000, "cpu_keys_per_sec": 200, "speedup": 5.0}}
    assert s["train"]["ctr_dnn local-1T"]["fp32"] == {
        "cuda_examples_per_sec": 4000, "cpu_examples_per_sec": 1000, "speedup": 4.0, "cuda_auc": 0.75,
        "cpu_auc": 0.751, "auc_cuda_minus_cpu": -0.001}
    table = compute_bench.cuda_table({"summary": s, "gpu": {"name": "G", "cuda": "12", "packages": {}},
                                      "cpu": {"model": "C", "cores": 2}, "rows": 10, "batch": 8})
    assert "| B=8 F=2 D=4 | 1,000 | 200 | 5.0x |" in table
    assert "| ctr_dnn local-1T | fp32 | 4000 | 1000 | 4.0 | 0.75 | 0.751 | -0.001 |" in table


def test_tbe_probe_counts_keys_of_forward_and_backward():
    r = compute_bench.tbe_keys_per_second("cpu", batch=16, features=3, dim=4, rows=50, steps=2, warmup=1)
    assert (r["kind"], r["device"], r["batch"], r["features"], r["steps"]) == ("tbe", "cpu", 16, 3, 2)
    assert r["keys_per_sec"] == pytest.approx(16 * 3 * 2 / r["seconds"], rel=0.01)  # seconds rounded to 1 us


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: --device cuda runs")
def test_device_cuda_without_cuda_stops_before_any_run(capsys):
    assert compute_bench.main(["--device", "cuda", "--out", "/nonexistent/never-written.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("compute_bench --device cuda: device='cuda': torch.cuda.is_available() is False")
    assert "make setup-gpu" in err
