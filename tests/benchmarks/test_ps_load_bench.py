"""benchmarks.ps_load_bench at a CI size (4 client processes, 2 server processes, 5 s): no lost
update, checked exactly (integer gradients, SGD lr 1: every row equals minus the sum of what the
clients pushed to it), and the command writes its JSON and its RESULTS.md section."""

from __future__ import annotations

import json

import pytest

from benchmarks import ps_load_bench

pytestmark = pytest.mark.slow


def test_four_clients_for_five_seconds_lose_no_update(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# results\n\n## Someone else's section\n\nkept\n")
    out = tmp_path / "load.json"
    code = ps_load_bench.main(["--clients", "4", "--servers", "2", "--seconds", "5", "--keys", "20000",
                               "--json", str(out), "--results-md", str(results)])
    r = json.loads(out.read_text())
    assert code == 0, r
    assert r["lost_rows"] == 0 and r["dense_lost"] == 0 and r["values_integral"], r
    assert r["rows_checked"] == 20000 and r["rows_nonzero"] > 1000  # the check covered real traffic
    assert r["server_rows"] == r["keys_touched"] > 1000  # a row per key pulled, none other
    assert r["steps"] > 4 * 5 and r["rows_pushed"] == 512 * r["steps"]  # every client stepped repeatedly
    for op in ps_load_bench.OPS:
        lat = r["latency"][op]
        assert lat["calls"] == r["steps"] and 0 < lat["p50_ms"] <= lat["p99_ms"] <= lat["max_ms"], (op, lat)
    text = results.read_text()
    assert "## Someone else's section\n\nkept" in text
    assert text.count(ps_load_bench.BEGIN) == 1 and "**Lost updates: 0 of 20,000 rows" in text
    assert "| pull | " in text and "| push_dense | " in text
    # A second run replaces the section, the rest stays.
    ps_load_bench.write_section(results, "## PS load\n\nreplaced\n")
    text = results.read_text()
    assert text.count(ps_load_bench.BEGIN) == 1 and "replaced" in text and "Lost updates" not in text and "kept" in text


def test_bad_arguments_fail_naming_the_value():
    with pytest.raises(ValueError, match=r"--clients=0"):
        ps_load_bench.run(clients=0)
    with pytest.raises(ValueError, match=r"--seconds=0"):
        ps_load_bench.run(seconds=0)
