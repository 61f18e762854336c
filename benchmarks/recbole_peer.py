"""A peer library on recps' own split: RecBole's BPR and SASRec on the MovieLens latest-small split the funnel
evaluates on, scored by recps' metrics over the same held-out requests (issue 29 point 6).

    python -m benchmarks.recbole_peer [--models bpr,sasrec] [--epochs N] [--max-minutes M] [--out-dir DIR]
        [--ratings PATH] [--movies PATH] [--venv DIR] [--threads 1] [--no-refit]

RecBole (https://recbole.io, Zhao et al., CIKM 2021) is never a dependency of recps: this script creates its own
virtualenv once (--venv, default ~/.cache/recps/recbole-venv: `pip install` of REQUIREMENTS from PyPI) and runs
RecBole there as a subprocess (benchmarks/recbole_peer_runner.py, under `nice -n 10`, one torch thread, a
timeout), reading its results back from files.

The split is recps' own: `recps.pipeline.data.movielens` with conf/pipeline/movielens_funnel.yaml's `world:`
settings (test_fraction 0.2, click_rating 4.0). Its training rows (every rating outside each user's last 20%)
are all RecBole trains on; they are exported as RecBole atomic files (`benchmark_filename` train / valid / test,
user and item tokens = recps' user and item indices) in two datasets:

    select   train = each user's earlier training rows, valid = the clicks (rating >= 4) among the user's latest
             20% of training rows (recps.pipeline.ease.holdout_latest, as EASE's λ and SASRec alone's epochs
             are chosen), test = the held-out positives (read only for RecBole's own figures).
    all      train = every training row; valid and test as in select.

1. select: each setting of the model's grid trains its epochs (or until --max-minutes); after every epoch
   RecBole lists its top 10 for each user with a validation positive (input: the earlier rows; excluded: the
   items of those rows and items with no earlier row). recps' NDCG@10 of those lists (recps.metrics.funnel)
   chooses the setting and the epochs. RecBole's own validation NDCG is recorded, not used: for SASRec it does
   not exclude the user's own items, and it stayed near 0.01 while recps' figure rose.
2. refit: the chosen setting trains on `all` for the chosen epochs (as recps' EASE and SASRec alone are
   refitted), unless --no-refit or the --max-minutes budget cannot fit it: then the select model's lists at
   the chosen epoch are scored (said in the results).
3. RecBole lists its top 10 over its whole item vocabulary for each held-out request user (input: the user's
   whole training history; excluded: `data.seen`, the items the user rated in training, and items without a
   training row, which RecBole could not have learned); this script checks the exclusions, then scores the
   lists with the held-out evaluation's NDCG@10 and HR@10 (benchmarks.sasrec_alone_bench.list_metrics) over
   `data.test_users`, the funnel run's requests. RecBole's own test figures (its NDCG / Hit / Recall @10 on
   its test file, its definitions and masking) are reported beside them, labelled `recbole_own_test`.

SASRec's files hold RecBole's sequential layout (each row: the item sequence before the target, at most
MAX_LEN items); a valid or test row's sequence is the user's training rows before the split, never another
held-out item. Writes DIR/recbole_peer.json (default DIR: outputs/recbole_peer/<date>/<time>), prints a
Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from benchmarks.sasrec_alone_bench import list_metrics
from recps.config import PROJECT_ROOT
from recps.metrics import funnel as fm
from recps.pipeline.data import Csr, FunnelData, csr_from_pairs, movielens
from recps.pipeline.ease import holdout_latest

__all__ = ["MODELS", "REQUIREMENTS", "Export", "load_split", "export", "read_inter", "check_lists", "validation_ndcg",
           "main"]

log = logging.getLogger("benchmarks.recbole_peer")

FUNNEL_CONF = PROJECT_ROOT / "conf" / "pipeline" / "movielens_funnel.yaml"
RUNNER = Path(__file__).resolve().parent / "recbole_peer_runner.py"
DEFAULT_VENV = Path.home() / ".cache" / "recps" / "recbole-venv"
# RecBole 1.2.1 with torch 2.13: numpy 2 and setuptools 81 broke its imports, pandas 3 its remapping of an item
# sequence column (SASRec's files: "Length of values (1) does not match length of index"); the runner uses its
# Trainer's per-epoch methods, so the version is pinned.
REQUIREMENTS = ("recbole==1.2.1", "torch==2.13.0", "numpy<2", "setuptools<81", "pandas<3")
VALIDATION_FRACTION = 0.2  # each user's latest share of training rows (movielens_funnel.yaml's validation_fraction)
MAX_LEN = 50  # SASRec's sequence length (RecBole's MAX_ITEM_LIST_LENGTH default)
N = 10

# Each model: RecBole's name, its kind, the fixed settings, the grid tried on the validation rows and the epoch
# bound (each setting trains that many epochs, or until --max-minutes; the epochs are chosen afterwards).
MODELS = {
    "bpr": {"recbole": "BPR", "kind": "general", "fixed": {"embedding_size": 64, "train_batch_size": 2048},
            "grid": [{"learning_rate": 0.001}, {"learning_rate": 0.005}], "max_epochs": 100},
    # SASRec: RecBole's defaults but the batch: at 2048 (40 steps an epoch) a trial reached validation NDCG@10
    # 0.0094 after its first epoch (4.5 min on one loaded core); 256 takes 8x the steps for about the same epoch.
    "sasrec": {"recbole": "SASRec", "kind": "sequential",
               "fixed": {"n_layers": 2, "n_heads": 2, "hidden_size": 64, "inner_size": 256,
                         "hidden_dropout_prob": 0.5, "attn_dropout_prob": 0.5, "loss_type": "CE",
                         "MAX_ITEM_LIST_LENGTH": MAX_LEN},
               "grid": [{"learning_rate": 0.001, "train_batch_size": 256}], "max_epochs": 8},
}

# RESULTS.md's recps figures on this split (591 requests), cited, not re-measured.
RECPS_FIGURES = [
    ("recps funnel (D, F1, F2)", "0.1015-0.1043", "0.426-0.447", "RESULTS.md, Funnel: training on a validation period"),
    ("recps EASE (λ=300 on validation)", "0.1017", "0.4467", "RESULTS.md, SASRec alone"),
    ("recps recall alone", "0.0926-0.0933", "", "RESULTS.md, Funnel: training on a validation period (F1, F2, D)"),
    ("recps most-popular", "0.0784", "0.3181", "RESULTS.md, SASRec alone"),
    ("recps SASRec alone (seed 0)", "0.0614", "0.3029", "RESULTS.md, SASRec alone"),
]


def load_split(ratings: str | None = None, movies: str | None = None, max_users: int | None = None) -> FunnelData:
    """recps' MovieLens funnel data with movielens_funnel.yaml's `world:` settings (paths overridable)."""
    OmegaConf.register_new_resolver("recps.root", lambda: str(PROJECT_ROOT), replace=True)
    world = OmegaConf.to_container(OmegaConf.load(FUNNEL_CONF).world, resolve=True)
    world.pop("_target_")
    if ratings:
        world["ratings"] = ratings
    if movies:
        world["movies"] = movies
    if max_users is not None:
        world["max_users"] = max_users
    return movielens(**world)


def _ordered(data: FunnelData) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training rows (users, items, clicked) in each user's time order, ties in the data's row order (as
    recps.pipeline.held_out.fit_ease orders them)."""
    users, items, clicked = data.train_user, data.train_item, data.train_labels[:, 0] > 0
    order = torch.from_numpy(np.lexsort((np.arange(users.numel()), data.train_time.numpy(), users.numpy())))
    return users[order], items[order], clicked[order]


@dataclass
class Export:
    """What `export` wrote for one model kind: the atomic-file folder (datasets `select` and `all`), the users
    RecBole lists items for (`valid.tsv`: the users with a validation positive, their earlier rows as input and
    exclusion; `requests.tsv`: the held-out request users, their whole training history as input, their
    training-rated items, `data.seen`, excluded), and the recps tensors behind them."""

    folder: Path
    requests: Path
    valid: Path
    request_users: torch.Tensor  # (R,) data.test_users
    valid_users: torch.Tensor  # (V,) the users with a validation positive, ascending
    valid_positives: Csr  # over valid_users: their validation positives
    trained_items: torch.Tensor  # (I,) bool: the item has a training row (dataset `all`)
    early_items: torch.Tensor  # (I,) bool: the item has an earlier training row (dataset `select`)


def _write(path: Path, header: list[str], columns: list[list[str]]) -> None:
    lines = ["\t".join(header)] + ["\t".join(row) for row in zip(*columns)]
    path.write_text("\n".join(lines) + "\n")


def _sequences(users: torch.Tensor, items: torch.Tensor) -> dict[int, list[int]]:
    """{user: its items in the given (time) order}."""
    out: dict[int, list[int]] = {}
    for u, i in zip(users.tolist(), items.tolist()):
        out.setdefault(u, []).append(i)
    return out


def _general(path: Path, users: torch.Tensor, items: torch.Tensor) -> None:
    _write(path, ["user_id:token", "item_id:token"],
           [[str(u) for u in users.tolist()], [str(i) for i in items.tolist()]])


def _sequential(path: Path, rows: list[tuple[int, list[int], int]]) -> None:
    """RecBole's sequential benchmark layout: user, the item sequence before the target (oldest first), target."""
    _write(path, ["user_id:token", "item_id_list:token_seq", "item_id:token"],
           [[str(u) for u, _, _ in rows], [" ".join(map(str, s[-MAX_LEN:])) for _, s, _ in rows],
            [str(t) for _, _, t in rows]])


def _next_item_rows(seqs: dict[int, list[int]]) -> list[tuple[int, list[int], int]]:
    """Every training position after a user's first: (user, the items before it, the item)."""
    return [(u, s[:p], s[p]) for u, s in seqs.items() for p in range(1, len(s))]


def _after(seqs: dict[int, list[int]], users: torch.Tensor, items: torch.Tensor) -> list[tuple[int, list[int], int]]:
    """Rows (user, the user's whole sequence in `seqs`, target) for each (user, item) target."""
    return [(u, seqs.get(u, []), i) for u, i in zip(users.tolist(), items.tolist()) if seqs.get(u)]


def export(data: FunnelData, folder: Path, kind: str, validation_fraction: float = VALIDATION_FRACTION) -> Export:
    """Writes recps' split as RecBole atomic files under `folder`: datasets `select` and `all` (module doc) in
    the `general` (user, item) or `sequential` (user, item sequence, target) layout, and requests.tsv (each
    held-out request user, its whole training history oldest first). Tokens are recps' user and item ids."""
    users, items, clicked = _ordered(data)
    (early_u, early_i), (val_u, val_i) = holdout_latest(users, items, validation_fraction, keep=clicked)
    p = data.test_positives
    test_u = data.test_users[p.row_ids()]  # (P,) each held-out positive's user
    test_i = p.items
    for name in ("select", "all"):
        (folder / name).mkdir(parents=True, exist_ok=True)
    if kind == "general":
        _general(folder / "select" / "select.train.inter", early_u, early_i)
        _general(folder / "all" / "all.train.inter", users, items)
        for name in ("select", "all"):
            _general(folder / name / f"{name}.valid.inter", val_u, val_i)
            _general(folder / name / f"{name}.test.inter", test_u, test_i)
    elif kind == "sequential":
        early, whole = _sequences(early_u, early_i), _sequences(users, items)
        _sequential(folder / "select" / "select.train.inter", _next_item_rows(early))
        _sequential(folder / "all" / "all.train.inter", _next_item_rows(whole))
        for name in ("select", "all"):
            _sequential(folder / name / f"{name}.valid.inter", _after(early, val_u, val_i))
            _sequential(folder / name / f"{name}.test.inter", _after(whole, test_u, test_i))
    else:
        raise ValueError(f"recbole_peer: kind {kind!r}; use 'general' or 'sequential'")
    whole = _sequences(users, items)
    requests = folder / "requests.tsv"
    seen = data.seen.rows(data.test_users)
    excluded = [" ".join(map(str, seen.items[seen.offsets[r]:seen.offsets[r + 1]].tolist()))
                for r in range(data.test_users.numel())]
    _write(requests, ["user", "history", "exclude"],
           [[str(u) for u in data.test_users.tolist()],
            [" ".join(map(str, whole.get(u, []))) for u in data.test_users.tolist()], excluded])
    asked = torch.unique(val_u)  # (V,) ascending
    row = torch.full((data.num_users,), -1, dtype=torch.int64)
    row[asked] = torch.arange(asked.numel())
    earlier = _sequences(early_u, early_i)
    valid = folder / "valid.tsv"
    _write(valid, ["user", "history", "exclude"],
           [[str(u) for u in asked.tolist()], [" ".join(map(str, earlier[u])) for u in asked.tolist()],
            [" ".join(map(str, sorted(set(earlier[u])))) for u in asked.tolist()]])
    trained = torch.zeros(data.num_items, dtype=torch.bool)
    trained[items] = True
    early_trained = torch.zeros(data.num_items, dtype=torch.bool)
    early_trained[early_i] = True
    return Export(folder, requests, valid, data.test_users.clone(), asked,
                  csr_from_pairs(row[val_u], val_i, int(asked.numel())), trained, early_trained)


def read_inter(path: Path) -> dict[str, list[str]]:
    """An atomic .inter file as {column name (without its type): values}."""
    lines = path.read_text().splitlines()
    names = [h.split(":")[0] for h in lines[0].split("\t")]
    rows = [line.split("\t") for line in lines[1:]]
    return {name: [r[c] for r in rows] for c, name in enumerate(names)}


def check_lists(lists: np.ndarray, users: torch.Tensor, exclude: Csr, allowed: torch.Tensor, n: int) -> torch.Tensor:
    """RecBole's (B, k) lists (recps item ids, -1 pads) as a (B, n) tensor, after checking that none lists an
    item `exclude` holds for its user or an item outside `allowed` (the runner applies both)."""
    out = torch.from_numpy(np.ascontiguousarray(lists[:, :n])).to(torch.int64)  # (B, n)
    if out.shape != (users.numel(), n):
        raise RuntimeError(f"recbole_peer: RecBole listed {tuple(lists.shape)} items for {users.numel()} users; "
                           f"expected ({users.numel()}, >= {n}): see the runner's log")
    bad = fm.hits(out, exclude.offsets, exclude.items) | ((out >= 0) & ~allowed[out.clamp(min=0)])
    if bool(bad.any()):
        raise RuntimeError(f"recbole_peer: RecBole listed {int(bad.sum())} excluded or untrained items; "
                           f"the runner's exclusion is broken")
    return out


def validation_ndcg(lists: torch.Tensor, positives: Csr, n: int) -> float:
    """recps.metrics.funnel's NDCG@n of (V, n) lists against the validation positives."""
    pair = fm.ndcg_at_k(lists, positives.offsets, positives.items, n, "ndcg")["ndcg"]
    return float(pair[0] / pair[1])


def ensure_venv(venv: Path) -> Path:
    """RecBole's own virtualenv (created once, then reused while its marker names REQUIREMENTS); its python."""
    python = venv / "bin" / "python"
    marker = venv / ".recps-recbole"
    wanted = " ".join(REQUIREMENTS)
    if python.exists() and marker.exists() and marker.read_text().strip() == wanted:
        return python
    log.info("creating RecBole's virtualenv %s (%s)", venv, wanted)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *REQUIREMENTS], check=True, timeout=1800)
    subprocess.run([str(python), "-c", "import recbole.quick_start"], check=True, timeout=300, env=_env(1))
    marker.write_text(wanted + "\n")
    return python


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1", "PYTHONHASHSEED": "0"}


def base_config(kind: str, checkpoints: Path) -> dict:
    """RecBole settings shared by every model: the exported files, the metrics, CPU, seed 0."""
    cols = ["user_id", "item_id_list", "item_id"] if kind == "sequential" else ["user_id", "item_id"]
    out = {"load_col": {"inter": cols}, "benchmark_filename": ["train", "valid", "test"],
           "metrics": ["NDCG", "Hit", "Recall"], "topk": [N], "valid_metric": f"NDCG@{N}", "use_gpu": False,
           "seed": 0, "reproducibility": True, "show_progress": False, "worker": 0, "eval_batch_size": 4096,
           "checkpoint_dir": str(checkpoints), "log_wandb": False, "save_dataset": False,
           "save_dataloaders": False}
    if kind == "sequential":
        out.update({"alias_of_item_id": ["item_id_list"], "train_neg_sample_args": None})
    return out


def _run(job: dict, folder: Path, spec: dict, python: Path, args: argparse.Namespace) -> dict:
    """One RecBole runner process on `job` (nice -n 10, a timeout); its result.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.json").write_text(json.dumps(job, indent=1))
    command = ["nice", "-n", "10", str(python), str(RUNNER), str(folder / "job.json")]
    log.info("RecBole %s on %s: %s", spec["recbole"], job["dataset"], " ".join(command))
    timeout = max(60.0, job["deadline"] - time.time()) + 900  # + data loading, listing, RecBole's own figures
    try:
        with open(folder / "runner.log", "w") as sink:
            subprocess.run(command, cwd=folder, env=_env(args.threads), stdout=sink, stderr=subprocess.STDOUT,
                           check=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise SystemExit(f"recbole_peer: RecBole {spec['recbole']} still ran after {exc.timeout:.0f} s (--max-minutes "
                         f"{args.max_minutes} + 15 min); its log: {folder / 'runner.log'}") from exc
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"recbole_peer: RecBole {spec['recbole']} failed (exit {exc.returncode}); its log: "
                         f"{folder / 'runner.log'}") from exc
    return json.loads((folder / "result.json").read_text())


def _tokens(mask: torch.Tensor) -> list[str]:
    return [str(i) for i in mask.nonzero().flatten().tolist()]


def run_model(name: str, data: FunnelData, out: Path, python: Path, args: argparse.Namespace) -> dict:
    """Exports the split for `name`'s kind, runs RecBole on it in its virtualenv (select, then refit), chooses
    the setting and epochs by recps' validation NDCG@10 and scores the chosen model's lists; one result row."""
    spec = MODELS[name]
    folder = out / name
    exported = export(data, folder / "data", spec["kind"])
    start = time.perf_counter()
    deadline = time.time() + 60.0 * args.max_minutes
    common = {"model": spec["recbole"], "kind": spec["kind"], "data_path": str(folder / "data"), "k": N,
              "base": {**base_config(spec["kind"], folder / "saved"), **spec["fixed"]}, "threads": args.threads,
              "deadline": deadline}
    select = _run({**common, "dataset": "select", "settings": spec["grid"], "every_epoch": True,
                   "epochs": args.epochs or spec["max_epochs"], "recbole_own": True,
                   "trained_items": _tokens(exported.early_items), "out": str(folder / "select"),
                   "lists": {"valid": str(exported.valid), "requests": str(exported.requests)}},
                  folder / "select", spec, python, args)
    seen = data.seen.rows(data.test_users)
    earlier = Csr(*_earlier(exported))
    trials, best = [], None
    for index, record in enumerate(select["settings"]):
        lists = np.load(folder / "select" / f"lists_{index}.npz")
        curve = {}
        for row in record["epochs"]:
            e = row["epoch"]
            valid = check_lists(lists[f"valid_{e}"], exported.valid_users, earlier, exported.early_items, N)
            curve[e] = validation_ndcg(valid, exported.valid_positives, N)
            if best is None or curve[e] > best[2]:  # ties: the earlier setting, the fewer epochs
                best = (index, e, curve[e])
        trials.append({"setting": record["setting"], "validation_ndcg@10": curve, "stopped": record["stopped"],
                       "epoch_seconds": [round(r["seconds"], 1) for r in record["epochs"]],
                       "recbole_own": {r["epoch"]: {"valid": r.get("recbole_valid"), "test": r.get("recbole_test")}
                                       for r in record["epochs"]}})
    if best is None:
        raise SystemExit(f"recbole_peer: RecBole {spec['recbole']} trained no epoch before the deadline; raise "
                         f"--max-minutes ({args.max_minutes})")
    index, epochs, valid_ndcg = best
    setting = select["settings"][index]["setting"]
    epoch_seconds = max(r["seconds"] for r in select["settings"][index]["epochs"])
    lists = np.load(folder / "select" / f"lists_{index}.npz")[f"requests_{epochs}"]
    own = trials[index]["recbole_own"][epochs]["test"]
    refit: dict = {"skipped": "--no-refit"} if args.no_refit else {}
    if not args.no_refit:
        needed = 1.2 * epochs * epoch_seconds
        if time.time() + needed > deadline:
            refit = {"skipped": f"needs ~{needed:.0f} s, past the --max-minutes {args.max_minutes} deadline"}
        else:
            final = _run({**common, "dataset": "all", "settings": [setting], "epochs": epochs, "every_epoch": False,
                          "recbole_own": True, "trained_items": _tokens(exported.trained_items),
                          "lists": {"requests": str(exported.requests)}, "out": str(folder / "all")},
                         folder / "all", spec, python, args)
            lists = np.load(folder / "all" / "lists_0.npz")[f"requests_{epochs}"]
            own = final["settings"][0]["epochs"][-1]["recbole_test"]
            refit = {"epochs": epochs, "seconds": final["seconds"]}
    allowed = exported.trained_items if "epochs" in refit else exported.early_items
    top = check_lists(lists, data.test_users, seen, allowed, N)
    return {"model": spec["recbole"], **list_metrics(top, data, N), "requests": int(top.shape[0]),
            "chosen": {"setting": setting, "epochs": epochs, "validation_ndcg@10": valid_ndcg},
            "fixed": spec["fixed"], "recbole_own_test": own, "refit": refit, "trials": trials,
            "wall_seconds": time.perf_counter() - start, "select_seconds": select["seconds"],
            "versions": select["versions"], "torch_threads": select["torch_threads"]}


def _earlier(exported: Export) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets, items) over valid_users: the items of their earlier rows (the validation lists' exclusion)."""
    rows = [line.split("\t") for line in exported.valid.read_text().splitlines()[1:]]
    items = [[int(i) for i in r[2].split(" ")] if r[2] else [] for r in rows]
    offsets = torch.tensor([0, *np.cumsum([len(i) for i in items]).tolist()], dtype=torch.int64)
    return offsets, torch.tensor([i for row in items for i in row], dtype=torch.int64)


def markdown(rows: list[dict]) -> str:
    out = ["| model | NDCG@10 (recps' metric) | HR@10 (recps' metric) | RecBole's own NDCG@10 / Hit@10 "
           "| chosen on validation (recps' NDCG@10 there) | refit | wall |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        own, refit, chosen = r["recbole_own_test"] or {}, r["refit"], r["chosen"]
        done = f"{refit['epochs']} epochs on all training rows" if "epochs" in refit else f"no ({refit['skipped']})"
        out.append(f"| RecBole {r['model']} | {r[f'ndcg@{N}']:.4f} | {r[f'hr@{N}']:.4f} | "
                   f"{own.get(f'ndcg@{N}', float('nan')):.4f} / {own.get(f'hit@{N}', float('nan')):.4f} | "
                   f"{chosen['setting']}, {chosen['epochs']} epochs ({chosen['validation_ndcg@10']:.4f}) | {done} | "
                   f"{r['wall_seconds']:.0f} s |")
    for name, ndcg, hr, where in RECPS_FIGURES:
        out.append(f"| {name} | {ndcg} | {hr} | | {where} | | |")
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bpr,sasrec", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--epochs", type=int, default=0, help="max epochs per setting (0: each model's default)")
    parser.add_argument("--max-minutes", type=float, default=60.0, help="wall budget of each model's training")
    parser.add_argument("--out-dir", help="default: outputs/recbole_peer/<date>/<time>")
    parser.add_argument("--ratings", help="default: movielens_funnel.yaml's world.ratings")
    parser.add_argument("--movies", help="default: movielens_funnel.yaml's world.movies")
    parser.add_argument("--venv", default=str(DEFAULT_VENV), help="RecBole's virtualenv (created when absent)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in RecBole's process")
    parser.add_argument("--no-refit", action="store_true", help="score the model trained on the earlier rows")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[str]:
    """The models asked for; a bad value raises SystemExit with one line naming it and the fix, before anything
    heavy starts."""
    models = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        bad = unknown[0] if unknown else "(none)"
        raise SystemExit(f"recbole_peer: --models {args.models!r}: unknown model {bad!r}; "
                         f"use a comma-separated list of {', '.join(MODELS)}")
    for flag, path in (("--ratings", args.ratings), ("--movies", args.movies)):
        if path and not Path(path).is_file():
            raise SystemExit(f"recbole_peer: {flag} {path}: no such file; pass MovieLens latest-small's file "
                             f"(datasets/movielens_latest_small/) or leave {flag} out for movielens_funnel.yaml's")
    if args.epochs < 0 or args.max_minutes <= 0 or args.threads < 1:
        raise SystemExit(f"recbole_peer: --epochs {args.epochs} / --max-minutes {args.max_minutes} / --threads "
                         f"{args.threads}: use epochs >= 0, minutes > 0, threads >= 1")
    return models


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    models = check_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    torch.set_num_threads(args.threads)
    out = Path(args.out_dir) if args.out_dir else (PROJECT_ROOT / "outputs" / "recbole_peer" /
                                                   datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S"))
    out.mkdir(parents=True, exist_ok=True)
    data = load_split(args.ratings, args.movies)
    python = ensure_venv(Path(args.venv))
    rows = []
    for name in models:
        rows.append(run_model(name, data, out, python, args))
        result = {"command": "python -m benchmarks.recbole_peer " + " ".join(sys.argv[1:] if argv is None else argv),
                  "split": {"conf": str(FUNNEL_CONF.relative_to(PROJECT_ROOT)),
                            "requests": int(data.test_users.numel()),
                            "train_rows": int(data.train_user.numel()), "items": data.num_items,
                            "validation_fraction": VALIDATION_FRACTION},
                  "models": rows, "recps_figures_cited": RECPS_FIGURES, "markdown": markdown(rows)}
        (out / "recbole_peer.json").write_text(json.dumps(result, indent=1))
    print(markdown(rows))
    print(f"results: {out / 'recbole_peer.json'}")
    return result


if __name__ == "__main__":
    main()
