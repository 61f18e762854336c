"""Parameter-server nodes (layer L1): servers own shards, clients fan out, a coordinator keeps members.

    PSServer         one server process's table shards; verbs pull / push, their dense twins, create,
                     save / load, shrink, stats, stop; pushes go to the table's mode's server half (server.py)
    PSClient         a worker's client: partitions keys with recps.ps.table.partition, de-duplicates,
                     fans out to all servers in parallel, reassembles; returns PSHandle (client.py)
    Coordinator      membership, named barriers, heartbeats and dead-peer detection; hosted by
                     server 0 on Role.coordinator (coordinator.py)
    ServerNode       a server (and on server 0 the coordinator) joined from a Role (join.py)
    connect          a worker's client from a Role (join.py)

Consistency (sync, async, GEO) is built on these verbs in recps.ps.modes, not inside them.
"""

from recps.ps.node.client import PSClient, PSHandle, unique_inverse
from recps.ps.node.join import ServerNode, connect
from recps.ps.node.coordinator import DEFAULT_DEAD_AFTER_S, Coordinator, CoordinatorClient, tcp_endpoint
from recps.ps.node.server import HostedTable, PSServer, ServerHalf
from recps.ps.node.specs import DenseLayout, TableConfig, dense_spec, sparse_spec

__all__ = [
    "PSServer",
    "PSClient",
    "PSHandle",
    "Coordinator",
    "CoordinatorClient",
    "ServerNode",
    "HostedTable",
    "ServerHalf",
    "TableConfig",
    "connect",
    "DenseLayout",
    "sparse_spec",
    "dense_spec",
    "unique_inverse",
    "tcp_endpoint",
    "DEFAULT_DEAD_AFTER_S",
]
