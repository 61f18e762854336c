"""Debug dump (Paddle's dump_fields / dump_param) and the diff of two runs' dumps.

    python -m recps.train debug=dump trainer.threads=1 ...   # writes <run dir>/dump/
    python -m recps.debug diff RUN_A RUN_B                   # first divergence, or none
    python -m recps.debug show RUN --step 3                  # the records of a dump

``format``: the files (one .bin + one text .idx per role, rank and thread); ``dump``: the
``DebugDump`` training observer (it logs a ``DumpEstimate`` of its size at the first step);
``diff``: ``diff_runs``. Importing this package does not import torch (the CLI reads dumps
with numpy); ``DebugDump``, ``DumpEstimate`` and ``build_dump`` are loaded on first use.
"""

from __future__ import annotations

from typing import Any

from recps.debug.diff import DiffResult, Divergence, diff_runs
from recps.debug.format import DumpWriter, Record, dump_files, read_index, read_record

__all__ = [
    "DebugDump",
    "DumpEstimate",
    "build_dump",
    "check_debug_config",
    "DumpWriter",
    "Record",
    "dump_files",
    "read_index",
    "read_record",
    "diff_runs",
    "Divergence",
    "DiffResult",
]


def __getattr__(name: str) -> Any:
    if name in ("DebugDump", "DumpEstimate", "build_dump", "check_debug_config", "FIELDS"):
        from recps.debug import dump  # deferred: torch; `recps.debug` (the diff CLI, reading dumps) needs none

        return getattr(dump, name)
    raise AttributeError(f"module 'recps.debug' has no attribute {name!r}")
