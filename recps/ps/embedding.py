"""PS-backed embedding collections: torchrec's interfaces over a parameter-server Communicator (L3).

`PSEmbeddingBagCollection` is a drop-in for torchrec's EmbeddingBagCollection (KJT in,
KeyedTensor (B, F*D) out, `embedding_bag_configs()`), `PSEmbeddingCollection` for its
EmbeddingCollection (KJT in, dict feature -> JaggedTensor (N_f, D) out, `embedding_configs()`).
Every model in `models/` runs unchanged over them in every mode (sync, async, GEO).

The worker never allocates a table. Per batch and per PS table:

    keys (N,) --salt per table--> (N,) --unique--> uniq (U,), inverse (N,)
    rows = communicator.pull(table, uniq)                        (U, D)
    pooled = sum of rows[inverse] per bag (FBGEMM, autograd)     (B, F*D)
    backward: d loss / d rows (U, D) -> communicator.push(table, uniq, grads, shows=, clicks=)

Tables of the same width share one PS table: a batch costs one pull and one push per
width, not one per feature (Paddle's CTR-DNN does the same with one sparse table for its
26 slots). Keys of different tables are kept apart by a per-table salt:
`ps_keys = splitmix64(key + salt(table name))`, so feature "user" key 5 and feature
"item" key 5 are different rows, as they are in torchrec. Checkpoints hold salted keys;
`salted_keys()` computes them for serving.

Pooling uses FBGEMM's dense TBE lookup (`dense_embedding_codegen_lookup_function`: one
kernel for all F features over the pulled rows, output already (B, F*D), backward an
FBGEMM segment reduction), because it pays: `python -m benchmarks.ps_throughput --pooling`
(B=512, F=26, one key per bag, U=8000, forward + backward, one thread, median of 5x20, three
runs on the shared 2-core machine, load 7-8): FBGEMM 2.2-4.5 ms (D=9) / 1.8-5.0 ms (D=12),
F.embedding_bag + transpose 8.4-16.2 / 10.0-16.7 ms (3-4x slower), rows[inverse] gather
2.8-5.4 / 3.3-7.3 ms (faster once of six, and it only pools bags of one key).

Prefetch (async): `prefetch(kjt)` salts, de-duplicates and sends the pulls of a batch the calling
thread will pass to forward() next; forward() of that same KJT then only waits for the replies.
The trainer calls it with batch t+1 between batch t's forward and backward passes (`ps.prefetch`),
so the round trip overlaps the backward; rows of keys shared with batch t then miss batch t's push. A forward of
any other KJT drops the prefetch (its replies are awaited and discarded) and pulls as usual.

CTR statistics: a communicator whose `counts_statistics(table)` is true (the servers' table has a
CTR accessor, recps.ps.table.accessor) gets with each push the batch's shows and clicks per
unique key: a show per occurrence of the key in the batch, and the click of the example the
occurrence belongs to, summed (float32; exact for 0/1 clicks). The trainer hands the clicks (B,)
of the batch to `set_batch_clicks` before the forward pass (recps.job.loop: the task's label
column); a label is clamped to [0, 1] and counts as that much of a click (Paddle feeds the label
as the click). Without clicks (a model that builds its own KJT, a forward outside the trainer)
the shows still count the occurrences and the clicks are 0. `key_statistics` is where this is decided;
below (communicators, client, tables) shows and clicks are required for a table with an accessor.

GEO: a communicator that trains a local replica itself (`FusedBagLookup`, see
recps.ps.modes.geo) gets the ids and offsets and returns the pooled output; its TBE's
fused optimizer updates the replica in the backward pass.

Device (`device=cuda`: the worker computes on its GPU, the servers stay CPU processes). Keys are
host data: the KJT stays on the host (`input_device`), where keys are salted, de-duplicated and
pulled. The pulled rows (U, D), the inverse (N,) and the offsets are copied up through pinned
host memory (recps.device.to_device, non-blocking), pooled by FBGEMM's kernel on the GPU, and
d loss / d rows comes back down (to_host) before the push. GEO's replica lives on the device
(`bind` places it: recps.ps.modes.geo). On the CPU every one of these copies is the tensor itself.

Shapes: B batch, F features (Fg of one PS table), D embedding dim, N keys in the batch,
U unique keys.

Example (an in-process communicator over one SparseTable, no servers):

    >>> from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    >>> from recps.ps.table import SparseTable, SGDRule, Initializer
    >>> class Tables:
    ...     mode = "async"
    ...     def __init__(self): self.t = SparseTable(dim=4, optimizer=SGDRule(lr=1.0), initializer=Initializer("zeros"))
    ...     def pull(self, table, keys): return self.t.pull(keys)
    ...     def push(self, table, keys, grads): self.t.push(keys, grads)
    >>> configs = [EmbeddingBagConfig(name="t_a", embedding_dim=4, num_embeddings=10, feature_names=["a"])]
    >>> ebc = PSEmbeddingBagCollection(configs, Tables())
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([7, 7, 3]), torch.tensor([2, 1]))
    >>> ebc(kjt).values().sum().backward()   # d/d rows = number of uses; SGD lr 1
    >>> ebc(kjt).values().tolist()           # key 7: -2 per use, twice in bag 0; key 3: -1
    [[-4.0, -4.0, -4.0, -4.0], [-1.0, -1.0, -1.0, -1.0]]
"""

from __future__ import annotations

import hashlib
import logging
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from recps.device import same_device, to_device, to_host
from recps.errors import ConfigError, PSError
from recps.splitmix import splitmix64
from recps.ps.modes.base import CountsStatistics, PlacesReplicas, StartsPulls
from recps.ps.table.keys import unique_keys

__all__ = [
    "PSEmbeddingBagCollection",
    "PSEmbeddingCollection",
    "FusedBagLookup",
    "PSTable",
    "table_salt",
    "salted_keys",
    "ps_table_name",
    "pool_sum",
    "key_statistics",
]

logger = logging.getLogger(__name__)

# The op builds its own autograd node on CPU (checked against F.embedding_bag in
# tests/ps/test_embedding.py); torch warns because no kernel sits on the Autograd key.
warnings.filterwarnings("ignore", message=r"fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel")

_SUM = 0  # fbgemm PoolingMode.SUM
_FP32 = 0  # fbgemm SparseType.FP32


def table_salt(name: str) -> int:
    """A stable signed 64-bit salt for a torchrec table name (blake2b, not Python's hash()).

    >>> table_salt("t_C1") == table_salt("t_C1") != table_salt("t_C2")
    True
    """
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def salted_keys(keys: torch.Tensor, table: str) -> torch.Tensor:
    """The PS keys of raw int64 `keys` (N,) of torchrec table `table`: splitmix64(key + salt)."""
    return splitmix64(keys, table_salt(table))


def ps_table_name(dim: int, prefix: str = "embedding") -> str:
    """The PS table that holds every torchrec table of width `dim`: "embedding_d16"."""
    return f"{prefix}_d{dim}"


@dataclass(frozen=True)
class PSTable:
    """One PS sparse table as the collections see it: its name, width and the features it serves.

    Attributes:
        name: the PS table name (`ps_table_name(dim)`).
        dim: D.
        features: the features it serves, in output order.
        salts: (Fg,) int64, the salt of each feature's torchrec table.
    """

    name: str
    dim: int
    features: tuple[str, ...]
    salts: torch.Tensor


@runtime_checkable
class FusedBagLookup(Protocol):
    """A communicator that trains a local replica itself (GEO): pooled lookups whose backward
    updates the replica (FBGEMM TBE with a fused optimizer) instead of returning gradients."""

    def lookup_bags(self, table: str, keys: torch.Tensor, offsets: torch.Tensor, num_features: int,
                    shows: torch.Tensor | None = None, clicks: torch.Tensor | None = None) -> torch.Tensor:
        """keys (N,) salted int64, offsets (Fg*B+1,) -> pooled (B, Fg*D), differentiable.
        shows, clicks (N,): each occurrence's (`key_statistics`), given when `counts_statistics(table)`."""
        ...


def key_statistics(inverse: torch.Tensor | None, num_keys: int,
                   clicks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The CTR statistics a training batch gives its keys, decided here and nowhere below (the
    communicators, the client and the tables require them for a table with an accessor): each
    occurrence of a key is one show, with the click of its example (0 when the batch has no click
    labels, see `set_batch_clicks`).

    inverse (N,): the key (0..num_keys-1) of each of the N occurrences, or None when the N
    occurrences are the keys themselves (num_keys == N); clicks (N,) or None.
    Returns (num_keys,) shows, (num_keys,) clicks, float32."""
    if inverse is None:
        shows = torch.ones(num_keys)  # (N,)
        return shows, torch.zeros(num_keys) if clicks is None else clicks.to(torch.float32)
    shows = torch.bincount(inverse, minlength=num_keys).to(torch.float32)  # (U,) occurrences
    if clicks is None:
        return shows, torch.zeros(num_keys)
    return shows, torch.bincount(inverse, weights=clicks, minlength=num_keys).to(torch.float32)  # (U,)


class _PushGrads(torch.autograd.Function):
    """Identity on the pulled rows whose backward hands d loss / d rows to the communicator,
    with the keys' shows and clicks (U,) when they are counted (None: not)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, push, table: str, keys: torch.Tensor,
                shows: torch.Tensor | None, clicks: torch.Tensor | None) -> torch.Tensor:
        ctx.push, ctx.table, ctx.keys, ctx.shows, ctx.clicks = push, table, keys, shows, clicks
        return rows.view_as(rows)  # (U, D)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = to_host(grad.contiguous())  # (U, D) summed over the batch's uses; from a GPU: copied down
        if ctx.shows is None:
            ctx.push(ctx.table, ctx.keys, grad)
        else:
            ctx.push(ctx.table, ctx.keys, grad, shows=ctx.shows, clicks=ctx.clicks)
        return None, None, None, None, None, None


def pool_sum(rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor, num_features: int,
             pad: bool | None = None) -> torch.Tensor:
    """Sum-pooled bags over pulled rows, all features in one FBGEMM kernel.

    Args:
        rows: (U, D) float32 (may require grad).
        inverse: (N,) int64 row of each key.
        offsets: (Fg*B + 1,) int64 bag boundaries, feature-major as in a KJT.
        num_features: Fg.
        pad: pool rows zero-padded to P (D rounded up to a multiple of 4) and slice the output back:
            FBGEMM's GPU kernels take widths that are multiples of 4 only. None: on a GPU when D is not.
    Returns:
        (B, Fg*D) float32; an empty bag pools to zeros.
    """
    num_rows, dim = rows.shape
    width = -(-dim // 4) * 4  # P
    if (rows.device.type != "cpu" if pad is None else pad) and width != dim:
        padded = pool_sum(torch.nn.functional.pad(rows, (0, width - dim)), inverse, offsets, num_features, pad=False)
        batch = padded.shape[0]
        return padded.view(batch, num_features, width)[:, :, :dim].reshape(batch, num_features * dim)  # (B, Fg*D)
    dev = rows.device
    weights_offsets = torch.zeros(num_features, dtype=torch.int64, device=dev)  # every feature reads table 0
    d_offsets = torch.arange(0, (num_features + 1) * dim, dim, dtype=torch.int32, device=dev)  # (Fg+1,)
    hash_size_cumsum = torch.zeros(num_features + 1, dtype=torch.int64, device=dev)
    hash_size_cumsum[-1] = num_rows
    return torch.ops.fbgemm.dense_embedding_codegen_lookup_function(
        dev_weights=rows.reshape(-1), weights_offsets=weights_offsets, D_offsets=d_offsets,
        total_D=num_features * dim, max_D=dim, hash_size_cumsum=hash_size_cumsum,
        total_hash_size_bits=max(1, int(num_rows).bit_length()), indices=inverse, offsets=offsets,
        pooling_mode=_SUM, indice_weights=None, feature_requires_grad=None, output_dtype=_FP32,
    )  # (B, Fg*D)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def _group_tables(configs: Sequence[EmbeddingBagConfig | EmbeddingConfig], prefix: str, where: str) -> list[PSTable]:
    """Features grouped by width into PS tables, each feature with its torchrec table's salt."""
    seen: dict[str, str] = {}
    by_dim: dict[int, tuple[list[str], list[int]]] = {}
    names: set[str] = set()
    for config in configs:
        if config.name in names:
            raise ConfigError(f"{where}: two tables are named {config.name!r}; table names must be unique")
        names.add(config.name)
        if getattr(config, "pooling", PoolingType.SUM) not in (PoolingType.SUM, None):
            raise ConfigError(f"{where}: table {config.name} asks for pooling={config.pooling}; only SUM is served here")
        if not config.feature_names:
            raise ConfigError(f"{where}: table {config.name} has no feature_names; give at least one")
        for feature in config.feature_names:
            if feature in seen:
                raise ConfigError(f"{where}: feature {feature!r} is in tables {seen[feature]} and {config.name}; "
                                  "give each feature to one table")
            seen[feature] = config.name
            features, salts = by_dim.setdefault(int(config.embedding_dim), ([], []))
            features.append(feature)
            salts.append(table_salt(config.name))
    return [PSTable(ps_table_name(dim, prefix), dim, tuple(features), torch.tensor(salts, dtype=torch.int64))
            for dim, (features, salts) in by_dim.items()]


@dataclass
class _Prefetch:
    """A batch's pulls in flight: its KJT, the `_split` result, and per PS table (uniq, inverse, rows())."""

    features: KeyedJaggedTensor
    parts: list
    batch: int
    pulls: list[tuple[torch.Tensor, torch.Tensor, Callable[[], torch.Tensor]]]


class _PSCollectionBase(nn.Module):
    """What both collections share: tables, the communicator binding, key salting per batch."""

    def __init__(self, configs, communicator, prefix: str, where: str, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self._where = where
        self.device = torch.device(device)  # where the output is computed (rows copied up)
        self.input_device = torch.device("cpu")  # where forward() reads the KJT: keys are host data
        self.ps_tables = _group_tables(configs, prefix, where)
        self.feature_names = [f for t in self.ps_tables for f in t.features]  # group order
        self.communicator = communicator
        self._prefetched: dict[int, _Prefetch] = {}  # by thread: the collection is shared by the trainer's threads
        self._prefetch_off = False  # set when the model passed forward() other features than prefetched
        self._clicks: dict[int, torch.Tensor] = {}  # by thread: the clicks (B,) of its batch (set_batch_clicks)
        self._warned_stride = False

    def set_batch_clicks(self, clicks: torch.Tensor | None) -> None:
        """The clicks (B,) of the examples of the batch this thread trains next (the CTR
        statistics' clicks, see the module docstring): each is clamped to [0, 1]. None clears them
        (then a forward counts shows only). The trainer sets them around the forward pass."""
        ident = threading.get_ident()
        if clicks is None:
            self._clicks.pop(ident, None)
            return
        # (B,) on the host, where the keys' statistics are counted (labels on a GPU: copied down)
        self._clicks[ident] = to_host(clicks.detach().reshape(-1)).to(torch.float32).clamp(0.0, 1.0)

    def _batch_clicks(self, batch: int) -> torch.Tensor | None:
        """This thread's clicks (B,), if set and made for a batch of `batch` examples."""
        clicks = self._clicks.get(threading.get_ident())
        if clicks is not None and clicks.numel() != batch:
            if not self._warned_stride:
                logger.warning("%s: the batch has %d clicks but the model passed %d examples' features; the "
                               "servers count shows only for them (clicks 0)", self._where, clicks.numel(), batch)
                self._warned_stride = True
            return None
        return clicks

    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Send the pulls of `features`, the KJT this thread passes to forward() next (see the module
        docstring). A no-op with a communicator that cannot start a pull (sync, GEO)."""
        communicator = self._communicator()
        if not isinstance(communicator, StartsPulls) or isinstance(communicator, FusedBagLookup) or self._prefetch_off:
            return
        start = communicator.pull_start
        self.drop_prefetch()
        if self._missing(features):
            self._turn_prefetch_off()  # these are not the features forward() will get
            return
        parts, batch = self._split(features)
        pulls = []
        for table, keys, _ in parts:
            uniq, inverse = unique_keys(keys)  # (U,), (N,)
            pulls.append((uniq, inverse, start(table.name, uniq)))
        self._prefetched[threading.get_ident()] = _Prefetch(features, parts, batch, pulls)

    def drop_prefetch(self) -> None:
        """Forget this thread's prefetch, if any; its replies are awaited (a dead server still fails)."""
        pending = self._prefetched.pop(threading.get_ident(), None)
        if pending is not None:
            for _, _, rows in pending.pulls:
                rows()

    def _turn_prefetch_off(self) -> None:
        # The model builds its own KJT from the batch (e.g. skip-gram pairs): prefetching the batch's
        # features would double the pulls, or pull keys nobody trains.
        logger.warning("%s: the model does not pass the batch's features to this collection as they are; "
                       "prefetch is off for it", self._where)
        self._prefetch_off = True

    def _take_prefetch(self, features: KeyedJaggedTensor) -> _Prefetch | None:
        """This thread's prefetch if it was made for exactly `features`; any other is dropped."""
        pending = self._prefetched.get(threading.get_ident())
        if pending is None:
            return None
        if pending.features is not features:
            self._turn_prefetch_off()
            self.drop_prefetch()
            return None
        del self._prefetched[threading.get_ident()]
        return pending

    def bind(self, communicator) -> None:
        """Sets (or replaces) the communicator: Fleet binds it in init_worker; evaluation may bind a
        reader of the servers' values. A communicator that keeps a local replica (GEO) places it on
        this collection's device."""
        if isinstance(communicator, PlacesReplicas):
            communicator.place_replicas(self.device)
        self.communicator = communicator

    def table_dims(self) -> dict[str, int]:
        """PS table name -> D: the sparse tables a cluster must create for this collection."""
        return {t.name: t.dim for t in self.ps_tables}

    def _communicator(self):
        if self.communicator is None:
            raise PSError(f"{self._where}: no communicator is bound; call fleet.init_worker() (or bind()) "
                          "before the first forward pass")
        return self.communicator

    def _missing(self, features: KeyedJaggedTensor) -> list[str]:
        """This collection's features that the KJT lacks."""
        keys = features.keys()
        return [f for f in self.feature_names if f not in keys]

    def _split(self, features: KeyedJaggedTensor):
        """Per PS table: (table, salted keys (N,), lengths (Fg*B,)) in table order, on the host (a KJT a
        model built on the GPU from its batch is copied down: keys are hashed and pulled there)."""
        if features.device().type != "cpu":
            features = features.to(torch.device("cpu"))
        keys = features.keys()
        missing = self._missing(features)
        if missing:
            raise ConfigError(f"{self._where}: the batch has no sparse features {missing}; batch features are "
                              f"{keys}; align dataset.schema and the model's tables")
        if keys != self.feature_names:
            features = features.permute([keys.index(f) for f in self.feature_names])
        values, lengths = features.values(), features.lengths()
        batch = features.stride()
        length_per_key = lengths.view(len(self.feature_names), batch).sum(1)  # (F,)
        out, start_f, start_v = [], 0, 0
        for table in self.ps_tables:
            nf = len(table.features)
            counts = length_per_key[start_f:start_f + nf]  # (Fg,)
            n = int(counts.sum())
            raw = values[start_v:start_v + n]  # (N,)
            salts = torch.repeat_interleave(table.salts, counts, output_size=n)  # (N,)
            out.append((table, splitmix64(raw, salts), lengths[start_f * batch:(start_f + nf) * batch]))
            start_f += nf
            start_v += n
        return out, batch

    def _parts(self, features: KeyedJaggedTensor):
        """(_split's parts, batch, per part its prefetched (uniq, inverse, rows()) or None)."""
        pending = self._take_prefetch(features)
        if pending is not None:
            return pending.parts, pending.batch, pending.pulls
        parts, batch = self._split(features)
        return parts, batch, [None] * len(parts)

    def _counts_statistics(self, communicator, table: PSTable) -> bool:
        """Whether pushes of `table` carry shows and clicks (the communicator asks for them)."""
        return isinstance(communicator, CountsStatistics) and bool(communicator.counts_statistics(table.name))

    def _occurrence_clicks(self, table: PSTable, lengths: torch.Tensor, batch: int, n: int) -> torch.Tensor | None:
        """(N,) the click of the example of each of the N keys, or None without clicks.
        lengths (Fg*B,) feature-major: bag f*B + b belongs to example b."""
        clicks = self._batch_clicks(batch)  # (B,)
        if clicks is None:
            return None
        return torch.repeat_interleave(clicks.repeat(len(table.features)), lengths, output_size=n)  # (N,)

    def _rows(self, table: PSTable, keys: torch.Tensor, pulled=None, lengths: torch.Tensor | None = None,
              batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Pulled unique rows (U, D), differentiable into a push when training, and the inverse (N,).
        pulled: a prefetch's (uniq, inverse, rows()) for these keys; lengths (Fg*B,), batch B: which
        example each key belongs to (the clicks of the push's statistics)."""
        communicator = self._communicator()
        if pulled is None:
            uniq, inverse = unique_keys(keys)  # (U,), (N,)
            rows = communicator.pull(table.name, uniq)  # (U, D)
        else:
            uniq, inverse, wait = pulled
            rows = wait()  # (U, D)
        if rows.shape != (uniq.numel(), table.dim):
            raise PSError(f"{self._where}: pull of table {table.name} returned {tuple(rows.shape)} for "
                          f"{uniq.numel()} keys of dim {table.dim}; the servers' table has another width")
        if self.training and torch.is_grad_enabled():
            shows = clicks = None
            if self._counts_statistics(communicator, table):
                each = None if lengths is None else self._occurrence_clicks(table, lengths, batch, inverse.numel())
                shows, clicks = key_statistics(inverse, uniq.numel(), each)  # (U,) each
            rows = _PushGrads.apply(to_device(rows, self.device).requires_grad_(True), communicator.push,
                                    table.name, uniq, shows, clicks)
        else:
            rows = to_device(rows, self.device)
        return rows, to_device(inverse, self.device)  # (U, D), (N,) where the pooling runs


class PSEmbeddingBagCollection(_PSCollectionBase):
    """torchrec EmbeddingBagCollection over a parameter server (sum pooling).

    Args:
        tables: torchrec EmbeddingBagConfigs (num_embeddings is informational: the PS grows).
        communicator: a `recps.ps.modes.Communicator`; None binds later (`bind`, Fleet).
        prefix: PS table names are f"{prefix}_d{D}".

    forward(features: KJT of raw int64 keys) -> KeyedTensor, keys = the features in table
    order, values (B, F*D).
    """

    def __init__(self, tables: Sequence[EmbeddingBagConfig], communicator=None, prefix: str = "embedding",
                 device: str | torch.device = "cpu") -> None:
        super().__init__(tables, communicator, prefix, "PSEmbeddingBagCollection", device)
        self._configs = list(tables)
        config_order = [f for c in self._configs for f in c.feature_names]
        self._dims = {f: int(c.embedding_dim) for c in self._configs for f in c.feature_names}
        self._out_keys = config_order
        # Column permutation from group order back to torchrec's config order (None: already so).
        if config_order == self.feature_names:
            self._columns = None
        else:
            starts, pos = {}, 0
            for f in self.feature_names:
                starts[f] = pos
                pos += self._dims[f]
            self._columns = torch.cat([torch.arange(starts[f], starts[f] + self._dims[f]) for f in config_order])

    @classmethod
    def from_features(cls, feature_names: Sequence[str], embedding_dim: int, communicator=None,
                      num_embeddings: int = 2**31 - 1, prefix: str = "embedding",
                      device: str | torch.device = "cpu") -> "PSEmbeddingBagCollection":
        """One table `t_<feature>` of width `embedding_dim` per feature (as the local collection)."""
        configs = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=int(embedding_dim), num_embeddings=num_embeddings,
                                      feature_names=[f]) for f in feature_names]
        return cls(configs, communicator, prefix, device)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._configs)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        parts, batch, pulled = self._parts(features)
        communicator = self._communicator()
        fused = self.training and torch.is_grad_enabled() and isinstance(communicator, FusedBagLookup)
        pooled = []
        for (table, keys, lengths), pull in zip(parts, pulled):
            offsets = _offsets(lengths)  # (Fg*B+1,)
            if fused:
                stats = {}
                if self._counts_statistics(communicator, table):  # per occurrence: the replica sums them per key
                    each = self._occurrence_clicks(table, lengths, batch, keys.numel())  # (N,) or None
                    stats["shows"], stats["clicks"] = key_statistics(None, keys.numel(), each)  # (N,) each
                pooled.append(communicator.lookup_bags(table.name, keys, offsets, len(table.features), **stats))
                continue
            rows, inverse = self._rows(table, keys, pull, lengths, batch)
            offsets = to_device(offsets, self.device)
            pooled.append(pool_sum(rows, inverse, offsets, len(table.features)))  # (B, Fg*D)
        values = pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=1)  # (B, F*D) group order
        if self._columns is not None:
            if not same_device(self._columns.device, values.device):
                self._columns = self._columns.to(values.device)  # once: it stays there
            values = values.index_select(1, self._columns)  # (B, F*D) config order
        return KeyedTensor(keys=self._out_keys, length_per_key=[self._dims[f] for f in self._out_keys],
                           values=values)


class PSEmbeddingCollection(_PSCollectionBase):
    """torchrec EmbeddingCollection over a parameter server (no pooling; sequence models).

    forward(features: KJT of raw int64 keys) -> {feature: JaggedTensor(values (N_f, D), lengths (B,))}.
    """

    def __init__(self, tables: Sequence[EmbeddingConfig], communicator=None, prefix: str = "embedding",
                 device: str | torch.device = "cpu") -> None:
        super().__init__(tables, communicator, prefix, "PSEmbeddingCollection", device)
        self._configs = list(tables)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self._configs)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        parts, batch, pulled = self._parts(features)
        out: dict[str, JaggedTensor] = {}
        for (table, keys, lengths), pull in zip(parts, pulled):
            rows, inverse = self._rows(table, keys, pull, lengths, batch)
            looked = rows.index_select(0, inverse)  # (N, D); backward scatters into (U, D)
            per_feature = lengths.view(len(table.features), batch)  # (Fg, B) on the host
            sizes = per_feature.sum(1).tolist()
            on_device = to_device(per_feature, self.device)  # (Fg, B) with the values
            for feature, chunk, lens in zip(table.features, looked.split(sizes), on_device):
                out[feature] = JaggedTensor(values=chunk, lengths=lens)
        return {f: out[f] for c in self._configs for f in c.feature_names}
