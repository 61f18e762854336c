"""PSServer: one parameter-server process's shards of every table, served over the transport.

Shape letters: K keys in a request, D row width, N_s the flat size of this server's part of a
dense table, W workers.

Server `index` of S holds, for each sparse table, the rows of the keys with
`partition(key, S) == index` (the client routes them; the same function re-shards checkpoints),
and for each dense table the parameters `DenseLayout` gives it (whole parameters, by name).

Verbs (request tensors -> reply tensors; `table` is the transport's text field):

    create_sparse   meta spec (JSON)                 -> meta spec       idempotent; another spec: error
    create_dense    meta spec, [init (N_s,)]?        -> meta spec       idempotent; first values win
    describe                                         -> meta spec
    pull            [keys (K,)], meta create?        -> [rows (K, D)]   rows created on first pull
    push            [keys, grads (K, D), shows?, clicks?]               update rule applied on arrival
    push_sync       [keys, grads], meta step, worker, workers, timeout_s
                    the gradients of step `step` from all W workers are summed and divided by W
                    (the mean over workers) and applied as ONE update when the last arrives; every
                    worker's reply leaves after that update, so a pull that follows sees it
    push_delta      [keys, deltas (K, D)]                               GEO: value += delta
    pull_dense                                       -> [values (N_s,)]
    push_dense      [grads (N_s,)], meta return_values?   -> [values]?
    push_dense_sync [grads (N_s,)], meta step, worker, workers, timeout_s
    push_dense_delta [deltas (N_s,)]
    save            meta path, mode, tables          -> meta result (JSON)  path/<table>/shard-i-of-S/
    load            meta path, tables                -> meta result (JSON)
    shrink          meta tables                      -> meta deleted
    stats                                            -> meta stats (JSON)
    tables                                           -> meta tables (JSON name -> spec)
    stop                                             the reply leaves, then `stopped` is set

Concurrency: requests are served by `num_threads` handler threads; each table is thread-safe on
its own (see recps.ps.table), so pulls and pushes of different threads and workers interleave.
A push_sync whose step does not complete within its `timeout_s` fails for the workers that did
push, naming the ones that did not (reply meta {"error": "timeout", "message": ...}, raised by the
client as PSTimeoutError).

>>> import torch
>>> from recps.ps.node.client import PSClient
>>> with PSServer(token="t") as server, PSClient([server.endpoint], token="t") as client:
...     _ = client.create_sparse_table("emb", dim=2, optimizer={"name": "sgd", "lr": 1.0},
...                                    initializer={"kind": "zeros"})
...     client.push("emb", torch.tensor([5, 5]), torch.ones(2, 2)).wait()
...     client.pull("emb", torch.tensor([5, 6])).wait().tolist()
[[-2.0, -2.0], [0.0, 0.0]]
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from recps.errors import ConfigError, PSError
from recps.ps.node.specs import (
    DenseLayout,
    build_dense,
    build_sparse,
    parse_spec,
    spec_difference,
    spec_json,
)
from recps.ps.table import SAVE_MODES, DenseTable, SparseTable, warm_up_kernels
from recps.ps.transport import TransportServer

__all__ = ["PSServer", "TABLE_NAME_RE", "SPEC_FILE"]

logger = logging.getLogger(__name__)

TABLE_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")  # names become folder names in checkpoints
SPEC_FILE = "spec.json"  # written next to a table's shard folders by server 0
_SWEEP_S = 0.25  # how often expired push_sync steps are failed


@dataclass
class _SyncStep:
    """Contributions of the workers to one (table, step) of a synchronous push."""

    workers: int
    deadline: float
    arrived: dict[int, Future] = field(default_factory=dict)  # worker -> its deferred reply
    keys: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    dense: torch.Tensor | None = None  # running sum of dense parts


class _Table:
    """A table this server holds: its spec and its shard (None: a dense table with no parameter here)."""

    __slots__ = ("name", "spec", "json", "shard", "layout")

    def __init__(self, name: str, spec: dict, shard, layout: DenseLayout | None) -> None:
        self.name, self.spec, self.json, self.shard, self.layout = name, spec, spec_json(spec), shard, layout


def check_table_name(name: str, where: str) -> str:
    if not isinstance(name, str) or not TABLE_NAME_RE.match(name):
        raise ConfigError(f"{where}: table name {name!r}; use 1-128 letters, digits, '_', '.', '-' (it names a folder)")
    return name


class PSServer:
    """Server `index` of `num_servers`; see the module docstring for the verbs.

    Args:
        index, num_servers: this server's shard and the cluster's server count S.
        token: cluster token (None reads $RECPS_CLUSTER_TOKEN).
        bind, port: where to listen (127.0.0.1 and a free port by default); see TransportServer.
        num_threads: handler threads serving requests concurrently; 0 serves on the network
            thread (one hop less per request, requests one at a time; save, load and shrink run
            on a background thread either way).
    """

    def __init__(
        self,
        index: int = 0,
        num_servers: int = 1,
        token: str | bytes | None = None,
        bind: str = "127.0.0.1",
        port: int = 0,
        num_threads: int = 2,
    ) -> None:
        if not 0 <= index < num_servers:
            raise ConfigError(f"PSServer: index={index} is outside [0, num_servers={num_servers})")
        self.index, self.num_servers = index, num_servers
        self._transport = TransportServer(self._handle, token=token, bind=bind, port=port, num_threads=num_threads)
        self._tables: dict[str, _Table] = {}
        self._tables_lock = threading.Lock()
        self._sync: dict[tuple[str, str, int], _SyncStep] = {}
        self._sync_lock = threading.Lock()
        self.stopped = threading.Event()  # set by stop()
        self._stop_requested = threading.Event()
        self._sweeper: threading.Thread | None = None
        # Long verbs (save, load, shrink) run here, one at a time, so that they never hold a
        # handler thread (or, with num_threads=0, the network thread) while pulls wait.
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"recps-ps{index}-background")
        self._verbs = {
            "create_sparse": self._create_sparse,
            "create_dense": self._create_dense,
            "describe": self._describe,
            "pull": self._pull,
            "push": self._push,
            "push_sync": self._push_sync,
            "push_delta": self._push_delta,
            "pull_dense": self._pull_dense,
            "push_dense": self._push_dense,
            "push_dense_sync": self._push_dense_sync,
            "push_dense_delta": self._push_dense_delta,
            "save": self._in_background(self._save),
            "load": self._in_background(self._load),
            "shrink": self._in_background(self._shrink),
            "stats": self._stats,
            "tables": self._list_tables,
            "stop": self._stop_verb,
        }

    # -- life cycle ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """"tcp://host:port" clients connect to (after start())."""
        return self._transport.endpoint

    def start(self) -> "PSServer":
        warm_up_kernels()  # before the first request: loading the tables' compiled loops takes ~1 s
        self._transport.start()
        self._sweeper = threading.Thread(target=self._sweep, name=f"recps-ps{self.index}-sweeper", daemon=True)
        self._sweeper.start()
        logger.info("server %d/%d serving on %s", self.index, self.num_servers, self.endpoint)
        return self

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop serving (pending push_sync steps fail); True if every thread ended within `timeout`."""
        self._stop_requested.set()
        self.stopped.set()
        with self._sync_lock:
            pending, self._sync = list(self._sync.values()), {}
        for step in pending:
            _fail(step, PSError(f"server {self.index} stopped while a synchronous step was pending"))
        clean = self._transport.stop(timeout)
        if self._sweeper is not None:
            self._sweeper.join(timeout)
        self._background.shutdown(wait=False, cancel_futures=True)
        return clean

    def _in_background(self, verb):
        """The verb, run on the background thread: its handler returns a Future (a deferred reply)."""

        def deferred(name, tensors, meta) -> Future:
            return self._background.submit(verb, name, tensors, meta)

        return deferred

    def wait_stop_requested(self, timeout: float | None = None) -> bool:
        """Block until a client sent `stop` (or stop() ran); True if it did within `timeout`."""
        return self._stop_requested.wait(timeout)

    def __enter__(self) -> "PSServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- in-process access (tests, serving exports) ------------------------------------------

    def sparse(self, name: str) -> SparseTable:
        """This server's SparseTable shard of `name`."""
        table = self._get(name, "sparse")
        return table.shard

    def dense(self, name: str) -> DenseTable | None:
        """This server's DenseTable part of `name` (None if it holds none of its parameters)."""
        return self._get(name, "dense").shard

    # -- dispatch ------------------------------------------------------------------------------

    def _handle(self, verb: str, table: str, tensors: list, meta: dict):
        fn = self._verbs.get(verb)
        if fn is None:
            raise PSError(f"unknown verb {verb!r}; this server speaks {sorted(self._verbs)}")
        return fn(table, tensors, meta)

    def _get(self, name: str, kind: str | None = None) -> _Table:
        table = self._tables.get(name)
        if table is None:
            known = sorted(self._tables) or "none"
            raise ConfigError(f"server {self.index}: no table {name!r} (tables: {known}); create it first (create_sparse_table / create_dense_table)")
        if kind is not None and table.spec["kind"] != kind:
            raise ConfigError(f"server {self.index}: table {name!r} is {table.spec['kind']}, not {kind}")
        return table

    def _dense_shard(self, name: str, verb: str) -> tuple[_Table, DenseTable]:
        table = self._get(name, "dense")
        if table.shard is None:
            raise PSError(f"server {self.index} holds no parameter of dense table {name!r}; {verb} was sent to the wrong server")
        return table, table.shard

    # -- create / describe ---------------------------------------------------------------------

    def _register(self, name: str, spec: dict, make) -> dict:
        check_table_name(name, f"server {self.index}")
        with self._tables_lock:
            old = self._tables.get(name)
            if old is not None:
                if old.json != spec_json(spec):
                    diff = "; ".join(spec_difference(old.spec, spec))
                    raise ConfigError(
                        f"table {name!r} already exists with another spec ({diff}); use the same settings "
                        "on every worker, or another table name"
                    )
                return {"spec": old.json, "created": False}
            self._tables[name] = make()
            logger.info("server %d: created %s table %r", self.index, spec["kind"], name)
            return {"spec": self._tables[name].json, "created": True}

    def _create_sparse(self, name, tensors, meta):
        spec = parse_spec(str(meta.get("spec", "")), f"create_sparse {name!r}")
        if spec["kind"] != "sparse":
            raise ConfigError(f"create_sparse {name!r}: spec kind {spec['kind']!r}")
        return [], self._register(name, spec, lambda: _Table(name, spec, build_sparse(spec, name, self.num_servers), None))

    def _create_dense(self, name, tensors, meta):
        spec = parse_spec(str(meta.get("spec", "")), f"create_dense {name!r}")
        if spec["kind"] != "dense":
            raise ConfigError(f"create_dense {name!r}: spec kind {spec['kind']!r}")
        layout = DenseLayout(spec, self.num_servers)
        values = tensors[0].to(torch.float32) if tensors else None

        def make() -> _Table:
            return _Table(name, spec, build_dense(spec, name, self.index, self.num_servers, values), layout)

        return [], self._register(name, spec, make)

    def _describe(self, name, tensors, meta):
        return [], {"spec": self._get(name).json}

    def _list_tables(self, name, tensors, meta):
        with self._tables_lock:
            return [], {"tables": json.dumps({n: t.spec for n, t in self._tables.items()})}

    # -- sparse verbs --------------------------------------------------------------------------

    def _pull(self, name, tensors, meta):
        shard: SparseTable = self._get(name, "sparse").shard
        return [shard.pull(tensors[0], create=bool(meta.get("create", True)))]

    def _push(self, name, tensors, meta):
        shard: SparseTable = self._get(name, "sparse").shard
        shows, clicks = (tensors[2], tensors[3]) if len(tensors) == 4 else (None, None)
        shard.push(tensors[0], tensors[1], shows=shows, clicks=clicks, unique=bool(meta.get("unique")))
        return []

    def _push_delta(self, name, tensors, meta):
        shard: SparseTable = self._get(name, "sparse").shard
        shows, clicks = (tensors[2], tensors[3]) if len(tensors) == 4 else (None, None)
        shard.push_delta(tensors[0], tensors[1], shows=shows, clicks=clicks, unique=bool(meta.get("unique")))
        return []

    def _arrive(self, kind: str, name: str, meta: dict, add) -> tuple[_SyncStep, Future, bool]:
        """Record worker meta["worker"]'s contribution to (name, step) with add(step), under the
        lock; returns the step, the worker's deferred reply and whether it was the last to arrive."""
        step_id, worker, workers = int(meta["step"]), int(meta["worker"]), int(meta["workers"])
        if not 0 <= worker < workers:
            raise ConfigError(f"{kind} {name!r} step {step_id}: worker={worker} is outside [0, workers={workers})")
        key = (kind, name, step_id)
        future: Future = Future()
        with self._sync_lock:
            step = self._sync.get(key)
            if step is None:
                deadline = time.monotonic() + float(meta.get("timeout_s", 60.0))
                step = self._sync[key] = _SyncStep(workers=workers, deadline=deadline)
            if step.workers != workers:
                raise ConfigError(f"{kind} {name!r} step {step_id}: worker {worker} says workers={workers}, others said {step.workers}")
            if worker in step.arrived:
                raise ConfigError(f"{kind} {name!r} step {step_id}: worker {worker} pushed twice; each worker pushes each step once")
            add(step)
            step.arrived[worker] = future
            last = len(step.arrived) == workers
            if last:
                del self._sync[key]
        return step, future, last

    def _push_sync(self, name, tensors, meta):
        shard: SparseTable = self._get(name, "sparse").shard
        keys, grads = tensors[0], tensors[1]

        def add(step: _SyncStep) -> None:
            step.keys.append(keys)
            step.grads.append(grads)

        step, future, last = self._arrive("push_sync", name, meta, add)
        if last:
            self._apply_sync(step, lambda: _apply_sparse_sync(shard, step))
        return future

    def _push_dense_sync(self, name, tensors, meta):
        table, shard = self._dense_shard(name, "push_dense_sync")
        grads = tensors[0]

        def add(step: _SyncStep) -> None:
            step.dense = grads.clone() if step.dense is None else step.dense.add_(grads)

        step, future, last = self._arrive("push_dense_sync", name, meta, add)
        if last:
            self._apply_sync(step, lambda: _apply_dense(table, shard, step.dense.div_(step.workers), "push", self.index))
        return future

    def _apply_sync(self, step: _SyncStep, apply) -> None:
        try:
            apply()
        except Exception as e:  # noqa: BLE001 - every waiting worker gets the error
            _fail(step, e)
            return
        for f in step.arrived.values():
            f.set_result(None)

    def _sweep(self) -> None:
        """Fail synchronous steps whose deadline passed, naming the workers that never pushed."""
        while not self.stopped.wait(_SWEEP_S):
            now = time.monotonic()
            with self._sync_lock:
                expired = [(k, s) for k, s in self._sync.items() if s.deadline <= now]
                for k, _ in expired:
                    del self._sync[k]
            for (kind, name, step_id), step in expired:
                missing = sorted(set(range(step.workers)) - set(step.arrived))
                _fail(step, _Timeout(
                    f"server {self.index}: {kind} of table {name!r} step {step_id}: worker(s) {missing} did not push "
                    f"within the timeout ({len(step.arrived)} of {step.workers} arrived); is a worker dead or behind?"
                ))

    # -- dense verbs ---------------------------------------------------------------------------

    def _pull_dense(self, name, tensors, meta):
        table, shard = self._dense_shard(name, "pull_dense")
        return [_dense_flat(table, shard)]

    def _push_dense(self, name, tensors, meta):
        table, shard = self._dense_shard(name, "push_dense")
        _apply_dense(table, shard, tensors[0], "push", self.index)
        return [_dense_flat(table, shard)] if meta.get("return_values") else []

    def _push_dense_delta(self, name, tensors, meta):
        table, shard = self._dense_shard(name, "push_dense_delta")
        _apply_dense(table, shard, tensors[0], "push_delta", self.index)
        return [_dense_flat(table, shard)] if meta.get("return_values") else []

    # -- checkpoints, shrink, stats, stop ------------------------------------------------------

    def _selected(self, meta: dict) -> list[_Table]:
        names = [n for n in str(meta.get("tables", "")).split(",") if n]
        with self._tables_lock:
            if not names:
                return list(self._tables.values())
        return [self._get(n) for n in names]

    def _save(self, name, tensors, meta):
        path, mode = Path(str(meta["path"])), str(meta.get("mode", "full"))
        if mode not in SAVE_MODES:
            raise ConfigError(f"save: mode={mode!r}; use one of {SAVE_MODES}")
        result = {}
        for table in self._selected(meta):
            folder = path / table.name
            if self.index == 0:
                _write_spec(folder, table.json)
            if table.spec["kind"] == "sparse":
                man = table.shard.save(folder, mode, shard=self.index, num_shards=self.num_servers)
                result[table.name] = int(man.get("rows", 0))
            elif table.shard is not None:
                # Only servers holding parameters write: shard numbers count the owners.
                owners = sorted({o for o in table.layout.owner})
                table.shard.save(folder, mode, shard=owners.index(self.index), num_shards=len(owners))
                result[table.name] = len(table.shard)
        logger.info("server %d: saved %s (%s) to %s", self.index, sorted(result), mode, path)
        return [], {"result": json.dumps(result)}

    def _load(self, name, tensors, meta):
        path = Path(str(meta["path"]))
        names = [n for n in str(meta.get("tables", "")).split(",") if n]
        if not names:
            with self._tables_lock:
                names = sorted(self._tables)
            if not names and path.is_dir():  # a fresh cluster restores every saved table
                names = sorted(p.name for p in path.iterdir() if (p / SPEC_FILE).is_file())
        result = {}
        for n in names:
            folder = path / n
            if n not in self._tables:
                spec_file = folder / SPEC_FILE
                if not spec_file.is_file():
                    raise ConfigError(f"load: table {n!r} does not exist here and {spec_file} is missing; create the table first")
                spec = parse_spec(spec_file.read_text(), f"load {spec_file}")
                verb = self._create_sparse if spec["kind"] == "sparse" else self._create_dense
                verb(n, [], {"spec": spec_json(spec)})
            table = self._get(n)
            if table.spec["kind"] == "sparse":
                result[n] = table.shard.load(folder, shard=self.index, num_shards=self.num_servers)
            elif table.shard is not None:
                result[n] = table.shard.load(folder)
        logger.info("server %d: loaded %s from %s", self.index, sorted(result), path)
        return [], {"result": json.dumps(result)}

    def _shrink(self, name, tensors, meta):
        deleted = 0
        explicit = bool(meta.get("tables"))
        for table in self._selected(meta):
            if table.spec["kind"] == "sparse" and (explicit or table.shard.accessor is not None):
                deleted += table.shard.shrink()
        return [], {"deleted": deleted}

    def _stats(self, name, tensors, meta):
        with self._tables_lock:
            tables = list(self._tables.values())
        stats = {}
        for t in tables:
            if t.spec["kind"] == "sparse":
                stats[t.name] = {"kind": "sparse", "rows": len(t.shard), "memory_bytes": t.shard.memory_bytes()}
            else:
                n = t.layout.server_sizes[self.index]
                stats[t.name] = {"kind": "dense", "rows": n, "memory_bytes": n * 4 * 2}  # values and ~state
        with self._sync_lock:
            pending = len(self._sync)
        return [], {"stats": json.dumps({"server": self.index, "tables": stats, "pending_sync_steps": pending})}

    def _stop_verb(self, name, tensors, meta):
        logger.info("server %d: stop requested by a client", self.index)
        self._stop_requested.set()
        return []


class _Timeout(Exception):
    """A synchronous step expired: answered as meta {"error": "timeout"}, raised by the client as
    PSTimeoutError (an exception crossing the transport would arrive as a plain PSError)."""


def _fail(step: _SyncStep, error: Exception) -> None:
    for f in step.arrived.values():
        if f.done():
            continue
        if isinstance(error, _Timeout):
            f.set_result(([], {"error": "timeout", "message": str(error)}))
        else:
            f.set_exception(error)


@torch.no_grad()
def _apply_sparse_sync(shard: SparseTable, step: _SyncStep) -> None:
    keys = torch.cat(step.keys) if len(step.keys) > 1 else step.keys[0]  # (sum K,)
    grads = torch.cat(step.grads) if len(step.grads) > 1 else step.grads[0]  # (sum K, D)
    if keys.numel():
        # Keys pushed by several workers are summed by the table: / W makes it the mean.
        shard.push(keys, grads / step.workers if step.workers > 1 else grads)


def _dense_parts(table: _Table, flat: torch.Tensor, server: int) -> dict[str, torch.Tensor]:
    layout = table.layout
    if flat.numel() != layout.server_sizes[server]:
        raise ConfigError(
            f"dense table {table.name!r}: got {flat.numel()} values for server {server}, which holds "
            f"{layout.server_sizes[server]}; client and server disagree on the table's parameters"
        )
    parts, pos = {}, 0
    for i in layout.params_of(server):
        n = layout.sizes[i]
        parts[layout.names[i]] = flat[pos : pos + n].view(layout.shapes[i])
        pos += n
    return parts


def _apply_dense(table: _Table, shard: DenseTable, flat: torch.Tensor, verb: str, server: int) -> None:
    getattr(shard, verb)(_dense_parts(table, flat, server))


def _dense_flat(table: _Table, shard: DenseTable) -> torch.Tensor:
    return shard.flat()  # (N_s,)


def _write_spec(folder: Path, text: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{SPEC_FILE}.{os.getpid()}.{threading.get_ident()}"
    tmp.write_text(text)
    os.replace(tmp, folder / SPEC_FILE)
