"""SASRec alone: the zoo's sequential model as a full-catalogue baseline beside the funnel (issue 29.6).

What it is for: a funnel run says whether its recall -> rank stages beat the best single model of the
zoo on its own. That model is SASRec (Kang & McAuley, "Self-Attentive Sequential Recommendation",
ICDM 2018, https://arxiv.org/abs/1808.09781; models/sasrec.py, named here by its `_target_` as conf/
names every model): it reads each user's training interactions in time order and ranks the whole
catalogue for the next one. It is trained here in-process (plain torch, Adam, a torchrec
EmbeddingCollection, no parameter server, no Hydra config tree) on the same split as the funnel, with
the loss of recps.tasks.NextItemTask (softmax cross-entropy over every item at every position).

    fit_sasrec(data, settings, k)      data's training interactions (each user's, in time order: train_time,
                                       ties in the data's row order), as sequences windowed to max_len:
       1. validation: each user's latest `validation_fraction` of training rows held out
          (recps.pipeline.ease.holdout_latest, as EASE's λ), positives = those clicked; a model trained
          on the earlier rows is scored after every epoch: NDCG@k of its full-catalogue top k after the
          user's earlier rows (last max_len), those earlier items excluded
       2. the epochs: the best validation NDCG@k (the fewest on a tie; `patience` epochs without a
          better one stop early)
       3. refit: a new model (same seed) on all training rows for that many epochs
    SasrecBaseline.lists(data, users, n)   (B, n) each user's top n after the user's whole training
                                       sequence (last max_len), training-seen items (data.seen) excluded

The held-out requests (data.test_users, data.test_positives) are never read by the fit.

A user without training interactions has no query for SASRec: its list is empty (all -1), counted as a
miss, never filled from another model.

Shapes: U users, C items (the catalogue, data.num_items), E interactions, L = max_len, W training
windows, N positions of a batch (sum of its windows' lengths), B users of a call, D embedding dim.

Settings (`pipeline.baselines.sasrec`, every key optional; SASREC_DEFAULTS): enabled; interactions,
"exposures" (every training row, e.g. every MovieLens rating) or "clicks" (label 0 > 0); max_len, the
most recent interactions a sequence holds (longer histories train as several windows of max_len);
embedding_dim, num_blocks, num_heads, dropout (models.SASRec's); lr (Adam), batch_size (windows per
step), max_epochs, patience; validation_fraction; seed (initialisation, dropout and window order;
the global torch RNG is restored afterwards).

How the defaults were chosen and what they measured: benchmarks/RESULTS.md, "SASRec alone".
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recps.errors import ConfigError, DataError
from recps.metrics import funnel as fm
from recps.pipeline.data import Csr, FunnelData, csr_from_pairs
from recps.pipeline.ease import holdout_latest

__all__ = ["SASREC_DEFAULTS", "MODEL", "SasrecBaseline", "fit_sasrec", "sasrec_settings"]

log = logging.getLogger("recps.pipeline")

MODEL = "models.SASRec"  # the zoo model, by _target_ (recps never imports models)
FEATURE = "item"
WHERE = "pipeline.baselines.sasrec"

# pipeline.baselines.sasrec: module docstring. Chosen on the validation split of MovieLens latest-small's training
# rows (never on its held-out requests) within a fit budget of 3 minutes on one core (benchmarks/RESULTS.md,
# "SASRec alone": 11 settings tried; batch_size 16 best and cheapest; more epochs overfit).
SASREC_DEFAULTS: dict[str, Any] = {"enabled": True, "interactions": "exposures", "max_len": 50, "embedding_dim": 64,
                                   "num_blocks": 2, "num_heads": 1, "dropout": 0.2, "lr": 0.001, "batch_size": 16,
                                   "max_epochs": 6, "patience": 3, "validation_fraction": 0.2, "seed": 0}

_INTEGERS = {"max_len": 1, "embedding_dim": 1, "num_blocks": 1, "num_heads": 1, "batch_size": 1, "max_epochs": 1,
             "patience": 1, "seed": 0}  # key -> its least value


def sasrec_settings(given: Mapping[str, Any] | None) -> dict[str, Any]:
    """SASREC_DEFAULTS updated by `given` (pipeline.baselines.sasrec), checked: a ConfigError names the key,
    the value and the fix."""
    given = dict(given or {})
    unknown = [k for k in given if k not in SASREC_DEFAULTS]
    if unknown:
        raise ConfigError(f"{WHERE}.{unknown[0]}={given[unknown[0]]!r} is read by nothing; use one of "
                          f"{', '.join(SASREC_DEFAULTS)}")
    out = {**SASREC_DEFAULTS, **given}
    for key, least in _INTEGERS.items():
        value = out[key]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
            raise ConfigError(f"{WHERE}.{key}={value!r}; use an integer >= {least}")
        out[key] = int(value)
    if out["interactions"] not in ("exposures", "clicks"):
        raise ConfigError(f"{WHERE}.interactions={out['interactions']!r}; use exposures (every training row) or "
                          "clicks (the clicked ones)")
    if not _number(out["validation_fraction"]) or not 0.0 < float(out["validation_fraction"]) < 1.0:
        raise ConfigError(f"{WHERE}.validation_fraction={out['validation_fraction']!r}; use a value in (0, 1): each "
                          "user's latest share of TRAINING rows the epochs are chosen on")
    if not _number(out["dropout"]) or not 0.0 <= float(out["dropout"]) < 1.0:
        raise ConfigError(f"{WHERE}.dropout={out['dropout']!r}; use a value in [0, 1)")
    if not _number(out["lr"]) or not float(out["lr"]) > 0:
        raise ConfigError(f"{WHERE}.lr={out['lr']!r}; use a learning rate > 0, e.g. 0.001")
    if out["embedding_dim"] % out["num_heads"]:
        raise ConfigError(f"{WHERE}.num_heads={out['num_heads']} does not divide embedding_dim="
                          f"{out['embedding_dim']}; pick a divisor")
    return out


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


@dataclass
class SasrecBaseline:
    """SASRec fitted on a funnel's training interactions (`fit_sasrec`): `history` holds each user's
    interactions in time order (its query), `epochs` those chosen on validation (`validation`: epoch ->
    NDCG@k there), `seconds` the whole fit's."""

    model: nn.Module
    history: Csr  # over users, each row in time order (not deduplicated)
    epochs: int
    validation: dict[int, float]
    seconds: float
    settings: dict[str, Any]

    def lists(self, data: FunnelData, users: torch.Tensor, n: int) -> torch.Tensor:
        """(B, n) int64 each user's top n over the whole catalogue by SASRec after its training sequence (last
        max_len), training-seen items (data.seen) excluded; -1 pads (no item left, or no history)."""
        users = users.to(torch.int64)
        return _top(self.model, self.history.rows(users), data.seen.rows(users), n, data.num_items,
                    self.settings["max_len"])


def fit_sasrec(data: FunnelData, settings: Mapping[str, Any] | None, k: int) -> SasrecBaseline:
    """SASRec on data's training interactions: the epochs chosen by NDCG@k on each user's latest
    validation_fraction of them, then a refit on all of them (module docstring). The held-out requests are
    never read."""
    start = time.perf_counter()
    s = sasrec_settings(settings)
    validation = _validation(data, s, k)
    best = max(validation, key=lambda e: (validation[e], -e))
    users, items, _ = _interactions(data, s["interactions"])
    everything = _sequences(users, items, data.num_users)
    model, _ = _train(everything, data.num_items, s, best, None)
    seconds = time.perf_counter() - start
    log.info("SASRec alone: %d epochs chosen on the training data's validation split (ndcg@%d %s), %d items, "
             "%.1f s", best, k, {e: round(v, 4) for e, v in validation.items()}, data.num_items, seconds)
    return SasrecBaseline(model, everything, best, validation, seconds, s)


def _validation(data: FunnelData, s: Mapping[str, Any], k: int) -> dict[int, float]:
    """{epoch: NDCG@k} of a model trained on each user's earlier training rows, on its latest validation_fraction
    (the clicked ones), the earlier items excluded from its list; epochs until `patience` after the best."""
    users, items, clicked = _interactions(data, s["interactions"])
    (early_users, early_items), (val_users, val_items) = holdout_latest(users, items, s["validation_fraction"],
                                                                        keep=clicked)
    if val_users.numel() == 0:
        raise DataError(f"SASRec alone: no user of {data.name!r} has a clicked row among its latest "
                        f"{s['validation_fraction']} of training rows; nothing to choose the epochs on (raise "
                        f"{WHERE}.validation_fraction, or use interactions=clicks)")
    early = _sequences(early_users, early_items, data.num_users)
    asked = torch.unique(val_users)  # (R,) the users with a validation positive
    remap = torch.full((data.num_users,), -1, dtype=torch.int64)
    remap[asked] = torch.arange(asked.numel())
    positives = csr_from_pairs(remap[val_users], val_items, int(asked.numel()))
    early_asked = early.rows(asked)
    mine = remap[early_users] >= 0  # (E',) earlier rows of the users with a validation positive
    exclude = csr_from_pairs(remap[early_users[mine]], early_items[mine], int(asked.numel()))

    def validate(model: nn.Module) -> float:
        lists = _top(model, early_asked, exclude, k, data.num_items, s["max_len"])  # (R, k)
        pair = fm.ndcg_at_k(lists, positives.offsets, positives.items, k, "ndcg")["ndcg"]
        return float(pair[0] / pair[1])

    return _train(early, data.num_items, s, s["max_epochs"], validate)[1]


def _interactions(data: FunnelData, which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(users, items, clicked) (E,) of data's training rows ("clicks": the clicked ones only), grouped by
    user, each user's in time order (train_time; ties and no times: the data's row order)."""
    users, items = data.train_user.to(torch.int64), data.train_item.to(torch.int64)
    clicked = data.train_labels[:, 0] > 0  # (E,) the validation positives (MovieLens: rating >= click_rating)
    times = data.train_time
    if which == "clicks":
        users, items, times = users[clicked], items[clicked], (times[clicked] if times is not None else None)
        clicked = clicked[clicked]
    if times is not None:
        order = torch.from_numpy(np.lexsort((np.arange(users.numel()), times.numpy(), users.numpy())))
    else:
        order = torch.argsort(users, stable=True)
    return users[order], items[order], clicked[order]


def _sequences(users: torch.Tensor, items: torch.Tensor, num_users: int) -> Csr:
    """Csr over users of items given grouped by user (in their order, duplicates kept)."""
    offsets = torch.zeros(num_users + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(users, minlength=num_users), 0, out=offsets[1:])
    return Csr(offsets, items)


def _tail(seq: Csr, length: int) -> Csr:
    """Each row's last `length` items, in order."""
    lengths = seq.offsets.diff().clamp(max=length)  # (B,)
    starts = seq.offsets[1:] - lengths  # (B,)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    take = torch.repeat_interleave(starts - offsets[:-1], lengths) + torch.arange(int(offsets[-1]))  # (V,)
    return Csr(offsets, seq.items[take])


def _model(num_items: int, s: Mapping[str, Any]) -> nn.Module:
    table = EmbeddingConfig(name="t_item", embedding_dim=s["embedding_dim"], num_embeddings=num_items,
                            feature_names=[FEATURE])
    collection = EmbeddingCollection(tables=[table], device=torch.device("cpu"))
    return instantiate({"_target_": MODEL, "max_len": s["max_len"], "num_blocks": s["num_blocks"],
                        "num_heads": s["num_heads"], "dropout": float(s["dropout"])},
                       embedding_collection=collection)


def _windows(seq: Csr, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts (W,), lengths (W,)): each user's transitions (the item at p -> the item at p + 1) cut into
    windows of at most `length` inputs from the latest backwards (the oldest window may be shorter); a window
    reads inputs items[start:start + len], targets one further."""
    counts = seq.offsets.diff()  # (U,)
    steps = (counts - 1).clamp(min=0)  # (U,) transitions
    per = (steps + length - 1) // length  # (U,) windows
    owner = torch.repeat_interleave(torch.arange(counts.numel()), per)  # (W,)
    first = torch.cumsum(per, 0) - per  # (U,)
    j = torch.arange(owner.numel()) - first[owner]  # (W,) 0: the latest window
    stop = seq.offsets[owner] + steps[owner] - j * length  # (W,) one past its last input
    begin = torch.maximum(seq.offsets[owner], stop - length)  # (W,)
    return begin, stop - begin


def _train(seq: Csr, num_items: int, s: Mapping[str, Any], epochs: int,
           validate: Callable[[nn.Module], float] | None) -> tuple[nn.Module, dict[int, float]]:
    """(model, {epoch: validate(model)}): a new SASRec trained `epochs` epochs on the windows of `seq`, its RNG
    seeded by s["seed"] (the global one restored after). With `validate`, called after each epoch, training
    stops `patience` epochs after the best; without, the dict is empty."""
    begin, lengths = _windows(seq, s["max_len"])  # (W,), (W,)
    if begin.numel() == 0:
        raise DataError("SASRec alone: no user has two training interactions; nothing to learn the next item from")
    scores: dict[int, float] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s["seed"])
        model = _model(num_items, s)
        optimizer = torch.optim.Adam(model.parameters(), lr=float(s["lr"]))
        order_rng = torch.Generator().manual_seed(s["seed"])
        for epoch in range(1, epochs + 1):
            model.train()
            for part in torch.randperm(begin.numel(), generator=order_rng).split(s["batch_size"]):
                n = lengths[part]  # (b,)
                offsets = torch.zeros(part.numel() + 1, dtype=torch.int64)
                torch.cumsum(n, 0, out=offsets[1:])
                at = torch.repeat_interleave(begin[part] - offsets[:-1], n) + torch.arange(int(offsets[-1]))  # (N,)
                sparse = KeyedJaggedTensor.from_lengths_sync([FEATURE], seq.items[at], n)
                loss = F.cross_entropy(model(sparse), seq.items[at + 1])  # (N, C) scores, the next items
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            if validate is None:
                continue
            model.eval()
            with torch.no_grad():
                scores[epoch] = validate(model)
            log.info("SASRec alone: epoch %d, last loss %.4f, validation ndcg %.4f", epoch, float(loss.detach()),
                     scores[epoch])
            best = max(scores, key=lambda e: (scores[e], -e))
            if epoch - best >= s["patience"]:
                break
    return model.eval(), scores


@torch.no_grad()
def _top(model: nn.Module, history: Csr, exclude: Csr, n: int, num_items: int, max_len: int,
         rows: int = 64) -> torch.Tensor:
    """(B, n) the top n items after each row of `history` (its last max_len), `exclude`'s items never listed,
    -1 pads; `rows` rows scored at once (the model scores every position: rows x max_len x C floats)."""
    b = history.offsets.numel() - 1
    out = torch.full((b, n), -1, dtype=torch.int64)
    width = min(n, num_items)
    for part in torch.arange(b).split(rows):
        query = _tail(history.rows(part), max_len)
        lengths = query.offsets.diff()  # (b,)
        has = torch.nonzero(lengths > 0).flatten()  # rows with a history
        scores = torch.full((part.numel(), num_items), -math.inf)  # (b, C)
        if has.numel():
            query = query.rows(has)
            sparse = KeyedJaggedTensor.from_lengths_sync([FEATURE], query.items, query.offsets.diff())
            scores[has] = model(sparse)[query.offsets[1:] - 1]  # (N, C) -> each row's last position (b', C)
        ex = exclude.rows(part)
        scores[ex.row_ids(), ex.items] = -math.inf
        value, index = torch.topk(scores, width, dim=1)  # (b, width)
        out[part, :width] = torch.where(value > -math.inf, index, torch.full_like(index, -1))
    return out
