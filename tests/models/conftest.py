"""Shared by the model tests: tiny tables and batches built in memory (fixtures `tiny`, and
`tiny_mt` for the multitask models, `tiny_seq` for the session models), a tiny generated world
and the first losses of a real local run (fixtures `first_losses`, `repeatable_losses`)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import pytest
import torch
from omegaconf import OmegaConf, open_dict
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from recps.config import compose_config as recps_compose_config

# Every field of the world is spelled out, so that a change of the generator's defaults
# cannot move the golden losses; a change of its algorithm (bytes) or of the readers'
# key hashing will, and then the golden values are refreshed deliberately.
TINY_WORLD = dict(
    train_rows=2048, test_rows=256, seed=0, vocab=100, zipf_a=1.2, missing=0.05, signal=1.2,
    target_ctr=0.25, interactions=[["C1", "C2"], ["C3", "C4"]], interaction_dim=4, shares=[0.8, 0.1, 0.1],
)
GOLDEN_BATCH = 256
GOLDEN_STEPS = 5


def compose_config(overrides: Sequence[str], data_dir: Path, world: dict) -> OmegaConf:
    """The training config `python -m recps.train <overrides>` would run, on a generated world."""
    cfg = recps_compose_config(overrides)
    with open_dict(cfg):
        cfg.dataset.dir = str(data_dir)
        cfg.dataset.generate = dict(world)
    return cfg


@pytest.fixture(scope="session")
def tiny_world_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_world")


@pytest.fixture(scope="session")
def first_losses(tiny_world_dir) -> Callable[..., list[float]]:
    """first_losses(model_name, *overrides) -> the first GOLDEN_STEPS training losses.

    A real local job (conf/ defaults, ps=local, FBGEMM tables, the model's dense
    optimizer) on the tiny world, one training thread, so the sequence is deterministic.
    """
    from recps.job.build import build_job

    def run(model: str, *overrides: str) -> list[float]:
        cfg = compose_config([f"model={model}", "ps=local", "trainer.threads=1", "progress=false", *overrides],
                             tiny_world_dir, TINY_WORLD)
        job = build_job(cfg)
        intra_op = torch.get_num_threads()
        torch.set_num_threads(1)  # same losses as with 2 (checked); 5x faster on a busy CI runner
        try:
            stats = job.trainer.fit(job.data.train, GOLDEN_BATCH, epochs=1, max_steps=GOLDEN_STEPS, progress=False)
        finally:
            torch.set_num_threads(intra_op)
        assert stats.steps == GOLDEN_STEPS
        return stats.first_losses

    return run


@pytest.fixture(scope="session")
def repeatable_losses(first_losses) -> Callable[..., list[float]]:
    """repeatable_losses(model_name, *overrides) -> `first_losses`, asserted bitwise equal over two runs."""

    def run(*args: str) -> list[float]:
        losses = first_losses(*args)
        assert losses == first_losses(*args)  # bitwise: one thread, same seed
        return losses

    return run


@pytest.fixture(scope="session")
def world_config() -> Callable[[Sequence[str], Path, dict], OmegaConf]:
    """world_config(overrides, data_dir, world) -> the training config on a generated world."""
    return compose_config


class TinyBatch(NamedTuple):
    """One in-memory batch: dense (B, I), a KJT with one key per example and feature, ids (F, B)."""

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    ids: torch.Tensor


class Tiny:
    """Builders for hand-checkable model inputs: `tiny.collection()`, `tiny.batch()`, `tiny.rows(...)`."""

    names = ("C1", "C2", "C3")

    @staticmethod
    def collection(names: Sequence[str] = names, dims: int | Sequence[int] = 9,
                   rows: int = 50) -> EmbeddingBagCollection:
        """One table `t_<name>` per feature; `dims` is one width for all or one per table."""
        dims = [dims] * len(names) if isinstance(dims, int) else list(dims)
        return EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t_{n}", embedding_dim=d, num_embeddings=rows, feature_names=[n])
            for n, d in zip(names, dims)])

    @staticmethod
    def batch(names: Sequence[str] = names, b: int = 4, dense: int = 13, rows: int = 50,
              seed: int = 0) -> TinyBatch:
        """B examples with exactly one id per feature (so sum pooling is the row itself)."""
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, rows, (len(names), b), generator=g)  # (F, B)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(names), values=ids.flatten(),
                                                  lengths=torch.ones(len(names) * b, dtype=torch.int64))
        return TinyBatch(torch.randn(b, dense, generator=g), kjt, ids)

    @staticmethod
    def rows(collection: EmbeddingBagCollection, ids: torch.Tensor,
             names: Sequence[str] = names) -> torch.Tensor:
        """The table rows a batch looks up, read straight from the weights: (B, F, E)."""
        tables = [collection.embedding_bags[f"t_{n}"].weight for n in names]
        return torch.stack([t[i] for t, i in zip(tables, ids)], dim=1)  # (B, F, E)

    @staticmethod
    def bias_shift(model: torch.nn.Module, bias: torch.Tensor, batch: TinyBatch,
                   c: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs before and after adding c to the head's bias (in place, no grad)."""
        with torch.no_grad():
            before = model(batch.dense, batch.sparse)
            bias += c
            after = model(batch.dense, batch.sparse)
        return before, after

    @staticmethod
    def refuses_dense_width(model: torch.nn.Module, who: str, width: int, built: int = 13) -> None:
        """A batch with `width` dense columns fails with the message that names both widths."""
        batch = Tiny.batch(dense=width)
        with pytest.raises(ValueError, match=rf"{who}: dense input has shape \(4, {width}\) but the model was "
                                             rf"built with dense_in_features={built}"):
            model(batch.dense, batch.sparse)


@pytest.fixture(scope="session")
def tiny() -> type[Tiny]:
    return Tiny


class TinyMultitask:
    """The multitask models' inputs (MMoE, PLE, SharedBottom, ESMM): three 8-wide tables of 50
    rows, `dense` = 5 dense features, B = 16 examples; `Tiny`'s builders with these sizes."""

    dense = 5

    @staticmethod
    def collection(dims: Sequence[int] = (8, 8, 8)) -> EmbeddingBagCollection:
        return Tiny.collection(dims=dims)

    @staticmethod
    def batch(b: int = 16) -> tuple[torch.Tensor, KeyedJaggedTensor]:
        """(dense (B, 5), KJT with one id per example and feature)."""
        batch = Tiny.batch(b=b, dense=TinyMultitask.dense)
        return batch.dense, batch.sparse


@pytest.fixture(scope="session")
def tiny_mt() -> type[TinyMultitask]:
    return TinyMultitask


class TinySessions:
    """Builders for the session models (GRU4Rec, SASRec): one item table of `items` = 30 rows of
    `dim` = 8, KJT rows of sessions, session files and the engine's config over them."""

    items, dim = 30, 8

    @staticmethod
    def collection(dim: int = dim, items: int = items, names: Sequence[str] = ("item",)) -> EmbeddingCollection:
        """Weights drawn after torch.manual_seed(0)."""
        torch.manual_seed(0)
        return EmbeddingCollection(tables=[EmbeddingConfig(name=f"t_{n}", embedding_dim=dim, num_embeddings=items,
                                                           feature_names=[n]) for n in names])

    @staticmethod
    def model(cls: type[torch.nn.Module], **kwargs) -> torch.nn.Module:
        """cls over `collection()`, its own layers drawn after torch.manual_seed(1), in eval mode."""
        ec = TinySessions.collection()
        torch.manual_seed(1)
        return cls(ec, **kwargs).eval()

    @staticmethod
    def rows(*sessions: list[int]) -> KeyedJaggedTensor:
        """One KJT row (feature "item") per session."""
        return KeyedJaggedTensor.from_lengths_sync(["item"], torch.tensor([i for s in sessions for i in s]),
                                                   torch.tensor([len(s) for s in sessions]))

    @staticmethod
    def write(path: Path, sessions: list[list[int]], first_id: int = 0) -> Path:
        """A SessionId/ItemId/Time TSV of the sessions, ids from first_id, time = position."""
        lines = ["SessionId\tItemId\tTime"]
        for s, items in enumerate(sessions):
            lines += [f"{first_id + s}\t{item}\t{t}" for t, item in enumerate(items)]
        path.write_text("\n".join(lines) + "\n")
        return path

    @staticmethod
    def job_config(directory: Path, overrides: Sequence[str], train: list[list[int]],
                   test: list[list[int]]) -> OmegaConf:
        """conf/ composed with `overrides`, its dataset read from train.txt and test.txt written in
        `directory` (test session ids from 10,000)."""
        train_path = TinySessions.write(directory / "train.txt", train)
        test_path = TinySessions.write(directory / "test.txt", test, first_id=10_000)
        cfg = recps_compose_config(overrides)
        with open_dict(cfg):
            cfg.dataset.train, cfg.dataset.test = [str(train_path)], [str(test_path)]
        return cfg


@pytest.fixture(scope="session")
def tiny_seq() -> type[TinySessions]:
    return TinySessions


class BehaviourWorld:
    """Generated rows where the label depends on the history (DIN, BST). Each row: a user, a target
    item and its category, a history of 1..L items (oldest first) with their categories and a click
    flag (key 0/1); click with p 0.8 if the target's category is among the categories of the
    history's CLICKED items, else 0.1. Without the history every row looks alike (AUC 0.5); the true
    probabilities give the best reachable AUC (about 0.74). Items' categories are fixed by `seed=123`.

    Features: user_id, item_id, category, history_item_id, history_category, history_click."""

    users, items, categories, max_len = 300, 400, 20, 10
    target = ("item_id", "category")
    history = ("history_item_id", "history_category")
    flags = ("history_click",)

    def __init__(self, rows: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.category = torch.randint(0, self.categories, (self.items,), generator=torch.Generator().manual_seed(123))
        self.user = torch.randint(0, self.users, (rows,), generator=g)  # (N,)
        self.item = torch.randint(0, self.items, (rows,), generator=g)  # (N,)
        self.lengths = torch.randint(1, self.max_len + 1, (rows,), generator=g)  # (N,)
        self.history_item = torch.randint(0, self.items, (int(self.lengths.sum()),), generator=g)  # (H,)
        self.click = torch.randint(0, 2, self.history_item.shape, generator=g)  # (H,)
        row = torch.repeat_interleave(torch.arange(rows), self.lengths)  # (H,)
        match = (self.category[self.history_item] == self.category[self.item][row]) & (self.click == 1)  # (H,)
        hit = torch.zeros(rows, dtype=torch.bool)
        hit[row[match]] = True
        self.probs = torch.where(hit, 0.8, 0.1)  # (N,)
        self.labels = (torch.rand(rows, generator=g) < self.probs).float()  # (N,)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), self.lengths.cumsum(0)])  # (N+1,)

    def __len__(self) -> int:
        return int(self.labels.numel())

    def sparse(self, rows: torch.Tensor, history: bool = True) -> KeyedJaggedTensor:
        """The KJT of `rows`; history=False: user_id, item_id, category only (a ranker without history)."""
        one = torch.ones(rows.numel(), dtype=torch.long)
        items = self.item[rows]
        keys, values, lengths = ["user_id", "item_id", "category"], [self.user[rows], items, self.category[items]], [one] * 3
        if history:
            starts, n = self.offsets[rows], self.lengths[rows]  # (B,), (B,)
            within = torch.arange(int(n.sum())) - torch.repeat_interleave(n.cumsum(0) - n, n)  # (H_b,) index in its row
            pos = torch.repeat_interleave(starts, n) + within  # (H_b,) the rows' history keys, in row order
            h = self.history_item[pos]
            keys += [*self.history, *self.flags]
            values += [h, self.category[h], self.click[pos]]
            lengths += [n] * 3
        return KeyedJaggedTensor.from_lengths_sync(keys, torch.cat(values), torch.cat(lengths))

    @classmethod
    def collection(cls, dim: int = 8) -> EmbeddingCollection:
        """Target and history share the item and the category tables (the papers' setting)."""
        return EmbeddingCollection(tables=[
            EmbeddingConfig(name="t_item", embedding_dim=dim, num_embeddings=cls.items,
                            feature_names=["item_id", "history_item_id"]),
            EmbeddingConfig(name="t_category", embedding_dim=dim, num_embeddings=cls.categories,
                            feature_names=["category", "history_category"]),
            EmbeddingConfig(name="t_click", embedding_dim=dim, num_embeddings=2, feature_names=["history_click"]),
            EmbeddingConfig(name="t_user", embedding_dim=dim, num_embeddings=cls.users, feature_names=["user_id"])])

    @classmethod
    def bag_collection(cls, dim: int = 9) -> EmbeddingBagCollection:
        """user_id, item_id, category for a ranker without history (DeepFM: dim = 1 + D)."""
        return EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t_{f}", embedding_dim=dim, num_embeddings=n, feature_names=[f])
            for f, n in (("user_id", cls.users), ("item_id", cls.items), ("category", cls.categories))])

    def train(self, model: torch.nn.Module, steps: int, history: bool = True, batch: int = 256, lr: float = 0.01,
              seed: int = 1) -> list[float]:
        """Adam on every parameter (tables included), `steps` batches drawn with `seed`, one torch
        thread; returns the losses; leaves the model in eval mode."""
        intra_op = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            optimizer = torch.optim.Adam(model.parameters(), lr=lr)
            g = torch.Generator().manual_seed(seed)
            losses = []
            model.train()
            for _ in range(steps):
                rows = torch.randint(0, len(self), (batch,), generator=g)
                logits = model(torch.zeros(batch, 0), self.sparse(rows, history))
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, self.labels[rows])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(float(loss.detach()))
        finally:
            torch.set_num_threads(intra_op)
        model.eval()
        return losses

    def best_auc(self) -> float:
        """The AUC of the true click probabilities: the best any model reaches on these rows."""
        return exact_auc(self.probs, self.labels)

    def auc(self, model: torch.nn.Module, history: bool = True) -> float:
        """The model's exact AUC (ties split) on every row, in eval mode."""
        rows = torch.arange(len(self))
        with torch.no_grad():
            scores = model.eval()(torch.zeros(len(self), 0), self.sparse(rows, history))
        return exact_auc(scores, self.labels)


def exact_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """scikit-learn's exact ROC AUC (ties split)."""
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(labels.numpy(), scores.double().numpy()))


@pytest.fixture(scope="session")
def behaviour_world() -> type[BehaviourWorld]:
    return BehaviourWorld
