"""PSServer: one parameter-server process's shards of every table, served over the transport.

Shape letters: K keys in a request, D row width, N_s the flat size of this server's part of a
dense table.

Server `index` of S holds, for each sparse table, the rows of the keys with
`partition(key, S) == index` (the client routes them; the same function re-shards checkpoints),
and for each dense table the parameters `DenseLayout` gives it (whole parameters, by name).

The server hosts tables and serves verbs; it holds no consistency policy. What a push does is
the table's mode's: each table's spec names its mode ("sync", "async", "geo"), and the server
hands the table's pushes to that mode's server half (`ServerHalf`, one per mode per server, made
by the factories the server was given: `recps.ps.modes.server_halves()`), as ps-lite's servers
call their request handle.

Verbs (request fields -> reply tensors; `table` is the transport's text field):

    create_sparse   meta spec (JSON)                 -> meta spec       idempotent; another spec: error
    create_dense    meta spec, {values (N_s,)}?      -> meta spec       idempotent; first values win
    describe                                         -> meta spec
    pull            {keys (K,)}, meta create?        -> [rows (K, D)]   rows created on first pull
    pull_statistics {keys (K,)}                      -> [(K, 2) show, click]   the accessor's; 0 without a row
    push            {keys, rows (K, D), shows?, clicks?}, meta ...      the table's mode's server half
    pull_dense                                       -> [values (N_s,)]
    push_dense      {values (N_s,)}, meta ...        -> the mode's reply (e.g. [values])
    save            meta path, mode, tables          -> meta result (JSON)  path/<table>/shard-i-of-S/
    load            meta path, tables                -> meta result (JSON)
                    (path must lie under one of the server's storage roots, when it has them)
    shrink          meta tables                      -> meta deleted
    stats                                            -> meta stats (JSON)
    tables                                           -> meta tables (JSON name -> spec)
    stop                                             the reply leaves, then `stopped` is set

Storage roots: a save or load path comes from a message, so a server given storage roots
(`storage_roots=`, else $RECPS_STORAGE_ROOTS: comma-separated paths or URLs) refuses, with
ConfigError, any path that is not under one of them after normalization (".." resolved; local
paths through symlinks as well). Without roots the paths are not confined and the first save or
load logs a warning saying so.

Concurrency: requests are served by `num_threads` handler threads; each table is thread-safe on
its own (see recps.ps.table), so pulls and pushes of different threads and workers interleave.
A server half may defer its reply (return a Future): the handler thread is free meanwhile.
Save, load and shrink run one at a time on a background thread; a save writes its tables at once
on the server's SAVE_THREADS save threads, the same threads for every save.

>>> import torch
>>> from recps.ps.modes import server_halves
>>> from recps.ps.node.client import PSClient
>>> with PSServer(token="t", halves=server_halves()) as server, PSClient([server.endpoint], token="t") as client:
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
import posixpath
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Protocol

import torch

from recps import fs as rfs
from recps.errors import ConfigError, PSError
from recps.ps.node.specs import (
    DenseLayout,
    build_dense,
    build_sparse,
    check_table_name,
    parse_spec,
    spec_difference,
    spec_json,
)
from recps.ps.table import SAVE_MODES, DenseTable, SparseTable, warm_up_kernels
from recps.ps.table.checkpoint import SPEC_FILE, read_spec, saved_tables
from recps.ps.transport import TransportServer

__all__ = ["PSServer", "HostedTable", "ServerHalf", "ServerHalfFactory", "SPEC_FILE", "STORAGE_ROOTS_ENV",
           "storage_roots_from_env", "check_storage_path"]

logger = logging.getLogger(__name__)

# SPEC_FILE (recps.ps.table.checkpoint): spec.json, written next to a table's shard folders by server 0
SAVE_RETRIES = 3  # more attempts of a table's save that failed transiently (recps.fs.retry_transient)
SAVE_THREADS = 16  # tables a save writes at once (on HDFS each table's commit is a fixed wait)
STORAGE_ROOTS_ENV = "RECPS_STORAGE_ROOTS"


def storage_roots_from_env(environ: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The roots in $RECPS_STORAGE_ROOTS (comma-separated paths or URLs), or None when it is unset."""
    text = (os.environ if environ is None else environ).get(STORAGE_ROOTS_ENV)
    if text is None or not text.strip():
        return None
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _location(path: str) -> tuple[str, str]:
    """(scheme://authority, normalized absolute path) of a local path or an fsspec URL."""
    scheme, sep, rest = str(path).partition("://")
    if not sep or scheme == "file":
        return "file://", os.path.realpath(rest if sep else path)  # symlinks and ".." resolved
    authority, _, tail = rest.partition("/")
    return f"{scheme}://{authority}", posixpath.normpath("/" + tail)


def check_storage_path(path: str, roots: Sequence[str], what: str) -> None:
    """Raise ConfigError unless `path` lies under one of `roots` (see the module docstring).

    >>> check_storage_path("/data/run/ckpt/../ckpt2", ["/data/run"], "save")
    >>> check_storage_path("hdfs://nn:9000/runs/a/../../etc", ["hdfs://nn:9000/runs"], "save")
    Traceback (most recent call last):
    ...
    recps.errors.ConfigError: save: path 'hdfs://nn:9000/runs/a/../../etc' (hdfs://nn:9000/etc) is outside the storage roots ['hdfs://nn:9000/runs']; write under one of them, or add the folder to $RECPS_STORAGE_ROOTS (PSServer storage_roots=) on every server
    """
    where, target = _location(path)
    for root in roots:
        root_where, root_path = _location(root)
        if where == root_where and (target == root_path or target.startswith(root_path.rstrip("/") + "/")):
            return
    shown = target if where == "file://" else f"{where}{target}"
    raise ConfigError(f"{what}: path {str(path)!r} ({shown}) is outside the storage roots {list(roots)}; write under one "
                      f"of them, or add the folder to ${STORAGE_ROOTS_ENV} (PSServer storage_roots=) on every server")


class HostedTable:
    """A table this server holds: its spec and its shard (None: a dense table with no parameter
    here), and the server half of its mode. What a server half works on."""

    __slots__ = ("name", "spec", "json", "shard", "layout", "half", "server")

    def __init__(self, name: str, spec: dict, shard, layout: DenseLayout | None, half: "ServerHalf", server: int) -> None:
        self.name, self.spec, self.json, self.shard, self.layout = name, spec, spec_json(spec), shard, layout
        self.half, self.server = half, server

    @property
    def mode(self) -> str:
        return self.spec["mode"]

    def dense_shard(self, verb: str) -> DenseTable:
        if self.spec["kind"] != "dense":
            raise ConfigError(f"server {self.server}: table {self.name!r} is sparse; {verb} takes dense tables")
        if self.shard is None:
            raise PSError(f"server {self.server} holds no parameter of dense table {self.name!r}; {verb} was sent to the wrong server")
        return self.shard

    def sparse_shard(self, verb: str) -> SparseTable:
        if self.spec["kind"] != "sparse":
            raise ConfigError(f"server {self.server}: table {self.name!r} is dense; {verb} takes sparse tables")
        return self.shard

    def dense_parts(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """This server's (N_s,) flat part -> name -> view with the parameter's shape."""
        layout = self.layout
        if flat.numel() != layout.server_sizes[self.server]:
            raise ConfigError(
                f"dense table {self.name!r}: got {flat.numel()} values for server {self.server}, which holds "
                f"{layout.server_sizes[self.server]}; client and server disagree on the table's parameters"
            )
        parts, pos = {}, 0
        for i in layout.params_of(self.server):
            n = layout.sizes[i]
            parts[layout.names[i]] = flat[pos : pos + n].view(layout.shapes[i])
            pos += n
        return parts


class ServerHalf(Protocol):
    """A PS mode's server half (recps.ps.modes): what the pushes to its tables do on this server.

    Each method returns the reply (a list of tensors, (tensors, meta), or a Future of one: a
    deferred reply). `fields` are the request's named tensors (see the verbs above).
    """

    def push(self, table: HostedTable, fields: Mapping, meta: Mapping): ...

    def push_dense(self, table: HostedTable, fields: Mapping, meta: Mapping): ...

    def pending(self) -> int:
        """Requests it holds unanswered (stats)."""

    def close(self) -> None:
        """The server stops: answer what is held with an error, end its threads."""


ServerHalfFactory = Callable[[int], ServerHalf]  # server index -> the mode's half on that server


class PSServer:
    """Server `index` of `num_servers`; see the module docstring for the verbs.

    Args:
        index, num_servers: this server's shard and the cluster's server count S.
        token: cluster token (None reads $RECPS_CLUSTER_TOKEN).
        bind, port: where to listen (127.0.0.1 and a free port by default); see TransportServer.
        num_threads: handler threads serving requests concurrently; 0 serves on the network
            thread (one hop less per request, requests one at a time; save, load and shrink run
            on a background thread either way).
        halves: mode name -> factory of its server half (`recps.ps.modes.server_halves()`); a
            table of a mode not given here is refused at creation.
        storage_roots: the folders (paths or URLs) save and load may use; None reads
            $RECPS_STORAGE_ROOTS, and without it paths are not confined (see the module docstring).
    """

    def __init__(
        self,
        index: int = 0,
        num_servers: int = 1,
        token: str | bytes | None = None,
        bind: str = "127.0.0.1",
        port: int = 0,
        num_threads: int = 2,
        halves: Mapping[str, ServerHalfFactory] | None = None,
        storage_roots: Sequence[str] | None = None,
    ) -> None:
        if not 0 <= index < num_servers:
            raise ConfigError(f"PSServer: index={index} is outside [0, num_servers={num_servers})")
        if isinstance(storage_roots, str):
            raise ConfigError(f"PSServer: storage_roots={storage_roots!r} is one string; give a list of folders")
        self.index, self.num_servers = index, num_servers
        self.storage_roots = tuple(storage_roots) if storage_roots is not None else storage_roots_from_env()
        self._unconfined_warned = False
        self._transport = TransportServer(self._handle, token=token, bind=bind, port=port, num_threads=num_threads)
        self._tables: dict[str, HostedTable] = {}
        self._tables_lock = threading.Lock()
        self._factories = dict(halves or {})
        self._halves: dict[str, ServerHalf] = {}  # made on the first table of each mode
        self.stopped = threading.Event()  # set by stop()
        self._stop_requested = threading.Event()
        self.stop_verb_received = False  # a client sent `stop` (the job's normal end)
        # Long verbs (save, load, shrink) run here, one at a time, so that they never hold a
        # handler thread (or, with num_threads=0, the network thread) while pulls wait.
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"recps-ps{index}-background")
        # A save's tables are written by these threads, the same ones every save. A fresh thread per
        # table per save (rfs.concurrently) let glibc's malloc hand each one whichever of its up to
        # 8 x cores arenas was free, so every save left its row copies' freed memory resident in other
        # arenas: RSS rose with each save (see tests/ps/node/test_save_memory.py).
        self._save_pool = ThreadPoolExecutor(max_workers=SAVE_THREADS, thread_name_prefix=f"recps-ps{index}-save")
        self._verbs = {
            "create_sparse": self._create_sparse,
            "create_dense": self._create_dense,
            "describe": self._describe,
            "pull": self._pull,
            "pull_statistics": self._pull_statistics,
            "push": self._push,
            "pull_dense": self._pull_dense,
            "push_dense": self._push_dense,
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

    @property
    def rejections(self) -> dict[str, int]:
        """Messages and connections the transport refused, by reason (TransportServer.rejections)."""
        return self._transport.rejections

    @property
    def resends(self) -> int:
        """Requests that arrived again and were answered with their first reply (TransportServer.resends)."""
        return self._transport.resends

    def start(self) -> "PSServer":
        warm_up_kernels()  # before the first request: loading the tables' compiled loops takes ~1 s
        self._transport.start()
        logger.info("server %d/%d serving on %s", self.index, self.num_servers, self.endpoint)
        return self

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop serving (the modes' halves answer what they hold with an error); True if every
        thread ended within `timeout`."""
        self._stop_requested.set()
        self.stopped.set()
        with self._tables_lock:
            halves = list(self._halves.values())
        for half in halves:
            half.close()
        clean = self._transport.stop(timeout)
        self._background.shutdown(wait=False, cancel_futures=True)
        self._save_pool.shutdown(wait=False, cancel_futures=True)
        with self._tables_lock:
            sparse = [t.shard for t in self._tables.values() if t.spec["kind"] == "sparse"]
        for shard in sparse:
            shard.close()  # a disk tier's store and folder go with the server
        return clean

    def _in_background(self, verb):
        """The verb, run on the background thread: its handler returns a Future (a deferred reply)."""

        def deferred(name, fields, meta) -> Future:
            return self._background.submit(verb, name, fields, meta)

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

    def _handle(self, verb: str, table: str, fields: dict, meta: dict):
        fn = self._verbs.get(verb)
        if fn is None:
            raise PSError(f"unknown verb {verb!r}; this server speaks {sorted(self._verbs)}")
        return fn(table, fields, meta)

    def _get(self, name: str, kind: str | None = None) -> HostedTable:
        table = self._tables.get(name)
        if table is None:
            known = sorted(self._tables) or "none"
            raise ConfigError(f"server {self.index}: no table {name!r} (tables: {known}); create it first (create_sparse_table / create_dense_table)")
        if kind is not None and table.spec["kind"] != kind:
            raise ConfigError(f"server {self.index}: table {name!r} is {table.spec['kind']}, not {kind}")
        return table

    def _half(self, mode: str, name: str) -> ServerHalf:
        """The server half of `mode` (made once per server, under the tables lock)."""
        half = self._halves.get(mode)
        if half is None:
            factory = self._factories.get(mode)
            if factory is None:
                raise ConfigError(f"server {self.index}: table {name!r} is trained by mode {mode!r}, and this server "
                                  f"knows the modes {sorted(self._factories) or 'none'}; start it with "
                                  "halves=recps.ps.modes.server_halves() (Fleet.init_server does)")
            half = self._halves[mode] = factory(self.index)
        return half

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
            self._tables[name] = make(self._half(spec["mode"], name))
            # The engine's exchange buffers ("recps.metrics.header.w1.b0": a metrics merge's, a stream's
            # evaluation's, made as the passes need them) at DEBUG; the model's tables at INFO.
            logger.log(logging.DEBUG if name.startswith("recps.") else logging.INFO, "server %d: created %s table %r (%s)",
                       self.index, spec["kind"], name, spec["mode"])
            return {"spec": self._tables[name].json, "created": True}

    def _create_sparse(self, name, fields, meta):
        spec = parse_spec(str(meta.get("spec", "")), f"create_sparse {name!r}")
        if spec["kind"] != "sparse":
            raise ConfigError(f"create_sparse {name!r}: spec kind {spec['kind']!r}")
        return [], self._register(name, spec, lambda half: HostedTable(
            name, spec, build_sparse(spec, name, self.num_servers), None, half, self.index))

    def _create_dense(self, name, fields, meta):
        spec = parse_spec(str(meta.get("spec", "")), f"create_dense {name!r}")
        if spec["kind"] != "dense":
            raise ConfigError(f"create_dense {name!r}: spec kind {spec['kind']!r}")
        layout = DenseLayout(spec, self.num_servers)
        values = fields["values"].to(torch.float32) if "values" in fields else None

        def make(half) -> HostedTable:
            shard = build_dense(spec, name, self.index, self.num_servers, values)
            return HostedTable(name, spec, shard, layout, half, self.index)

        return [], self._register(name, spec, make)

    def _describe(self, name, fields, meta):
        return [], {"spec": self._get(name).json}

    def _list_tables(self, name, fields, meta):
        with self._tables_lock:
            return [], {"tables": json.dumps({n: t.spec for n, t in self._tables.items()})}

    # -- data verbs: pulls read the shard, pushes go to the table's mode ----------------------

    def _pull(self, name, fields, meta):
        shard = self._get(name).sparse_shard("pull")
        return [shard.pull(fields["keys"], create=bool(meta.get("create", True)))]

    def _pull_statistics(self, name, fields, meta):
        shard = self._get(name).sparse_shard("pull_statistics")
        if shard.accessor is None:
            raise ConfigError(f"server {self.index}: table {name!r} keeps no show/click statistics (no accessor); "
                              "create it with an accessor (ps.table.accessor) to read them")
        stats = shard.stats(fields["keys"])
        return [torch.stack([stats["show"], stats["click"]], 1)]  # (K, 2), zeros for keys without a row

    def _push(self, name, fields, meta):
        table = self._get(name)
        table.sparse_shard("push")
        return table.half.push(table, fields, meta)

    def _pull_dense(self, name, fields, meta):
        return [self._get(name).dense_shard("pull_dense").flat()]

    def _push_dense(self, name, fields, meta):
        table = self._get(name)
        table.dense_shard("push_dense")
        return table.half.push_dense(table, fields, meta)

    # -- checkpoints, shrink, stats, stop ------------------------------------------------------

    def _selected(self, meta: dict) -> list[HostedTable]:
        names = [n for n in str(meta.get("tables", "")).split(",") if n]
        with self._tables_lock:
            if not names:
                return list(self._tables.values())
        return [self._get(n) for n in names]

    def _confine(self, path: str, verb: str) -> None:
        """Refuse a path from a message outside the storage roots (see the module docstring)."""
        if self.storage_roots is not None:
            check_storage_path(path, self.storage_roots, f"server {self.index}: {verb}")
        elif not self._unconfined_warned:
            self._unconfined_warned = True
            logger.warning("server %d: %s to %s is not confined: no storage roots (set $%s or PSServer storage_roots=), "
                           "so a client may have this server write or read wherever it can", self.index, verb, path,
                           STORAGE_ROOTS_ENV)

    def _save(self, name, fields, meta):
        path, mode = str(meta["path"]), str(meta.get("mode", "full"))
        if mode not in SAVE_MODES:
            raise ConfigError(f"save: mode={mode!r}; use one of {SAVE_MODES}")
        self._confine(path, "save")
        if self.index == 0:  # the checkpoint's own folder; each table's folder is swept by its writers
            rfs.sweep_temporaries(path)
        calls, names = [], []
        for table in self._selected(meta):
            folder = rfs.join(path, table.name)
            if self.index == 0:
                calls.append(lambda f=folder, t=table: rfs.write_atomic(rfs.join(f, SPEC_FILE), t.json, overwrite=True))
                names.append(None)
            if table.spec["kind"] == "sparse":
                calls.append(lambda f=folder, t=table: int(
                    t.shard.save(f, mode, shard=self.index, num_shards=self.num_servers).get("rows", 0)))
                names.append(table.name)
            elif table.shard is not None:
                # Only servers holding parameters write: shard numbers count the owners.
                owners = sorted({o for o in table.layout.owner})

                def dense(f=folder, t=table, shard=owners.index(self.index), n=len(owners)) -> int:
                    t.shard.save(f, mode, shard=shard, num_shards=n)
                    return len(t.shard)

                calls.append(dense)
                names.append(table.name)
        # Tables are written at once, on the server's save threads: on HDFS each file's close is a
        # fixed wait. A save that failed transiently (HDFS: NotReplicatedYet, a DataNode slow to
        # report a block) left nothing behind and changed nothing (SparseTable.save resets delta
        # scores and counts unseen days only after its commit): it is done again, a bounded number
        # of times, and writes the same rows. Every table's write ends (each request of a file
        # system from rfs.resolve is bounded by its timeout) before the first error, in table
        # order, is raised: no write is left running behind a failed save.
        what = f"server {self.index}: save to {path}"
        futures = [self._save_pool.submit(rfs.retry_transient, c, what, SAVE_RETRIES) for c in calls]
        wait(futures)
        for future in futures:
            if (error := future.exception()) is not None:
                raise error
        result = {n: f.result() for n, f in zip(names, futures) if n is not None}
        logger.info("server %d: saved %s (%s) to %s", self.index, sorted(result), mode, path)
        return [], {"result": json.dumps(result)}

    def _load(self, name, fields, meta):
        path = str(meta["path"])
        self._confine(path, "load")
        if self.index == 0:
            rfs.sweep_temporaries(path)
        names = [n for n in str(meta.get("tables", "")).split(",") if n]
        if not names:
            with self._tables_lock:
                names = sorted(self._tables)
            if not names:  # a fresh cluster restores every saved table: each with its spec, or an error naming it
                names = saved_tables(path)
        result = {}
        for n in names:
            folder = rfs.join(path, n)
            if n not in self._tables:
                spec = parse_spec(read_spec(folder), f"load {rfs.join(folder, SPEC_FILE)}")
                verb = self._create_sparse if spec["kind"] == "sparse" else self._create_dense
                verb(n, {}, {"spec": spec_json(spec)})
            table = self._get(n)
            if table.spec["kind"] == "sparse":
                result[n] = table.shard.load(folder, shard=self.index, num_shards=self.num_servers)
            elif table.shard is not None:
                result[n] = table.shard.load(folder)
        logger.info("server %d: loaded %s from %s", self.index, sorted(result), path)
        return [], {"result": json.dumps(result)}

    def _shrink(self, name, fields, meta):
        deleted = 0
        explicit = bool(meta.get("tables"))
        for table in self._selected(meta):
            if table.spec["kind"] == "sparse" and (explicit or table.shard.accessor is not None):
                deleted += table.shard.shrink()
        return [], {"deleted": deleted}

    def _stats(self, name, fields, meta):
        with self._tables_lock:
            tables = list(self._tables.values())
        stats = {}
        for t in tables:
            if t.spec["kind"] == "sparse":
                stats[t.name] = {"kind": "sparse", "rows": len(t.shard), "memory_bytes": t.shard.memory_bytes()}
                tier = t.shard.tier_stats()
                if tier is not None:  # a table with a disk tier: rows per tier, hit rate, promotions, evictions, bytes
                    stats[t.name]["tier"] = tier
            else:
                n = t.layout.server_sizes[self.index]
                stats[t.name] = {"kind": "dense", "rows": n, "memory_bytes": n * 4 * 2}  # values and ~state
        with self._tables_lock:
            pending = {mode: half.pending() for mode, half in self._halves.items()}
        return [], {"stats": json.dumps({"server": self.index, "tables": stats, "pending": pending,
                                         "rejected": self.rejections,
                                         "handler_errors": self._transport.handler_errors,
                                         "resends": self._transport.resends})}

    def _stop_verb(self, name, fields, meta):
        logger.info("server %d: stop requested by a client", self.index)
        self.stop_verb_received = True
        self._stop_requested.set()
        return []
