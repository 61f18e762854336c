"""The RecBole side of benchmarks/recbole_peer.py: runs inside RecBole's own virtualenv, never imported by recps.

    <recbole-venv>/bin/python benchmarks/recbole_peer_runner.py JOB.json

JOB.json (written by benchmarks.recbole_peer) names the model, one atomic-file dataset it exported (`select`:
train = each user's earlier training rows, valid = the latest share's clicks; `all`: train = every training
row), the settings to run, the epochs and a wall-clock deadline, and the users to list items for: `lists`
maps a name to a TSV of (user token, its input history oldest first, the item tokens to exclude). For each
setting a fresh model trains epoch by epoch (no early stopping: recps chooses the setting and epoch afterwards,
from the validation lists, with its own metric); after every epoch (`every_epoch`) or after the last one, it
scores RecBole's whole item vocabulary for each listed user (general models: the user's embedding; sequential
models: the user's history, its last MAX_ITEM_LIST_LENGTH items), sets the excluded items and the items
outside `allowed` to -inf and keeps the top `k`. RecBole's own figures (its NDCG / Hit / Recall @10 on its
valid and test files, its definitions and masking) are recorded beside them, never used for a choice.
Writes, into the job's `out` folder: lists_<setting>.npz ({name}_{epoch}: (users, k) int64 item tokens, -1
where fewer than k items were left) and result.json. Imports only RecBole, torch and numpy.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from recbole.config import Config
from recbole.data import create_dataset, data_preparation
from recbole.data.interaction import Interaction
from recbole.utils import get_model, get_trainer, init_seed


def build(job: dict, setting: dict):
    """RecBole's config, dataset, dataloaders, a fresh model and its trainer for the job's dataset and `setting`."""
    config_dict = {**job["base"], **setting, "dataset": job["dataset"], "data_path": job["data_path"],
                   "epochs": int(job["epochs"])}
    config = Config(model=job["model"], dataset=job["dataset"], config_dict=config_dict)
    init_seed(config["seed"], config["reproducibility"])
    torch.set_num_threads(int(job["threads"]))
    data = create_dataset(config)
    loaders = data_preparation(config, data)
    init_seed(config["seed"], config["reproducibility"])
    model = get_model(config["model"])(config, loaders[0]._dataset).to(config["device"])
    trainer = get_trainer(config["MODEL_TYPE"], config["model"])(config, model)
    return config, data, loaders, model, trainer


def read_users(path: str) -> list[tuple[str, list[str], list[str]]]:
    """(user token, history tokens oldest first, excluded item tokens) per row of a lists TSV."""
    rows = []
    for line in Path(path).read_text().splitlines()[1:]:
        user, history, exclude = line.split("\t")
        rows.append((user, history.split(" ") if history else [], exclude.split(" ") if exclude else []))
    return rows


def top_lists(job: dict, model, data, config, users: list, allowed: torch.Tensor) -> np.ndarray:
    """(B, k) the top k item tokens (as ints) of each user's full-vocabulary scores, exclusions applied."""
    item_field = data.iid_field
    vocab = data.field2token_id[item_field]  # token -> RecBole id
    tokens = np.array([int(t) if str(t).isdigit() else -1 for t in data.field2id_token[item_field]])  # (V,)
    k = int(job["k"])
    out = []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(users), 256):
            part = users[start: start + 256]
            if job["kind"] == "sequential":
                width = int(config["MAX_ITEM_LIST_LENGTH"])
                seq = torch.zeros(len(part), width, dtype=torch.int64)  # (B, L) oldest first, 0-padded at the end
                lengths = torch.zeros(len(part), dtype=torch.int64)  # (B,)
                for b, (_, history, _) in enumerate(part):  # items outside this dataset's files: not an input
                    ids = np.asarray([vocab[t] for t in history if t in vocab][-width:], dtype=np.int64)
                    seq[b, : ids.size] = torch.from_numpy(ids)
                    lengths[b] = ids.size
                batch = Interaction({model.ITEM_SEQ: seq, model.ITEM_SEQ_LEN: lengths})
            else:
                ids = np.asarray(data.token2id(data.uid_field, [u for u, _, _ in part]), dtype=np.int64)
                batch = Interaction({model.USER_ID: torch.from_numpy(ids)})
            scores = model.full_sort_predict(batch).view(len(part), -1).to(torch.float32)  # (B, V)
            scores[:, ~allowed] = float("-inf")
            for b, (_, _, exclude) in enumerate(part):
                known = [vocab[t] for t in exclude if t in vocab]
                scores[b, torch.tensor(known, dtype=torch.int64)] = float("-inf")
            value, top = torch.topk(scores, min(k, scores.shape[1]), dim=1)  # (B, k)
            listed = torch.from_numpy(tokens)[top]
            out.append(torch.where(torch.isfinite(value), listed, torch.full_like(listed, -1)).numpy())
    return np.concatenate(out)


def main(path: str) -> None:
    job = json.loads(Path(path).read_text())
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    deadline = float(job["deadline"])
    started = time.perf_counter()
    users = {name: read_users(p) for name, p in job["lists"].items()}
    result: dict = {"model": job["model"], "dataset": job["dataset"], "settings": []}
    for index, setting in enumerate(job["settings"]):
        config, data, (train_data, valid_data, test_data), model, trainer = build(job, setting)
        trained = set(job["trained_items"])  # the tokens of items with a training row in this dataset
        allowed = torch.tensor([str(t) in trained for t in data.field2id_token[data.iid_field]])  # (V,)
        record: dict = {"setting": setting, "epochs": [], "stopped": "epochs", "items": int(data.item_num)}
        lists: dict[str, np.ndarray] = {}
        for epoch in range(1, int(job["epochs"]) + 1):
            spent = [e["seconds"] for e in record["epochs"]]
            if spent and time.time() + max(spent) > deadline:
                record["stopped"] = "deadline"
                break
            start = time.perf_counter()
            loss = trainer._train_epoch(train_data, epoch - 1)
            row = {"epoch": epoch, "loss": float(sum(loss) if isinstance(loss, tuple) else loss),
                   "train_seconds": time.perf_counter() - start}
            if job["every_epoch"] or epoch == int(job["epochs"]):
                for name, rows in users.items():
                    lists[f"{name}_{epoch}"] = top_lists(job, model, data, config, rows, allowed)
                if job["recbole_own"]:  # recorded, never used for a choice
                    for key, loader in (("recbole_valid", valid_data), ("recbole_test", test_data)):
                        row[key] = {k: float(v) for k, v in trainer.evaluate(loader, load_best_model=False).items()}
            row["seconds"] = time.perf_counter() - start
            record["epochs"].append(row)
            print(f"[recbole_peer_runner] {job['model']} {job['dataset']} {setting} {row}", flush=True)
        np.savez(out / f"lists_{index}.npz", **lists)
        result["settings"].append(record)
    result["seconds"] = time.perf_counter() - started
    result["torch_threads"] = torch.get_num_threads()
    result["versions"] = {"recbole": __import__("recbole").__version__, "torch": torch.__version__,
                          "numpy": np.__version__, "python": sys.version.split()[0]}
    (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
