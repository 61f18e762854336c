"""RetrievalTask: log-Q arithmetic for in-batch, sampled and mixed candidates, masks, the loss;
full-catalogue evaluation (exclusions, AUC, pessimistic ties) and the most-popular baseline."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from models import TwoTower, YouTubeDNN
from recps.data.batch import Batch
from recps.data.interactions import FEATURES, InteractionLog, build_retrieval_data
from recps.errors import ConfigError, DataError
from recps.tasks.retrieval import RetrievalTask, append_rows, evaluate_ranking, popularity_baseline

# 4 users over 6 movies; the last rating of each user is its test query.
RATINGS = pd.DataFrame({
    "userId":    [1, 1, 1, 2, 2, 2, 3, 3, 4, 4, 4, 4],
    "movieId":   [10, 11, 12, 10, 11, 13, 10, 14, 11, 12, 10, 15],
    "timestamp": [1, 2, 3, 1, 2, 3, 1, 2, 1, 2, 3, 4],
})


def toy_data(shuffle=False):
    return build_retrieval_data(InteractionLog.from_frames(RATINGS), history_length=4, shuffle=shuffle)


def youtube(dim=4, seed=0) -> YouTubeDNN:
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t_{n}", embedding_dim=dim, num_embeddings=16, feature_names=[n]) for n in FEATURES])
    return YouTubeDNN(ebc, dense_in_features=0, hidden=(8,))


def first_batch(data, size=8) -> Batch:
    return next(iter(data.train.batches(size, 0, 1, 0)))


def test_in_batch_logits_subtract_log_expected_counts_and_mask_duplicates():
    data = toy_data()
    batch = first_batch(data)  # 8 training rows
    model = youtube()
    task = RetrievalTask()
    out = task.forward(model, batch)
    b = batch.batch_size
    assert out.shape == (b, 1 + b)
    users, items = model.encode(batch.dense, batch.sparse)
    raw = users @ items.t()  # (B, B)
    log_q = batch.labels[:, 1] + math.log(b)  # (B,)
    keys = batch.sparse["item"].values()
    torch.testing.assert_close(out[:, 0], raw.diagonal() - log_q)
    for i in range(b):
        for j in range(b):
            if keys[i] == keys[j]:  # the row's own item (its diagonal too): not a negative
                assert out[i, 1 + j] == float("-inf")
            else:
                torch.testing.assert_close(out[i, 1 + j], raw[i, j] - log_q[j])
    loss = task.loss(out, batch)
    torch.testing.assert_close(loss, -torch.log_softmax(out, dim=1)[:, 0].mean())
    torch.testing.assert_close(task.predict(out), torch.softmax(out, dim=1)[:, 0])
    assert task.target(batch).tolist() == [1.0] * b


def test_without_correction_the_logits_are_the_scores():
    batch = first_batch(toy_data())
    model = youtube()
    out = RetrievalTask(log_q_correction=False).forward(model, batch)
    users, items = model.encode(batch.dense, batch.sparse)
    torch.testing.assert_close(out[:, 0], (users * items).sum(1))


def test_sampled_negatives_come_from_the_catalogue_with_their_proposal():
    data = toy_data()
    batch = first_batch(data, 5)
    model = youtube()
    task = RetrievalTask(negatives="sampled", num_negatives=7, sampling_alpha=1.0)
    task.bind(data)
    cat = data.train.catalogue
    counts = cat.counts.to(torch.float64) + 1.0
    proposal = counts / counts.sum()  # alpha = 1: (count + 1)^1
    torch.testing.assert_close(task._proposal.to(torch.float64), proposal, atol=1e-7, rtol=0)
    torch.manual_seed(5)
    drawn = torch.multinomial(task._proposal, 7, replacement=True)
    torch.manual_seed(5)
    out = task.forward(model, batch)
    assert out.shape == (5, 1 + 7)
    users, _ = model.encode(batch.dense, batch.sparse)
    _, negs = model.encode(torch.zeros(7, 0), cat.features(drawn))
    keys = batch.sparse["item"].values()
    log_n = math.log(7)
    pos_items = model.encode(batch.dense, batch.sparse)[1]
    expected_pos = (users * pos_items).sum(1) - (torch.log(task._proposal[keys]) + log_n)
    torch.testing.assert_close(out[:, 0], expected_pos)
    expected = users @ negs.t() - (torch.log(task._proposal[drawn]) + log_n)
    hit = keys[:, None] == cat.keys[drawn][None, :]  # accidental hits are masked
    torch.testing.assert_close(out[:, 1:][~hit], expected[~hit])
    assert bool((out[:, 1:][hit] == float("-inf")).all())


def test_mixed_has_in_batch_then_sampled_columns():
    data = toy_data()
    batch = first_batch(data, 6)
    task = RetrievalTask(negatives="mixed", num_negatives=3)
    task.bind(data)
    out = task.forward(youtube(), batch)
    assert out.shape == (6, 1 + 6 + 3)
    in_batch_only = RetrievalTask().forward(youtube(), batch)
    torch.testing.assert_close(out[:, :7], in_batch_only)  # same model seed, same in-batch block


def test_training_steps_lower_the_loss():
    data = toy_data()
    model = youtube(dim=8)
    task = RetrievalTask(negatives="mixed", num_negatives=4)
    task.bind(data)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    batch = first_batch(data)
    losses = []
    for _ in range(30):
        loss = task.loss(task.forward(model, batch), batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.3 * losses[0]


def test_append_rows_concatenates_per_feature():
    a = KeyedJaggedTensor(keys=["x", "y"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 2, 1, 0]), stride=2)
    b = KeyedJaggedTensor(keys=["y", "x"], values=torch.tensor([7, 8, 9]), lengths=torch.tensor([2, 1]), stride=1)
    c = append_rows(a, b)
    assert c.stride() == 3
    d = c.to_dict()
    assert d["x"].lengths().tolist() == [1, 2, 1] and d["x"].values().tolist() == [1, 2, 3, 9]
    assert d["y"].lengths().tolist() == [1, 0, 2] and d["y"].values().tolist() == [4, 7, 8]


class _FixedScores(nn.Module):
    """Scores each catalogue item by a fixed table (queries are ignored): known rankings."""

    def __init__(self, item_scores: list[float]) -> None:
        super().__init__()
        self.item_scores = torch.tensor(item_scores)

    def encode(self, dense, sparse):
        items = sparse["item"].values().to(torch.float32).view(-1, 1)  # (B, 1) the item key
        return torch.zeros(sparse.stride(), 1), items

    def score(self, queries, candidates):
        return self.item_scores[candidates[:, 0].long()].expand(queries.shape[0], -1)


def test_evaluation_excludes_training_items_and_counts_auc():
    data = toy_data()
    cat = data.test.catalogue  # items 10..15 -> rows 0..5
    test_items = [q.targets.tolist() for q in data.test.query_batches(10)][0]
    assert test_items == [2, 3, 4, 5]  # users 1..4: movies 12, 13, 14, 15
    # Item 0 (movie 10, trained on by every user) scores highest; it is excluded for all.
    model = _FixedScores([9.0, 1.0, 5.0, 4.0, 3.0, 2.0])
    task = RetrievalTask(metrics=("recall@1", "recall@2", "ndcg@2", "mrr", "auc"), baseline=False)
    got = task.evaluate(model, data.test, batch_size=3)
    # Ranks after exclusions: user 1 (excl 10, 11): 12 first -> 1; user 2 (excl 10, 11): 13 after 12 -> 2;
    # user 3 (excl 10): 14 after 12 and 13 (11 scores below it) -> 3; user 4 (excl 10, 11, 12): 15 after 13, 14 -> 3.
    ranks = [1, 2, 3, 3]
    valid = [6 - 2, 6 - 2, 6 - 1, 6 - 3]
    assert got["recall@1"] == pytest.approx(sum(r <= 1 for r in ranks) / 4)
    assert got["recall@2"] == pytest.approx(sum(r <= 2 for r in ranks) / 4)
    assert got["ndcg@2"] == pytest.approx(sum(1 / math.log2(r + 1) for r in ranks if r <= 2) / 4)
    assert got["mrr"] == pytest.approx(sum(1 / r for r in ranks) / 4)
    assert got["auc"] == pytest.approx(sum((v - r) / (v - 1) for v, r in zip(valid, ranks)) / 4)
    assert got["queries"] == 4.0
    assert len(cat) == 6


def test_ties_count_against_the_target():
    """A constant scorer ranks every target last among its ties: recall@1 is 0, not 1."""
    got = evaluate_ranking(lambda batch: torch.zeros(batch.batch_size, 6), toy_data().test, 4, ("recall@1", "auc"))
    assert got["recall@1"] == 0.0 and got["auc"] == 0.0


def test_most_popular_baseline_ranks_by_training_count():
    data = toy_data()
    # Training counts: 10 x4, 11 x3, 12 x1 (user 4), others 0. Ties broken by catalogue order.
    assert data.train.catalogue.counts.tolist() == [4, 3, 1, 0, 0, 0]
    got = popularity_baseline(data.test, 2, ("recall@1", "mrr"))
    # user 1 (excl 10, 11): 12 first -> 1; user 2 (excl 10, 11): 12, then 13 -> 2;
    # user 3 (excl 10): 11, 12, 13, then 14 -> 4; user 4 (excl 10, 11, 12): 13, 14, then 15 -> 3.
    assert got["recall@1"] == pytest.approx(1 / 4)
    assert got["mrr"] == pytest.approx((1 + 1 / 2 + 1 / 4 + 1 / 3) / 4)


def test_two_tower_evaluates_on_the_catalogue():
    data = toy_data()
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t_{n}", embedding_dim=4, num_embeddings=16, feature_names=[n]) for n in FEATURES])
    model = TwoTower(ebc, 0, hidden=(8,), out_dim=4)
    got = RetrievalTask().evaluate(model, data.test, 2)
    names = ["recall@10", "recall@50", "ndcg@10", "ndcg@50", "mrr", "auc"]
    assert set(got) == {*names, "queries", *(f"most_popular/{n}" for n in names)}
    popular = popularity_baseline(data.test, 4, names)
    assert [got[f"most_popular/{n}"] for n in names] == pytest.approx([popular[n] for n in names], abs=1e-12)
    assert got["recall@10"] == 1.0  # 6 items: every target is in the top 10
    assert 0.0 <= got["auc"] <= 1.0 and got["queries"] == 4.0
    assert model.training  # evaluation restores the mode


def test_configuration_errors_name_the_fix():
    with pytest.raises(ConfigError, match=r"task.negatives='hard'; use one of"):
        RetrievalTask(negatives="hard")
    with pytest.raises(ConfigError, match=r"num_negatives=0; set num_negatives >= 1"):
        RetrievalTask(negatives="sampled")
    with pytest.raises(ConfigError, match=r"evaluation ranks items; use recall@K"):
        RetrievalTask(metrics=("recall@10", "logloss"))
    task = RetrievalTask(negatives="sampled", num_negatives=2)
    with pytest.raises(ConfigError, match=r"needs the item catalogue: call task.bind\(data\)"):
        task.forward(youtube(), first_batch(toy_data()))

    class NoCatalogue:
        train = object()

    with pytest.raises(ConfigError, match=r"this data set has none; use an interaction data set"):
        task.bind(NoCatalogue())
    with pytest.raises(DataError, match=r"task.item_feature='video' is not a batch feature"):
        RetrievalTask(item_feature="video").forward(youtube(), first_batch(toy_data()))
    with pytest.raises(ConfigError, match=r"has no item catalogue; retrieval needs a RetrievalSource"):
        RetrievalTask().evaluate(youtube(), object(), 4)


def test_models_train_and_evaluate_over_the_ps_backed_collection():
    """The same model over recps' PS-backed collection: one lookup per step (positives and
    sampled rows together), gradients pushed to the rows it pulled, catalogue evaluation."""
    from recps.ps.embedding import PSEmbeddingBagCollection, salted_keys
    from recps.ps.table import Initializer, SGDRule, SparseTable

    class Tables:  # an in-process communicator over one real SparseTable (no servers)
        mode = "async"

        def __init__(self):
            self.table = SparseTable(dim=4, optimizer=SGDRule(lr=1.0), initializer=Initializer("normal", std=0.1))
            self.pulls = 0

        def pull(self, table, keys):
            self.pulls += 1
            return self.table.pull(keys)

        def push(self, table, keys, grads):
            self.table.push(keys, grads)

    data = toy_data()
    tables = Tables()
    torch.manual_seed(0)
    model = YouTubeDNN(PSEmbeddingBagCollection.from_features(FEATURES, 4, tables), 0, hidden=(8,))
    task = RetrievalTask(negatives="mixed", num_negatives=3)
    task.bind(data)
    batch = first_batch(data)
    item_keys = salted_keys(batch.sparse["item"].values(), "t_item")
    before = tables.table.pull(item_keys).clone()
    task.loss(task.forward(model, batch), batch).backward()
    assert tables.pulls == 1  # batch rows and sampled rows: one pull
    assert not torch.allclose(tables.table.pull(item_keys), before)  # the positives' rows moved
    got = task.evaluate(model, data.test, 2)
    assert got["queries"] == 4.0 and 0.0 <= got["recall@10"] <= 1.0
