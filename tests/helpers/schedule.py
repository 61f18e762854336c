"""The order `make test` hands test files to its two pytest-xdist workers: longest first.

`--dist loadfile` sends a whole file to one worker (its module fixtures, a shared cluster or HDFS,
start once there). xdist's own order is by number of tests, so a file of a few long end-to-end tests
could be sent last and leave the other worker idle for minutes at the end. `LongestFirstLoadFile`
keeps loadfile's grouping and sends the units in decreasing recorded seconds (the greedy
longest-processing-time rule: the last units sent are the short ones), from tests/durations.json.

Units: a file, except the files in SPLIT, whose tests are units of their own (their fixtures are
function- or session-scoped, so nothing is started twice): each alone takes minutes, and as one
unit they would end the run on one worker.

tests/durations.json holds seconds per unit (setup, call and teardown) from one `make test` run;
a unit it does not list counts as UNKNOWN_S. Refresh it with
    .venv/bin/python -m pytest -q -n 2 --dist loadfile --record-durations tests/durations.json
Stale figures cost only balance, never a test: every unit is run whatever its figure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from xdist.scheduler import LoadFileScheduling

__all__ = ["PROJECT_ROOT", "DURATIONS", "SPLIT", "UNKNOWN_S", "LongestFirstLoadFile", "unit_of", "read_durations", "unit_seconds"]

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # the checkout: tests/helpers/schedule.py
DURATIONS = PROJECT_ROOT / "tests" / "durations.json"
# Files whose tests each take minutes (measured: tests/durations.json): each test is its own unit.
SPLIT = frozenset({
    "tests/models/test_learning.py",
})
UNKNOWN_S = 5.0  # a unit without a recorded figure: a new file is most often a few short tests


def unit_of(nodeid: str) -> str:
    """The unit a test is sent in: its file, or (a file in SPLIT) the test itself."""
    path = nodeid.split("::", 1)[0]
    return nodeid if path in SPLIT else path


def read_durations(path: Path = DURATIONS) -> dict[str, float]:
    """unit -> seconds; {} when the file is absent (every unit then counts as UNKNOWN_S)."""
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def unit_seconds(test_seconds: Mapping[str, float]) -> dict[str, float]:
    """Seconds per test (nodeid -> s) summed per unit, rounded to 0.1 s, sorted by unit."""
    units: dict[str, float] = {}
    for nodeid, seconds in test_seconds.items():
        unit = unit_of(nodeid)
        units[unit] = units.get(unit, 0.0) + seconds
    return {unit: round(units[unit], 1) for unit in sorted(units)}


class LongestFirstLoadFile(LoadFileScheduling):
    """xdist's loadfile scheduling (a file to one worker), units sent in decreasing recorded seconds."""

    def __init__(self, config, log=None, durations: Mapping[str, float] | None = None) -> None:
        super().__init__(config, log)
        self.durations = read_durations() if durations is None else dict(durations)
        self._ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node) -> None:
        if not self._ordered:  # the first assignment: the work queue is complete, order it once
            seconds = {unit: self.durations.get(unit, UNKNOWN_S) for unit in self.workqueue}
            for unit in sorted(self.workqueue, key=lambda u: (-seconds[u], u)):
                self.workqueue.move_to_end(unit)
            self._ordered = True
        super()._assign_work_unit(node)
