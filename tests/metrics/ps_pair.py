"""One real parameter server and two worker clients on threads, for the metric mergers' tests."""

from __future__ import annotations

import threading

__all__ = ["servers_and_workers"]


def servers_and_workers(work) -> None:
    """One real server node and two worker clients on threads; work(rank, client)."""
    from recps.cluster.launch import free_port
    from recps.ps.modes import server_halves
    from recps.ps.node import ServerNode, connect
    from recps.ps.roles import UserDefinedRoleMaker

    address = f"127.0.0.1:{free_port()}"
    role = lambda kind, i: UserDefinedRoleMaker(kind, i, 1, 2, coordinator=address, token="t").role()  # noqa: E731
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            with connect(role("worker", rank), timeout_s=60.0) as client:
                work(rank, client)
                client.barrier("done", timeout=60.0)  # nobody deregisters while the other still merges
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    with ServerNode(role("server", 0), halves=server_halves()).start():
        workers = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=180)
    assert not errors, errors
    assert all(not w.is_alive() for w in workers)
