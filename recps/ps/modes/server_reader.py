"""ServerReader: the read half of the Communicator protocol, for evaluating what the servers hold."""

from __future__ import annotations

import torch

from recps.errors import PSError

__all__ = ["ServerReader"]


class ServerReader:
    """Pull-only view of the servers: evaluation reads the merged values, whatever the training
    mode; rows of keys never trained read as zeros (nothing is created)."""

    mode = "read"

    def __init__(self, client, timeout_s: float | None = None) -> None:
        self.client = client
        self.timeout_s = timeout_s

    def server_reader(self) -> "ServerReader":
        """Itself: it is the read-only view (ReadsServers)."""
        return self

    def pull(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        return self.client.pull(table, keys, create=False, assume_unique=True).wait(self.timeout_s)

    def push(self, table: str, keys: torch.Tensor, grads: torch.Tensor) -> None:
        raise PSError(f"ServerReader is read-only: a push to {table!r} came from a model in training mode; "
                      "call model.eval() or bind the training communicator")

    def pull_dense(self, table: str) -> torch.Tensor:
        return self.client.pull_dense(table).wait(self.timeout_s)
