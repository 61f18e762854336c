"""TransportServer: answers requests from TransportClients with a handler, on several threads.

    clients (DEALER) --tcp/ipc--> ROUTER  [front thread]  --queue--> handler threads (num_threads)
                                  ROUTER <--inproc PUSH/PULL--------  each reply

The front thread only moves messages (zero-copy); handler threads decode, check the token,
call `handler` and encode the reply, so requests are served concurrently (the handler must be
thread-safe). With num_threads=0 the front thread serves requests itself, one at a time.
A malformed or unauthenticated request gets an error reply; it never reaches the handler and
never stops the server. PING ("__ping__") is answered without calling the handler.

Security (`security` has the details): the ROUTER is a CURVE server with keys derived from the
cluster token and pyzmq's ZAP handler admits only the job's client key, so only a process that
holds the token gets a message through, and every request and reply is encrypted and
authenticated per connection (no replay, no forgery). Before authentication a peer costs at most
one frame of wire.MAX_FRAME_BYTES (ZMQ_MAXMSGSIZE) for at most `handshake_timeout_s`, and at most
`max_unauthenticated` peers are in that state at once (the front thread follows the ROUTER's
monitor events). Every rejection is counted by reason (`rejections`) and logged at most once per
`reject_log_interval_s`.

A connection on which a frame fails authentication (a replayed or forged frame injected on the way)
is dropped within security.HEARTBEAT_TIMEOUT_S + HEARTBEAT_IVL_S by the ZMTP heartbeats (libzmq
4.3.5 would stop reading it instead of closing it) and counted as a "handshake" rejection; the
client reconnects and resends what was in flight (`TransportClient`).

At most once: a request of kind wire.REQUEST_ONCE (the client's default; reads are plain REQUESTs)
is remembered by its request id for 2 x wire.RESEND_WINDOW_S (at most ONCE_ENTRIES ended ones). A
resend of one that is still running gets its reply when it ends; a resend of one that ended gets the
same reply again (kept up to ONCE_REPLY_BYTES; a larger one is answered with an error saying it
ran). Resends are counted (`resends`).

Handler contract:

    handler(verb: str, table: str, fields: dict[str | int, Tensor], meta: dict[str, int | float | bool | str])
        fields: the request's tensors by name (`wire`), an unnamed one under its position
        -> list[Tensor]  |  (list[Tensor], meta dict)  |  None (no tensors)
        |  a concurrent.futures.Future resolving to one of these (a deferred reply: the handler
           thread is released at once, the reply leaves when the future completes; use it for
           verbs that wait on other clients, such as a barrier or a synchronous push)

The request's tensors may share memory with the received message; the handler may keep them.
The tensors it returns are sent without a copy (64 KiB and more): it must not modify them
afterwards (return a fresh tensor, or a slice nothing writes to while the reply leaves). An exception raised by the handler
(or set on its future) becomes an error reply "<Type>: <message>" that the client raises as PSError.
"""

from __future__ import annotations

import collections
import hmac
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Mapping, Sequence

import torch
import zmq
import zmq.utils.monitor

from recps.errors import PSError
import recps.ps.transport.security as security
import recps.ps.transport.wire as wire
from recps.ps.transport.wire import PING, Status

__all__ = ["TransportServer", "Handler", "PING"]

logger = logging.getLogger(__name__)

Handler = Callable[[str, str, dict, dict], object]

_server_ids = itertools.count()
# Plain ints: pyzmq's enum constants cost an enum construction per use on this hot path.
_EVENTS, _POLLIN, _NOBLOCK, _RCVMORE, _SRCFD = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK), int(zmq.RCVMORE), int(zmq.SRCFD)
_MONITORED = int(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                 | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_POLL_MS = 1000  # the front thread re-checks its stop flag at least this often
ONCE_REPLY_BYTES = 1 << 16  # a REQUEST_ONCE's reply up to this size is kept for a resend
ONCE_ENTRIES = 200_000  # REQUEST_ONCEs remembered at most (~250 B each): beyond, the oldest ended are forgotten early


class _Once:
    """One REQUEST_ONCE: when it arrived, its reply once it ended, the resends waiting for that."""

    __slots__ = ("arrived", "reply", "waiting")

    def __init__(self, arrived: float) -> None:
        self.arrived, self.reply, self.waiting = arrived, None, []


class _OnceLog:
    """The REQUEST_ONCEs of the last `retain_s` seconds by request id (and the running ones, however
    old), at most `max_entries` (then the oldest ended ones go first, counted in `forgotten_early`: a
    resend of one of those would run again). Thread-safe; a request id is unique per client
    (TransportClient: a random session prefix)."""

    def __init__(self, retain_s: float = 2 * wire.RESEND_WINDOW_S, max_entries: int = ONCE_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.retain_s, self.max_entries, self._clock = retain_s, max_entries, clock
        self.resends = 0
        self.forgotten_early = 0
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[int, _Once] = collections.OrderedDict()  # arrival order

    def begin(self, rid: int, identity) -> tuple[bool, list | None]:
        """(True, None): the first arrival, run it. (False, reply): a resend of one that ended, answer
        `reply`. (False, None): a resend of one still running: `identity` gets its reply (see end)."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            entry = self._entries.get(rid)
            if entry is None:
                self._entries[rid] = _Once(now)
                return True, None
            self.resends += 1
            if entry.reply is None:
                entry.waiting.append(identity)
            return False, entry.reply

    def end(self, rid: int, reply: list) -> list:
        """Request `rid` ended with `reply`: the identities of its resends that wait for it."""
        size = sum(memoryview(f).nbytes for f in reply)
        kept = ([bytes(f) for f in reply] if size <= ONCE_REPLY_BYTES else
                _error(rid, Status.HANDLER_ERROR, f"this request ran already and its reply ({size} bytes) was not kept "
                       "for a resend; read the values again"))
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None:
                return []
            entry.reply, waiting, entry.waiting = kept, entry.waiting, []
            return waiting

    def _expire(self, now: float) -> None:
        """Forget ended requests that arrived more than retain_s ago, or the oldest ended ones beyond
        max_entries (lock held)."""
        for _ in range(len(self._entries)):
            rid, entry = next(iter(self._entries.items()))
            full = len(self._entries) >= self.max_entries
            if now - entry.arrived < self.retain_s and not full:
                return
            if entry.reply is None:
                self._entries.move_to_end(rid)  # still running: its resends must find it
            else:
                del self._entries[rid]
                self.forgotten_early += now - entry.arrived < self.retain_s


def _endpoint(bind: str, port: int) -> str:
    """The endpoint to bind, from a host and port (0 = any free port) or a full ZeroMQ endpoint."""
    if "://" in bind:
        return bind
    return f"tcp://{bind}:{port if port else '*'}"  # "*": the OS picks a free port


class TransportServer:
    """Serves one handler on one endpoint. Thread-safe handler required when num_threads > 1.

    Args:
        handler: see the module docstring.
        token: the cluster token (str or bytes); None reads $RECPS_CLUSTER_TOKEN. The CURVE keys
            are derived from it (`security.curve_keys`); a request must also carry its digest, else
            it is refused with Status.TOKEN_MISMATCH.
        bind: a host to bind on TCP ("127.0.0.1", the default, accepts local clients only), or a
            full ZeroMQ endpoint ("tcp://10.0.0.5:7000", "ipc:///tmp/recps-s0.sock").
        port: TCP port when `bind` is a host; 0 picks a free one (read `endpoint` after start()).
        num_threads: handler threads serving requests concurrently. 0 serves every request on the
            network thread itself: one hop less per request (see benchmarks/RESULTS.md), but one
            request at a time, so only for handlers that never block (deferred replies still work).
        curve: encrypt and authenticate with CURVE + ZAP (default: $RECPS_TRANSPORT_ENCRYPTION, on
            unless it says off). Clients must use the same setting.
        max_unauthenticated: connections that may be in their handshake (before their first
            message) at once; one more is shut down at accept.
        handshake_timeout_s: a connection that has not finished its handshake by then is dropped.
        reject_log_interval_s: rejected messages and connections are logged at most once per interval.

    >>> import torch
    >>> from recps.ps.transport import TransportClient
    >>> double = lambda verb, table, tensors, meta: [tensors[0] * 2]
    >>> with TransportServer(double, token="t") as server, TransportClient([server.endpoint], "t") as client:
    ...     client.request(0, "pull", "emb", [torch.arange(3)]).wait(5.0).tensors[0].tolist()
    [0, 2, 4]
    """

    def __init__(
        self,
        handler: Handler,
        token: str | bytes | None = None,
        bind: str = "127.0.0.1",
        port: int = 0,
        num_threads: int = 2,
        *,
        curve: bool | None = None,
        max_unauthenticated: int = security.MAX_UNAUTHENTICATED,
        handshake_timeout_s: float = security.HANDSHAKE_TIMEOUT_S,
        reject_log_interval_s: float = security.REJECTION_LOG_INTERVAL_S,
    ) -> None:
        if num_threads < 0:
            raise ValueError(f"num_threads={num_threads}; use 0 (serve on the network thread) or more")
        if max_unauthenticated < 1:
            raise ValueError(f"max_unauthenticated={max_unauthenticated}; at least 1 connection must be able to authenticate")
        if handshake_timeout_s <= 0:
            raise ValueError(f"handshake_timeout_s={handshake_timeout_s}; give a positive number of seconds")
        self._handler = handler
        self._digest = wire.token_digest(token)
        self._keys = security.curve_keys(token) if security.resolve_encryption(curve) else None
        self._max_unauthenticated = max_unauthenticated
        self._handshake_timeout_s = handshake_timeout_s
        self._authenticator = None
        self._bind = _endpoint(bind, port)
        self._rejections = security.RejectionLog(f"server {self._bind}", reject_log_interval_s, logger)
        # a token holder's malformed requests fail in the handler: counted, logged as the rejections are
        self._handler_errors = security.RejectionLog(f"server {self._bind}", reject_log_interval_s, logger,
                                                     what="requests failed in their handler")
        self._once = _OnceLog()
        self._num_threads = num_threads
        self._name = f"recps-server-{next(_server_ids)}"
        self._ctx: zmq.Context | None = None
        self._endpoint: str | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._deferred_out: zmq.Socket | None = None  # shared by the threads that complete deferred replies
        self._deferred_lock = threading.Lock()
        self._finish_lock = threading.Lock()
        self._terminated = False

    @property
    def encrypted(self) -> bool:
        """Whether this server speaks CURVE (else: plaintext with the token digest)."""
        return self._keys is not None

    @property
    def rejections(self) -> dict[str, int]:
        """Rejected messages and connections since start, by reason: "malformed", "token",
        "handshake", "unauthenticated_closed", "unauthenticated_limit" (see security.PendingConnections)."""
        return self._rejections.counts()

    @property
    def handler_errors(self) -> dict[str, int]:
        """Requests whose handler raised since start, by verb and error type (e.g. "pull ConfigError")."""
        return self._handler_errors.counts()

    @property
    def resends(self) -> int:
        """Requests run at most once (wire.REQUEST_ONCE) that arrived again since start (a client resent
        them after its connection dropped); each was answered with the first one's reply."""
        return self._once.resends

    @property
    def endpoint(self) -> str:
        """The endpoint clients connect to, e.g. "tcp://127.0.0.1:40123" (known after start())."""
        if self._endpoint is None:
            raise PSError(f"server on {self._bind} has no endpoint yet; call start() first")
        return self._endpoint

    def start(self) -> "TransportServer":
        """Bind and start serving; raises PSError if the endpoint cannot be bound."""
        if self._ctx is not None:
            raise PSError(f"server {self._endpoint} was started already; a TransportServer starts once, create a new one")
        ctx = zmq.Context()
        if self._keys is not None:
            self._authenticator = security.start_authenticator(ctx, self._keys)  # before the first connection
        router = ctx.socket(zmq.ROUTER)
        router.linger = 0
        router.copy_threshold = wire.ZERO_COPY_BYTES
        security.secure_server_socket(router, self._keys, self._handshake_timeout_s)
        monitor = router.get_monitor_socket(_MONITORED)  # before bind: no connection goes unseen
        try:
            router.bind(self._bind)
            self._endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            router.disable_monitor()
            monitor.close()
            router.close()
            if self._authenticator is not None:
                self._authenticator.stop()
            ctx.term()
            raise PSError(f"cannot bind server to {self._bind}: {e}; pick another port or address") from None
        self._rejections.where = f"server {self._endpoint}"
        pending = security.PendingConnections(self._max_unauthenticated, self._handshake_timeout_s, self._rejections,
                                              self._endpoint)
        replies = ctx.socket(zmq.PULL)
        replies.linger = 0
        replies.rcvhwm = 0
        replies.bind(f"inproc://{self._name}-replies")
        control = ctx.socket(zmq.PULL)
        control.linger = 0
        control.bind(f"inproc://{self._name}-control")
        self._deferred_out = self._reply_socket(ctx)
        self._ctx = ctx
        # Sockets created here move to the front thread; Thread.start() is the memory barrier zmq asks for.
        front = threading.Thread(target=self._front, args=(router, replies, control, monitor, pending),
                                 name=f"{self._name}-front", daemon=True)
        self._threads = [front] + [
            threading.Thread(target=self._work, name=f"{self._name}-handler-{i}", daemon=True)
            for i in range(self._num_threads)
        ]
        for t in self._threads:
            t.start()
        if self._keys is None:
            logger.warning("server %s: encryption is off (curve=False or $%s=off): requests are authenticated by the "
                           "token digest alone, in clear, and a captured one can be replayed; use it on a trusted network only",
                           self._endpoint, security.ENCRYPTION_ENV)
        logger.info("server listening on %s with %d handler threads (%s)", self._endpoint, self._num_threads,
                    "CURVE" if self._keys is not None else "no encryption")
        return self

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop serving; in-flight requests may go unanswered. True if every thread ended within
        `timeout` and the sockets are closed. Called by a handler, it returns False at once and
        finishes in the background when that handler returns."""
        if self._ctx is None:
            return True
        if not self._stopping.is_set():
            self._stopping.set()
            ctl = self._ctx.socket(zmq.PUSH)
            ctl.linger = 0
            ctl.connect(f"inproc://{self._name}-control")
            try:
                ctl.send(b"stop", zmq.NOBLOCK)
            except zmq.Again:
                pass  # the front thread also polls the stop flag
            ctl.close()
            for _ in range(self._num_threads):
                self._queue.put(None)
        if threading.current_thread() in self._threads:
            threading.Thread(target=self._finish, args=(timeout,), name=f"{self._name}-stop", daemon=True).start()
            return False
        return self._finish(timeout)

    def _finish(self, timeout: float) -> bool:
        """Join the server's threads, then close the context (once)."""
        with self._finish_lock:
            if self._terminated:
                return True
            deadline = time.monotonic() + timeout
            for t in self._threads:
                t.join(max(0.0, deadline - time.monotonic()))
            if any(t.is_alive() for t in self._threads):
                # Terminating the context now would block until the stuck handler returns.
                logger.warning("server %s: a handler did not return within %.1fs; its threads are left behind", self._endpoint, timeout)
                return False
            with self._deferred_lock:
                self._deferred_out.close()
            if self._authenticator is not None:
                self._authenticator.stop()
            self._rejections.flush()
            self._handler_errors.flush()
            self._ctx.destroy(linger=0)
            self._terminated = True
            logger.info("server %s stopped", self._endpoint)
            return True

    def __enter__(self) -> "TransportServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- front thread: move messages between the network and the handler threads --------------

    def _front(self, router: zmq.Socket, replies: zmq.Socket, control: zmq.Socket, monitor: zmq.Socket,
               pending: security.PendingConnections) -> None:
        poller = zmq.Poller()
        for s in (router, replies, control, monitor):
            poller.register(s, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                if control in dict(poller.poll(_POLL_MS)):
                    break
                # Connections first: a new one is in `pending` before its first message is read.
                while monitor.get(_EVENTS) & _POLLIN:
                    event = zmq.utils.monitor.parse_monitor_message(monitor.recv_multipart(_NOBLOCK))
                    pending.on_event(int(event["event"]), int(event["value"]))
                if len(pending):
                    pending.expire()
                self._rejections.tick()
                self._handler_errors.tick()
                # Socket.get() keeps the GIL where a receive that fails with Again would let go of it.
                while router.get(_EVENTS) & _POLLIN:
                    # [identity, head, *tensor frames]; while connections are pending, the head's source fd marks one authenticated.
                    item = _recv_marking(router, pending) if len(pending) else wire.recv(router, _NOBLOCK, envelope=1)
                    if self._num_threads:
                        self._queue.put(item)
                        continue
                    reply = self._serve(item[0], item[1:])  # inline: no thread hop, no concurrency
                    if reply is not None:
                        router.send_multipart([item[0], *reply], _NOBLOCK, copy=False)
                while replies.get(_EVENTS) & _POLLIN:
                    frames = replies.recv_multipart(_NOBLOCK, copy=False)  # moved as they are
                    # ROUTER drops (never blocks on) a reply to a peer that left or is full.
                    router.send_multipart(frames, _NOBLOCK, copy=False)
        except Exception:  # noqa: BLE001 - the thread must close its sockets whatever happened
            logger.exception("server %s: front thread failed", self._endpoint)
            self._stopping.set()
            for _ in range(self._num_threads):
                self._queue.put(None)
        finally:
            router.disable_monitor()
            for s in (router, replies, control, monitor):
                s.close()

    # -- handler threads ----------------------------------------------------------------------

    def _reply_socket(self, ctx: zmq.Context) -> zmq.Socket:
        out = ctx.socket(zmq.PUSH)
        out.linger = 0
        out.sndhwm = 0  # unbounded: a reply is never dropped while the front thread runs
        out.copy_threshold = wire.ZERO_COPY_BYTES
        out.connect(f"inproc://{self._name}-replies")
        return out

    def _work(self) -> None:
        out = self._reply_socket(self._ctx)
        try:
            while True:
                item = self._queue.get()  # a None per thread comes from stop()
                if item is None or self._stopping.is_set():
                    return  # requests still queued at stop go unanswered
                reply = self._serve(item[0], item[1:])
                if reply is not None:
                    _send(out, [item[0], *reply])
        finally:
            out.close()

    def _complete_deferred(self, identity, rid: int, verb: str, table: str, once: bool, future: Future) -> None:
        """Send a deferred reply; runs in whichever thread completed the handler's future."""
        try:
            reply = _reply(rid, future.result(timeout=0))
        except Exception as e:  # noqa: BLE001
            reply = self._handler_error(rid, verb, table, e)
        self._send_to([identity, *(self._once.end(rid, reply) if once else ())], reply)

    def _send_to(self, identities: list, reply: list) -> None:
        """Send `reply` to each of `identities` through the front thread (any thread may call it)."""
        if not identities:
            return
        with self._deferred_lock:
            if not self._deferred_out.closed:
                for identity in identities:
                    _send(self._deferred_out, [identity, *reply])

    def _handler_error(self, rid: int, verb: str, table: str, e: Exception) -> list:
        """The error reply to a request whose handler raised; counted and logged at most once an interval."""
        self._handler_errors.note(f"{verb} {type(e).__name__}", f"{verb} on {table[:100]!r}: {type(e).__name__}: {e}")
        logger.debug("handler traceback", exc_info=e)
        return _error(rid, Status.HANDLER_ERROR, f"{type(e).__name__}: {e}")

    def _serve(self, identity, frames: Sequence) -> list | None:
        """The reply frames to one request, or None when the handler deferred it. Never raises."""
        try:
            return self._answer(identity, frames)
        except Exception as e:  # noqa: BLE001 - a bug here must cost one request, not a thread
            logger.exception("server %s: internal error on a request", self._endpoint)
            rid = wire.peek_request_id(frames[0]) if frames else None
            return _error(rid or 0, Status.HANDLER_ERROR, f"internal server error: {type(e).__name__}: {e}")

    def _answer(self, identity, frames: Sequence) -> list | None:
        try:
            msg = wire.decode(frames)
            if msg.kind not in wire.REQUESTS:
                raise wire.WireError(f"message kind {msg.kind} sent to a server; requests are kinds {wire.REQUESTS}")
        except wire.WireError as e:
            rid = wire.peek_request_id(frames[0]) if frames else None
            self._rejections.note("malformed", f"a malformed message: {e}")
            return _error(rid or 0, e.status, f"malformed request: {e}")
        if not _same(msg.token_digest, self._digest):
            self._rejections.note("token", f"{msg.verb} on {msg.text[:100]!r}: token mismatch")
            return _error(
                msg.request_id,
                Status.TOKEN_MISMATCH,
                f"token mismatch; set the same {wire.TOKEN_ENV} / cluster.token on every process",
            )
        if msg.verb == PING:
            return wire.encode(wire.REPLY, msg.request_id)
        once = msg.kind == wire.REQUEST_ONCE
        if once:
            first, reply = self._once.begin(msg.request_id, identity)
            if not first:  # a resend: the first one's reply, now or when it ends
                return reply
        try:
            result = self._handler(msg.verb, msg.text, msg.fields, msg.meta)
            if isinstance(result, Future):
                args = (identity, msg.request_id, msg.verb, msg.text, once)
                result.add_done_callback(lambda f: self._complete_deferred(*args, f))
                return None
            reply = _reply(msg.request_id, result)
        except Exception as e:  # noqa: BLE001 - every handler error goes back to the client
            reply = self._handler_error(msg.request_id, msg.verb, msg.text, e)
        if once:
            self._send_to(self._once.end(msg.request_id, reply), reply)
        return reply


def _recv_marking(router: zmq.Socket, pending: security.PendingConnections) -> list:
    """wire.recv(router, envelope=1), and the connection the message came from is no longer pending."""
    frames = [router.recv(_NOBLOCK, copy=True)]  # the ROUTER's identity frame
    head = router.recv(_NOBLOCK, copy=False)
    pending.authenticated(head.get(_SRCFD))
    frames.append(head.bytes)
    while router.get(_RCVMORE):
        frames.append(router.recv(_NOBLOCK, copy=False))
    return frames


def _send(sock: zmq.Socket, frames: list) -> None:
    try:
        sock.send_multipart(frames, _NOBLOCK, copy=False)
    except zmq.Again:
        logger.debug("reply dropped: the server is stopping")


def _same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


def _reply(rid: int, result) -> list:
    meta: Mapping | None = None
    if result is None:
        tensors: Sequence[torch.Tensor] = ()
    elif isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping):
        tensors, meta = result
    elif isinstance(result, torch.Tensor):
        raise TypeError("the handler returned a Tensor; return a list of tensors")
    else:
        tensors = result
    if isinstance(tensors, Mapping):
        tensors = list(tensors.values())
    return wire.encode(wire.REPLY, rid, tensors=list(tensors), meta=meta)


def _error(rid: int, status: Status, text: str) -> list:
    return wire.encode(wire.REPLY, rid, status=status, text=text[: wire.MAX_TEXT_BYTES // 4])


