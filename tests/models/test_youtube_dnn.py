"""YouTubeDNN: items are their own output embeddings, the user tower reads the history mean,
forward = score_pairs = diagonal of score, clear errors."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from models import YouTubeDNN

FEATURES = ("user", "item", "history", "genres")


def collection(dim=8, rows=40) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t_{n}", embedding_dim=dim, num_embeddings=rows, feature_names=[n])
        for n in FEATURES])


def kjt(rows: list[dict[str, list[int]]]) -> KeyedJaggedTensor:
    values = [k for n in FEATURES for r in rows for k in r.get(n, [])]
    lengths = [len(r.get(n, [])) for n in FEATURES for r in rows]
    return KeyedJaggedTensor(keys=list(FEATURES), values=torch.tensor(values, dtype=torch.int64),
                             lengths=torch.tensor(lengths, dtype=torch.int64), stride=len(rows))


ROWS = [
    {"user": [1], "item": [5], "history": [2, 3, 4], "genres": [0, 1]},
    {"user": [2], "item": [6], "history": [], "genres": [2]},
    {"user": [3], "item": [7], "history": [9], "genres": []},
]


def model(**kw) -> YouTubeDNN:
    torch.manual_seed(0)
    ebc = collection()
    return YouTubeDNN(ebc, dense_in_features=kw.pop("dense", 0), hidden=(16, 12), **kw)


def test_protocol_shapes_and_equalities():
    m = model()
    dense, sparse = torch.zeros(3, 0), kjt(ROWS)
    users, items = m.encode(dense, sparse)
    assert users.shape == items.shape == (3, 8)
    scores = m.score(users, items)
    torch.testing.assert_close(scores, users @ items.t())  # a plain dot product: no bias, no norm
    torch.testing.assert_close(m(dense, sparse), scores.diagonal())
    torch.testing.assert_close(m.score_pairs(users, items), scores.diagonal())


def test_items_are_the_output_embedding_table_rows():
    m = model()
    _, items = m.encode(torch.zeros(3, 0), kjt(ROWS))
    table = m.sparse_arch.embedding_bags["t_item"].weight  # (rows, D)
    torch.testing.assert_close(items, table[torch.tensor([5, 6, 7])])


def test_user_tower_reads_the_history_mean_and_dense_not_the_item():
    m = model(dense=1)
    base = m.encode(torch.zeros(3, 1), kjt(ROWS))[0]
    torch.testing.assert_close(base, m.encode(torch.zeros(3, 1), kjt([dict(r, item=[30], user=[31]) for r in ROWS]))[0])
    doubled = kjt([dict(r, history=r["history"] * 2) for r in ROWS])
    torch.testing.assert_close(base, m.encode(torch.zeros(3, 1), doubled)[0])
    assert not torch.allclose(base, m.encode(torch.ones(3, 1), kjt(ROWS))[0])
    assert [l.out_features for l in m.user_tower if isinstance(l, torch.nn.Linear)] == [16, 12, 8]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"YouTubeDNN: item_feature names features \['video'\]"):
        YouTubeDNN(collection(), 0, item_feature="video")
    with pytest.raises(ValueError, match=r"YouTubeDNN: item_feature='item' is also a query feature"):
        YouTubeDNN(collection(), 0, query_features=("history", "item"))
    with pytest.raises(ValueError, match=r"YouTubeDNN: query_features is empty"):
        YouTubeDNN(collection(), 0, query_features=())
