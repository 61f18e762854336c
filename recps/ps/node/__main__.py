"""Run one parameter server from the environment's role: `python -m recps.ps.node`.

The role comes from `recps.ps.roles.detect_role_maker()` (RECPS_* variables set by
`python -m recps.launch`, torchrun, MPI or Slurm); the process serves until a worker sends
`stop` or it gets SIGTERM / SIGINT. Options: --threads (handler threads), --dead-after
(seconds of heartbeat silence before the coordinator declares a peer dead; server 0 only).
"""

from __future__ import annotations

import argparse
import logging

from recps.ps.node.cluster import serve
from recps.ps.node.coordinator import DEFAULT_DEAD_AFTER_S
from recps.ps.roles import detect_role_maker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recps.ps.node", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="handler threads (default 2)")
    parser.add_argument("--dead-after", type=float, default=DEFAULT_DEAD_AFTER_S, help="heartbeat silence before a peer is dead (s)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the coordinator at start")
    args = parser.parse_args(argv)
    role = detect_role_maker().role()
    logging.basicConfig(level=logging.INFO, format=f"[{role.name}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    if not role.is_server:
        parser.error(f"this process has role {role.name}; python -m recps.ps.node runs servers only")
    serve(role, num_threads=args.threads, dead_after_s=args.dead_after, timeout_s=args.timeout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
