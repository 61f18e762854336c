"""Serving the trained funnel: `python -m recps.pipeline.recommend RUN_DIR --users 1,2,3 [--n 10] [--json]`.

Reads what the run left (no training cluster, no server): its composed config (<run dir>/recps-job.yaml),
each stage's export (<run dir>/funnel/<stage>.pt: the rows the servers held and its dense state) and the
recall stage's item index (<run dir>/funnel/items.ann), rebuilds the data's feature tables, and sends the
users through the same cascade as the evaluation (recps.pipeline.funnel.Funnel.run). Prints each user's
final top-N with every stage's score of each item (what each score is: `score_meaning`) and, with
`--latency-users N`, the latency: per stage and per request, p50 / p99 over users served one at a time,
and users/s served in batches.

    from recps.pipeline.recommend import load_funnel, recommend
    funnel = load_funnel(run_dir)
    lists = recommend(funnel, torch.tensor([1, 2, 3]), n=5)   # [{"user": 1, "items": [...], "scores": {...}}, ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from omegaconf import OmegaConf

from recps import fs as rfs
from recps import quiet_libraries
from recps.config import register_resolvers
from recps.errors import ConfigError, RecpsError
from recps.pipeline.ann import ItemIndex
from recps.pipeline.data import load_world
from recps.pipeline.ease import EaseBaseline
from recps.pipeline.counts import COUNTS_EXPORT, counts_from_bytes
from recps.pipeline.stages import ITEM_CF, pipeline_specs
from recps.pipeline.funnel import EXPORT_DIR, ITEM_CF_EXPORT, Funnel, load_stage

__all__ = ["load_funnel", "recommend", "score_meaning", "latency", "main"]

JOB_CONFIG = "recps-job.yaml"  # what recps.cluster writes into the run folder


def load_funnel(run_dir: str | Path, data=None) -> Funnel:
    """The trained funnel of a `pipeline=...` run folder (see the module docstring); `data`: its
    FunnelData when the caller holds it already (else built from the run's config)."""
    register_resolvers()
    run_dir = Path(run_dir)
    path = run_dir / JOB_CONFIG
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no {JOB_CONFIG}; give the folder of a `python -m recps.train pipeline=...` run")
    cfg = OmegaConf.load(path)
    if str((cfg.get("pipeline") or {}).get("name", "none")) == "none":
        raise ConfigError(f"{run_dir}: not a funnel run (pipeline=none); give the folder of a "
                          "`python -m recps.train pipeline=...` run (a single model's run is served by recps.serve)")
    specs = pipeline_specs(cfg)
    exports = rfs.join(str(run_dir.resolve()), EXPORT_DIR)
    missing = [s.name for s in specs if not rfs.exists(rfs.join(exports, f"{s.name}.pt"))]
    if missing:
        raise ConfigError(f"{exports}: no export of stage(s) {missing}; the run did not finish training them")
    data = data if data is not None else load_world(cfg)
    stages = {s.name: load_stage(s, rfs.join(exports, f"{s.name}.pt")) for s in specs}
    index = ItemIndex.load(rfs.join(exports, "items.ann"))
    item_cf = None
    if any(ITEM_CF in s.scores for s in specs):
        path = rfs.join(exports, ITEM_CF_EXPORT)
        if not rfs.exists(path):
            raise ConfigError(f"{path} is missing: a stage reads {ITEM_CF} and the run writes its EASE there before "
                              "training; give the folder of a finished run")
        item_cf = EaseBaseline.from_bytes(rfs.read_bytes(path))
    counts = None
    if any(s.counts for s in specs):  # the counting features' statistics as of the end of training
        path = rfs.join(exports, COUNTS_EXPORT)
        if not rfs.exists(path):
            raise ConfigError(f"{path} is missing: a stage reads counting features (inputs.counts) and the run writes "
                              "their statistics there after training; give the folder of a finished run")
        counts = counts_from_bytes(rfs.read_bytes(path))
    funnel = Funnel(specs, stages, index, data, item_cf, counts)
    funnel.top_n = int(cfg.pipeline.top_n)
    return funnel


def _check_users(funnel: Funnel, users: torch.Tensor) -> torch.Tensor:
    users = torch.as_tensor(users, dtype=torch.int64).reshape(-1)
    bad = users[(users < 0) | (users >= funnel.data.num_users)]
    if bad.numel():
        raise ConfigError(f"--users: {bad[:5].tolist()} are not users of this run (ids 0..{funnel.data.num_users - 1})")
    return users


def _check_n(funnel: Funnel, n: int | None) -> int:
    """The list length: `n`, or pipeline.top_n; at most what the final stage keeps."""
    most = funnel.specs[-1].keep
    if n is None:
        return min(int(getattr(funnel, "top_n", most)), most)
    if isinstance(n, bool) or not 1 <= int(n) <= most:
        raise ConfigError(f"--n {n}: give a list length from 1 to {most} (what the final stage "
                          f"{funnel.final} keeps, pipeline.stages.{funnel.final}.keep)")
    return int(n)


def score_meaning(funnel: Funnel) -> dict[str, str]:
    """stage -> what its scores are: a probability of a label, or its weighted sum (score_weights)."""
    names = funnel.data.label_names
    out = {}
    for spec in funnel.specs:
        if spec.score_weights is None:
            out[spec.name] = f"P({names[0]})"
        else:
            out[spec.name] = " + ".join(f"{w:g} x P({names[t]})" for t, w in enumerate(spec.score_weights) if w)
    return out


def recommend(funnel: Funnel, users: Sequence[int] | torch.Tensor, n: int | None = None) -> list[dict[str, Any]]:
    """Each user's final list, best first (its first `n`: default pipeline.top_n), with every stage's score of
    each listed item."""
    n = _check_n(funnel, n)
    users = _check_users(funnel, users)
    out = funnel.run(users)
    final = funnel.final
    kept = out.kept[final]  # (B, N)
    lists = []
    for b, user in enumerate(users.tolist()):
        items = [i for i in kept[b].tolist() if i >= 0][:n]
        scores: dict[str, list[float]] = {}
        for spec in funnel.specs:
            ids = out.kept[spec.name][b]  # (K_s,)
            where = {int(i): k for k, i in enumerate(ids.tolist())}
            scores[spec.name] = [float(out.scores[spec.name][b, where[i]]) for i in items]
        lists.append({"user": int(user), "items": items, "scores": scores})
    return lists


def latency(funnel: Funnel, users: torch.Tensor, batch: int = 256) -> dict[str, Any]:
    """Per stage and per request: p50 / p99 milliseconds over users served one at a time; users/s in batches."""
    users = _check_users(funnel, users)
    per_stage: dict[str, list[float]] = {s.name: [] for s in funnel.specs}
    total: list[float] = []
    for u in users.split(1):
        start = time.perf_counter()
        out = funnel.run(u)
        total.append(1000.0 * (time.perf_counter() - start))
        for name, s in out.seconds.items():
            per_stage[name].append(1000.0 * s)
    start = time.perf_counter()
    for part in users.split(batch):
        funnel.run(part)
    batched = users.numel() / max(1e-9, time.perf_counter() - start)
    q = lambda xs, p: float(np.percentile(np.asarray(xs), p)) if xs else float("nan")  # noqa: E731
    return {"users": int(users.numel()),
            "stages_ms": {n: {"p50": q(v, 50), "p99": q(v, 99)} for n, v in per_stage.items()},
            "request_ms": {"p50": q(total, 50), "p99": q(total, 99)},
            "users_per_sec_batched": batched, "batch": batch}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recps.pipeline.recommend", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="the run folder of `python -m recps.train pipeline=...`")
    parser.add_argument("--users", required=True, help="comma-separated user ids (0..U-1)")
    parser.add_argument("--n", type=int, default=None,
                        help="items a list (default: the run's pipeline.top_n; at most the final stage's keep)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of lines")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: a serving process per core; more oversubscribe a busy machine)")
    parser.add_argument("--latency-users", type=int, default=0,
                        help="users (the first ones) served one at a time and in batches for latency figures "
                             "(default 0: none)")
    args = parser.parse_args(argv)
    quiet_libraries()  # torch.fx's is_fx_tracing notice on the models' first forward pass
    try:
        users = torch.tensor([int(u) for u in args.users.split(",") if u.strip()], dtype=torch.int64)
    except ValueError:
        print(f"recommend: --users={args.users!r}: give comma-separated integers, e.g. 1,2,3", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, int(args.threads)))
    try:
        funnel = load_funnel(args.run_dir)
        lists = recommend(funnel, users, n=args.n)
        timing = None
        if args.latency_users > 0:
            n = min(int(args.latency_users), funnel.data.num_users)
            timing = latency(funnel, torch.arange(n))
    except RecpsError as exc:
        print(f"recommend: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"lists": lists, "scores": score_meaning(funnel), "latency": timing}, indent=2))
        return 0
    meaning = score_meaning(funnel)
    width = max(len(name) for name in meaning)
    print("scores: " + "; ".join(f"{name} {what}" for name, what in meaning.items()))
    for row in lists:
        print(f"user {row['user']}: " + " ".join(str(i) for i in row["items"]))
        for stage, scores in row["scores"].items():
            print(f"  {stage:>{width}}: " + " ".join(f"{s:.3f}" for s in scores))
    if timing:
        print(f"latency over {timing['users']} users, one at a time: request p50 {timing['request_ms']['p50']:.2f} ms, "
              f"p99 {timing['request_ms']['p99']:.2f} ms; batched ({timing['batch']}): "
              f"{timing['users_per_sec_batched']:.0f} users/s")
        for stage, q in timing["stages_ms"].items():
            print(f"  {stage:>8}: p50 {q['p50']:.2f} ms, p99 {q['p99']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
