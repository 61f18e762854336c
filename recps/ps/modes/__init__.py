"""Consistency modes over one PS client: sync, async and GEO (layer L2).

Each mode is one constructor (`SyncMode`, `AsyncMode`, `GeoMode`: conf/ps/<mode>.yaml names it
in `_target_`) that builds both of its halves: the worker's Communicator (the protocol in
`base`; the PS-backed embedding collections and the trainer talk to it only, so `ps=` touches
no model and no reader) and the server half the servers plug in for the mode's tables
(`server_halves()`).
"""

from recps.ps.modes.asynchronous import AsyncCommunicator, AsyncMode
from recps.ps.modes.base import (Communicator, CountsStatistics, KeepsWorkerState, Mode, NumbersSteps, PlacesReplicas,
                                  ReadsServers, StartsPulls)
from recps.ps.modes.geo import GeoCommunicator, GeoMode
from recps.ps.modes.server_reader import ServerReader
from recps.ps.modes.synchronous import SyncCommunicator, SyncMode

__all__ = ["Communicator", "CountsStatistics", "StartsPulls", "PlacesReplicas", "KeepsWorkerState", "NumbersSteps",
           "ReadsServers", "Mode", "SyncMode", "AsyncMode", "GeoMode", "SyncCommunicator", "AsyncCommunicator",
           "GeoCommunicator", "ServerReader", "MODES", "server_halves"]

MODES: dict[str, type[Mode]] = {m.name: m for m in (SyncMode, AsyncMode, GeoMode)}


def server_halves() -> dict:
    """Mode name -> factory of its server half (server index -> ServerHalf), for PSServer(halves=...)."""
    return {name: mode.server_half for name, mode in MODES.items()}
