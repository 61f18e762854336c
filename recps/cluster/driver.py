"""The driver of a PS job (`recps.train` with ps=sync|async|geo): start a cluster on this machine, or be one of its processes.

    python -m recps.train ps=async cluster.servers=1 cluster.workers=2 trainer.threads=2

The Hydra process (no role in its environment, cluster=local) is the launcher: it generates
the data set if the config asks for it, then starts S servers and W workers on
`cluster.host` (127.0.0.1) with `recps.cluster.launch.launch`, each one `python -m recps.train` of the
composed config itself (<run dir>/recps-job.yaml: a user's --config-dir and every override are in
it), the same run folder and its role in RECPS_* variables. Start-up: the processes (of every job: the
default one, a stream, a funnel) are forked from the launcher instead, which has imported torch, torchrec
and the model and checked the config already, so each starts at its role (recps.cluster.launch's preloaded
image; the command is exec'd where a fork is not safe, and with RECPS_LAUNCH_FORK=0). The launcher's data
preparation and checks run in a child forked for them (`run_in_fork`), whose threads (pyarrow's, torch's,
an HDFS client's) would otherwise make the forks unsafe. Each worker parses only its own training rows
(recps.data.dataset.WorkerExamplesSource; worker 0 its held-out rows when it evaluates). Their output is
forwarded with a "[worker0] " prefix and copied to <run dir>/cluster.log. `launch` supervises:
when the workers are done the servers stop; when any process dies every other one is stopped
and the run fails naming it; nothing is left behind.

A process that finds its role in the environment (RECPS_ROLE from recps.cluster.launch; torchrun,
mpirun or srun with more than one task: the first `cluster.servers` ranks serve) acts as that
role:
- a server serves until worker 0 stops it (or it is signalled): recps.cluster.server;
- a worker (recps.cluster.work) builds the model over a PS-backed embedding collection, joins through
  `recps.ps.fleet.Fleet`, trains `trainer.threads` Hogwild threads on shards
  worker * T + thread of W * T, sends what is queued and waits for the others; worker 0
  then evaluates on the held-out split with the servers' values, has the servers save
  their shards under <run dir>/checkpoint and writes <run dir>/metrics.json.
  During training, conf/metrics' global metrics merge over every worker and thread through
  the servers (worker 0 logs them and writes train_metrics.jsonl, metrics.json
  "train_metrics", TensorBoard events), and with debug=dump every worker's threads write
  their own files under <run dir>/dump/ (`recps.job.run.training_observers`).

Recovery: with `cluster.restarts=N` the launcher starts a failed cluster again (recps.cluster.launch:
every process stopped, a back-off, at most N times), logging the cause and the checkpoint it
resumes from. A restarted process (RECPS_RESTART_COUNT, or torchrun's TORCHELASTIC_RESTART_COUNT
under `torchrun --max-restarts`) resumes from the last committed checkpoint under checkpoint.dir
(recps.cluster.checkpoint.resume_after_restart; `cluster.checkpoint_every` or ps.checkpoint_every_* take them), so the
updates after it are replayed exactly once; a stream resumes from its records in stream.out.

`run_distributed` returns the metrics on the launcher, None in the cluster's processes.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from recps import fs as rfs
from recps.cluster.checkpoint import finished_message, last_committed, restart_resume
from recps.cluster.launch import LaunchError, launch, process_age, run_in_fork
from recps.cluster.process import role_logging
from recps.config import check_cluster_config, cluster_checkpoint_every, ps_mode
from recps.errors import ConfigError, DataError, RecpsError
from recps.job.checkpoint import MANIFEST, SPEC_FILE, committed_checkpoints, find_checkpoint, is_committed
from recps.job.settings import checkpoint_dir, node_settings
from recps.ps.fleet import ENCRYPTION_ENV, STORAGE_ROOTS_ENV
from recps.ps.roles import ROLE_ENV, detect_role_maker

__all__ = ["run_distributed", "run_role", "storage_roots", "environment_role", "child_command", "apply_checkpoint_every",
           "JOB_CONFIG", "last_committed_checkpoint", "resume_after_restart"]

log = logging.getLogger("recps.cluster")


def environment_role(cfg: DictConfig, environ: Mapping[str, str] | None = None):
    """The Role this process was started with, or None (then cluster=local launches one).

    RECPS_ROLE always counts; torchrun / MPI / Slurm variables only with more than one process
    (a lone `srun python -m recps.train` is not a cluster)."""
    env = os.environ if environ is None else environ
    sizes = [env.get(k) for k in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")]
    if not env.get(ROLE_ENV) and not any(s and s.isdigit() and int(s) > 1 for s in sizes):
        return None
    return detect_role_maker(env, num_servers=int(cfg.cluster.servers)).role()



def run_distributed(cfg: DictConfig, out_dir: Path, *, work=None, before_launch=None) -> dict[str, Any] | None:
    """Launch a local cluster, or act as this process's role; see the module docstring.

    `work(cfg, role, out_dir, data=, observers=)`: what a worker does, given the composed config: it
    builds the typed values its body takes (default: the job, trained on the data set once by
    recps.cluster.work.work; recps.train gives the stream's pass loop, recps.pipeline.incremental_entry
    the streaming funnel's).
    `before_launch(cfg, mode, out_dir)`: the checks and preparations the launcher makes before any
    process starts (default: the storage checks and the data set's generation)."""
    check_cluster_config(cfg)
    apply_checkpoint_every(cfg)
    mode = ps_mode(cfg)  # a bad mode knob fails here, before any process starts
    _transport_encryption(cfg)
    role = environment_role(cfg)
    if role is None:
        prepare = before_launch or _before_launch
        # In a child of its own: the threads reading data starts end with it, and the cluster's processes
        # can still be forked from this preloaded image (recps.cluster.launch).
        run_in_fork(lambda: prepare(cfg, mode, Path(out_dir)), "the launcher's checks and data preparation")
        return _launch_local(cfg, Path(out_dir), fork=_forked_process(cfg, Path(out_dir), work))
    role_logging(role)
    if (age := process_age()) is not None:
        log.info("%s up %.2f s after its process started", role.name, age)  # benchmarks/startup_bench.py
    resume_after_restart(cfg, role, Path(out_dir))
    metrics = run_role(cfg, role, Path(out_dir), work=work)
    # Under recps.launch the launcher prints the run's closing lines; under torchrun, mpirun or srun nobody
    # else does: worker 0's process does, with the metrics it wrote.
    return metrics if not os.environ.get(ROLE_ENV) else None



def apply_checkpoint_every(cfg: DictConfig) -> None:
    """cluster.checkpoint_every into the mode's ps.checkpoint_every_steps / _seconds (recps.config checks that
    the two places do not disagree)."""
    steps, seconds = cluster_checkpoint_every(cfg)
    if steps is not None:
        cfg.ps.checkpoint_every_steps = steps
    if seconds is not None:
        cfg.ps.checkpoint_every_seconds = seconds



def last_committed_checkpoint(cfg: DictConfig, out_dir: Path) -> str | None:
    """The committed checkpoint with the most steps under the run's checkpoint folder, or None
    (recps.cluster.checkpoint.last_committed)."""
    return last_committed(checkpoint_dir(cfg, out_dir))


def resume_after_restart(cfg: DictConfig, role, out_dir: Path) -> None:
    """A restarted cluster's process sets trainer.resume to the last committed checkpoint under
    checkpoint.dir (recps.cluster.checkpoint.restart_resume); a stream resumes from its own records."""
    if cfg.get("stream") is not None and bool(cfg.stream.get("enabled", False)):
        return
    found = restart_resume(checkpoint_dir(cfg, out_dir), role, cfg.trainer.resume or None)
    if found is not None:
        cfg.trainer.resume = found


def _transport_encryption(cfg: DictConfig) -> None:
    """cluster.encryption (curve / off) into this process's environment, which the processes it
    starts inherit and the transport reads as it opens a socket; null leaves the environment's."""
    if cfg.cluster.get("encryption") is not None:
        os.environ[ENCRYPTION_ENV] = str(cfg.cluster.encryption)


def _before_launch(cfg: DictConfig, mode, out_dir: Path) -> None:
    _check_storage(cfg, mode, out_dir)
    _generate_data(cfg)
    _check_data_paths(cfg)


def _check_data_paths(cfg: DictConfig) -> None:
    """Before any process starts: every file, folder or pattern of dataset.train / dataset.test names at
    least one data file (after generated data was written). A data set built by its own `_target_`
    (MovieLens ...) finds its files itself."""
    if cfg.dataset.get("_target_"):
        return
    from recps.data.reader import expand_paths  # deferred: pandas, pyarrow (a stream's or funnel's launcher never reads them)

    for key in ("train", "test"):
        paths = cfg.dataset.get(key)
        if not paths:
            continue  # test: [] with dataset.test_fraction
        try:
            expand_paths(list(paths) if not isinstance(paths, str) else [paths])
        except DataError as exc:
            raise DataError(f"dataset.{key}: {exc} (or generate it: dataset.generate)") from None


def _check_storage(cfg: DictConfig, mode, out_dir: Path) -> None:
    """Before any process starts: trainer.resume is a PS checkpoint, and the checkpoint folder holds no
    committed one, nor do its step-N/ folders (a committed checkpoint is never overwritten)."""
    resume = str(cfg.trainer.resume) if cfg.trainer.resume else ""
    target = checkpoint_dir(cfg, out_dir) if cfg.checkpoint.save else ""
    if resume:
        kind, found = find_checkpoint(resume)
        if kind != "ps":
            raise ConfigError(f"trainer.resume={resume!r} is a ps=local checkpoint ({found}); resume it "
                              "with ps=local, or give a parameter-server checkpoint")
        _check_resume_mode(found, str(cfg.ps.name), resume)
    if mode.checkpoint_every_steps or mode.checkpoint_every_seconds:
        target = checkpoint_dir(cfg, out_dir)  # its step-N/ folders
    committed = committed_checkpoints(target) if target else []
    if committed:
        raise ConfigError(f"checkpoint.dir: {target} holds a committed checkpoint ({committed[0]}/{MANIFEST}); "
                          "none is ever overwritten: give another checkpoint.dir or hydra.run.dir (or move it away)")


def _check_resume_mode(folder: str, mode: str, resume: str) -> None:
    """A PS checkpoint resumes in the mode that wrote it (each table's spec.json says which): the optimizer
    state it holds is that mode's (GEO's dense state lives with the workers, sync's and async's on the servers)."""
    manifest = json.loads(rfs.read_bytes(rfs.join(folder, MANIFEST)))
    written = {}
    for table in manifest.get("tables", []):
        try:
            spec = json.loads(rfs.read_bytes(rfs.join(folder, table, SPEC_FILE)))
        except FileNotFoundError:
            continue  # the manifest check on loading names a missing file
        if spec.get("mode") and spec["mode"] != mode:
            written.setdefault(spec["mode"], []).append(table)
    if written:
        old = sorted(written)[0]
        raise ConfigError(f"trainer.resume={resume!r}: the checkpoint {folder} was written by ps={old} (tables "
                          f"{written[old]}), and this run is ps={mode}; resume it with ps={old}, or start afresh "
                          "without trainer.resume (a checkpoint's optimizer state belongs to the mode that wrote it)")


def run_role(cfg: DictConfig, role, out_dir: Path, *, data=None, observers: Sequence = (), work=None) -> dict[str, Any] | None:
    """Be `role` of a running cluster in this thread: a server serves until a worker stops it
    (returns None); a worker trains, and worker 0 returns the metrics it wrote (the others None).

    In-process clusters (tests) run each role in a thread of one process; `data` (the
    PreparedData of cfg.dataset) spares reading the data set again, `observers`
    (recps.job.observer.TrainObserver) join the worker's training threads; `work`: as run_distributed's."""
    check_cluster_config(cfg)
    # Deferred: the launcher (no role) never runs a role body; a server or worker pays the imports of
    # its own (recps.job.build: torch, fbgemm, the readers) only where it runs one.
    if role.is_server:
        from recps.cluster.server import serve  # deferred: torch and the PS tables; the launcher never serves

        serve(node_settings(cfg), role, Path(out_dir), storage_roots(cfg, out_dir))
        return None
    return (work or _batch_work)(cfg, role, Path(out_dir), data=data, observers=observers)


def _batch_work(cfg: DictConfig, role, out_dir: Path, data=None, observers: Sequence = ()) -> dict[str, Any] | None:
    """A batch job's worker: the job built from `cfg` (this worker's own rows where it can), then its
    body (recps.cluster.work.work) with the typed values."""
    from recps.cluster.work import work  # deferred: torch, torchrec, fbgemm; the launcher never runs a worker
    from recps.job.build import build_job, worker_data  # deferred: the same

    job = build_job(cfg, data if data is not None else worker_data(cfg, role))  # the same job as ps=local's
    return work(job, ps_mode(cfg), node_settings(cfg), role, out_dir, observers=observers)



# ---------------------------------------------------------------------------------- the launcher


JOB_CONFIG = "recps-job"  # <run dir>/recps-job.yaml: the composed config the cluster's processes run


def child_command(cfg: DictConfig, out_dir: Path) -> list[str]:
    """`python -m recps.train` of the composed config `cfg` itself, written to <out_dir>/recps-job.yaml
    (so a process cannot compose anything else: a user's --config-dir, --config-name and every
    override are in it), in the same run folder, logging to stdout, `progress` off."""
    path = Path(out_dir) / f"{JOB_CONFIG}.yaml"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(OmegaConf.to_yaml(cfg))  # unresolved: ${recps.root:} etc. resolve in each process
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return [sys.executable, "-m", "recps.train", "--config-dir", str(Path(out_dir).resolve()), "--config-name", JOB_CONFIG,
            f"hydra.run.dir={out_dir}", "hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none",
            "progress=false"]


# The line a failed process ends with: recps.train's one-line report ("recps.train: ConfigError: ...")
# or a traceback's last line ("ValueError: ...").
_ERROR_LINE = re.compile(r"^(recps\.train: .+|([A-Za-z_][\w.]*\.)?[A-Z]\w*(Error|Exception|Exit|Interrupt)(: .*)?)$")


class _Tee:
    """Forwarded output to our stdout and to a file (launch writes line by line under a lock); keeps
    each process's last lines, to name what a failed one said."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", encoding="utf-8")
        self.tails: dict[str, collections.deque[str]] = {}

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        self.file.write(text)
        if text.startswith("[") and "] " in text:
            name, _, line = text[1:].partition("] ")
            self.tails.setdefault(name, collections.deque(maxlen=50)).append(line.rstrip("\n"))

    def last_error(self, name: str | None) -> str | None:
        """The last line of process `name` that reads as an error, if any."""
        for line in reversed(self.tails.get(name or "", ())):
            if _ERROR_LINE.match(line.strip()):
                return line.strip().removeprefix("recps.train: ")
        return None

    def flush(self) -> None:
        sys.stdout.flush()
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _generate_data(cfg: DictConfig) -> None:
    """Create generated data once, here, rather than in every worker at the same time."""
    ds = OmegaConf.to_container(cfg.dataset, resolve=True)
    if not ds.get("generate"):
        return
    # The dataset's own generator (recps.data.dataset.ensure_generated's rule, without importing torch here).
    ensure_split = get_object(ds.get("generator") or "recps.data.generators.ctr.ensure_split")
    gen = ds["generate"]
    ensure_split(ds["dir"], int(gen.pop("train_rows")), int(gen.pop("test_rows")), seed=int(gen.pop("seed", 0)), **gen)


def _forked_process(cfg: DictConfig, out_dir: Path, work=None):
    """What `python -m recps.train` of the job's config (child_command) does, for a process that recps.cluster.launch
    forks from this one instead: this process imported torch, fbgemm, torchrec and the model, composed and
    checked the config, so the child starts at its role (in its environment). An error a user can cause
    ends it as recps.train's does (its one-line message on stderr, exit 1); any other, with its traceback."""

    def run() -> int:
        cfg.progress = False
        try:
            run_distributed(cfg, out_dir, work=work)
        except RecpsError as exc:  # the process's top (recps.train.cli's message, which the launcher quotes)
            sys.stderr.write(f"recps.train: {type(exc).__name__}: {exc}\n")
            return 1
        return 0

    return run


def _what_runs(cfg: DictConfig) -> tuple[str, str]:
    """(what the launcher starts, each worker's threads) for its first line: `ps=async`, "x 2 thread(s)";
    a funnel's stages each train in their own mode with their own threads (trainer.threads is not read):
    `pipeline=video_funnel (recall geo, coarse async, fine async, fusion sync)`, "x 1 thread(s) per stage"."""
    p = cfg.get("pipeline")
    stages = p.get("stages") if p is not None and str(p.get("name", "none")) != "none" else None
    if not stages:
        return f"ps={cfg.ps.name}", f"x {cfg.trainer.threads} thread(s)"
    modes = ", ".join(f"{name} {stage.ps.get('name')}" for name, stage in stages.items())
    threads = {name: int(stage.trainer.threads) for name, stage in stages.items()}
    each = (f"x {next(iter(threads.values()))} thread(s) per stage" if len(set(threads.values())) == 1 else
            "x " + ", ".join(f"{t} ({name})" for name, t in threads.items()) + " thread(s)")
    return f"pipeline={p.get('name')} ({modes})", each


def _launch_local(cfg: DictConfig, out_dir: Path, fork=None) -> dict[str, Any]:
    c = cfg.cluster
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = out_dir / "metrics.json"
    metrics_file.unlink(missing_ok=True)
    command = child_command(cfg, out_dir)
    what, threads = _what_runs(cfg)
    log.info("%s: starting %d server(s) and %d worker(s) %s on %s", what, c.servers, c.workers, threads, c.host)
    tee = _Tee(out_dir / "cluster.log")
    streaming = cfg.get("stream") is not None and bool(cfg.stream.get("enabled", False))

    def on_restart(number: int, failed) -> str:
        """The restart's log line: what the failed process said, and where the new start resumes."""
        said = tee.last_error(failed.failed)
        where = f"{said}; " if said else ""
        if streaming:
            where += f"the stream resumes from its records in {cfg.stream.out}"
        elif is_committed(checkpoint_dir(cfg, out_dir)):
            raise LaunchError(finished_message(failed.message, checkpoint_dir(cfg, out_dir)))
        elif found := last_committed_checkpoint(cfg, out_dir):
            where += f"resuming from {found}"
        else:
            where += f"no committed checkpoint under {checkpoint_dir(cfg, out_dir)} yet: starting over"
        tee.file.write(f"[launch] restart {number}: {failed.message}; {where}\n")  # in cluster.log too
        tee.tails.clear()  # what the next start's processes say
        return where

    try:
        result = launch(command, servers=int(c.servers), workers=int(c.workers),
                        timeout=None if c.timeout_s is None else float(c.timeout_s), host=str(c.host), output=tee,
                        restarts=int(c.get("restarts", 0) or 0), on_restart=on_restart,
                        fork=fork)
    finally:
        tee.close()
    if not result.ok:
        said = tee.last_error(result.failed)
        raise LaunchError(f"{result.message}{': ' + said if said else ''}; its output is in {out_dir / 'cluster.log'}")
    if not metrics_file.is_file():
        raise RecpsError(f"the cluster finished but worker 0 wrote no {metrics_file}; see {out_dir / 'cluster.log'}")
    metrics = json.loads(metrics_file.read_text())
    metrics["cluster_seconds"] = round(result.duration_s, 3)
    if result.restarts:  # the failures the cluster recovered from
        metrics["restarts"] = list(result.restarts)
    server_cpu = [json.loads(p.read_text())["cpu_seconds"] for p in sorted(out_dir.glob("server*.cpu.json"))]
    if len(server_cpu) == int(c.servers) and metrics.get("worker_cpu_seconds"):
        metrics["server_cpu_seconds"] = sum(server_cpu)
        metrics["examples_per_cpu_second"] = metrics["train_examples"] / (metrics["worker_cpu_seconds"] + sum(server_cpu))
    return metrics


def storage_roots(cfg: DictConfig, out_dir: Path, environ: Mapping[str, str] | None = None) -> list[str]:
    """The folders this job's servers may save to and load from (a save or load request naming a
    path elsewhere is refused: recps.ps.node.server.check_storage_path): the run folder, the
    checkpoint folder, the checkpoint resumed from, the stream's output, and whatever
    $RECPS_STORAGE_ROOTS already names (comma-separated)."""
    env = os.environ if environ is None else environ
    roots = [str(Path(out_dir).resolve()), checkpoint_dir(cfg, Path(out_dir).resolve())]
    resume = cfg.trainer.get("resume")
    if resume:
        roots.append(str(resume))
    stream = cfg.get("stream")
    if stream is not None and bool(stream.get("enabled", False)) and stream.get("out"):
        roots.append(str(stream.out))
    roots += [r for r in env.get(STORAGE_ROOTS_ENV, "").split(",") if r.strip()]
    return list(dict.fromkeys(roots))
