"""EASE: the closed-form item-item linear baseline (Steck, "Embarrassingly Shallow Autoencoders for
Sparse Data", WWW 2019, https://arxiv.org/abs/1905.03375).

With X (U, I) the 0/1 user-item matrix of the training interactions, EASE learns B (I, I) minimising
||X - X B||² + λ||B||² subject to diag(B) = 0. The solution is closed form:

    P = (XᵀX + λI)⁻¹,   B = I - P · diag(1 / diag(P)),   i.e. B_ij = -P_ij / P_jj (i != j), B_jj = 0

and a user's scores are its history row times B: scores = X_u B (U, I). Items no training row
touches have zero rows and columns in XᵀX, so their block of P is I/λ and of B exactly 0: the solve
runs over the touched items only (the result is the same, the cost falls with their number).

λ is chosen on a validation split (`choose_l2`: each user's latest training interactions held out,
NDCG@k of the ranking over the rest, seen items excluded), never on the test split.

Inputs ("interactions"): a pair (users, items) of index arrays (torch, numpy or lists; one entry per
interaction, duplicates count once), or a CSR-like object with `offsets` (U + 1,) and `items` (V,)
(e.g. recps.pipeline.data.Csr): row u holds items[offsets[u]:offsets[u + 1]].

Shapes: U users, I items, T touched items (I_t), K list length, V interactions.

Memory: the Gram matrix and its inverse are (T, T): MovieLens latest-small's ~9k items need
2 x 9k² x 8 B ≈ 1.3 GB in float64 (the default; float32 halves it).

Example:
    >>> import torch
    >>> users, items = torch.tensor([0, 0, 1, 1, 2]), torch.tensor([0, 1, 0, 1, 2])
    >>> model = EASE.fit((users, items), n_items=4, l2=1.0)
    >>> model.weights.diagonal().abs().max().item()   # no item predicts itself
    0.0
    >>> model.recommend((torch.tensor([0]), torch.tensor([0])), k=2, n_users=1).tolist()   # seen 0: 1 first
    [[1, 2]]
"""

from __future__ import annotations

import io
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from recps.errors import ConfigError, DataError
from recps.pipeline.data import Csr, FunnelData, csr_from_pairs, latest_share

__all__ = ["EASE", "EaseBaseline", "choose_l2", "fit_ease", "holdout_latest", "ndcg_at_k", "pairs"]

log = logging.getLogger("recps.pipeline")


def pairs(interactions: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(users (V,), items (V,)) int64 of a (users, items) pair or a CSR-like object (offsets, items)."""
    if hasattr(interactions, "offsets") and hasattr(interactions, "items"):
        offsets = torch.as_tensor(np.asarray(interactions.offsets), dtype=torch.int64)
        items = torch.as_tensor(np.asarray(interactions.items), dtype=torch.int64)
        users = torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets.diff())
        return users, items
    try:
        users, items = interactions
    except (TypeError, ValueError):
        raise DataError(f"EASE: interactions of type {type(interactions).__name__}; pass (users, items) index "
                        "arrays or a CSR-like object with offsets and items") from None
    users = torch.as_tensor(np.asarray(users), dtype=torch.int64)
    items = torch.as_tensor(np.asarray(items), dtype=torch.int64)
    if users.shape != items.shape or users.dim() != 1:
        raise DataError(f"EASE: users {tuple(users.shape)} and items {tuple(items.shape)} must be 1-d and of one "
                        "length (one entry per interaction)")
    return users, items


def _matrix(interactions: Any, n_items: int, n_users: int | None, dtype: torch.dtype) -> torch.Tensor:
    """X (U, I) 0/1 of the interactions; U = n_users or the largest user index + 1."""
    users, items = pairs(interactions)
    if items.numel() and (int(items.min()) < 0 or int(items.max()) >= n_items):
        raise DataError(f"EASE: item indices span [{int(items.min())}, {int(items.max())}] but n_items={n_items}; "
                        "number items 0..n_items-1")
    rows = int(n_users) if n_users is not None else (int(users.max()) + 1 if users.numel() else 0)
    x = torch.zeros(rows, n_items, dtype=dtype)
    x[users, items] = 1.0
    return x


class EASE:
    """The fitted item-item weights B (I, I), zero diagonal; `scores` / `recommend` for user histories."""

    def __init__(self, weights: torch.Tensor, l2: float) -> None:
        self.weights = weights  # (I, I)
        self.l2 = float(l2)

    @property
    def n_items(self) -> int:
        return int(self.weights.shape[0])

    @classmethod
    def fit(cls, interactions: Any, n_items: int, l2: float, dtype: torch.dtype = torch.float64) -> "EASE":
        """B = I - P·diag(1/diag P), P = (XᵀX + λI)⁻¹, over the items the interactions touch (the others'
        rows and columns of B are 0); λ = `l2` > 0."""
        if not float(l2) > 0:
            raise ConfigError(f"EASE: l2={l2}; use a value > 0 (the closed form inverts XᵀX + l2·I)")
        x = _matrix(interactions, int(n_items), None, dtype)  # (U, I)
        touched = torch.nonzero(x.sum(0) > 0).flatten()  # (T,)
        xt = x[:, touched]  # (U, T)
        gram = xt.t() @ xt  # (T, T)
        gram.diagonal().add_(float(l2))
        p = torch.cholesky_inverse(torch.linalg.cholesky(gram))  # (T, T), symmetric positive definite
        b = -p / p.diagonal().unsqueeze(0)  # (T, T): B_ij = -P_ij / P_jj
        b.diagonal().zero_()
        weights = torch.zeros(int(n_items), int(n_items), dtype=dtype)  # (I, I)
        weights[touched.unsqueeze(1), touched.unsqueeze(0)] = b
        return cls(weights, float(l2))

    def scores(self, history: Any, n_users: int | None = None) -> torch.Tensor:
        """(U, I) scores X_u B of the users' histories (interactions as in the module doc; U = n_users or
        the largest user index + 1)."""
        if isinstance(history, torch.Tensor) and history.dim() == 2:
            x = history.to(self.weights.dtype)  # (U, I) given as a matrix
        else:
            x = _matrix(history, self.n_items, n_users, self.weights.dtype)  # (U, I)
        return x @ self.weights  # (U, I)

    def recommend(self, history: Any, k: int, n_users: int | None = None,
                  exclude: Any = "history") -> torch.Tensor:
        """(U, K) the top-k items of each user by score, items of `exclude` (default: the history itself;
        None: nothing) never listed (-1 pads a list when fewer items are left); ties go to the lower index."""
        s = self.scores(history, n_users)  # (U, I)
        if isinstance(exclude, str) and exclude != "history":
            raise ConfigError(f"EASE: exclude={exclude!r}; use 'history', None or interactions to exclude")
        if exclude is not None:
            if isinstance(exclude, str) and isinstance(history, torch.Tensor) and history.dim() == 2:
                seen = history != 0  # (U, I)
            else:
                seen = _matrix(history if isinstance(exclude, str) else exclude, self.n_items, s.shape[0],
                               torch.bool)  # (U, I)
            s = s.masked_fill(seen, -math.inf)
        # stable descending order: lower item index first among equal scores
        top = torch.argsort(-s, dim=1, stable=True)[:, :k]  # (U, K)
        return torch.where(s.gather(1, top) == -math.inf, torch.full_like(top, -1), top)  # -1: nothing left


def ndcg_at_k(lists: torch.Tensor, positives: Any, k: int, n_items: int) -> float:
    """Mean over users with a positive of DCG@k / IDCG@k with binary gains (the funnel's definition,
    recps.metrics.funnel.ndcg_at_k): lists (U, K) item indices; positives: interactions of the same U rows."""
    users, items = pairs(positives)
    u = lists.shape[0]
    wanted = torch.zeros(u, n_items, dtype=torch.bool)
    wanted[users, items] = True
    hit = wanted.gather(1, lists[:, :k].clamp(min=0)) & (lists[:, :k] >= 0)  # (U, k)
    discount = 1.0 / torch.log2(torch.arange(2, k + 2, dtype=torch.float64))  # (k,)
    dcg = hit.to(torch.float64) @ discount[: hit.shape[1]]  # (U,)
    npos = wanted.sum(1)  # (U,)
    ideal = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(discount, 0)])  # (k + 1,)
    has = npos > 0
    if not bool(has.any()):
        raise DataError("EASE: no user has a positive to evaluate; check the validation split")
    return float((dcg[has] / ideal[npos[has].clamp(max=k)]).mean())


def holdout_latest(users: Any, items: Any, fraction: float, keep: Any = None) -> tuple[tuple, tuple]:
    """Splits interactions given in each user's time order (rows grouped by user, oldest first, as the
    funnel's training rows are) into (earlier, latest): each user's last `fraction` (at least one, and
    never all of a user's rows) go to `latest`; `keep` (V,) bool limits `latest` to those rows (e.g. the
    ratings >= 4 as positives). Returns ((users, items) earlier, (users, items) latest)."""
    if not 0.0 < float(fraction) < 1.0:
        raise ConfigError(f"EASE: validation fraction={fraction}; use a value in (0, 1)")
    users, items = pairs((users, items))
    if users.numel() and bool((users.diff() < 0).any()):
        raise DataError("EASE: holdout_latest needs rows grouped by user in time order (sorted by user)")
    latest = torch.from_numpy(latest_share(users, fraction))  # (V,) a user keeps at least one earlier row
    chosen = latest if keep is None else latest & torch.as_tensor(np.asarray(keep), dtype=torch.bool)
    return (users[~latest], items[~latest]), (users[chosen], items[chosen])


def choose_l2(train: Any, validation: Any, n_items: int, grid: Sequence[float], k: int = 10,
              dtype: torch.dtype = torch.float64) -> tuple[float, dict[float, float]]:
    """The λ of `grid` whose EASE, fitted on `train`, ranks `validation`'s items best by NDCG@k (the users'
    `train` items excluded from their lists). Both are interactions (module doc) over the same user
    indices; only these two splits are read, so the test split cannot leak into the choice.
    Returns (best λ (the smallest on a tie), {λ: NDCG@k})."""
    if not grid:
        raise ConfigError("EASE: choose_l2 got an empty grid; pass the l2 values to try, e.g. [100, 300, 1000]")
    val_users, val_items = pairs(validation)
    tr_users, tr_items = pairs(train)
    n_users = int(max(int(tr_users.max()) if tr_users.numel() else -1,
                      int(val_users.max()) if val_users.numel() else -1)) + 1
    asked = torch.unique(val_users)  # (R,) the users with a validation positive
    history = _matrix((tr_users, tr_items), int(n_items), n_users, dtype)[asked]  # (R, I)
    remap = torch.full((n_users,), -1, dtype=torch.int64)
    remap[asked] = torch.arange(asked.numel())
    positives = (remap[val_users], val_items)
    results: dict[float, float] = {}
    for l2 in sorted(float(v) for v in grid):
        model = EASE.fit((tr_users, tr_items), n_items, l2, dtype=dtype)
        lists = model.recommend(history, k)  # (R, k), the users' training items excluded
        results[l2] = ndcg_at_k(lists, positives, k, int(n_items))
    best = max(results, key=lambda v: (results[v], -v))
    return best, results


@dataclass
class EaseBaseline:
    """EASE fitted on a funnel's training interactions (`fit_ease`) over the items they touch (at most
    max_items, the most interacted), numbered 0..T-1 (`items`: their funnel item ids (T,)); `history`
    holds each user's interactions in those numbers (its query row)."""

    model: EASE
    items: torch.Tensor  # (T,) funnel item id of each modelled item
    history: Csr  # over users: the modelled items each user interacted with (0..T-1)
    l2: float
    validation: dict[float, float]
    seconds: float

    def _numbers(self, size: int) -> torch.Tensor:
        """(size,) int64: EASE's number of each funnel item id below size, -1 for one it does not model."""
        top = int(self.items.max()) + 1 if self.items.numel() else 0
        local = torch.full((max(size, top),), -1, dtype=torch.int64)
        local[self.items] = torch.arange(self.items.numel())
        return local

    def _queries(self, users: torch.Tensor) -> torch.Tensor:
        """(B, T) the users' 0/1 interaction rows over the modelled items: EASE's X_u."""
        rows = self.history.rows(users)
        x = torch.zeros(users.numel(), self.model.n_items, dtype=self.model.weights.dtype)  # (B, T)
        x[rows.row_ids(), rows.items] = 1.0
        return x

    def lists(self, data: FunnelData, users: torch.Tensor, n: int) -> torch.Tensor:
        """(B, n) each user's top n by EASE (funnel item ids), training-seen items excluded (-1 pads)."""
        seen = data.seen.rows(users)
        seen_local = self._numbers(data.num_items)[seen.items]  # (V,) -1: an item EASE does not model (never listed)
        modelled = seen_local >= 0
        top = self.model.recommend(self._queries(users), n,
                                   exclude=(seen.row_ids()[modelled], seen_local[modelled]))  # (B, n)
        out = torch.where(top >= 0, self.items[top.clamp(min=0)], torch.full_like(top, -1))
        if out.shape[1] < n:
            out = torch.cat([out, torch.full((out.shape[0], n - out.shape[1]), -1, dtype=out.dtype)], 1)
        return out

    def to_bytes(self) -> bytes:
        """The fitted model as the bytes of a torch file (`from_bytes` reads it back)."""
        buf = io.BytesIO()
        torch.save({"weights": self.model.weights, "l2": self.l2, "items": self.items, "offsets": self.history.offsets,
                    "history": self.history.items, "validation": self.validation, "seconds": self.seconds}, buf)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, blob: bytes) -> "EaseBaseline":
        saved = torch.load(io.BytesIO(blob), weights_only=True)
        return cls(EASE(saved["weights"], saved["l2"]), saved["items"], Csr(saved["offsets"], saved["history"]),
                   saved["l2"], saved["validation"], saved["seconds"])

    def pair_scores(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """(N,) float32 X_u B[:, i] of pairs (users (N,), items (N,) funnel ids): how strongly the user's
        interactions point at the item (0 for an item EASE does not model)."""
        out = torch.zeros(users.numel(), dtype=torch.float32)
        if not items.numel():
            return out
        col = self._numbers(int(items.max()) + 1)[items]  # (N,) EASE's number of each item, -1: not modelled
        ok = col >= 0
        who, row = torch.unique(users[ok], return_inverse=True)  # (Ub,), (N',)
        which, slot = torch.unique(col[ok], return_inverse=True)  # (Ib,), (N',)
        scores = self._queries(who) @ self.model.weights[:, which]  # (Ub, Ib)
        out[ok] = scores[row, slot].to(torch.float32)
        return out


def fit_ease(data: FunnelData, settings: dict[str, Any], k: int, purpose: str = "EASE baseline",
             l2: float | None = None) -> EaseBaseline:
    """EASE on data's training interactions: λ chosen on each user's latest validation_fraction of them
    (rows in each user's time order: train_time when the data has it, else the data's row order), then
    fitted on all of them. The held-out requests are never read. `purpose` names the fit in the log.
    `l2`: that λ, not chosen again (one fit instead of one per grid value and one; `validation` is then {})."""
    start = time.perf_counter()
    dtype = getattr(torch, settings["dtype"])
    users, items = data.train_user, data.train_item
    keep = data.train_labels[:, 0] > 0  # the validation positives: clicks (MovieLens: rating >= click_rating)
    times = getattr(data, "train_time", None)
    if settings["interactions"] == "clicks":
        users, items, times = users[keep], items[keep], (times[keep] if times is not None else None)
        keep = keep[keep]
    counts = torch.bincount(items, minlength=data.num_items)  # (I,)
    modelled = torch.argsort(counts, descending=True, stable=True)[: min(int(settings["max_items"]),
                                                                          int((counts > 0).sum()))]
    modelled = torch.sort(modelled).values  # (T,) funnel ids of the modelled items
    local = torch.full((data.num_items,), -1, dtype=torch.int64)
    local[modelled] = torch.arange(modelled.numel())
    inside = local[items] >= 0
    users, items, keep = users[inside], local[items[inside]], keep[inside]
    times = times[inside] if times is not None else None
    if times is not None:  # each user's rows in time order (ties: the data's order)
        order = torch.from_numpy(np.lexsort((np.arange(users.numel()), times.numpy(), users.numpy())))
    else:
        order = torch.argsort(users, stable=True)
    users, items, keep = users[order], items[order], keep[order]
    t = int(modelled.numel())
    given = l2 is not None
    grid: dict[float, float] = {}
    if not given:
        train, validation = holdout_latest(users, items, float(settings["validation_fraction"]), keep=keep)
        l2, grid = choose_l2(train, validation, t, settings["grid"], k=k, dtype=dtype)
    model = EASE.fit((users, items), t, float(l2), dtype=dtype)
    history = csr_from_pairs(users, items, data.num_users)
    seconds = time.perf_counter() - start
    if given:
        log.info("%s: l2 %g given (not chosen again), %d items, %.1f s", purpose, l2, t, seconds)
    else:
        log.info("%s: l2 %g chosen on the training data's validation split (ndcg@%d %s), %d items, %.1f s",
                 purpose, l2, k, {v: round(x, 4) for v, x in grid.items()}, t, seconds)
    return EaseBaseline(model, modelled, history, l2, grid, seconds)
