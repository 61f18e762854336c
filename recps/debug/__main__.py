"""`python -m recps.debug diff RUN_A RUN_B` and `python -m recps.debug show RUN`.

diff: prints the first divergence of two runs' dumps (step, role, rank, thread, record name,
max abs difference) or that there is none. Exit status 0: identical, 1: diverged, 2: error
(no dump, unreadable files). show: lists a dump's records (filters: --step, --name glob).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from typing import Sequence

from recps.debug.diff import diff_runs
from recps.debug.format import dump_files, read_index
from recps.errors import RecpsError

__all__ = ["main"]


def _diff(args: argparse.Namespace) -> int:
    result = diff_runs(args.run_a, args.run_b, atol=args.atol)
    d = result.divergence
    if args.json:
        print(json.dumps({"identical": d is None, "divergence": d.as_dict() if d else None, "files": result.files,
                          "records": result.records, "bytes": result.bytes}, sort_keys=True))
    elif d is None:
        print(f"no divergence: {result.files} dump files, {result.records} records, "
              f"{result.bytes / 1e6:.1f} MB compared" + (f" (atol {args.atol:g})" if args.atol else ""))
    else:
        print(f"first divergence: {d.describe()}")
    return 0 if d is None else 1


def _show(args: argparse.Namespace) -> int:
    for (role, rank, thread), idx in dump_files(args.run).items():
        for r in read_index(idx):
            if args.step is not None and r.step != args.step:
                continue
            if args.name and not fnmatch.fnmatchcase(r.name, args.name):
                continue
            shape = ",".join(map(str, r.shape)) or "-"
            print(f"{role}{rank}\tthread{thread}\t{r.step}\t{r.batch}\t{r.name}\t{r.dtype}\t{shape}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recps.debug", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("diff", help="the first divergence of two runs' dumps")
    p.add_argument("run_a", help="run folder (with dump/) or dump folder")
    p.add_argument("run_b", help="run folder (with dump/) or dump folder")
    p.add_argument("--atol", type=float, default=0.0, help="differences up to this count as equal (default: bytes must match)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=_diff)
    p = sub.add_parser("show", help="list the records of a dump")
    p.add_argument("run")
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--name", default=None, help="glob over record names, e.g. 'grad/*'")
    p.set_defaults(fn=_show)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (RecpsError, OSError) as exc:
        print(f"python -m recps.debug {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
