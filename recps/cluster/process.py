"""This process as a node of a cluster: its Fleet with the job's cluster settings, where it runs, its logging.

Read by the role bodies (recps.cluster.server, recps.cluster.work) and by the jobs that bring their
own worker body (recps.stream, recps.pipeline).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Sequence

from recps.job.settings import NodeSettings
from recps.ps.fleet import Fleet
from recps.ps.roles import ROLE_ENV

__all__ = ["NodeSettings", "fleet_for", "crowded", "on_this_machine", "role_logging"]


def fleet_for(settings: NodeSettings, role, storage_roots: Sequence[str] | None = None):
    """The Fleet of `role` with the cluster's settings; `storage_roots`: a server's save/load folders."""
    # Handler threads of a server (null: 0 when this machine is crowded, see crowded; else 2).
    # Measured on 2 cores, quiet (benchmarks/RESULTS.md): serving on the network thread cut the
    # server's CPU by 7-20% and ran async 1S+2Wx1T, 1S+1Wx2T and GEO/sync 1S+1Wx2T faster.
    server_threads = settings.server_threads
    if server_threads is None:
        server_threads = 0 if role.is_server and crowded(settings, role) else 2
    return Fleet(role, connect_timeout_s=settings.connect_timeout_s, dead_after_s=settings.dead_after_s,
                 server_threads=int(server_threads), storage_roots=storage_roots)


def crowded(settings: NodeSettings, role) -> bool:
    """Whether this machine's servers and training threads outnumber its cores (local launches only)."""
    busy = role.num_servers + role.num_workers * settings.trainer_threads
    return on_this_machine(role) and busy > (os.cpu_count() or 1)


def on_this_machine(role) -> bool:
    return bool(os.environ.get(ROLE_ENV)) and role.coordinator.startswith(("127.", "localhost", "[::1]"))


def role_logging(role) -> None:
    """recps' INFO lines and everyone's warnings on stdout (library INFO chatter stays out)."""
    prefix = "" if os.environ.get(ROLE_ENV) else f"[{role.name}] "  # recps.cluster.launch adds it itself
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, force=True,
                        format=f"{prefix}%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("recps").setLevel(logging.INFO)
