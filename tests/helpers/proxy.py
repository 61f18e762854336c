"""A TCP proxy on 127.0.0.1 in front of one server, for tests that sit on a connection's path
(tests/ps/test_security.py's recording and tampering proxy, tests/helpers/onpath.py's injector).

A subclass says what happens on a connection: `connected(n, client, server)` gets the n-th accepted
client socket and its own fresh connection to the target, and starts whatever threads forward
between them. Clients connect to `endpoint`; `close()` closes the listener and every socket."""

from __future__ import annotations

import socket
import threading

__all__ = ["TcpProxy", "shut"]


class TcpProxy:
    """See the module docstring. A subclass sets its own attributes, then calls `start()`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()
        self.endpoint = f"tcp://127.0.0.1:{self.address[1]}"
        self._sockets: list[socket.socket] = []
        self._connections = 0

    def start(self) -> None:
        threading.Thread(target=self._accept, name=f"{type(self).__name__}-accept", daemon=True).start()

    def connected(self, n: int, client: socket.socket, server: socket.socket) -> None:
        raise NotImplementedError

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            n = self._connections
            self._connections += 1
            self._sockets += [client, server]
            self.connected(n, client, server)

    def close(self) -> None:
        self._listener.close()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass


def shut(sock: socket.socket) -> None:
    """End the sending half of `sock` (the peer reads end of stream), ignoring a socket already gone."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
