"""TransportClient: sends requests to S servers and returns handles to wait on.

Contract (ps-lite style):

- `request(server, verb, table, tensors, meta)` queues the request and returns a `Handle` at
  once; many requests may be in flight, to one server or to all of them (fan out, then wait).
- `Handle.wait(timeout)` blocks until the reply arrives and returns a `Reply(tensors, meta)`,
  or raises: PSError for an error reply (handler error, token mismatch, malformed request),
  PSTimeoutError after `timeout` seconds, naming the server, the verb, the table and the key
  count (the length of the request's first tensor). A timed-out request is abandoned: its late
  reply is dropped and later waits on the handle raise the same error.
- Thread-safe: each calling thread gets its own sockets (one DEALER per server), created on its
  first request (or inherited from a thread that ended), so threads never contend for a socket
  and a reply needs no hop through a helper thread. A handle may be waited on from another
  thread: its owner's sockets are then borrowed under a lock, which delays the owner's next
  request by up to 50 ms (one polling slice).
- Tensors are sent without a copy (64 KiB and more): do not modify them before the reply arrives.
  Reply tensors share memory with the received message (no copy) and are writable.
- Only requests fail on a dead server; detect one with `ping(server, timeout)`, or let whoever
  watches the servers (recps.ps.node's coordinator heartbeats) call `fail_server(server, error)`:
  every request in flight to that server, and every later one, then fails at once with `error`
  (within one polling slice, 50 ms) instead of waiting out its timeout.
- Security (`security`): each socket is a CURVE client with the job's keys (derived from the
  token) and takes no frame over wire.MAX_FRAME_BYTES. A server that refuses the handshake
  HANDSHAKE_ATTEMPTS times in a row (another token, or no encryption) fails the requests waiting
  for it with PSError at once. A reply that fails authentication on an established connection
  (altered on the way) fails the requests in flight to that server at once, with PSError: their
  outcome is unknown.
- Resends: a connection that drops while requests are in flight on it (the server dropped it
  after a frame injected on the way failed authentication, or the ZMTP heartbeats found it dead:
  security.HEARTBEAT_TIMEOUT_S) is reopened by ZeroMQ, and those requests are sent again on it, with
  the same request ids, until wire.RESEND_WINDOW_S after they were first sent; later, they fail
  with PSError ("its outcome is unknown"). A request is run at most once (wire.REQUEST_ONCE: the
  server answers a resend with the first reply) unless it is sent with once=False (a read, which
  may run again). `resends` counts the requests sent again.

>>> import torch
>>> from recps.ps.transport import TransportServer
>>> rows = torch.arange(12.0).view(6, 2)                           # (rows, D) the server's table
>>> pull = lambda verb, table, tensors, meta: [rows[tensors[0]]]   # (K, D)
>>> with TransportServer(pull, token="t") as s0, TransportServer(pull, token="t") as s1, \\
...         TransportClient([s0.endpoint, s1.endpoint], token="t", timeout_s=5.0) as client:
...     handles = [client.request(i, "pull", "emb", [torch.tensor([i, 5])]) for i in range(2)]
...     [r.tensors[0].tolist() for r in wait_all(handles)]
[[[0.0, 1.0], [10.0, 11.0]], [[2.0, 3.0], [10.0, 11.0]]]
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
import zmq
import zmq.utils.monitor

from recps.errors import PSError, PSTimeoutError
import recps.ps.transport.security as security
import recps.ps.transport.wire as wire
from recps.ps.transport.wire import PING, MetaValue, Status

__all__ = ["TransportClient", "Handle", "Reply", "wait_all"]

logger = logging.getLogger(__name__)

# Plain ints: pyzmq's enum constants cost an enum construction per use on this hot path.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
_SLICE_S = 0.05  # a borrowed channel is released this often while a wait polls it
_SNDHWM = 10_000  # requests queued to one unreachable server before request() refuses more
HANDSHAKE_ATTEMPTS = 3  # handshakes refused in a row before the requests to that server fail (reconnects are 0.1 s apart)
_MONITORED = int(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                 | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_DISCONNECTED)


@dataclass
class Reply:
    """A server's answer: the handler's tensors and meta."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    meta: dict[str, MetaValue] = field(default_factory=dict)


class Handle:
    """One request in flight. `wait(timeout)` returns its Reply or raises; see the module docstring."""

    __slots__ = ("server", "endpoint", "verb", "table", "num_keys", "request_id", "_channel", "_done", "_reply", "_error",
                 "_timeout_s", "_frames", "_sent_at")

    def __init__(self, channel: "_Channel", server: int, endpoint: str, verb: str, table: str, num_keys: int, rid: int,
                 timeout_s: float, frames: list):
        self.server, self.endpoint, self.verb, self.table = server, endpoint, verb, table
        self.num_keys, self.request_id = num_keys, rid
        self._channel = channel
        self._done = False  # set under the channel lock, by whoever pumps the channel
        self._reply: Reply | None = None
        self._error: PSError | None = None
        self._timeout_s = timeout_s
        self._frames = frames  # kept for a resend until the reply arrives
        self._sent_at = time.monotonic()

    def done(self) -> bool:
        """Whether the reply (or an error) is in; never blocks beyond a zero-timeout poll."""
        if not self._done and self._channel.lock.acquire(blocking=False):
            try:
                if not self._channel.client._closed:
                    self._channel.pump(self, time.monotonic())
                    failed = self._channel.client._failed.get(self.server)
                    if not self._done and failed is not None:
                        self._fail(failed)
            finally:
                self._channel.lock.release()
        return self._done

    def wait(self, timeout: float | None = None) -> Reply:
        """The reply, within `timeout` seconds (default: the client's timeout_s)."""
        timeout = self._timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        channel = self._channel
        while not self._done:
            if channel.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                try:
                    if channel.client._closed:
                        self._fail(PSError(f"the transport client was closed while {self.verb} to {self.endpoint} was in flight"))
                    elif not self._done:
                        channel.pump(self, deadline)
                        failed = channel.client._failed.get(self.server)
                        if not self._done and failed is not None:
                            self._fail(failed)
                        elif not self._done and time.monotonic() >= deadline:
                            self._fail(self._timeout_error(timeout))
                finally:
                    channel.lock.release()
            elif not self._done:
                # Another thread held this channel until our deadline; it may still complete us.
                with channel.lock:
                    if not self._done:
                        self._fail(self._timeout_error(timeout))
        if self._error is not None:
            raise self._error
        return self._reply

    def _timeout_error(self, timeout: float) -> PSTimeoutError:
        return PSTimeoutError(
            f"{self._channel.client.names[self.server]} at {self.endpoint} did not answer {self.verb} on table {self.table!r} "
            f"({self.num_keys} keys) within {timeout:g} s; is it alive? (ping it, or raise the timeout)"
        )

    def _fail(self, error: PSError) -> None:
        """Abandon the request (channel lock held): its late reply will be dropped."""
        self._channel.pending.pop(self.request_id, None)
        self._error = error
        self._done = True
        self._frames = None

    def _complete(self, msg: wire.Message) -> None:
        self._frames = None
        if msg.status == Status.OK:
            self._reply = Reply(msg.tensors, msg.meta)
        elif msg.status == Status.TOKEN_MISMATCH:
            self._error = PSError(f"server {self.endpoint} refused {self.verb} on table {self.table!r}: {msg.text}")
        else:
            self._error = PSError(f"server {self.endpoint} failed {self.verb} on table {self.table!r} ({self.num_keys} keys): {msg.text}")
        self._done = True

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"Handle({self.verb} {self.table!r} {self.num_keys} keys -> {self.endpoint}, {state})"


def wait_all(handles: Sequence[Handle], timeout: float | None = None) -> list[Reply]:
    """The replies of `handles` in order, all within one `timeout` (default: each handle's client timeout).

    Raises the first error met, after which the remaining handles are left to their own waits.
    """
    if timeout is None:
        return [h.wait() for h in handles]
    deadline = time.monotonic() + timeout
    return [h.wait(max(0.0, deadline - time.monotonic())) for h in handles]


class _Link:
    """What a channel knows of its connection to one server, from the socket's monitor events."""

    __slots__ = ("server", "monitor", "established", "refusals")

    def __init__(self, server: int, monitor: zmq.Socket) -> None:
        self.server, self.monitor = server, monitor
        self.established = False  # a handshake succeeded and the connection has not dropped since
        self.refusals = 0  # handshakes failed in a row


class _Channel:
    """One thread's sockets (a DEALER per server) and the requests it has in flight."""

    def __init__(self, client: "TransportClient") -> None:
        self.client = client
        self.owner = threading.current_thread()
        self.lock = threading.Lock()
        self.sockets: dict[int, zmq.Socket] = {}
        self.links: dict[zmq.Socket, _Link] = {}  # monitor socket -> its link
        self.poller = zmq.Poller()
        self.pending: dict[int, Handle] = {}

    def socket(self, server: int) -> zmq.Socket:
        sock = self.sockets.get(server)
        if sock is None:
            sock = self.client._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.sndhwm = _SNDHWM
            sock.copy_threshold = wire.ZERO_COPY_BYTES
            security.secure_client_socket(sock, self.client._keys)
            monitor = sock.get_monitor_socket(_MONITORED)
            sock.connect(self.client.endpoints[server])
            self.sockets[server] = sock
            self.links[monitor] = _Link(server, monitor)
            self.poller.register(sock, zmq.POLLIN)
            self.poller.register(monitor, zmq.POLLIN)
        return sock

    def pump(self, target: Handle, deadline: float) -> None:
        """Receive replies, completing their handles, until `target` is done, `deadline` passes or
        one slice ends (the caller holds the lock and releases it between slices)."""
        end = min(deadline, time.monotonic() + _SLICE_S)
        while True:
            ms = max(0.0, end - time.monotonic()) * 1000
            for sock, _ in self.poller.poll(ms):
                if sock.closed:
                    continue  # retired by _watch in this round
                link = self.links.get(sock)
                if link is None:
                    self._drain(sock)
                else:
                    self._watch(link)
            if target._done or time.monotonic() >= end:
                return

    def _drain(self, sock: zmq.Socket) -> None:
        # Socket.get() keeps the GIL where a receive that fails with Again would let go of it.
        while sock.get(_EVENTS) & _POLLIN:
            frames = wire.recv(sock, _NOBLOCK)
            try:
                msg = wire.decode(frames)
            except wire.WireError as e:
                rid = wire.peek_request_id(frames[0])
                handle = self.pending.pop(rid, None) if rid is not None else None
                logger.warning("malformed reply from %s: %s", handle.endpoint if handle else "a server", e)
                if handle is not None:
                    handle._error = PSError(f"server {handle.endpoint} sent a malformed reply to {handle.verb}: {e}")
                    handle._done, handle._frames = True, None
                continue
            handle = self.pending.pop(msg.request_id, None)
            if handle is None:
                logger.debug("dropped a late reply (request %d)", msg.request_id)
                continue
            handle._complete(msg)

    def _watch(self, link: _Link) -> None:
        """Read `link`'s monitor events; resend the requests in flight when its connection dropped,
        fail them when the server cannot be trusted.

        A failure this side detects (HANDSHAKE_FAILED_PROTOCOL: a box that does not open, another
        mechanism; HANDSHAKE_FAILED_AUTH: refused by the server's ZAP) ends the ZeroMQ session for
        good (it never reconnects), so the socket is retired and the next request opens a new one.
        A connection the server closed during the handshake (NO_DETAIL: it could not open ours) is
        retried by ZeroMQ; HANDSHAKE_ATTEMPTS of them in a row fail the requests."""
        while not link.monitor.closed and link.monitor.get(_EVENTS) & _POLLIN:
            event = zmq.utils.monitor.parse_monitor_message(link.monitor.recv_multipart(_NOBLOCK))
            kind, value = int(event["event"]), int(event["value"])
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.established, link.refusals = True, 0
                continue
            if kind == zmq.EVENT_DISCONNECTED:
                if link.established:  # ZeroMQ reconnects; what the old connection carried may be lost
                    link.established = False
                    self._resend(link.server, "the connection dropped")
                continue
            reason = security.handshake_failure(kind, value)
            endpoint = self.client.endpoints[link.server]
            terminal = kind != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            if link.established:  # a message on an established connection did not authenticate
                self._fail_server(link.server, PSError(
                    f"a message from server {endpoint} failed authentication ({reason}): it was altered on the way, "
                    "or the peer is not that server; the connection was dropped and the outcome of this request "
                    "is unknown (check the network path; every request and reply is authenticated)"))
                if terminal:
                    self._retire(link)
                else:
                    link.established = False
                continue
            link.refusals += 1
            if link.refusals >= HANDSHAKE_ATTEMPTS or terminal:
                self._fail_server(link.server, PSError(
                    f"server {endpoint} refused the secure handshake ({reason}; {link.refusals} in a row): a token "
                    "mismatch (it runs with another cluster token), another encryption setting, or a peer that is not "
                    f"a server of this job; set the same {wire.TOKEN_ENV} / cluster.token (and {security.ENCRYPTION_ENV}) "
                    "on every process"))
            if terminal:
                self._retire(link)

    def _retire(self, link: _Link) -> None:
        """Close the socket of `link` (ZeroMQ gave its connection up); the next request opens another."""
        sock = self.sockets.pop(link.server)
        del self.links[link.monitor]
        for s in (sock, link.monitor):
            self.poller.unregister(s)
        sock.disable_monitor()
        sock.close()
        link.monitor.close()

    def _resend(self, server: int, why: str) -> None:
        """Send the requests in flight to `server` again (channel lock held), on the socket ZeroMQ
        reconnects; those first sent more than wire.RESEND_WINDOW_S ago fail instead."""
        handles = [h for h in self.pending.values() if h.server == server]
        if not handles:
            return
        now, endpoint, resent = time.monotonic(), self.client.endpoints[server], 0
        for handle in handles:
            if now - handle._sent_at > wire.RESEND_WINDOW_S:
                handle._fail(PSError(
                    f"{self.client.names[server]} at {endpoint}: {why} while {handle.verb} on table {handle.table!r} was "
                    f"in flight, more than {wire.RESEND_WINDOW_S:g} s after it was sent; not sent again, its outcome is unknown"))
                continue
            try:
                self.socket(server).send_multipart(handle._frames, _NOBLOCK, copy=False)
            except zmq.Again:
                handle._fail(PSError(f"server {endpoint}: {_SNDHWM} requests queued and unanswered; it is unreachable or overloaded"))
                continue
            resent += 1
        self.client.resends += resent
        if resent:
            logger.warning("%s at %s: %s; %d request%s in flight sent again", self.client.names[server], endpoint, why,
                           resent, "s" if resent != 1 else "")

    def _fail_server(self, server: int, error: PSError) -> None:
        """Fail every request in flight to `server` (channel lock held)."""
        for handle in [h for h in self.pending.values() if h.server == server]:
            handle._fail(error)

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.disable_monitor()
            sock.close()
        for monitor in self.links:
            monitor.close()
        self.sockets.clear()
        self.links.clear()


def _adopt(channel: _Channel) -> bool:
    """Hand the sockets of a thread that ended with nothing in flight to the calling thread.

    Its connections are already up, so a short-lived thread's first request does not wait for a
    TCP handshake; the lock is the memory barrier ZeroMQ asks for when a socket changes threads.
    """
    if channel.owner.is_alive() or not channel.lock.acquire(blocking=False):
        return False
    try:
        if channel.pending:
            return False  # another thread may still wait on these handles
        channel.owner = threading.current_thread()
        return True
    finally:
        channel.lock.release()


class TransportClient:
    """Talks to the servers at `endpoints` (index = server id). Thread-safe.

    Args:
        endpoints: ZeroMQ endpoints of the servers ("tcp://127.0.0.1:40123", "ipc:///tmp/s0.sock").
        token: the cluster token (str or bytes); None reads $RECPS_CLUSTER_TOKEN.
        timeout_s: default timeout of Handle.wait and ping.
        curve: encrypt and authenticate with CURVE (default: $RECPS_TRANSPORT_ENCRYPTION, on unless
            it says off); the servers must use the same setting.
        names: what errors call each server (default "server0", "server1", ...).
    """

    def __init__(self, endpoints: Sequence[str], token: str | bytes | None = None, timeout_s: float = 30.0, *,
                 curve: bool | None = None, names: Sequence[str] | None = None) -> None:
        if not endpoints:
            raise ValueError("no server endpoints; pass at least one, e.g. ['tcp://127.0.0.1:7000']")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}; a positive number of seconds is needed")
        self.endpoints = list(endpoints)
        self.names = list(names) if names is not None else [f"server{i}" for i in range(len(self.endpoints))]
        if len(self.names) != len(self.endpoints):
            raise ValueError(f"{len(self.names)} names for {len(self.endpoints)} endpoints; give one name per endpoint")
        self.timeout_s = float(timeout_s)
        self._failed: dict[int, PSError] = {}  # server -> the error its requests fail with (fail_server)
        self._digest = wire.token_digest(token)
        self._keys = security.curve_keys(token) if security.resolve_encryption(curve) else None
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._channels: list[_Channel] = []
        self._channels_lock = threading.Lock()
        # Request ids: a random session prefix, unique per client for a server's at-most-once log (wire.REQUEST_ONCE).
        self._session = (secrets.randbits(31) | 1) << 32
        self._ids = itertools.count(1)
        self.resends = 0  # requests sent again after their connection dropped (see the module docstring)
        self._closed = False

    def _channel(self) -> _Channel:
        channel = getattr(self._local, "channel", None)
        if channel is None:
            with self._channels_lock:
                channel = next((c for c in self._channels if _adopt(c)), None)
                if channel is None:
                    channel = _Channel(self)
                    self._channels.append(channel)
            self._local.channel = channel
        return channel

    def request(
        self,
        server: int,
        verb: str,
        table: str = "",
        tensors: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] = (),
        meta: Mapping[str, MetaValue] | None = None,
        *,
        once: bool = True,
    ) -> Handle:
        """Send `verb` for `table` with `tensors` (a mapping: named fields) and `meta` to server
        `server`; returns at once. `once`: the server runs it at most once, also when it is resent
        (False: a read, which a resend may run again at no harm)."""
        if self._closed:
            raise PSError("the transport client is closed; create a new one")
        if not 0 <= server < len(self.endpoints):
            raise ValueError(f"server {server} out of range; this client knows {len(self.endpoints)} servers")
        if not verb or (verb.startswith("__") and verb != PING):
            raise ValueError(f"verb {verb!r} is empty or reserved (names starting with '__' belong to the transport)")
        failed = self._failed.get(server)
        if failed is not None:
            raise failed
        rid = self._session | (next(self._ids) & 0xFFFF_FFFF)
        kind = wire.REQUEST_ONCE if once and verb != PING else wire.REQUEST
        frames = wire.encode(kind, rid, verb=verb, text=table, tensors=tensors, meta=meta, token_digest=self._digest)
        first = next(iter(tensors.values() if isinstance(tensors, Mapping) else tensors), None)
        num_keys = int(first.shape[0]) if first is not None and first.dim() else 0
        channel = self._channel()
        handle = Handle(channel, server, self.endpoints[server], verb, table, num_keys, rid, self.timeout_s, frames)
        with channel.lock:
            sock = channel.socket(server)
            channel.pending[rid] = handle
            try:
                sock.send_multipart(frames, _NOBLOCK, copy=False)
            except zmq.Again:
                del channel.pending[rid]
                raise PSError(
                    f"server {self.endpoints[server]}: {_SNDHWM} requests queued and unanswered; "
                    "it is unreachable or overloaded"
                ) from None
        return handle

    def call(self, server: int, verb: str, table: str = "", tensors: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] = (),
             meta: Mapping[str, MetaValue] | None = None, timeout: float | None = None, *, once: bool = True) -> Reply:
        """request(...).wait(timeout)."""
        return self.request(server, verb, table, tensors, meta, once=once).wait(timeout)

    def ping(self, server: int, timeout: float | None = None) -> float:
        """Round-trip seconds of an empty request answered by server `server`'s handler threads.

        Raises PSTimeoutError if it does not answer within `timeout`, PSError if it refuses the token.
        """
        start = time.perf_counter()
        self.request(server, PING).wait(timeout)
        return time.perf_counter() - start

    def fail_server(self, server: int, error: PSError) -> None:
        """Server `server` is gone (its watcher says so): every request in flight to it fails with
        `error` within one polling slice of its wait, and every later request() raises it at once.
        The first error given for a server stays. Thread-safe."""
        if not 0 <= server < len(self.endpoints):
            raise ValueError(f"server {server} out of range; this client knows {len(self.endpoints)} servers")
        self._failed.setdefault(server, error)

    def failed(self, server: int) -> PSError | None:
        """The error fail_server gave for `server`, or None."""
        return self._failed.get(server)

    def close(self) -> None:
        """Close every socket; call once no thread uses the client any more. Pending handles time out."""
        if self._closed:
            return
        self._closed = True
        with self._channels_lock:
            for channel in self._channels:
                with channel.lock:
                    channel.close()
        self._ctx.term()

    def __enter__(self) -> "TransportClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
