"""DenseTable: named dense parameters on a server, with an update rule and a sync buffer.

Each parameter is stored float32 with its own optimizer state. The update rules of
`optimizers.py` see a parameter as rows. Per-element rules (SGD, Adagrad, Adam:
`rule.per_element`) get the whole parameter as one row (1, numel), which is exactly
torch.optim's per-parameter step and lets Adam run torch's fused kernel; row-wise Adagrad
sees the first dimension as rows (one row for a 1-D parameter or a scalar) and keeps one
accumulator per row.

Verbs:
    pull(names=None) -> {name: tensor}      copies
    push(grads)                              one update now (async mode)
    push_delta(deltas)                       GEO: value += delta
    accumulate(grads) -> int                 sync mode: add one worker's contribution
    apply_accumulated() -> int               one update with the sum of contributions
    save(path, mode) / load(path)            same folder format as SparseTable

A dense table sharded by parameter name across servers re-shards for free: `load` reads
every saved shard and keeps the parameters this table holds.

Thread safety: all methods may be called from any thread; each is atomic (one lock).

>>> table = DenseTable({"w": torch.ones(2, 2)}, optimizer=SGDRule(lr=0.5))
>>> table.push({"w": torch.ones(2, 2)})
>>> table.pull()["w"].tolist()
[[0.5, 0.5], [0.5, 0.5]]
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

import torch

from recps.errors import ConfigError
from recps.ps.table.checkpoint import CheckpointError, ShardReader, ShardWriter, list_shards
from recps.ps.table.optimizers import SGDRule, UpdateRule
from recps.ps.table.sparse import SAVE_MODES

__all__ = ["DenseTable"]


def _rows_view(t: torch.Tensor, per_element: bool) -> torch.Tensor:
    """A parameter as (rows, cols): one row for per-element rules, 0-D and 1-D parameters;
    else the first dim by the rest."""
    if per_element or t.dim() <= 1:
        return t.reshape(1, -1)
    return t.reshape(t.shape[0], -1)


def _file_name(name: str) -> str:
    """Parameter names become file names: keep them portable."""
    safe = "".join(c if c.isalnum() or c in "._-" else f"%{ord(c):02x}" for c in name)
    return safe


class DenseTable:
    """Named dense parameters and their optimizer state; see the module docstring.

    Args:
        params: name -> initial value (copied, stored float32).
        optimizer: update rule (default SGDRule(lr=0.01)).
        name: used in error messages and manifests.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], optimizer: UpdateRule | None = None, name: str = "dense") -> None:
        optimizer = SGDRule() if optimizer is None else optimizer
        if not isinstance(optimizer, UpdateRule):
            raise ConfigError(f"DenseTable {name}: optimizer={optimizer!r} is not an UpdateRule; use e.g. AdamRule(lr=1e-3)")
        if not params:
            raise ConfigError(f"DenseTable {name}: no parameters given; pass a dict name -> tensor")
        self.name = name
        self.rule = optimizer
        self._values = {n: torch.as_tensor(v).detach().to(torch.float32).clone() for n, v in params.items()}
        self._state = {n: self._fresh_state(v) for n, v in self._values.items()}
        self._buffer: dict[str, torch.Tensor] | None = None
        self._contributions = 0
        self._lock = threading.RLock()

    def _state_shape(self, v: torch.Tensor) -> tuple[int, int]:
        """(rows, S) of the optimizer state of parameter `v`."""
        rows = _rows_view(v, self.rule.per_element)
        return rows.shape[0], self.rule.state_width(rows.shape[1])

    def _fresh_state(self, v: torch.Tensor) -> torch.Tensor:
        rows = _rows_view(v, self.rule.per_element)
        return self.rule.init_state(rows.shape[0], rows.shape[1])

    @property
    def names(self) -> list[str]:
        return list(self._values)

    def shapes(self) -> dict[str, torch.Size]:
        return {n: v.shape for n, v in self._values.items()}

    def __len__(self) -> int:
        return len(self._values)

    def _check(self, tensors: Mapping[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
        out = {}
        for n, t in tensors.items():
            if n not in self._values:
                raise ConfigError(f"DenseTable {self.name}.{where}: unknown parameter {n!r}; this table has {self.names}")
            t = torch.as_tensor(t)
            if t.shape != self._values[n].shape:
                raise ConfigError(
                    f"DenseTable {self.name}.{where}: {n} has shape {tuple(t.shape)}, expected {tuple(self._values[n].shape)}"
                )
            out[n] = t.detach().to(torch.float32)
        return out

    @torch.no_grad()
    def pull(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Copies of the named parameters (all if names is None)."""
        with self._lock:
            names = self.names if names is None else names
            missing = [n for n in names if n not in self._values]
            if missing:
                raise ConfigError(f"DenseTable {self.name}.pull: unknown parameter(s) {missing}; this table has {self.names}")
            return {n: self._values[n].clone() for n in names}

    def flat(self) -> torch.Tensor:
        """(N,) every parameter's values flattened and concatenated in `names` order (one copy)."""
        with self._lock:
            return torch.cat([v.reshape(-1) for v in self._values.values()])

    def _update(self, grads: dict[str, torch.Tensor]) -> None:
        rows = self.rule.per_element
        self.rule.apply_many([_rows_view(self._values[n], rows) for n in grads], [_rows_view(g, rows) for g in grads.values()],
                             [self._state[n] for n in grads])

    @torch.no_grad()
    def push(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Apply the update rule now to the parameters named in grads (any subset)."""
        grads = self._check(grads, "push")
        with self._lock:
            self._update(grads)

    @torch.no_grad()
    def push_delta(self, deltas: Mapping[str, torch.Tensor]) -> None:
        """GEO: value += delta for the named parameters; optimizer state untouched."""
        deltas = self._check(deltas, "push_delta")
        with self._lock:
            for n, d in deltas.items():
                self._values[n].add_(d)

    @torch.no_grad()
    def accumulate(self, grads: Mapping[str, torch.Tensor]) -> int:
        """Sync mode: add one contribution (all parameters) to the buffer; returns how many are buffered."""
        grads = self._check(grads, "accumulate")
        if set(grads) != set(self._values):
            raise ConfigError(
                f"DenseTable {self.name}.accumulate: got {sorted(grads)}, a contribution must cover {sorted(self._values)}"
            )
        with self._lock:
            if self._buffer is None:
                self._buffer = {n: g.clone() for n, g in grads.items()}
            else:
                for n, g in grads.items():
                    self._buffer[n].add_(g)
            self._contributions += 1
            return self._contributions

    @property
    def pending_contributions(self) -> int:
        return self._contributions

    @torch.no_grad()
    def apply_accumulated(self) -> int:
        """One update with the summed buffered gradients, then empty the buffer; returns
        the number of contributions applied (0: nothing buffered, nothing done)."""
        with self._lock:
            if self._buffer is None:
                return 0
            self._update(self._buffer)
            applied = self._contributions
            self._buffer, self._contributions = None, 0
            return applied

    # ------------------------------------------------------------------ save / load

    @torch.no_grad()
    def save(self, path: str | os.PathLike, mode: str = "full", shard: int = 0, num_shards: int = 1) -> dict:
        """Write `path/shard-SSSSS-of-NNNNN/` atomically. full and delta carry values and
        optimizer state (a dense delta is the whole table); base carries values only."""
        if mode not in SAVE_MODES:
            raise ConfigError(f"DenseTable {self.name}.save: mode={mode!r}; use one of {SAVE_MODES}")
        with self._lock:
            values = {n: v.clone() for n, v in self._values.items()}
            state = {n: s.clone() for n, s in self._state.items()}
        with ShardWriter(path, shard, num_shards) as writer:
            files = {}
            for n, v in values.items():
                f = _file_name(n)
                files[n] = f
                writer.declare(f"value.{f}", torch.float32, tuple(v.shape[1:]) if v.dim() else ())
                writer.append(f"value.{f}", v if v.dim() else v.reshape(1))
                if mode != "base":
                    writer.declare(f"state.{f}", torch.float32, tuple(state[n].shape[1:]))
                    writer.append(f"state.{f}", state[n])
            header = {
                "kind": "dense",
                "table": self.name,
                "mode": mode,
                "shard": shard,
                "num_shards": num_shards,
                "params": {n: {"file": files[n], "shape": list(v.shape)} for n, v in values.items()},
                "optimizer": self.rule.config(),
            }
            return writer.commit(header)

    @torch.no_grad()
    def load(self, path: str | os.PathLike) -> int:
        """Load this table's parameters from every shard under `path` (checksums and shapes
        verified first; nothing changes on a mismatch). Returns parameters loaded."""
        found: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for shard_dir in list_shards(path):
            reader = ShardReader(shard_dir)
            man = reader.manifest
            if man.get("kind") != "dense":
                raise CheckpointError(f"load {shard_dir}: checkpoint kind={man.get('kind')!r}, table {self.name} is dense")
            keep_state = man["mode"] != "base"
            if keep_state and man["optimizer"]["name"] != self.rule.name:
                raise CheckpointError(
                    f"load {shard_dir}: checkpoint optimizer={man['optimizer']['name']!r}, table {self.name} "
                    f"uses {self.rule.name!r}; use the same optimizer, or load a base export"
                )
            for n, spec in man["params"].items():
                if n not in self._values:
                    continue  # held by another shard
                if list(self._values[n].shape) != spec["shape"]:
                    raise CheckpointError(
                        f"load {shard_dir}: {n} has shape {spec['shape']} in the checkpoint, "
                        f"{list(self._values[n].shape)} in table {self.name}; build the model with the saved shapes"
                    )
                value = reader.read(f"value.{spec['file']}").reshape(self._values[n].shape)
                state = reader.read(f"state.{spec['file']}") if keep_state else None
                expected = self._state_shape(self._values[n])
                if state is not None and tuple(state.shape) != expected:
                    raise CheckpointError(
                        f"load {shard_dir}: the optimizer state of {n} has shape {tuple(state.shape)}, table "
                        f"{self.name} keeps {tuple(expected)} (a checkpoint of an older layout); load its base "
                        f"export (values only) or save it again with this version"
                    )
                found[n] = (value, state)
        missing = [n for n in self._values if n not in found]
        if missing:
            raise CheckpointError(f"load {path}: parameter(s) {missing} of table {self.name} are not in the checkpoint")
        with self._lock:
            for n, (value, state) in found.items():
                self._values[n] = value
                self._state[n] = state if state is not None else self._fresh_state(value)
            self._buffer, self._contributions = None, 0
        return len(found)
