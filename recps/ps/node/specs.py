"""Table specs: what a client asks a server to create, as plain data that travels as JSON.

A spec is a dict of JSON scalars, lists and dicts (never pickled); servers compare specs to make
`create_*` idempotent and build the L0 tables from them.

    sparse spec  {"kind": "sparse", "dim": D, "optimizer": {"name": "adagrad", "lr": 0.05, ...},
                  "initializer": {"kind": "uniform", "low": -0.01, ...}, "accessor": {...} | None,
                  "entry": {"name": "count_filter", "count": 3} | None, "dtype": "float32",
                  "seed": 0, "capacity": 0, "mode": "async", "memory_budget": R}   (the last only when set)
    dense spec   {"kind": "dense", "params": [[name, [shape...]], ...], "optimizer": {...}, "mode": "async"}

`mode` tags the table with the PS mode that trains it ("sync", "async", "geo"): the server hands
the table's pushes to that mode's server half (recps.ps.modes), so two tables of one job may
follow two modes. A spec without one (written before modes were tagged) is "async".

`TableConfig` is what a user configures of a sparse table (conf/ps/*.yaml `table:`): update
rule, initial values, capacity, seed; `TableConfig.spec(dim, mode)` makes the spec.

A dense table is a list of named parameters; the Communicator sees it as one flat (N,) float32
vector, the parameters' values concatenated in spec order. `DenseLayout` places each parameter
whole on one server (largest first onto the least loaded server), so a checkpoint re-shards by
name and every per-element update rule equals the single-process one.

>>> layout = DenseLayout(dense_spec({"w": (2, 3), "b": (3,)}), num_servers=2)
>>> layout.size, layout.owner, layout.server_sizes
(9, [0, 1], [6, 3])
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from recps.errors import ConfigError
from recps.ps.table import (
    CountFilterEntry,
    CtrAccessor,
    DenseTable,
    Initializer,
    ProbabilityEntry,
    SparseTable,
    UpdateRule,
    make_rule,
)
from recps.ps.table.accessor import meta_columns
from recps.ps.table.tier import budget_rows, parse_memory_budget

__all__ = [
    "TableConfig",
    "TABLE_NAME_RE",
    "check_table_name",
    "sparse_spec",
    "dense_spec",
    "build_sparse",
    "build_dense",
    "spec_json",
    "parse_spec",
    "spec_difference",
    "DenseLayout",
]

_DTYPES = {"float32": torch.float32, "float16": torch.float16}
TABLE_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")  # names become folder names in checkpoints
DEFAULT_MODE = "async"  # the mode of a spec that names none (checkpoints written before tables were tagged)


def check_table_name(name: str, where: str) -> str:
    if not isinstance(name, str) or not TABLE_NAME_RE.match(name):
        raise ConfigError(f"{where}: table name {name!r}; use 1-128 letters, digits, '_', '.', '-' (it names a folder)")
    return name


def _mode(mode: str, where: str) -> str:
    if not isinstance(mode, str) or not re.match(r"^[a-z][a-z0-9_]{0,31}$", mode):
        raise ConfigError(f"{where}: mode={mode!r}; name the PS mode that trains the table (sync, async, geo)")
    return mode


def _optimizer(optimizer: Mapping | UpdateRule | None, where: str) -> dict:
    if optimizer is None:
        return {"name": "sgd", "lr": 0.01}
    if isinstance(optimizer, UpdateRule):
        return optimizer.config()
    if not isinstance(optimizer, Mapping) or "name" not in optimizer:
        raise ConfigError(f"{where}: optimizer={optimizer!r}; give a dict like {{'name': 'adagrad', 'lr': 0.05}}")
    out = dict(optimizer)
    try:
        return make_rule(**out).config()  # validated here, at the caller, not later on a server
    except TypeError as e:
        raise ConfigError(f"{where}: optimizer={out!r}: {e}; see recps.ps.table.optimizers") from None


def _dataclass_dict(value, cls, where: str, what: str) -> dict | None:
    if value is None:
        return None
    if isinstance(value, cls):
        return dataclasses.asdict(value)
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: {what}={value!r}; give a dict of {cls.__name__} fields or a {cls.__name__}")
    try:
        return dataclasses.asdict(cls(**value))
    except TypeError as e:
        raise ConfigError(f"{where}: {what}={dict(value)!r}: {e}; see {cls.__name__}'s fields") from None


def _entry(entry, where: str) -> dict | None:
    if entry is None:
        return None
    if isinstance(entry, (CountFilterEntry, ProbabilityEntry)):
        return entry.config()
    if not isinstance(entry, Mapping) or entry.get("name") not in ("count_filter", "probability"):
        raise ConfigError(
            f"{where}: entry={entry!r}; give {{'name': 'count_filter', 'count': 3}} or {{'name': 'probability', 'probability': 0.1}}"
        )
    fields = {k: v for k, v in entry.items() if k != "name"}
    cls = CountFilterEntry if entry["name"] == "count_filter" else ProbabilityEntry
    try:
        return cls(**fields).config()
    except TypeError as e:
        raise ConfigError(f"{where}: entry={dict(entry)!r}: {e}") from None


def sparse_spec(
    dim: int,
    optimizer: Mapping | UpdateRule | None = None,
    initializer: Mapping | Initializer | None = None,
    accessor: Mapping | CtrAccessor | None = None,
    entry: Mapping | CountFilterEntry | ProbabilityEntry | None = None,
    dtype: str = "float32",
    seed: int = 0,
    capacity: int = 0,
    mode: str = DEFAULT_MODE,
    where: str = "sparse table",
    memory_budget: int | None = None,
) -> dict:
    """A validated, canonical sparse table spec (see the module docstring). `memory_budget`: rows
    each server keeps in memory, the rest on its disk tier (None: all in memory; the key is then
    left out, so specs and checkpoints of RAM-only tables are as before)."""
    if isinstance(dim, bool) or int(dim) != dim or dim < 1:
        raise ConfigError(f"{where}: dim={dim!r}; it must be an integer >= 1")
    if dtype not in _DTYPES:
        raise ConfigError(f"{where}: dtype={dtype!r}; use one of {sorted(_DTYPES)}")
    if int(capacity) != capacity or capacity < 0:
        raise ConfigError(f"{where}: capacity={capacity!r}; it must be an integer >= 0")
    spec = {
        "kind": "sparse",
        "dim": int(dim),
        "optimizer": _optimizer(optimizer, where),
        "initializer": _dataclass_dict(initializer, Initializer, where, "initializer") or dataclasses.asdict(Initializer()),
        "accessor": _dataclass_dict(accessor, CtrAccessor, where, "accessor"),
        "entry": _entry(entry, where),
        "dtype": dtype,
        "seed": int(seed),
        "capacity": int(capacity),
        "mode": _mode(mode, where),
    }
    if memory_budget is not None:
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 1:
            raise ConfigError(f"{where}: memory_budget={memory_budget!r}; give rows per server >= 1, or None for RAM only")
        spec["memory_budget"] = memory_budget
    return spec


def dense_spec(
    params: int | Mapping[str, tuple[int, ...] | torch.Size | torch.Tensor],
    optimizer: Mapping | UpdateRule | None = None,
    mode: str = DEFAULT_MODE,
    where: str = "dense table",
) -> dict:
    """A validated dense table spec: `params` is a flat size N (one parameter "value" of shape
    (N,)) or an ordered mapping name -> shape (or tensor, whose shape is taken)."""
    if isinstance(params, int) and not isinstance(params, bool):
        if params < 1:
            raise ConfigError(f"{where}: size={params}; it must be >= 1")
        params = {"value": (params,)}
    if not isinstance(params, Mapping) or not params:
        raise ConfigError(f"{where}: params={params!r}; give a size N or a dict name -> shape")
    shapes = []
    for name, shape in params.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: parameter name {name!r}; names must be non-empty strings")
        shape = tuple(shape.shape) if isinstance(shape, torch.Tensor) else tuple(shape)
        if any(isinstance(d, bool) or int(d) != d or d < 0 for d in shape):
            raise ConfigError(f"{where}: parameter {name} has shape {shape}; dims must be integers >= 0")
        shapes.append([name, [int(d) for d in shape]])
    return {"kind": "dense", "params": shapes, "optimizer": _optimizer(optimizer, where), "mode": _mode(mode, where)}


def spec_json(spec: Mapping) -> str:
    """Canonical JSON of a spec: equal specs give equal strings."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def parse_spec(text: str, where: str) -> dict:
    """A spec from JSON received over the network (validated again by the builders)."""
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{where}: the table spec is not JSON ({e})") from None
    if not isinstance(spec, dict) or spec.get("kind") not in ("sparse", "dense"):
        raise ConfigError(f"{where}: the table spec has kind={spec.get('kind') if isinstance(spec, dict) else spec!r}")
    spec.setdefault("mode", DEFAULT_MODE)
    _mode(spec["mode"], where)
    return spec


def spec_difference(old: Mapping, new: Mapping) -> list[str]:
    """Fields where two specs differ, as "field: old -> new" lines."""
    keys = sorted(set(old) | set(new))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def _rule(spec: Mapping) -> UpdateRule:
    opt = dict(spec["optimizer"])
    return make_rule(opt.pop("name"), **opt)


def build_sparse(spec: Mapping, name: str, num_servers: int) -> SparseTable:
    """The SparseTable shard one of `num_servers` servers holds for this spec."""
    entry = spec.get("entry")
    if entry is not None:
        fields = {k: v for k, v in entry.items() if k != "name"}
        entry = CountFilterEntry(**fields) if entry["name"] == "count_filter" else ProbabilityEntry(**fields)
    return SparseTable(
        dim=spec["dim"],
        optimizer=_rule(spec),
        initializer=Initializer(**spec["initializer"]),
        seed=spec["seed"],
        accessor=CtrAccessor(**spec["accessor"]) if spec.get("accessor") else None,
        entry=entry,
        dtype=_DTYPES[spec["dtype"]],
        capacity=math.ceil(spec["capacity"] / num_servers),
        name=name,
        memory_budget=spec.get("memory_budget"),  # rows per server
    )


def build_dense(spec: Mapping, name: str, server: int, num_servers: int, values: torch.Tensor | None) -> DenseTable | None:
    """The DenseTable holding the parameters `server` owns (None if it owns none), with initial
    `values` (that server's flat part) or zeros."""
    layout = DenseLayout(spec, num_servers)
    mine = layout.params_of(server)
    if not mine:
        return None
    if values is not None and values.numel() != layout.server_sizes[server]:
        raise ConfigError(
            f"dense table {name}: server {server} got {values.numel()} initial values, its parameters hold "
            f"{layout.server_sizes[server]}; the client and server disagree on the layout"
        )
    params = {}
    pos = 0
    for i in mine:
        n = layout.sizes[i]
        shape = layout.shapes[i]
        params[layout.names[i]] = values[pos : pos + n].reshape(shape) if values is not None else torch.zeros(shape)
        pos += n
    return DenseTable(params, optimizer=_rule(spec), name=name)


def _default_table_optimizer() -> dict:
    return {"name": "rowwise_adagrad", "lr": 0.05, "eps": 1e-8}


@dataclass
class TableConfig:
    """A sparse table's settings (conf/ps/<mode>.yaml `table:`): every table a PS mode creates.

    Args:
        optimizer: the update rule, {"name": "sgd" | "adagrad" | "rowwise_adagrad" | "adam", "lr", ...}:
            applied by the servers (sync, async) or by a GEO worker's replica ("sgd" | "rowwise_adagrad").
            "eps" is dropped for "sgd" (conf keeps Adagrad's eps next to the name).
        init_std: rows start uniform with this std, a deterministic function of (key, seed).
        capacity: expected rows of the table over all servers (0: grow as keys come; reserving
            them spares the key index's re-hashing as the table grows).
        seed: of the initial values.
        accessor: None (no statistics), or CtrAccessor fields (Paddle's CTR accessor: nonclk_coeff,
            click_coeff, base_threshold, delta_threshold, delta_keep_days, show_click_decay_rate,
            delete_threshold, delete_after_unseen_days; `{}` takes its defaults): each row keeps
            show / click / score statistics that shrink, delta and base saves select by.
        entry: None (every key gets a row), {"name": "count_filter", "count": N} (a row after N
            sightings) or {"name": "probability", "probability": p} (admitted with probability p).
        memory_budget: None keeps every row in RAM. Otherwise the RAM each server gives a table: a
            row count (1000000) or a size with a unit (4GiB, 500MB; divided by the bytes of a row,
            `recps.ps.table.tier.row_bytes`); the other rows live in the server's disk tier
            ($RECPS_TIER_DIR, else the temp folder). docs/scaling.md, "Tables larger than memory".
    """

    optimizer: Mapping = field(default_factory=_default_table_optimizer)
    init_std: float = 0.01
    capacity: int = 0
    seed: int = 0
    accessor: Any = None
    entry: Any = None
    memory_budget: Any = None

    def __post_init__(self) -> None:
        self.optimizer = dict(self.optimizer)
        if self.optimizer.get("name") == "sgd":
            self.optimizer.pop("eps", None)
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 0:
            raise ConfigError(f"ps.table.capacity={self.capacity!r}; it must be an integer >= 0")
        if not (isinstance(self.init_std, (int, float)) and self.init_std >= 0):
            raise ConfigError(f"ps.table.init_std={self.init_std!r}; it must be a number >= 0")
        _optimizer(self.optimizer, "ps.table")  # a bad rule fails here, before a server sees it
        # Bad accessor or entry fields fail here too; kept as plain dicts (they travel in specs).
        self.accessor = _dataclass_dict(None if self.accessor is None else dict(self.accessor), CtrAccessor,
                                        "ps.table", "accessor")
        self.entry = _entry(None if self.entry is None else dict(self.entry), "ps.table")
        self._budget = parse_memory_budget(self.memory_budget, "ps.table.memory_budget")  # bad text fails here

    def budget_rows(self, dim: int) -> int | None:
        """The memory budget as rows per server for tables of width `dim` (None: RAM only); a size
        that holds no row raises ConfigError."""
        rule = make_rule(**self.optimizer)
        return budget_rows(self._budget, dim, rule.state_width(dim), len(meta_columns(self.accessor is not None)),
                           False, "ps.table.memory_budget", self.memory_budget)

    def initializer(self) -> dict:
        bound = self.init_std * 3**0.5  # U(-b, b) has std b/sqrt(3): the same rows as ps=local's init_std
        return {"kind": "uniform", "low": -bound, "high": bound}

    def spec(self, dim: int, mode: str, where: str = "sparse table") -> dict:
        """The sparse spec of a table of width `dim` trained by `mode`."""
        return sparse_spec(dim, self.optimizer, self.initializer(), accessor=self.accessor, entry=self.entry,
                           seed=self.seed, capacity=self.capacity, mode=mode, where=where,
                           memory_budget=self.budget_rows(dim))


class DenseLayout:
    """Where each parameter of a dense table lives and where it sits in the flat vector.

    Attributes:
        names, shapes, sizes, offsets: per parameter, in spec order (offsets into the flat (N,)).
        owner: server index of each parameter.
        size: N, the flat length.
        server_sizes: flat length of each server's part (its parameters in spec order).
    """

    def __init__(self, spec: Mapping, num_servers: int) -> None:
        self.names = [p[0] for p in spec["params"]]
        self.shapes = [tuple(p[1]) for p in spec["params"]]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.size = self.offsets[-1]
        # Largest first onto the least loaded server; ties to the lower index: deterministic.
        load = [0] * num_servers
        self.owner = [0] * len(self.names)
        for i in sorted(range(len(self.names)), key=lambda i: (-self.sizes[i], i)):
            s = min(range(num_servers), key=lambda j: (load[j], j))
            self.owner[i] = s
            load[s] += self.sizes[i]
        self.server_sizes = load
        self.num_servers = num_servers

    def params_of(self, server: int) -> list[int]:
        """Indices of the parameters `server` holds, in spec order."""
        return [i for i, s in enumerate(self.owner) if s == server]

    def split(self, flat: torch.Tensor) -> list[torch.Tensor | None]:
        """(N,) flat -> each server's part (None for a server with no parameters)."""
        if self.num_servers == 1:
            return [flat]
        parts: list[torch.Tensor | None] = []
        for s in range(self.num_servers):
            mine = self.params_of(s)
            if not mine:
                parts.append(None)
            elif len(mine) == 1:
                i = mine[0]
                parts.append(flat[self.offsets[i] : self.offsets[i + 1]])
            else:
                parts.append(torch.cat([flat[self.offsets[i] : self.offsets[i + 1]] for i in mine]))
        return parts

    def join(self, parts: list[torch.Tensor | None]) -> torch.Tensor:
        """Each server's part -> the (N,) flat vector."""
        if self.num_servers == 1:
            return parts[0]
        out = torch.empty(self.size, dtype=torch.float32)
        for s, part in enumerate(parts):
            pos = 0
            for i in self.params_of(s):
                n = self.sizes[i]
                out[self.offsets[i] : self.offsets[i + 1]] = part[pos : pos + n]
                pos += n
        return out

    def flatten(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """name -> tensor (every parameter) -> (N,) flat float32, in spec order."""
        missing = [n for n in self.names if n not in params]
        if missing:
            raise ConfigError(f"dense values: parameter(s) {missing} missing; the table has {self.names}")
        return torch.cat([torch.as_tensor(params[n]).detach().reshape(-1).to(torch.float32) for n in self.names])

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """(N,) flat -> name -> view with the parameter's shape."""
        return {n: flat[self.offsets[i] : self.offsets[i + 1]].view(self.shapes[i]) for i, n in enumerate(self.names)}
