"""CTR-DNN on generated Criteo-schema data, in one process (train_local.py) or on a parameter server (train_fleet.py).

    python examples/train_local.py --rows 20000 --epochs 2
    python -m recps.launch --servers 1 --workers 2 -- python examples/train_fleet.py --rows 20000 --epochs 2 --mode geo

train_fleet.py is train_local.py with its Fleet part, 12 lines in place of 5 (tests/ps/test_fleet_example.py counts them):

    diff -w examples/train_local.py examples/train_fleet.py

the Fleet import, --mode, the server branch (3), the PS collection, the distributed optimizer,
init_worker, this worker's shard, a barrier before evaluating, and only the first worker evaluates
(2, with main's return type). The mode name takes recps.ps.modes' defaults (GeoMode: k_steps=100);
for others give a mode object: fleet.DistributedStrategy(GeoMode(k_steps=20)).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from models import CTRDNN
from recps.config import PROJECT_ROOT
from recps.data.dataset import prepare_data
from recps.metrics import MetricCollection
from recps.embeddings import LocalEmbeddingBagCollection

DIM, HIDDEN, BATCH = 9, [64, 32], 256


def load_data(rows: int, vocab: int):
    folder = PROJECT_ROOT / "datasets" / "generated" / f"example-v{vocab}-n{rows}"
    return prepare_data({"name": "example", "schema": {"format": "criteo"}, "dir": str(folder),
                         "train": [f"{folder}/train.txt"], "test": [f"{folder}/test.txt"],
                         "generate": {"train_rows": rows, "test_rows": rows // 4, "seed": 0, "vocab": vocab}})


def dense_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for name, p in model.named_parameters() if not name.startswith("sparse_arch.")]


def train(model, optimizer, data, epochs: int, shard: int = 0, shards: int = 1) -> float:
    for epoch in range(epochs):
        for batch in data.train.batches(BATCH, shard, shards, epoch):
            loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse), batch.labels[:, 0])
            optimizer.zero_grad()
            loss.backward()  # the embedding rows are updated here, by the collection itself
            optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def evaluate(model, data) -> dict[str, float]:
    model.eval()
    metrics = MetricCollection(["auc", "logloss"])
    for batch in data.test.batches(4096, 0, 1, 0):
        metrics.update(torch.sigmoid(model(batch.dense, batch.sparse)), batch.labels[:, 0])
    return {name: round(float(value), 4) for name, value in metrics.compute().items()}


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    data = load_data(args.rows, args.vocab)
    ebc = LocalEmbeddingBagCollection(data.schema.feature_names, DIM, args.vocab, init_std=0.01)
    model = CTRDNN(ebc, dense_in_features=data.schema.num_dense, hidden=HIDDEN)
    optimizer = torch.optim.Adam(dense_params(model), lr=1e-3)
    train(model, optimizer, data, args.epochs)
    result = evaluate(model, data)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
