"""Word2Vec quality on real text (issue 5): the Wikipedia excerpt of ../shared/data/word2vec_text.

The run is `python -m recps.train model=word2vec ps=local` (its defaults: the excerpt with
markup stripped, min_count 5, skip-gram window 5, 5 negatives, subsampling 1e-3, D=100, 5 passes
of 4096-token batches, 2 Hogwild threads, row-wise Adagrad 0.05), built in this process. The
input vectors are evaluated on WordSim-353 (Spearman, covered pairs) and the Google analogy
questions (3CosAdd accuracy, covered questions); nearest neighbours of a few common words are
printed. Baselines on the same corpus and evaluation: random vectors and PPMI-SVD (window 5,
D=100; Levy et al. 2015). Figures: models/README.md. ~1 min on the 2-core machine.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from recps.config import compose_config

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "word2vec_text"
COMMON_WORDS = ["war", "city", "music", "science", "king", "water"]


@pytest.fixture(scope="module")
def trained():
    if not (DATA / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2").is_file():
        pytest.skip(f"{DATA} is absent: ../shared/data (next to the checkout) holds the Wikipedia excerpt")
    from recps.job.build import build_job
    from recps.job.run import evaluate

    cfg = compose_config(["model=word2vec", "ps=local", "progress=false"])
    assert cfg.dataset.name == "word2vec_text" and cfg.trainer.epochs == 5 and cfg.trainer.threads == 2
    job = build_job(cfg)
    stats = job.trainer.fit(job.data.train, int(cfg.trainer.batch_size), epochs=int(cfg.trainer.epochs),
                            progress=False)
    return job, stats, evaluate(job)


def test_word2vec_learns_word_similarity_and_analogies(trained, capsys):
    from recps.tasks.skipgram import nearest_neighbours, ppmi_svd_vectors

    job, stats, metrics = trained
    data, task = job.data, job.task
    assert data.corpus.num_tokens > 400_000 and len(data.vocabulary) > 8000
    assert metrics["wordsim353_pairs"] == 231 and metrics["analogy_questions"] == 3366  # covered subsets
    vocab = len(data.vocabulary)
    random = task.evaluate_vectors(torch.randn(vocab, 100, generator=torch.Generator().manual_seed(0)), data.test)
    ppmi = task.evaluate_vectors(ppmi_svd_vectors(data.corpus, vocab, window=5, dim=100), data.test)

    vectors = task.vectors(job.model, vocab, 4096)
    ids = torch.from_numpy(data.vocabulary.encode(COMMON_WORDS))
    neighbours = nearest_neighbours(vectors, ids, k=8)
    with capsys.disabled():
        print(f"\nWord2Vec on the Wikipedia excerpt: {stats.examples:,} words in {stats.seconds:.1f} s "
              f"({stats.examples_per_sec:,.0f} words/s), loss {stats.first_losses[0]:.3f} -> {stats.last_loss:.3f}")
        for name, m in (("Word2Vec", metrics), ("PPMI-SVD", ppmi), ("random vectors", random)):
            print(f"  {name:15s} WordSim-353 Spearman {m['wordsim353_spearman']:.4f}   analogy accuracy "
                  f"{m['analogy_accuracy']:.4f} (semantic {m['analogy_semantic']:.4f}, syntactic "
                  f"{m['analogy_syntactic']:.4f})")
        for word, row in zip(COMMON_WORDS, neighbours.tolist()):
            print(f"  {word:8s} -> {', '.join(data.vocabulary.decode(row))}")
    logging.getLogger(__name__).info("word2vec quality: %s", metrics)

    # one batch's loss: measured 0.79-0.82 of the first on this machine, quiet or loaded; the proof is below
    assert stats.last_loss < 0.87 * stats.first_losses[0]
    assert abs(random["wordsim353_spearman"]) < 0.15 and random["analogy_accuracy"] < 0.003
    # Hogwild threads and the draws move it: 0.29-0.41 over nine local runs, 0.279 once in CI; gensim's
    # SGNS scores 0.21 on this corpus, random vectors ~0
    assert metrics["wordsim353_spearman"] > 0.22 > random["wordsim353_spearman"] + 0.15
    assert metrics["analogy_accuracy"] > 0.005 > 2 * random["analogy_accuracy"]
    assert ppmi["wordsim353_spearman"] > 0.4  # the count baseline is strong on a corpus this small
