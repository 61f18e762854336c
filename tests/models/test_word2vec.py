"""Word2Vec: logits against brute force (band of neighbours, negatives, block edges), gradients
against a brute-force graph, the same logits over torchrec / local FBGEMM / PS collections,
errors, and the engine's own job learning planted topics (ps=local, and item2vec's configs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from models import Word2Vec
from recps.ps.embedding import PSEmbeddingBagCollection, salted_keys

V, D = 30, 6


def collection(names=("input", "output"), dims=(D, D), vocab: int = V) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t_{n}", embedding_dim=d, num_embeddings=vocab, feature_names=[n])
        for n, d in zip(names, dims)])


def model(bias: bool = True, seed: int = 0) -> Word2Vec:
    torch.manual_seed(seed)
    m = Word2Vec(collection(), bias=bias)
    with torch.no_grad():
        if m.bias is not None:
            m.bias.fill_(0.25)
    return m


def run_kjt(tokens: list[int], negatives: list[int]) -> KeyedJaggedTensor:
    r, k = len(tokens), len(negatives)
    lengths = [1] * r + [0] * k + [1] * (r + k)
    return KeyedJaggedTensor.from_lengths_sync(["input", "output"], torch.tensor(tokens + tokens + negatives),
                                               torch.tensor(lengths))


def brute_force(m: Word2Vec, tokens: list[int], negatives: list[int], window: int):
    x = m.sparse_arch.embedding_bags["t_input"].weight
    y = m.sparse_arch.embedding_bags["t_output"].weight
    bias = 0.0 if m.bias is None else m.bias
    r = len(tokens)
    offsets = list(range(-window, 0)) + list(range(1, window + 1))
    context = torch.stack([torch.stack([
        x[tokens[i]] @ y[tokens[i + o]] + bias if 0 <= i + o < r else torch.zeros(()) + bias for o in offsets])
        for i in range(r)])  # (R, 2W)
    negative = torch.stack([torch.stack([x[tokens[i]] @ y[n] + bias for n in negatives]) for i in range(r)])
    return context, negative


@pytest.mark.parametrize("rows, window", [(1, 1), (3, 2), (15, 5), (16, 5), (17, 5), (40, 3), (33, 16)])
def test_logits_equal_brute_force_at_block_edges(rows, window):
    m = model()
    g = torch.Generator().manual_seed(rows)
    tokens = torch.randint(0, V, (rows,), generator=g).tolist()
    negatives = torch.randint(0, V, (4,), generator=g).tolist()
    context, negative = m(run_kjt(tokens, negatives), rows=rows, window=window)
    want_context, want_negative = brute_force(m, tokens, negatives, window)
    assert context.shape == (rows, 2 * window) and negative.shape == (rows, 4)
    torch.testing.assert_close(context, want_context, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(negative, want_negative, atol=1e-5, rtol=1e-5)


def test_gradients_equal_brute_force():
    tokens, negatives, window = [3, 7, 3, 9, 1, 0, 7, 2, 5, 5, 8, 13, 21, 3, 4, 6, 11, 12, 3], [1, 2, 29], 4
    weights = torch.rand(19, 2 * window, generator=torch.Generator().manual_seed(1))
    grads = []
    for path in ("model", "brute"):
        m = model()
        if path == "model":
            context, negative = m(run_kjt(tokens, negatives), rows=len(tokens), window=window)
        else:
            context, negative = brute_force(m, tokens, negatives, window)
        ((context * weights).sum() + negative.pow(2).sum()).backward()
        grads.append([p.grad.clone() for p in (m.sparse_arch.embedding_bags["t_input"].weight,
                                               m.sparse_arch.embedding_bags["t_output"].weight, m.bias)])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_vectors_read_their_own_tables():
    m = model()
    ids = torch.tensor([4, 0, 4])
    torch.testing.assert_close(m.word_vectors(ids), m.sparse_arch.embedding_bags["t_input"].weight[ids])
    torch.testing.assert_close(m.output_vectors(ids), m.sparse_arch.embedding_bags["t_output"].weight[ids])
    # A collection serving the features in the other order: the model reads by name, not position.
    torch.manual_seed(3)
    swapped = Word2Vec(collection(names=("output", "input")))
    torch.testing.assert_close(swapped.word_vectors(ids), swapped.sparse_arch.embedding_bags["t_input"].weight[ids])


def test_same_logits_over_local_fused_and_ps_collections():
    """The model does not know which collection it got: same weights, same logits; the PS
    collection pulls each table's rows once per step and pushes their gradients."""
    from recps.embeddings import LocalEmbeddingBagCollection

    m = model()
    tokens, negatives = [5, 2, 5, 9, 14, 3, 3], [7, 1]
    kjt = run_kjt(tokens, negatives)
    expected = m(kjt, rows=7, window=2)
    tables = {n: m.sparse_arch.embedding_bags[f"t_{n}"].weight.detach().clone() for n in ("input", "output")}

    local = LocalEmbeddingBagCollection(["input", "output"], D, V, optimizer="sgd", lr=0.0)
    with torch.no_grad():
        for (name, weight), padded in zip(tables.items(), local.fused.state_dict().values()):
            padded[:, :D].copy_(weight)  # TBE rows are padded to a multiple of 4

    keyed = {n: salted_keys(torch.arange(V), f"t_{n}") for n in tables}

    class Rows:  # an in-process communicator over both tables, keyed as the PS keys them
        mode = "async"
        pulls: list = []
        pushed: list = []

        def pull(self, table, keys):
            self.pulls.append(keys)
            out = torch.empty(keys.numel(), D)
            for name, ps_keys in keyed.items():
                hit = keys[:, None] == ps_keys[None, :]  # (K, V)
                found = hit.any(1)
                out[found] = tables[name][hit[found].int().argmax(1)]
            return out

        def push(self, table, keys, grads):
            self.pushed.append((keys, grads))

    communicator = Rows()
    ps = PSEmbeddingBagCollection.from_features(["input", "output"], D, communicator)
    for ebc in (local, ps):
        other = Word2Vec(ebc)
        other.load_state_dict(m.state_dict(), strict=False)
        got = other(kjt, rows=7, window=2)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    sum(t.sum() for t in got).backward()
    assert len(communicator.pulls) == 1  # both features share one PS table of width D: one pull a step
    keys, grads = communicator.pushed[-1]
    want = set(keyed["input"][tokens].tolist()) | set(keyed["output"][tokens + negatives].tolist())
    assert set(keys.tolist()) == want and grads.shape == (len(want), D)


def test_collection_must_serve_the_two_features():
    with pytest.raises(ValueError, match=r"Word2Vec: the collection serves features \['input'\]; it needs exactly two"):
        Word2Vec(collection(names=("input",), dims=(D,)))
    with pytest.raises(ValueError, match=r"input_feature='a' and output_feature='output'"):
        Word2Vec(collection(), input_feature="a")
    with pytest.raises(ValueError, match=r"embedding tables have dims \[4, 6\]"):
        Word2Vec(collection(dims=(D, 4)))
    with pytest.raises(ValueError, match=r"rows=9, window=1 with a KJT of stride 3"):
        model()(run_kjt([1, 2], [3]), rows=9, window=1)


# ---- the engine's job --------------------------------------------------------------------------------


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    from recps.config import PROJECT_ROOT, register_resolvers

    register_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def test_local_job_learns_planted_topics(tmp_path):
    """conf/ defaults (model=word2vec: dataset word2vec_text, task skipgram), ps=local, 2 Hogwild
    threads, on the generated Zipf corpus the dataset falls back to."""
    from recps.job.build import build_job
    from recps.job.run import evaluate

    cfg = compose(["model=word2vec", "ps=local", "progress=false", "model.embedding_dim=16", "trainer.batch_size=256",
                   f"dataset.train=[{tmp_path / 'absent.bz2'}]", f"dataset.fallback_dir={tmp_path / 'zipf'}",
                   "dataset.fallback.documents=300", "dataset.fallback.words_per_document=100",
                   "dataset.fallback.vocab=400", "dataset.fallback.topics=10", "ps.table.optimizer.lr=0.2"])
    job = build_job(cfg)
    assert type(job.collection).__name__ == "LocalEmbeddingBagCollection" and job.trainer.threads == 2
    assert job.collection.num_embeddings == len(job.data.vocabulary)
    before = evaluate(job)
    stats = job.trainer.fit(job.data.train, 256, epochs=4, progress=False)
    after = evaluate(job)
    assert stats.examples == 4 * job.data.corpus.num_tokens and stats.last_loss < 0.8 * stats.first_losses[0]
    assert abs(before["zipf_topics_spearman"]) < 0.15  # random start
    assert after["zipf_topics_spearman"] > 0.45  # PPMI-SVD on such a corpus: ~0.45 (tests/tasks/test_skipgram.py)


RSC15 = Path(__file__).resolve().parents[3] / "shared" / "data" / "rsc15_yoochoose"


def test_item2vec_config_trains_on_sessions(tmp_path):
    """model=item2vec composes the session corpus (rsc15 by default; planted sessions here),
    the session task, and evaluates next-click retrieval against most-popular."""
    from omegaconf import open_dict

    from recps.job.build import build_job
    from recps.job.run import evaluate

    def write(path: Path, n: int, seed: int, first: int) -> Path:
        g = torch.Generator().manual_seed(seed)
        lines = ["SessionId\tItemId\tTime"]
        for s in range(n):  # walks of items i -> i + 1 (mod 30): a click's neighbours are its successors
            start, length = int(torch.randint(0, 30, (1,), generator=g)), int(torch.randint(2, 6, (1,), generator=g))
            lines += [f"{first + s}\t{100 + (start + k) % 30}\t{k}" for k in range(length)]
        path.write_text("\n".join(lines) + "\n")
        return path

    cfg = compose(["model=item2vec", "ps=local", "progress=false", "model.embedding_dim=16", "trainer.batch_size=256",
                   "ps.table.optimizer.lr=0.1"])
    assert cfg.dataset.name == "rsc15_item2vec" and list(cfg.task.metrics) == ["recall@20", "mrr@20"]
    with open_dict(cfg):
        cfg.dataset.train = [str(write(tmp_path / "train.txt", 800, 0, 0))]
        cfg.dataset.test = [str(write(tmp_path / "test.txt", 100, 1, 10_000))]
    job = build_job(cfg)
    job.trainer.fit(job.data.train, 256, epochs=5, progress=False)
    out = evaluate(job)
    assert out["recall@20"] > 0.9 > out["most_popular/recall@20"] + 0.1
