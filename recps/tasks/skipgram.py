"""Skip-gram with negative sampling: pairs, subsampling, negatives, the loss and evaluation.

References: Mikolov et al. 2013 (https://arxiv.org/abs/1310.4546; word2vec.c's subsampling
rule and reduced windows), Ji et al. 2016 (https://arxiv.org/abs/1604.04661: negatives
shared by many pairs, so that scoring them is a matrix product).

From a `TokenBatch` (recps.data.text: n consecutive tokens, a bag per document piece) the
task forms the training pairs, all tensor ops, no loop per token:

    tokens (n,) ── subsample: keep w with p = (sqrt(f_w / (s·N)) + 1) · s·N / f_w ──► run (R,)
    each kept token c is a center with a reach ρ_c ~ U{1..window} (word2vec's reduced window;
    ρ_c = window without shrinking); token r is a context of c when |r - c| <= ρ_c and both
    are in the same document piece ─► valid (R, 2W): [r, j] = r is a context of r + offset_j
    K negatives ~ unigram^power for the whole batch (`shared_negatives`)
    model(sparse, R, W) ─► context (R, 2W), negative (R, K)    (models.Word2Vec)
    loss = [ Σ_valid softplus(-context) + (N / K) Σ_r m_r Σ_k softplus(negative_rk) ] / P

m_r is the number of pairs whose context is token r, P = Σ_r m_r; a negative that is token
r's own word is left out (word2vec skips it too). In expectation over the draws this is SGNS
with N = `negatives` negatives per pair (word2vec's `negative`): every pair's negative term
is N · E_n[softplus(x·y_n)], estimated from K draws shared by the batch instead of N fresh
ones per pair (Ji et al. share them per window). Sharing is what makes it fast: each token
is looked up once per table, the negatives cost one (R, D) x (D, K) product and the pairs a
band of small block products; measured on the Wikipedia excerpt, quality is gensim's within
the spread of seeds (models/README.md). Counts f_w and N come from the data (`bind`);
`subsample` s = 0 keeps every token. Words per second count the batch's tokens before
subsampling (gensim's "raw words").

Evaluation (`evaluate(model, test, batch_size)`) reads every word's input vector:
- a `WordEvaluation` (text): Spearman correlation between cosine similarity and human scores
  of each similarity set ("<set>_spearman", over the covered pairs, "<set>_pairs"), analogy
  accuracy by 3CosAdd over the whole vocabulary (a, b, c excluded; "analogy_accuracy", and
  its semantic / syntactic ("gram*" sections) parts, over the covered questions,
  "analogy_questions");
- a `SessionProbe` (item2vec): each click of a test session predicts the next by cosine
  similarity to every item: recall@K / MRR@K of the task's `metrics`, and the same of the
  most-popular ranking ("most_popular/recall@20").
`ppmi_svd_vectors` is the count-based baseline (Levy, Goldberg & Dagan 2015).

Shapes: n batch tokens, R kept tokens, W window, K shared negatives, P pairs, V vocabulary,
D dim, Q questions.

Example:
    >>> import torch
    >>> from torchrec import KeyedJaggedTensor
    >>> from recps.data.text import TokenBatch
    >>> task = SkipGramTask(window=1, shared_negatives=2, subsample=0.0, shrink_window=False)
    >>> task.bind_counts(torch.tensor([5, 3, 2]))
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(["tokens"], torch.tensor([0, 1, 2, 2]), torch.tensor([3, 1]))
    >>> sg = task.sample(TokenBatch(torch.zeros(4, 0), kjt, torch.zeros(4, 0)), torch.Generator().manual_seed(0))
    >>> sg.rows, sg.valid.tolist()          # offsets (-1, +1); the last token is a document of its own
    (4, [[False, True], [True, True], [True, False], [False, False]])
    >>> sg.pairs.tolist()                   # (context, center)
    [[0, 1], [1, 0], [1, 2], [2, 1]]
    >>> sg.multiplicity.tolist(), sg.sparse.stride()   # pairs per context; R + K bags per feature
    ([1.0, 2.0, 1.0, 0.0], 6)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recps.data.batch import Batch
from recps.data.text import SKIPGRAM_FEATURES, Corpus, SessionProbe, TokenBatch, WordEvaluation
from recps.errors import ConfigError, DataError
from recps.metrics import MetricCollection
from recps.tasks.base import TaskBase

__all__ = ["SkipGramBatch", "SkipGramTask", "nearest_neighbours", "ppmi_svd_vectors", "spearman"]


@dataclass
class SkipGramBatch:
    """The run of one batch, laid out for models.Word2Vec.

    sparse: KJT, features (input, output), stride R + K: bag r < R of both holds token r of
        the run, output bags R.. the negatives, input bags R.. are empty;
    rows: R; window: W; valid: (R, 2W) bool, [r, j]: token r is a context of token r + offset_j
        (offsets -W..-1, 1..W); tokens: (R,) ids; negatives: (K,) ids.
    """

    sparse: KeyedJaggedTensor
    rows: int
    window: int
    valid: torch.Tensor
    tokens: torch.Tensor
    negatives: torch.Tensor

    @property
    def multiplicity(self) -> torch.Tensor:
        """(R,) float32: pairs whose context is token r."""
        return self.valid.sum(1, dtype=torch.float32)

    @property
    def num_pairs(self) -> int:
        return int(self.valid.sum())

    @property
    def pairs(self) -> torch.Tensor:
        """(P, 2) int64 (context, center) rows, context-major (for reading; the loss uses `valid`)."""
        offsets = torch.cat([torch.arange(-self.window, 0), torch.arange(1, self.window + 1)])
        context, j = self.valid.nonzero(as_tuple=True)
        return torch.stack([context, context + offsets[j]], dim=1)


def spearman(x: Any, y: Any) -> float:
    """Spearman's rank correlation (average ranks for ties), NaN below two points.

    >>> spearman([1.0, 2.0, 3.0], [10.0, 30.0, 20.0])
    0.5
    """
    a, b = pd.Series(np.asarray(x, dtype=np.float64)), pd.Series(np.asarray(y, dtype=np.float64))
    if len(a) < 2:
        return float("nan")
    return float(np.corrcoef(a.rank().to_numpy(), b.rank().to_numpy())[0, 1])


def _unit(vectors: torch.Tensor) -> torch.Tensor:
    return F.normalize(vectors.to(torch.float32), dim=1)  # (V, D)


def nearest_neighbours(vectors: torch.Tensor, ids: torch.Tensor, k: int = 5) -> torch.Tensor:
    """(Q,) ids → (Q, k) ids of the most cosine-similar rows of `vectors` (V, D), self excluded."""
    unit = _unit(vectors)
    sims = unit[ids] @ unit.T  # (Q, V)
    sims[torch.arange(ids.numel()), ids] = float("-inf")
    return sims.topk(min(k, vectors.shape[0] - 1), dim=1).indices  # (Q, k)


def ppmi_svd_vectors(corpus: Corpus, vocab_size: int, window: int = 5, dim: int = 100, alpha: float = 0.75,
                     seed: int = 0) -> torch.Tensor:
    """The count-based baseline: PPMI of window co-occurrences, context counts smoothed by `alpha`,
    truncated SVD (randomized, Halko et al.), rows U·sqrt(Σ) (Levy, Goldberg & Dagan 2015,
    https://aclanthology.org/Q15-1016). Returns (V, dim) float32. Needs scipy and scikit-learn."""
    from scipy import sparse as sp  # deferred: scipy, scikit-learn; only the count-based baseline needs them
    from sklearn.utils.extmath import randomized_svd

    tokens = corpus.tokens.numpy()
    doc = np.repeat(np.arange(corpus.num_documents), np.diff(corpus.offsets.numpy()))  # (N,)
    rows, cols = [], []
    for offset in range(1, window + 1):  # one vectorised pass per offset
        same = doc[offset:] == doc[:-offset]
        left, right = tokens[:-offset][same], tokens[offset:][same]
        rows += [left, right]
        cols += [right, left]
    i, j = np.concatenate(rows), np.concatenate(cols)
    counts = sp.coo_matrix((np.ones(i.size, dtype=np.float64), (i, j)), shape=(vocab_size, vocab_size)).tocsr()
    counts.sum_duplicates()
    word = np.asarray(counts.sum(axis=1)).ravel()  # (V,)
    context = np.asarray(counts.sum(axis=0)).ravel() ** alpha  # (V,)
    coo = counts.tocoo()
    pmi = np.log(coo.data * context.sum() / (word[coo.row] * context[coo.col]))
    keep = pmi > 0
    ppmi = sp.csr_matrix((pmi[keep], (coo.row[keep], coo.col[keep])), shape=counts.shape)
    k = min(dim, vocab_size - 1)
    u, s, _ = randomized_svd(ppmi, n_components=k, n_iter=5, random_state=seed)
    vectors = np.zeros((vocab_size, dim), dtype=np.float32)
    vectors[:, :k] = u * np.sqrt(s)
    return torch.from_numpy(vectors)


class SkipGramTask(TaskBase):
    """Pairs, the SGNS loss and the evaluation of skip-gram models (see the module docstring).

    Args:
        window: the largest offset of a context word.
        negatives: N, the negatives per pair of the objective (word2vec's `negative`).
        shared_negatives: K, the negatives drawn per batch and shared by its pairs.
        subsample: word2vec's `sample` threshold s; 0 keeps every token.
        power: exponent of the unigram counts of the negative distribution.
        shrink_window: draw each center's reach from 1..window (word2vec), else reach = window.
        metrics: the names `recps.train` shows; evaluation computes what the test split holds.
        analogy_rows: analogy questions scored at once (bounds a (rows, V) matrix).

    The model is called as `model(sparse, rows, window)` (models.Word2Vec) and must read
    features "input" and "output" (recps.data.text.SKIPGRAM_FEATURES).
    """

    passes_batch_sparse = False  # the model gets the sampled pairs' features (recps.tasks.base)

    def __init__(self, window: int = 5, negatives: int = 5, shared_negatives: int = 64, subsample: float = 1e-3,
                 power: float = 0.75, shrink_window: bool = True,
                 metrics: Sequence[str] = ("wordsim353_spearman", "analogy_accuracy"), analogy_rows: int = 1024) -> None:
        if window < 1 or negatives < 1 or shared_negatives < 1:
            raise ConfigError(f"task.window={window}, task.negatives={negatives}, task.shared_negatives="
                              f"{shared_negatives}; all must be >= 1")
        if subsample < 0:
            raise ConfigError(f"task.subsample={subsample}; use 0 (keep every token) or a threshold such as 1e-3")
        self.window, self.negatives, self.shared_negatives = int(window), int(negatives), int(shared_negatives)
        self.subsample, self.power = float(subsample), float(power)
        self.shrink_window = bool(shrink_window)
        self.metrics = tuple(metrics)
        self.analogy_rows = int(analogy_rows)
        self.features = SKIPGRAM_FEATURES
        offsets = torch.cat([torch.arange(-self.window, 0), torch.arange(1, self.window + 1)])  # (2w,)
        self._offsets, self._reach = offsets, offsets.abs()
        self._keep: torch.Tensor | None = None
        self._cdf: torch.Tensor | None = None

    # -- data ------------------------------------------------------------------------------------

    def bind(self, data: Any) -> None:
        """Reads the word counts (V,) of the training data (`data.counts`)."""
        counts = getattr(data, "counts", None)
        if counts is None:
            raise ConfigError(f"task=skipgram trains on text or session corpora (recps.data.text); the data set "
                              f"{type(data).__name__} has no word counts: pick dataset=word2vec_text or rsc15_item2vec")
        self.bind_counts(torch.as_tensor(counts))

    def bind_counts(self, counts: torch.Tensor) -> None:
        """Keep probabilities and the negative distribution from corpus counts (V,)."""
        counts = counts.to(torch.float64)
        if counts.dim() != 1 or counts.numel() < 2 or bool((counts < 0).any()) or not float(counts.sum()) > 0:
            raise DataError(f"skip-gram counts: shape {tuple(counts.shape)}, sum {float(counts.sum())}; need one "
                            "count >= 0 per word, two words at least, some of them seen")
        if self.subsample > 0:
            threshold = self.subsample * counts.sum()
            seen = counts.clamp(min=1.0)  # an unseen word never comes up; avoid 0 / 0
            self._keep = ((seen / threshold).sqrt() + 1) * threshold / seen  # (V,), >= 1 keeps always
        else:
            self._keep = None
        weights = counts.pow(self.power)
        self._cdf = (weights.cumsum(0) / weights.sum()).to(torch.float32)  # (V,)

    # -- training --------------------------------------------------------------------------------

    def sample(self, batch: Batch, generator: torch.Generator | None = None) -> SkipGramBatch:
        """The pairs and negatives of a TokenBatch (see the module docstring); `generator` makes
        the draws reproducible (default: torch's global generator)."""
        if not isinstance(batch, TokenBatch):
            raise DataError(f"task=skipgram reads TokenBatch (recps.data.text), got {type(batch).__name__}; "
                            "pick a text or session-corpus data set")
        if self._cdf is None:
            raise ConfigError("SkipGramTask: no word counts; call bind(data) (recps.job.build does) or bind_counts()")
        tokens = batch.sparse.values()  # (n,)
        piece = torch.repeat_interleave(torch.arange(batch.sparse.stride()), batch.sparse.lengths(),
                                        output_size=tokens.numel())  # (n,) document piece of each token
        if self._keep is not None:
            kept = torch.rand(tokens.numel(), generator=generator, dtype=torch.float64) < self._keep[tokens]
            if not bool(kept.any()):
                kept[0] = True  # one row, maybe without pairs: the step still has a graph
            tokens, piece = tokens[kept], piece[kept]  # (R,)
        r, w = tokens.numel(), self.window
        center = torch.arange(r)[:, None] + self._offsets[None, :]  # (R, 2W) center of context r at offset j
        valid = (center >= 0) & (center < r)
        center = center.clamp(0, r - 1)
        valid &= piece[center] == piece[:, None]
        if self.shrink_window:
            reach = torch.randint(1, w + 1, (r,), generator=generator)  # (R,) each center's reach
            valid &= self._reach[None, :] <= reach[center]
        k = self.shared_negatives
        negatives = torch.searchsorted(self._cdf, torch.rand(k, generator=generator)).clamp_(max=self._cdf.numel() - 1)
        lengths = torch.ones(2 * (r + k), dtype=torch.int64)
        lengths[r:r + k] = 0  # input bags of the negatives' slots are empty
        sparse = KeyedJaggedTensor(keys=list(self.features), values=torch.cat([tokens, tokens, negatives]),
                                   lengths=lengths, stride=r + k)
        return SkipGramBatch(sparse, r, w, valid, tokens, negatives)

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, SkipGramBatch]:
        """(context logits (R, 2W), negative logits (R, K), the run they score)."""
        sg = self.sample(batch)
        context, negative = model(sg.sparse, sg.rows, sg.window)
        return context, negative, sg

    def loss(self, output: tuple[torch.Tensor, torch.Tensor, SkipGramBatch], batch: Batch) -> torch.Tensor:
        context, negative, sg = output
        valid = sg.valid.to(context.dtype)  # (R, 2W)
        multiplicity = valid.sum(1)  # (R,)
        own = sg.negatives[None, :] == sg.tokens[:, None]  # (R, K) a draw of the token's own word
        weights = multiplicity[:, None].expand_as(negative).masked_fill(own, 0.0)  # (R, K)
        negative_term = (F.softplus(negative) * weights).sum() * (self.negatives / self.shared_negatives)
        return ((F.softplus(-context) * valid).sum() + negative_term) / multiplicity.sum().clamp(min=1.0)

    def predict(self, output: tuple[torch.Tensor, torch.Tensor, SkipGramBatch]) -> torch.Tensor:
        """Probabilities (P,) that each pair co-occurs (context-major, as `SkipGramBatch.pairs`)."""
        context, _, sg = output
        return torch.sigmoid(context[sg.valid])

    # -- evaluation ------------------------------------------------------------------------------

    @torch.no_grad()
    def vectors(self, model: nn.Module, vocab_size: int, batch_size: int) -> torch.Tensor:
        """Every word's input vector (V, D), read `batch_size` at a time."""
        was_training = model.training
        model.eval()
        try:
            ids = torch.arange(vocab_size)
            return torch.cat([model.word_vectors(chunk) for chunk in ids.split(max(1, int(batch_size)))])
        finally:
            model.train(was_training)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, test: Any, batch_size: int) -> dict[str, Any]:
        """Word similarity and analogies (text), or next-item retrieval by similarity (sessions)."""
        if isinstance(test, WordEvaluation):
            vectors = self.vectors(model, len(test.vocabulary), batch_size)
            return self.evaluate_vectors(vectors, test)
        if isinstance(test, SessionProbe):
            vectors = self.vectors(model, test.num_items, batch_size)
            return self.evaluate_sessions(vectors, test)
        raise DataError(f"task=skipgram evaluates a WordEvaluation or a SessionProbe (recps.data.text), got "
                        f"{type(test).__name__}; pick a text or session-corpus data set")

    def evaluate_vectors(self, vectors: torch.Tensor, test: WordEvaluation) -> dict[str, Any]:
        """The metrics of word vectors (V, D) on a WordEvaluation (usable on any vectors: baselines)."""
        unit = _unit(vectors)
        out: dict[str, Any] = {}
        for name, sim in test.similarity.items():
            cosine = (unit[sim.pairs[:, 0]] * unit[sim.pairs[:, 1]]).sum(1)  # (P,)
            out[f"{name}_spearman"] = spearman(cosine.numpy(), sim.scores.numpy())
            out[f"{name}_pairs"] = int(sim.pairs.shape[0])
        if test.analogies is not None:
            correct = self._analogies(unit, test.analogies.questions)  # (Q,) bool
            syntactic = torch.tensor([n.startswith("gram") for n in test.analogies.section_names],
                                     dtype=torch.bool)[test.analogies.sections]  # (Q,)
            out["analogy_accuracy"] = _mean(correct)
            out["analogy_semantic"] = _mean(correct[~syntactic])
            out["analogy_syntactic"] = _mean(correct[syntactic])
            out["analogy_questions"] = int(correct.numel())
        return out

    def _analogies(self, unit: torch.Tensor, questions: torch.Tensor) -> torch.Tensor:
        """3CosAdd: d = argmax cos(x, b - a + c) over unit vectors, x not in {a, b, c}; (Q,) correct."""
        correct = []
        for chunk in questions.split(self.analogy_rows):  # bounds the (rows, V) score matrix
            query = F.normalize(unit[chunk[:, 1]] - unit[chunk[:, 0]] + unit[chunk[:, 2]], dim=1)  # (q, D)
            scores = query @ unit.T  # (q, V)
            scores.scatter_(1, chunk[:, :3], float("-inf"))
            correct.append(scores.argmax(1) == chunk[:, 3])
        return torch.cat(correct) if correct else torch.zeros(0, dtype=torch.bool)

    def evaluate_sessions(self, vectors: torch.Tensor, test: SessionProbe) -> dict[str, Any]:
        """Next-item recall / MRR of cosine neighbours, and of the most-popular ranking."""
        names = [m for m in self.metrics if "@" in m]
        if not names:
            raise ConfigError(f"task.metrics={list(self.metrics)}: session evaluation ranks items; name recall@K, "
                              "mrr@K or ndcg@K")
        unit = _unit(vectors)
        model_metrics, popular = MetricCollection(names), MetricCollection(names)
        popularity = test.item_counts.to(torch.float32)  # (C,)
        queries, targets = test.queries, test.targets  # (M,), (M,)
        for q, t in zip(queries.split(1024), targets.split(1024)):
            model_metrics.update(unit[q] @ unit.T, t)  # (m, C)
            popular.update(popularity.expand(q.numel(), -1), t)
        out: dict[str, Any] = {k: float(v) for k, v in model_metrics.compute().items()}
        out.update({f"most_popular/{k}": float(v) for k, v in popular.compute().items()})
        out["predictions"] = int(queries.numel())
        return out


def _mean(flags: torch.Tensor) -> float:
    return float(flags.float().mean()) if flags.numel() else float("nan")
