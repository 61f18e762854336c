"""Joining a cluster from a `Role`: `ServerNode(role)` is a server, `connect(role)` gives a worker its client (L1: Fleet builds on it).

    server i                                   worker j
    --------                                   --------
    i == 0: start the Coordinator on           register as worker j, heartbeat
            role.coordinator                   wait until all S servers registered (timeout)
    PSServer on role.host (port from           PSClient(endpoints) with the coordinator for barriers
      role.server_endpoints[i] or free)
    register server i + endpoint, heartbeat
    serve until a client sends `stop` or stop() is called (recps.ps.fleet's run_server also
      stops on SIGTERM/SIGINT and when every worker is gone)

Every process heartbeats to the coordinator; one silent for `dead_after_s` is declared dead and
every barrier or server wait fails naming it (see coordinator.py). Every peer then learns it with
its next heartbeat (`ServerNode.failure`, `PSClient.failure`; a worker's calls in flight fail at
once), and so does the dead peer if it comes back; a peer that loses the coordinator fails too.

>>> from recps.ps.roles import UserDefinedRoleMaker
>>> from recps.cluster.launch import free_port
>>> address = f"127.0.0.1:{free_port()}"
>>> server_role = UserDefinedRoleMaker("server", 0, 1, 1, coordinator=address, token="t").role()
>>> worker_role = UserDefinedRoleMaker("worker", 0, 1, 1, coordinator=address, token="t").role()
>>> with ServerNode(server_role, halves={}).start() as node, connect(worker_role, timeout_s=10.0) as client:
...     client.barrier("ready", timeout=5.0)
...     client.num_servers
1
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from recps.errors import ConfigError, PSError
from recps.ps.node.client import PSClient
from recps.ps.node.coordinator import DEFAULT_DEAD_AFTER_S, Coordinator, CoordinatorClient, tcp_endpoint
from recps.ps.node.server import PSServer, ServerHalfFactory
from recps.ps.roles import Role, split_host_port

__all__ = ["ServerNode", "connect"]

logger = logging.getLogger(__name__)


class ServerNode:
    """Server `role.index` with, on server 0, the coordinator; `start()` returns at once.

    Args:
        role: a server Role.
        num_threads: handler threads of the PSServer.
        dead_after_s: heartbeat silence after which the coordinator declares a peer dead (server 0 only).
        timeout_s: how long registering may wait for the coordinator to come up.
        halves: the modes' server halves (PSServer's `halves`; recps.ps.modes.server_halves()).
        storage_roots: the folders save and load may use (PSServer's; None: $RECPS_STORAGE_ROOTS).
    """

    def __init__(self, role: Role, num_threads: int = 2, dead_after_s: float = DEFAULT_DEAD_AFTER_S, timeout_s: float = 60.0,
                 halves: Mapping[str, ServerHalfFactory] | None = None, storage_roots: Sequence[str] | None = None) -> None:
        if not role.is_server:
            raise ConfigError(f"ServerNode: role {role.name} is not a server; workers call connect(role)")
        self.role = role
        self.coordinator: Coordinator | None = None
        if role.index == 0:
            host, port = split_host_port(role.coordinator, what="role.coordinator")
            self.coordinator = Coordinator(role.num_servers, role.num_workers, token=role.token, bind=host, port=port,
                                           dead_after_s=dead_after_s)
        port = split_host_port(role.server_endpoints[role.index])[1] if role.server_endpoints else 0
        self.server = PSServer(role.index, role.num_servers, token=role.token, bind=role.host, port=port, num_threads=num_threads,
                               halves=halves, storage_roots=storage_roots)
        self.link = CoordinatorClient(role.coordinator, token=role.token, timeout_s=timeout_s)
        self._timeout_s = timeout_s
        self._stopped = False
        self._stop_reason = ""  # request_stop's: why this server stops before a client said so

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def start(self) -> "ServerNode":
        if self.coordinator is not None:
            try:
                self.coordinator.start()
            except PSError as e:
                if not self.role.coordinator_from:
                    raise
                raise PSError(f"{e} (the coordinator's address came from {self.role.coordinator_from})") from None
        self.server.start()
        try:
            self.link.register("server", self.role.index, self.server.endpoint, timeout_s=self._timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def request_stop(self, reason: str = "it was stopped by a signal") -> None:
        """Make `wait` return (a signal handler's way to stop the serving loop). Unless a client
        sent `stop` or every worker is gone, `stop()` then tells the coordinator this server leaves
        before the job finished, for `reason` ("it got SIGTERM"): every peer fails at once naming it."""
        self._stop_reason = reason
        self.server._stop_requested.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a client asked this server to stop (or stop() ran); True if so within `timeout`."""
        return self.server.wait_stop_requested(timeout)

    @property
    def failure(self):
        """A PSError once this server cannot go on: a peer was declared dead, this server itself
        was (it stalled), or the coordinator is lost (see CoordinatorClient.failure); else None."""
        return self.link.failure

    @property
    def heartbeat_s(self) -> float:
        return self.link._heartbeat_s

    @property
    def workers_gone(self) -> bool:
        """Every worker registered and then left or died (as of the last heartbeat): nobody is
        left to send `stop`, so a server loop should end (no orphan servers without a launcher)."""
        return self.link.workers_gone

    def stop(self) -> None:
        """Deregister, stop serving, and (server 0) stop the coordinator. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        why = ""
        if self._stop_reason and not self.server.stop_verb_received and not self.link.workers_gone and self.link.failure is None:
            why = f"{self._stop_reason} (no worker had sent stop)"
        self.link.deregister(timeout_s=2.0, why=why)
        if why and self.coordinator is not None:
            # This process hosts the coordinator: serve until every live peer heard who left (its
            # next heartbeat), two heartbeat periods at most, else they would wait out a lease.
            self.coordinator.wait_told(2 * self.heartbeat_s + 0.5)
        self.link.close()
        self.server.stop()
        if self.coordinator is not None:
            self.coordinator.stop()

    def __enter__(self) -> "ServerNode":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def connect(role: Role, timeout_s: float = 60.0, request_timeout_s: float | None = None) -> PSClient:
    """A worker's PSClient for the cluster of `role`: registers with the coordinator (heartbeats
    start), waits up to `timeout_s` for every server to register (PSTimeoutError naming the missing
    ones; PSError at once if one is dead), and returns the client (`close()` deregisters).
    `request_timeout_s` is the client's default wait (default `timeout_s`)."""
    if not role.is_worker:
        raise ConfigError(f"connect: role {role.name} is not a worker; servers run a ServerNode (recps.ps.fleet: init_server)")
    link = CoordinatorClient(role.coordinator, token=role.token, timeout_s=timeout_s)
    try:
        link.register("worker", role.index, timeout_s=timeout_s)
        endpoints = link.wait_for_servers(timeout_s)
    except BaseException:
        link.deregister(timeout_s=1.0)
        link.close()
        raise
    if role.server_endpoints is not None:
        expected = [tcp_endpoint(e) for e in role.server_endpoints]
        if expected != endpoints:
            logger.warning("%s: servers registered at %s, the role says %s; using the registered ones", role.name, endpoints, expected)
    return PSClient(endpoints, token=role.token, timeout_s=request_timeout_s or timeout_s, coordinator=link,
                    worker_index=role.index, num_workers=role.num_workers)
