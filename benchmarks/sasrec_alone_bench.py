"""SASRec alone against EASE and most-popular on the funnel's MovieLens latest-small split (issue 29.6).

    OMP_NUM_THREADS=1 python -m benchmarks.sasrec_alone_bench [--threads 1] [--out result.json] [--set key=value ...]

Loads `recps.pipeline.data.movielens` (test_fraction 0.2, click_rating 4.0: the funnel's split), fits
SASRec alone (recps.pipeline.sasrec_alone, SASREC_DEFAULTS updated by --set) and EASE
(recps.pipeline.ease.fit_ease, EASE_DEFAULTS), both with their choices made on the training data's
validation split, and scores every held-out request with them and with most-popular
(recps.pipeline.held_out.most_popular: training clicks, seen items excluded). NDCG@10 and HR@10 are
recps.metrics.funnel's, over the requests with a positive, as recps.pipeline.held_out reports them.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import types
from pathlib import Path

import torch
import yaml

from recps import quiet_libraries
from recps.config import PROJECT_ROOT
from recps.metrics import funnel as fm
from recps.pipeline.data import movielens
from recps.pipeline.ease import fit_ease
from recps.pipeline.held_out import most_popular
from recps.pipeline.sasrec_alone import fit_sasrec
from recps.pipeline.stages import EASE_DEFAULTS

ML = PROJECT_ROOT / "datasets" / "movielens_latest_small"


def list_metrics(lists: torch.Tensor, data, n: int) -> dict[str, float]:
    """ndcg@n and hr@n of (R, n) lists over data's held-out requests (recps.pipeline.held_out's definition)."""
    p = data.test_positives
    pairs = {**fm.ndcg_at_k(lists[:, :n], p.offsets, p.items, n, "ndcg"), **fm.hit_rate(lists[:, :n], p.offsets,
                                                                                         p.items, n, "hr")}
    return {f"{name}@{n}": float(v[0] / v[1]) for name, v in pairs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratings", default=str(ML / "ratings.csv"))
    parser.add_argument("--movies", default=str(ML / "movies.csv"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--set", nargs="*", default=[], help="SASRec settings, key=value (YAML values)")
    parser.add_argument("--skip-ease", action="store_true")
    parser.add_argument("--out", help="a JSON file for the results")
    args = parser.parse_args()
    quiet_libraries()  # the libraries' import-time lines a user cannot act on
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    torch.set_num_threads(args.threads)
    settings = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    data = movielens(ratings=args.ratings, movies=args.movies)
    users, n = data.test_users, args.n
    rows: dict[str, dict[str, float]] = {}
    rows["most_popular"] = list_metrics(most_popular(types.SimpleNamespace(data=data), users, n), data, n)
    sasrec = fit_sasrec(data, settings, k=n)
    start = time.perf_counter()
    rows["sasrec_alone"] = {**list_metrics(sasrec.lists(data, users, n), data, n), "fit_seconds": sasrec.seconds,
                            "epochs": sasrec.epochs, "list_seconds": time.perf_counter() - start}
    if not args.skip_ease:
        ease = fit_ease(data, EASE_DEFAULTS, k=n)
        rows["ease"] = {**list_metrics(ease.lists(data, users, n), data, n), "fit_seconds": ease.seconds,
                        "l2": ease.l2}
    result = {"threads": args.threads, "requests": int(users.numel()), "settings": sasrec.settings,
              "sasrec_validation": sasrec.validation, "baselines": rows}
    print(f"{'baseline':<14} {'ndcg@' + str(n):>9} {'hr@' + str(n):>8}  notes")
    for name, row in rows.items():
        notes = ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                          if k not in (f"ndcg@{n}", f"hr@{n}"))
        print(f"{name:<14} {row[f'ndcg@{n}']:>9.4f} {row[f'hr@{n}']:>8.4f}  {notes}")
    print("sasrec validation ndcg by epoch:", {e: round(v, 4) for e, v in sasrec.validation.items()})
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
