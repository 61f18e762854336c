"""Word2Vec: recps (GEO 1 server + 2 workers, and local) against gensim on the same corpus.

    python -m benchmarks.word2vec_bench [--epochs 5] [--repeat 2] [--systems gensim1,gensim2,local,geo,geo_1t]
                                        [--corpus wiki|zipf] [--no-equal-spearman]
                                        [--out benchmarks/results/word2vec.json]

Corpus: the Wikipedia excerpt of ../shared/data/word2vec_text (read by recps.data.text: markup
stripped, min_count 5; 414k tokens, 8.6k words), or the generated Zipf corpus when the excerpt
is absent (or with --corpus zipf). Both systems train on the same token ids: gensim gets the
recps corpus decoded back to words (documents cut at gensim's 10,000-token limit) with
min_count=1, so its vocabulary is recps'. Same settings: skip-gram, negative sampling with
5 negatives, window 5 (reduced windows), dimension 100, subsampling 1e-3, unigram^0.75, the
same epochs; gensim with `workers` = 1 or 2 and its default learning rate (0.025 -> 0.0001),
recps with its defaults (row-wise Adagrad 0.05, 64 negatives drawn per batch of 4096 tokens
and shared by its pairs, see recps.tasks.skipgram), local with 2 Hogwild threads, GEO with
1 server + 2 workers x 2 threads ("geo") and x 1 thread ("geo_1t"; the delta syncs run on
the GEO communicator's own thread either way), a delta sync every `--k-steps` (20)
worker steps, the workers' deltas summed (ps.delta_scale=1.0: each worker trains its own
share of the corpus; averaging them measured worse).

Each run is a fresh process (recps: the real CLI, `python -m recps.train`; gensim: a child of
this module). Figures per run:
- words/s: raw corpus words trained (epochs x tokens, before subsampling: gensim's "raw
  words") / training wall time (vocabulary and start-up excluded, for both);
- words per CPU-second: the same words / the CPU time of every process during training
  (gensim: its process; local: the process; GEO: workers' training loops + servers from start
  to stop). The machine is shared, so this is the steadier figure;
- WordSim-353 Spearman and analogy accuracy (covered subsets), by recps.tasks.skipgram's
  evaluation for both systems (gensim's vectors are evaluated by the same code);
- peak RSS of every process (benchmarks.procmon);
- at equal Spearman (with gensim2 in the systems): each system against gensim with 2 workers
  in the same round. The target is the lower of the two runs' final WordSim-353 Spearman; each
  system's time to target is the training time up to the end of its first pass whose Spearman
  reaches it. gensim and recps local evaluate after every pass (the evaluation is not timed;
  gensim by an epoch-end callback, during which its workers are idle); a GEO run evaluates only
  at its end, so GEO's passes come from runs of 1, 2, ... passes (stopped at the first that
  reaches the target). "Equal-Spearman words/s" = the raw words gensim 2 workers needed to reach
  the target / the system's time to reach it (gensim's own rate for gensim), and the ratio of
  the two times says how much faster than gensim a system gets there.
Every configuration runs `--repeat` times (round by round); the table shows each run and the
median. Writes JSON (--out) and prints a Markdown section; `run_suite` is the slot of
`python -m benchmarks.run --preset full`.

gensim is a benchmark-only dependency (requirements/bench.txt).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from benchmarks.procmon import run_monitored

__all__ = ["SYSTEMS", "run_system", "run_suite", "equal_spearman", "first_reaching", "markdown", "main"]

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("gensim1", "gensim2", "local", "geo", "geo_1t")
LABELS = {"gensim1": ("gensim", "1 worker"), "gensim2": ("gensim", "2 workers"),
          "local": ("recps ps=local", "1 process x 2 threads"), "geo": ("recps ps=geo", "1 server + 2 workers x 2 threads"),
          "geo_1t": ("recps ps=geo", "1 server + 2 workers x 1 thread")}
# Reference figures of issue 7 on this kind of machine, words/s: gensim (1 and 2 workers), PaddleRec 2.6.2.
REFERENCE = {"gensim 1 worker": (100_000, 100_000), "gensim 2 workers": (140_000, 180_000),
             "PaddleRec local": (9_000, 9_000), "PaddleRec GEO 1S+2W": (10_000, 10_000)}
SETTINGS = dict(window=5, negatives=5, dim=100, sample=1e-3, min_count=5, batch=4096)
GENSIM_MAX_LEN = 10_000  # gensim's longest sentence (longer ones are cut)
RUN_TIMEOUT_S = 600


def corpus_overrides(corpus: str) -> list[str]:
    """Dataset overrides of `recps.train` for the corpus: the Wikipedia excerpt (conf default) or
    the generated Zipf corpus (a missing train file makes prepare_text generate it)."""
    if corpus == "wiki":
        return []
    if corpus == "zipf":
        return ["dataset.train=[/nonexistent/word2vec_bench/use-the-zipf-corpus]"]
    raise ValueError(f"--corpus {corpus!r}: use wiki or zipf")


def pick_corpus(corpus: str) -> str:
    if corpus != "auto":
        return corpus
    from recps.config import compose_config

    cfg = compose_config(["model=word2vec"])
    return "wiki" if all(os.path.isfile(p) for p in cfg.dataset.train) else "zipf"


def recps_overrides(system: str, epochs: int, seed: int, corpus: str, k_steps: int) -> list[str]:
    s = SETTINGS
    common = ["model=word2vec", f"model.embedding_dim={s['dim']}", f"task.window={s['window']}",
              f"task.negatives={s['negatives']}", f"task.subsample={s['sample']}", f"dataset.min_count={s['min_count']}",
              f"trainer.batch_size={s['batch']}", f"trainer.epochs={epochs}", f"seed={seed}", "checkpoint.save=false",
              "progress=false", *corpus_overrides(corpus)]
    if system == "local":
        return [*common, "ps=local", "trainer.threads=2"]
    if system in ("geo", "geo_1t"):
        threads = 2 if system == "geo" else 1
        return [*common, "ps=geo", "cluster.servers=1", "cluster.workers=2", f"trainer.threads={threads}",
                f"ps.k_steps={k_steps}", "ps.delta_scale=1.0"]
    raise ValueError(f"system {system!r} is not a recps system (local, geo, geo_1t)")


def run_system(system: str, epochs: int, seed: int = 0, corpus: str = "wiki", k_steps: int = 20,
               timeout_s: float = RUN_TIMEOUT_S) -> dict[str, Any]:
    """One run of `system` in fresh processes; its figures (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="recps-w2v-bench-") as tmp:
        if system.startswith("gensim"):
            workers = int(system[len("gensim"):])
            spec = {"workers": workers, "epochs": epochs, "seed": seed, "corpus": corpus}
            command = [sys.executable, "-m", "benchmarks.word2vec_bench", "--gensim-child", json.dumps(spec)]
        elif system == "local":
            command = [sys.executable, "-m", "benchmarks.word2vec_bench", "--local-child",
                       json.dumps(recps_overrides(system, epochs, seed, corpus, k_steps))]
        else:
            command = [sys.executable, "-m", "recps.train", *recps_overrides(system, epochs, seed, corpus, k_steps),
                       f"hydra.run.dir={tmp}"]
        load_before = os.getloadavg()[0]
        stdout, processes, wall = run_monitored(command, ROOT, f"word2vec bench {system}", timeout_s)
        if system.startswith("geo"):
            m = json.loads((Path(tmp) / "metrics.json").read_text())
            # recps.cluster leaves server_cpu_seconds out when a server's CPU file is missing
            cpu = m["worker_cpu_seconds"] + m.get("server_cpu_seconds", float("nan"))
            figures = dict(words=m["train_examples"], seconds=m["train_seconds"], cpu_seconds=cpu,
                           words_per_sec=m["examples_per_sec"], spearman=m["wordsim353_spearman"],
                           analogy=m["analogy_accuracy"], pairs=m["wordsim353_pairs"],
                           questions=m["analogy_questions"], k_steps=m.get("k_steps"))
            figures["curve"] = [dict(epoch=epochs, seconds=figures["seconds"], words=figures["words"],
                                     spearman=figures["spearman"])]  # one evaluation, at the end
        else:
            figures = json.loads(stdout.strip().splitlines()[-1])
    figures["words_per_cpu_second"] = figures["words"] / figures["cpu_seconds"]
    return {"system": system, "epochs": epochs, "seed": seed, "corpus": corpus, **figures,
            "wall_s": round(wall, 1), "load_1min_before": round(load_before, 2),
            "load_1min_after": round(os.getloadavg()[0], 2), "processes": processes,
            "peak_rss_mib": max((p["peak_rss_mib"] for p in processes), default=None)}


# ----------------------------------------------------------------------------------- children


def _text_data(corpus: str, seed: int):
    from recps.config import compose_config
    from recps.job.build import prepare_dataset

    cfg = compose_config(["model=word2vec", f"dataset.min_count={SETTINGS['min_count']}", *corpus_overrides(corpus)])
    return prepare_dataset(cfg.dataset, seed=seed)


def gensim_child(spec: dict[str, Any]) -> dict[str, Any]:
    """gensim Word2Vec on recps' corpus; evaluated by recps' evaluation code."""
    import numpy as np
    import torch
    from gensim.models import Word2Vec as GensimWord2Vec
    from gensim.models.callbacks import CallbackAny2Vec

    from recps.tasks.skipgram import SkipGramTask

    data = _text_data(spec["corpus"], spec["seed"])
    words = data.vocabulary.words
    tokens, offsets = data.corpus.tokens.numpy(), data.corpus.offsets.numpy()
    sentences = []
    for d in range(data.corpus.num_documents):  # a loop per document, once, outside the timing
        doc = words[tokens[offsets[d]:offsets[d + 1]]].tolist()
        sentences += [doc[i:i + GENSIM_MAX_LEN] for i in range(0, len(doc), GENSIM_MAX_LEN)]
    s = SETTINGS
    model = GensimWord2Vec(vector_size=s["dim"], window=s["window"], negative=s["negatives"], sample=s["sample"],
                           min_count=1, sg=1, hs=0, workers=int(spec["workers"]), seed=int(spec["seed"]) + 1)
    model.build_vocab(sentences)
    epochs = int(spec["epochs"])
    task, tokens = SkipGramTask(), data.corpus.num_tokens
    clock = {"start": 0.0, "cpu": 0.0, "paused": 0.0, "paused_cpu": 0.0}
    curve: list[dict[str, Any]] = []

    def evaluate() -> dict[str, Any]:
        vectors = np.stack([model.wv[w] for w in words])  # recps' vocabulary order
        return task.evaluate_vectors(torch.from_numpy(vectors), data.test)

    class PassEnd(CallbackAny2Vec):
        """Evaluates after every pass; its time (gensim's workers are idle) is not training."""

        def on_epoch_end(self, _model) -> None:
            wall, cpu = time.perf_counter(), time.process_time()
            seconds = wall - clock["start"] - clock["paused"]
            m = evaluate()
            curve.append(dict(epoch=len(curve) + 1, seconds=seconds, words=(len(curve) + 1) * tokens,
                              spearman=m["wordsim353_spearman"]))
            clock["paused"] += time.perf_counter() - wall
            clock["paused_cpu"] += time.process_time() - cpu

    clock["cpu"], clock["start"] = time.process_time(), time.perf_counter()
    model.train(sentences, total_examples=len(sentences), epochs=epochs, callbacks=[PassEnd()])
    seconds = time.perf_counter() - clock["start"] - clock["paused"]
    cpu = time.process_time() - clock["cpu"] - clock["paused_cpu"]
    metrics = evaluate()
    raw = epochs * tokens
    return dict(words=raw, seconds=seconds, cpu_seconds=cpu, words_per_sec=raw / seconds,
                spearman=metrics["wordsim353_spearman"], analogy=metrics["analogy_accuracy"],
                pairs=metrics["wordsim353_pairs"], questions=metrics["analogy_questions"],
                vocabulary=len(words), tokens=tokens, curve=curve)


def local_child(overrides: list[str]) -> dict[str, Any]:
    """recps ps=local: the job `python -m recps.train` builds, its training loop timed (wall, CPU)."""
    from recps.config import compose_config
    from recps.job.build import build_job
    from recps.job.run import evaluate

    cfg = compose_config(overrides)
    job = build_job(cfg)
    words, seconds, cpu, curve = 0, 0.0, 0.0, []
    for epoch in range(int(cfg.trainer.epochs)):  # pass by pass, evaluated after each (not timed)
        start = time.process_time()
        stats = job.trainer.fit(job.data.train, int(cfg.trainer.batch_size), epochs=1, first_epoch=epoch,
                                progress=False)
        cpu += time.process_time() - start
        words, seconds = words + stats.examples, seconds + stats.seconds
        m = evaluate(job)
        curve.append(dict(epoch=epoch + 1, seconds=seconds, words=words, spearman=m["wordsim353_spearman"]))
    return dict(words=words, seconds=seconds, cpu_seconds=cpu, words_per_sec=words / seconds,
                spearman=m["wordsim353_spearman"], analogy=m["analogy_accuracy"], pairs=m["wordsim353_pairs"],
                questions=m["analogy_questions"], vocabulary=len(job.data.vocabulary),
                tokens=job.data.corpus.num_tokens, curve=curve)


# ----------------------------------------------------------------------------------- the suite


def run_all(systems: Sequence[str], epochs: int, repeat: int, corpus: str, k_steps: int,
            log=print) -> list[dict[str, Any]]:
    results = []
    for rnd in range(repeat):  # round by round: a slow phase of the machine hits every system alike
        for system in systems:
            r = run_system(system, epochs, seed=rnd, corpus=corpus, k_steps=k_steps)
            r["round"] = rnd
            log(json.dumps({k: v for k, v in r.items() if k != "processes"}))
            results.append(r)
    return results


def first_reaching(curve: Sequence[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first pass of `curve` (points {epoch, seconds, words, spearman}) whose Spearman
    reaches `target`; None if none does."""
    return next((p for p in sorted(curve, key=lambda p: p["epoch"]) if p["spearman"] >= target), None)


def equal_spearman(results: list[dict[str, Any]], k_steps: int, run=None, log=print) -> list[dict[str, Any]]:
    """Adds r["equal_spearman"] to every result of a round that has a gensim2 run (see the
    module docstring) and returns those rows. A GEO system's earlier passes come from shorter
    runs (`run`, default run_system), stopped at the first that reaches the target."""
    run = run_system if run is None else run
    rows = []
    for rnd in sorted({r.get("round", 0) for r in results}):
        in_round = [r for r in results if r.get("round", 0) == rnd]
        ref = next((r for r in in_round if r["system"] == "gensim2"), None)
        if ref is None:
            continue
        for r in in_round:
            target = min(ref["spearman"], r["spearman"])
            curve = list(r["curve"])
            if r["system"].startswith("geo"):
                for epochs in range(1, r["epochs"]):
                    short = run(r["system"], epochs, seed=r["seed"], corpus=r["corpus"], k_steps=k_steps)
                    log(json.dumps({"system": r["system"], "round": rnd, "ladder_epochs": epochs,
                                    "seconds": short["seconds"], "spearman": short["spearman"], "target": target}))
                    curve += short["curve"]
                    if short["spearman"] >= target:
                        break
            point, ref_point = first_reaching(curve, target), first_reaching(ref["curve"], target)
            row = dict(system=r["system"], round=rnd, target=target, epoch=point["epoch"], seconds=point["seconds"],
                       spearman=point["spearman"], gensim_epoch=ref_point["epoch"],
                       gensim_seconds=ref_point["seconds"], words_per_sec=ref_point["words"] / point["seconds"],
                       ratio=ref_point["seconds"] / point["seconds"], curve=sorted(curve, key=lambda p: p["epoch"]))
            r["equal_spearman"] = row
            rows.append(row)
    return rows


def _fmt(values: list[float], digits: int = 0) -> str:
    runs = " / ".join(f"{v:,.{digits}f}" for v in values)
    return f"{runs} (median **{statistics.median(values):,.{digits}f}**)" if len(values) > 1 else f"**{runs}**"


def markdown(results: list[dict[str, Any]], command: str) -> str:
    """The RESULTS.md section: one row per system, every run and the median, ratios to gensim."""
    by: dict[str, list[dict]] = {}
    for r in results:
        by.setdefault(r["system"], []).append(r)
    med = {s: statistics.median(r["words_per_sec"] for r in rs) for s, rs in by.items()}
    cpu_med = {s: statistics.median(r["words_per_cpu_second"] for r in rs) for s, rs in by.items()}
    first = results[0]
    tokens = next((f"{r['tokens']:,}" for r in results if r.get("tokens")), "?")
    lines = [f"Command: `{command}`. Corpus: {first['corpus']} ({tokens} tokens x "
             f"{first['epochs']} epochs); settings {SETTINGS}; 1-minute load "
             f"{min(r['load_1min_before'] for r in results):.1f}-{max(r['load_1min_after'] for r in results):.1f}.", "",
             "| system | topology | words/s (runs, median) | / gensim 2 workers | words per CPU-s | "
             "/ gensim 2 workers | WordSim-353 Spearman | analogy accuracy | peak RSS, MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for system in [s for s in SYSTEMS if s in by]:
        rs = by[system]
        name, topo = LABELS[system]
        ratio = f"{med[system] / med['gensim2']:.2f}" if "gensim2" in med else "-"
        cpu_ratio = f"{cpu_med[system] / cpu_med['gensim2']:.2f}" if "gensim2" in cpu_med else "-"
        lines.append(f"| {name} | {topo} | {_fmt([r['words_per_sec'] for r in rs])} | {ratio} | "
                     f"{_fmt([r['words_per_cpu_second'] for r in rs])} | {cpu_ratio} | "
                     f"{_fmt([r['spearman'] for r in rs], 3)} | {_fmt([r['analogy'] for r in rs], 3)} | "
                     f"{max(r['peak_rss_mib'] or 0 for r in rs):,.0f} |")
    equal = {s: [r["equal_spearman"] for r in rs if r.get("equal_spearman")] for s, rs in by.items()}
    if any(equal.values()):
        lines += ["", "At equal Spearman: each run against gensim 2 workers' run of the same round; target = the "
                      "lower of the two final WordSim-353 Spearman; time to target = training time to the end of the "
                      "first pass that reaches it; equal-Spearman words/s = gensim 2 workers' raw words to the target "
                      "/ the system's time to it:", "",
                  "| system | topology | target Spearman | passes to target | seconds to target | "
                  "gensim 2 workers: passes, seconds | equal-Spearman words/s | / gensim 2 workers (time ratio) |",
                  "|---|---|---|---|---|---|---|---|"]
        for system in [s for s in SYSTEMS if equal.get(s)]:
            es = equal[system]
            name, topo = LABELS[system]
            gensim = " / ".join(f"{e['gensim_epoch']}, {e['gensim_seconds']:.1f}" for e in es)
            lines.append(f"| {name} | {topo} | {_fmt([e['target'] for e in es], 3)} | "
                         f"{' / '.join(str(e['epoch']) for e in es)} | {_fmt([e['seconds'] for e in es], 1)} | "
                         f"{gensim} | {_fmt([e['words_per_sec'] for e in es])} | {_fmt([e['ratio'] for e in es], 2)} |")
    lines += ["", "Against the issue's reference figures (words/s on this kind of machine; ratio = measured median "
                  "/ reference):", "", "| reference | words/s | recps GEO 1S+2Wx2T | recps local | gensim here |",
              "|---|---|---|---|---|"]
    for name, (low, high) in REFERENCE.items():
        ref = (low + high) / 2
        here = "gensim2" if "2 workers" in name else "gensim1" if "1 worker" in name else None
        cells = [f"{med[s] / ref:.2f}" if s in med else "-" for s in ("geo", "local")]  # geo: 2 workers x 2 threads
        gensim_here = f"{med[here] / ref:.2f}" if here in med else "-"
        lines.append(f"| {name} | {low:,}" + (f"-{high:,}" if high != low else "") + f" | {cells[0]} | {cells[1]} | "
                     f"{gensim_here} |")
    return "\n".join(lines)


def have_gensim() -> bool:
    return importlib.util.find_spec("gensim") is not None


NO_GENSIM = "gensim is not installed (a benchmark-only dependency): pip install -r requirements/bench.txt"


def run_suite(preset: str = "full", out_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The slot of `python -m benchmarks.run`: every system, 5 epochs, two rounds (quick: one);
    without gensim, the recps systems only, and the section says why."""
    repeat = 1 if preset in ("quick", "smoke") else 2
    epochs = 1 if preset == "smoke" else 5
    corpus = pick_corpus("auto")
    systems = [s for s in SYSTEMS if have_gensim() or not s.startswith("gensim")]
    command = (f"python -m benchmarks.word2vec_bench --epochs {epochs} --repeat {repeat} --corpus {corpus} "
               f"--systems {','.join(systems)}")
    results = run_all(systems, epochs, repeat, corpus, k_steps=20, log=lambda line: None)
    equal_spearman(results, k_steps=20, log=lambda line: None)
    text = markdown(results, command) + ("" if have_gensim() else f"\n\nNo gensim figures: {NO_GENSIM}.")
    out = {"results": results, "markdown": text}
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "word2vec.json").write_text(json.dumps(results, indent=1) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--corpus", default="auto", choices=("auto", "wiki", "zipf"))
    parser.add_argument("--k-steps", type=int, default=20, help="GEO: worker steps between delta syncs")
    parser.add_argument("--no-equal-spearman", action="store_true",
                        help="skip the equal-Spearman comparison (its shorter GEO runs)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "word2vec.json"))
    parser.add_argument("--gensim-child", help=argparse.SUPPRESS)
    parser.add_argument("--local-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gensim_child:
        print(json.dumps(gensim_child(json.loads(args.gensim_child))))
        return
    if args.local_child:
        print(json.dumps(local_child(json.loads(args.local_child))))
        return
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"--systems {unknown}: pick from {list(SYSTEMS)}")
    if any(s.startswith("gensim") for s in systems) and not have_gensim():
        parser.error(f"--systems {args.systems}: {NO_GENSIM} (or leave gensim1,gensim2 out)")
    corpus = pick_corpus(args.corpus)
    results = run_all(systems, args.epochs, args.repeat, corpus, args.k_steps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    if not args.no_equal_spearman:
        equal_spearman(results, args.k_steps)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    command = "python -m benchmarks.word2vec_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    print(markdown(results, command.strip()))


if __name__ == "__main__":
    main()
