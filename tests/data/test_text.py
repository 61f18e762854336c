"""recps.data.text: markup stripping, reading, the vocabulary, the token source against plain
references (shards partition the corpus, bags follow documents), evaluation sets, the
generated Zipf corpus and the session corpus of item2vec."""

from __future__ import annotations

import bz2
import logging

import numpy as np
import pytest
import torch

from recps.data.text import (
    SKIPGRAM_FEATURES,
    Corpus,
    TokenBatch,
    TokenSource,
    Vocabulary,
    build_corpus,
    generate_zipf_corpus,
    prepare_session_corpus,
    prepare_text,
    read_analogies,
    read_documents,
    read_word_pairs,
    strip_wiki_markup,
    tokenize,
)
from recps.errors import ConfigError, DataError
from recps.data.sharding import WorkerShards

WIKI_PAGE = """<page>
    <title>{title}</title>
    <ns>{ns}</ns>
    <id>1</id>
    <revision><text xml:space="preserve">{text}</text></revision>
  </page>"""


def wiki_dump(pages: list[tuple[str, int, str]]) -> str:
    body = "\n".join(WIKI_PAGE.format(title=t, ns=ns, text=text) for t, ns, text in pages)
    return f'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">\n  <siteinfo/>\n{body}\n</mediawiki>\n'


# ---- markup ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("wikitext, expected", [
    ("a {{outer|x={{inner|y}}}} b", "a b"),                                   # nested templates, inner first
    ("a<ref name=x>cite {{c}}</ref> b<ref name=y/> c", "a b c"),              # references, self-closing too
    ("a <!-- hidden\ncomment --> b", "a b"),
    ("a\n{| class=t\n|-\n| cell {{t}}\n|}\nb", "a b"),                       # tables
    ("[[File:X.jpg|thumb|a [[Paris|city]] view]] after", "after"),            # file link with a link inside
    ("[[Category:Cities]] [[de:Paris]] kept", "kept"),                        # categories, interwiki links
    ("the [[capital city|capital]] of [[France]]", "the capital of France"),  # link labels, plain links
    ("see [http://example.org the site] and https://x.org/y", "see the site and"),
    ("'''bold''' ''it'' ==Head== __TOC__", "bold it Head"),
    ("a <small>b</small> <math>x^2</math> c", "a b c"),                       # tags kept / dropped with content
])
def test_strip_wiki_markup_keeps_running_text(wikitext, expected):
    assert " ".join(strip_wiki_markup(wikitext).split()) == expected


def test_strip_keeps_document_separators():
    assert strip_wiki_markup("a {{t}}\x00b [[x|y]]").split("\x00") == ["a  ", "b y"]


def test_tokenize_lowercases_runs_of_letters():
    assert tokenize(["Rock'n'Roll, 1969: Über-cool!", ""]) == [["rock", "n", "roll", "über", "cool"], []]


# ---- reading ---------------------------------------------------------------------------------------


def test_read_documents_lines_bz2_and_wiki(tmp_path):
    (tmp_path / "a.cor").write_text("first doc here\nsecond doc\n")
    with bz2.open(tmp_path / "b.cor.bz2", "wt", encoding="utf-8") as f:
        f.write("third\n")
    dump = wiki_dump([("Paris", 0, "'''Paris''' is in [[France]].{{cite}}"),
                      ("Talk:Paris", 1, "talk page text"),
                      ("Lutetia", 0, "#REDIRECT [[Paris]]"),
                      ("Rome", 0, "Rome &amp;nbsp;is &lt;ref&gt;x&lt;/ref&gt;old.")])
    with bz2.open(tmp_path / "w.xml.bz2", "wt", encoding="utf-8") as f:
        f.write(dump)
    docs = read_documents([tmp_path / "a.cor", tmp_path / "b.cor.bz2", tmp_path / "w.xml.bz2"])
    assert [" ".join(d.split()) for d in docs] == ["first doc here", "second doc", "third", "Paris is in France.",
                                                  "Rome is old."]


def test_read_documents_errors_name_the_file_and_fix(tmp_path):
    with pytest.raises(DataError, match=r"nope.cor: no such file; fix dataset.train"):
        read_documents([tmp_path / "nope.cor"])
    (tmp_path / "latin.cor").write_bytes(b"price \xa3 5\n")
    with pytest.raises(DataError, match=r"latin.cor: cannot read it as utf-8 text .*set dataset.encoding"):
        read_documents([tmp_path / "latin.cor"])
    assert read_documents([tmp_path / "latin.cor"], encoding="latin-1") == ["price £ 5"]
    (tmp_path / "empty.cor").write_text("")
    with pytest.raises(DataError, match=r"empty.cor: no documents in it"):
        read_documents([tmp_path / "empty.cor"])


# ---- vocabulary and corpus -------------------------------------------------------------------------


def test_build_corpus_orders_by_count_and_drops_rare_words():
    docs = [["c", "a", "b", "a"], ["x"], ["b", "a", "c", "y", "c"]]
    vocab, corpus = build_corpus(docs, min_count=2)
    assert vocab.words.tolist() == ["c", "a", "b"]  # c: 3; a: 3 (seen after c); b: 2
    assert vocab.counts.tolist() == [3, 3, 2]
    assert corpus.tokens.tolist() == [0, 1, 2, 1, 2, 1, 0, 0]  # "x" and "y" dropped; doc 2 vanished
    assert corpus.offsets.tolist() == [0, 4, 8]
    assert vocab.encode(["b", "zzz"]).tolist() == [2, -1] and vocab.decode([1]).tolist() == ["a"]
    vocab2, _ = build_corpus(docs, min_count=1, max_vocab=2)
    assert vocab2.words.tolist() == ["c", "a"]


def test_build_corpus_errors():
    with pytest.raises(ConfigError, match=r"min_count=0; use 1 or more"):
        build_corpus([["a"]], min_count=0)
    with pytest.raises(DataError, match=r"no word occurs 5 times or more in 2 tokens; lower dataset.min_count"):
        build_corpus([["a", "b"]], min_count=5)


# ---- the token source ------------------------------------------------------------------------------


def corpus_of(docs: list[list[int]]) -> Corpus:
    lengths = [len(d) for d in docs]
    return Corpus(torch.tensor([t for d in docs for t in d], dtype=torch.int64),
                  torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int64))


DOCS = [[0, 1, 2], [3, 4, 5, 6, 7], [8], [9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21]]


@pytest.mark.parametrize("shards, batch_size", [(1, 4), (2, 3), (3, 5), (4, 1), (5, 100)])
def test_shards_partition_the_corpus_in_batches_of_consecutive_tokens(shards, batch_size):
    corpus = corpus_of(DOCS)
    source = TokenSource(corpus)
    seen = []
    counts = []
    for k in range(shards):
        batches = list(source.batches(batch_size, k, shards, epoch=0))
        counts.append(len(batches))
        for batch in batches:
            assert isinstance(batch, TokenBatch) and batch.batch_size == batch.sparse.values().numel()
            assert batch.batch_size <= batch_size and batch.dense.shape == (batch.batch_size, 0)
            seen.extend(batch.sparse.values().tolist())
            # Bags follow document boundaries: each bag's tokens lie in one document.
            doc_of = {t: d for d, doc in enumerate(DOCS) for t in doc}
            values = batch.sparse.values().tolist()
            start = 0
            for length in batch.sparse.lengths().tolist():
                assert length > 0 and len({doc_of[t] for t in values[start:start + length]}) == 1
                start += length
            assert len({doc_of[v] for v in values}) == batch.sparse.lengths().numel()
    assert seen == list(range(22))  # every token once, in order
    # The same number of batches per shard as the sync mode's count (recps.data.sharding.WorkerShards).
    assert counts == WorkerShards(source, 0, 1).shard_batches(batch_size, shards)


def test_shuffle_permutes_batches_per_epoch_reproducibly():
    corpus = corpus_of([list(range(40))])
    plain = [b.sparse.values().tolist() for b in TokenSource(corpus).batches(4, 0, 1, 0)]
    shuffled = TokenSource(corpus, shuffle=True, seed=3)
    e0 = [b.sparse.values().tolist() for b in shuffled.batches(4, 0, 1, 0)]
    e1 = [b.sparse.values().tolist() for b in shuffled.batches(4, 0, 1, 1)]
    assert sorted(e0) == sorted(e1) == plain and e0 != plain and e0 != e1
    assert e0 == [b.sparse.values().tolist() for b in shuffled.batches(4, 0, 1, 0)]


def test_token_source_errors():
    source = TokenSource(corpus_of(DOCS))
    with pytest.raises(ConfigError, match=r"batch_size=0; use 1 or more \(tokens per batch\)"):
        next(source.batches(0, 0, 1, 0))
    with pytest.raises(ConfigError, match=r"shard 2 of 2"):
        next(source.batches(4, 2, 2, 0))


# ---- evaluation sets -------------------------------------------------------------------------------


VOCAB = Vocabulary(np.array(["king", "queen", "man", "woman", "paris", "france"], dtype=object),
                   np.array([6, 5, 4, 3, 2, 1]))


def test_read_word_pairs_skips_comments_and_header_and_counts_coverage(tmp_path):
    path = tmp_path / "ws.tsv"
    path.write_text("# a comment\nWord 1\tWord 2\tHuman (mean)\nKing\tqueen\t8.5\nman\tunicorn\t3\nparis\tfrance\t9\n")
    pairs = read_word_pairs(path, VOCAB)
    assert pairs.pairs.tolist() == [[0, 1], [4, 5]] and pairs.scores.tolist() == [8.5, 9.0] and pairs.total == 3
    path.write_text("king queen 8\nking queen\n")
    with pytest.raises(DataError, match=r"ws.tsv:2: 'king queen' is not 'word word score'"):
        read_word_pairs(path, VOCAB)


def test_read_analogies_keeps_covered_questions_with_sections(tmp_path):
    path = tmp_path / "q.txt"
    path.write_text(": capital\nParis France Rome Italy\nparis france king queen\n: gram-gender\nking queen man woman\n")
    analogies = read_analogies(path, VOCAB)
    assert analogies.questions.tolist() == [[4, 5, 0, 1], [0, 1, 2, 3]]
    assert analogies.sections.tolist() == [0, 1] and analogies.section_names == ("capital", "gram-gender")
    assert analogies.total == 3
    path.write_text("king queen man woman\n")
    with pytest.raises(DataError, match=r"q.txt:1: 'king queen man woman' is not four words after a ': section'"):
        read_analogies(path, VOCAB)


# ---- generated corpus and data sets ----------------------------------------------------------------


def test_zipf_corpus_is_deterministic_and_plants_topic_similarity(tmp_path):
    a = generate_zipf_corpus(tmp_path / "a", documents=200, words_per_document=50, vocab=300, topics=10, seed=1)
    b = generate_zipf_corpus(tmp_path / "b", documents=200, words_per_document=50, vocab=300, topics=10, seed=1)
    assert a[0].read_bytes() == b[0].read_bytes() and a[1].read_bytes() == b[1].read_bytes()
    docs = tokenize(read_documents([a[0]]))
    assert len(docs) == 200 and all(len(d) == 50 for d in docs)
    # Zipf: the most frequent word ("wa", rank 1) is about 2^1.05 times as frequent as rank 2 ("wb").
    flat = [w for d in docs for w in d]
    assert 1.5 < flat.count("wa") / flat.count("wb") < 2.8
    # The similarity set scores a pair 2 (same topic, w mod 10), 1 (neighbouring topics on the ring), 0.
    lines = [line.split("\t") for line in a[1].read_text().splitlines()[1:]]
    index = {f"w{chr(97 + i)}": i for i in range(26)}
    for w1, w2, score in lines:
        if w1 in index and w2 in index:
            d = abs(index[w1] % 10 - index[w2] % 10)
            assert float(score) == max(0, 2 - min(d, 10 - d))


def test_prepare_text_falls_back_to_zipf_with_a_warning(tmp_path, caplog):
    fallback = dict(documents=100, words_per_document=40, vocab=200, topics=8)
    with caplog.at_level(logging.WARNING):
        data = prepare_text("t", [tmp_path / "absent.xml.bz2"], similarity={"ws": tmp_path / "absent.tsv"},
                            min_count=1, fallback_dir=tmp_path / "zipf", fallback=fallback, seed=2)
    assert "absent.xml.bz2 absent; training on the generated Zipf corpus" in caplog.text
    assert list(data.test.similarity) == ["zipf_topics"] and data.test.analogies is None
    assert data.corpus.num_tokens == 4000 and data.num_embeddings == len(data.vocabulary)
    assert data.schema.feature_names == SKIPGRAM_FEATURES
    assert data.counts.sum().item() == 4000
    with pytest.raises(DataError, match=r"absent.xml.bz2: no such file"):
        prepare_text("t", [tmp_path / "absent.xml.bz2"])
    with pytest.raises(ConfigError, match=r"train lists no corpus files"):
        prepare_text("t", [])


def test_prepare_session_corpus_makes_sessions_documents(tmp_path):
    def write(name, rows):
        lines = ["SessionId\tItemId\tTime"] + ["\t".join(map(str, r)) for r in rows]
        (tmp_path / name).write_text("\n".join(lines) + "\n")

    write("train.txt", [(1, 30, 1), (1, 10, 2), (2, 20, 3), (2, 30, 4), (2, 10, 5), (3, 40, 6)])
    write("test.txt", [(7, 10, 9), (7, 99, 10), (7, 20, 11), (7, 30, 12), (8, 30, 13), (8, 10, 14)])
    data = prepare_session_corpus("s", [tmp_path / "train.txt"], [tmp_path / "test.txt"])
    assert data.vocabulary.words.tolist() == ["10", "20", "30", "40"]
    assert data.corpus.tokens.tolist() == [2, 0, 1, 2, 0]  # session 3 has one click: dropped
    assert data.corpus.offsets.tolist() == [0, 2, 5]
    assert data.counts.tolist() == [2, 1, 2, 0]
    # Test: item 99 unseen -> dropped; probes are each click but a session's last, and the next click.
    assert data.test.queries.tolist() == [0, 1, 2] and data.test.targets.tolist() == [1, 2, 0]
    assert data.test.num_items == 4
