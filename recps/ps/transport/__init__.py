"""Moving tensors between processes: ZeroMQ with raw frames, a typed header, a cluster token.

Connections are encrypted and authenticated with CURVE keys derived from the cluster token
(`security`); no frame is larger than wire.MAX_FRAME_BYTES, and a server bounds what peers that
have not authenticated may cost it.

Layer L0, a sibling of recps.ps.table: neither imports the other. recps.ps.node builds the
parameter server's verbs (pull, push, barrier, ...) on top of `TransportServer` and `TransportClient`.
The wire format is in `wire`; nothing received is unpickled.
"""

from recps.ps.transport.client import Handle, Reply, TransportClient, wait_all
from recps.ps.transport.security import ENCRYPTION_ENV, CurveKeys, RejectionLog, curve_keys
from recps.ps.transport.server import Handler, TransportServer
from recps.ps.transport.wire import DTYPE_CODES, MAX_FRAME_BYTES, PING, TOKEN_ENV, Status, WireError, resolve_token

__all__ = [
    "TransportServer",
    "TransportClient",
    "Handle",
    "Handler",
    "Reply",
    "wait_all",
    "PING",
    "Status",
    "WireError",
    "DTYPE_CODES",
    "TOKEN_ENV",
    "resolve_token",
    "MAX_FRAME_BYTES",
    "ENCRYPTION_ENV",
    "CurveKeys",
    "curve_keys",
    "RejectionLog",
]
