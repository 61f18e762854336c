"""NCF (NeuMF): the split-weight all-pairs score equals the paper's per-pair network, GMF and
MLP use disjoint halves of each row, clear errors."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from models import NCF


def collection(dim=8, rows=40, names=("user", "item")) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t_{n}", embedding_dim=dim, num_embeddings=rows, feature_names=[n]) for n in names])


def kjt(users: list[int], items: list[int]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=["user", "item"], values=torch.tensor(users + items),
                             lengths=torch.ones(2 * len(users), dtype=torch.int64), stride=len(users))


def model(**kw) -> NCF:
    torch.manual_seed(0)
    return NCF(collection(), dense_in_features=0, hidden=(8, 4), **kw)


def neumf_by_hand(m: NCF, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
    """The paper's NeuMF for one pair: concat MLP embeddings, ReLU layers, concat with GMF, linear."""
    g = m.gmf_dim
    w_first = torch.cat([m.mlp_user.weight, m.mlp_item.weight], dim=1)  # (H0, 2*Dm)
    x = torch.relu(w_first @ torch.cat([user[g:], item[g:]]) + m.mlp_user.bias)
    for layer in m.mlp_rest:
        x = layer(x)
    return m.head(torch.cat([user[:g] * item[:g], x])).squeeze(0)


def test_score_matches_the_papers_network_pair_by_pair():
    m = model()
    dense, sparse = torch.zeros(3, 0), kjt([1, 2, 3], [4, 5, 6])
    users, items = m.encode(dense, sparse)
    scores = m.score(users, items)  # (3, 3)
    assert scores.shape == (3, 3)
    for b in range(3):
        for c in range(3):
            torch.testing.assert_close(scores[b, c], neumf_by_hand(m, users[b], items[c]))
    torch.testing.assert_close(m(dense, sparse), scores.diagonal())
    torch.testing.assert_close(m.score_pairs(users, items), scores.diagonal())


def test_gmf_and_mlp_read_disjoint_halves_of_each_row():
    m = model(gmf_dim=3)
    users, items = m.encode(torch.zeros(2, 0), kjt([1, 2], [4, 5]))
    moved_mlp, moved_gmf = users.clone(), users.clone()
    moved_mlp[:, 3:] += 1.0
    moved_gmf[:, :3] += 1.0
    head = m.head.weight.detach().clone()
    with torch.no_grad():
        m.head.weight[0, 3:] = 0.0  # only the GMF path reaches the logits
        torch.testing.assert_close(m.score(users, items), m.score(moved_mlp, items))
        assert not torch.allclose(m.score(users, items), m.score(moved_gmf, items))
        m.head.weight.copy_(head)
        m.head.weight[0, :3] = 0.0  # only the MLP path
        torch.testing.assert_close(m.score(users, items), m.score(moved_gmf, items))
        assert not torch.allclose(m.score(users, items), m.score(moved_mlp, items))
    assert m.mlp_user.in_features == m.mlp_item.in_features == 5


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"NCF: the data has 3 dense inputs"):
        NCF(collection(), dense_in_features=3)
    with pytest.raises(ValueError, match=r"NCF: gmf_dim=8 with table width D=8"):
        NCF(collection(), 0, gmf_dim=8)
    with pytest.raises(ValueError, match=r"NCF: user_feature names features \['member'\]"):
        NCF(collection(), 0, user_feature="member")
    with pytest.raises(ValueError, match=r"NCF: hidden is empty"):
        NCF(collection(), 0, hidden=())
