"""Fleet-style API (layer L4): about ten added lines turn a local training script into a distributed one.

    local script                                   its distributed twin (examples/)
    ------------                                   --------------------------------
                                                   with fleet.init(detect_role_maker()) as f:
                                                       if f.is_server():
                                                           f.init_server(); f.run_server()
                                                       else:
    ebc = LocalEmbeddingBagCollection(...)             ebc = f.embedding_bag_collection(configs)
    model = CTRDNN(ebc, 13)                            model = CTRDNN(ebc, 13)
    opt = torch.optim.Adam(dense params)               opt = f.distributed_optimizer(torch.optim.Adam(...), strategy)
                                                           f.init_worker()
    for batch in data:                                     for batch in data (this worker's shard):
        loss.backward(); opt.step()                            loss.backward(); opt.step()
                                                           f.stop_worker()

`Fleet` is an object, not a process-wide singleton: two in one process (tests) do not meet.
A `Fleet` is a context manager: leaving it stops the worker (or the server) whatever happened.

What each call does:
- `init_server()` starts this process's PSServer (server 0 also hosts the coordinator);
  `run_server()` serves until a worker sends stop (or SIGTERM / SIGINT), then returns.
- `embedding_bag_collection(configs)` / `embedding_collection(configs)`: PS-backed drop-ins for
  torchrec's collections, bound to the communicator by `init_worker()`.
- `distributed_optimizer(optimizer, strategy)`: wraps a torch optimizer over the dense
  parameters; its `step()` pushes their gradients (sync / async: the servers apply the
  matching rule, see `torch_optimizer_rule`) or steps it locally (geo), then ends the step.
- `init_worker()`: connects (waits for every server), creates the sparse tables of the
  collections and the dense table (the first worker's initial values win), waits for every
  worker, copies the servers' dense values into the model, binds the communicator.
- `stop_worker()`: sends what is queued, waits for every worker, and worker 0 stops the servers.
- `barrier(name)`: sends what is queued, every worker waits for all, dense values refreshed.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from recps.errors import ConfigError, PSError
from recps.ps.embedding import PSEmbeddingBagCollection, PSEmbeddingCollection
from recps.ps.node import ServerNode, connect
from recps.ps.node.coordinator import DEFAULT_DEAD_AFTER_S
from recps.ps.roles import Role, detect_role_maker
from recps.ps.worker import (
    DENSE_TABLE,
    MODES,
    CommunicatorSettings,
    GeoDenseUpdater,
    PSDenseUpdater,
    assign_flat,
    make_communicator,
    torch_optimizer_rule,
)

__all__ = ["Fleet", "DistributedStrategy", "DistributedOptimizer", "init"]

log = logging.getLogger(__name__)

_STOP_WAIT_S = 10.0  # how long worker 0 waits for the others to leave before it stops the servers
_STOP_REPLY_S = 5.0  # a server answers stop at once; it may close before the reply is read
_REPLY_GRACE_S = 0.2


def _uniform(init_std: float) -> dict:
    bound = init_std * 3**0.5  # U(-b, b) has std b/sqrt(3): the same rows as ps=local's init_std
    return {"kind": "uniform", "low": -bound, "high": bound}


@dataclass
class DistributedStrategy:
    """How the workers train against the servers.

    Args:
        mode: "async" | "sync" | "geo".
        k_steps: geo: worker steps between two delta syncs.
        max_pending: async: most pushes of a worker unapplied at once (the staleness bound).
        merge_threshold: async: most queued pushes merged into one send.
        min_merge: async: the sender waits until this many pushes are queued and sends them as
            one (<= max_pending and merge_threshold; 1: every push at once).
        dense_min_merge: async: the same for dense gradients, summed (None: min_merge).
        threads: training threads per worker that end each step (sync waits for all of them).
        dense_refresh_steps: async: the dense values are pulled in the background every this many steps.
        embedding_optimizer: sparse update rule ({"name", "lr", ...}): on the servers (sync, async)
            or on the worker's replica (geo: "sgd" or "rowwise_adagrad").
        init_std: sparse rows start uniform with this std (deterministic per key on the servers).
        seed: of the servers' initializer.
        timeout_s: bound of every wait on a server or a barrier.
        geo_capacity: initial replica rows per table (doubles as needed).
        geo_delta_scale, geo_dense_delta_scale: factors of the sparse / dense deltas a GEO worker
            sends (None: 1 / workers, Paddle's averaging).
        table_capacity: expected rows of each sparse table over all servers (0: grow as keys come).
            Reserving them up front spares the growth (re-hashing every key each time the index
            grows): in-process, a pull that creates 7,000 rows costs ~4 ms instead of ~7 ms; no
            difference measured on the CTR-DNN benchmark, whose tables grow a few times at most.
        geo_background_sync: run GEO's delta syncs on a background thread (None: when k_steps > 1;
            k_steps = 1 stays synchronous, exactly local SGD with one worker).
        geo_local_init: a GEO worker starts a key it has never seen from the servers' initial value,
            computed locally, instead of pulling it (tables without an admission filter).
        prefetch: async: each training thread sends the pull of its next batch between the current
            batch's forward and backward (recps.trainer.Trainer with a PS collection's `prefetch`), so
            the pull travels while the backward runs; those rows may miss the current batch's push.
    """

    mode: str = "async"
    k_steps: int = 100
    max_pending: int = 8
    merge_threshold: int = 4
    min_merge: int = 1
    dense_min_merge: int | None = None
    threads: int = 1
    dense_refresh_steps: int = 1
    embedding_optimizer: Mapping = field(default_factory=lambda: {"name": "rowwise_adagrad", "lr": 0.05, "eps": 1e-8})
    init_std: float = 0.01
    seed: int = 0
    timeout_s: float = 60.0
    geo_capacity: int = 1 << 16
    geo_delta_scale: float | None = None
    geo_dense_delta_scale: float | None = None
    geo_background_sync: bool | None = None
    geo_local_init: bool = True
    table_capacity: int = 0
    prefetch: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"DistributedStrategy: mode={self.mode!r}; use one of {MODES}")
        lowest = {"k_steps": 1, "max_pending": 1, "merge_threshold": 1, "min_merge": 1, "threads": 1,
                  "geo_capacity": 1, "table_capacity": 0}
        for name, low in lowest.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"DistributedStrategy: {name}={value!r}; it must be an integer >= {low}")
        if self.dense_min_merge is not None and (isinstance(self.dense_min_merge, bool) or not isinstance(self.dense_min_merge, int)
                                                 or self.dense_min_merge < 1):
            raise ConfigError(f"DistributedStrategy: dense_min_merge={self.dense_min_merge!r}; use an integer >= 1 or None (= min_merge)")
        if self.min_merge > min(self.max_pending, self.merge_threshold):
            raise ConfigError(
                f"DistributedStrategy: min_merge={self.min_merge} exceeds max_pending={self.max_pending} or "
                f"merge_threshold={self.merge_threshold}; lower min_merge or raise both"
            )
        if not self.timeout_s > 0:
            raise ConfigError(f"DistributedStrategy: timeout_s={self.timeout_s}; it must be > 0 seconds")
        if self.prefetch and self.mode != "async":
            raise ConfigError(f"DistributedStrategy: prefetch=True with mode={self.mode!r}; prefetching pulls is "
                              "async's (sync must pull after the step's update, GEO trains a local replica); "
                              "set prefetch=False")
        self.embedding_optimizer = dict(self.embedding_optimizer)
        if self.embedding_optimizer.get("name") == "sgd":
            # conf/ps keeps Adagrad's eps next to the name: `ps.embedding_optimizer.name=sgd` just works.
            self.embedding_optimizer.pop("eps", None)

    def settings(self) -> CommunicatorSettings:
        return CommunicatorSettings(
            mode=self.mode, threads=self.threads, k_steps=self.k_steps, max_pending=self.max_pending,
            merge_threshold=self.merge_threshold, min_merge=self.min_merge, dense_min_merge=self.dense_min_merge,
            dense_refresh_steps=self.dense_refresh_steps,
            geo_capacity=self.geo_capacity, timeout_s=self.timeout_s, embedding_optimizer=self.embedding_optimizer,
            geo_delta_scale=self.geo_delta_scale, geo_dense_delta_scale=self.geo_dense_delta_scale,
            geo_background_sync=self.geo_background_sync, geo_local_init=self.geo_local_init,
        )


class DistributedOptimizer:
    """A torch optimizer over the dense parameters, trained through the parameter server.

    `step(thread=0)` hands the gradients to the mode (see the module docstring) and ends the
    step; `zero_grad()` is the wrapped optimizer's. `updater` is the same thing as a
    recps.trainer DenseUpdater, for the multi-threaded Trainer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: DistributedStrategy) -> None:
        self.optimizer = optimizer
        self.strategy = strategy
        self.params: list[nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"]]
        if not self.params:
            raise ConfigError("distributed_optimizer: the optimizer has no parameters; give it the model's dense ones")
        self.rule = torch_optimizer_rule(optimizer) if strategy.mode != "geo" else None
        self.updater = None  # set by Fleet.init_worker

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def named_params(self) -> dict[str, nn.Parameter]:
        return {f"param{i}": p for i, p in enumerate(self.params)}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, thread: int = 0) -> None:
        if self.updater is None:
            raise PSError("DistributedOptimizer.step: call fleet.init_worker() first")
        self.updater.apply([p.grad for p in self.params])
        self.updater.step_end(thread)


class Fleet:
    """This process's place in a PS cluster; see the module docstring.

    Args:
        role_maker: anything with `.role()` (recps.ps.roles); None detects it from the environment.
        connect_timeout_s: how long init_worker / init_server wait for the others to come up.
        dead_after_s: heartbeat silence before the coordinator declares a peer dead (server 0).
        server_threads: handler threads of a server.
    """

    def __init__(self, role_maker=None, *, connect_timeout_s: float = 120.0,
                 dead_after_s: float = DEFAULT_DEAD_AFTER_S, server_threads: int = 2) -> None:
        maker = role_maker if role_maker is not None else detect_role_maker()
        self.role: Role = maker.role() if hasattr(maker, "role") else maker
        self.connect_timeout_s = connect_timeout_s
        self.dead_after_s = dead_after_s
        self.server_threads = server_threads
        self.strategy: DistributedStrategy | None = None
        self.client = None
        self.communicator = None
        self._node: ServerNode | None = None
        self._collections: list[PSEmbeddingBagCollection | PSEmbeddingCollection] = []
        self._optimizer: DistributedOptimizer | None = None
        self._stopped = False

    # -- roles ---------------------------------------------------------------------------------

    def is_server(self) -> bool:
        return self.role.is_server

    def is_worker(self) -> bool:
        return self.role.is_worker

    def is_first_worker(self) -> bool:
        return self.role.is_worker and self.role.index == 0

    def worker_index(self) -> int:
        return self.role.index if self.role.is_worker else -1

    def worker_num(self) -> int:
        return self.role.num_workers

    def server_num(self) -> int:
        return self.role.num_servers

    # -- servers -------------------------------------------------------------------------------

    def init_server(self) -> None:
        """Start this process's server (and, on server 0, the coordinator)."""
        self._require("server", "init_server")
        self._node = ServerNode(self.role, num_threads=self.server_threads, dead_after_s=self.dead_after_s,
                                timeout_s=self.connect_timeout_s).start()
        log.info("%s serving on %s", self.role.name, self._node.endpoint)

    def run_server(self) -> None:
        """Serve until a worker sends stop, SIGTERM / SIGINT arrives (from the main thread), or every
        worker left or died without a stop (no orphan servers without a launcher); then stop."""
        self._require("server", "run_server")
        if self._node is None:
            self.init_server()
        node = self._node
        previous = {}
        if threading.current_thread() is threading.main_thread():
            def on_signal(signum, frame) -> None:
                log.info("%s: signal %d, stopping", self.role.name, signum)
                node.server._stop_requested.set()

            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, on_signal)
        try:
            while not node.wait(0.5):  # wake up now and then: signal handlers run between bytecodes
                if node.workers_gone:
                    log.warning("%s: every worker left or died without stopping the servers; stopping", self.role.name)
                    break
            time.sleep(_REPLY_GRACE_S)  # let the reply to a worker's stop leave before the sockets close
        finally:
            try:
                # Under this method's handlers: the launcher's SIGTERM, sent once the workers exit,
                # only repeats the stop instead of killing the server mid-shutdown.
                self._stop_server()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    def _stop_server(self) -> None:
        if self._node is not None:
            self._node.stop()
            self._node = None

    # -- worker side ---------------------------------------------------------------------------

    def embedding_bag_collection(self, tables, prefix: str = "embedding") -> PSEmbeddingBagCollection:
        """A PS-backed EmbeddingBagCollection of torchrec `EmbeddingBagConfig`s, bound by init_worker."""
        collection = PSEmbeddingBagCollection(tables, prefix=prefix)
        self._collections.append(collection)
        return collection

    def embedding_collection(self, tables, prefix: str = "sequence") -> PSEmbeddingCollection:
        """A PS-backed EmbeddingCollection of torchrec `EmbeddingConfig`s, bound by init_worker."""
        collection = PSEmbeddingCollection(tables, prefix=prefix)
        self._collections.append(collection)
        return collection

    def add_collection(self, collection: PSEmbeddingBagCollection | PSEmbeddingCollection) -> None:
        """Register a collection built elsewhere (recps.train builds its own)."""
        self._collections.append(collection)

    def distributed_optimizer(self, optimizer: torch.optim.Optimizer,
                              strategy: DistributedStrategy | None = None) -> DistributedOptimizer:
        """Wrap `optimizer` (over the dense parameters) for training through the PS."""
        self.strategy = strategy or self.strategy or DistributedStrategy()
        self._optimizer = DistributedOptimizer(optimizer, self.strategy)
        return self._optimizer

    def init_worker(self, strategy: DistributedStrategy | None = None) -> None:
        """Connect, create the tables, start from the servers' dense values, bind the communicator."""
        self._require("worker", "init_worker")
        if self.client is not None:
            raise PSError(f"{self.role.name}: init_worker was called twice")
        self.strategy = strategy or self.strategy or DistributedStrategy()
        s = self.strategy
        self.client = connect(self.role, timeout_s=self.connect_timeout_s, request_timeout_s=s.timeout_s)
        for collection in self._collections:
            for table, dim in collection.table_dims().items():
                # geo: the servers only add deltas; their rule is unused, the replica has its own.
                self.client.create_sparse_table(table, dim, optimizer=s.embedding_optimizer,
                                                initializer=_uniform(s.init_std), seed=s.seed,
                                                capacity=s.table_capacity)
        opt = self._optimizer
        if opt is not None:
            rule = opt.rule or {"name": "sgd", "lr": 0.01}
            self.client.create_dense_table(DENSE_TABLE, {n: p.detach() for n, p in opt.named_params().items()},
                                           optimizer=rule)
        self.client.barrier("recps.init_worker", timeout=self.connect_timeout_s)  # tables exist everywhere
        if opt is not None:
            assign_flat(opt.params, self.client.pull_dense(DENSE_TABLE).wait())  # every worker starts equal
        self.communicator = make_communicator(s.settings(), self.client)
        for collection in self._collections:
            collection.bind(self.communicator)
        if opt is not None:
            if s.mode == "geo":
                self.communicator.attach_dense(DENSE_TABLE, opt.named_params())
                opt.updater = GeoDenseUpdater(opt.params, opt.optimizer, self.communicator)
            else:
                opt.updater = PSDenseUpdater(opt.params, self.communicator)
        log.info("%s: %s mode, %d server(s), %d worker(s), %d thread(s)", self.role.name, s.mode,
                 self.role.num_servers, self.role.num_workers, s.threads)

    def barrier(self, name: str = "fleet.barrier", timeout: float | None = None) -> None:
        """Send what this worker queued, wait until every worker arrived (PSTimeoutError / PSError
        name the missing or dead), then (sync, async) copy the servers' dense values into the
        model: after a barrier every worker holds the same, current dense parameters."""
        self._require("worker", "barrier")
        if self.client is None:
            raise PSError("barrier: call init_worker() first")
        self.flush()
        self.client.barrier(name, timeout=timeout)
        if self._optimizer is not None and self.strategy.mode != "geo":
            assign_flat(self._optimizer.params, self.client.pull_dense(DENSE_TABLE).wait())

    def flush(self) -> None:
        """Everything this worker pushed is applied on the servers (geo: the last deltas sent)."""
        if self.communicator is not None:
            self.communicator.flush()

    def save(self, path: str, mode: str = "full") -> dict[str, int]:
        """The servers write their shards of every table under `path` (call from one worker, after a barrier)."""
        if self.client is None:
            raise PSError("save: call init_worker() first")
        return self.client.save(str(path), mode=mode)

    def stop_worker(self) -> None:
        """Flush, wait for every worker; worker 0 then stops the servers. Idempotent."""
        self._require("worker", "stop_worker")
        if self._stopped or self.client is None:
            return
        self._stopped = True
        client = self.client
        try:
            if self.communicator is not None:
                self.communicator.close()
            # Worker 0 may still be evaluating or saving: wait longer than for a training step.
            client.barrier("recps.stop_worker", timeout=max(self.strategy.timeout_s, self.connect_timeout_s))
            if self.role.index == 0:
                self._wait_others_left(client)
                try:
                    client.stop_servers(timeout=_STOP_REPLY_S)
                except PSError as e:  # gone already (they also stop once every worker left): fine
                    log.info("%s: stop_servers: %s", self.role.name, e)
        finally:
            client.close()

    def _wait_others_left(self, client) -> None:
        """Let the other workers deregister while the coordinator (on server 0) still runs."""
        deadline = time.monotonic() + _STOP_WAIT_S
        others = {f"worker{i}" for i in range(1, self.role.num_workers)}
        while others and time.monotonic() < deadline:
            members = client.coordinator.members()
            if all(members.get(n, {}).get("state") != "alive" for n in others):
                return
            time.sleep(0.05)

    def _close_on_error(self) -> None:
        """Leave without barriers: the others learn it from the coordinator (deregistered / dead)."""
        self._stopped = True  # the communicator is not flushed: its queue may wait on a dead server
        if self.client is not None:
            self.client.close()

    def _require(self, kind: str, what: str) -> None:
        if (kind == "server") != self.role.is_server:
            raise ConfigError(f"{what}: this process is {self.role.name}; only {kind}s call it "
                              f"(branch on fleet.is_server() / is_worker())")

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.role.is_server:
            self._stop_server()
        elif exc_type is None:
            self.stop_worker()
        else:
            self._close_on_error()


def init(role_maker=None, **kwargs) -> Fleet:
    """A Fleet for this process (Paddle's `fleet.init(role_maker)`), usable as a context manager."""
    return Fleet(role_maker, **kwargs)
