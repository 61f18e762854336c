"""Coordinator: cluster membership, named barriers and dead-peer detection (hosted by server 0).

Every process (S servers, W workers) registers under its name ("server0", "worker1") and then
heartbeats every `heartbeat_s`. A peer silent for `dead_after_s` is declared dead, for good:
every pending barrier and server wait fails at once with an error naming it, and so does every
later one. A peer that deregisters (a clean exit) has left; a barrier that needs a worker that
left fails naming it.

Liveness is a lease that accounts for the observer's own stalls: silence is counted from the
later of a peer's last heartbeat and the end of the observer's last stall (a SIGSTOP, a VM
pause, swapping: a tick of its monitor that came more than STALL_S late), so a coordinator that
was itself paused does not declare everyone dead on its first tick back. What a heartbeat
reply carries reaches the peers (CoordinatorClient):
- a peer declared dead (`dead`, `dead_why`: "server1 at tcp://... is dead: no heartbeat for ...")
  fails the peer that hears it (`failure`, `on_failure` listeners; the PSClient then fails every
  call in flight at once), since this run of the job cannot finish without it; the message says
  what follows (`restart_note`: the launcher's restart from the last committed checkpoint, or none);
- the dead peer itself, if it comes back, is told (`declared_dead`) and fails;
- the coordinator's own loss (server 0 dead or stalled): a peer whose heartbeats go unanswered
  for `dead_after_s` + `heartbeat_s` (its own stalls excepted) fails naming server0, so the
  coordinator is no silent single point of failure.

Bounds, with the defaults (heartbeat_s = dead_after_s / 5): a peer that crashed is declared dead
within dead_after_s and every other peer hears it within one more heartbeat_s; the coordinator's
loss is detected within dead_after_s + heartbeat_s. A stall of a peer shorter than dead_after_s -
heartbeat_s (8 s of 10), or of the coordinator shorter than dead_after_s, ends nothing.

Verbs (meta in, meta out; all answered by a `CoordinatorClient`):

    register     kind, index, endpoint        -> heartbeat_s, dead_after_s, num_servers, num_workers
    deregister   name, why?                   a clean exit; with `why` ("it got SIGTERM (no worker had sent
                                                 stop)") a departure before the job finished: the peer is dead
                                                 for the job and every peer hears "server1 at tcp://... left
                                                 before the job finished: ..." with its next heartbeat
    heartbeat    name                         -> dead (comma-separated names of dead peers), dead_why (JSON
                                                 name -> why), declared_dead (if the caller is), servers
                                                 (endpoints, once all S registered), workers_gone (all W
                                                 workers registered, none alive)
    wait_servers timeout_s                    -> endpoints (comma-separated, server order), once all S registered
    barrier      name (text), index, timeout_s      released when all W workers arrived
    members                                   -> members (JSON)

Waiting verbs are deferred replies: no thread is held while a barrier waits. A failed wait
answers OK with meta {"error": "timeout" | "dead" | "left" | "usage", "message": ...}; the client
raises PSTimeoutError for "timeout" and PSError otherwise.

>>> with Coordinator(num_servers=1, num_workers=1, token="t") as coord:
...     server, worker = CoordinatorClient(coord.endpoint, "t"), CoordinatorClient(coord.endpoint, "t")
...     _ = server.register("server", 0, "tcp://127.0.0.1:7000", heartbeats=False)
...     _ = worker.register("worker", 0, heartbeats=False)
...     worker.wait_for_servers(timeout_s=5.0), worker.barrier("start", timeout_s=5.0)
...     server.close(); worker.close()
(['tcp://127.0.0.1:7000'], None)
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from recps.errors import ConfigError, PSError, PSTimeoutError
from recps.ps.transport import TransportClient, TransportServer

__all__ = ["Coordinator", "CoordinatorClient", "DEFAULT_DEAD_AFTER_S", "STALL_S", "StallClock", "tcp_endpoint",
           "MAX_RESTARTS_ENV", "restart_note"]

logger = logging.getLogger(__name__)

DEFAULT_DEAD_AFTER_S = 10.0
_REPLY_MARGIN_S = 2.0  # a client waits this much longer than the coordinator, to get its message
STALL_S = 1.5  # a watcher's tick this late means its own process stalled: leases restart from its resume
# What a launcher that restarts failed jobs tells its processes (recps.launch sets both: `--restarts`,
# cluster.restarts, and which start this is; torchrun --max-restarts its TORCHELASTIC_* pair).
MAX_RESTARTS_ENV = "RECPS_MAX_RESTARTS"  # recps.launch.MAX_RESTARTS_ENV (this layer does not import it)
_RESTARTERS = ((MAX_RESTARTS_ENV, "RECPS_RESTART_COUNT", "cluster.restarts"),
               ("TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT", "torchrun --max-restarts"))


def restart_note(environ=None) -> str:
    """What follows a failure of this process's job, for its error messages, from what its launcher
    put in the environment: recps.launch (cluster.restarts) and torchrun --max-restarts say how many
    restarts the job has and which start this is; nothing there: no automatic restart.

    >>> restart_note({"RECPS_MAX_RESTARTS": "2", "RECPS_RESTART_COUNT": "1"})
    'the launcher restarts the job from its last committed checkpoint (restart 2 of cluster.restarts=2)'
    >>> restart_note({"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "1"})
    'no restart left (the 1 of torchrun --max-restarts=1 is used): the job fails; raise torchrun --max-restarts to restart it again'
    >>> restart_note({})
    'no automatic restart (cluster.restarts=0): the job fails; set cluster.restarts=N (or torchrun --max-restarts=N) to restart it from its last committed checkpoint'
    """
    env = os.environ if environ is None else environ
    for most_name, count_name, knob in _RESTARTERS:
        most, count = env.get(most_name, ""), env.get(count_name, "") or "0"
        if not (most.isdigit() and count.isdigit()) or int(most) == 0:
            continue
        most, count = int(most), int(count)
        if count < most:
            return (f"the launcher restarts the job from its last committed checkpoint (restart {count + 1} of "
                    f"{knob}={most})")
        used = "is" if most == 1 else "are"
        return f"no restart left (the {most} of {knob}={most} {used} used): the job fails; raise {knob} to restart it again"
    return ("no automatic restart (cluster.restarts=0): the job fails; set cluster.restarts=N (or torchrun "
            "--max-restarts=N) to restart it from its last committed checkpoint")


class StallClock:
    """The end of this observer's last stall: `tick()` on every round of a loop that expects to run
    at least every `period_s`; a round `STALL_S` later than that means the process itself was
    paused (SIGSTOP, VM stall, swap), so silence it saw during the pause proves nothing about others.

    >>> clock = StallClock(0.25, now=100.0)
    >>> clock.tick(now=100.3), clock.resumed_at
    (0.0, 100.0)
    >>> clock.tick(now=121.0), clock.resumed_at     # paused for about 20 s
    (20.45, 121.0)
    >>> clock.silence(last_seen=98.0, now=125.0)    # counted from the resume, not from 98
    4.0
    """

    def __init__(self, period_s: float, now: float | None = None) -> None:
        self.period_s = float(period_s)
        self.last = time.monotonic() if now is None else now
        self.resumed_at = self.last

    def tick(self, now: float | None = None) -> float:
        """Record a round; returns how long the process was stalled before it (0.0 if it was not)."""
        now = time.monotonic() if now is None else now
        late = now - self.last - self.period_s
        self.last = now
        if late > STALL_S:
            self.resumed_at = now
            return round(late, 3)
        return 0.0

    def silence(self, last_seen: float, now: float) -> float:
        """Seconds a peer last seen at `last_seen` has been silent, this observer's stalls excepted."""
        return now - max(last_seen, self.resumed_at)


def tcp_endpoint(address: str) -> str:
    """ "host:port" (or "[v6]:port") -> "tcp://host:port"; a full ZeroMQ endpoint is returned as is."""
    return address if "://" in address else f"tcp://{address}"


@dataclass
class _Peer:
    kind: str
    index: int
    endpoint: str
    last_seen: float
    state: str = "alive"  # alive | dead | left
    why: str = ""
    quit: bool = False  # dead because it said it was leaving before the job finished (a SIGTERM), not silent


@dataclass
class _Waiter:
    future: Future
    deadline: float
    what: str


@dataclass
class _Barrier:
    arrived: dict[int, _Waiter] = field(default_factory=dict)  # worker index -> its wait


class Coordinator:
    """Membership and barriers for `num_servers` servers and `num_workers` workers.

    Args:
        token: cluster token (None reads $RECPS_CLUSTER_TOKEN).
        bind, port: where to listen ("127.0.0.1", 0 = a free port), or a full endpoint in bind.
        dead_after_s: seconds without a heartbeat after which a registered peer is dead.
        heartbeat_s: heartbeat period told to peers (default dead_after_s / 5).
    """

    def __init__(
        self,
        num_servers: int,
        num_workers: int,
        token: str | bytes | None = None,
        bind: str = "127.0.0.1",
        port: int = 0,
        dead_after_s: float = DEFAULT_DEAD_AFTER_S,
        heartbeat_s: float | None = None,
    ) -> None:
        if num_servers < 1 or num_workers < 1:
            raise ConfigError(f"Coordinator: num_servers={num_servers}, num_workers={num_workers}; both must be >= 1")
        if not dead_after_s > 0:
            raise ConfigError(f"Coordinator: dead_after_s={dead_after_s}; give a positive number of seconds")
        self.num_servers, self.num_workers = num_servers, num_workers
        self.dead_after_s = float(dead_after_s)
        self.heartbeat_s = float(heartbeat_s) if heartbeat_s else self.dead_after_s / 5
        self._transport = TransportServer(self._handle, token=token, bind=bind, port=port, num_threads=1)
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._server_waiters: list[_Waiter] = []
        self._barriers: dict[str, _Barrier] = {}
        self._stop = threading.Event()
        self._quit_at: float | None = None  # when a peer last said it was leaving before the job finished
        self._monitor: threading.Thread | None = None
        self.stalls: list[float] = []  # seconds of each stall of this process the monitor noticed

    @property
    def endpoint(self) -> str:
        return self._transport.endpoint

    def start(self) -> "Coordinator":
        self._transport.start()
        self._monitor = threading.Thread(target=self._watch, name="recps-coordinator-monitor", daemon=True)
        self._monitor.start()
        logger.info("coordinator on %s for %d servers, %d workers (dead after %.1fs)",
                    self.endpoint, self.num_servers, self.num_workers, self.dead_after_s)
        return self

    def stop(self, timeout: float = 5.0) -> bool:
        self._stop.set()
        with self._lock:
            waiters = self._server_waiters + [w for b in self._barriers.values() for w in b.arrived.values()]
            self._server_waiters, self._barriers = [], {}
        for w in waiters:
            _answer(w.future, "left", f"{w.what}: the coordinator stopped")
        clean = self._transport.stop(timeout)
        if self._monitor is not None:
            self._monitor.join(timeout)
        return clean

    def __enter__(self) -> "Coordinator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def members(self) -> dict[str, dict]:
        """name -> {kind, index, endpoint, state, silent_s}."""
        now = time.monotonic()
        with self._lock:
            return {
                n: {"kind": p.kind, "index": p.index, "endpoint": p.endpoint, "state": p.state, "silent_s": round(now - p.last_seen, 3)}
                for n, p in self._peers.items()
            }

    # -- verbs ----------------------------------------------------------------------------------

    def _handle(self, verb: str, text: str, tensors: list, meta: dict):
        if verb == "heartbeat":
            return self._heartbeat(str(meta.get("name", "")))
        if verb == "register":
            return self._register(str(meta["kind"]), int(meta["index"]), str(meta.get("endpoint", "")))
        if verb == "deregister":
            return self._deregister(str(meta.get("name", "")), str(meta.get("why", "")))
        if verb == "wait_servers":
            return self._wait_servers(float(meta.get("timeout_s", 60.0)))
        if verb == "barrier":
            return self._barrier(text, int(meta["index"]), float(meta.get("timeout_s", 60.0)))
        if verb == "members":
            return [], {"members": json.dumps(self.members())}
        raise PSError(f"coordinator: unknown verb {verb!r}")

    def _register(self, kind: str, index: int, endpoint: str):
        count = {"server": self.num_servers, "worker": self.num_workers}.get(kind)
        if count is None or not 0 <= index < count:
            raise ConfigError(f"coordinator: cannot register {kind}{index}; this cluster has {self.num_servers} servers and {self.num_workers} workers")
        name = f"{kind}{index}"
        with self._lock:
            old = self._peers.get(name)
            if old is not None and old.state == "dead":
                raise PSError(f"coordinator: {name} was declared dead ({old.why}); restart the whole cluster")
            if old is not None and old.state == "alive" and old.endpoint != endpoint:
                raise ConfigError(f"coordinator: {name} is already registered at {old.endpoint}; two processes claim the same role")
            self._peers[name] = _Peer(kind, index, endpoint, time.monotonic())
            ready = self._servers_ready()
            waiters = self._server_waiters if ready is not None else []
            if ready is not None:
                self._server_waiters = []
        logger.info("coordinator: %s registered (%s)", name, endpoint or "no endpoint")
        for w in waiters:
            _resolve(w.future, {"endpoints": ",".join(ready)})
        return [], {
            "heartbeat_s": self.heartbeat_s,
            "dead_after_s": self.dead_after_s,
            "num_servers": self.num_servers,
            "num_workers": self.num_workers,
        }

    def _deregister(self, name: str, why: str = ""):
        """A peer leaves. With `why` (a server stopped by a signal before the job finished) it is
        dead for the job, told to every peer as a dead one is, at once (see `quit`)."""
        with self._lock:
            peer = self._peers.get(name)
            if peer is not None and peer.state == "alive" and why:
                failed = self._quit(name, peer, why)
            elif peer is not None and peer.state == "alive":
                peer.state, peer.why = "left", "it deregistered"
                failed = self._fail_for(peer, name) if peer.kind == "worker" else []
            else:
                failed = []
        if not why:
            logger.info("coordinator: %s left", name)
        for w, message in failed:
            _answer(w.future, "dead" if why else "left", message)
        return []

    def _heartbeat(self, name: str):
        with self._lock:
            peer = self._peers.get(name)
            if peer is not None and peer.state == "alive":
                peer.last_seen = time.monotonic()
            dead = {n: _fate(n, p) for n, p in self._peers.items() if p.state == "dead"}
            gone = self.workers_gone()
            servers = self._servers_ready()
        meta = {"dead": ",".join(dead), "dead_why": json.dumps(dead), "known": peer is not None, "workers_gone": gone,
                "servers": ",".join(servers or [])}  # so that every peer can name server0's endpoint if it is lost
        if peer is not None and peer.state == "dead":
            meta["declared_dead"] = peer.why
        return [], meta

    def workers_gone(self) -> bool:
        """True once all W workers registered and none is alive any more (left or dead): the
        servers have nobody left to serve."""
        workers = [self._peers.get(f"worker{j}") for j in range(self.num_workers)]
        return all(w is not None and w.state != "alive" for w in workers)

    def _servers_ready(self) -> list[str] | None:
        """Endpoints of all S servers if all registered and alive (lock held)."""
        out = []
        for i in range(self.num_servers):
            p = self._peers.get(f"server{i}")
            if p is None or p.state != "alive":
                return None
            out.append(p.endpoint)
        return out

    def _broken(self, kinds: tuple[str, ...]) -> tuple[str, str] | None:
        """(error kind, message) if a peer of `kinds` is dead (any kind) or left (lock held)."""
        for n, p in self._peers.items():
            if p.state == "dead":
                return "dead", _fate(n, p)
        for n, p in self._peers.items():
            if p.state == "left" and p.kind in kinds:
                return "left", f"{n} left the cluster ({p.why})"
        return None

    def _wait_servers(self, timeout_s: float):
        future: Future = Future()
        with self._lock:
            broken = self._broken(("server",))
            ready = self._servers_ready()
            if broken is None and ready is None:
                self._server_waiters.append(_Waiter(future, time.monotonic() + timeout_s, "waiting for the servers"))
        if broken is not None:
            _answer(future, broken[0], f"waiting for the servers: {broken[1]}")
        elif ready is not None:
            _resolve(future, {"endpoints": ",".join(ready)})
        return future

    def _barrier(self, name: str, index: int, timeout_s: float):
        future: Future = Future()
        what = f"barrier {name!r}"
        if not 0 <= index < self.num_workers:
            _answer(future, "usage", f"{what}: worker index {index} is outside [0, {self.num_workers})")
            return future
        release: list[_Waiter] = []
        with self._lock:
            broken = self._broken(("worker",))
            if broken is None:
                barrier = self._barriers.setdefault(name, _Barrier())
                if index in barrier.arrived:
                    broken = ("usage", f"worker{index} arrived twice at {what} before it was released")
                else:
                    barrier.arrived[index] = _Waiter(future, time.monotonic() + timeout_s, what)
                    if len(barrier.arrived) == self.num_workers:
                        release = list(barrier.arrived.values())
                        del self._barriers[name]
        if broken is not None:
            _answer(future, broken[0], f"{what}: {broken[1]}")
        for w in release:
            _resolve(w.future, {})
        return future

    def _quit(self, name: str, peer: _Peer, why: str) -> list[tuple[_Waiter, str]]:
        """(lock held) `name` leaves before the job finished: dead for everyone; the waits to fail."""
        peer.state, peer.why, peer.quit = "dead", why, True
        self._quit_at = time.monotonic()
        logger.error("coordinator: %s", _fate(name, peer))
        return self._fail_for(peer, name)

    def quit(self, name: str, why: str) -> None:
        """In-process twin of a peer's deregister with a reason (server 0 leaving on a signal)."""
        self._deregister(name, why)

    def wait_told(self, timeout: float) -> bool:
        """Block until every live peer heartbeat since the last `quit` (so it heard who left), at most
        `timeout` seconds; True if all did. Server 0 calls it before its coordinator stops. Peers
        already silent for two heartbeats at the quit (dying too, or stopped) are not waited for."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                since = self._quit_at
                recent = None if since is None else since - 2 * self.heartbeat_s - STALL_S
                waiting = [n for n, p in self._peers.items()
                           if p.state == "alive" and since is not None and recent <= p.last_seen < since]
            if not waiting:
                return True
            if time.monotonic() >= deadline:
                logger.warning("coordinator: %s did not heartbeat within %.1f s of the departure", ", ".join(waiting), timeout)
                return False
            time.sleep(0.05)

    # -- monitor --------------------------------------------------------------------------------

    def _fail_for(self, peer: _Peer, name: str) -> list[tuple[_Waiter, str]]:
        """Every pending wait that can no longer succeed because `name` died or left (lock held)."""
        why = _fate(name, peer) if peer.state == "dead" else f"{name} left the cluster"
        failed = [(w, f"{w.what}: {why}") for w in self._server_waiters]
        self._server_waiters = []
        for b in self._barriers.values():
            failed += [(w, f"{w.what}: {why}") for w in b.arrived.values()]
        self._barriers = {}
        return failed

    def _watch(self) -> None:
        tick = min(0.25, self.dead_after_s / 8)
        clock = StallClock(tick)
        while not self._stop.wait(tick):
            stalled = clock.tick()
            if stalled:  # our own pause: every lease restarts now (the peers' heartbeats are queued)
                self.stalls.append(stalled)
                logger.warning("coordinator: this process was stalled for %.1f s; no peer is declared dead for it", stalled)
            now = time.monotonic()
            failed: list[tuple[_Waiter, str, str]] = []
            with self._lock:
                for name, peer in self._peers.items():
                    silent = clock.silence(peer.last_seen, now)
                    if peer.state == "alive" and silent > self.dead_after_s:
                        peer.state = "dead"
                        peer.why = (f"no heartbeat for {silent:.1f} s (cluster.dead_after_s={self.dead_after_s:g}); "
                                    "it crashed, hangs or was stalled that long (raise cluster.dead_after_s if such "
                                    "pauses are expected)")
                        logger.error("coordinator: %s is dead: %s", _who(name, peer), peer.why)
                        failed += [(w, "dead", m) for w, m in self._fail_for(peer, name)]
                # Expired waits: each fails alone, naming who is missing.
                keep = []
                for w in self._server_waiters:
                    if w.deadline <= now:
                        missing = [f"server{i}" for i in range(self.num_servers) if f"server{i}" not in self._peers]
                        failed.append((w, "timeout", f"{w.what}: {missing} did not register in time; are they running?"))
                    else:
                        keep.append(w)
                self._server_waiters = keep
                for bname, b in list(self._barriers.items()):
                    missing = [f"worker{i}" for i in range(self.num_workers) if i not in b.arrived]
                    for index, w in list(b.arrived.items()):
                        if w.deadline <= now:
                            del b.arrived[index]
                            failed.append((w, "timeout", f"{w.what}: worker(s) {missing} did not arrive in time"))
                    if not b.arrived:
                        del self._barriers[bname]
            for w, kind, message in failed:
                _answer(w.future, kind, message)


def _fate(name: str, peer: _Peer) -> str:
    """What the peers are told of a dead peer: "server1 at tcp://... is dead: no heartbeat for ...", or,
    for one that said it was leaving, "server1 at tcp://... left before the job finished: it got SIGTERM"."""
    return f"{_who(name, peer)} {'left before the job finished' if peer.quit else 'is dead'}: {peer.why}"


def _who(name: str, peer: _Peer) -> str:
    """ "server1 at tcp://127.0.0.1:4000", or "worker0" (a worker serves nothing)."""
    return f"{name} at {peer.endpoint}" if peer.endpoint else name


def _resolve(future: Future, meta: dict) -> None:
    if not future.done():
        future.set_result(([], meta))


def _answer(future: Future, kind: str, message: str) -> None:
    if not future.done():
        future.set_result(([], {"error": kind, "message": message}))


class CoordinatorClient:
    """A peer's link to the coordinator: register, wait for servers, barriers, heartbeats.

    Args:
        address: the coordinator's "host:port" (Role.coordinator) or ZeroMQ endpoint.
        token: cluster token.
        name: this peer's name ("worker0"), set by register() as well.
        timeout_s: default timeout of every call.
    """

    def __init__(self, address: str, token: str | bytes | None = None, name: str = "", timeout_s: float = 60.0) -> None:
        self.endpoint = tcp_endpoint(address)
        self.name = name
        self.timeout_s = float(timeout_s)
        self._transport = TransportClient([self.endpoint], token=token, timeout_s=self.timeout_s, names=["the coordinator"])
        self._heartbeat_s = DEFAULT_DEAD_AFTER_S / 5
        self._dead_after_s = DEFAULT_DEAD_AFTER_S
        self.server_endpoints: list[str] = []  # the PS servers' endpoints, once wait_for_servers returned them
        self.failure: PSError | None = None  # why this peer cannot go on (a dead peer, told dead, coordinator lost)
        self.failed_peers: tuple[str, ...] = ()  # who that failure names ("server0", "worker1")
        self._listeners: list = []
        self._failure_lock = threading.Lock()
        self.stalls: list[float] = []  # seconds of each stall of this process the heartbeat thread noticed
        self._dead: tuple[str, ...] = ()
        self._heartbeat_failing = False
        self.workers_gone = False  # as of the last heartbeat: every worker left or died
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def _call(self, verb: str, text: str = "", meta: dict | None = None, timeout_s: float | None = None) -> dict:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            reply = self._transport.call(0, verb, text, meta=meta or {}, timeout=timeout)
        except PSTimeoutError as e:
            raise PSTimeoutError(f"coordinator {self.endpoint} did not answer {verb} {text!r} within {timeout:g} s; is server 0 alive? ({e})") from None
        error = reply.meta.get("error")
        if error:
            cls = PSTimeoutError if error == "timeout" else PSError
            raise cls(f"coordinator: {reply.meta.get('message', error)}")
        return reply.meta

    def register(self, kind: str, index: int, endpoint: str = "", timeout_s: float | None = None, heartbeats: bool = True) -> dict:
        """Join the cluster as `kind``index`; starts heartbeats unless heartbeats=False.
        Waits up to `timeout_s` for the coordinator to come up."""
        self.name = f"{kind}{index}"
        meta = self._call("register", meta={"kind": kind, "index": index, "endpoint": endpoint}, timeout_s=timeout_s)
        self._heartbeat_s = float(meta["heartbeat_s"])
        self._dead_after_s = float(meta["dead_after_s"])
        if heartbeats:
            self.start_heartbeats()
        return meta

    def wait_for_servers(self, timeout_s: float | None = None) -> list[str]:
        """The S server endpoints, once all registered; PSTimeoutError after `timeout_s`,
        PSError at once if a server is dead or left."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        meta = self._call("wait_servers", meta={"timeout_s": timeout}, timeout_s=timeout + _REPLY_MARGIN_S)
        self.server_endpoints = str(meta["endpoints"]).split(",")
        return list(self.server_endpoints)

    def barrier(self, name: str, index: int | None = None, timeout_s: float | None = None) -> None:
        """Block until every worker reached barrier `name`. `index` defaults to this peer's
        worker index. PSTimeoutError names the workers missing; PSError names a dead peer."""
        if index is None:
            if not self.name.startswith("worker"):
                raise ConfigError(f"barrier {name!r}: {self.name or 'this peer'} is not a registered worker; pass index=")
            index = int(self.name[len("worker"):])
        timeout = self.timeout_s if timeout_s is None else timeout_s
        self._call("barrier", name, {"index": index, "timeout_s": timeout}, timeout_s=timeout + _REPLY_MARGIN_S)

    def members(self) -> dict[str, dict]:
        return json.loads(str(self._call("members")["members"]))

    @property
    def dead_peers(self) -> tuple[str, ...]:
        """Names of peers the coordinator declared dead, as of the last heartbeat."""
        return self._dead

    def start_heartbeats(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name=f"recps-{self.name}-heartbeat", daemon=True)
            self._thread.start()

    def on_failure(self, listener) -> None:
        """Call `listener(names, error)` once this peer cannot go on (see `failure`): `names` the dead
        peers ("server0", ...) or this peer's own name, `error` a PSError naming them. Called from
        the heartbeat thread (or at once, if the failure is already known); it must not block."""
        with self._failure_lock:
            self._listeners.append(listener)
            failure, names = self.failure, self.failed_peers
        if failure is not None:
            listener(names, failure)

    def _fail(self, names: tuple[str, ...], error: PSError) -> None:
        """The first failure stays; listeners hear it once. Barriers and waits fail at once too."""
        with self._failure_lock:
            if self.failure is not None:
                return
            self.failure, self.failed_peers = error, names
            listeners = list(self._listeners)
        logger.error("%s: %s", self.name, error)
        if names == ("server0",) or names == (self.name,):  # the coordinator is lost, or has no use for us
            self._transport.fail_server(0, error)
        for listener in listeners:
            try:
                listener(names, error)
            except Exception:  # a listener's bug must not stop the heartbeats
                logger.exception("%s: a failure listener raised", self.name)

    def _coordinator_name(self) -> str:
        ps = f" at {self.server_endpoints[0]}" if self.server_endpoints else ""
        return f"server0{ps} (its coordinator at {self.endpoint})"

    def _beat(self) -> None:
        """Heartbeat every heartbeat_s; a lease on the coordinator: unanswered for dead_after_s
        (this process's own stalls excepted, see StallClock) fails this peer naming server0."""
        warned = False
        period = self._heartbeat_s
        clock = StallClock(period)
        last_ok = time.monotonic()
        # The coordinator answered at last_ok and may have stalled right after; a stall shorter than
        # dead_after_s must not end the job, so the lease is one heartbeat period longer.
        lease = self._dead_after_s + period
        while not self._stop.wait(period if not self._heartbeat_failing else min(period, 0.25)):
            stalled = clock.tick()
            if stalled:
                self.stalls.append(stalled)
                logger.warning("%s: this process was stalled for %.1f s", self.name, stalled)
            now = time.monotonic()
            timeout = max(0.2, min(2 * period, lease - clock.silence(last_ok, now)))
            try:
                meta = self._call("heartbeat", meta={"name": self.name}, timeout_s=timeout)
            except PSError as e:
                if self._stop.is_set():
                    return
                now = time.monotonic()
                if now - clock.last > timeout + STALL_S:  # stalled during the call: the silence is ours
                    clock.resumed_at = now
                    self.stalls.append(round(now - clock.last - timeout, 3))
                clock.last = now
                self._heartbeat_failing = True
                if not warned:
                    logger.warning("%s: heartbeat failed: %s", self.name, e)
                    warned = True
                silent = clock.silence(last_ok, now)
                if silent > lease and self.failure is None:
                    self._fail(("server0",), PSError(
                        f"{self._coordinator_name()} is dead or stalled: no answer to {self.name}'s heartbeats for "
                        f"{silent:.1f} s (cluster.dead_after_s={self._dead_after_s:g}); this run of the job cannot go "
                        f"on without its coordinator: {restart_note()}; see server0's log, or raise "
                        "cluster.dead_after_s if such pauses are expected"))
                continue
            clock.last = last_ok = time.monotonic()
            self._heartbeat_failing, warned = False, False
            self.workers_gone = bool(meta.get("workers_gone", False))
            if meta.get("servers") and not self.server_endpoints:
                self.server_endpoints = str(meta["servers"]).split(",")
            dead = tuple(n for n in str(meta.get("dead", "")).split(",") if n)
            if dead and dead != self._dead:
                logger.error("%s: the coordinator declared %s dead", self.name, ", ".join(dead))
            self._dead = dead
            if meta.get("declared_dead") is not None:
                self._fail((self.name,), PSError(
                    f"{self.name} was declared dead by the coordinator ({meta['declared_dead']}); this process "
                    f"stalled or lost the network longer than that, and this run of the job failed without it: "
                    f"{restart_note()}"))
            elif dead:
                why = json.loads(str(meta.get("dead_why") or "{}"))
                self._fail(dead, PSError(
                    f"{why.get(dead[0], dead[0] + ' is dead')}; this run of the job cannot finish without it: "
                    f"{restart_note()}"))

    def deregister(self, timeout_s: float = 2.0, why: str = "") -> None:
        """Leave the cluster (stops heartbeats); errors are logged, not raised. Skipped when the
        last heartbeat failed (the coordinator is gone: nobody to tell). With `why` ("it got
        SIGTERM") this peer leaves before the job finished: the coordinator tells every peer, as
        it tells a dead one, and their calls fail at once naming this peer."""
        self._stop.set()
        if self._heartbeat_failing:
            logger.info("%s: not deregistering, the coordinator did not answer the last heartbeat", self.name)
            return
        if self.name:
            try:
                self._call("deregister", meta={"name": self.name, **({"why": why} if why else {})}, timeout_s=timeout_s)
            except PSError as e:
                logger.warning("%s: deregister failed: %s", self.name, e)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(max(1.0, 2 * self._heartbeat_s) + 1.0)
        self._transport.close()
