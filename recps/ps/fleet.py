"""Fleet-style API (layer L4): about ten added lines turn a local training script into a distributed one.

    local script                                   its distributed twin (examples/)
    ------------                                   --------------------------------
                                                   with fleet.init(detect_role_maker()) as f:
                                                       if f.is_server():
                                                           f.init_server(); f.run_server()
                                                       else:
    ebc = LocalEmbeddingBagCollection(...)             ebc = f.embedding_bag_collection(configs)
    model = CTRDNN(ebc, 13)                            model = CTRDNN(ebc, 13)
    opt = torch.optim.Adam(dense params)               opt = f.distributed_optimizer(torch.optim.Adam(...),
                                                                                 DistributedStrategy(GeoMode(k_steps=100)))
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
  torchrec's collections, bound to the communicator by `init_worker()`
  (`embedding_bag_collection_from_features(feature_names, dim)`: one table per feature, as
  recps.embeddings.LocalEmbeddingBagCollection(feature_names, dim, num_embeddings) builds). `mode=` gives a
  collection its own PS mode (another mode object than the strategy's): its tables are tagged
  with that mode on the servers and trained by that mode's communicator, so one job may train
  a sync table and a GEO table side by side against the same servers.
- `distributed_optimizer(optimizer, strategy)`: wraps a torch optimizer over the dense
  parameters; its `step()` pushes their gradients (sync / async: the servers apply the
  matching rule, see `torch_optimizer_rule`) or steps it locally (geo), then ends the step.
- `init_worker()`: connects (waits for every server), creates the sparse tables of the
  collections and the dense table (the first worker's initial values win), waits for every
  worker, copies the servers' dense values into the model, binds one communicator per mode.
- `stop_worker()`: sends what is queued, waits for every worker, and worker 0 stops the servers.
- `barrier(name)`: sends what is queued, every worker waits for all, dense values refreshed;
  `wait_for_workers(name)`: only the meeting (nothing sent or pulled).
- Dense tables beside the optimizer's, by name (a funnel stage's `<stage>_dense`, statistics):
  `create_dense_table`, `push_dense` (a handle), `pull_dense` (the values), `pull_dense_into`
  (into parameters); `save` / `load` / `shrink` / `table_mode` on the servers' tables;
  `channel()`: the narrow view observers and metric mergers get. Orchestration (recps.pipeline,
  recps.stream, recps.cluster) uses these, never `fleet.client` (tests/test_layers.py).
- Counting tables (a funnel's counting features): `create_counting_table` (width 1, an accessor, nothing
  trained), `count` (shows and clicks of keys), `pull_statistics` (any accessor table's show and click).
- `read_servers()`: the model reads what the servers hold (evaluation after training).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from recps.errors import ConfigError, PSError
from recps.ps.embedding import PSEmbeddingBagCollection, PSEmbeddingCollection
from recps.ps.modes import MODES, AsyncMode, KeepsWorkerState, Mode, ReadsServers, ServerReader, server_halves
from recps.ps.modes.dense import assign_flat
from recps.ps.node import PSClient, PSServer, ServerNode, connect
from recps.ps.node.coordinator import DEFAULT_DEAD_AFTER_S
from recps.ps.node.server import STORAGE_ROOTS_ENV  # the folders a server may save to and load from
from recps.ps.transport.security import ENCRYPTION_ENV  # curve (default) or off, the same on every process
from recps.ps.roles import Role, detect_role_maker
from recps.ps.table.tier import tier_line  # a tiered table's line in a run's closing output

__all__ = ["Fleet", "WorkerChannel", "DistributedStrategy", "STORAGE_ROOTS_ENV", "ENCRYPTION_ENV", "DistributedOptimizer", "DENSE_TABLE", "ReadsServers", "ServerReader", "init", "read_checkpoint", "tier_line"]

log = logging.getLogger(__name__)

DENSE_TABLE = "dense"  # the dense parameters' table
_STOP_WAIT_S = 10.0  # how long worker 0 waits for the others to leave before it stops the servers
_STOP_REPLY_S = 5.0  # a server answers stop at once; it may close before the reply is read
_REPLY_GRACE_S = 0.2


@dataclass
class DistributedStrategy:
    """How the workers train against the servers.

    Args:
        mode: a mode object, SyncMode(), AsyncMode(...) or GeoMode(k_steps=20, ...)
            (recps.ps.modes; conf/ps/<mode>.yaml builds the same), with its tables' settings
            (`table=TableConfig(...)`) and its timeout; a name ("sync") takes its defaults.
        threads: training threads per worker that end each step (sync waits for all of them).
    """

    mode: Mode = field(default_factory=AsyncMode)
    threads: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.mode, str):
            if self.mode not in MODES:
                raise ConfigError(f"DistributedStrategy: mode={self.mode!r}; use one of {sorted(MODES)} "
                                  "or a mode object (recps.ps.modes.SyncMode(), AsyncMode(...), GeoMode(...))")
            self.mode = MODES[self.mode]()
        if not isinstance(self.mode, Mode):
            raise ConfigError(f"DistributedStrategy: mode={self.mode!r}; give SyncMode(), AsyncMode(...) or GeoMode(...)")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ConfigError(f"DistributedStrategy: threads={self.threads!r}; it must be an integer >= 1")


class DistributedOptimizer:
    """A torch optimizer over the dense parameters, trained through the parameter server.

    `step(thread=0)` hands the gradients to the mode (see the module docstring) and ends the
    step; `zero_grad()` is the wrapped optimizer's. `updater` is the same thing as a
    recps.job.loop DenseUpdater, for the multi-threaded Trainer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: DistributedStrategy) -> None:
        self.optimizer = optimizer
        self.strategy = strategy
        self.params: list[nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"]]
        if not self.params:
            raise ConfigError("distributed_optimizer: the optimizer has no parameters; give it the model's dense ones")
        self.rule = strategy.mode.dense_rule(optimizer)  # the servers' rule (validated here, before connecting)
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
                 dead_after_s: float = DEFAULT_DEAD_AFTER_S, server_threads: int = 2,
                 storage_roots: Sequence[str] | None = None) -> None:
        maker = role_maker if role_maker is not None else detect_role_maker()
        self.role: Role = maker.role() if hasattr(maker, "role") else maker
        self.connect_timeout_s = connect_timeout_s
        self.dead_after_s = dead_after_s
        self.server_threads = server_threads
        self.storage_roots = storage_roots  # a server's save/load folders (None: $RECPS_STORAGE_ROOTS)
        self.strategy: DistributedStrategy | None = None
        self.client = None
        self.communicator = None  # the strategy mode's (the dense table's)
        self.communicators: list = []  # one per mode object in use, the strategy's first
        self._node: ServerNode | None = None
        self._collections: list[tuple[PSEmbeddingBagCollection | PSEmbeddingCollection, Mode | None]] = []
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
                                timeout_s=self.connect_timeout_s, halves=server_halves(),
                                storage_roots=self.storage_roots).start()
        log.info("%s serving on %s", self.role.name, self._node.endpoint)

    def run_server(self) -> None:
        """Serve until a worker sends stop or SIGTERM / SIGINT arrives (from the main thread): then
        stop and return. Raise PSError (a non-zero exit, whoever launched the process) when the job
        cannot finish: every worker left or died without a stop (no orphan servers without a
        launcher), a peer was declared dead, this server was, or the coordinator is lost; server 0
        first serves two heartbeats longer, so that every peer hears who died from its coordinator."""
        self._require("server", "run_server")
        if self._node is None:
            self.init_server()
        node = self._node
        previous = {}
        if threading.current_thread() is threading.main_thread():
            def on_signal(signum, frame) -> None:
                log.info("%s: signal %d, stopping", self.role.name, signum)
                node.request_stop(f"it got {signal.Signals(signum).name}")

            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, on_signal)
        failure: PSError | None = None
        try:
            while not node.wait(0.5):  # wake up now and then: signal handlers run between bytecodes
                failure = node.failure
                if failure is not None:
                    if node.coordinator is not None:  # the others hear it from this coordinator's heartbeats
                        node.wait(2 * node.heartbeat_s + 0.5)
                    failure = PSError(f"{self.role.name}: {failure}")
                    break
                if node.workers_gone:
                    failure = PSError(f"{self.role.name}: every worker left or died before the job finished (no worker "
                                      "sent stop, see the workers' logs); stopping with an error")
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
        if failure is not None:
            raise failure

    def _stop_server(self) -> None:
        if self._node is not None:
            self._node.stop()
            self._node = None

    # -- worker side ---------------------------------------------------------------------------

    def embedding_bag_collection(self, tables, prefix: str = "embedding", mode: Mode | None = None) -> PSEmbeddingBagCollection:
        """A PS-backed EmbeddingBagCollection of torchrec `EmbeddingBagConfig`s, bound by init_worker;
        `mode`: its own PS mode (default: the strategy's)."""
        collection = PSEmbeddingBagCollection(tables, prefix=prefix)
        self.add_collection(collection, mode)
        return collection

    def embedding_bag_collection_from_features(self, feature_names, embedding_dim: int, num_embeddings: int = 2**31 - 1,
                                               prefix: str = "embedding", mode: Mode | None = None) -> PSEmbeddingBagCollection:
        """`embedding_bag_collection` with one table `t_<feature>` of width `embedding_dim` per feature,
        the arguments of recps.embeddings.LocalEmbeddingBagCollection(feature_names, embedding_dim, num_embeddings)
        (num_embeddings is informational here: the servers' tables grow with the keys)."""
        collection = PSEmbeddingBagCollection.from_features(feature_names, embedding_dim,
                                                            num_embeddings=num_embeddings, prefix=prefix)
        self.add_collection(collection, mode)
        return collection

    def embedding_collection(self, tables, prefix: str = "sequence", mode: Mode | None = None) -> PSEmbeddingCollection:
        """A PS-backed EmbeddingCollection of torchrec `EmbeddingConfig`s, bound by init_worker;
        `mode`: its own PS mode (default: the strategy's)."""
        collection = PSEmbeddingCollection(tables, prefix=prefix)
        self.add_collection(collection, mode)
        return collection

    def add_collection(self, collection: PSEmbeddingBagCollection | PSEmbeddingCollection, mode: Mode | None = None) -> None:
        """Register a collection built elsewhere (recps.train builds its own); `mode` as above."""
        if mode is not None and not isinstance(mode, Mode):
            raise ConfigError(f"add_collection: mode={mode!r}; give SyncMode(), AsyncMode(...) or GeoMode(...)")
        self._collections.append((collection, mode))

    def distributed_optimizer(self, optimizer: torch.optim.Optimizer,
                              strategy: DistributedStrategy | None = None) -> DistributedOptimizer:
        """Wrap `optimizer` (over the dense parameters) for training through the PS."""
        self.strategy = strategy or self.strategy or DistributedStrategy()
        self._optimizer = DistributedOptimizer(optimizer, self.strategy)
        return self._optimizer

    def init_worker(self, strategy: DistributedStrategy | None = None, load_from: str | None = None) -> None:
        """Connect, create the tables, start from the servers' dense values, bind the communicators.

        `load_from`: a PS checkpoint folder (any fsspec URL) whose tables the servers load, with their
        optimizer state and statistics, re-sharded onto this cluster's servers (the first worker
        asks, the others wait for it), before any worker reads a value."""
        self._require("worker", "init_worker")
        if self.client is not None:
            raise PSError(f"{self.role.name}: init_worker was called twice")
        self.strategy = strategy or self.strategy or DistributedStrategy()
        s = self.strategy
        modes = [s.mode]  # distinct mode objects, the strategy's first
        for _, mode in self._collections:
            if mode is not None and all(mode is not m for m in modes):
                modes.append(mode)
        self.client = connect(self.role, timeout_s=self.connect_timeout_s,
                              request_timeout_s=max(m.timeout_s for m in modes))
        tables: dict[str, str] = {}
        for collection, mode in self._collections:
            mode = mode or s.mode
            for table, dim in collection.table_dims().items():
                if tables.setdefault(table, mode.name) != mode.name:
                    raise ConfigError(f"table {table!r} is trained by two modes ({tables[table]}, {mode.name}); "
                                      "give the collections different prefixes")
                # geo: the servers only add deltas; the rule is the replica's.
                t = mode.table
                self.client.create_sparse_table(table, dim, optimizer=t.optimizer, initializer=t.initializer(),
                                                accessor=t.accessor, entry=t.entry, seed=t.seed,
                                                capacity=t.capacity, mode=mode.name,
                                                memory_budget=t.budget_rows(dim))
        opt = self._optimizer
        if opt is not None:
            self.client.create_dense_table(DENSE_TABLE, {n: p.detach().cpu() for n, p in opt.named_params().items()},
                                           optimizer=opt.rule, mode=s.mode.name)
        self.client.barrier("recps.init_worker", timeout=self.connect_timeout_s)  # tables exist everywhere
        if load_from is not None:
            if self.role.index == 0:
                loaded = self.client.load(str(load_from), tables=sorted(tables) + ([DENSE_TABLE] if opt is not None else []),
                                          timeout=max(m.timeout_s for m in modes) * 10)
                log.info("%s: the servers loaded %s from %s", self.role.name, loaded, load_from)
            self.client.barrier("recps.loaded", timeout=self.connect_timeout_s * 10)
        self._pull_dense_params()  # every worker starts equal
        self.communicators = [m.communicator(self.client, s.threads) for m in modes]
        self.communicator = self.communicators[0]
        by_mode = {id(m): c for m, c in zip(modes, self.communicators)}
        for collection, mode in self._collections:
            collection.bind(by_mode[id(mode or s.mode)])
        if opt is not None:
            updater = s.mode.dense_updater(opt.named_params(), opt.optimizer, self.communicator, DENSE_TABLE)
            opt.updater = updater if len(modes) == 1 else _EveryMode(updater, self.communicators[1:])
        log.info("%s: %s mode%s, %d server(s), %d worker(s), %d thread(s)", self.role.name, s.mode.name,
                 "".join(f" + {m.name}" for m in modes[1:]), self.role.num_servers, self.role.num_workers, s.threads)

    def barrier(self, name: str = "fleet.barrier", timeout: float | None = None) -> None:
        """Send what this worker queued, wait until every worker arrived (PSTimeoutError / PSError
        name the missing or dead), then (sync, async) copy the servers' dense values into the
        model: after a barrier every worker holds the same, current dense parameters."""
        self._require("worker", "barrier")
        if self.client is None:
            raise PSError("barrier: call init_worker() first")
        self.flush()
        self.client.barrier(name, timeout=timeout)
        if self.strategy.mode.name != "geo":
            self._pull_dense_params()

    def wait_for_workers(self, name: str, timeout: float | None = None) -> None:
        """Block until every worker called wait_for_workers(name) (or barrier(name)); nothing is
        sent or pulled (`barrier` also flushes and refreshes the dense parameters). Raises
        PSTimeoutError after `timeout` s (default: the client's), PSError naming a dead worker.
        Thread-safe: threads of one worker may wait on different names at once (a funnel's
        concurrent stages), never two on the same name."""
        self._worker_client("wait_for_workers").barrier(name, timeout=timeout)

    # -- dense tables beside the optimizer's (a dense table per prefix: a funnel stage's, statistics) --

    def create_dense_table(self, name: str, params, *, optimizer: dict | None = None, mode: str | None = None,
                           timeout: float | None = None) -> dict:
        """Create dense table `name` on the servers: `params` a flat size N (zeros), or an ordered
        dict name -> tensor (its values initialize the table) or -> shape; `optimizer` the servers'
        rule (`mode.dense_rule(opt)`; None: values are only summed), `mode` the PS mode that trains it
        (default: the strategy's). Every worker may call it: idempotent, the first creator's values
        win. Returns when every server holds the table (the spec), PSTimeoutError after `timeout`.
        Other workers may not have created it yet: wait_for_workers before they read it."""
        client = self._worker_client("create_dense_table")
        mode = mode if mode is not None else self.strategy.mode.name
        return client.create_dense_table(name, params, optimizer=optimizer, mode=mode, timeout=timeout)

    def push_dense(self, name: str, values: torch.Tensor):
        """Send (N,) flat values to dense table `name` (what they are, gradients or additions, is its
        mode's); returns a handle: `wait(timeout)` returns once every server applied them. Thread-safe."""
        return self._worker_client("push_dense").push_dense(name, values)

    def pull_dense(self, name: str, timeout: float | None = None) -> torch.Tensor:
        """The (N,) float32 values the servers hold of dense table `name`, now (blocks; PSTimeoutError
        after `timeout`, default the client's). Thread-safe."""
        return self._worker_client("pull_dense").pull_dense(name).wait(timeout)

    def pull_dense_into(self, name: str, params: Sequence[torch.Tensor], timeout: float | None = None) -> None:
        """Copy dense table `name`'s values into `params` (the table's order, as it was created from
        them; no autograd): `pull_dense` then an in-place copy. Returns when the copy is done."""
        assign_flat(list(params), self.pull_dense(name, timeout))

    # -- counting tables: the accessor's show/click statistics of keys, nothing trained ----------------

    def create_counting_table(self, name: str, accessor: dict, timeout: float | None = None) -> dict:
        """Create sparse table `name` that only counts: width 1, zeros, no entry policy (every key counted),
        the CTR accessor `accessor` (CtrAccessor fields; its decay and deletion rules apply at `shrink`),
        tagged "geo" so that a push adds its (zero) rows, never an update rule. Every worker may call it
        (idempotent); wait_for_workers before another worker counts into it."""
        client = self._worker_client("create_counting_table")
        if accessor is None:
            raise ConfigError(f"create_counting_table {name!r}: no accessor; its statistics are the accessor's: give "
                              "CtrAccessor fields ({} for its defaults)")
        return client.create_sparse_table(name, 1, optimizer={"name": "sgd", "lr": 1.0},  # never applied: geo adds
                                          initializer={"kind": "zeros"}, accessor=dict(accessor), mode="geo",
                                          timeout=timeout)

    def count(self, name: str, keys: torch.Tensor, shows: torch.Tensor, clicks: torch.Tensor):
        """Add (K,) shows and clicks to the statistics of (K,) keys of counting table `name` (duplicates
        summed; a new key gets a row). Returns a handle: `wait(timeout)` returns once every server added
        them. Thread-safe."""
        client = self._worker_client("count")
        keys = torch.as_tensor(keys, dtype=torch.int64).reshape(-1)
        return client.push(name, keys, torch.zeros(keys.numel(), 1), shows=shows, clicks=clicks)

    def pull_statistics(self, name: str, keys: torch.Tensor, timeout: float | None = None) -> torch.Tensor:
        """(K, 2) float32 show and click of (K,) keys of sparse table `name` (it has an accessor), as the
        servers hold them now: zeros for a key without a row; nothing is created. Blocks (PSTimeoutError
        after `timeout`, default the client's). Thread-safe."""
        return self._worker_client("pull_statistics").pull_statistics(name, keys).wait(timeout)

    def table_mode(self, name: str) -> str:
        """The PS mode table `name` is tagged with on the servers ("sync", "async", "geo")."""
        return self._worker_client("table_mode").table_spec(name)["mode"]

    def tier_stats(self, tables: Sequence[str] | None = None, timeout: float | None = None) -> dict[str, dict]:
        """{table: its disk tier's statistics merged over the servers} for the tables (of `tables`;
        None: every table) that have a disk tier (ps.table.memory_budget); {} when none has.
        Blocks on the servers' stats verb (PSTimeoutError after `timeout`, default the client's)."""
        stats = self._worker_client("tier_stats").stats(timeout=timeout)["tables"]
        return {name: t["tier"] for name, t in sorted(stats.items())
                if "tier" in t and (tables is None or name in tables)}

    def load(self, path: str, tables: Sequence[str] | None = None, timeout: float | None = None) -> dict[str, int]:
        """The servers load `tables` (all: None) of the PS checkpoint `path` (any fsspec URL), re-sharded
        onto this cluster, optimizer state and statistics with them; returns rows / parameters loaded
        per table once every server is done. One worker calls it, the others wait_for_workers."""
        return self._worker_client("load").load(str(path), tables=tables, timeout=timeout)

    def shrink(self, tables: Sequence[str] | None = None, timeout: float | None = None) -> int:
        """Day end on every server (tables with an accessor): decay shows and clicks, delete rows by
        score and unseen days; returns the rows deleted once every server is done. One worker calls it."""
        return self._worker_client("shrink").shrink(tables=tables, timeout=timeout)

    def channel(self) -> "WorkerChannel":
        """What this worker's observers and metric mergers may do on the servers beside training
        (recps.metrics.ps_merger.PSMerger, TrainObserver.on_checkpoint): see WorkerChannel."""
        return WorkerChannel(self._worker_client("channel"))

    def _worker_client(self, what: str):
        if self.client is None:
            raise PSError(f"{what}: call init_worker() first")
        return self.client

    def flush(self) -> None:
        """Everything this worker pushed is applied on the servers (geo: the last deltas sent)."""
        for communicator in self.communicators:
            communicator.flush()

    def close_communicators(self) -> None:
        """Send what is queued (geo: the last deltas) and stop the communicators' threads; the
        client stays open (barriers, evaluation, saves). Idempotent."""
        for communicator in self.communicators:
            communicator.close()

    def read_servers(self) -> None:
        """The model reads what the servers hold: every collection pulls through a read-only view
        (nothing is created or pushed) and the dense parameters take the servers' values. Call
        after close_communicators and a barrier: every worker's updates are in."""
        if self.client is None:
            raise PSError("read_servers: call init_worker() first")
        reader = ServerReader(self.client)
        for collection, _ in self._collections:
            collection.bind(reader)
        self._pull_dense_params()

    @contextlib.contextmanager
    def reading_servers(self):
        """For the block, the model reads what the servers hold (as `read_servers`: nothing is
        created, pushed or counted as a sighting), then trains on as before: the collections get
        their communicators back and the dense parameters this worker's own values (geo keeps a
        local dense replica). For an evaluation between passes, after `barrier`: every worker's
        updates are in."""
        if self.client is None:
            raise PSError("reading_servers: call init_worker() first")
        bound = [(collection, collection.communicator) for collection, _ in self._collections]
        own = [p.detach().clone() for p in self._optimizer.params] if self._optimizer is not None else []
        try:
            self.read_servers()
            yield
        finally:
            for collection, communicator in bound:
                collection.bind(communicator)
            if own:
                with torch.no_grad():
                    for p, value in zip(self._optimizer.params, own):
                        p.copy_(value)

    def _pull_dense_params(self) -> None:
        """The servers' dense values into the distributed optimizer's parameters (if there is one)."""
        if self._optimizer is not None:
            assign_flat(self._optimizer.params, self.client.pull_dense(DENSE_TABLE).wait())

    def worker_state(self) -> dict:
        """What this worker holds that the servers do not, for a checkpoint (geo: its replicas' keys
        and optimizer state, the local dense optimizer's state; sync and async: nothing). Call
        between steps, after `flush`."""
        state: dict = {}
        sparse = {t: v for c in self.communicators if isinstance(c, KeepsWorkerState) for t, v in c.state_dict().items()}
        if sparse:
            state["sparse"] = sparse
        dense = self._local_dense_updater()
        if dense is not None:
            state["dense_optimizer"] = dense.state_dict()
        return state

    def load_worker_state(self, state: dict) -> None:
        """A `worker_state` of this worker's place in a checkpointed run, before training."""
        for communicator in self.communicators:
            if isinstance(communicator, KeepsWorkerState) and state.get("sparse"):
                communicator.load_state_dict(state["sparse"])
        dense = self._local_dense_updater()
        if dense is not None and "dense_optimizer" in state:
            dense.load_state_dict(state["dense_optimizer"])

    def _local_dense_updater(self):
        """The dense updater whose optimizer runs on this worker (geo), or None."""
        updater = self._optimizer.updater if self._optimizer is not None else None
        if isinstance(updater, _EveryMode):  # it wraps the strategy's
            updater = updater.updater
        return updater if isinstance(updater, KeepsWorkerState) else None  # geo's GeoDenseUpdater

    def save(self, path: str, mode: str = "full", tables: Sequence[str] | None = None,
             timeout: float | None = None) -> dict[str, int]:
        """The servers write their shards of `tables` (every table: None) under `path` in save mode
        `mode` (recps.ps.node.client.PSClient.save); returns rows / parameters written per table once
        every server is done (PSTimeoutError after `timeout`). Call from one worker, after a barrier."""
        return self._worker_client("save").save(str(path), mode=mode, tables=tables, timeout=timeout)

    def stop_worker(self) -> None:
        """Flush, wait for every worker; worker 0 then stops the servers. Idempotent."""
        self._require("worker", "stop_worker")
        if self._stopped or self.client is None:
            return
        self._stopped = True
        client = self.client
        try:
            self.close_communicators()
            # Worker 0 may still be evaluating or saving: wait longer than for a training step.
            client.barrier("recps.stop_worker", timeout=max(self.strategy.mode.timeout_s, self.connect_timeout_s))
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


class WorkerChannel:
    """A worker's narrow view of the servers for what observes training (metric merges through
    the servers, checks at a checkpoint): its place, dense tables by name, a bare barrier and
    reads. The verbs are PSClient's of the same names, with their contracts (handles with
    `wait(timeout)`; thread-safe); nothing here trains a sparse table, saves, loads or stops."""

    def __init__(self, client) -> None:
        self._c = client

    @property
    def worker_index(self) -> int:
        return self._c.worker_index

    @property
    def num_workers(self) -> int:
        return self._c.num_workers

    @property
    def timeout_s(self) -> float:
        return self._c.timeout_s

    def create_dense_table(self, name: str, params, optimizer: dict | None = None, mode: str = "geo",
                           timeout: float | None = None) -> dict:
        return self._c.create_dense_table(name, params, optimizer=optimizer, mode=mode, timeout=timeout)

    def push_dense(self, name: str, values, **kw):
        return self._c.push_dense(name, values, **kw)

    def pull_dense(self, name: str):
        return self._c.pull_dense(name)

    def barrier(self, name: str, timeout: float | None = None) -> None:
        self._c.barrier(name, timeout=timeout)

    def pull(self, table: str, keys: torch.Tensor, *, create: bool = False):
        """Rows of `keys` as the servers hold them (create=False: missing rows read as zeros)."""
        return self._c.pull(table, keys, create=create)

    def stats(self, timeout: float | None = None) -> dict:
        return self._c.stats(timeout=timeout)

    def table_spec(self, name: str) -> dict:
        return self._c.table_spec(name)


class _EveryMode:
    """The dense updater of a worker whose collections use several modes: a step ends on every
    communicator (the other modes' first, then the dense table's)."""

    def __init__(self, updater, others) -> None:
        self.updater, self.others = updater, list(others)

    def apply(self, grads) -> None:
        self.updater.apply(grads)

    def step_end(self, thread: int) -> None:
        for communicator in self.others:
            communicator.step_end(thread)
        self.updater.step_end(thread)


def init(role_maker=None, **kwargs) -> Fleet:
    """A Fleet for this process (Paddle's `fleet.init(role_maker)`), usable as a context manager."""
    return Fleet(role_maker, **kwargs)


@contextlib.contextmanager
def read_checkpoint(folder: str, collections, params):
    """For the block: a server in this process holds every table of the PS checkpoint `folder`
    (re-sharded onto it), the `collections` read through it (nothing is created or pushed) and the
    dense `params` (the distributed optimizer's order) hold its dense values. Evaluation of a
    checkpoint without a cluster."""
    token = secrets.token_hex(16)
    with PSServer(token=token, halves=server_halves(), storage_roots=[str(folder)]) as server, PSClient([server.endpoint], token=token) as client:
        tables = sorted({t for c in collections for t in c.table_dims()})
        client.load(str(folder), tables=[*tables, DENSE_TABLE])
        reader = ServerReader(client)
        for collection in collections:
            collection.bind(reader)
        assign_flat(list(params), client.pull_dense(DENSE_TABLE).wait())
        yield client
