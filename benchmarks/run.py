"""The benchmark suite: one command, a named matrix, results as JSON + Markdown + PNG.

    python -m benchmarks.run --quick                 # = --preset quick: < 5 min on a quiet 2-core machine
    python -m benchmarks.run --preset full           # < 45 min there: the figures committed in RESULTS.md
    python -m benchmarks.run --preset smoke --out /tmp/s --markdown /tmp/s/RESULTS.md --data-dir /tmp/s/data
    python -m benchmarks.run --preset full --dry-run # the matrix and its time estimate; runs nothing
    python -m benchmarks.run --report benchmarks/results/2026-11-29/full.json   # RESULTS.md + plots again
    python -m benchmarks.run --quick --world vocab=300,rows=100000,signal=1.5  # another generated world
                                                                               # for time-to-quality

A preset is a list of cases — model x mode x topology (servers x workers x threads) x batch size
on a generated Criteo-schema world — run `repeats` (2) times each, every run in fresh processes
(`benchmarks.ps_throughput.run_one`: `python -m recps.train` for the PS modes, one child process
for ps=local), the cases taking turns (all of round 1, then all of round 2). Per run: the
workers' examples/s, examples per CPU-second, held-out AUC, and the peak RSS of every process
(`benchmarks.procmon`). Two kinds of case:

- throughput: one pass over the reference world (vocabulary 10^6 a slot, as issues 2 and 4),
  training metrics off;
- quality (time to quality): training on a learnable world (`QUALITY_WORLD`, `--world`), with a held-out
  AUC every N steps (`benchmarks.quality.HeldOutAUC`, hooked in through `trainer.observers`);
  reports training seconds to the best reachable AUC - 0.01 (and - 0.02) and the AUC curve.

The full preset adds the scale benchmark (`benchmarks.scale_bench`: 100M keys, dim 8, row-wise
Adagrad over 2 server processes, 2 workers) and the Word2Vec-vs-gensim benchmark when
`benchmarks/word2vec_bench.py` exists (its `run_suite(preset=..., out_dir=...)`, see
`_word2vec`).

Writes <out>/<preset>.json (default out: benchmarks/results/<date>/), PNG plots next to it, and
regenerates the preset's block of RESULTS.md (between `<!-- BEGIN benchmarks.run preset=... -->`
and its END marker; the hand-written sections stay). Generated data goes under --data-dir
(default datasets/generated, git-ignored; shared by runs of the same world).
Exit status 1 when any run failed (the others still run and are reported).
"""

from __future__ import annotations

from recps import quiet_libraries
import argparse
import dataclasses
import datetime as dt
import importlib
import importlib.util
import json
import logging
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from benchmarks import report
from benchmarks.ps_throughput import ROOT, Topology, run_one
from benchmarks.quality import read_curve, time_to_quality

__all__ = ["Case", "Preset", "PRESETS", "QUALITY_WORLD", "case_overrides", "run_case", "run_preset", "estimate_s",
           "environment", "write_report", "main"]

log = logging.getLogger("benchmarks.run")

REFERENCE_VOCAB = 1_000_000  # issues 2 and 4: vocabulary 10^6 a slot


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration of the matrix.

    kind: "throughput" (one pass, metrics off) or "quality" (held-out AUC every `eval_every` steps).
    model: a conf/model name (ctr_dnn, deepfm ...). mode: local | sync | async | geo.
    topology: "1PxTT" (local) or "SS+WWxTT". world: vocab keys a slot, rows of training data,
    epochs over it, `generate` extra dataset.generate keys (e.g. signal, shares).
    num_embeddings: ps=local rows a table (0: `run_one`'s, = vocab). ps=local folds the 64-bit
    keys into that many rows with a modulo: vocab keys into vocab rows share rows (1 - 1/e, 63%,
    of the keys collide), which costs a quality world ~0.03 AUC; the PS modes store every key.
    """

    kind: str
    model: str
    mode: str
    topology: str
    batch: int = 512
    vocab: int = REFERENCE_VOCAB
    rows: int = 200_000
    epochs: int = 1
    test_rows: int | None = None
    evals: int = 20  # quality: held-out evaluations per run (sets eval_every)
    eval_rows: int = 0  # quality: held-out rows evaluated (0: the whole test split)
    k_steps: int = 100
    generate: tuple[tuple[str, Any], ...] = ()
    num_embeddings: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("throughput", "quality"):
            raise ValueError(f"case kind {self.kind!r}: use throughput or quality")
        Topology.parse(self.topology)

    @property
    def name(self) -> str:
        world = f"v{self.vocab}-n{self.rows}x{self.epochs}" + "".join(f"-{k}{v}" for k, v in self.generate)
        return f"{self.kind}/{self.model}/{self.mode}/{self.topology}/b{self.batch}/{world}"

    @property
    def eval_every(self) -> int:
        """Steps between evaluations in worker 0 (it counts its own threads' steps)."""
        topo = Topology.parse(self.topology)
        worker_steps = self.rows * self.epochs // (self.batch * topo.workers)
        return max(1, worker_steps // max(1, self.evals))


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    description: str
    cases: tuple[Case, ...]
    repeats: int = 2
    scale: dict | None = None  # benchmarks.scale_bench.run arguments
    word2vec: bool = False


def _throughput(model: str, pairs: Sequence[tuple[str, str]], **kw) -> list[Case]:
    return [Case("throughput", model, mode, topo, **kw) for mode, topo in pairs]


def _quality(model: str, pairs: Sequence[tuple[str, str]], **kw) -> list[Case]:
    return [Case("quality", model, mode, topo, **kw) for mode, topo in pairs]


_PS_1W2T = [("sync", "1S+1Wx2T"), ("async", "1S+1Wx2T"), ("geo", "1S+1Wx2T")]
# The time-to-quality world: one whose best reachable AUC - 0.01 CTR-DNN and DeepFM reach in every
# mode within one pass (--world changes it). Measured (notes in RESULTS.md, "Time to quality"):
# - the generator's planted pairwise term (C1xC2, C3xC4, rank 4) is not learnt by these models in
#   such a budget: with its default 10% of the logit's variance a first-order model's ceiling is
#   0.014-0.016 AUC below the best reachable (target out of reach by construction); with 40%, one
#   pass of 200k rows (vocab 50) recovers ~0.006 of the 0.063 it is worth (DeepFM as CTR-DNN;
#   larger factor init or row lr made DeepFM worse). So the world plants no pairwise term
#   (shares 0.9 sparse, 0.1 dense, 0 pairwise): its best reachable AUC is a first-order model's;
# - keys a slot: the reference world's 10^6 leave most keys unseen; 1,000 (the old world) need
#   far more rows than a short run holds; 30 keys a slot are learnt within ~100k rows;
# - ps=local gets 100,003 rows a table (conf/ps/local's default): run_one's ps.num_embeddings =
#   vocab folds 30 keys into 30 rows, 63% of them shared, and costs ~0.03 AUC (PS modes are exact);
# - 20,000 held-out rows: the best reachable AUC and the model's are read on the same rows, so the
#   noise of their difference is well under 0.01.
QUALITY_SHARES = (("shares", "[0.9,0.1,0.0]"),)
QUALITY_WORLD = {"vocab": 30, "rows": 150_000, "epochs": 1, "test_rows": 20_000, "evals": 8,
                 "generate": QUALITY_SHARES, "num_embeddings": 100_003}

PRESETS: dict[str, Preset] = {
    "smoke": Preset(
        "smoke", "CI: two configurations on tiny data, each twice (tests/benchmarks)",
        tuple(_throughput("ctr_dnn", [("local", "1Px2T")], batch=256, vocab=1000, rows=3000, test_rows=1000)
              + _quality("ctr_dnn", [("local", "1Px2T")], batch=256, vocab=1000, rows=3000, test_rows=1000,
                         epochs=1, evals=3)),
    ),
    "quick": Preset(
        "quick", "< 5 min: CTR-DNN throughput local / async / GEO, time to quality of CTR-DNN and DeepFM locally",
        tuple(_throughput("ctr_dnn", [("local", "1Px2T"), ("async", "1S+1Wx2T"), ("geo", "1S+1Wx2T")], rows=60_000)
              + _quality("ctr_dnn", [("local", "1Px2T")], **QUALITY_WORLD)
              + _quality("deepfm", [("local", "1Px2T")], **QUALITY_WORLD)),
    ),
    "full": Preset(
        "full", "< 45 min: the matrix, time to quality per mode, 100M-key scale, Word2Vec vs gensim "
                "(its time is not in the estimate: benchmarks/word2vec_bench.py sizes itself)",
        tuple(
            _throughput("ctr_dnn", [("local", "1Px1T"), ("local", "1Px2T"),
                                    ("sync", "1S+1Wx1T"), ("async", "1S+1Wx1T"), ("geo", "1S+1Wx1T"),
                                    *_PS_1W2T,
                                    ("sync", "1S+2Wx1T"), ("async", "1S+2Wx1T"), ("geo", "1S+2Wx1T"),
                                    ("async", "2S+2Wx1T")])
            + _throughput("ctr_dnn", [("local", "1Px2T"), ("async", "1S+1Wx2T")], batch=2048)
            + _throughput("deepfm", [("local", "1Px2T"), ("async", "1S+1Wx2T"), ("geo", "1S+1Wx2T")])
            + _quality("ctr_dnn", [("local", "1Px2T"), *_PS_1W2T], **QUALITY_WORLD)
            + _quality("deepfm", [("local", "1Px2T"), *_PS_1W2T], **QUALITY_WORLD)
        ),
        scale={"keys": 100_000_000, "dim": 8, "servers": 2, "workers": 2, "batch": 100_000,
               "build_batch": 1_000_000, "seconds": 15.0, "save": True},
        word2vec=True,
    ),
}


# ------------------------------------------------------------------------------------- estimate

# Seconds on a quiet machine of this kind (2 cores), from the figures in RESULTS.md: process
# start-up (torch + fbgemm + torchrec imports, data read), training rates, evaluation.
_START_S = {"local": 12.0, "ps": 22.0}
_RATE = {("ctr_dnn", "local"): 25_000, ("ctr_dnn", "ps"): 13_000, ("deepfm", "local"): 12_000, ("deepfm", "ps"): 8_000}


def estimate_s(case: Case) -> float:
    """A rough wall-time estimate of one run of `case` on a quiet 2-core machine."""
    kind = "local" if case.mode == "local" else "ps"
    rate = _RATE.get((case.model, kind), 8_000) * (0.6 if case.batch < 512 else 1.0)
    seconds = _START_S[kind] + case.rows * case.epochs / rate + (case.test_rows or max(case.rows // 10, 10000)) / 20_000
    if case.kind == "quality":
        seconds += case.evals * (case.eval_rows or case.test_rows or 10_000) / 20_000
    return seconds


def _scale_estimate_s(scale: dict) -> float:
    return 20 + scale["keys"] / 700_000 + 2 * scale["seconds"] + (scale["keys"] / 2_000_000 if scale.get("save") else 0)


# ------------------------------------------------------------------------------------- running


def run_case(case: Case, measurement: int, data_root: str | os.PathLike | None, work: Path) -> dict[str, Any]:
    """One run of `case` in fresh processes; the result row (throughput or quality)."""
    curve_path = work / f"curve-{case.name.replace('/', '_')}-{measurement}.jsonl" if case.kind == "quality" else None
    extra = case_overrides(case, curve_path)
    start = time.perf_counter()
    result = run_one(case.mode, case.topology, case.rows, case.vocab, seed=0, k_steps=case.k_steps, extra=extra,
                     model=case.model, batch=case.batch, epochs=case.epochs, data_root=_world_root(case, data_root),
                     test_rows=case.test_rows)
    row = {"case": case.name, "measurement": measurement, "kind": case.kind, "vocab": case.vocab, "rows": case.rows,
           "epochs": case.epochs, "generate": dict(case.generate), **result,
           "run_s": round(time.perf_counter() - start, 1)}
    if case.kind == "quality":
        curve = read_curve(curve_path)
        best = row.get("best_reachable_auc")
        row.update(curve=curve, eval_every=case.eval_every,
                   max_auc=max((p["auc"] for p in curve if p["auc"] is not None), default=None),
                   eval_share=round(curve[-1]["eval_s"] / curve[-1]["wall_s"], 3) if curve and curve[-1]["wall_s"] else None,
                   ttq_01=time_to_quality(curve, best - 0.01) if best else None,
                   ttq_02=time_to_quality(curve, best - 0.02) if best else None)
    return row


def case_overrides(case: Case, curve_path: Path | None) -> list[str]:
    """The `recps.train` overrides `run_case` adds to `run_one`'s: the world's generate keys, the
    local table rows, and (quality) the HeldOutAUC observer writing to `curve_path`."""
    extra = [f"++dataset.generate.{k}={v}" for k, v in case.generate]
    if case.mode == "local" and case.num_embeddings:
        extra.append(f"ps.num_embeddings={case.num_embeddings}")  # after run_one's (= vocab): the last one wins
    if case.kind == "quality":
        observer = (f"{{_target_:benchmarks.quality.HeldOutAUC,every_steps:{case.eval_every},"
                    f"path:'{curve_path}',rows:{case.eval_rows}}}")
        extra.append(f"++trainer.observers=[{observer}]")
    return extra


def _world_root(case: Case, data_root) -> Path | None:
    """Worlds with extra generate keys get their own folder (data_overrides names only seed, vocab, rows)."""
    if not case.generate:
        return Path(data_root) if data_root else None
    base = Path(data_root) if data_root else ROOT / "datasets" / "generated"
    return base / ("world-" + "-".join(f"{k}{_plain(v)}" for k, v in case.generate))


def _plain(value: Any) -> str:
    """A generate value as a folder-name part Hydra overrides can hold: "[0.9,0.1,0.0]" -> "0.9_0.1_0.0".

    >>> _plain("[0.9, 0.1, 0.0]"), _plain(1.5)
    ('0.9_0.1_0.0', '1.5')
    """
    return re.sub(r"[^0-9A-Za-z.]+", "_", str(value)).strip("_")


def environment() -> dict[str, Any]:
    """Machine, versions and commit: what RESULTS.md states about every run."""
    versions = {"python": platform.python_version()}
    for name in ("torch", "fbgemm_gpu", "torchrec", "numpy", "hydra", "zmq"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except Exception:  # noqa: BLE001 - a missing one is reported as such
            versions[name] = "missing"
    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = float("nan")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return {
        "machine": f"{platform.machine()} {cpu}, {os.cpu_count()} cores, {mem_gib:.0f} GiB, {platform.system()} {platform.release()}",
        "versions": ", ".join(f"{k} {v}" for k, v in versions.items()),
        "commit": f"{commit or 'unknown'}{' (with uncommitted changes)' if dirty else ''}",
        "load_before": list(os.getloadavg()),
    }


def _word2vec(preset: Preset, out_dir: Path) -> dict[str, Any] | None:
    """The Word2Vec-vs-gensim slot: benchmarks/word2vec_bench.py's `run_suite(preset=, out_dir=)`
    (a JSON-able dict; its "markdown" entry, if any, goes into RESULTS.md) when the module exists."""
    if not preset.word2vec or importlib.util.find_spec("benchmarks.word2vec_bench") is None:
        return None
    module = importlib.import_module("benchmarks.word2vec_bench")
    entry = getattr(module, "run_suite", None)
    if entry is None:
        return {"error": "benchmarks.word2vec_bench has no run_suite(preset=..., out_dir=...)"}
    try:
        result = entry(preset=preset.name, out_dir=out_dir)
    except Exception as exc:  # noqa: BLE001 - reported, the rest of the suite stands
        return {"error": f"{type(exc).__name__}: {exc}"}
    return result if isinstance(result, dict) and "markdown" in result else {"result": result}


def run_preset(preset: Preset, out_dir: Path, data_root: str | os.PathLike | None, markdown_path: Path | None,
               command: str) -> dict[str, Any]:
    """Runs every case `repeats` times (round by round), the scale and Word2Vec parts; writes
    <out_dir>/<preset>.json, the plots and the RESULTS.md block; returns the results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "preset": preset.name, "description": preset.description, "command": command,
        "started": dt.datetime.now().isoformat(timespec="seconds"), "repeats": preset.repeats,
        "environment": environment(), "throughput": [], "quality": [], "failures": [],
    }
    start = time.perf_counter()
    total = len(preset.cases) * preset.repeats
    with tempfile.TemporaryDirectory(prefix="recps-bench-") as work:
        done = 0
        for measurement in range(1, preset.repeats + 1):
            for case in preset.cases:
                done += 1
                log.info("[%d/%d] %s, run %d", done, total, case.name, measurement)
                try:
                    row = run_case(case, measurement, data_root, Path(work))
                except Exception as exc:  # noqa: BLE001 - one failed run must not lose the others
                    log.error("%s, run %d failed: %s", case.name, measurement, exc)
                    results["failures"].append({"case": case.name, "measurement": measurement, "error": str(exc)})
                    row = {"case": case.name, "measurement": measurement, "kind": case.kind, "model": case.model,
                           "mode": case.mode, "topology": case.topology, "batch": case.batch, "vocab": case.vocab,
                           "rows": case.rows, "epochs": case.epochs, "error": str(exc)[:2000]}
                results[case.kind].append(row)
                log.info("  %s", _summary(row))
    if preset.scale:
        from benchmarks import scale_bench

        runs = []
        for measurement in range(1, preset.repeats + 1):
            log.info("scale: %s, run %d", preset.scale, measurement)
            try:
                runs.append({"measurement": measurement, **scale_bench.run(**preset.scale)})
            except Exception as exc:  # noqa: BLE001
                log.error("scale run %d failed: %s", measurement, exc)
                results["failures"].append({"case": "scale", "measurement": measurement, "error": str(exc)})
                runs.append({"measurement": measurement, "error": str(exc)[:2000]})
        results["scale"] = {"runs": runs}
    results["word2vec"] = _word2vec(preset, out_dir)
    results["wall_s"] = round(time.perf_counter() - start, 1)
    results["load_after"] = list(os.getloadavg())
    path = out_dir / f"{preset.name}.json"
    results["json"] = os.path.relpath(path, ROOT) if path.resolve().is_relative_to(ROOT) else str(path)
    path.write_text(json.dumps(results, indent=1) + "\n")
    write_report(results, out_dir, markdown_path)
    return results


def _summary(row: dict) -> str:
    if row.get("error"):
        return f"FAILED: {row['error'][:300]}"
    text = f"{row['examples_per_sec']:,} ex/s, AUC {row['auc']:.4f}, peak RSS {row['peak_rss_mib']:,.0f} MiB, {row['run_s']} s"
    if row["kind"] == "quality":
        ttq = row.get("ttq_01")
        text += f", max AUC {row.get('max_auc')}, best {row.get('best_reachable_auc') or 0:.4f}, " + \
                (f"best-0.01 at {ttq['train_s']} s" if ttq else "best-0.01 not reached")
    return text


def write_report(results: dict[str, Any], plots_dir: Path, markdown_path: Path | None) -> list[Path]:
    """Plots into `plots_dir` and the preset's block of `markdown_path` (None: no Markdown)."""
    plots = report.make_plots(results, plots_dir)
    if markdown_path is not None:
        text = report.markdown(results, plots, relative_to=markdown_path.parent)
        report.update_section(markdown_path, results["preset"], text)
    return plots


def _parse_world(text: str) -> dict[str, Any]:
    """'vocab=300,rows=100000,signal=1.5,shares=[0.9,0.1,0]' -> Case fields (vocab, rows, epochs,
    test_rows, evals, eval_rows, num_embeddings) and dataset.generate keys (anything else; a list in
    brackets keeps its commas).

    >>> _parse_world("vocab=30,shares=[0.9,0.1,0],signal=1.5")
    {'vocab': 30, 'generate': (('shares', '[0.9,0.1,0]'), ('signal', '1.5'))}
    """
    fields = {"vocab", "rows", "epochs", "test_rows", "evals", "eval_rows", "num_embeddings"}
    out: dict[str, Any] = {}
    generate = []
    for item in filter(None, re.split(r",(?![^\[]*\])", text)):
        if "=" not in item:
            raise SystemExit(f"--world {text!r}: {item!r} is not KEY=VALUE")
        key, value = item.split("=", 1)
        if key in fields:
            out[key] = int(value)
        else:
            generate.append((key, value))
    if generate:
        out["generate"] = tuple(sorted(generate))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--quick", action="store_true", help="= --preset quick")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results/<date>)")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="the RESULTS.md whose block is regenerated (default benchmarks/RESULTS.md; "
                             "with --out outside the checkout: <out>/RESULTS.md)")
    parser.add_argument("--data-dir", default=None, help="where generated worlds are cached (default datasets/generated)")
    parser.add_argument("--world", default="", help="time-to-quality world, e.g. vocab=300,rows=100000,epochs=2,signal=1.5")
    parser.add_argument("--only", default="", help="run only cases whose name contains this (e.g. quality/, /geo/)")
    parser.add_argument("--dry-run", action="store_true", help="list the matrix and its estimated time")
    parser.add_argument("--report", type=Path, default=None, help="regenerate the report from a results JSON")
    args = parser.parse_args(argv)
    quiet_libraries()  # the libraries' import-time lines a user cannot act on
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", force=True)

    if args.report is not None:
        results = json.loads(args.report.read_text())
        plots = write_report(results, args.report.parent, args.markdown or ROOT / "benchmarks" / "RESULTS.md")
        print("\n".join(str(p) for p in plots))
        return 0
    name = "quick" if args.quick else (args.preset or "quick")
    preset = PRESETS[name]
    if args.world or args.only:
        world = _parse_world(args.world)
        cases = [dataclasses.replace(c, **world) if c.kind == "quality" else c for c in preset.cases]
        preset = dataclasses.replace(preset, cases=tuple(c for c in cases if args.only in c.name))
    estimate = sum(estimate_s(c) for c in preset.cases) * preset.repeats
    if preset.scale:
        estimate += _scale_estimate_s(preset.scale) * preset.repeats
    if args.dry_run:
        for c in preset.cases:
            print(f"{estimate_s(c):6.0f} s  {c.name}" + (f"  (eval every {c.eval_every} steps)" if c.kind == "quality" else ""))
        if preset.scale:
            print(f"{_scale_estimate_s(preset.scale):6.0f} s  scale {preset.scale}")
        print(f"{preset.name}: {len(preset.cases)} cases x {preset.repeats} runs, about {estimate / 60:.1f} min on a quiet "
              f"2-core machine" + (" + Word2Vec" if preset.word2vec else ""))
        return 0
    out = args.out or ROOT / "benchmarks" / "results" / dt.date.today().isoformat()
    markdown_path = args.markdown
    if markdown_path is None:
        inside = out.resolve().is_relative_to(ROOT)
        markdown_path = ROOT / "benchmarks" / "RESULTS.md" if inside else out / "RESULTS.md"
    command = "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    log.info("preset %s: %d cases x %d runs, about %.1f min on a quiet machine", preset.name, len(preset.cases),
             preset.repeats, estimate / 60)
    results = run_preset(preset, out, args.data_dir, markdown_path, command.strip())
    print(f"results: {out / (preset.name + '.json')}; markdown: {markdown_path}")
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
