"""The RecBole side of benchmarks/recbole_peer.py: runs inside RecBole's own virtualenv, never imported by recps.

    <recbole-venv>/bin/python benchmarks/recbole_peer_runner.py JOB.json

JOB.json (written by benchmarks.recbole_peer) names the model, the atomic-file datasets it exported (`select`:
train = each user's earlier training rows, valid = the latest share's clicks; `all`: train = every training
row), the settings to try, the epoch bound, the patience and a wall-clock deadline. For each setting the model
trains on `select` and is validated after every epoch by RecBole's own NDCG@10 on the valid file; the setting
and epoch with the best validation figure are chosen (the held-out test rows are never read for a choice).
Then, if the deadline allows, a fresh model with that setting trains on `all` for the chosen epochs (no
validation). The model is scored over RecBole's whole item vocabulary for every held-out request user
(requests.tsv: the user's token and its whole training history, oldest first), and RecBole's own test figures
are computed on the test file (labelled as RecBole's in the results). Writes, into the job's `out` folder:
scores.npy (R, n_items) float32, items.json (the item token of each column) and result.json.
Imports only RecBole, torch and numpy: recps is not installed in this virtualenv.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from recbole.config import Config
from recbole.data import create_dataset, data_preparation
from recbole.data.interaction import Interaction
from recbole.utils import get_model, get_trainer, init_seed


def build(job: dict, dataset: str, setting: dict, epochs: int):
    """RecBole's config, dataloaders and a fresh model for `dataset` (a folder of atomic files) and `setting`."""
    config_dict = {**job["base"], **setting, "dataset": dataset, "data_path": job["data_path"], "epochs": epochs}
    config = Config(model=job["model"], dataset=dataset, config_dict=config_dict)
    init_seed(config["seed"], config["reproducibility"])
    torch.set_num_threads(int(job["threads"]))
    data = create_dataset(config)
    train, valid, test = data_preparation(config, data)
    init_seed(config["seed"] + config["local_rank"], config["reproducibility"])
    model = get_model(config["model"])(config, train._dataset).to(config["device"])
    trainer = get_trainer(config["MODEL_TYPE"], config["model"])(config, model)
    return config, data, (train, valid, test), model, trainer


def train(job: dict, dataset: str, setting: dict, epochs: int, validate: bool, deadline: float) -> dict:
    """Trains up to `epochs` epochs (validating after each when `validate`), stopping after `patience` epochs
    without a better validation NDCG@10 or before an epoch that would pass `deadline`. Returns the run's
    record with the best state (the last one when not validating)."""
    config, data, (train_data, valid_data, test_data), model, trainer = build(job, dataset, setting, epochs)
    metric = config["valid_metric"].lower()
    record: dict = {"setting": setting, "epochs": [], "stopped": "epochs"}
    best, best_state, waited = -1.0, None, 0
    for epoch in range(epochs):
        spent = [e["train_seconds"] + e.get("valid_seconds", 0.0) for e in record["epochs"]]
        if spent and time.time() + max(spent) > deadline:
            record["stopped"] = "deadline"
            break
        start = time.perf_counter()
        loss = trainer._train_epoch(train_data, epoch)
        row = {"epoch": epoch + 1, "loss": float(loss if not isinstance(loss, tuple) else sum(loss)),
               "train_seconds": time.perf_counter() - start}
        if validate:
            start = time.perf_counter()
            score, result = trainer._valid_epoch(valid_data)
            row.update(valid={k: float(v) for k, v in result.items()}, valid_seconds=time.perf_counter() - start)
            if score > best:
                best, best_state, waited = score, copy.deepcopy(model.state_dict()), 0
                record["best_epoch"], record["best_valid"] = epoch + 1, float(score)
            else:
                waited += 1
        record["epochs"].append(row)
        print(f"[recbole_peer_runner] {job['model']} {dataset} {setting} epoch {epoch + 1}: {row}", flush=True)
        if validate and waited >= int(job["patience"]):
            record["stopped"] = "patience"
            break
    if not validate:
        best_state = copy.deepcopy(model.state_dict())
        record["best_epoch"] = len(record["epochs"])
    record["valid_metric"] = metric
    return {"record": record, "state": best_state, "model": model, "trainer": trainer, "data": data,
            "test": test_data, "config": config}


def score(job: dict, run: dict) -> tuple[np.ndarray, list[str]]:
    """(R, n_items) scores of every request user over RecBole's item vocabulary, and each column's item token."""
    model, data, config = run["model"], run["data"], run["config"]
    model.load_state_dict(run["state"])
    model.eval()
    rows = [line.rstrip("\n").split("\t") for line in Path(job["requests"]).read_text().splitlines()[1:]]
    item_field = data.iid_field
    tokens = [str(t) for t in data.field2id_token[item_field]]
    out = []
    with torch.no_grad():
        for start in range(0, len(rows), 256):
            part = rows[start: start + 256]
            if job["kind"] == "sequential":
                width = int(config["MAX_ITEM_LIST_LENGTH"])
                seq = torch.zeros(len(part), width, dtype=torch.int64)  # (B, L) oldest first, 0-padded at the end
                lengths = torch.zeros(len(part), dtype=torch.int64)  # (B,)
                for b, (_, history) in enumerate(part):
                    ids = data.token2id(item_field, history.split(" ")[-width:])
                    seq[b, : len(ids)] = torch.as_tensor(np.asarray(ids, dtype=np.int64))
                    lengths[b] = len(ids)
                batch = Interaction({model.ITEM_SEQ: seq, model.ITEM_SEQ_LEN: lengths})
            else:
                users = np.asarray(data.token2id(data.uid_field, [u for u, _ in part]), dtype=np.int64)
                batch = Interaction({model.USER_ID: torch.as_tensor(users)})
            out.append(model.full_sort_predict(batch).view(len(part), -1).to(torch.float32).numpy())  # (B, n_items)
    return np.concatenate(out), tokens


def main(path: str) -> None:
    job = json.loads(Path(path).read_text())
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    deadline = float(job["deadline"])
    started = time.perf_counter()
    trials = []
    best_trial = None
    for setting in job["grid"]:  # choices on the `select` dataset's validation rows only
        run = train(job, job["select"], setting, int(job["max_epochs"]), True, deadline)
        trials.append(run["record"])
        if best_trial is None or run["record"].get("best_valid", -1.0) > best_trial["record"].get("best_valid", -1.0):
            best_trial = run
        else:
            del run
    chosen = best_trial["record"]
    result: dict = {"model": job["model"], "trials": trials, "chosen": {"setting": chosen["setting"],
                                                                         "epochs": chosen.get("best_epoch", 0),
                                                                         "valid": chosen.get("best_valid")}}
    final = best_trial
    epoch_seconds = max([e["train_seconds"] for e in chosen["epochs"]] or [0.0])
    if job["refit"] and chosen.get("best_epoch"):
        needed = chosen["best_epoch"] * epoch_seconds * 1.2
        if time.time() + needed <= deadline:
            final = train(job, job["all"], chosen["setting"], int(chosen["best_epoch"]), False, float("inf"))
            result["refit"] = final["record"]
        else:
            result["refit"] = {"skipped": f"needs ~{needed:.0f} s, beyond the deadline"}
    else:
        result["refit"] = {"skipped": "not asked" if not job["refit"] else "no epoch trained"}
    start = time.perf_counter()
    scores, tokens = score(job, final)
    result["score_seconds"] = time.perf_counter() - start
    np.save(out / "scores.npy", scores)
    (out / "items.json").write_text(json.dumps(tokens))
    final["model"].load_state_dict(final["state"])
    own = final["trainer"].evaluate(final["test"], load_best_model=False)
    result["recbole_test"] = {k: float(v) for k, v in own.items()}
    result["scored_dataset"] = job["all"] if "epochs" in result["refit"] else job["select"]
    result["seconds"] = time.perf_counter() - started
    result["torch_threads"] = torch.get_num_threads()
    result["versions"] = {"recbole": __import__("recbole").__version__, "torch": torch.__version__,
                          "numpy": np.__version__, "python": sys.version.split()[0]}
    result["pid"] = os.getpid()
    (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
