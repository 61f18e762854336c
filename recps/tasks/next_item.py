"""Next-item prediction over sessions: the losses of GRU4Rec / SASRec and their evaluation.

A model scores every item after every click: `scores (N, C)` for the N positions of a batch
(the clicks of its KJT, in KJT order) and C items. The target of a position is the click
that follows it: `labels (B, W)` of recps.data.sessions' sources, read at the valid
positions of each row (-1: not scored). Shapes: B rows, W the longest row, N positions,
C items, Y recurrent layers, D state width.

Losses (mean over the scored positions):
- "cross_entropy": softmax cross-entropy over all C items.
- "bpr_max" (Hidasi & Karatzoglou, CIKM 2018, https://arxiv.org/abs/1706.03847):
  -log Σ_j s_j σ(r_t - r_j) + bpreg · Σ_j s_j r_j², with s = softmax of the negatives'
  scores r_j. Negatives are all items but the target (GRU4Rec samples them from the
  mini-batch and a popularity distribution; with every item scored anyway, the full set
  is the exact form of the sum it approximates).

Session-parallel batches (`SessionParallelBatch`) carry the recurrent state across steps:
the task keeps each training thread's state (threading.local), zeroes the lanes whose
session starts, passes it as `model(sparse, hidden)` and keeps the detached state the
model returns (GRU4Rec's one-step truncated backpropagation). Other batches call
`model(sparse)`; a model returning `(scores, state)` gets its state dropped.

Evaluation (GRU4Rec's protocol): every next click of every test session is predicted from
its prefix (whole sessions in one pass; SequenceSource windows longer ones), items are
ranked by score, and recall@K / MRR@K average over the predictions (ties count against the
target: recps.metrics.retrieval). With `baseline` and a source that carries the training
clicks per item (`item_counts`: recps.data.sessions' evaluation source does), two baselines
are ranked on the same predictions: most popular (`MostPopular`, "most_popular/<metric>") and
the session's own items, most recent first, then popular (`SessionItemsThenPopular`,
"session_items/<metric>": repeat clicks are common in session logs, and a model that does not
beat this has not learned more than to recall what the session showed).

Example:
    >>> import torch
    >>> from torchrec import KeyedJaggedTensor
    >>> from recps.data.batch import Batch
    >>> sparse = KeyedJaggedTensor.from_lengths_sync(["item"], torch.tensor([0, 1, 2]), torch.tensor([2, 1]))
    >>> batch = Batch(torch.zeros(2, 0), sparse, torch.tensor([[1.0, 2.0], [-1.0, -1.0]]))
    >>> task = NextItemTask()
    >>> task.target(batch).tolist()                  # positions 0, 1 of row 0, position 0 of row 1 (not scored)
    [1, 2, -1]
    >>> scores = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 9.0], [5.0, 0.0, 0.0]])   # (N=3, C=3)
    >>> round(float(task.loss(scores, batch)), 4)    # both scored targets nearly certain
    0.0002
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from recps.data.batch import Batch
from recps.data.sessions import SessionParallelBatch
from recps.errors import ConfigError, DataError
from recps.metrics import MetricCollection
from recps.tasks.base import TaskBase

__all__ = ["NextItemTask", "MostPopular", "SessionItemsThenPopular", "bpr_max_loss"]

_LOSSES = ("cross_entropy", "bpr_max")


def bpr_max_loss(scores: torch.Tensor, targets: torch.Tensor, bpreg: float = 1.0) -> torch.Tensor:
    """BPR-max over all non-target items: scores (N, C), targets (N,) int64 → mean loss ()."""
    target_score = scores.gather(1, targets[:, None])  # (N, 1)
    is_target = F.one_hot(targets, scores.shape[1]).bool()  # (N, C)
    weights = torch.softmax(scores.masked_fill(is_target, float("-inf")), dim=1)  # (N, C), 0 at the target
    ranking = (weights * torch.sigmoid(target_score - scores)).sum(1)  # (N,)
    regularizer = (weights * scores.pow(2)).sum(1)  # (N,)
    return (-torch.log(ranking + 1e-24) + bpreg * regularizer).mean()


class NextItemTask(TaskBase):
    """Loss, targets and evaluation for models that score all items after each click.

    Args:
        loss: "cross_entropy" or "bpr_max".
        bpreg: BPR-max's score regularisation weight (GRU4Rec's `bpreg`).
        metrics: ranking metrics of `evaluate` (recall@K, mrr@K, ndcg@K).
        eval_rows: rows scored at once in `evaluate` (bounds its (N, C) score matrix);
            the engine's eval batch size applies when it is smaller.
        baseline: `evaluate` also ranks by the baselines (see the module docstring) when the
            source carries the training clicks per item.
    """

    # The next-item models look their clicks up together with every item of the catalogue (one KJT
    # they build: GRU4Rec, SASRec), never batch.sparse as it is: a PS collection prefetching the
    # batch's rows would pull them for nothing, then turn prefetch off with a warning per thread.
    passes_batch_sparse = False

    def __init__(self, loss: str = "cross_entropy", bpreg: float = 1.0,
                 metrics: Sequence[str] = ("recall@20", "mrr@20"), eval_rows: int = 256,
                 baseline: bool = True) -> None:
        if loss not in _LOSSES:
            raise ConfigError(f"task.loss={loss!r}; use one of {_LOSSES}")
        if eval_rows < 1:
            raise ConfigError(f"task.eval_rows={eval_rows}; use 1 or more")
        self.loss_name = loss
        self.bpreg = float(bpreg)
        self.metrics = tuple(metrics)
        if MetricCollection(list(self.metrics)).kind != "retrieval":
            raise ConfigError(f"task.metrics={list(self.metrics)}: next-item evaluation ranks items; use "
                              "recall@K, mrr@K or ndcg@K")
        self.eval_rows = int(eval_rows)
        self.baseline = bool(baseline)
        self._threads = threading.local()  # .hidden: this training thread's recurrent state

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Scores (N, C) of the batch's positions."""
        if isinstance(batch, SessionParallelBatch):
            starts = batch.session_start  # (B,)
            hidden = getattr(self._threads, "hidden", None)
            if hidden is None or hidden.shape[0] != starts.numel():
                if not bool(starts.all()):
                    raise DataError(f"a session-parallel batch of {starts.numel()} lanes continues sessions but this "
                                    f"thread's state has {None if hidden is None else hidden.shape[0]} lanes; a "
                                    "source must start every lane in its first batch")
                hidden = None
            elif bool(starts.any()):
                hidden = hidden.masked_fill(starts.view(-1, *([1] * (hidden.dim() - 1))), 0.0)  # (B, Y, D)
            scores, state = model(batch.sparse, hidden)  # (B, C), (B, Y, D)
            self._threads.hidden = state.detach()
            return scores
        out = model(batch.sparse)
        return out[0] if isinstance(out, tuple) else out

    def target(self, batch: Batch) -> torch.Tensor:
        """(N,) int64: the next item of each position, -1 where it is not scored."""
        lengths = batch.sparse.lengths()  # (B,) one feature
        width = batch.labels.shape[1]
        valid = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]  # (B, W)
        return batch.labels[valid].to(torch.int64)  # (N,)

    def loss(self, scores: torch.Tensor, batch: Batch) -> torch.Tensor:
        targets = self.target(batch)  # (N,)
        scored = targets >= 0
        if not bool(scored.all()):
            scores, targets = scores[scored], targets[scored]  # (N', C), (N',)
        if self.loss_name == "bpr_max":
            return bpr_max_loss(scores, targets, self.bpreg)
        return F.cross_entropy(scores, targets)

    def predict(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores, dim=1)  # (N, C) probabilities of the next item

    @torch.no_grad()
    def evaluate(self, model: nn.Module, source: Any, batch_size: int) -> dict[str, float]:
        """The ranking metrics over every scored position of one pass of `source` (one shard), and the
        baselines' as "<baseline>/<metric>" (see the module docstring)."""
        out = self._rank(model, source, batch_size)
        counts = getattr(source, "item_counts", None)  # (C,) training clicks per item
        if self.baseline and counts is not None:
            feature = getattr(source, "feature", "item")
            for name, ranking in (("most_popular", MostPopular(counts, feature)),
                                  ("session_items", SessionItemsThenPopular(counts, feature))):
                scored = self._rank(ranking, source, batch_size)
                out.update({f"{name}/{k}": v for k, v in scored.items() if k != "predictions"})
        return out

    def _rank(self, model: nn.Module, source: Any, batch_size: int) -> dict[str, float]:
        metrics = MetricCollection(list(self.metrics))
        was_training = model.training
        model.eval()
        try:
            for batch in source.batches(min(int(batch_size), self.eval_rows), 0, 1, 0):
                if isinstance(batch, SessionParallelBatch):
                    raise ConfigError("NextItemTask.evaluate reads whole sessions; give it a SequenceSource "
                                      "(recps.data.sessions), not session-parallel lanes")
                scores = self.forward(model, batch)  # (N, C)
                targets = self.target(batch)  # (N,)
                scored = targets >= 0
                metrics.update(scores[scored], targets[scored])
        finally:
            model.train(was_training)
        details = metrics.details()
        out = {name: float(v) for name, v in metrics.compute().items()}
        out["predictions"] = details[f"{self.metrics[0]}.queries"]
        return out


class MostPopular(nn.Module):
    """The most-popular baseline: every position scores item c by its training click count.

    Args:
        counts: (C,) clicks per item (`Sessions.item_counts`).
        feature: the KJT feature that holds the clicks.

    forward(sparse) -> scores (N, C), the same row for every click.
    """

    def __init__(self, counts: torch.Tensor, feature: str = "item") -> None:
        super().__init__()
        self.feature = feature
        self.register_buffer("counts", counts.to(torch.float32))

    def forward(self, sparse: Any) -> torch.Tensor:
        n = sparse[self.feature].values().numel()
        return self.counts.expand(n, -1)  # (N, C)


class SessionItemsThenPopular(nn.Module):
    """The session's own items, most recent first, then popular: after each click the items of the
    session so far (the row's clicks up to and including it) rank first, the latest clicked first,
    then every other item by training clicks (ties: the lower id first).

    Args:
        counts: (C,) clicks per item (`Sessions.item_counts`).
        feature: the KJT feature that holds the clicks.

    forward(sparse) -> scores (N, C): an item clicked at row position p scores C + p at every later
    position of its row (its latest position wins), the others their popularity rank in [0, C).

    >>> from torchrec import KeyedJaggedTensor
    >>> sparse = KeyedJaggedTensor.from_lengths_sync(["item"], torch.tensor([3, 1, 3, 2]), torch.tensor([3, 1]))
    >>> scores = SessionItemsThenPopular(torch.tensor([5, 9, 0, 1]))(sparse)   # (N=4, C=4)
    >>> [row.argsort(descending=True).tolist() for row in scores]   # item 1 is the most popular
    [[3, 1, 0, 2], [1, 3, 0, 2], [3, 1, 0, 2], [2, 1, 0, 3]]
    """

    def __init__(self, counts: torch.Tensor, feature: str = "item") -> None:
        super().__init__()
        self.feature = feature
        c = counts.numel()
        rank = torch.empty(c, dtype=torch.float32)  # (C,) 0 the least popular .. C - 1 the most
        order = torch.argsort(counts.to(torch.float64) - torch.arange(c, dtype=torch.float64) / max(c, 1))
        rank[order] = torch.arange(c, dtype=torch.float32)
        self.register_buffer("rank", rank)

    def forward(self, sparse: Any) -> torch.Tensor:
        jt = sparse[self.feature]
        items, lengths = jt.values(), jt.lengths()  # (N,), (B,)
        n, c = items.numel(), self.rank.numel()
        scores = self.rank.expand(n, -1).clone()  # (N, C)
        starts = torch.cumsum(lengths, 0) - lengths  # (B,)
        pos = torch.arange(n, device=items.device) - torch.repeat_interleave(starts, lengths, output_size=n)  # (N,)
        # Every pair (position n, click m of its row with m <= n): P = sum over positions of pos + 1.
        counts = pos + 1  # (N,)
        owner = torch.repeat_interleave(torch.arange(n, device=items.device), counts)  # (P,) position n
        step = torch.arange(owner.numel(), device=items.device) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts)  # (P,) 0 .. pos of n
        clicked = owner - pos[owner] + step  # (P,) the click m
        value = (c + pos[clicked]).to(scores.dtype)  # (P,) later clicks score higher
        flat = scores.view(-1)
        flat.scatter_reduce_(0, owner * c + items[clicked], value, reduce="amax")
        return scores  # (N, C)
