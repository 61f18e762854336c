"""Who may talk to a server, and what a peer may cost it before it proved it: CURVE, ZAP, bounds.

Authentication and encryption (ZeroMQ's CURVE, RFC 26, with ZAP, RFC 27):

    cluster token --scrypt--> server secret key, client secret key   (curve_keys: every process of
                              (and their public keys)                 the job derives the same four)
    server socket: CURVE server with the server secret key; a ZAP handler (pyzmq's zmq.auth) admits
                   only clients that present the client public key
    client socket: CURVE client that knows the server public key and holds the client key pair

A connection starts with a handshake of fresh (ephemeral) keys: each side proves it holds its
long-term secret key, and every message after it is encrypted and authenticated (Poly1305) under
that connection's keys with a nonce that only counts up. So a packet captured on the wire cannot
be replayed (not on another connection: its keys differ; not on the same one: its nonce is spent),
nor forged or altered (the box does not open), nor read; and a reply comes from a process that
holds the token. Nobody without the token gets a message to the request handler.

The token is the only secret: recps.launch makes a random one per job (secrets.token_hex(16))
unless $RECPS_CLUSTER_TOKEN or --token gives one. scrypt makes guessing a short token from a
captured handshake slow, but give a long random one on a network that others can reach.

$RECPS_TRANSPORT_ENCRYPTION=off (or TransportServer/TransportClient(curve=False)) turns CURVE off:
requests then carry only the token digest in clear, which anyone who captures one can replay.
It exists for measurements and trusted networks (benchmarks/RESULTS.md has the cost of
encryption); every process of a job must use the same setting, and a server logs a warning.

Bounds that hold before any authentication (issue 15):
- no frame over MAX_FRAME_BYTES (wire.MAX_FRAME_BYTES, 16 MiB; large tensors travel in chunks):
  ZMQ_MAXMSGSIZE, so a peer that declares a larger frame is disconnected before anything is
  allocated for it;
- at most `max_unauthenticated` connections between accept and their first authenticated message
  (`PendingConnections`); one more is shut down at once; the handshake must end within
  `handshake_timeout_s` (ZMQ_HANDSHAKE_IVL). Memory held for unauthenticated peers is therefore at
  most max_unauthenticated x (MAX_FRAME_BYTES + ZeroMQ's 8 KiB read batch), for at most
  handshake_timeout_s per connection;
- every rejected message or connection is counted by reason (`RejectionLog.counts()`) and logged
  at most once per `interval_s`: the first at once, then a line with the counts since the last.

>>> keys = curve_keys("secret")
>>> keys == curve_keys(b"secret") and keys != curve_keys("other")
True
>>> len(keys.server_public), keys.server_public == keys.client_public
(40, False)
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from recps.errors import ConfigError
from recps.ps.transport.wire import MAX_FRAME_BYTES, resolve_token

__all__ = [
    "CurveKeys",
    "curve_keys",
    "resolve_encryption",
    "ENCRYPTION_ENV",
    "ZAP_DOMAIN",
    "MAX_UNAUTHENTICATED",
    "HANDSHAKE_TIMEOUT_S",
    "REJECTION_LOG_INTERVAL_S",
    "RejectionLog",
    "PendingConnections",
    "secure_server_socket",
    "secure_client_socket",
    "start_authenticator",
    "handshake_failure",
    "MAX_WIRE_FRAME_BYTES",
    "HEARTBEAT_IVL_S",
    "HEARTBEAT_TIMEOUT_S",
]

logger = logging.getLogger(__name__)

ENCRYPTION_ENV = "RECPS_TRANSPORT_ENCRYPTION"
ZAP_DOMAIN = "recps"
MAX_UNAUTHENTICATED = 32  # connections in their handshake (or before their first message) at once
HANDSHAKE_TIMEOUT_S = 10.0  # ZMQ_HANDSHAKE_IVL: a peer that has not finished its handshake by then is dropped
REJECTION_LOG_INTERVAL_S = 10.0

# scrypt: 16 MiB and ~0.1 s per derivation, once per process and token (cached).
_SCRYPT = {"n": 1 << 14, "r": 8, "p": 1, "maxmem": 64 << 20}
_SALT = b"recps-curve-keys-v1"

# Monitor events (values: libzmq's) the transport reads.
EVENT_ACCEPTED = int(zmq.EVENT_ACCEPTED)
EVENT_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
EVENT_HANDSHAKE_SUCCEEDED = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)
EVENT_HANDSHAKE_FAILED = int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                             | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_PROTOCOL_ERRORS = {int(getattr(zmq, n)): n.removeprefix("PROTOCOL_ERROR_") for n in dir(zmq) if n.startswith("PROTOCOL_ERROR_")}


@dataclass(frozen=True)
class CurveKeys:
    """The job's CURVE keys, Z85-encoded (40 bytes each). Never logged (see __repr__)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:
        return f"CurveKeys(server_public={self.server_public.decode()}, client_public={self.client_public.decode()})"


@functools.lru_cache(maxsize=8)
def _derive(token: bytes) -> CurveKeys:
    material = hashlib.scrypt(token, salt=_SALT, dklen=64, **_SCRYPT)
    # Any 32 bytes are a Curve25519 secret key (the scalar is clamped when used).
    server_secret, client_secret = z85.encode(material[:32]), z85.encode(material[32:])
    return CurveKeys(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret)


def curve_keys(token: str | bytes | None) -> CurveKeys:
    """The job's CURVE key pairs, derived from the cluster token (None reads $RECPS_CLUSTER_TOKEN)."""
    if not zmq.has("curve"):
        raise ConfigError(
            f"this libzmq ({zmq.zmq_version()}) has no CURVE security; install the pyzmq wheel (it bundles a libzmq "
            f"with libsodium), or set {ENCRYPTION_ENV}=off on every process of a trusted network"
        )
    return _derive(resolve_token(token))


def resolve_encryption(curve: bool | None) -> bool:
    """Whether to use CURVE: `curve` if given, else $RECPS_TRANSPORT_ENCRYPTION (curve, the default, or off)."""
    if curve is not None:
        return bool(curve)
    value = os.environ.get(ENCRYPTION_ENV, "").strip().lower()
    if value in ("", "curve", "on", "1", "true"):
        return True
    if value in ("off", "0", "false", "none"):
        return False
    raise ConfigError(f"${ENCRYPTION_ENV}={value!r}; use curve (the default) or off, the same on every process")


# On the wire a CURVE message frame is the frame plus 33 bytes ("\x07MESSAGE", nonce, flags, MAC).
_CURVE_OVERHEAD = 256
MAX_WIRE_FRAME_BYTES = MAX_FRAME_BYTES + _CURVE_OVERHEAD

# ZMTP heartbeats on every connection, both ways (answered by ZeroMQ's I/O threads, never by Python code):
# a connection on which nothing arrived for HEARTBEAT_TIMEOUT_S after a PING is dropped, and the
# connecting side reconnects. This is what ends a connection that a frame failing authentication left
# open but unread (issue 33.1): libzmq 4.3.5 stops reading such a connection instead of closing it when
# the socket's monitor listens for HANDSHAKE_FAILED_PROTOCOL (sending the event overwrites the errno
# EPROTO that would close it with EAGAIN), and the transport's monitors listen for it to count and report it.
HEARTBEAT_IVL_S = 1.0
HEARTBEAT_TIMEOUT_S = 3.0


def _common_options(sock: zmq.Socket) -> None:
    sock.maxmsgsize = MAX_WIRE_FRAME_BYTES  # a larger declared frame disconnects the peer, before any allocation
    sock.heartbeat_ivl = int(HEARTBEAT_IVL_S * 1000)
    sock.heartbeat_timeout = int(HEARTBEAT_TIMEOUT_S * 1000)


def secure_server_socket(sock: zmq.Socket, keys: CurveKeys | None, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """A listening socket's options: frame bound, handshake deadline and (keys given) CURVE + ZAP domain."""
    _common_options(sock)
    sock.handshake_ivl = max(1, int(handshake_timeout_s * 1000))
    if keys is not None:
        sock.curve_server = True
        sock.curve_secretkey = keys.server_secret
        sock.zap_domain = ZAP_DOMAIN.encode()


def secure_client_socket(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """A connecting socket's options: frame bound and (keys given) CURVE with the job's server key."""
    _common_options(sock)
    if keys is not None:
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret


class _ClientKeyCheck:
    """ZAP credentials provider: admits the job's client public key only."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == ZAP_DOMAIN and key == self.client_public


def start_authenticator(ctx: zmq.Context, keys: CurveKeys):
    """pyzmq's ZAP handler on `ctx` (a thread), admitting CURVE clients with the job's client key.
    Refusals reach the server as HANDSHAKE_FAILED_AUTH monitor events (counted there). Stop it
    before the context is destroyed."""
    auth = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_ClientKeyCheck(keys.client_public))
    return auth


def handshake_failure(event: int, value: int) -> str:
    """A readable reason for a HANDSHAKE_FAILED_* monitor event."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"refused by ZAP (status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"protocol error {_PROTOCOL_ERRORS.get(value, value)}"
    return f"connection closed during the handshake ({os.strerror(value) if 0 < value < 200 else value})"


class RejectionLog:
    """Counts rejections by reason and logs them at most once per `interval_s`.

    The first rejection is logged at once with its detail; later ones within the interval are only
    counted, and the next line (at the next rejection or `tick()` after the interval, or `flush()`)
    gives the counts since the previous line. A flood of N rejections thus costs N counter
    increments and about duration / interval_s log lines. Thread-safe.

    >>> log = RejectionLog("server tcp://127.0.0.1:1", interval_s=60.0)
    >>> for _ in range(3):
    ...     log.note("malformed", "bad magic")
    >>> log.counts(), log.total()
    ({'malformed': 3}, 3)
    """

    def __init__(self, where: str, interval_s: float = REJECTION_LOG_INTERVAL_S, log: logging.Logger | None = None,
                 what: str = "") -> None:
        """`what(n)` of a line: "rejected N messages or connections" unless `what` names the events
        (e.g. "requests that failed in their handler")."""
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s}; give a positive number of seconds")
        self.where, self.interval_s, self.what = where, float(interval_s), what
        self._log = log or logger
        self._lock = threading.Lock()
        self._totals: dict[str, int] = {}
        self._window: dict[str, int] = {}
        self._last_detail = ""
        self._last_line = -float("inf")
        self._window_start = time.monotonic()

    def note(self, reason: str, detail: str = "") -> None:
        """Count one rejection; log if the interval has passed since the last line."""
        with self._lock:
            self._totals[reason] = self._totals.get(reason, 0) + 1
            self._window[reason] = self._window.get(reason, 0) + 1
            self._last_detail = detail or reason
            line = self._take_line(time.monotonic())
        if line:
            self._log.warning("%s", line)

    def tick(self) -> None:
        """Log the counts held back, if the interval has passed (called periodically)."""
        with self._lock:
            line = self._take_line(time.monotonic()) if self._window else None
        if line:
            self._log.warning("%s", line)

    def flush(self) -> None:
        """Log the counts held back now (at stop)."""
        with self._lock:
            line = self._take_line(time.monotonic(), force=True) if self._window else None
        if line:
            self._log.warning("%s", line)

    def _take_line(self, now: float, force: bool = False) -> str | None:
        if not force and now - self._last_line < self.interval_s:
            return None
        n = sum(self._window.values())
        counts = ", ".join(f"{reason}: {count}" for reason, count in sorted(self._window.items()))
        span = now - self._window_start
        events = (f"{n} {self.what}" if self.what else
                  f"rejected {n} message{'s' if n != 1 else ''} or connection{'s' if n != 1 else ''}")
        line = f"{self.where}: {events} in the last {span:.1f} s ({counts}); last: {self._last_detail}"
        self._window.clear()
        self._last_line = self._window_start = now
        return line

    def counts(self) -> dict[str, int]:
        """Rejections since the start, by reason."""
        with self._lock:
            return dict(self._totals)

    def total(self) -> int:
        with self._lock:
            return sum(self._totals.values())


class PendingConnections:
    """Connections accepted by a listening socket that have not yet delivered a message, and the
    bound on them. Fed by the socket's monitor events and by each received message's source fd
    (ZMQ_SRCFD); used by one thread (the server's front thread).

    A connection stops being pending with its first message (it passed the handshake: CURVE and
    ZAP, or the NULL mechanism without encryption), when it closes, or `handshake_timeout_s`
    after it was accepted (ZeroMQ drops one whose handshake took longer, so one still open
    finished it). Rejections are noted in `rejections`:
    - "handshake": a HANDSHAKE_FAILED_* event (wrong token, a replayed or altered packet, ZAP
      refusal, a peer that closed or timed out in its handshake), or a message that did not
      authenticate on an established connection;
    - "unauthenticated_closed": closed before its first message without such an event (a declared
      frame over MAX_WIRE_FRAME_BYTES, bytes that are not ZMTP);
    - "unauthenticated_limit": accepted while `limit` others were pending, shut down at once.
    """

    def __init__(self, limit: int, handshake_timeout_s: float, rejections: RejectionLog, endpoint: str | None = None) -> None:
        if limit < 1:
            raise ValueError(f"max_unauthenticated={limit}; at least 1 connection must be able to authenticate")
        self.limit, self.timeout_s, self.rejections = int(limit), float(handshake_timeout_s), rejections
        self.endpoint = endpoint  # the listening endpoint: an fd is shut down only if it is one of its connections
        self.pending: dict[int, float] = {}  # fd -> when accepted (monotonic)
        self._evicted: set[int] = set()
        # Reasons of handshake failures whose disconnection is still to come: libzmq reports a failure
        # right before the DISCONNECTED event of the same connection (one I/O thread, in order).
        self._failures: collections.deque[str] = collections.deque()

    def __len__(self) -> int:
        return len(self.pending)

    def on_event(self, event: int, value: int) -> None:
        """One monitor event of the listening socket (`value`: the fd for ACCEPTED and DISCONNECTED)."""
        if event == EVENT_ACCEPTED:
            self.expire()
            if len(self.pending) >= self.limit:
                self._evicted.add(value)
                self.rejections.note("unauthenticated_limit",
                                     f"{len(self.pending)} connections were still unauthenticated; one more was shut down")
                _shutdown(value, self.endpoint)
            else:
                self.pending[value] = time.monotonic()
        elif event & EVENT_HANDSHAKE_FAILED:
            self._failures.append(handshake_failure(event, value))
        elif event == EVENT_DISCONNECTED:
            failure = self._failures.popleft() if self._failures else None
            if value in self._evicted:  # counted when it was shut down
                self._evicted.discard(value)
                return
            was_pending = self.pending.pop(value, None) is not None
            if failure is not None:  # in the handshake, or a message that did not authenticate afterwards
                self.rejections.note("handshake", f"a handshake failed: {failure}")
            elif was_pending:
                self.rejections.note("unauthenticated_closed", "a connection closed before its first message "
                                     f"(a declared frame over {MAX_WIRE_FRAME_BYTES} bytes, or bytes that are not ZMTP)")

    def authenticated(self, fd: int) -> None:
        """A message arrived from `fd`."""
        self.pending.pop(fd, None)

    def expire(self) -> None:
        """Forget connections accepted more than handshake_timeout_s ago: still open, they finished
        their handshake (ZeroMQ drops one that did not)."""
        now = time.monotonic()
        old = [fd for fd, t in self.pending.items() if now - t > self.timeout_s]
        for fd in old:
            del self.pending[fd]


def _ours(sockname, endpoint: str | None) -> bool:
    """Whether an accepted socket's local address belongs to listening `endpoint` (tcp: its port; ipc: its path)."""
    if endpoint is None:
        return True
    if endpoint.startswith("ipc://"):
        return sockname == endpoint[len("ipc://"):]
    return isinstance(sockname, tuple) and endpoint.rsplit(":", 1)[-1] == str(sockname[1])


def _shutdown(fd: int, endpoint: str | None) -> None:
    """Shut down (not close: ZeroMQ owns it) the accepted connection on `fd`; ZeroMQ then sees it
    end and closes it. Skipped if `fd` no longer is a connection of our listening endpoint."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return  # closed already
    try:
        if not _ours(sock.getsockname(), endpoint):
            return
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()

