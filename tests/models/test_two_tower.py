"""TwoTower: towers see only their own features, mean pooling, normalised scores, the
retrieval protocol's equalities (forward = score_pairs = diagonal of score), clear errors."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from models import TwoTower

FEATURES = ("user", "item", "history", "genres")


def collection(dim=8, rows=40, names=FEATURES) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t_{n}", embedding_dim=dim, num_embeddings=rows, feature_names=[n]) for n in names])


def kjt(rows: list[dict[str, list[int]]], names=FEATURES) -> KeyedJaggedTensor:
    """A KJT from per-row feature lists (feature-major, as every KJT)."""
    values = [k for n in names for r in rows for k in r.get(n, [])]
    lengths = [len(r.get(n, [])) for n in names for r in rows]
    return KeyedJaggedTensor(keys=list(names), values=torch.tensor(values, dtype=torch.int64),
                             lengths=torch.tensor(lengths, dtype=torch.int64), stride=len(rows))


ROWS = [
    {"user": [1], "item": [5], "history": [2, 3, 4], "genres": [0, 1]},
    {"user": [2], "item": [6], "history": [], "genres": [2]},
    {"user": [3], "item": [7], "history": [9], "genres": []},
]


def model(**kw) -> TwoTower:
    torch.manual_seed(0)
    return TwoTower(collection(), dense_in_features=kw.pop("dense", 0), hidden=(16,), out_dim=6, **kw)


def test_protocol_shapes_and_equalities():
    m = model()
    dense, sparse = torch.zeros(3, 0), kjt(ROWS)
    queries, candidates = m.encode(dense, sparse)
    assert queries.shape == candidates.shape == (3, 6)
    scores = m.score(queries, candidates)
    assert scores.shape == (3, 3)
    torch.testing.assert_close(m(dense, sparse), scores.diagonal())
    torch.testing.assert_close(m.score_pairs(queries, candidates), scores.diagonal())


def test_normalised_towers_give_cosine_over_temperature():
    m = model(temperature=0.1)
    queries, candidates = m.encode(torch.zeros(3, 0), kjt(ROWS))
    torch.testing.assert_close(queries.norm(dim=1), torch.ones(3))
    torch.testing.assert_close(candidates.norm(dim=1), torch.ones(3))
    assert m.score(queries, candidates).abs().max() <= 10.0 + 1e-5  # |cos| / 0.1
    raw = model(normalize=False)
    q, c = raw.encode(torch.zeros(3, 0), kjt(ROWS))
    assert not torch.allclose(q.norm(dim=1), torch.ones(3))


def test_each_tower_reads_only_its_own_features():
    """Candidates can be precomputed for serving: they do not move with the query features."""
    m = model()
    _, c1 = m.encode(torch.zeros(3, 0), kjt(ROWS))
    changed = [dict(r, user=[11], history=[12, 13]) for r in ROWS]
    q2, c2 = m.encode(torch.zeros(3, 0), kjt(changed))
    torch.testing.assert_close(c1, c2)
    q1, _ = m.encode(torch.zeros(3, 0), kjt(ROWS))
    assert not torch.allclose(q1, q2)
    q3, _ = m.encode(torch.zeros(3, 0), kjt([dict(r, item=[20], genres=[3]) for r in ROWS]))
    torch.testing.assert_close(q1, q3)


def test_multi_key_features_are_means():
    """A history [2, 2, 4, 4] is the same mean as [2, 4]; an empty history is finite (zeros in)."""
    m = model()
    a = kjt([dict(ROWS[0], history=[2, 4])])
    b = kjt([dict(ROWS[0], history=[2, 2, 4, 4])])
    torch.testing.assert_close(m.encode(torch.zeros(1, 0), a)[0], m.encode(torch.zeros(1, 0), b)[0])
    empty = m.encode(torch.zeros(1, 0), kjt([dict(ROWS[1])]))[0]
    assert torch.isfinite(empty).all()


def test_dense_inputs_feed_the_query_tower():
    m = model(dense=2)
    sparse = kjt(ROWS)
    q1, c1 = m.encode(torch.zeros(3, 2), sparse)
    q2, c2 = m.encode(torch.ones(3, 2), sparse)
    assert not torch.allclose(q1, q2)
    torch.testing.assert_close(c1, c2)
    assert m.query_tower[0].in_features == 2 * 8 + 2 and m.candidate_tower[0].in_features == 2 * 8


def test_trains_with_fbgemm_collection():
    """Over the local FBGEMM collection (ps=local), a few softmax steps raise the positives' scores."""
    from recps.embeddings import LocalEmbeddingBagCollection

    torch.manual_seed(0)
    ebc = LocalEmbeddingBagCollection(list(FEATURES), 8, 64, optimizer="sgd", lr=0.5, init_std=0.1)
    m = TwoTower(ebc, dense_in_features=0, hidden=(16,), out_dim=8)
    opt = torch.optim.Adam([p for n, p in m.named_parameters() if not n.startswith("sparse_arch")], lr=0.01)
    dense, sparse = torch.zeros(3, 0), kjt(ROWS)
    losses = []
    for _ in range(20):
        q, c = m.encode(dense, sparse)
        loss = torch.nn.functional.cross_entropy(m.score(q, c), torch.arange(3))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.1 * losses[0]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"TwoTower: query_features names features \['age'\].*serves"):
        TwoTower(collection(), 0, query_features=("user", "age"))
    with pytest.raises(ValueError, match=r"TwoTower: candidate_features is empty"):
        TwoTower(collection(), 0, candidate_features=())
    with pytest.raises(ValueError, match=r"TwoTower: temperature=0"):
        TwoTower(collection(), 0, temperature=0)
    mixed = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t_user", embedding_dim=8, num_embeddings=5, feature_names=["user"]),
        EmbeddingBagConfig(name="t_item", embedding_dim=4, num_embeddings=5, feature_names=["item"])])
    with pytest.raises(ValueError, match=r"TwoTower: embedding tables have dims \[4, 8\]"):
        TwoTower(mixed, 0, query_features=("user",), candidate_features=("item",))
