"""Text corpora for skip-gram training: documents → token ids, a vocabulary, batch sources.

Formats (by content; .bz2 and .gz files are decompressed by extension; the corpus is held in
memory as int64 ids, 8 bytes a token):
- plain text / `.cor`: one document per line (gensim's test corpora; one `encoding` for
  all files of a data set, e.g. latin-1 for lee.cor);
- a MediaWiki XML dump (`<mediawiki ...>`): one document per article (namespace 0, no
  redirects), its wikitext stripped of markup by `strip_wiki_markup`.

Why a regex stripper and not a wikitext parser: word vectors need running text, not a
faithful rendering. A dozen regular expressions, each run over the whole text of all
articles at once (C loops, no Python loop per token or per article), remove comments,
references, templates and tables (innermost first, until none is left), file and category
links, and keep link labels; the Wikipedia excerpt of ../shared/data (106 articles, 6 MB of
XML) is stripped in ~1.5 s. A full parser (mwparserfromhell) renders more faithfully, is
one more dependency and an order of magnitude slower.

Tokens are maximal runs of letters (`[^\\W\\d_]+`, Unicode), lower-cased. The vocabulary
keeps words seen at least `min_count` times (the `max_vocab` most frequent ones when set),
id 0 being the most frequent word (word2vec's order; ties in first-seen order); other
tokens are dropped from the corpus before any window is formed, as word2vec does.

Shapes: N corpus tokens, Dc documents, V vocabulary words, n tokens of a batch, P the
document pieces of a batch.

`TokenSource` is the trainer's `BatchSource`: shard k of n is a contiguous run of the
corpus (its share of the N tokens: the first N mod n shards hold one token more), cut into
batches of `batch_size` consecutive tokens. A `TokenBatch` holds the tokens of one batch as
one feature whose bags are the document pieces in it (a window never crosses a bag); its
`batch_size` is the token count, so the trainer's examples/s are words/s. Pairs, negatives
and subsampling are the task's work (recps.tasks.skipgram).

The held-out side is a `WordEvaluation`: word-similarity sets (word pairs with human
scores, e.g. WordSim-353) and analogy questions (questions-words.txt), encoded with the
vocabulary; pairs and questions with an unknown word are left out and counted.

Sessions of clicks (item2vec) are documents too: `prepare_session_corpus` reads them with
recps.data.sessions (the click reader shared with GRU4Rec / SASRec) and makes each training
session a document of item ids; its held-out side is a `SessionProbe` (each test click and
the click that follows it).

When the configured files are absent and `fallback_dir` is set, `prepare_text` generates a
Zipf corpus with planted topics there (`generate_zipf_corpus`) and says so in a warning.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "c.cor").write_text("the cat sat on the mat\\nthe dog sat\\n")
    >>> data = prepare_text("toy", [d / "c.cor"], min_count=2)
    >>> data.vocabulary.words.tolist(), data.vocabulary.counts.tolist()
    (['the', 'sat'], [3, 2])
    >>> data.corpus.tokens.tolist(), data.corpus.offsets.tolist()   # rare words dropped
    ([0, 1, 0, 0, 1], [0, 3, 5])
    >>> batch = next(data.train.batches(4, 0, 1, 0))
    >>> batch.batch_size, batch.sparse.values().tolist(), batch.sparse.lengths().tolist()
    (4, [0, 1, 0, 0], [3, 1])
"""

from __future__ import annotations

import bz2
import gzip
import html
import io
import itertools
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recps.data.batch import Batch
from recps.data.schema import Schema
from recps.data.sessions import ItemVocabulary, build_sessions, read_train_test
from recps.errors import ConfigError, DataError

__all__ = [
    "Corpus",
    "SessionProbe",
    "TextData",
    "TokenBatch",
    "TokenSource",
    "Vocabulary",
    "WordEvaluation",
    "build_corpus",
    "generate_zipf_corpus",
    "prepare_session_corpus",
    "prepare_text",
    "read_analogies",
    "read_documents",
    "read_word_pairs",
    "strip_wiki_markup",
    "tokenize",
]

log = logging.getLogger(__name__)

#: The KJT feature of a TokenBatch.
TOKEN_FEATURE = "tokens"
#: The two tables a skip-gram model reads: input (word) vectors and output (context) vectors.
SKIPGRAM_FEATURES = ("input", "output")

_WORD = re.compile(r"[^\W\d_]+")
_PAGE = re.compile(r"<page>.*?<ns>(\d+)</ns>.*?<text\b[^>]*?(?:/>|>(.*?)</text>)", re.S)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_EMPTY_TAG = re.compile(r"<(?:ref|references|math|gallery|timeline|score|syntaxhighlight|source|pre|imagemap|"
                        r"nowiki|br|hr)\b[^>]*?/>", re.I)
_DROPPED_TAG = re.compile(r"<(ref|math|gallery|timeline|score|syntaxhighlight|source|pre|imagemap|"
                          r"chem|hiero)\b[^>]*>.*?</\1\s*>", re.S | re.I)
_ANY_TAG = re.compile(r"</?[A-Za-z][^>\n]{0,300}>")
_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_TABLE = re.compile(r"\{\|(?:[^{}]|\{(?!\|))*?\|\}")
_FILE_LINK = re.compile(r"\[\[(?:[Ff]ile|[Ii]mage|[Cc]ategory|[Mm]edia|[a-z]{2,3}(?:-[a-z]+)?):[^\[\]]*\]\]")
_LINK = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]|]*)\]\]")
_EXTERNAL_LINK = re.compile(r"\[(?:https?|ftp)://[^\s\]]*\s*([^\]]*)\]")
_URL = re.compile(r"(?:https?|ftp)://\S+")
_FORMATTING = re.compile(r"'{2,}|={2,}|__[A-Z]+__")
_NESTING_PASSES = 32  # deeper template / link nesting than this is left as text
_DOC_SEP = "\x00"


def strip_wiki_markup(text: str) -> str:
    """Running text of wikitext (one article, or several joined by "\\x00", which survives).

    >>> strip_wiki_markup("'''Paris''' is the [[capital city|capital]] of [[France]].{{cite|x={{y}}}}<ref>a</ref>")
    ' Paris  is the capital of France.  '
    """
    text = _COMMENT.sub(" ", text)
    text = _EMPTY_TAG.sub(" ", text)
    text = _DROPPED_TAG.sub(" ", text)
    text = _ANY_TAG.sub(" ", text)
    for _ in range(_NESTING_PASSES):  # innermost templates and tables first, until none is left
        text, templates = _TEMPLATE.subn(" ", text)
        text, tables = _TABLE.subn(" ", text)
        if templates + tables == 0:
            break
    for _ in range(_NESTING_PASSES):  # links inside file captions go first, then the file link
        text, files = _FILE_LINK.subn(" ", text)
        text, links = _LINK.subn(r"\1", text)
        if files + links == 0:
            break
    text = _EXTERNAL_LINK.sub(r"\1", text)
    text = _URL.sub(" ", text)
    return _FORMATTING.sub(" ", text)


def _open_text(path: str, encoding: str) -> io.TextIOBase:
    opener = {".bz2": bz2.open, ".gz": gzip.open}.get(Path(path).suffix.lower())
    if opener is not None:
        return opener(path, "rt", encoding=encoding)
    return open(path, encoding=encoding)


def read_documents(paths: Sequence[str | os.PathLike], encoding: str = "utf-8") -> list[str]:
    """The documents of `paths`, in order: one per line, or one per article of a MediaWiki XML
    dump (markup stripped). Raises DataError for a missing, unreadable or empty file."""
    documents: list[str] = []
    for path in map(str, paths):
        if not os.path.isfile(path):
            raise DataError(f"text corpus {path}: no such file; fix dataset.train (or set dataset.fallback_dir "
                            "to train on a generated Zipf corpus instead)")
        try:
            with _open_text(path, encoding) as f:
                text = f.read()
        except (OSError, UnicodeDecodeError, EOFError) as exc:
            raise DataError(f"text corpus {path}: cannot read it as {encoding} text ({exc}); set "
                            "dataset.encoding (lee.cor is latin-1) or check the file") from None
        if text.lstrip().startswith("<mediawiki"):
            pages = [body for ns, body in _PAGE.findall(text) if ns == "0"]
            # The dump escapes wikitext once (&lt;ref&gt;) and its entities twice (&amp;nbsp;).
            pages = [html.unescape(html.unescape(p)) for p in pages]
            pages = [p for p in pages if p and not p.lstrip()[:9].upper().startswith("#REDIRECT")]
            found = strip_wiki_markup(_DOC_SEP.join(pages)).split(_DOC_SEP) if pages else []
        else:
            found = text.splitlines()
        if not found:
            raise DataError(f"text corpus {path}: no documents in it (an empty file, or a wiki dump without "
                            "articles); remove it from dataset.train")
        documents.extend(found)
    return documents


def tokenize(documents: Sequence[str], lowercase: bool = True) -> list[list[str]]:
    """Each document's tokens: maximal runs of letters, lower-cased.

    >>> tokenize(["Hello, World! It's 2024."])
    [['hello', 'world', 'it', 's']]
    """
    return [_WORD.findall(d.lower() if lowercase else d) for d in documents]


@dataclass(frozen=True)
class Vocabulary:
    """Words by descending count (id 0 = the most frequent) and their corpus counts.

    words: (V,) str (object array); counts: (V,) int64, counts in the corpus the
    vocabulary was built from (before subsampling).
    """

    words: np.ndarray
    counts: np.ndarray

    def __len__(self) -> int:
        return int(self.words.shape[0])

    def encode(self, words: Any) -> np.ndarray:
        """(M,) words → (M,) int64 ids, -1 for a word outside the vocabulary."""
        return pd.Index(self.words).get_indexer(np.asarray(words, dtype=object)).astype(np.int64)

    def decode(self, ids: Any) -> np.ndarray:
        return self.words[np.asarray(ids, dtype=np.int64)]


@dataclass(frozen=True)
class Corpus:
    """Token ids of all documents, flat.

    tokens: (N,) int64 ids 0..V-1; offsets: (Dc+1,) int64, document d is tokens[offsets[d]:offsets[d+1]].
    """

    tokens: torch.Tensor
    offsets: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_documents(self) -> int:
        return int(self.offsets.numel() - 1)


def build_corpus(documents: Sequence[Sequence[str]], min_count: int = 5,
                 max_vocab: int | None = None) -> tuple[Vocabulary, Corpus]:
    """Vocabulary of the words seen >= `min_count` times (the `max_vocab` most frequent when
    set) and the corpus of their ids; other tokens are dropped, documents left empty too.

    >>> vocab, corpus = build_corpus([["b", "a", "b"], ["a", "c", "b"]], min_count=2)
    >>> vocab.words.tolist(), corpus.tokens.tolist(), corpus.offsets.tolist()
    (['b', 'a'], [0, 1, 0, 1, 0], [0, 3, 5])
    """
    if min_count < 1:
        raise ConfigError(f"dataset.min_count={min_count}; use 1 or more")
    lengths = np.fromiter((len(d) for d in documents), dtype=np.int64, count=len(documents))
    flat = np.fromiter(itertools.chain.from_iterable(documents), dtype=object, count=int(lengths.sum()))
    codes, uniques = pd.factorize(flat)  # first-seen order
    counts = np.bincount(codes, minlength=len(uniques)).astype(np.int64)
    order = np.argsort(-counts, kind="stable")  # by count, ties in first-seen order
    order = order[counts[order] >= min_count]
    if max_vocab is not None:
        order = order[: int(max_vocab)]
    if order.size == 0:
        raise DataError(f"no word occurs {min_count} times or more in {flat.size} tokens; lower dataset.min_count "
                        "or give a larger corpus")
    new_id = np.full(len(uniques), -1, dtype=np.int64)
    new_id[order] = np.arange(order.size)
    ids = new_id[codes]  # (N_raw,)
    kept = ids >= 0
    doc_of = np.repeat(np.arange(lengths.size), lengths)
    kept_lengths = np.bincount(doc_of[kept], minlength=lengths.size)
    kept_lengths = kept_lengths[kept_lengths > 0]
    offsets = np.zeros(kept_lengths.size + 1, dtype=np.int64)
    np.cumsum(kept_lengths, out=offsets[1:])
    vocab = Vocabulary(np.asarray(uniques, dtype=object)[order], counts[order])
    return vocab, Corpus(torch.from_numpy(ids[kept]), torch.from_numpy(offsets))


@dataclass
class TokenBatch(Batch):
    """n consecutive corpus tokens: `sparse` holds one feature ("tokens"), a bag per document
    piece (P bags, lengths (P,), values (n,) ids); dense (n, 0); labels (n, 0), so that
    `batch_size` is n, the words of the batch."""


class TokenSource:
    """The trainer's `BatchSource` over a `Corpus` (see the module docstring).

    Args:
        corpus: the training corpus.
        shuffle: visit a shard's batches in a random order per (seed, shard, epoch); the
            tokens inside a batch stay in corpus order.
        seed: the shuffle's seed.
    """

    def __init__(self, corpus: Corpus, shuffle: bool = False, seed: int = 0) -> None:
        self.corpus = corpus
        self.shuffle = shuffle
        self.seed = seed

    def __len__(self) -> int:
        return self.corpus.num_tokens

    def shard_range(self, shard_index: int, num_shards: int) -> tuple[int, int]:
        """Token range [start, end) of shard k of n: contiguous, sizes as `range(k, N, n)`."""
        if num_shards < 1 or not 0 <= shard_index < num_shards:
            raise ConfigError(f"shard {shard_index} of {num_shards}: need 0 <= shard < shards")
        q, r = divmod(len(self), num_shards)
        start = shard_index * q + min(shard_index, r)
        return start, start + q + (1 if shard_index < r else 0)

    def batches(self, batch_size: int, shard_index: int, num_shards: int, epoch: int) -> Iterator[TokenBatch]:
        if batch_size < 1:
            raise ConfigError(f"trainer.batch_size={batch_size}; use 1 or more (tokens per batch)")
        start, end = self.shard_range(shard_index, num_shards)
        starts = torch.arange(start, end, batch_size)  # (batches,)
        if self.shuffle and starts.numel() > 1:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + shard_index) * 1_000_003 + epoch)
            starts = starts[torch.randperm(starts.numel(), generator=g)]
        for first in starts.tolist():
            yield self._batch(first, min(first + batch_size, end))

    def _batch(self, first: int, last: int) -> TokenBatch:
        tokens = self.corpus.tokens[first:last]  # (n,)
        offsets = self.corpus.offsets
        # Document boundaries strictly inside (first, last) cut the batch into pieces.
        lo = int(torch.searchsorted(offsets, first, right=True))
        hi = int(torch.searchsorted(offsets, last, right=False))
        cuts = torch.cat([torch.tensor([first]), offsets[lo:hi], torch.tensor([last])])  # (P+1,)
        lengths = cuts.diff()  # (P,)
        lengths = lengths[lengths > 0]
        n = tokens.numel()
        sparse = KeyedJaggedTensor(keys=[TOKEN_FEATURE], values=tokens, lengths=lengths, stride=lengths.numel())
        return TokenBatch(dense=torch.zeros(n, 0), sparse=sparse, labels=torch.zeros(n, 0))


# ------------------------------------------------------------------------------ evaluation sets


@dataclass(frozen=True)
class WordPairs:
    """A word-similarity set encoded with a vocabulary.

    pairs: (P, 2) int64 ids of the covered pairs; scores: (P,) float64 human scores;
    total: pairs in the file (covered or not).
    """

    pairs: torch.Tensor
    scores: torch.Tensor
    total: int


@dataclass(frozen=True)
class Analogies:
    """Analogy questions a:b :: c:d encoded with a vocabulary.

    questions: (Q, 4) int64 ids of the covered questions; sections: (Q,) int64 index into
    `section_names`; total: questions in the file (covered or not).
    """

    questions: torch.Tensor
    sections: torch.Tensor
    section_names: tuple[str, ...]
    total: int


@dataclass
class WordEvaluation:
    """The held-out side of a text data set: similarity sets by name, analogies (or None)."""

    vocabulary: Vocabulary
    similarity: dict[str, WordPairs] = field(default_factory=dict)
    analogies: Analogies | None = None


def read_word_pairs(path: str | os.PathLike, vocabulary: Vocabulary) -> WordPairs:
    """A similarity file: `word1<TAB or space>word2<sep>score` per line, '#' comments, an
    optional header line (WordSim-353's .tsv; SimLex-999's header with extra columns)."""
    rows: list[tuple[str, str, float]] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            fields = line.split()
            if not fields or line.startswith("#"):
                continue
            try:
                rows.append((fields[0].lower(), fields[1].lower(), float(fields[2])))
            except (IndexError, ValueError):
                if rows:  # a header may only come first
                    raise DataError(f"{path}:{number}: {line.strip()!r} is not 'word word score'; fix the "
                                    "line or the path of the similarity set") from None
    if not rows:
        raise DataError(f"{path}: no 'word word score' lines; check the similarity set's path")
    ids = vocabulary.encode([w for a, b, _ in rows for w in (a, b)]).reshape(-1, 2)  # (P_all, 2)
    covered = (ids >= 0).all(axis=1)
    scores = np.array([s for _, _, s in rows])[covered]
    return WordPairs(torch.from_numpy(ids[covered]), torch.from_numpy(scores), len(rows))


def read_analogies(path: str | os.PathLike, vocabulary: Vocabulary) -> Analogies:
    """questions-words.txt: ': section' lines, then `a b c d` per line (case folded)."""
    words: list[str] = []
    sections: list[int] = []
    names: list[str] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.startswith(":"):
                names.append(line[1:].strip())
                continue
            fields = line.lower().split()
            if not fields:
                continue
            if len(fields) != 4 or not names:
                raise DataError(f"{path}:{number}: {line.strip()!r} is not four words after a ': section' line; "
                                "fix the analogy file")
            words.extend(fields)
            sections.append(len(names) - 1)
    if not sections:
        raise DataError(f"{path}: no analogy questions; check dataset.analogies")
    ids = vocabulary.encode(words).reshape(-1, 4)  # (Q_all, 4)
    covered = (ids >= 0).all(axis=1)
    return Analogies(torch.from_numpy(ids[covered]), torch.tensor(sections)[torch.from_numpy(covered)],
                     tuple(names), len(sections))


# ------------------------------------------------------------------------------ generated corpus


def generate_zipf_corpus(out_dir: str | os.PathLike, documents: int = 2000, words_per_document: int = 200,
                         vocab: int = 5000, topics: int = 50, topic_share: float = 0.5, zipf: float = 1.05,
                         seed: int = 0) -> tuple[Path, Path]:
    """Writes a Zipf corpus with planted topics and a similarity set graded by topic distance.

    Word w (rank w+1, spelled "w" + w in base-26 letters) has global frequency ∝ (w+1)^-zipf and belongs to topic w mod `topics`;
    topics sit on a ring. A document picks a topic t; each of its tokens is, with probability
    `topic_share`, a word of t or of a ring neighbour of t (t±1, half as likely), drawn by
    global frequency among them, else a word of the whole vocabulary. The similarity set
    scores 2000 random pairs of the 1000 most frequent words 2 (same topic), 1 (neighbouring
    topics) or 0: co-occurrence statistics (and so skip-gram vectors) can recover it.
    Returns (corpus.cor, similarity.tsv); files already there are kept.
    """
    out = Path(out_dir)
    corpus_path, pairs_path = out / "corpus.cor", out / "similarity.tsv"
    if corpus_path.is_file() and pairs_path.is_file():
        return corpus_path, pairs_path
    if topics < 3 or vocab < topics or not 0.0 <= topic_share <= 1.0:
        raise ConfigError(f"generate_zipf_corpus: topics={topics}, vocab={vocab}, topic_share={topic_share}; "
                          "need topics >= 3, vocab >= topics, 0 <= topic_share <= 1")
    rng = np.random.default_rng(seed)
    weights = np.arange(1, vocab + 1, dtype=np.float64) ** -zipf  # (V,)
    global_cdf = np.cumsum(weights) / weights.sum()
    topic_of = np.arange(vocab) % topics  # (V,)
    by_topic = [np.flatnonzero(topic_of == t) for t in range(topics)]
    topic_cdfs = [np.cumsum(weights[m]) / weights[m].sum() for m in by_topic]
    n = documents * words_per_document
    doc_topic = rng.integers(0, topics, documents)  # (Dc,)
    token_doc = np.repeat(np.arange(documents), words_per_document)  # (N,)
    shift = rng.choice([-1, 0, 0, 1], size=n)  # neighbours half as likely as the topic itself
    token_topic = (doc_topic[token_doc] + shift) % topics  # (N,)
    from_topic = rng.random(n) < topic_share
    tokens = np.searchsorted(global_cdf, rng.random(n))  # (N,) global draws
    u = rng.random(n)
    for t in range(topics):  # one vectorised draw per topic
        sel = np.flatnonzero(from_topic & (token_topic == t))
        tokens[sel] = by_topic[t][np.minimum(np.searchsorted(topic_cdfs[t], u[sel]), by_topic[t].size - 1)]
    tokens = np.minimum(tokens, vocab - 1)
    names = np.array([_letters(i) for i in range(vocab)], dtype=object)  # tokens are letters only
    lines = [" ".join(doc) for doc in names[tokens].reshape(documents, words_per_document).tolist()]
    top = min(1000, vocab)
    a, b = rng.integers(0, top, 2000), rng.integers(0, top, 2000)
    keep = a != b
    distance = np.abs(topic_of[a] - topic_of[b])
    distance = np.minimum(distance, topics - distance)
    scores = np.maximum(0, 2 - distance)  # same topic 2, neighbours 1, else 0
    out.mkdir(parents=True, exist_ok=True)
    corpus_path.write_text("\n".join(lines) + "\n")
    pairs_path.write_text("# word1\tword2\tscore (2 same topic, 1 neighbouring topics, 0 else)\n" + "".join(
        f"{names[i]}\t{names[j]}\t{s:.1f}\n" for i, j, s in zip(a[keep], b[keep], scores[keep])))
    return corpus_path, pairs_path


def _letters(i: int) -> str:
    """A word of letters for index i: 'wa', 'wb', ..., 'wz', 'wba', ... (base 26)."""
    digits = []
    while True:
        i, r = divmod(i, 26)
        digits.append(chr(97 + r))
        if i == 0:
            return "w" + "".join(reversed(digits))


# ------------------------------------------------------------------------------ data set


@dataclass
class TextData:
    """What `recps.job` trains and evaluates on (as `PreparedData`), plus the vocabulary.

    schema: the skip-gram tables' features (sequence "input", "output"; label "context");
    train: a `TokenSource`; test: a `WordEvaluation` (text) or a `SessionProbe` (sessions);
    num_embeddings: V.
    """

    schema: Schema
    vocabulary: Vocabulary
    corpus: Corpus
    train: TokenSource
    test: WordEvaluation | SessionProbe
    best_auc: float | None = None

    @property
    def num_embeddings(self) -> int:
        return len(self.vocabulary)

    @property
    def counts(self) -> torch.Tensor:
        """(V,) int64 corpus counts of the words (the task's subsampling and negatives)."""
        return torch.from_numpy(self.vocabulary.counts)


def prepare_text(
    name: str,
    train: Sequence[str | os.PathLike],
    similarity: Mapping[str, str | os.PathLike] | None = None,
    analogies: str | os.PathLike | None = None,
    min_count: int = 5,
    max_vocab: int | None = None,
    encoding: str = "utf-8",
    shuffle: bool = False,
    fallback_dir: str | os.PathLike | None = None,
    fallback: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> TextData:
    """Reads (or generates) a corpus and its evaluation sets.

    Args:
        train: corpus files (see the module docstring for the formats).
        similarity: name -> word-similarity file (e.g. {"wordsim353": ".../wordsim353.tsv"}).
        analogies: a questions-words file, or None.
        min_count, max_vocab: the vocabulary (see `build_corpus`).
        encoding: of every text file of the corpus.
        shuffle: visit batches in a random order per epoch (see `TokenSource`).
        fallback_dir: when a corpus file is missing, generate a Zipf corpus here instead
            (`generate_zipf_corpus` with the `fallback` arguments; its similarity set is
            evaluated as "zipf_topics") and log a warning; None: a missing file is an error.
    """
    paths = [str(p) for p in train]
    if not paths:
        raise ConfigError(f"dataset {name!r}: train lists no corpus files; set dataset.train")
    similarity = dict(similarity or {})
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing and fallback_dir is not None:
        generate = {"seed": seed, **dict(fallback or {})}
        corpus_path, pairs_path = generate_zipf_corpus(fallback_dir, **generate)
        log.warning("dataset %s: %s absent; training on the generated Zipf corpus %s instead (evaluation: its "
                    "planted topic similarity, no analogies)", name, missing[0], corpus_path)
        paths, similarity, analogies, encoding = [str(corpus_path)], {"zipf_topics": pairs_path}, None, "utf-8"
    vocabulary, corpus = build_corpus(tokenize(read_documents(paths, encoding)), min_count, max_vocab)
    evaluation = WordEvaluation(vocabulary)
    for set_name, path in similarity.items():
        evaluation.similarity[set_name] = read_word_pairs(path, vocabulary)
    if analogies is not None:
        evaluation.analogies = read_analogies(analogies, vocabulary)
    log.info("dataset %s: %d documents, %d tokens, %d words (min_count %d); similarity %s; analogies %s", name,
             corpus.num_documents, corpus.num_tokens, len(vocabulary), min_count,
             {k: f"{v.pairs.shape[0]}/{v.total} pairs" for k, v in evaluation.similarity.items()},
             None if evaluation.analogies is None else
             f"{evaluation.analogies.questions.shape[0]}/{evaluation.analogies.total} questions")
    schema = Schema(labels=("context",), sequence=SKIPGRAM_FEATURES)
    return TextData(schema, vocabulary, corpus, TokenSource(corpus, shuffle, seed), evaluation)


# ------------------------------------------------------------------------------ sessions (item2vec)


@dataclass(frozen=True)
class SessionProbe:
    """Next-click probes of test sessions: queries (M,) the clicked items (every click but a
    session's last), targets (M,) the items clicked next; item_counts (C,) training clicks."""

    queries: torch.Tensor
    targets: torch.Tensor
    item_counts: torch.Tensor

    @property
    def num_items(self) -> int:
        return int(self.item_counts.numel())


def prepare_session_corpus(
    name: str,
    train: Sequence[str | os.PathLike],
    test: Sequence[str | os.PathLike],
    session_key: str = "SessionId",
    item_key: str = "ItemId",
    time_key: str = "Time",
    separator: str = "\t",
    integer_ids: bool = True,
    min_length: int = 2,
    shuffle: bool = False,
    error_budget: float | int = 0.001,
    seed: int = 0,
    header: bool = True,
    columns: Sequence[str] | None = None,
    time_format: str = "number",
    test_days: float | None = None,
    order_key: str | None = None,
    order_format: str = "number",
) -> TextData:
    """Click files → a corpus whose documents are the training sessions (item ids 0..C-1, the
    vocabulary of recps.data.sessions) and a SessionProbe of the test sessions (clicks on items
    unseen in training dropped, then sessions shorter than `min_length`, as GRU4Rec's protocol).
    The layout (`order_key`: the column ordering a session's clicks, when the time column does not)
    and `test_days` (the last N days of `train` as the test split) are
    recps.data.sessions.prepare_sessions'."""
    read = dict(session_key=session_key, item_key=item_key, time_key=time_key, separator=separator,
                integer_ids=integer_ids, error_budget=error_budget, header=header, columns=columns,
                time_format=time_format, order_key=order_key, order_format=order_format)
    clicks, test_clicks = read_train_test(name, train, test, test_days, **read)
    items = ItemVocabulary.from_items(clicks["item"].to_numpy())
    sessions = build_sessions(clicks, items, min_length)
    held_out = build_sessions(test_clicks, items, min_length)
    if sessions.num_sessions == 0 or held_out.num_sessions == 0:
        raise DataError(f"dataset {name!r}: {sessions.num_sessions} train / {held_out.num_sessions} test sessions "
                        f"with >= {min_length} known clicks; check the files and min_length")
    counts = sessions.item_counts(len(items))  # (C,)
    vocabulary = Vocabulary(items.raw_ids.astype(str).astype(object), counts.numpy().astype(np.int64))
    corpus = Corpus(sessions.items, sessions.offsets)
    last = torch.zeros(held_out.num_clicks, dtype=torch.bool)
    last[held_out.offsets[1:] - 1] = True  # (M_test,) a session's last click predicts nothing
    probe = SessionProbe(held_out.items[~last], held_out.items[torch.roll(~last, 1)], counts)
    log.info("dataset %s: %d items; train %d sessions, %d clicks; test %d next-click probes", name, len(items),
             sessions.num_sessions, sessions.num_clicks, probe.queries.numel())
    schema = Schema(labels=("context",), sequence=SKIPGRAM_FEATURES)
    return TextData(schema, vocabulary, corpus, TokenSource(corpus, shuffle, seed), probe)
