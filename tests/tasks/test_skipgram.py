"""SkipGramTask: the pairs against plain Python references (windows, documents, reduced
windows), the draws against their distributions (subsampling, unigram^0.75 negatives), the
loss against hand arithmetic, the evaluation against scipy / planted vectors, and errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from models import Word2Vec
from recps.data.text import (
    Analogies,
    SessionProbe,
    TokenBatch,
    Vocabulary,
    WordEvaluation,
    WordPairs,
    build_corpus,
    generate_zipf_corpus,
    read_documents,
    read_word_pairs,
    tokenize,
)
from recps.errors import ConfigError, DataError
from recps.tasks.skipgram import SkipGramTask, nearest_neighbours, ppmi_svd_vectors, spearman


def token_batch(docs: list[list[int]]) -> TokenBatch:
    values = torch.tensor([t for d in docs for t in d], dtype=torch.int64)
    kjt = KeyedJaggedTensor.from_lengths_sync(["tokens"], values, torch.tensor([len(d) for d in docs]))
    n = values.numel()
    return TokenBatch(torch.zeros(n, 0), kjt, torch.zeros(n, 0))


def bound_task(vocab: int = 50, **kwargs) -> SkipGramTask:
    task = SkipGramTask(**kwargs)
    task.bind_counts(torch.arange(vocab, 0, -1))
    return task


def offsets(w: int) -> list[int]:
    return list(range(-w, 0)) + list(range(1, w + 1))


# ---- pairs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 2, 5])
def test_full_windows_pair_every_neighbour_in_the_same_document(window):
    docs = [[3, 1, 4, 1, 5], [9], [2, 6, 5, 3, 5, 8, 9, 7], [9, 3]]
    task = bound_task(window=window, subsample=0.0, shrink_window=False)
    sg = task.sample(token_batch(docs), torch.Generator().manual_seed(0))
    doc = [d for d, tokens in enumerate(docs) for _ in tokens]
    r = len(doc)
    expected = [[0 <= i + o < r and doc[i + o] == doc[i] for o in offsets(window)] for i in range(r)]
    assert sg.valid.tolist() == expected
    assert sg.tokens.tolist() == [t for d in docs for t in d] and sg.rows == r and sg.window == window
    assert sg.multiplicity.tolist() == [float(sum(row)) for row in expected]
    assert sorted(map(tuple, sg.pairs.tolist())) == sorted(
        (i, i + o) for i in range(r) for j, o in enumerate(offsets(window)) if expected[i][j])


def test_kjt_layout_token_bags_then_negatives():
    task = bound_task(window=2, shared_negatives=3, subsample=0.0)
    sg = task.sample(token_batch([[7, 8, 9, 10]]), torch.Generator().manual_seed(1))
    assert sg.sparse.keys() == ["input", "output"] and sg.sparse.stride() == 4 + 3
    assert sg.sparse.lengths().tolist() == [1, 1, 1, 1, 0, 0, 0] + [1] * 7
    assert sg.sparse.values().tolist() == [7, 8, 9, 10, 7, 8, 9, 10, *sg.negatives.tolist()]


def test_reduced_windows_are_symmetric_reaches_of_each_center():
    doc = list(range(400))
    w = 5
    task = bound_task(vocab=400, window=w, subsample=0.0, shrink_window=True)
    sg = task.sample(token_batch([doc]), torch.Generator().manual_seed(2))
    contexts: dict[int, set[int]] = {c: set() for c in doc}
    for context, center in sg.pairs.tolist():
        contexts[center].add(context)
    reaches = []
    for c in doc:
        reach = max(abs(r - c) for r in contexts[c])  # every center has a neighbour at distance 1
        assert 1 <= reach <= w
        assert contexts[c] == {r for r in range(c - reach, c + reach + 1) if r != c and 0 <= r < len(doc)}
        reaches.append(reach)
    counts = np.bincount(reaches, minlength=w + 1)[1:]
    assert counts.min() > 400 / w * 0.6  # each reach 1..W drawn about equally often


def test_subsampling_keeps_words_with_word2vecs_probability():
    counts = torch.tensor([9000, 600, 300, 100])  # word 0 is 90% of the corpus
    task = SkipGramTask(window=1, subsample=1e-2)
    task.bind_counts(counts)
    tokens = torch.multinomial(counts.double(), 40000, replacement=True, generator=torch.Generator().manual_seed(3))
    sg = task.sample(token_batch([tokens.tolist()]), torch.Generator().manual_seed(4))
    threshold = 1e-2 * 10000
    for w, f in enumerate(counts.tolist()):
        keep = min(1.0, (math.sqrt(f / threshold) + 1) * threshold / f)
        seen = int((tokens == w).sum())
        kept = int((sg.tokens == w).sum())
        assert abs(kept / seen - keep) < 4 * math.sqrt(keep * (1 - keep) / seen) + 1e-9, (w, kept / seen, keep)


def test_negatives_follow_unigram_to_the_power():
    counts = torch.tensor([1000, 100, 10, 1])
    task = SkipGramTask(window=1, shared_negatives=50000, subsample=0.0, power=0.75)
    task.bind_counts(counts)
    sg = task.sample(token_batch([[0, 1]]), torch.Generator().manual_seed(5))
    observed = np.bincount(sg.negatives.numpy(), minlength=4) / 50000
    expected = counts.double().pow(0.75) / counts.double().pow(0.75).sum()
    assert np.allclose(observed, expected.numpy(), atol=0.01)


def test_a_batch_whose_tokens_are_all_subsampled_keeps_one():
    task = SkipGramTask(window=2, subsample=1e-6)
    task.bind_counts(torch.tensor([10**6, 1]))
    sg = task.sample(token_batch([[0, 0, 0]]), torch.Generator().manual_seed(0))
    assert sg.rows >= 1 and sg.sparse.stride() == sg.rows + task.shared_negatives


# ---- loss ------------------------------------------------------------------------------------------


def test_loss_is_sgns_with_shared_negatives_by_hand():
    torch.manual_seed(0)
    vocab, dim = 12, 4
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t_input", embedding_dim=dim, num_embeddings=vocab, feature_names=["input"]),
        EmbeddingBagConfig(name="t_output", embedding_dim=dim, num_embeddings=vocab, feature_names=["output"])])
    for weight in ebc.state_dict().values():
        weight.normal_(0, 0.5)
    model = Word2Vec(ebc, bias=False)
    task = SkipGramTask(window=2, negatives=5, shared_negatives=4, subsample=0.0)
    task.bind_counts(torch.ones(vocab))
    docs = [[1, 2, 3, 4, 5, 6], [7, 8, 1]]
    sg = task.sample(token_batch(docs), torch.Generator().manual_seed(6))
    sg.negatives[0] = 2  # make sure a draw hits a row's own word
    sg.sparse = KeyedJaggedTensor(keys=sg.sparse.keys(), values=torch.cat([sg.tokens, sg.tokens, sg.negatives]),
                                  lengths=sg.sparse.lengths(), stride=sg.sparse.stride())
    context, negative = model(sg.sparse, sg.rows, sg.window)
    loss = float(task.loss((context, negative, sg), token_batch(docs)))

    x, y = model.word_vectors(torch.arange(vocab)), model.output_vectors(torch.arange(vocab))
    softplus = lambda v: math.log1p(math.exp(v))  # noqa: E731
    tokens, negs = sg.tokens.tolist(), sg.negatives.tolist()
    total, pairs = 0.0, 0
    for r, c in sg.pairs.tolist():  # (context, center): input vector of the context, output of the center
        total += softplus(-float(x[tokens[r]] @ y[tokens[c]]))
        total += 5 / 4 * sum(softplus(float(x[tokens[r]] @ y[n])) for n in negs if n != tokens[r])
        pairs += 1
    assert loss == pytest.approx(total / pairs, rel=1e-5)


def test_loss_falls_when_training_a_planted_corpus():
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t_input", embedding_dim=8, num_embeddings=20, feature_names=["input"]),
        EmbeddingBagConfig(name="t_output", embedding_dim=8, num_embeddings=20, feature_names=["output"])])
    model = Word2Vec(ebc)
    task = bound_task(vocab=20, window=2, subsample=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    docs = [[a, a + 1, a, a + 1] for a in range(0, 20, 2)] * 5  # words 2i and 2i+1 always together
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = task.loss(task.forward(model, token_batch(docs)), None)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    partners = nearest_neighbours(torch.cat([model.word_vectors(torch.arange(20)),
                                             model.output_vectors(torch.arange(20))], 1), torch.arange(20), k=1)
    assert (partners.squeeze(1) == torch.arange(20) ^ 1).float().mean() >= 0.8  # 2i <-> 2i+1


# ---- evaluation ------------------------------------------------------------------------------------


def test_spearman_equals_scipy_with_ties():
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 5, 50).astype(float), rng.normal(size=50)
    assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic, abs=1e-12)
    assert math.isnan(spearman([1.0], [2.0]))


def test_evaluate_vectors_similarity_and_planted_analogies():
    torch.manual_seed(1)
    vocab = Vocabulary(np.array(list("abcdefgh"), dtype=object), np.arange(8, 0, -1))
    vectors = torch.randn(8, 16)
    unit = torch.nn.functional.normalize(vectors, dim=1)
    vectors[3] = unit[1] - unit[0] + unit[2]  # d = b - a + c exactly
    pairs = WordPairs(torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 3]]), torch.tensor([1.0, 5, 2, 4, 3]), 6)
    questions = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 4]])  # the second expects the wrong word
    analogies = Analogies(questions, torch.tensor([0, 1]), ("capital", "gram-plural"), 3)
    test = WordEvaluation(vocab, {"ws": pairs}, analogies)
    out = SkipGramTask().evaluate_vectors(vectors, test)
    cosine = [float(torch.nn.functional.cosine_similarity(vectors[i], vectors[j], dim=0)) for i, j in pairs.pairs.tolist()]
    assert out["ws_spearman"] == pytest.approx(spearmanr(cosine, pairs.scores.numpy()).statistic, abs=1e-6)
    assert out["ws_pairs"] == 5
    assert out["analogy_accuracy"] == 0.5 and out["analogy_questions"] == 2
    assert out["analogy_semantic"] == 1.0 and out["analogy_syntactic"] == 0.0


def test_evaluate_reads_the_models_input_vectors():
    torch.manual_seed(2)
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t_input", embedding_dim=4, num_embeddings=6, feature_names=["input"]),
        EmbeddingBagConfig(name="t_output", embedding_dim=4, num_embeddings=6, feature_names=["output"])])
    model = Word2Vec(ebc)
    vocab = Vocabulary(np.array(list("abcdef"), dtype=object), np.ones(6, dtype=np.int64))
    test = WordEvaluation(vocab, {"ws": WordPairs(torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.tensor([1.0, 2, 3]), 3)})
    task = SkipGramTask()
    weights = ebc.embedding_bags["t_input"].weight.detach()
    assert task.evaluate(model, test, batch_size=4) == task.evaluate_vectors(weights, test)
    assert model.training


def test_session_evaluation_ranks_items_by_similarity_against_most_popular():
    vectors = torch.eye(4)
    vectors[0, 1] = vectors[1, 0] = 0.9  # items 0 and 1 are each other's nearest
    probe = SessionProbe(queries=torch.tensor([0, 1, 2]), targets=torch.tensor([1, 0, 3]),
                         item_counts=torch.tensor([1, 1, 1, 9]))
    out = SkipGramTask(metrics=["recall@2", "mrr@2"]).evaluate_sessions(vectors, probe)
    # query 0: scores [1, .9, 0, 0] -> target 1 at rank 2; query 1: target 0 at rank 2; query 2: target 3
    # ties with items 0, 1 at 0 and ranks last (pessimistic): rank 4.
    assert out["recall@2"] == pytest.approx(2 / 3) and out["mrr@2"] == pytest.approx((0.5 + 0.5) / 3)
    # most popular: item 3 first, ties after: targets 1, 0 rank 4, target 3 rank 1.
    assert out["most_popular/recall@2"] == pytest.approx(1 / 3) and out["predictions"] == 3
    with pytest.raises(ConfigError, match=r"session evaluation ranks items; name recall@K"):
        SkipGramTask(metrics=["wordsim353_spearman"]).evaluate_sessions(vectors, probe)


def test_nearest_neighbours_exclude_the_word_itself():
    vectors = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [-1.0, -0.1]])
    assert nearest_neighbours(vectors, torch.tensor([0, 2]), k=2).tolist() == [[1, 2], [1, 0]]


def test_ppmi_svd_baseline_recovers_planted_topics(tmp_path):
    corpus_path, pairs_path = generate_zipf_corpus(tmp_path, documents=300, words_per_document=60, vocab=300,
                                                   topics=10, seed=0)
    vocab, corpus = build_corpus(tokenize(read_documents([corpus_path])), min_count=3)
    vectors = ppmi_svd_vectors(corpus, len(vocab), window=3, dim=16)
    assert vectors.shape == (len(vocab), 16)
    test = WordEvaluation(vocab, {"topics": read_word_pairs(pairs_path, vocab)})
    assert SkipGramTask().evaluate_vectors(vectors, test)["topics_spearman"] > 0.3  # random vectors: ~0


# ---- errors ----------------------------------------------------------------------------------------


def test_errors_name_the_value_and_the_fix():
    with pytest.raises(ConfigError, match=r"task.window=0, task.negatives=5, task.shared_negatives=64; all must"):
        SkipGramTask(window=0)
    with pytest.raises(ConfigError, match=r"task.subsample=-1"):
        SkipGramTask(subsample=-1)
    with pytest.raises(ConfigError, match=r"no word counts; call bind"):
        SkipGramTask().sample(token_batch([[1, 2]]))
    task = bound_task()
    with pytest.raises(DataError, match=r"reads TokenBatch .*got Batch"):
        from recps.data.batch import Batch
        task.sample(Batch(torch.zeros(1, 0), token_batch([[1]]).sparse, torch.zeros(1, 1)))
    with pytest.raises(ConfigError, match=r"has no word counts: pick dataset=word2vec_text"):
        task.bind(object())
    with pytest.raises(DataError, match=r"need one count >= 0 per word"):
        task.bind_counts(torch.tensor([1, -1]))
    with pytest.raises(DataError, match=r"evaluates a WordEvaluation or a SessionProbe"):
        task.evaluate(None, object(), 8)
