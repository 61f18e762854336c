"""Retrieval task: a softmax over in-batch and/or sampled candidates with the log-Q correction,
and evaluation that ranks the whole item catalogue.

References: Bengio and Senécal 2008 and Jean et al. 2015 (sampled softmax: subtract the log
of each candidate's sampling probability), Yi et al. 2019 (in-batch softmax with the same
log-Q correction, https://dl.acm.org/doi/10.1145/3298689.3346996), Yang et al. 2020 (mixed
in-batch and sampled negatives, https://dl.acm.org/doi/10.1145/3366424.3386195).

Models follow the retrieval protocol of models/_retrieval.py: `encode(dense, sparse)` ->
(queries, candidates) of every row from one lookup, `score(queries (B, ·), candidates (C, ·))`
-> logits (B, C), `score_pairs(queries (B, ·), candidates (B, ·))` -> (B,) (row b against
row b: the positives when there is no in-batch block). One training step, B rows and N
sampled negatives:

    batch ─┬─ (sampled | mixed) + N catalogue rows drawn from Q_s ∝ (count + 1)^alpha, item
           │  features only, appended as rows of the same KJT (one lookup for everything)
           └► model.encode ─► queries (B, ·), candidates (B + N, ·) ─► model.score ─► (B, B + N)
              (sampled: score_pairs for the B positives, score for the N negatives only)
    log-Q: a candidate's logit -= log(its expected count among the candidates):
           in-batch column j: log(B · Q(item_j)), Q from the batch's labels[:, log_q_index]
           sampled column j: log(N · Q_s(item_j))
    masks (-inf): in-batch columns that hold the row's own item (its duplicates), sampled
           accidental hits of the row's item
    output logits (B, 1 + B + N), or (B, 1 + B) / (B, 1 + N): column 0 the row's positive,
           then the negatives; loss = cross-entropy with target 0 (mean over rows)

`predict` is the softmax probability of the positive (B,) and `target` the label column
(all ones for interaction data): training reports' logloss is the loss; their AUC is
undefined (one class) and reads NaN. Retrieval quality comes from `evaluate`.

Evaluation (`evaluate(model, source, batch_size)`, a `RetrievalSource`): every catalogue item
is encoded once; each test query is scored against all C items; the user's training items
(other than its target) are excluded; the metrics are recall@K, NDCG@K, MRR over the
ranking (`recps.metrics.retrieval`, pessimistic ties) and "auc": the share of the
non-excluded items ranked below the target, per query, averaged; with `baseline`, the same
metrics of the most-popular ranking ("most_popular/recall@50", ...) for comparison.

Shapes: B batch, N sampled negatives, C catalogue items, K excluded (query, item) pairs.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recps.data.batch import Batch
from recps.errors import ConfigError, DataError
from recps.metrics.collection import MetricCollection, build_metric
from recps.metrics.retrieval import rank_scores

__all__ = ["RetrievalTask", "append_rows", "evaluate_ranking", "popularity_baseline", "NEGATIVES"]

NEGATIVES = ("in_batch", "sampled", "mixed")
_NEG_INF = float("-inf")


def append_rows(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The rows of `a` then those of `b` (same keys; `b` is reordered to `a`'s keys), stride Ba + Bb."""
    keys = list(a.keys())
    if list(b.keys()) != keys:
        missing = sorted(set(keys) - set(b.keys()))
        if missing:
            raise DataError(f"append_rows: the rows to append lack features {missing}")
        b = b.permute([list(b.keys()).index(k) for k in keys])
    la = a.lengths().view(len(keys), -1)  # (F, Ba)
    lb = b.lengths().view(len(keys), -1)  # (F, Bb)
    va = a.values().split(a.length_per_key())
    vb = b.values().split(b.length_per_key())
    values = torch.cat([v for pair in zip(va, vb) for v in pair])  # feature 0's a then b, feature 1's ...
    return KeyedJaggedTensor(keys=keys, values=values, lengths=torch.cat([la, lb], dim=1).reshape(-1),
                             stride=la.shape[1] + lb.shape[1])


def _catalogue_of(source: Any, who: str):
    catalogue = getattr(source, "catalogue", None)
    if catalogue is None or not hasattr(source, "query_batches"):
        raise ConfigError(
            f"{who}: the evaluation source {type(source).__name__} has no item catalogue; retrieval needs "
            "a RetrievalSource (recps.data.interactions), e.g. dataset=movielens"
        )
    return catalogue


def evaluate_ranking(scores_of: Callable[[Batch], torch.Tensor], source: Any, batch_size: int,
                     metrics: Sequence[str] = ("recall@50", "ndcg@10")) -> dict[str, float]:
    """Ranks the whole catalogue for every query of `source` (a RetrievalSource).

    Args:
        scores_of: batch -> scores (B, C) over the catalogue rows.
        metrics: recall@K / ndcg@K / mrr[@K] names, and "auc" (share of the non-excluded
            items ranked below the target).
    Returns {metric: value, "queries": count}.
    """
    catalogue = _catalogue_of(source, "evaluate_ranking")
    c = len(catalogue)
    names = [m for m in metrics if m != "auc"]
    collection = MetricCollection(names) if names else None
    auc_sum, queries = 0.0, 0
    for q in source.query_batches(batch_size):
        scores = scores_of(q.batch).detach().to(torch.float64, copy=True)  # (B, C), ours to write
        if scores.shape != (q.batch.batch_size, c):
            raise DataError(f"evaluate_ranking: scores have shape {tuple(scores.shape)}; expected "
                            f"(B, C) = {(q.batch.batch_size, c)}, a score per catalogue item")
        # Excluded items go below everything (finite: the metrics refuse inf).
        scores[q.exclude_rows, q.exclude_cols] = torch.finfo(torch.float64).min
        if collection is not None:
            collection.update(scores, q.targets)
        if "auc" in metrics:
            rank = rank_scores(scores, q.targets).rank  # (B,) 1-based, pessimistic ties
            valid = c - torch.bincount(q.exclude_rows, minlength=scores.shape[0]).to(torch.float64)  # (B,)
            auc_sum += float(((valid - rank) / (valid - 1).clamp(min=1)).sum())
        queries += scores.shape[0]
    if queries == 0:
        raise ConfigError("evaluate_ranking: the evaluation source holds no query; check the data split")
    out = dict(collection.compute()) if collection is not None else {}
    if "auc" in metrics:
        out["auc"] = auc_sum / queries
    out["queries"] = float(queries)
    return {m: out[m] for m in [*metrics, "queries"]}


def popularity_baseline(source: Any, batch_size: int = 4096,
                        metrics: Sequence[str] = ("recall@50", "ndcg@10")) -> dict[str, float]:
    """Most-popular: every query ranks the catalogue by training count (ties: catalogue order)."""
    catalogue = _catalogue_of(source, "popularity_baseline")
    c = len(catalogue)
    # A strict order: count first, then the lower catalogue row (a tie-break below one count).
    order = catalogue.counts.to(torch.float64) - torch.arange(c, dtype=torch.float64) / c  # (C,)
    return evaluate_ranking(lambda batch: order.expand(batch.batch_size, c), source, batch_size, metrics)


class RetrievalTask:
    """Softmax over in-batch / sampled / mixed candidates with the log-Q correction.

    Args:
        negatives: "in_batch" (the other rows' items), "sampled" (N items drawn from the
            catalogue, shared by the batch) or "mixed" (both).
        num_negatives: N for sampled / mixed.
        sampling_alpha: the sampled proposal is Q_s ∝ (training count + 1)^alpha: 0 uniform,
            1 the items' frequency.
        log_q_correction: subtract the log of each candidate's expected count (see module doc).
        item_feature: the KJT feature holding each row's item key (one per row).
        label_index: the label column of `target` (1 = an observed interaction).
        log_q_index: the label column holding log Q(item) of each row (in-batch correction).
        metrics: what `evaluate` reports: recall@K, ndcg@K, mrr[@K], auc.
        score_rows: queries scored against the catalogue at a time (bounds memory for models
            whose `score` builds (B, C, H) tensors, e.g. NCF).
        baseline: `evaluate` also reports the most-popular ranking's metrics, as
            "most_popular/<metric>", on the same queries and exclusions.
    """

    def __init__(
        self,
        negatives: str = "in_batch",
        num_negatives: int = 0,
        sampling_alpha: float = 0.0,
        log_q_correction: bool = True,
        item_feature: str = "item",
        label_index: int = 0,
        log_q_index: int = 1,
        metrics: Sequence[str] = ("recall@10", "recall@50", "ndcg@10", "ndcg@50", "mrr", "auc"),
        score_rows: int = 64,
        baseline: bool = True,
    ) -> None:
        if negatives not in NEGATIVES:
            raise ConfigError(f"task.negatives={negatives!r}; use one of {NEGATIVES}")
        if negatives != "in_batch" and int(num_negatives) < 1:
            raise ConfigError(f"task.negatives={negatives!r} with task.num_negatives={num_negatives}; "
                              "set num_negatives >= 1 (or negatives=in_batch)")
        if int(score_rows) < 1:
            raise ConfigError(f"task.score_rows={score_rows}; use a positive number of queries")
        pointwise = [m for m in metrics if m != "auc" and build_metric(m).kind != "retrieval"]
        if pointwise:
            raise ConfigError(f"task.metrics={list(metrics)}: {pointwise} are pointwise; evaluation ranks "
                              "items; use recall@K, ndcg@K, mrr or auc")
        self.negatives = negatives
        self.num_negatives = int(num_negatives) if negatives != "in_batch" else 0
        self.sampling_alpha = float(sampling_alpha)
        self.log_q_correction = bool(log_q_correction)
        self.item_feature = item_feature
        self.label_index = int(label_index)
        self.log_q_index = int(log_q_index)
        self.metrics = tuple(metrics)
        self.score_rows = int(score_rows)
        self.baseline = bool(baseline)
        self.catalogue = None
        self._proposal: torch.Tensor | None = None  # (C,) Q_s
        self._log_proposal: torch.Tensor | None = None  # (C,) log Q_s

    # ---- data ------------------------------------------------------------------------------

    def bind(self, data: Any) -> None:
        """Takes the item catalogue of prepared data (its train source's `catalogue`): sampled
        negatives are drawn from it. Called by the engine after the data is prepared."""
        catalogue = getattr(getattr(data, "train", None), "catalogue", None)
        if catalogue is None:
            if self.negatives != "in_batch":
                raise ConfigError(f"task.negatives={self.negatives!r} samples items from a catalogue, and this "
                                  "data set has none; use an interaction data set (dataset=movielens) or "
                                  "negatives=in_batch")
            return
        self.catalogue = catalogue
        weights = (catalogue.counts.to(torch.float64) + 1.0) ** self.sampling_alpha  # (C,)
        self._proposal = (weights / weights.sum()).to(torch.float32)
        self._log_proposal = torch.log(self._proposal)

    # ---- training --------------------------------------------------------------------------

    def _item_keys(self, batch: Batch) -> torch.Tensor:
        if self.item_feature not in batch.sparse.keys():
            raise DataError(f"task.item_feature={self.item_feature!r} is not a batch feature "
                            f"{batch.sparse.keys()}; name the feature that holds the item")
        jt = batch.sparse[self.item_feature]
        if jt.values().numel() != batch.batch_size or not bool((jt.lengths() == 1).all()):
            raise DataError(f"feature {self.item_feature!r} must hold one item key per row for retrieval")
        return jt.values()  # (B,)

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Corrected logits (B, 1 + negatives): column 0 the positive, masked columns -inf."""
        b = batch.batch_size
        keys = self._item_keys(batch)  # (B,)
        dense, sparse = batch.dense, batch.sparse
        neg_rows = None
        if self.num_negatives:
            if self._proposal is None:
                raise ConfigError(f"task.negatives={self.negatives!r} needs the item catalogue: call "
                                  "task.bind(data) before training (recps.job.build does)")
            neg_rows = torch.multinomial(self._proposal, self.num_negatives, replacement=True)  # (N,)
            sparse = append_rows(sparse, self.catalogue.features(neg_rows))  # stride B + N
            dense = torch.cat([dense, dense.new_zeros(self.num_negatives, dense.shape[1])])  # (B + N, I)
        queries, candidates = model.encode(dense, sparse)  # (B + N, ·) each
        queries = queries[:b]  # (B, ·)
        if self.negatives == "sampled":  # no in-batch block: the positives pair by pair
            positive = model.score_pairs(queries, candidates[:b])  # (B,)
            in_batch = None
            sampled = model.score(queries, candidates[b:])  # (B, N)
        else:
            logits = model.score(queries, candidates)  # (B, B + N)
            in_batch, sampled = logits[:, :b], logits[:, b:]  # (B, B), (B, N)
            positive = in_batch.diagonal()  # (B,)
        if self.log_q_correction:
            batch_log_q = batch.labels[:, self.log_q_index] + math.log(b)  # (B,) per in-batch column
            if self.negatives == "sampled":
                positive = positive - (self._log_proposal[self.catalogue.rows_of(keys)] + math.log(self.num_negatives))
            else:
                positive = positive - batch_log_q
            if in_batch is not None:
                in_batch = in_batch - batch_log_q.unsqueeze(0)
            if neg_rows is not None:
                sampled = sampled - (self._log_proposal[neg_rows] + math.log(self.num_negatives)).unsqueeze(0)
        parts = [positive.unsqueeze(1)]  # (B, 1)
        if self.negatives != "sampled":
            duplicate = keys.unsqueeze(1) == keys.unsqueeze(0)  # (B, B), the diagonal included
            parts.append(in_batch.masked_fill(duplicate, _NEG_INF))
        if neg_rows is not None:
            hit = keys.unsqueeze(1) == self.catalogue.keys[neg_rows].unsqueeze(0)  # (B, N)
            parts.append(sampled.masked_fill(hit, _NEG_INF))
        return torch.cat(parts, dim=1)  # (B, 1 + negatives)

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Mean softmax cross-entropy with the positive in column 0."""
        return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.int64))

    def predict(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, dim=1)[:, 0]  # (B,) probability of the positive

    def target(self, batch: Batch) -> torch.Tensor:
        return batch.labels[:, self.label_index]  # (B,)

    # ---- evaluation ------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, model: nn.Module, source: Any, batch_size: int) -> dict[str, float]:
        """Ranks every catalogue item for each query of `source` (see the module doc)."""
        catalogue = _catalogue_of(source, "RetrievalTask.evaluate")
        dense_width = int(source.examples.dense.shape[1])
        was_training = model.training
        model.eval()
        try:
            parts = []
            for rows in torch.arange(len(catalogue)).split(max(1, int(batch_size))):
                _, cands = model.encode(torch.zeros(rows.numel(), dense_width), catalogue.features(rows))
                parts.append(cands)
            candidates = torch.cat(parts)  # (C, ·)

            def scores_of(batch: Batch) -> torch.Tensor:
                queries, _ = model.encode(batch.dense, batch.sparse)  # (B, ·)
                return torch.cat([model.score(q, candidates) for q in queries.split(self.score_rows)])  # (B, C)

            out = evaluate_ranking(scores_of, source, batch_size, self.metrics)
        finally:
            model.train(was_training)
        if self.baseline:
            popular = popularity_baseline(source, batch_size, self.metrics)
            out.update({f"most_popular/{k}": v for k, v in popular.items() if k != "queries"})
        return out
