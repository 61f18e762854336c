"""A server's role body in a `python -m recps.train` cluster: `serve` until worker 0 stops it.

Its threads follow the machine: handler threads (recps.cluster.process.fleet_for) and torch's intra-op
threads (1 when this machine's servers and training threads outnumber its cores). A Fleet script's
server is `python -m recps.ps` (recps/ps/__main__.py: the PS package's own entry, configured by options).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

import torch
from recps.cluster.process import crowded, fleet_for, on_this_machine
from recps.job.settings import NodeSettings

__all__ = ["serve"]


def serve(settings: NodeSettings, role, out_dir: Path, roots: Sequence[str]) -> None:
    """Serve as `role` until a worker stops it; `roots`: the folders it may save to and load from
    (recps.cluster.driver.storage_roots)."""
    # Intra-op threads of a server's table ops (null: torch's default, or 1 when this machine is
    # crowded: idle OpenMP threads spin and take CPU from the workers). Measured with async on 2
    # cores: 1 server + 2 workers, 1 thread 13.5k / 12.7k examples per CPU-s, 2 threads 11.5k;
    # 1 server + 1 worker x 2 threads (counted since session 4: the workers' threads are busy too),
    # 1 thread 21,259 examples/s and 4.6 s of server CPU against 19,754 and 5.6 s, and serving on
    # the network thread with 2 intra-op threads spun: 13.5 s of server CPU, 14,811 examples/s.
    threads = settings.server_torch_threads
    if threads is None and crowded(settings, role):
        threads = 1
    if threads is not None:
        torch.set_num_threads(int(threads))
    with fleet_for(settings, role, storage_roots=roots) as fleet:
        fleet.init_server()  # start-up work (loads the tables' compiled loops), like the imports:
        cpu = time.process_time()  # before the CPU clock starts
        fleet.run_server()
    if on_this_machine(role):  # the launcher adds it to metrics.json (benchmarks: examples per CPU-second)
        (out_dir / f"{role.name}.cpu.json").write_text(json.dumps({"cpu_seconds": time.process_time() - cpu}))
