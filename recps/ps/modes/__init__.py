"""Consistency modes over one PS client: sync, async and GEO (layer L2).

Every mode implements the `Communicator` protocol in `base`; the PS-backed embedding
collections and the trainer talk to that protocol only, so `ps=sync|async|geo` touches
no model and no reader.
"""

from recps.ps.modes.asynchronous import AsyncCommunicator
from recps.ps.modes.base import Communicator
from recps.ps.modes.synchronous import SyncCommunicator

__all__ = ["Communicator", "SyncCommunicator", "AsyncCommunicator"]
