"""Local (ps=local) training throughput of CTR-DNN on generated Criteo-schema data.

    python -m benchmarks.local_throughput [--rows 200000] [--threads 2] [--batch 512] [--vocab 1000000]

26 slots with a vocabulary of 10^6 keys each, batch 512, pre-parsed input, FBGEMM fused
row-wise Adagrad tables of 10^6 rows per slot, Adam on the dense layers. Prints one JSON
line with examples/s (steady state, after a warm-up) and the test AUC after the pass.
"""

from __future__ import annotations

from recps import quiet_libraries
import argparse
import json
import logging
import platform
import time

import torch


def run(rows: int, threads: int, batch: int, vocab: int, model_name: str, seed: int, data_dir: str) -> dict:
    from recps.data.dataset import prepare_data
    from recps.metrics import MetricCollection
    from recps.embeddings import LocalEmbeddingBagCollection
    from recps.tasks import BinaryTask
    from recps.job.loop import LocalDenseUpdater, Trainer, dense_parameters
    import models

    torch.manual_seed(seed)
    cfg = {
        "name": "bench", "schema": {"format": "criteo"}, "dir": data_dir,
        "train": [f"{data_dir}/train.txt"], "test": [f"{data_dir}/test.txt"],
        "generate": {"train_rows": rows, "test_rows": max(rows // 10, 10000), "seed": seed, "vocab": vocab},
    }
    data = prepare_data(cfg, seed=seed)
    names = list(data.schema.feature_names)
    dims = {"CTRDNN": 9, "DeepFM": 11}
    collection = LocalEmbeddingBagCollection(names, dims[model_name], vocab, optimizer="rowwise_adagrad",
                                             lr=0.05, init_std=0.01)
    model = getattr(models, model_name)(collection, dense_in_features=data.schema.num_dense)
    dense = [p for _, p in dense_parameters(model, collection)]
    task = BinaryTask()
    trainer = Trainer(model, collection, task, LocalDenseUpdater(dense, torch.optim.Adam(dense, lr=1e-3)),
                      threads=threads)
    warm = trainer.fit(data.train, batch, max_steps=20, progress=False)
    stats = trainer.fit(data.train, batch, epochs=1, progress=False, first_epoch=1)
    probs, targets = trainer.predict(data.test, 4096)
    metrics = MetricCollection(["auc", "logloss"])
    metrics.update(probs, targets)
    result = metrics.compute()
    return {
        "benchmark": "local_throughput", "model": model_name, "threads": threads, "batch": batch,
        "vocab_per_slot": vocab, "train_rows": rows, "examples_per_sec": round(stats.examples_per_sec, 1),
        "steps": stats.steps, "seconds": round(stats.seconds, 3), "warmup_steps": warm.steps,
        "auc": round(float(result["auc"]), 4), "logloss": round(float(result["logloss"]), 4),
        "best_reachable_auc": round(data.best_auc, 4) if data.best_auc else None,
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=1_000_000)
    parser.add_argument("--model", default="CTRDNN", choices=["CTRDNN", "DeepFM"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None, help="where the generated data is cached")
    args = parser.parse_args(argv)
    quiet_libraries()  # the libraries' import-time lines a user cannot act on
    logging.basicConfig(level=logging.WARNING)
    if args.data_dir is None:
        from recps.config import PROJECT_ROOT

        args.data_dir = str(PROJECT_ROOT / "datasets" / "generated" /
                            f"bench-s{args.seed}-v{args.vocab}-n{args.rows}")
    start = time.perf_counter()
    result = run(args.rows, args.threads, args.batch, args.vocab, args.model, args.seed, args.data_dir)
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
