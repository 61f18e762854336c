"""The served model: built once from an export's config.yaml, it scores candidates with one Version.

    scorer = Scorer(version.config_yaml)      # the zoo model, task and schema the stream trained
    scorer.check(version)                     # refuses (ConfigError) a version of another model
    batch = scorer.encode(user, candidates)   # raw feature values -> Batch, as the readers parse files
    probs, unknown = scorer.score(version, batch)

Features arrive as the data files hold them: a dense column's number (missing: 0, then the schema's
transform, log1p for Criteo), a sparse column's value (hashed per slot with recps.data.hashing when
`schema.hash_values`, as the reader does; missing: the slot's missing key), a sequence column's list
of values. Row b is the user's features with candidate b's. The embedding rows come from the version
(a key it does not hold reads as zeros, the PS's ServerReader convention, and is counted); the dense
parameters are the version's, copied into the model when a request brings another version than the
one before. `score` is called from one thread (recps.serve.app's inference thread): the model's dense
parameters are swapped between two requests, never during one.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import torch
from omegaconf import OmegaConf

from recps.config import register_resolvers
from recps.data.hashing import hash_slots, hash_strings
from recps.data.reader import Examples
from recps.data.schema import Schema
from recps.errors import ConfigError
from recps.job.build import build_job, schema_data
from recps.serve.versions import Version

__all__ = ["Scorer", "RequestError", "model_signature"]

log = logging.getLogger("recps.serve")

_NONE = type(None)
_NUMBER = {int, float, _NONE}  # a dense value (a bool is not one: its type is bool)
_HASHABLE = {str, int, _NONE}  # a hashed sparse value


class RequestError(ConfigError):
    """A request the model cannot take (an unknown feature, a value of the wrong kind); HTTP 422."""


def model_signature(config_yaml: str) -> str:
    """What two exports must share to be served by one model: the model's and the schema's config."""
    cfg = OmegaConf.create(config_yaml)
    parts = {}
    for name in ("model", "dataset.schema", "task._target_"):
        node = OmegaConf.select(cfg, name)
        parts[name] = OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node
    return json.dumps(parts, sort_keys=True, default=str)


class _VersionReader:
    """The collections' communicator while serving: pulls read one version's rows (read only)."""

    mode = "read"

    def __init__(self, dims: Mapping[str, int]) -> None:
        self.dims = dict(dims)  # PS table -> D
        self.version: Version | None = None
        self.unknown = 0  # keys of the last score() that the version does not hold

    def pull(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        rows = self.version.sparse.get(table) if self.version is not None else None
        dim = self.dims[table]
        if rows is None or len(rows) == 0:
            self.unknown += int(keys.numel())
            return torch.zeros(keys.numel(), dim)  # (U, D)
        at = torch.searchsorted(rows.keys, keys).clamp_(max=len(rows) - 1)  # (U,)
        found = rows.keys[at] == keys  # (U,)
        out = torch.zeros(keys.numel(), dim)  # (U, D)
        out[found] = rows.values[at[found]]
        self.unknown += int(keys.numel() - int(found.sum()))
        return out

    def push(self, table: str, keys: torch.Tensor, grads: torch.Tensor) -> None:
        raise ConfigError(f"the served model pushed gradients to {table!r}: it must be in eval mode")


class Scorer:
    """The model of `config_yaml` (an export's config.yaml), its task and its data schema."""

    def __init__(self, config_yaml: str) -> None:
        register_resolvers()
        cfg = OmegaConf.create(config_yaml)
        self.signature = model_signature(config_yaml)
        job = build_job(cfg, schema_data(cfg))
        self.schema: Schema = job.data.schema
        self.model, self.task, self.collection = job.model, job.task, job.collection
        self.model.eval()
        # the dense table's order: the distributed optimizer's (recps.ps.fleet: param0, param1, ...)
        self.params = [p for group in job.optimizer.param_groups for p in group["params"]]
        self.reader = _VersionReader(self.collection.table_dims())
        self.collection.bind(self.reader)
        self.bound: Version | None = None
        self.features = set(self.schema.dense) | set(self.schema.sparse) | set(self.schema.sequence)
        log.info("serve: model %s, %d dense inputs, sparse features %s", cfg.model._target_, len(self.schema.dense),
                 list(self.schema.feature_names))

    # -- versions ------------------------------------------------------------------------------------

    def _dense_values(self, version: Version) -> list[torch.Tensor]:
        names = sorted(version.dense, key=lambda n: int(n[len("param"):]) if n[len("param"):].isdigit() else -1)
        return [version.dense[n] for n in names]

    def check(self, version: Version) -> None:
        """Refuses (ConfigError, naming both) a version this model cannot serve: another model or
        schema, other tables or dense shapes. A new model needs a restart of the server."""
        if model_signature(version.config_yaml) != self.signature:
            raise ConfigError(f"{version.name} was trained as another model or schema than the one served "
                              f"(its config.yaml's model / dataset.schema / task differ); restart recps.serve to "
                              "serve it")
        tables = set(self.collection.table_dims())
        if not set(version.sparse) <= tables:
            raise ConfigError(f"{version.name} holds tables {sorted(version.sparse)}; the model has {sorted(tables)}")
        values = self._dense_values(version)
        shapes = [tuple(v.shape) for v in values]
        wanted = [tuple(p.shape) for p in self.params]
        if [math.prod(s) for s in shapes] != [math.prod(s) for s in wanted]:
            raise ConfigError(f"{version.name}: dense parameters of shapes {shapes}, the model's are {wanted}")

    def _bind(self, version: Version) -> None:
        with torch.no_grad():
            for p, v in zip(self.params, self._dense_values(version)):
                p.copy_(v.reshape(p.shape))
        self.reader.version = version
        self.bound = version

    # -- requests ------------------------------------------------------------------------------------

    def encode(self, user: Mapping[str, Any], candidates: Sequence[Mapping[str, Any]]) -> Examples:
        """Rows of the user's features with each candidate's, parsed as the readers parse a file's."""
        s = self.schema
        unknown = sorted({k for row in [user, *candidates] for k in row} - self.features)
        if unknown:
            raise RequestError(f"unknown feature(s) {unknown[:10]}; this model's features are dense "
                               f"{list(s.dense)}, sparse {list(s.sparse)}, sequence {list(s.sequence)}")
        both = sorted({k for row in candidates for k in row if k in user})
        if both:
            raise RequestError(f"feature(s) {both[:10]} given for the user and for a candidate; give each once")
        b = len(candidates)

        def column(name: str) -> list:
            if name in user:
                return [user[name]] * b
            return [row.get(name) for row in candidates]

        dense = np.zeros((len(s.dense), b), np.float32)  # (I, B)
        for j, c in enumerate(s.dense):
            values = column(c)
            if not {type(v) for v in values} <= _NUMBER:
                raise RequestError(f"dense feature {c} takes a number or null")
            x = np.array([np.nan if v is None else v for v in values], np.float64)
            if not np.isfinite(x[~np.isnan(x)]).all():
                raise RequestError(f"dense feature {c} is not finite")
            with np.errstate(over="ignore", invalid="ignore"):
                dense[j] = np.where(np.isnan(x), 0.0, x)  # the cast to float32, as recps.data.reader's
        if s.dense_transform == "log1p":
            dense = np.copysign(np.log1p(np.abs(dense)), dense)  # recps.data.reader's transform, in float32
        if not np.isfinite(dense).all():
            raise RequestError("a dense feature overflows float32 (|x| > 3.4e38), the training dtype")
        if s.hash_values and s.sparse:  # every column's values hashed in one pass
            flat: list = []
            for c in s.sparse:
                flat += self._strings(c, column(c))
            keys = hash_slots(flat, list(s.sparse), b)  # (S, B)
        else:
            keys = np.empty((len(s.sparse), b), np.int64)  # (S, B)
            for j, c in enumerate(s.sparse):
                keys[j] = self._keys(c, column(c))
        seq_lengths, seq_values = [], []
        for c in s.sequence:
            lists = column(c)
            if not all(v is None or isinstance(v, list) for v in lists):
                raise RequestError(f"sequence feature {c} takes a list of values or null")
            flat = [x for v in lists for x in (v or ())]
            seq_lengths.append(torch.tensor([len(v or ()) for v in lists], dtype=torch.int64))  # (B,)
            seq_values.append(torch.from_numpy(self._keys(c, flat)) if flat else torch.zeros(0, dtype=torch.int64))
        return Examples(feature_names=s.feature_names, dense=torch.from_numpy(np.ascontiguousarray(dense.T)),
                        keys=torch.from_numpy(np.ascontiguousarray(keys.T)),
                        labels=torch.zeros(b, len(s.labels)), seq_lengths=tuple(seq_lengths),
                        seq_values=tuple(seq_values))

    @staticmethod
    def _strings(column: str, values: list) -> list:
        """One hashed column's raw values as the reader hashes them: strings (an integer by its digits) or None."""
        kinds = {type(v) for v in values}
        if not kinds <= _HASHABLE:
            raise RequestError(f"sparse feature {column} takes a string (or an integer) value, or null")
        return values if int not in kinds else [str(v) if type(v) is int else v for v in values]

    def _keys(self, column: str, values: list) -> np.ndarray:
        """int64 keys of one sparse column's raw values (the reader's: hashed strings, or integer keys)."""
        if self.schema.hash_values:
            return hash_strings(pa.array(self._strings(column, values), pa.string()), column)
        if not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in values):
            raise RequestError(f"sparse feature {column} takes an integer key (dataset.schema.hash_values=false), "
                               "or null")
        return np.array([0 if v is None else v for v in values], np.int64)  # missing: 0, as the reader's

    def score(self, version: Version, examples: Examples) -> tuple[torch.Tensor, int]:
        """(probabilities (B,) or (B, T), keys the version does not hold) of `examples` under `version`."""
        if self.bound is not version:
            self._bind(version)
        self.reader.unknown = 0
        with torch.no_grad():
            probs = self.task.predict(self.task.forward(self.model, examples.to_batch()))
        return probs, self.reader.unknown
