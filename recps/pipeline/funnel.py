"""The trained funnel as one object: stage models over their exported rows, the recall index, the cascade.

A stage's export (`export_stage`, written by worker 0 after the stage trained) holds what the servers
held for it: every row of its tables that the data's keys reach (pulled through a read-only view of the
servers) and its dense parameters. `load_stage` rebuilds the stage's zoo model over a PS-backed collection
bound to those rows (`Snapshot`: a pull from memory, no server), so the evaluation path, the next stage's
training data and `recps.pipeline.recommend` all score with the same code:

    recall   user vectors (B, E) -> index.search(k=keep, exclude=seen)       -> (B, K0) items
    coarse   score (B, K0) pairs -> top keep                                  -> (B, K1)
             (a two-tower ranker: each user's and item's tower once, then a dot product per pair)
    fine     score (B, K1) pairs (its objectives, weighted) -> top keep       -> (B, K2)
    fusion   score (B, K2) pairs, dense inputs = the `scores` stages' outputs -> top top_n

Shapes: B users, K candidates per user, E vector width, T a stage's objectives.
"""

from __future__ import annotations

import inspect
import io
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from hydra.utils import get_object, instantiate
from omegaconf import OmegaConf
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recps import fs as rfs
from recps.config import MODEL_ENGINE_KEYS
from recps.errors import DataError, PSError
from recps.pipeline.counts import COLUMNS, Counts
from recps.pipeline.stages import ITEM_CF, StageSpec
from recps.pipeline.data import HISTORY_FEATURES, Csr, FunnelData, pair_examples
from recps.ps.embedding import PSEmbeddingBagCollection, PSEmbeddingCollection
from recps.ps.fleet import ReadsServers

__all__ = ["Snapshot", "SharedBagCollection", "StageModel", "Funnel", "FunnelResult", "build_stage_model", "export_stage", "load_stage",
           "stage_collection", "sequence_collection", "history_target", "pair_keys", "pair_times", "candidate_times", "score_inputs",
           "pairs_per_call"]

log = logging.getLogger("recps.pipeline")

EXPORT_DIR = "funnel"  # <run dir>/funnel/<stage>.pt, <run dir>/funnel/items.ann
ITEM_CF_EXPORT = "item_cf.pt"  # <run dir>/funnel/item_cf.pt: the EASE a stage's item_cf score reads (if one does)
PAIRS_PER_CALL = 131072  # (user, item) pairs a stage model scores at a time
# ... and history positions, for a stage reading behaviour history (each pair holds up to history_length of
# them, every one through the target attention: pairs per call = this // history_length)
POSITIONS_PER_CALL = 1 << 19
EXPORT_ROWS = 65536  # keys per feature pulled at a time by an export


def stage_collection(spec: StageSpec):
    """The stage's PS-backed bag collection: one table per input feature, namespaced by the stage's name
    (`<stage>_d<D>`); a feature in `inputs.share` is the owner stage's table instead (SharedBagCollection).
    A stage whose model reads behaviour history (it takes an `embedding_collection`: models.DIN, models.BST)
    gets an unpooled PSEmbeddingCollection (`sequence_collection`)."""
    if spec.sequence:
        return sequence_collection(spec)
    if spec.share:
        return SharedBagCollection(spec)
    return PSEmbeddingBagCollection.from_features(spec.features, int(spec.model.embedding_dim), prefix=spec.name)


def history_target(feature: str) -> str | None:
    """The target feature a history feature's keys are keys of (history_item_id -> item_id,
    history_category -> category); None for the flags (history_click, history_long_view: keys 0 / 1)."""
    target = feature[len("history_"):] if feature.startswith("history_") else None
    return target if target in ("item_id", "category") else None


def sequence_collection(spec: StageSpec) -> PSEmbeddingCollection:
    """The unpooled PS-backed collection of a history-reading stage (tables `<stage>_d<D>`): one torchrec
    table per feature, except that a history feature and its target share one (`t_item_id` serves item_id
    and history_item_id: one row per item, whether it is the candidate or in the history, the DIN paper's
    setting; models/_behaviour.py)."""
    dim = int(spec.model.embedding_dim)
    groups: dict[str, list[str]] = {}
    for f in spec.features:
        target = history_target(f)
        owner = target if target is not None and target in spec.features else f
        groups.setdefault(owner, []).append(f)
    configs = [EmbeddingConfig(name=f"t_{owner}", embedding_dim=dim, num_embeddings=2**31 - 1, feature_names=names)
               for owner, names in groups.items()]
    return PSEmbeddingCollection(configs, prefix=spec.name)


class SharedBagCollection(torch.nn.Module):
    """A stage's bag collection when it shares earlier stages' tables (`inputs.share: {feature: stage}`).

    Its own features are a PSEmbeddingBagCollection of tables `<stage>_d<D>`, trained in the stage's mode;
    each shared feature is looked up in the owner's table `<owner>_d<D>` with the owner's salt (the same
    torchrec table name `t_<feature>`), so its rows ARE the owner's rows on the servers: one table, no copy.
    A server table has one mode's update rule (the owner's) and the owner trained it: the sharing stage
    reads those rows frozen, through a read-only view of the servers (`ServerReader`, `Snapshot` once
    exported), never pushes to them, and creates no table for them (`table_dims` lists its own).

    forward(KJT of the stage's features) -> KeyedTensor, keys = spec.features, values (B, F*D). No prefetch
    (the async stage's own rows are pulled in the forward pass)."""

    def __init__(self, spec: StageSpec) -> None:
        super().__init__()
        dim = int(spec.model.embedding_dim)
        self.features, self.dim = list(spec.features), dim
        self.share = dict(spec.share)
        self.own = PSEmbeddingBagCollection.from_features([f for f in spec.features if f not in spec.share], dim,
                                                          prefix=spec.name)
        owners = list(dict.fromkeys(spec.share.values()))
        self.owners = owners
        self.frozen = torch.nn.ModuleList(
            PSEmbeddingBagCollection.from_features([f for f in spec.features if spec.share.get(f) == o], dim,
                                                   prefix=o) for o in owners)
        self.input_device = torch.device("cpu")
        self.device = torch.device("cpu")
        self.train(self.training)
        parts = [*self.own.feature_names, *(f for c in self.frozen for f in c.feature_names)]
        self._order = torch.tensor([parts.index(f) for f in self.features])  # (F,) parts' order -> spec's

    @property
    def communicator(self):
        return self.own.communicator

    def bind(self, communicator) -> None:
        """The stage's own tables get `communicator`; the shared ones a read-only view: `communicator`
        itself when it is one (mode "read": ServerReader, Snapshot, an export's recorder), else the
        training communicator's `server_reader()` (recps.ps.modes.abilities.ReadsServers)."""
        self.own.bind(communicator)
        if isinstance(communicator, ReadsServers):
            reader = communicator.server_reader()
        elif communicator.mode == "read":
            reader = communicator
        else:
            raise PSError(f"the tables shared from {self.owners}: a {type(communicator).__name__} gives no read-only view "
                          "of its servers (ReadsServers); bind a communicator of recps.ps.modes or a read-only view")
        for c in self.frozen:
            c.bind(reader)

    def train(self, mode: bool = True) -> "SharedBagCollection":
        super().train(mode)
        for c in self.frozen:
            c.eval()  # frozen: its rows are not differentiable, nothing is pushed
        return self

    def table_dims(self) -> dict[str, int]:
        """The tables this stage creates and trains: its own (the shared ones are their owners')."""
        return self.own.table_dims()

    def shared_tables(self) -> dict[str, str]:
        """feature -> the owner's PS table it reads."""
        return {f: t for c in self.frozen for t in c.table_dims() for f in c.feature_names}

    def embedding_bag_configs(self):
        by_feature = {c.feature_names[0]: c for p in (self.own, *self.frozen) for c in p.embedding_bag_configs()}
        return [by_feature[f] for f in self.features]

    def set_batch_clicks(self, clicks) -> None:
        self.own.set_batch_clicks(clicks)

    def drop_prefetch(self) -> None:
        self.own.drop_prefetch()

    def forward(self, features):
        keys = features.keys()
        parts = [self.own, *self.frozen]
        order = [keys.index(f) for p in parts for f in p.feature_names]
        split = features.permute(order).split([len(p.feature_names) for p in parts])
        pooled = [self.own(split[0]).values()]  # (B, Fo*D): the stage's own rows, trained in its mode
        with torch.no_grad():  # frozen: the owners' rows are read, never differentiated, never pushed
            pooled += [c(kjt).values() for c, kjt in zip(self.frozen, split[1:])]  # (B, Fs*D) each
        values = torch.cat(pooled, 1)  # (B, F*D) in parts' order
        b = values.shape[0]
        values = values.view(b, len(self.features), self.dim).index_select(1, self._order.to(values.device))
        return KeyedTensor(keys=list(self.features), length_per_key=[self.dim] * len(self.features),
                           values=values.reshape(b, -1))  # (B, F*D) in the stage's feature order


def dense_width(spec: StageSpec, specs: Sequence[StageSpec]) -> int:
    """I: the stage's dense inputs, one column per output of each stage in its `scores` (item_cf: one), then
    three per counting feature (recps.pipeline.counts.COLUMNS)."""
    by_name = {s.name: s for s in specs}
    return sum(1 if s == ITEM_CF else outputs_of(by_name[s]) for s in spec.scores) + len(COLUMNS) * len(spec.counts)


def outputs_of(spec: StageSpec) -> int:
    """T: the probabilities a stage outputs per pair (its model's num_tasks, else 1)."""
    return int(spec.model.get("num_tasks") or 1)


def build_stage_model(spec: StageSpec, collection, num_dense: int) -> torch.nn.Module:
    """The stage's zoo model (its `_target_`) over `collection`."""
    node = OmegaConf.to_container(spec.model, resolve=True)
    for key in MODEL_ENGINE_KEYS:
        node.pop(key, None)
    injected: dict[str, Any] = {"embedding_collection" if spec.sequence else "embedding_bag_collection": collection}
    if "dense_in_features" in inspect.signature(get_object(node["_target_"])).parameters:
        injected["dense_in_features"] = num_dense
    return instantiate(node, **injected, _convert_="all")


class Snapshot:
    """A pull-only communicator over exported rows: table -> (sorted salted keys (K,), rows (K, D)).
    A key that was never trained reads as zeros, as from the servers' read-only view."""

    mode = "read"

    def __init__(self, tables: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.tables = tables

    def pull(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        sorted_keys, rows = self.tables[table]
        pos = torch.searchsorted(sorted_keys, keys).clamp(max=max(0, sorted_keys.numel() - 1))  # (K,)
        found = sorted_keys[pos] == keys if sorted_keys.numel() else torch.zeros_like(keys, dtype=torch.bool)
        out = rows[pos] if sorted_keys.numel() else torch.zeros(keys.numel(), rows.shape[1])
        return torch.where(found.unsqueeze(1), out, torch.zeros_like(out))  # (K, D)

    def push(self, table: str, keys: torch.Tensor, grads: torch.Tensor) -> None:
        raise DataError(f"an exported stage is read-only: a push to {table!r} came from a model in training mode")


class _Recorder:
    """Wraps a read-only communicator and keeps every (table, keys, rows) it answered."""

    mode = "read"

    def __init__(self, inner) -> None:
        self.inner = inner
        self.seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def pull(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        rows = self.inner.pull(table, keys)
        self.seen.setdefault(table, []).append((keys.clone(), rows.clone()))
        return rows

    def push(self, table: str, keys: torch.Tensor, grads: torch.Tensor) -> None:
        raise DataError(f"export: a push to {table!r} while exporting")

    def tables(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for table, parts in self.seen.items():
            keys = torch.cat([k for k, _ in parts])
            rows = torch.cat([r for _, r in parts])
            uniq, order = np.unique(keys.numpy(), return_index=True)
            out[table] = (torch.from_numpy(uniq), rows[torch.from_numpy(order)])
        return out


def _key_table(data: FunnelData, f: str) -> torch.Tensor:
    """(K,) every key feature f takes: its user or item table; a history feature its target's (a flag: 0, 1)."""
    if f in HISTORY_FEATURES:
        target = history_target(f)
        return data.item_features[target] if target is not None else torch.tensor([0, 1])
    return data.user_features[f] if f in data.user_features else data.item_features[f]


def _all_keys(data: FunnelData, features: Sequence[str], start: int, stop: int):
    """A KJT of rows start..stop-1 of every feature's key table (feature f's rows past its end: empty)."""
    tables = [_key_table(data, f) for f in features]
    width = stop - start
    rows = torch.arange(start, stop)
    lengths = torch.cat([(rows < t.numel()).to(torch.int64) for t in tables])  # (F * width,)
    values = torch.cat([t[start:stop] for t in tables])
    return KeyedJaggedTensor(keys=list(features), values=values, lengths=lengths, stride=width)


def _key_rows(data: FunnelData, features: Sequence[str]) -> int:
    return max(int(_key_table(data, f).numel()) for f in features)


def export_stage(spec: StageSpec, model: torch.nn.Module, collection, data: FunnelData, num_dense: int) -> bytes:
    """The stage as the servers hold it (call with `collection` bound to a read-only view of the servers and
    the model's dense parameters holding the servers' values): its rows for every key of the data and its
    dense state, as the bytes of a torch file."""
    reader = collection.communicator
    recorder = _Recorder(reader)
    collection.bind(recorder)
    try:
        with torch.no_grad():
            total = _key_rows(data, spec.features)
            for start in range(0, total, EXPORT_ROWS):  # bounded memory: the keys in chunks
                collection(_all_keys(data, spec.features, start, min(total, start + EXPORT_ROWS)))
    finally:
        collection.bind(reader)
    state = {k: v for k, v in model.state_dict().items()}
    buffer = io.BytesIO()
    torch.save({"stage": spec.name, "features": list(spec.features), "num_dense": num_dense,
                "tables": recorder.tables(), "state": state}, buffer)
    return buffer.getvalue()


def load_stage(spec: StageSpec, blob: bytes | str) -> "StageModel":
    """A StageModel from `export_stage`'s bytes (or a path / URL to them)."""
    raw = rfs.read_bytes(blob) if isinstance(blob, str) else blob
    saved = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    if list(saved["features"]) != list(spec.features):
        raise DataError(f"{spec.where}: the export was trained on features {saved['features']}, the config names "
                        f"{list(spec.features)}; recommend with the run's own config")
    collection = stage_collection(spec)
    collection.bind(Snapshot(saved["tables"]))
    model = build_stage_model(spec, collection, int(saved["num_dense"]))
    model.load_state_dict(saved["state"])
    model.eval()
    return StageModel(spec, model)


def pair_times(spec: StageSpec, data: FunnelData, users: torch.Tensor, times: torch.Tensor | None) -> torch.Tensor | None:
    """The times (N,) a stage's history features are taken as of: `times`, else (serving, evaluation) the
    held-out request's (`data.request_times`: the whole training history); None for a stage without them."""
    if not any(f in HISTORY_FEATURES for f in spec.features):
        return None
    return times if times is not None else data.request_times(users)


def candidate_times(data: FunnelData, users: torch.Tensor, seed: int) -> torch.Tensor | None:
    """(N,) a time for each unexposed candidate row of `users` (N,) a ranker trains on as a negative: the time
    of one of the user's training exposures drawn at random (seeded), so the candidates' histories are
    distributed as the exposures' are (the held-out request's whole history would tell them apart); None
    when the data has no times."""
    if data.train_time is None or users.numel() == 0:
        return None
    order = torch.argsort(data.train_user, stable=True)  # (E,) exposures grouped by user
    counts = torch.bincount(data.train_user, minlength=data.num_users)  # (U,)
    starts = torch.cumsum(counts, 0) - counts
    draw = torch.rand(users.numel(), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    pick = starts[users] + (draw * counts[users].clamp(min=1)).floor().to(torch.int64)  # (N,)
    return data.train_time[order[pick.clamp(max=max(0, order.numel() - 1))]]


def pair_keys(spec: StageSpec, data: FunnelData, users: torch.Tensor, items: torch.Tensor,
              dense: torch.Tensor | None = None, times: torch.Tensor | None = None):
    """The Batch of (user, item) pairs (N,) for the stage's model; history features as of `times` (N,)
    (default: the held-out request's time, `pair_times`)."""
    return pair_examples(data, spec.features, users, items, dense=dense,
                         times=pair_times(spec, data, users, times)).to_batch()


TOWER_ROWS = 65536  # users or items per tower call when a two-tower stage encodes the whole data


@dataclass
class StageModel:
    """A trained stage, scoring (user, item) pairs.

    A two-tower stage (a model with encode() and score_pairs(), no dense inputs) encodes every user and
    every item of the data once (its towers read one side's features each) and scores a pair as the dot
    product of the two vectors: the values its forward gives, at O(U + I) tower calls instead of O(pairs)."""

    spec: StageSpec
    model: torch.nn.Module
    _towers: tuple | None = field(default=None, repr=False, compare=False)  # (data, (U, E), (I, E))

    @property
    def is_two_tower(self) -> bool:
        return hasattr(self.model, "encode") and hasattr(self.model, "score_pairs") and not self.spec.reads_dense

    @torch.no_grad()
    def towers(self, data: FunnelData) -> tuple[torch.Tensor, torch.Tensor]:
        """(every user's query vector (U, E), every item's candidate vector (I, E)), computed once per data."""
        if self._towers is None or self._towers[0] is not data:
            users = torch.cat([self.vectors(data, users=u) for u in torch.arange(data.num_users).split(TOWER_ROWS)])
            items = torch.cat([self.vectors(data, items=i) for i in torch.arange(data.num_items).split(TOWER_ROWS)])
            self._towers = (data, users, items)
        return self._towers[1], self._towers[2]

    @torch.no_grad()
    def outputs(self, data: FunnelData, users: torch.Tensor, items: torch.Tensor,
                dense: torch.Tensor | None = None, times: torch.Tensor | None = None) -> torch.Tensor:
        """(N, T) probabilities of pairs (users (N,), items (N,)); `times` (N,): as of when (history
        features; None: the held-out request's time)."""
        if users.numel() == 0:
            return torch.zeros(0, outputs_of(self.spec))
        if self.is_two_tower:
            queries, candidates = self.towers(data)
            logits = self.model.score_pairs(queries[users], candidates[items])  # (N,)
            return torch.sigmoid(logits.float()).unsqueeze(1)  # (N, 1)
        batch = pair_keys(self.spec, data, users, items, dense, times)
        logits = self.model(batch.dense, batch.sparse)  # (N,) or (N, T)
        return torch.sigmoid(logits.reshape(users.numel(), -1).float())  # (N, T)

    def rank_score(self, probs: torch.Tensor) -> torch.Tensor:
        """(N,) the score the stage ranks by: its objectives' probabilities weighted (score_weights)."""
        weights = self.spec.score_weights
        if weights is None:
            return probs[:, 0]
        return probs @ torch.tensor(weights, dtype=probs.dtype)  # (N,)

    @torch.no_grad()
    def vectors(self, data: FunnelData, users: torch.Tensor | None = None, items: torch.Tensor | None = None):
        """Retrieval stages: query vectors of `users` (B, E) or candidate vectors of `items` (C, E)."""
        if users is not None:
            batch = pair_keys(self.spec, data, users, torch.zeros_like(users))
            return self.model.encode(batch.dense, batch.sparse)[0]
        batch = pair_keys(self.spec, data, torch.zeros_like(items), items)
        return self.model.encode(batch.dense, batch.sparse)[1]


@dataclass
class FunnelResult:
    """What the cascade did for B users: per stage its kept items (B, K_s) (-1 pads), their rank scores,
    and its seconds."""

    users: torch.Tensor
    kept: dict[str, torch.Tensor] = field(default_factory=dict)
    scores: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # (B, K_s, T) probabilities of kept items
    seconds: dict[str, float] = field(default_factory=dict)
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # (B, K_in) what each ranker received
    input_scores: dict[str, torch.Tensor] = field(default_factory=dict)  # (B, K_in) its scores of them


class Funnel:
    """The stages in order over one data set: `run(users)` sends users through them (see the module doc).

    `stages`: StageModel by name (a prefix of `specs` may be given: `run` stops at the last one present);
    `index`: the recall stage's ItemIndex over the item vectors; `item_cf`: EASE fitted on `data`'s training
    rows (recps.pipeline.ease.EaseBaseline), for the stages whose scores read item_cf; `counts`: stage ->
    the Counts its counting features read (recps.pipeline.counts: the servers' statistics as of the time the
    funnel serves, e.g. the end of the previous pass)."""

    def __init__(self, specs: Sequence[StageSpec], stages: dict[str, StageModel], index, data: FunnelData,
                 item_cf: Any = None, counts: dict[str, Counts] | None = None) -> None:
        self.specs = [s for s in specs if s.name in stages]
        self.stages, self.index, self.data, self.item_cf = stages, index, data, item_cf
        self.counts = dict(counts or {})

    def dense_inputs(self, spec: StageSpec, users: torch.Tensor, items: torch.Tensor,
                     times: torch.Tensor | None = None) -> torch.Tensor:
        """(N, I) what a stage with `scores` or `counts` reads of pairs: each `scores` stage's probabilities as
        logits (`score_inputs`; its own `scores` in turn), item_cf's score as it is, then its counting
        features' columns (`count_inputs`)."""
        by_name = {x.name: x for x in self.specs}
        dense = torch.cat([self._item_cf(spec, users, items).unsqueeze(1) if s == ITEM_CF
                           else score_inputs(self.score_pairs(by_name[s], users, items, times=times)[0])
                           for s in spec.scores] + [self.count_inputs(spec, users, items)], 1)  # (N, I)
        return per_request(dense, users) if spec.score_norm == "request" else dense

    def count_inputs(self, spec: StageSpec, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """(N, 3F) the stage's counting features of pairs, from the Counts the funnel was given for it."""
        if not spec.counts:
            return torch.zeros(int(users.numel()), 0)
        counts = self.counts.get(spec.name)
        if counts is None:
            raise DataError(f"pipeline.stages.{spec.name}.inputs.counts={spec.counts}, but this funnel holds no "
                            "counts for the stage; build the Funnel with counts={stage: recps.pipeline.counts."
                            "read_counts(...)} (a run folder's funnel/counts.pt)")
        return counts.columns(self.data, spec.counts, users, items)

    def _item_cf(self, spec: StageSpec, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        if self.item_cf is None:
            raise DataError(f"pipeline.stages.{spec.name}.inputs.scores reads {ITEM_CF}, but this funnel has no "
                            "EASE fitted on its data; build the Funnel with item_cf=recps.pipeline.ease.fit_ease(...)")
        return self.item_cf.pair_scores(users, items)  # (N,)

    def seen_of(self, users: torch.Tensor):
        from recps.pipeline.ann import Seen  # deferred: faiss, only where the recall index is built or read

        part = self.data.seen.rows(users)
        return Seen(part.offsets.numpy(), part.items.numpy())

    def score_pairs(self, spec: StageSpec, users: torch.Tensor, items: torch.Tensor,
                    dense: torch.Tensor | None = None, times: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs (N, T), rank scores (N,)) of the stage for pairs; a stage with `scores` gets the upstream
        stages' probabilities of the same pairs as its dense inputs (`dense` (N, I) when the caller has them).
        `times` (N,): the pairs' times, as of which history features are read (training rows: their
        exposure's time, never later; None: the held-out request's, the whole training history)."""
        if spec.reads_dense and dense is None:  # before any chunking: a request's candidates are normalised together
            dense = self.dense_inputs(spec, users, items, times)
        chunk = pairs_per_call(spec, self.data)
        if users.numel() > chunk:  # bounded memory: the pairs in chunks
            cut = lambda x, i: None if x is None else x[i:i + chunk]  # noqa: E731
            parts = [self.score_pairs(spec, users[i:i + chunk], items[i:i + chunk], cut(dense, i), cut(times, i))
                     for i in range(0, users.numel(), chunk)]
            return torch.cat([p for p, _ in parts]), torch.cat([r for _, r in parts])
        stage = self.stages[spec.name]
        probs = stage.outputs(self.data, users, items, dense, times)
        return probs, stage.rank_score(probs)

    def rank(self, spec: StageSpec, users: torch.Tensor, candidates: torch.Tensor, keep: int | None = None,
             upstream: FunnelResult | None = None):
        """Score candidates (B, K) (-1 pads) with the stage; keep its best `keep` (default spec.keep).
        `upstream`: the run so far, whose stages' probabilities of these candidates (the same values scoring
        them again would give) are the dense inputs of a stage with `scores`.
        Returns (kept (B, k), kept scores (B, k), kept probs (B, k, T), scores of all candidates (B, K))."""
        b, k = candidates.shape
        keep = min(spec.keep if keep is None else keep, k)
        valid = candidates >= 0
        flat_users = users.repeat_interleave(k)[valid.flatten()]
        dense = None
        stages_read = [s for s in spec.scores if s != ITEM_CF]
        if spec.reads_dense and upstream is not None and all(
                s in upstream.outputs and self.stages[s].spec.upstream is not None for s in stages_read):
            gathered: dict[str, torch.Tensor] | None = {}
            for s in stages_read:  # rankers above this stage: their probabilities of its candidates
                ids, probs = upstream.kept[s], upstream.outputs[s]  # (B, K_s), (B, K_s, T_s)
                match = (candidates.unsqueeze(2) == ids.unsqueeze(1)) & valid.unsqueeze(2)  # (B, K, K_s)
                if not bool((match.any(2) | ~valid).all()):
                    gathered = None  # a candidate that stage did not keep: score the pairs again
                    break
                where = match.to(torch.int8).argmax(2)  # (B, K): each candidate's place in that stage's list
                kept = probs.gather(1, where.unsqueeze(2).expand(-1, -1, probs.shape[2]))  # (B, K, T_s)
                gathered[s] = score_inputs(kept[valid])  # (N, T_s)
            parts = None if gathered is None else [  # item_cf computed only once the gather holds
                self._item_cf(spec, flat_users, candidates[valid]).unsqueeze(1) if s == ITEM_CF else gathered[s]
                for s in spec.scores] + [self.count_inputs(spec, flat_users, candidates[valid])]  # (N, 3F) last
            dense = torch.cat(parts, 1) if parts else None  # (N, I)
            if dense is not None and spec.score_norm == "request":
                dense = per_request(dense, flat_users)
        probs_v, score_v = self.score_pairs(spec, flat_users, candidates[valid], dense)
        scores = torch.full((b, k), -torch.inf)
        scores[valid] = score_v
        probs = torch.zeros(b, k, probs_v.shape[1])
        probs[valid] = probs_v
        top = torch.topk(scores, keep, dim=1)  # (B, keep)
        kept = candidates.gather(1, top.indices)
        kept = torch.where(torch.isfinite(top.values), kept, torch.full_like(kept, -1))
        return kept, top.values, probs.gather(1, top.indices.unsqueeze(2).expand(-1, -1, probs.shape[2])), scores

    def retrieve(self, users: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Recall: (B, keep) unseen items and their scores from the index."""
        first = self.specs[0]
        queries = self.stages[first.name].vectors(self.data, users=users)  # (B, E)
        ids, scores = self.index.search(queries.numpy().astype(np.float32), keep, exclude=self.seen_of(users))
        return torch.from_numpy(ids), torch.from_numpy(scores.astype(np.float32))

    def run(self, users: torch.Tensor, until: str | None = None, record_inputs: bool = False,
            skip: set[str] | frozenset = frozenset()) -> FunnelResult:
        """Users (B,) through the stages (up to `until`, included); a stage in `skip` passes on what it
        received (the baseline without coarse)."""
        out = FunnelResult(users=users)
        for spec in self.specs:
            start = time.perf_counter()
            if spec.name in skip:
                kept, scores = out.kept[spec.upstream], out.scores[spec.upstream]
            elif spec.upstream is None:
                kept, scores = self.retrieve(users, spec.keep)
                out.outputs[spec.name] = scores.unsqueeze(2)
            else:
                candidates = out.kept[spec.upstream]
                kept, scores, probs, all_scores = self.rank(spec, users, candidates, upstream=out)
                out.outputs[spec.name] = probs
                if record_inputs:
                    out.inputs[spec.name], out.input_scores[spec.name] = candidates, all_scores
            out.kept[spec.name], out.scores[spec.name] = kept, scores
            out.seconds[spec.name] = time.perf_counter() - start
            if spec.name == until:
                break
        return out

    @property
    def final(self) -> str:
        return self.specs[-1].name


def pairs_per_call(spec: StageSpec, data: FunnelData) -> int:
    """How many (user, item) pairs the stage's model scores at a time: PAIRS_PER_CALL, or for a stage reading
    behaviour history POSITIONS_PER_CALL // history_length (its memory grows with the positions, every one through
    the target attention: the baseline without coarse sends all of recall's candidates to fine at once)."""
    if not any(f in HISTORY_FEATURES for f in spec.features):
        return PAIRS_PER_CALL
    return max(1, min(PAIRS_PER_CALL, POSITIONS_PER_CALL // max(1, int(data.history_length))))


def score_inputs(probs: torch.Tensor) -> torch.Tensor:
    """(N, I) the dense inputs a stage with `scores` reads: the upstream stages' probabilities as logits
    (a retrieval stage's σ(cosine / temperature) sits near 1 for every candidate it kept; its logit keeps
    the spread)."""
    return torch.logit(probs.clamp(1e-6, 1.0 - 1e-6))


def per_request(dense: torch.Tensor, users: torch.Tensor) -> torch.Tensor:
    """(N, I) each column of `dense` standardised over the rows of one user (a request's candidates):
    (x - mean) / sd, 0 where a request has one candidate or a column is constant in it."""
    _, group = torch.unique(users, return_inverse=True)  # (N,)
    g = int(group.max()) + 1 if group.numel() else 0
    x = dense.to(torch.float64)
    count = torch.bincount(group, minlength=g).clamp(min=1).unsqueeze(1).to(torch.float64)  # (G, 1)
    mean = torch.zeros(g, x.shape[1], dtype=torch.float64).index_add_(0, group, x) / count  # (G, I)
    centred = x - mean[group]  # (N, I)
    sd = (torch.zeros(g, x.shape[1], dtype=torch.float64).index_add_(0, group, centred * centred) / count).sqrt()
    return torch.where(sd[group] > 1e-12, centred / sd[group].clamp(min=1e-12), 0.0).to(dense.dtype)


def build_index(vectors: torch.Tensor, config: dict | None):
    """The recall stage's ItemIndex over item vectors (I, E) (ids 0..I-1)."""
    from recps.pipeline.ann import AnnConfig, ItemIndex  # deferred: faiss, only where the recall index is built

    cfg = AnnConfig(**(config or {}))
    return ItemIndex.build(vectors.numpy().astype(np.float32), np.arange(vectors.shape[0], dtype=np.int64), cfg)


def csr_positives(positives: Csr, rows: torch.Tensor) -> torch.Tensor:
    """(B, P) held-out positives of requests `rows`, -1 padded."""
    return positives.rows(rows).padded(-1)
