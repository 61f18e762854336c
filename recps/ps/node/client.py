"""PSClient: a worker's view of the S servers (partition, de-duplicate, fan out, reassemble).

Shape letters: K keys in a call, U unique keys, D row width, N flat size of a dense table.

Contract of every data verb (ps-lite style):
- it returns a `PSHandle` at once, the requests to all servers already sent; `wait(timeout)`
  blocks until every server answered and returns the result (pull: (K, D) float32 rows in the
  caller's key order; pull_dense: (N,) float32; pushes: None), or raises PSTimeoutError naming
  the server endpoint, the verb, the table and the key count, or PSError (server-side error).
- keys are routed with `recps.ps.table.partition(key, S)`, the function the tables re-shard
  checkpoints with. Duplicate keys never leave the worker: a pull asks each unique key once
  and copies rows back to every occurrence; a push sums the gradients of duplicate keys first.
  `assume_unique=True` skips that work when the caller guarantees unique keys.
- liveness: with a coordinator (`connect`), a server declared dead, the coordinator lost or
  any other peer dead (the job cannot finish) fails every call in flight at once, and every
  later one, with the PSError that names it ("server0 at tcp://...: no heartbeat for 10.2 s"),
  instead of each waiting out its timeout; `failure` holds that error.
- the client is thread-safe and meant to be shared by a worker's training threads (each thread
  gets its own sockets from the transport).
- tensors passed to a push must not be modified until its handle's wait() returned.

What a push does is the table's mode's (recps.ps.modes): the server hands it to the server half
of the mode the table was created with (`mode=`), with the push's `meta`; a mode whose server
half waits for every worker (sync) sends its pushes to every server (`every_server=True`), with
zero keys where a server has none.

>>> import torch
>>> from recps.ps.modes import server_halves
>>> from recps.ps.node.server import PSServer
>>> with PSServer(0, 2, token="t", halves=server_halves()) as s0, PSServer(1, 2, token="t", halves=server_halves()) as s1, \\
...         PSClient([s0.endpoint, s1.endpoint], token="t") as client:
...     _ = client.create_sparse_table("emb", dim=1, optimizer={"name": "sgd", "lr": 1.0},
...                                    initializer={"kind": "zeros"})
...     client.push("emb", torch.tensor([1, 2, 3, 1]), torch.ones(4, 1)).wait()
...     client.pull("emb", torch.tensor([3, 1, 2, 1])).wait().squeeze(1).tolist()
[-1.0, -2.0, -1.0, -2.0]
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar

import torch

from recps.errors import ConfigError, PSError, PSTimeoutError
from recps.ps.node.coordinator import CoordinatorClient
from recps.ps.node.specs import DEFAULT_MODE, DenseLayout, check_table_name, dense_spec, parse_spec, sparse_spec, spec_json
from recps.ps.table import SAVE_MODES, as_keys, partition, unique_keys
from recps.ps.table.tier import merge_tier_stats
from recps.ps.transport import Handle, Reply, TransportClient

__all__ = ["PSClient", "PSHandle", "unique_inverse"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Sent with every push: its keys are distinct (summed above), so a server may update each row
# in one compiled pass (SparseTable.push(unique=True)).
_UNIQUE = {"unique": True}


def unique_inverse(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(K,) int64 -> (U,) unique keys and (K,) inverse (uniq[inverse] == keys), or (keys, None)
    when the keys are already unique (nothing to gather back)."""
    if keys.numel() < 2:
        return keys, None
    uniq, inverse = unique_keys(keys)
    if uniq.numel() == keys.numel():
        return keys, None
    return uniq, inverse


class PSHandle(Generic[T]):
    """Requests in flight to several servers; `wait(timeout)` returns the assembled result.

    The result is computed once; later waits return it again (or raise the same error).
    """

    __slots__ = ("_handles", "_finish", "_timeout_s", "_done", "_result", "_error", "_lock")

    def __init__(self, handles: Sequence[Handle], finish: Callable[[list[Reply]], T], timeout_s: float) -> None:
        self._handles = list(handles)
        self._finish = finish
        self._timeout_s = timeout_s
        self._done = False
        self._result: T | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Whether wait() would return without blocking."""
        return self._done or all(h.done() for h in self._handles)

    def wait(self, timeout: float | None = None) -> T:
        """The result within `timeout` seconds (default: the client's timeout_s) for all servers together."""
        with self._lock:
            if not self._done:
                deadline = time.monotonic() + (self._timeout_s if timeout is None else timeout)
                try:
                    replies = [h.wait(max(0.0, deadline - time.monotonic())) for h in self._handles]
                    _raise_reply_errors(self._handles, replies)
                    self._result = self._finish(replies)
                except BaseException as e:
                    self._error = e
                self._done = True
                self._handles = []
            if self._error is not None:
                raise self._error
            return self._result  # type: ignore[return-value]


def _raise_reply_errors(handles: Sequence[Handle], replies: Sequence[Reply]) -> None:
    """A server answers an expected failure (a synchronous step that timed out) in meta."""
    for h, r in zip(handles, replies):
        error = r.meta.get("error")
        if error:
            cls = PSTimeoutError if error == "timeout" else PSError
            raise cls(f"server {h.endpoint}: {r.meta.get('message', error)}")


def _done(result: T = None) -> PSHandle[T]:
    return PSHandle([], lambda replies: result, 0.0)


def _rows(x: torch.Tensor, k: int, d: int, what: str, where: str) -> torch.Tensor:
    x = torch.as_tensor(x).detach()
    if x.shape != (k, d):
        raise ConfigError(f"{where}: {what} have shape {tuple(x.shape)}, expected ({k}, {d}) for {k} keys of dim {d}")
    return x.to(torch.float32).contiguous()


class _Sparse:
    __slots__ = ("dim", "spec")

    def __init__(self, spec: dict) -> None:
        self.spec, self.dim = spec, int(spec["dim"])


class _Dense:
    __slots__ = ("layout", "spec", "servers")

    def __init__(self, spec: dict, num_servers: int) -> None:
        self.spec, self.layout = spec, DenseLayout(spec, num_servers)
        self.servers = [s for s in range(num_servers) if self.layout.server_sizes[s]]


class PSClient:
    """One worker's client of the S servers at `endpoints`; see the module docstring.

    Args:
        endpoints: the servers' ZeroMQ endpoints, server i at position i.
        token: cluster token (None reads $RECPS_CLUSTER_TOKEN).
        timeout_s: default timeout of every wait.
        coordinator: a registered CoordinatorClient (barriers need one); closed with the client.
        worker_index, num_workers: this worker's place; synchronous pushes carry them.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        token: str | bytes | None = None,
        timeout_s: float = 30.0,
        coordinator: CoordinatorClient | None = None,
        worker_index: int = 0,
        num_workers: int = 1,
    ) -> None:
        if not 0 <= worker_index < num_workers:
            raise ConfigError(f"PSClient: worker_index={worker_index} is outside [0, num_workers={num_workers})")
        self.endpoints = list(endpoints)
        self.num_servers = len(self.endpoints)
        self.timeout_s = float(timeout_s)
        self.worker_index, self.num_workers = worker_index, num_workers
        self.coordinator = coordinator
        self._transport = TransportClient(self.endpoints, token=token, timeout_s=self.timeout_s)
        self._tables: dict[str, _Sparse | _Dense] = {}
        self._tables_lock = threading.Lock()
        self._closed = False
        if coordinator is not None:
            coordinator.on_failure(self._peer_failed)

    def _peer_failed(self, names: tuple[str, ...], error: PSError) -> None:
        """The coordinator link's failure (a dead peer, or the coordinator itself): fail every server's calls."""
        for s in range(self.num_servers):
            self._transport.fail_server(s, error)

    @property
    def failure(self) -> PSError | None:
        """Why this worker cannot go on (a dead server or worker, the coordinator lost), or None."""
        return self.coordinator.failure if self.coordinator is not None else None

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Deregister from the coordinator and close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.coordinator is not None:
            self.coordinator.deregister()
            self.coordinator.close()
        self._transport.close()

    @property
    def dead_peers(self) -> tuple[str, ...]:
        """Peers ("server1", "worker0") the coordinator declared dead, as of the last heartbeat."""
        return self.coordinator.dead_peers if self.coordinator is not None else ()

    # -- table metadata ------------------------------------------------------------------------

    def _request_all(self, verb: str, table: str = "", meta: dict | None = None, servers=None, once: bool = True) -> list[Handle]:
        servers = range(self.num_servers) if servers is None else servers
        return [self._transport.request(s, verb, table, meta=meta, once=once) for s in servers]

    def _wait_all(self, handles: list[Handle], timeout: float | None) -> list[Reply]:
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        return [h.wait(max(0.0, deadline - time.monotonic())) for h in handles]

    def _remember(self, name: str, spec: dict) -> _Sparse | _Dense:
        info = _Sparse(spec) if spec["kind"] == "sparse" else _Dense(spec, self.num_servers)
        with self._tables_lock:
            self._tables[name] = info
        return info

    def _info(self, name: str, kind: str) -> _Sparse | _Dense:
        info = self._tables.get(name)
        if info is None:  # created by another worker: ask server 0 once
            reply = self._transport.call(0, "describe", name, once=False)
            info = self._remember(name, parse_spec(str(reply.meta["spec"]), f"describe {name!r}"))
        if info.spec["kind"] != kind:
            raise ConfigError(f"table {name!r} is {info.spec['kind']}; use the {info.spec['kind']} verbs (pull/push vs pull_dense/push_dense)")
        return info

    def create_sparse_table(
        self,
        name: str,
        dim: int,
        optimizer: Mapping | None = None,
        initializer: Mapping | None = None,
        accessor: Mapping | None = None,
        entry: Mapping | None = None,
        dtype: str = "float32",
        seed: int = 0,
        capacity: int = 0,
        mode: str = DEFAULT_MODE,
        timeout: float | None = None,
        memory_budget: int | None = None,
    ) -> dict:
        """Create sparse table `name`, trained by PS mode `mode`, on every server (idempotent: the same spec is fine, another
        spec raises ConfigError naming the differences). Returns the canonical spec.

        optimizer: {"name": "sgd"|"adagrad"|"rowwise_adagrad"|"adam", "lr": ..., ...} (default SGD lr 0.01);
        initializer: {"kind": "uniform"|"normal"|"zeros", ...}; accessor: CtrAccessor fields or None;
        entry: {"name": "count_filter", "count": n} | {"name": "probability", "probability": p} | None;
        capacity: expected rows over all servers; memory_budget: rows each server keeps in memory, the
        rest on its disk tier (None: all in memory; see recps.ps.table.sparse, "Two tiers").
        """
        check_table_name(name, "create_sparse_table")
        spec = sparse_spec(dim, optimizer, initializer, accessor, entry, dtype, seed, capacity, mode, where=f"sparse table {name!r}",
                           memory_budget=memory_budget)
        self._wait_all(self._request_all("create_sparse", name, {"spec": spec_json(spec)}), timeout)
        self._remember(name, spec)
        return spec

    def create_dense_table(
        self,
        name: str,
        params: int | Mapping[str, Sequence[int] | torch.Size | torch.Tensor],
        optimizer: Mapping | None = None,
        mode: str = DEFAULT_MODE,
        timeout: float | None = None,
    ) -> dict:
        """Create dense table `name`, trained by PS mode `mode`: `params` is a flat size N, or an ordered dict name -> shape,
        or name -> tensor (its values initialize the table; shapes alone start at zeros).
        Idempotent as create_sparse_table (the first creator's values win). Returns the spec."""
        check_table_name(name, "create_dense_table")
        spec = dense_spec(params, optimizer, mode, where=f"dense table {name!r}")
        info = _Dense(spec, self.num_servers)
        meta = {"spec": spec_json(spec)}
        handles = []
        if isinstance(params, Mapping) and all(isinstance(v, torch.Tensor) for v in params.values()):
            parts = info.layout.split(info.layout.flatten(params))
            for s in range(self.num_servers):
                fields = {"values": parts[s].contiguous()} if parts[s] is not None else {}
                handles.append(self._transport.request(s, "create_dense", name, fields, meta))
        else:
            handles = self._request_all("create_dense", name, meta)
        self._wait_all(handles, timeout)
        with self._tables_lock:
            self._tables[name] = info
        return spec

    def table_spec(self, name: str) -> dict:
        """The spec of table `name` (asks server 0 if this client did not create it)."""
        info = self._tables.get(name)
        if info is None:
            reply = self._transport.call(0, "describe", name, once=False)
            info = self._remember(name, parse_spec(str(reply.meta["spec"]), f"describe {name!r}"))
        return info.spec

    def dense_layout(self, name: str) -> DenseLayout:
        """Names, shapes and offsets of dense table `name`'s parameters in its flat vector."""
        return self._info(name, "dense").layout

    # -- sparse verbs --------------------------------------------------------------------------

    def _route(self, uniq: torch.Tensor) -> tuple[torch.Tensor | None, list[int]]:
        """(U,) keys -> (order (U,) grouping keys by server or None for S=1, keys per server)."""
        if self.num_servers == 1:
            return None, [uniq.numel()]
        shard = partition(uniq, self.num_servers)  # (U,)
        order = torch.argsort(shard, stable=True)  # (U,)
        counts = torch.bincount(shard, minlength=self.num_servers).tolist()
        return order, counts

    def pull(self, table: str, keys: torch.Tensor, *, create: bool = True, assume_unique: bool = False) -> PSHandle[torch.Tensor]:
        """Rows of (K,) int64 keys -> handle of (K, D) float32, in `keys` order. Rows missing on a
        server are created (initial value, entry policy) unless create=False (then zeros)."""
        dim = self._info(table, "sparse").dim
        return self._gather("pull", table, keys, dim, None if create else {"create": False}, assume_unique)

    def pull_statistics(self, table: str, keys: torch.Tensor) -> PSHandle[torch.Tensor]:
        """The CTR accessor's statistics of (K,) int64 keys -> handle of (K, 2) float32 (show, click), in
        `keys` order, as the servers hold them when each server answers: zeros for a key without a row;
        nothing is created or counted. A table without an accessor: the handle raises ConfigError."""
        self._info(table, "sparse")
        return self._gather("pull_statistics", table, keys, 2, None, False)

    def _gather(self, verb: str, table: str, keys: torch.Tensor, width: int, meta, assume_unique: bool
                ) -> PSHandle[torch.Tensor]:
        """(K, width) float32 of (K,) keys from the servers holding them (`verb`'s reply), in `keys` order."""
        keys = as_keys(keys, f"{verb} {table!r}")
        uniq, inverse = (keys, None) if assume_unique else unique_inverse(keys)
        order, counts = self._route(uniq)
        if order is None:
            if uniq.numel() == 0:
                return _done(torch.zeros(keys.numel(), width))
            handle = self._transport.request(0, verb, table, {"keys": uniq}, meta, once=False)  # a read
            return PSHandle([handle], lambda r: r[0].tensors[0] if inverse is None else r[0].tensors[0][inverse], self.timeout_s)
        grouped = uniq[order]  # (U,) keys grouped by server
        handles, pos = [], 0
        for s, n in enumerate(counts):
            if n:
                handles.append(self._transport.request(s, verb, table, {"keys": grouped[pos : pos + n]}, meta, once=False))
            pos += n

        def finish(replies: list[Reply]) -> torch.Tensor:
            out = torch.empty(uniq.numel(), width)  # (U, width)
            if replies:
                out[order] = torch.cat([r.tensors[0] for r in replies]) if len(replies) > 1 else replies[0].tensors[0]
            return out if inverse is None else out[inverse]  # (K, width)

        return PSHandle(handles, finish, self.timeout_s)

    def _merged(self, where: str, table: str, keys, grads, assume_unique: bool, extras=()) -> tuple:
        """Validate, then sum rows of duplicate keys: -> (U,) keys, (U, D) rows, extras (U,)."""
        keys = as_keys(keys, where)
        dim = self._info(table, "sparse").dim
        grads = _rows(grads, keys.numel(), dim, "rows", where)
        extras = [None if e is None else torch.as_tensor(e, dtype=torch.float32).reshape(-1) for e in extras]
        if len(extras) == 2 and (extras[0] is None) != (extras[1] is None):
            raise ConfigError(f"{where}: give shows and clicks together (the accessor's statistics of the keys; "
                              "recps.ps.embedding counts them from the batch), or neither for a table without accessor")
        for e in extras:
            if e is not None and e.numel() != keys.numel():
                raise ConfigError(f"{where}: shows/clicks have {e.numel()} entries for {keys.numel()} keys")
        if assume_unique:
            return keys, grads, extras
        uniq, inverse = unique_inverse(keys)
        if inverse is None:
            return keys, grads, extras
        summed = torch.zeros(uniq.numel(), dim).index_add_(0, inverse, grads)  # (U, D)
        extras = [None if e is None else torch.zeros(uniq.numel()).index_add_(0, inverse, e) for e in extras]
        return uniq, summed, extras

    def _send_rows(self, table: str, keys, rows, extras, meta, every_server: bool) -> list[Handle]:
        order, counts = self._route(keys)
        if order is not None:
            keys, rows = keys[order], rows[order]
            extras = [None if e is None else e[order] for e in extras]
        handles, pos = [], 0
        for s, n in enumerate(counts):
            if n or every_server:
                fields = {"keys": keys[pos : pos + n], "rows": rows[pos : pos + n]}
                if extras[0] is not None:
                    fields["shows"], fields["clicks"] = extras[0][pos : pos + n], extras[1][pos : pos + n]
                handles.append(self._transport.request(s, "push", table, fields, meta))
            pos += n
        return handles

    def push(self, table: str, keys: torch.Tensor, rows: torch.Tensor, *, shows=None, clicks=None,
             meta: Mapping | None = None, every_server: bool = False, assume_unique: bool = False) -> PSHandle[None]:
        """Rows (K, D) of (K,) keys (duplicates summed) to the servers holding them; what the rows
        are (gradients, deltas, a step's part) and when they apply is the table's mode's, told by
        `meta`. shows/clicks (K,) feed the table's CTR accessor: both for a table with one, neither without.
        `every_server`: a request to every server, with zero keys where a server has none."""
        keys, rows, extras = self._merged(f"push {table!r}", table, keys, rows, assume_unique, (shows, clicks))
        meta = {**meta, **_UNIQUE} if meta else _UNIQUE
        return PSHandle(self._send_rows(table, keys, rows, extras, meta, every_server), _none, self.timeout_s)

    # -- dense verbs ---------------------------------------------------------------------------

    def _flat(self, info: _Dense, values, where: str) -> torch.Tensor:
        if isinstance(values, Mapping):
            return info.layout.flatten(values)
        values = torch.as_tensor(values).detach().reshape(-1).to(torch.float32)
        if values.numel() != info.layout.size:
            raise ConfigError(f"{where}: got {values.numel()} values; the table holds N={info.layout.size}")
        return values.contiguous()

    def _join(self, info: _Dense, replies: list[Reply]) -> torch.Tensor:
        parts: list[torch.Tensor | None] = [None] * self.num_servers
        for s, r in zip(info.servers, replies):
            parts[s] = r.tensors[0]
        return info.layout.join(parts)

    def pull_dense(self, table: str) -> PSHandle[torch.Tensor]:
        """Handle of the (N,) float32 values of dense table `table` (see dense_layout for names)."""
        info: _Dense = self._info(table, "dense")
        handles = [self._transport.request(s, "pull_dense", table, once=False) for s in info.servers]
        return PSHandle(handles, lambda replies: self._join(info, replies), self.timeout_s)

    def push_dense(self, table: str, values, *, meta: Mapping | None = None, return_values: bool = False) -> PSHandle:
        """(N,) flat values (or name -> tensor) to the servers holding them; what they are and when
        they apply is the table's mode's, told by `meta`. With return_values the handle returns the
        (N,) values the servers hold after it (the mode's server half answers them)."""
        info: _Dense = self._info(table, "dense")
        flat = self._flat(info, values, f"push_dense {table!r}")
        parts = info.layout.split(flat)
        if return_values:
            meta = {**(meta or {}), "return_values": True}
        handles = [self._transport.request(s, "push_dense", table, {"values": parts[s].contiguous()}, meta)
                   for s in info.servers]
        if not return_values:
            return PSHandle(handles, _none, self.timeout_s)
        return PSHandle(handles, lambda replies: self._join(info, replies), self.timeout_s)

    # -- cluster verbs -------------------------------------------------------------------------

    def barrier(self, name: str, timeout: float | None = None) -> None:
        """Block until every worker called barrier(name); needs a coordinator (see `connect`)."""
        if self.coordinator is None:
            raise PSError(f"barrier {name!r}: this client has no coordinator; build it with recps.ps.node.connect(role)")
        self.coordinator.barrier(name, self.worker_index, self.timeout_s if timeout is None else timeout)

    def _tables_meta(self, tables: Sequence[str] | None) -> str:
        names = list(tables or [])
        for n in names:
            check_table_name(n, "tables")
        return ",".join(names)

    def save(self, path: str, mode: str = "full", tables: Sequence[str] | None = None, timeout: float | None = None) -> dict[str, int]:
        """Every server writes its shard of each table (all by default) to path/<table>/; returns
        rows (sparse) or parameters (dense) written per table, summed over servers. `path` must
        be visible to every server (one machine, or a shared file system).

        `mode` is one of SAVE_MODES, Paddle's save modes 0-3 (SparseTable.save has the rules):
        "full" every row, nothing changes; "delta" the rows whose delta_score reached the
        accessor's threshold (resets it); "base" the serving export (values above
        base_threshold; resets delta_score); "batch" every row, then one more unseen day for
        every row (the day's end, what shrink deletes by)."""
        if mode not in SAVE_MODES:
            raise ConfigError(f"save: mode={mode!r}; use one of {SAVE_MODES}")
        meta = {"path": str(path), "mode": mode, "tables": self._tables_meta(tables)}
        return _summed(self._wait_all(self._request_all("save", "", meta), timeout))

    def load(self, path: str, tables: Sequence[str] | None = None, timeout: float | None = None) -> dict[str, int]:
        """Every server loads its share of each table from path/<table>/, whatever the number of
        servers that saved it (keys re-partitioned). Tables that do not exist yet are created
        from the saved spec. Returns rows / parameters loaded per table."""
        meta = {"path": str(path), "tables": self._tables_meta(tables)}
        result = _summed(self._wait_all(self._request_all("load", "", meta), timeout))
        with self._tables_lock:
            self._tables.clear()  # specs may have come from the checkpoint
        return result

    def shrink(self, tables: Sequence[str] | None = None, timeout: float | None = None) -> int:
        """Day end on every server: decay show/click, delete rows by score and unseen days (tables
        with an accessor; unseen days are counted by save(mode="batch")); returns rows deleted."""
        meta = {"tables": self._tables_meta(tables)}
        return sum(int(r.meta["deleted"]) for r in self._wait_all(self._request_all("shrink", "", meta), timeout))

    def stats(self, timeout: float | None = None) -> dict:
        """{"tables": {name: {"kind", "rows", "memory_bytes"}} summed over servers, "servers": [per server]}.
        A table with a disk tier also has "tier": its shards' tier statistics merged
        (recps.ps.table.tier.merge_tier_stats: rows per tier, hits, hit rate, promotions, evictions, bytes)."""
        per = [json.loads(str(r.meta["stats"])) for r in self._wait_all(self._request_all("stats", once=False), timeout)]
        tables: dict[str, dict] = {}
        tiers: dict[str, list[dict]] = {}
        for s in per:
            for name, st in s["tables"].items():
                t = tables.setdefault(name, {"kind": st["kind"], "rows": 0, "memory_bytes": 0})
                t["rows"] += st["rows"]
                t["memory_bytes"] += st["memory_bytes"]
                if "tier" in st:
                    tiers.setdefault(name, []).append(st["tier"])
        for name, shards in tiers.items():
            tables[name]["tier"] = merge_tier_stats(shards)
        return {"tables": tables, "servers": per}

    def stop_servers(self, timeout: float | None = None) -> None:
        """Ask every server to stop (call once, from one worker, after a final barrier)."""
        self._wait_all(self._request_all("stop"), timeout)

    def ping(self, timeout: float | None = None) -> list[float]:
        """Round-trip seconds to each server."""
        return [self._transport.ping(s, timeout) for s in range(self.num_servers)]


def _none(replies: list[Reply]) -> None:
    return None


def _summed(replies: list[Reply]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in replies:
        for name, n in json.loads(str(r.meta["result"])).items():
            out[name] = out.get(name, 0) + int(n)
    return out
