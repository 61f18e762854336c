"""The optional abilities of a communicator, each a Protocol checked with isinstance (see
recps.ps.modes.base's docstring for the Communicator protocol every mode implements)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

import torch

__all__ = ["CountsStatistics", "StartsPulls", "PlacesReplicas", "KeepsWorkerState", "NumbersSteps", "ReadsServers"]


@runtime_checkable
class CountsStatistics(Protocol):
    """Pushes of some tables carry the keys' shows and clicks (see the module docstring)."""

    def counts_statistics(self, table: str) -> bool: ...


@runtime_checkable
class StartsPulls(Protocol):
    """A pull can be sent before its rows are needed (async's prefetch)."""

    def pull_start(self, table: str, keys: torch.Tensor) -> Callable[[], torch.Tensor]: ...


@runtime_checkable
class PlacesReplicas(Protocol):
    """Local replicas of the tables (GEO), placed on the binding collection's device."""

    def place_replicas(self, device: str | torch.device) -> None: ...


@runtime_checkable
class KeepsWorkerState(Protocol):
    """State the worker holds and the servers do not (GEO's replicas), for a checkpoint."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: Mapping) -> None: ...


@runtime_checkable
class NumbersSteps(Protocol):
    """The number of the step being accumulated (sync): the dense values change once per step."""

    step: int


@runtime_checkable
class ReadsServers(Protocol):
    """A read-only view of the servers behind this communicator (nothing is created or pushed)."""

    def server_reader(self) -> "ReadsServers": ...
