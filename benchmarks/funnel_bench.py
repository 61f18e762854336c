"""The recommendation funnel end to end (issue 16's benchmark): `python -m recps.train pipeline=video_funnel`
in fresh processes, its metrics.json, then the trained funnel served from its exports.

    python -m benchmarks.funnel_bench                                   # 10^6 items, the default funnel: the seed's mix
    python -m benchmarks.funnel_bench --items 100000 --modes mix,sync,async,geo   # the mode-per-stage table
    python -m benchmarks.funnel_bench --quick                           # 100 users x 500 items, one run, seconds
    python -m benchmarks.funnel_bench --markdown benchmarks/results/funnel_bench_2026-12-05.jsonl --svg docs/funnel.svg

One run per entry of --modes, each the default funnel (conf/pipeline/video_funnel.yaml: keep 10,000 -> 500 ->
100 -> 10) on a generated video world of --users x --items, every stage in the run's modes:

    mix     the seed's advice, the config's defaults: recall GEO, coarse and fine async, fusion sync
    sync, async, geo    every stage in that mode (`ps@pipeline.stages.<stage>.ps=<mode>` for each stage)

Per run, from the run's own metrics.json (recps.pipeline.runner / evaluate; nothing re-implemented here):
each stage's training seconds, examples, examples/s in its mode, the seconds spent building its training
data from the upstream stages (`prepare_s`) and recall's index build; point 5's metrics (pass-through,
recall@K, AUC / GAUC / PNR, the final list's NDCG@10 / HR@10 against most-popular, recall alone, recall +
fine without coarse and the ideal list). Then, with --serve (on by default for the first run), the funnel
is loaded from the run folder (recps.pipeline.recommend.load_funnel: no cluster) in this process with one
torch thread, and `recps.pipeline.recommend.latency` measures p50 / p99 per request over --latency-users
held-out users served one at a time and users/s in batches of --batch; the recall index's recall@keep is
measured against exact search (ItemIndex.search(exact=True)) on --recall-users users with their seen items
excluded, as the funnel searches.

The world is generated (or found) by this process before the run starts (its seconds are `world_s`, not in
the run's wall time); the 1-minute load average is sampled every 5 s during each run. One JSON line per run
is appended to --out; --markdown turns such lines into RESULTS.md's tables and --svg draws the funnel
(candidates kept and positives surviving at each stage) of the first served run.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from recps import fs as rfs

from benchmarks.ann_bench import append_jsonl, cpu_model
from benchmarks.procmon import run_monitored
from benchmarks.ps_throughput import ROOT

__all__ = ["MODES", "STAGES", "TARGETS", "mode_overrides", "run_one", "serve", "markdown", "funnel_figure", "funnel_svg", "main"]

STAGES = ("recall", "coarse", "fine", "fusion")
MODES = {"mix": {"recall": "geo", "coarse": "async", "fine": "async", "fusion": "sync"},
         **{m: {s: m for s in STAGES} for m in ("sync", "async", "geo")}}
TARGETS = {"p99_ms": 50.0, "users_per_s": 200.0, "ann_recall": 0.95}

# --quick: a world and funnel small enough for seconds of training (the smoke test's); keep 100 -> 30 -> 15 -> 10.
QUICK = ["pipeline.world.metric_users=50", "pipeline.world.impressions_per_user=20",
         "pipeline.stages.recall.keep=100", "pipeline.stages.coarse.keep=30", "pipeline.stages.fine.keep=15",
         "pipeline.eval_users=0", "pipeline.stages.recall.trainer.epochs=2",
         *(f"pipeline.stages.{s}.trainer.epochs=1" for s in ("coarse", "fine", "fusion"))]


def mode_overrides(label: str) -> list[str]:
    """The command-line overrides that put every stage in `label`'s modes (mix: the config's own)."""
    if label not in MODES:
        raise ValueError(f"--modes entry {label!r}: use some of {', '.join(MODES)} (comma-separated)")
    if label == "mix":
        return []  # the config's defaults are the seed's mix; the record checks the modes that ran
    return [f"ps@pipeline.stages.{s}.ps={m}" for s, m in MODES[label].items()]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


class LoadSampler:
    """The 1-minute load average every `every_s` seconds in a thread, until stop()."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s, self.samples = every_s, [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(os.getloadavg()[0])

    def start(self) -> LoadSampler:
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(timeout=2 * self.every_s)
        s = self.samples + [os.getloadavg()[0]]
        return {"min": round(min(s), 2), "mean": round(sum(s) / len(s), 2), "max": round(max(s), 2)}


def world_overrides(args: argparse.Namespace) -> list[str]:
    out = [f"pipeline.world.users={args.users}", f"pipeline.world.items={args.items}"]
    if args.creators:
        out.append(f"pipeline.world.creators={args.creators}")
    if args.world_root:  # else the config's folder (datasets/generated/, named by the world's sizes)
        name = f"funnel_world-u{args.users}-i{args.items}{'-quick' if args.quick else ''}"
        out.append(f"pipeline.world.dir={Path(args.world_root) / name}")
    return out


def run_one(label: str, overrides: list[str], run_dir: Path, timeout_s: float) -> dict[str, Any]:
    """`python -m recps.train pipeline=video_funnel <overrides>` into run_dir; its metrics.json and the run's facts."""
    command = [sys.executable, "-m", "recps.train", "pipeline=video_funnel", *overrides, f"hydra.run.dir={run_dir}"]
    load = LoadSampler().start()
    try:
        _, processes, wall = run_monitored(command, ROOT, f"funnel {label}", timeout_s)
    finally:
        loads = load.stop()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    trained = metrics["stages_trained"]
    modes = {s: trained[s]["mode"] for s in metrics["stage_order"]}
    if label in MODES and modes != MODES[label]:
        raise RuntimeError(f"funnel {label}: the stages ran in {modes}, not {MODES[label]}; "
                           "conf/pipeline/video_funnel.yaml's defaults changed: update benchmarks.funnel_bench.MODES")
    stages = {}
    for s in metrics["stage_order"]:
        t, m = trained[s], metrics["stages"][s]
        stages[s] = {"mode": t["mode"], "keep": m["keep"], "train_s": round(t["seconds"], 2),
                     "prepare_s": round(t.get("prepare_seconds", 0.0), 2), "steps": t["steps"],
                     "examples": t["examples"], "train_rows": t["train_rows"],
                     "examples_per_sec": round(t["examples_per_sec"], 1),
                     **({"index_s": round(t["index_seconds"], 2)} if "index_seconds" in t else {}),
                     **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items() if k != "keep"}}
    r4 = lambda d: {k: round(v, 4) for k, v in d.items()}  # noqa: E731
    return {"label": label, "stage_order": metrics["stage_order"], "modes": modes, "command": "python -m recps.train pipeline=video_funnel "
            + " ".join(o for o in overrides if not o.startswith("pipeline.world.dir=")),
            "wall_s": round(wall, 1), "load": loads,
            "train_s": round(sum(v["train_s"] for v in stages.values()), 1),
            "prepare_s": round(sum(v["prepare_s"] for v in stages.values()), 1),
            "eval_s": round(metrics.get("eval_seconds", 0.0), 1), "stages": stages,
            "funnel": r4(metrics["funnel"]), "baselines": {k: r4(v) for k, v in metrics["baselines"].items()},
            "requests": metrics["requests"], "positives": metrics["positives"],
            "workers": metrics["workers"], "servers": metrics["servers"],
            "peak_rss_mib": max((p["peak_rss_mib"] for p in processes), default=None)}


def serve(run_dir: Path, data, latency_users: int, batch: int, recall_users: int) -> dict[str, Any]:
    """Serving figures of a trained run (see the module docstring), with one torch thread."""
    import numpy as np
    import torch

    from recps.pipeline.ann import recall_at_k
    from recps.pipeline.recommend import latency, load_funnel

    torch.set_num_threads(1)  # a serving process per core; the funnel's faiss index has its config's threads
    t = time.perf_counter()
    funnel = load_funnel(run_dir, data=data)
    load_s = time.perf_counter() - t
    users = data.test_users[: latency_users]
    load = LoadSampler().start()
    timing = latency(funnel, users, batch=batch)
    loads = load.stop()
    first = funnel.specs[0]
    keep = first.keep
    probe = data.test_users[: recall_users]
    queries = funnel.stages[first.name].vectors(data, users=probe).numpy().astype(np.float32)  # (R, E)
    seen = funnel.seen_of(probe)
    found = funnel.index.search(queries, keep, exclude=seen)[0]  # (R, keep)
    t = time.perf_counter()
    truth = funnel.index.search(queries, keep, exclude=seen, exact=True)[0]  # (R, keep)
    exact_s = time.perf_counter() - t
    r2 = lambda x: round(float(x), 2)  # noqa: E731
    return {"load_funnel_s": r2(load_s), "users": timing["users"], "batch": batch, "load": loads,
            "request_p50_ms": r2(timing["request_ms"]["p50"]), "request_p99_ms": r2(timing["request_ms"]["p99"]),
            "stages_ms": {s: {k: r2(v) for k, v in q.items()} for s, q in timing["stages_ms"].items()},
            "users_per_s": round(timing["users_per_sec_batched"], 1),
            "index": {"kind": funnel.index.kind, "items": len(funnel.index), "k": keep,
                      "nlist": getattr(funnel.index._index, "nlist", None), "threads": funnel.index.config.threads},
            "ann_recall": round(recall_at_k(found, truth), 4), "recall_users": int(probe.numel()),
            "exact_search_s": r2(exact_s)}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from recps.config import compose_config
    from recps.pipeline.runner import load_world

    labels = [m.strip() for m in args.modes.split(",") if m.strip()]
    for label in labels:
        mode_overrides(label)  # a bad entry fails before anything runs
    base = [*(QUICK if args.quick else []), *world_overrides(args)]
    world = compose_config(["pipeline=video_funnel", *base, *args.set]).pipeline.world
    # The world's held-out random bucket (where the config has one) must be <= a quarter of the catalogue:
    # at a small --items the bench lowers it to that, unless --set names it.
    bucket = world.get("random_items_per_user")
    if bucket is not None and bucket > args.items // 4 and not any("random_items_per_user" in x for x in args.set):
        base.append(f"pipeline.world.random_items_per_user={args.items // 4}")
    base += args.set
    t = time.perf_counter()
    data = load_world(compose_config(["pipeline=video_funnel", *base]))  # generated once, here; the runs read it
    world_s = time.perf_counter() - t
    commit = args.commit or _git("rev-parse", "--short", "HEAD")
    dirty = "" if args.commit else _git("status", "--porcelain", "--", "recps", "conf", "models")
    records = []
    for i, label in enumerate(labels):
        with tempfile.TemporaryDirectory(prefix=f"recps-funnel-{label}-", dir=args.tmp) as tmp:
            run_dir = Path(tmp) / "run"
            load_before = [round(x, 2) for x in os.getloadavg()]
            record: dict[str, Any] = {
                "bench": "funnel", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "commit": commit, "dirty": [line[3:] for line in dirty.splitlines()], "cpu": cpu_model(), "cores": os.cpu_count(),
                "users": args.users, "items": args.items, "quick": bool(args.quick), "world_s": round(world_s, 1),
                "load_before": load_before}
            record.update(run_one(label, [*base, *mode_overrides(label)], run_dir, args.timeout))
            if args.serve == "all" or (args.serve == "first" and i == 0):
                record["serving"] = serve(run_dir, data, args.latency_users, args.batch, args.recall_users)
            record["load_after"] = [round(x, 2) for x in os.getloadavg()]
        append_jsonl(args.out, record)
        records.append(record)
    return records


# ------------------------------------------------------------------------------------------ the report


def _size(r: dict[str, Any]) -> str:
    return f"{r['users']:,} users x {r['items']:,} items"


def _met(ok: bool) -> str:
    return "**yes**" if ok else "**no**"


def markdown(records: list[dict[str, Any]]) -> str:
    """RESULTS.md's tables: per served run its stages, metrics and serving; then the mode-per-stage table."""
    out: list[str] = []
    for r in records:
        if "serving" not in r:
            continue
        modes = ", ".join(f"{s} {r['modes'][s]}" for s in r["stage_order"])
        out.append(f"#### {_size(r)}, {r['label']} ({modes}), "
                   f"commit {r['commit']}"
                   f"{' + uncommitted ' + ', '.join(r['dirty']) if r['dirty'] else ''}, {r['date']}\n")
        order = r["stage_order"]
        out.append(f"`{r['command']}`: wall {r['wall_s']} s (training {r['train_s']} s, building the rankers' "
                   f"training data {r['prepare_s']} s, evaluation {r['eval_s']} s; world generated beforehand in "
                   f"{r['world_s']} s), {r['servers']} server x {r['workers']} worker, peak RSS "
                   f"{r['peak_rss_mib']:,.0f} MiB, load {r['load']['min']}-{r['load']['max']} (mean {r['load']['mean']}).\n")
        out.append("| stage | mode | keep | trained: s | steps | examples | examples/s | data prep s | pass-through "
                   "(hits) | recall@K / ndcg@K | AUC / GAUC / PNR |\n|" + "---|" * 11)
        for s in order:
            v = r["stages"][s]
            k = v["keep"]
            rec = f"{v[f'recall@{k}']} / {v[f'ndcg@{k}']}" if f"recall@{k}" in v else "-"
            rank = f"{v['auc']} / {v['gauc']} / {v['pnr']}" if "auc" in v else "-"
            extra = f" (+ index {v['index_s']} s)" if "index_s" in v else ""
            out.append(f"| {s} | {v['mode']} | {k:,} | {v['train_s']}{extra} | {v['steps']:,} | {v['examples']:,} | "
                       f"{v['examples_per_sec']:,.0f} | {v['prepare_s']} | {v['pass_through']} ({v['hits']:.0f}) | "
                       f"{rec} | {rank} |")
        out.append(f"\nThe final list against the baselines ({r['requests']:,} held-out requests, "
                   f"{r['positives']:,.0f} positives; funnel hit rate {r['funnel']['hit_rate']}, agreement "
                   f"{r['funnel'].get('agreement', '-')}):\n")
        keys = [k for k in r["funnel"] if k.endswith("@10")]
        out.append("| list | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1))
        lists = ["most_popular", "recall_alone", *sorted(set(r["baselines"]) - {"most_popular", "recall_alone", "ideal"}),
                 "ideal"]
        for name, values in [("funnel", r["funnel"]), *((b, r["baselines"][b]) for b in lists if b in r["baselines"])]:
            out.append(f"| {name} | " + " | ".join(str(values.get(k, "-")) for k in keys) + " |")
        sv = r["serving"]
        stage_ms = ", ".join(f"{s} {sv['stages_ms'][s]['p50']} / {sv['stages_ms'][s]['p99']}" for s in order)
        ix = sv["index"]
        out.append(f"\nServing (load_funnel + recps.pipeline.recommend.latency, 1 torch thread, index {ix['kind']}"
                   f"{' nlist ' + str(ix['nlist']) if ix['nlist'] else ''} over {ix['items']:,} items, faiss threads "
                   f"{ix['threads']}; {sv['users']} held-out users one at a time, batches of {sv['batch']}; load "
                   f"{sv['load']['min']}-{sv['load']['max']}):\n")
        out.append("| target (issue 16) | measured | met |\n|---|---|---|")
        out.append(f"| p99 <= {TARGETS['p99_ms']:g} ms per user | p50 {sv['request_p50_ms']} ms, p99 "
                   f"{sv['request_p99_ms']} ms ({stage_ms} ms p50 / p99) | "
                   f"{_met(sv['request_p99_ms'] <= TARGETS['p99_ms'])} |")
        out.append(f"| >= {TARGETS['users_per_s']:g} users/s batched | {sv['users_per_s']:,.0f} users/s | "
                   f"{_met(sv['users_per_s'] >= TARGETS['users_per_s'])} |")
        out.append(f"| ANN recall@{ix['k']:,} >= {TARGETS['ann_recall']} vs exact | {sv['ann_recall']} "
                   f"({sv['recall_users']} users, seen items excluded) | {_met(sv['ann_recall'] >= TARGETS['ann_recall'])} |\n")
    table = [r for r in records if not r.get("quick")] or records
    out.append("| size | run | recall / coarse / fine / fusion | training s (recall / coarse / fine / fusion) | "
               "wall s | NDCG@10 | HR@10 | utility NDCG@10 | commit | load min-max |\n|" + "---|" * 10)
    for r in table:
        st = {s: r["stages"][s] for s in r["stage_order"]}
        out.append(f"| {_size(r)} | {r['label']} | {' / '.join(v['mode'] for v in st.values())} | {r['train_s']} ("
                   f"{' / '.join(str(v['train_s']) for v in st.values())}) | {r['wall_s']} | {r['funnel']['ndcg@10']} | "
                   f"{r['funnel']['hr@10']} | {r['funnel'].get('utility_ndcg@10', '-')} | {r['commit']} | "
                   f"{r['load']['min']}-{r['load']['max']} |")
    return "\n".join(out)


def funnel_figure(record: dict[str, Any]):
    """The funnel of one run (a matplotlib Figure): candidates kept (log scale) and held-out positives
    surviving at each stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = record["stage_order"]
    names = ["catalogue", *order]
    kept = [record["items"], *(record["stages"][s]["keep"] for s in order)]
    positives = [record["positives"], *(record["stages"][s]["hits"] for s in order)]
    share = [p / record["positives"] for p in positives]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    x = range(len(names))
    left.bar(x, kept, color="#4c72b0")
    left.set_yscale("log")
    left.set_title("candidates kept per user")
    for i, k in enumerate(kept):
        left.annotate(f"{k:,}", (i, k), ha="center", va="bottom", fontsize=8)
    right.bar(x, share, color="#dd8452")
    chance = [k / record["items"] for k in kept]  # the share a random pick of the same size would keep
    right.scatter(list(x), chance, marker="_", s=500, color="black", zorder=3, label="a random pick of that size")
    right.legend(loc="upper right", fontsize=8, frameon=False)
    right.set_title("held-out positives surviving (share, log)")
    right.set_yscale("log")  # at 10^6 items the later stages hold 10^-5 of the positives
    right.set_ylim(min(v for v in share + chance if v > 0) / 3, 30.0)
    for i, (p, s) in enumerate(zip(positives, share)):
        right.annotate(f"{p:,.0f}\n({100 * s:.3g}%)", (i, max(s, chance[i])), ha="center", va="bottom", fontsize=8)
    for ax in (left, right):
        ax.set_xticks(list(x), names)
        ax.spines[["top", "right"]].set_visible(False)
    fig.suptitle(f"video_funnel, {_size(record)} ({record['label']}; final NDCG@10 {record['funnel']['ndcg@10']}, "
                 f"{record['requests']:,} held-out requests)", fontsize=9)
    fig.tight_layout()
    return fig


def funnel_svg(record: dict[str, Any]) -> bytes:
    """funnel_figure as SVG bytes (no date, stable ids: the file changes only with its numbers)."""
    import matplotlib.pyplot as plt

    fig = funnel_figure(record)
    buf = io.BytesIO()
    with plt.rc_context({"svg.hashsalt": "recps-funnel", "svg.fonttype": "none"}):  # text as text
        fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    return buf.getvalue()


def _write_svg(records: list[dict[str, Any]], url: str) -> None:
    served = [r for r in records if "serving" in r] or records
    if not served:
        raise ValueError(f"--svg {url}: no funnel record to draw")
    rfs.write_atomic(url, funnel_svg(served[0]), overwrite=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--users", type=int, default=2000, help="the config's default: 2,000")
    p.add_argument("--creators", type=int, default=0, help="0: the config's (2,500); must be <= --items")
    p.add_argument("--modes", default="mix", help=f"comma-separated runs, of {', '.join(MODES)}")
    p.add_argument("--serve", choices=("first", "all", "none"), default="first",
                   help="measure serving latency and ANN recall on the first run, every run, or none")
    p.add_argument("--latency-users", type=int, default=300)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--recall-users", type=int, default=100)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another override for every run")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds a run may take before it is stopped")
    p.add_argument("--commit", default=None,
                   help="the commit measured, when this checkout is a clean export of it (`git archive`), not a git tree")
    p.add_argument("--world-root", default=None, help="where the world is generated (default: the config's folder)")
    p.add_argument("--tmp", default=None, help="where run folders go (deleted after each run)")
    p.add_argument("--quick", action="store_true", help="100 users x 500 items, keep 100 -> 30 -> 15 -> 10, 1-2 epochs")
    p.add_argument("--out", default=None, help="JSON lines to append to (default benchmarks/results/funnel_bench_<date>.jsonl)")
    p.add_argument("--svg", default=None, help="draw the first served run's funnel here (e.g. docs/funnel.svg)")
    p.add_argument("--markdown", default=None, metavar="JSONL", help="print the RESULTS.md tables of these records and exit")
    args = p.parse_args(argv)
    if args.markdown:
        records = [json.loads(x) for x in rfs.read_bytes(args.markdown).decode().splitlines() if x.strip()]
        if args.svg:
            _write_svg(records, args.svg)
        print(markdown(records))
        return 0
    if args.quick:
        args.users, args.items, args.creators = 100, 500, 50
        args.latency_users, args.recall_users = min(args.latency_users, 50), min(args.recall_users, 50)
    args.out = args.out or str(Path(__file__).parent / "results" / f"funnel_bench_{datetime.date.today().isoformat()}.jsonl")
    records = run(args)
    if args.svg:
        _write_svg(records, args.svg)
    print(markdown(records))  # entry point: the tables a user reads
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
