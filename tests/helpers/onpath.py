"""An attacker on the path of a live CURVE connection (issue 33.1): a TCP proxy on 127.0.0.1 that
forwards a client's connections to `target` and, once, injects one frame into the client -> server
stream of a connection that is past its handshake.

    client ──► OnPathProxy ──► server            ZMTP 3: a 64-byte greeting, then frames
                 │                               (flags u8, size u8 or u64 big-endian, body); after
                 └─ after the `after`-th          the CURVE handshake every frame's body is
                    MESSAGE frame of a            b"\\x07MESSAGE" + nonce (u64 big-endian) + box
                    connection: `inject`

- "replay": the frame just forwarded, sent again (an already-delivered frame: its nonce is spent);
- "forge": that frame with a nonce 1000 higher and one byte of its box flipped (a frame the server
  has not seen, whose box does not open).

`plan` lists the injections in order: the first connection to reach `after` MESSAGE frames (ZMTP
heartbeats count: an idle connection reaches it too, one frame a second) gets plan[0], the next one
(another connection, or the one the client opens after the first dropped) plan[1], and so on; a
connection gets at most one, and once the plan is used up everything is forwarded untouched.
`events` records what happened ("connect 0", "inject 0 replay", "closed 0 by server", ...), and
`wait_for(pattern, timeout)` waits for one (bounded). Used by tests/ps/test_injection.py, also in
the worker process of a job (`python -m tests.helpers.onpath`, below): there every TransportClient
connects through the proxies named in $RECPS_TEST_ONPATH instead of the endpoints it is given.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import threading
import time

from tests.helpers.proxy import TcpProxy, shut

__all__ = ["OnPathProxy", "MESSAGE", "ONPATH_ENV"]

MESSAGE = b"\x07MESSAGE"
ONPATH_ENV = "RECPS_TEST_ONPATH"  # "tcp://host:port=tcp://host:port,...": an endpoint -> the proxy in front of it


def _frames(buf: bytearray, start: int):
    """(start, end, body offset) of each complete ZMTP frame in buf[start:]."""
    pos = start
    while pos < len(buf):
        flags = buf[pos]
        if flags & 0x02:
            if pos + 9 > len(buf):
                return
            (size,), body = struct.unpack_from(">Q", buf, pos + 1), pos + 9
        else:
            if pos + 2 > len(buf):
                return
            size, body = buf[pos + 1], pos + 2
        if body + size > len(buf):
            return
        yield pos, body + size, body
        pos = body + size


def forged(frame: bytes, body: int) -> bytes:
    """`frame` (a MESSAGE frame whose body starts at `body`) with its nonce + 1000 and its box altered."""
    out = bytearray(frame)
    nonce_at = body + len(MESSAGE)
    (nonce,) = struct.unpack_from(">Q", out, nonce_at)
    struct.pack_into(">Q", out, nonce_at, nonce + 1000)
    out[-1] ^= 0x01
    return bytes(out)


class OnPathProxy(TcpProxy):
    """See the module docstring. `after`: MESSAGE frames forwarded on a connection before its injection."""

    def __init__(self, target: tuple[str, int], plan: list[str], after: int = 20) -> None:
        if any(p not in ("replay", "forge") for p in plan):
            raise ValueError(f"plan={plan}; each injection is 'replay' or 'forge'")
        super().__init__(target)
        self.plan, self.after = list(plan), int(after)
        self.events: list[str] = []
        self._cond = threading.Condition()
        self._next = 0  # the next injection of the plan
        self.start()

    def _event(self, text: str) -> None:
        with self._cond:
            self.events.append(f"{time.monotonic():.3f} {text}")
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> str:
        """The first event matching `pattern` (re.search), waiting at most `timeout` seconds for it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for e in self.events:
                    if re.search(pattern, e):
                        return e
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no event {pattern!r} within {timeout} s; events: {self.events}")
                self._cond.wait(left)

    def connected(self, n: int, client: socket.socket, server: socket.socket) -> None:
        self._event(f"connect {n}")
        threading.Thread(target=self._upstream, args=(n, client, server), daemon=True).start()
        threading.Thread(target=self._downstream, args=(n, server, client), daemon=True).start()

    def _take(self) -> str | None:
        """The next injection of the plan, or None when it is used up."""
        with self._cond:
            if self._next >= len(self.plan):
                return None
            self._next += 1
            return self.plan[self._next - 1]

    def _upstream(self, n: int, src: socket.socket, dst: socket.socket) -> None:
        """client -> server, parsing frames until this connection's injection is made."""
        buf, pos, seen = bytearray(), 64, 0  # pos: the next frame's start (after the 64-byte greeting)
        parsing = True
        try:
            while data := src.recv(1 << 16):
                if not parsing:
                    dst.sendall(data)
                    continue
                buf += data
                cut, inject = len(buf), None
                for start, end, body in _frames(buf, pos) if len(buf) >= 64 else ():
                    pos = end
                    if buf[body:body + len(MESSAGE)] == MESSAGE:
                        seen += 1
                        if seen == self.after:  # forward up to this frame, then the injected one
                            parsing, action = False, self._take()
                            if action is not None:
                                frame = bytes(buf[start:end])
                                cut, inject = end, frame if action == "replay" else forged(frame, body - start)
                            break
                dst.sendall(bytes(buf[len(buf) - len(data):cut]) if inject is not None else data)
                if inject is not None:
                    dst.sendall(inject)
                    self._event(f"inject {n} {action}")
                    dst.sendall(bytes(buf[cut:]))
                if not parsing:
                    buf = bytearray()
        except OSError:
            pass
        finally:
            self._event(f"closed {n} by client")
            shut(dst)

    def _downstream(self, n: int, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._event(f"closed {n} by server")
            shut(dst)

def _reroute_transport_clients(routes: str) -> None:
    """Every TransportClient of this process connects through the proxy given for its endpoint."""
    import recps.ps.transport.client as transport

    table = dict(pair.split("=", 1) for pair in routes.split(",") if pair)
    original = transport.TransportClient.__init__

    def rerouted(self, endpoints, *args, **kwargs):
        original(self, [table.get(e, e) for e in endpoints], *args, **kwargs)

    transport.TransportClient.__init__ = rerouted


if __name__ == "__main__":  # python -m tests.helpers.onpath <module> <args...>: run <module> with the routes of $RECPS_TEST_ONPATH
    import runpy
    import sys

    _reroute_transport_clients(os.environ.get(ONPATH_ENV, ""))
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
