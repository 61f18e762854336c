"""`python -m recps.data.generators <kind> ...`: one entry for every generator (ctr, drifting, video_world)."""

from __future__ import annotations

import importlib
import sys

KINDS = {
    "ctr": "Criteo-like click data with a planted logistic truth",
    "drifting": "a drifting time-partitioned click stream (day/hour splits with donefiles)",
    "video_world": "the funnel's world: users, items, a known label model, biased impressions",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in KINDS:
        lines = [f"  {name:<12} {what}" for name, what in KINDS.items()]
        usage = "usage: python -m recps.data.generators {" + ",".join(KINDS) + "} [--help | flags]\n"
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: unknown generator {argv[0]!r}; choose one of {', '.join(KINDS)}", file=sys.stderr)
            print(usage + "\n".join(lines), file=sys.stderr)
            return 2
        print(usage + "\n".join(lines))
        return 0
    module = importlib.import_module(f"recps.data.generators.{argv[0]}")
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
