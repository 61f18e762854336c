"""Run one parameter server from the environment's role: `python -m recps.ps` (a Fleet script's server).

The PS package's own entry, configured by its options; a `python -m recps.train` cluster's server runs
recps.cluster.server instead (the job's config sets its threads and storage roots).

The role comes from `recps.ps.roles.detect_role_maker()` (RECPS_* variables set by
`python -m recps.launch`, torchrun, MPI or Slurm); the process serves every PS mode's tables
until a worker sends `stop` or it gets SIGTERM / SIGINT (exit 0), or the job cannot finish: every
worker gone without a stop, a peer declared dead, the coordinator lost (exit 1, the reason logged;
`recps.ps.fleet.Fleet.run_server`). Options: --threads (handler threads), --dead-after
(seconds of heartbeat silence before the coordinator declares a peer dead; server 0 only).
"""

from __future__ import annotations

import argparse
import logging

from recps import quiet_libraries
from recps.errors import PSError
from recps.ps.fleet import Fleet
from recps.ps.node.coordinator import DEFAULT_DEAD_AFTER_S
from recps.ps.roles import detect_role_maker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recps.ps", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="handler threads (default 2)")
    parser.add_argument("--dead-after", type=float, default=DEFAULT_DEAD_AFTER_S, help="heartbeat silence before a peer is dead (s)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the coordinator at start")
    args = parser.parse_args(argv)
    role = detect_role_maker().role()
    quiet_libraries()  # the libraries' import-time lines a user cannot act on
    logging.basicConfig(level=logging.INFO, format=f"[{role.name}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    if not role.is_server:
        parser.error(f"this process has role {role.name}; python -m recps.ps runs servers only")
    try:
        with Fleet(role, connect_timeout_s=args.timeout, dead_after_s=args.dead_after, server_threads=args.threads) as fleet:
            fleet.run_server()
    except PSError as e:  # the job did not finish (a dead peer, no stop): a non-zero exit, whoever launched us
        logging.getLogger("recps.ps").error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
