"""tests/helpers/schedule.py: the units `make test` sends to its workers and their recorded seconds."""

from __future__ import annotations

from tests.helpers.schedule import DURATIONS, PROJECT_ROOT, SPLIT, read_durations, unit_of, unit_seconds


def test_a_file_is_one_unit_unless_it_is_split():
    assert unit_of("tests/ps/test_fleet.py::test_x[a]") == "tests/ps/test_fleet.py"
    assert unit_of("recps/ps/table/__init__.py::recps.ps.table") == "recps/ps/table/__init__.py"
    learning = "tests/models/test_learning.py::test_reaches_best_reachable_auc_minus_margin[xdeepfm]"
    assert "tests/models/test_learning.py" in SPLIT and unit_of(learning) == learning


def test_seconds_are_summed_per_unit():
    got = unit_seconds({"tests/a.py::t1": 1.2, "tests/a.py::t2[x]": 2.0, "tests/b.py::t": 0.04})
    assert got == {"tests/a.py": 3.2, "tests/b.py": 0.0}


def test_every_recorded_unit_is_a_file_of_the_suite():
    """A renamed or deleted file's figure would order nothing: refresh tests/durations.json."""
    durations = read_durations()
    assert len(durations) > 100, DURATIONS
    missing = [u for u in durations if not (PROJECT_ROOT / u.split("::", 1)[0]).is_file()]
    assert not missing, f"{DURATIONS.name} names files that are gone: {missing}"
