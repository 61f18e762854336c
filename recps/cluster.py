"""`recps.train` with ps=sync|async|geo: start a cluster on this machine, or be one of its processes.

    python -m recps.train ps=async cluster.servers=1 cluster.workers=2 trainer.threads=2

The Hydra process (no role in its environment, cluster=local) is the launcher: it generates
the data set if the config asks for it, then starts S servers and W workers on
`cluster.host` (127.0.0.1) with `recps.launch.launch`, each one `python -m recps.train` of the
composed config itself (<run dir>/recps-job.yaml: a user's --config-dir and every override are in
it), the same run folder and its role in RECPS_* variables. Start-up: the default job's processes
are forked from the launcher instead, which has imported torch, torchrec and the model and checked
the config already, so each starts at its role (recps.launch's preloaded image; the command is
exec'd where a fork is not safe, for stream and pipeline jobs, and with RECPS_LAUNCH_FORK=0), and
each worker parses only its own training rows (recps.data.dataset.WorkerExamplesSource; worker 0
its held-out rows when it evaluates). Their output is
forwarded with a "[worker0] " prefix and copied to <run dir>/cluster.log. `launch` supervises:
when the workers are done the servers stop; when any process dies every other one is stopped
and the run fails naming it; nothing is left behind.

A process that finds its role in the environment (RECPS_ROLE from recps.launch; torchrun,
mpirun or srun with more than one task: the first `cluster.servers` ranks serve) acts as that
role:
- a server serves until worker 0 stops it (or it is signalled);
- a worker builds the model over a PS-backed embedding collection, joins through
  `recps.ps.fleet.Fleet`, trains `trainer.threads` Hogwild threads on shards
  worker * T + thread of W * T, sends what is queued and waits for the others; worker 0
  then evaluates on the held-out split with the servers' values, has the servers save
  their shards under <run dir>/checkpoint and writes <run dir>/metrics.json.
  During training, conf/metrics' global metrics merge over every worker and thread through
  the servers (worker 0 logs them and writes train_metrics.jsonl, metrics.json
  "train_metrics", TensorBoard events), and with debug=dump every worker's threads write
  their own files under <run dir>/dump/ (`recps.run.training_observers`).

Recovery: with `cluster.restarts=N` the launcher starts a failed cluster again (recps.launch:
every process stopped, a back-off, at most N times), logging the cause and the checkpoint it
resumes from. A restarted process (RECPS_RESTART_COUNT, or torchrun's TORCHELASTIC_RESTART_COUNT
under `torchrun --max-restarts`) resumes from the last committed checkpoint under checkpoint.dir
(`resume_after_restart`; `cluster.checkpoint_every` or ps.checkpoint_every_* take them), so the
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
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf

# The checks of a PS run's config live in recps.config (a layer below: validate_config runs them);
# re-exported here, where the cluster uses them.
from recps.config import PS_MODES, check_cluster_config, cluster_checkpoint_every, ps_mode
from recps.errors import ConfigError, RecpsError

__all__ = ["run_distributed", "run_role", "storage_roots", "environment_role", "ps_mode", "check_cluster_config", "child_command",
           "PS_MODES", "fleet_for",
           "on_this_machine", "apply_checkpoint_every", "last_committed_checkpoint", "resume_after_restart",
           "ProgressLog", "write_progress", "read_progress", "load_worker_state", "STATS_TABLE"]

log = logging.getLogger("recps.cluster")

STATS_TABLE = "recps_stats"  # [examples, examples/s, seconds, CPU seconds] summed over workers (a GEO-mode table: pushes add)
# Mid-run checkpoints' meetings (a GEO-mode table: pushes add): per worker its planned steps as
# two float32-exact halves (steps >> 20, steps & (2**20 - 1)), then the steps to the next meeting.
CONTROL_TABLE = "recps_control"
_PROGRESS_EVERY_S = 5.0


def environment_role(cfg: DictConfig, environ: Mapping[str, str] | None = None):
    """The Role this process was started with, or None (then cluster=local launches one).

    RECPS_ROLE always counts; torchrun / MPI / Slurm variables only with more than one process
    (a lone `srun python -m recps.train` is not a cluster)."""
    from recps.ps.roles import ROLE_ENV, detect_role_maker

    env = os.environ if environ is None else environ
    sizes = [env.get(k) for k in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")]
    if not env.get(ROLE_ENV) and not any(s and s.isdigit() and int(s) > 1 for s in sizes):
        return None
    return detect_role_maker(env, num_servers=int(cfg.cluster.servers)).role()


def run_distributed(cfg: DictConfig, out_dir: Path, *, work=None, before_launch=None) -> dict[str, Any] | None:
    """Launch a local cluster, or act as this process's role; see the module docstring.

    `work(cfg, role, out_dir, data=, observers=)`: what a worker does (default: train on the data
    set once, `_work`; recps.stream gives its pass loop). `before_launch(cfg, mode, out_dir)`: the
    checks and preparations the launcher makes before any process starts (default: the storage
    checks and the data set's generation)."""
    check_cluster_config(cfg)
    apply_checkpoint_every(cfg)
    mode = ps_mode(cfg)  # a bad mode knob fails here, before any process starts
    _transport_encryption(cfg)
    role = environment_role(cfg)
    if role is None:
        (before_launch or _before_launch)(cfg, mode, Path(out_dir))
        # A job of its own (stream, pipeline) execs its processes; the default one forks them (preloaded).
        return _launch_local(cfg, Path(out_dir), preloaded=work is None and before_launch is None)
    _role_logging(role)
    from recps.launch import process_age

    if (age := process_age()) is not None:
        log.info("%s up %.2f s after its process started", role.name, age)  # benchmarks/startup_bench.py
    resume_after_restart(cfg, role, Path(out_dir))
    run_role(cfg, role, Path(out_dir), work=work)
    return None


def apply_checkpoint_every(cfg: DictConfig) -> None:
    """cluster.checkpoint_every into the mode's ps.checkpoint_every_steps / _seconds (recps.config checks that
    the two places do not disagree)."""
    steps, seconds = cluster_checkpoint_every(cfg)
    if steps is not None:
        cfg.ps.checkpoint_every_steps = steps
    if seconds is not None:
        cfg.ps.checkpoint_every_seconds = seconds


def last_committed_checkpoint(cfg: DictConfig, out_dir: Path) -> str | None:
    """The committed checkpoint with the most steps under the run's checkpoint folder (its step-N/
    folders, or the folder itself), or None."""
    from recps.checkpoint import committed_checkpoints, find_checkpoint
    from recps.run import checkpoint_dir

    root = checkpoint_dir(cfg, out_dir)
    if not committed_checkpoints(root):
        return None
    return find_checkpoint(root)[1]


def resume_after_restart(cfg: DictConfig, role, out_dir: Path) -> None:
    """On a restart of the cluster (recps.launch's RECPS_RESTART_COUNT or torchrun's
    TORCHELASTIC_RESTART_COUNT > 0) every process resumes from the last committed checkpoint under
    checkpoint.dir (trainer.resume is set to it), so that the updates after it are replayed exactly
    once; with none committed yet, the job starts over as configured. Every process of the cluster
    was stopped before the restart, so they all find the same one. A stream resumes from its own
    records in stream.out instead (recps.stream), the same way as a rerun of its command."""
    from recps.launch import restart_count
    from recps.run import checkpoint_dir

    count = restart_count()
    if count == 0 or (cfg.get("stream") is not None and bool(cfg.stream.get("enabled", False))):
        return
    found = last_committed_checkpoint(cfg, out_dir)
    if found is None:
        log.warning("%s: restart %d: no committed checkpoint under %s yet; starting over%s", role.name, count,
                    checkpoint_dir(cfg, out_dir),
                    f" from trainer.resume={cfg.trainer.resume}" if cfg.trainer.resume else "")
        return
    if found == checkpoint_dir(cfg, out_dir):
        raise ConfigError(_finished_message(f"{role.name}: restart {count}", found))
    log.warning("%s: restart %d: resuming from %s", role.name, count, found)
    cfg.trainer.resume = found


def _finished_message(what: str, checkpoint: str) -> str:
    """A failure after the job's final checkpoint was committed: its training is done, nothing to resume."""
    return (f"{what}: the job's final checkpoint {checkpoint} was already committed (its training is complete): "
            f"nothing to restart from; evaluate it with python -m recps.evaluate {checkpoint}")


def _transport_encryption(cfg: DictConfig) -> None:
    """cluster.encryption (curve / off) into this process's environment, which the processes it
    starts inherit and the transport reads as it opens a socket; null leaves the environment's."""
    from recps.ps.fleet import ENCRYPTION_ENV

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
    from recps.data.reader import expand_paths
    from recps.errors import DataError

    if cfg.dataset.get("_target_"):
        return
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
    from recps.checkpoint import MANIFEST, committed_checkpoints, find_checkpoint
    from recps.run import checkpoint_dir

    resume = str(cfg.trainer.resume) if cfg.trainer.resume else ""
    target = checkpoint_dir(cfg, out_dir) if cfg.checkpoint.save else ""
    if resume:
        kind, found = find_checkpoint(resume)
        if kind != "ps":
            raise ConfigError(f"trainer.resume={resume!r} is a ps=local checkpoint ({found}); resume it "
                              "with ps=local, or give a parameter-server checkpoint")
    if mode.checkpoint_every_steps or mode.checkpoint_every_seconds:
        target = checkpoint_dir(cfg, out_dir)  # its step-N/ folders
    committed = committed_checkpoints(target) if target else []
    if committed:
        raise ConfigError(f"checkpoint.dir: {target} holds a committed checkpoint ({committed[0]}/{MANIFEST}); "
                          "none is ever overwritten: give another checkpoint.dir or hydra.run.dir (or move it away)")


def run_role(cfg: DictConfig, role, out_dir: Path, *, data=None, observers: Sequence = (), work=None) -> dict[str, Any] | None:
    """Be `role` of a running cluster in this thread: a server serves until a worker stops it
    (returns None); a worker trains, and worker 0 returns the metrics it wrote (the others None).

    In-process clusters (tests) run each role in a thread of one process; `data` (the
    PreparedData of cfg.dataset) spares reading the data set again, `observers`
    (recps.trainer.TrainObserver) join the worker's training threads; `work`: as run_distributed's."""
    check_cluster_config(cfg)
    if role.is_server:
        _serve(cfg, role, Path(out_dir))
        return None
    return (work or _work)(cfg, role, Path(out_dir), data=data, observers=observers)


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


def _role_logging(role) -> None:
    """recps' INFO lines and everyone's warnings on stdout (library INFO chatter stays out)."""
    from recps.ps.roles import ROLE_ENV

    prefix = "" if os.environ.get(ROLE_ENV) else f"[{role.name}] "  # recps.launch adds it itself
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, force=True,
                        format=f"{prefix}%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("recps").setLevel(logging.INFO)


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
    from hydra.utils import get_object

    # The dataset's own generator (recps.data.dataset.ensure_generated's rule, without importing torch here).
    ensure_split = get_object(ds.get("generator") or "recps.data.generators.ctr.ensure_split")
    gen = ds["generate"]
    ensure_split(ds["dir"], int(gen.pop("train_rows")), int(gen.pop("test_rows")), seed=int(gen.pop("seed", 0)), **gen)


def _forked_process(cfg: DictConfig, out_dir: Path):
    """What `python -m recps.train` of the job's config (child_command) does, for a process that recps.launch
    forks from this one instead: this process imported torch, fbgemm, torchrec and the model, composed and
    checked the config, so the child starts at its role (in its environment). An error a user can cause
    ends it as recps.train's does (its one-line message on stderr, exit 1); any other, with its traceback."""

    def run() -> int:
        cfg.progress = False
        try:
            run_distributed(cfg, out_dir)
        except RecpsError as exc:  # the process's top (recps.train.cli's message, which the launcher quotes)
            sys.stderr.write(f"recps.train: {type(exc).__name__}: {exc}\n")
            return 1
        return 0

    return run


def _launch_local(cfg: DictConfig, out_dir: Path, preloaded: bool = False) -> dict[str, Any]:
    from recps.checkpoint import is_committed
    from recps.launch import LaunchError, launch
    from recps.run import checkpoint_dir

    c = cfg.cluster
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = out_dir / "metrics.json"
    metrics_file.unlink(missing_ok=True)
    command = child_command(cfg, out_dir)
    log.info("ps=%s: starting %d server(s) and %d worker(s) x %d thread(s) on %s", cfg.ps.name, c.servers,
             c.workers, cfg.trainer.threads, c.host)
    tee = _Tee(out_dir / "cluster.log")
    streaming = cfg.get("stream") is not None and bool(cfg.stream.get("enabled", False))

    def on_restart(number: int, failed) -> str:
        """The restart's log line: what the failed process said, and where the new start resumes."""
        said = tee.last_error(failed.failed)
        where = f"{said}; " if said else ""
        if streaming:
            where += f"the stream resumes from its records in {cfg.stream.out}"
        elif is_committed(checkpoint_dir(cfg, out_dir)):
            raise LaunchError(_finished_message(failed.message, checkpoint_dir(cfg, out_dir)))
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
                        fork=_forked_process(cfg, out_dir) if preloaded else None)
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


# -------------------------------------------------------------------------------------- servers


def fleet_for(cfg: DictConfig, role, storage_roots: Sequence[str] | None = None):
    """The Fleet of `role` with the cluster's settings; `storage_roots`: a server's save/load folders."""
    from recps.ps.fleet import Fleet

    c = cfg.cluster
    # Handler threads of a server (null: 0 when this machine is crowded, see _crowded; else 2).
    # Measured on 2 cores, quiet (benchmarks/RESULTS.md): serving on the network thread cut the
    # server's CPU by 7-20% and ran async 1S+2Wx1T, 1S+1Wx2T and GEO/sync 1S+1Wx2T faster.
    server_threads = c.get("server_threads")
    if server_threads is None:
        server_threads = 0 if role.is_server and _crowded(cfg, role) else 2
    return Fleet(role, connect_timeout_s=float(c.connect_timeout_s), dead_after_s=float(c.dead_after_s),
                 server_threads=int(server_threads), storage_roots=storage_roots)


def _crowded(cfg: DictConfig, role) -> bool:
    """Whether this machine's servers and training threads outnumber its cores (local launches only)."""
    busy = role.num_servers + role.num_workers * int(cfg.trainer.threads)
    return on_this_machine(role) and busy > (os.cpu_count() or 1)


def _serve(cfg: DictConfig, role, out_dir: Path) -> None:
    import torch

    # Intra-op threads of a server's table ops (null: torch's default, or 1 when this machine is
    # crowded: idle OpenMP threads spin and take CPU from the workers). Measured with async on 2
    # cores: 1 server + 2 workers, 1 thread 13.5k / 12.7k examples per CPU-s, 2 threads 11.5k;
    # 1 server + 1 worker x 2 threads (counted since session 4: the workers' threads are busy too),
    # 1 thread 21,259 examples/s and 4.6 s of server CPU against 19,754 and 5.6 s, and serving on
    # the network thread with 2 intra-op threads spun: 13.5 s of server CPU, 14,811 examples/s.
    threads = cfg.cluster.get("server_torch_threads")
    if threads is None and _crowded(cfg, role):
        threads = 1
    if threads is not None:
        torch.set_num_threads(int(threads))
    with fleet_for(cfg, role, storage_roots=storage_roots(cfg, out_dir)) as fleet:
        fleet.init_server()  # start-up work (loads the tables' compiled loops), like the imports:
        cpu = time.process_time()  # before the CPU clock starts
        fleet.run_server()
    if on_this_machine(role):  # the launcher adds it to metrics.json (benchmarks: examples per CPU-second)
        (out_dir / f"{role.name}.cpu.json").write_text(json.dumps({"cpu_seconds": time.process_time() - cpu}))


def storage_roots(cfg: DictConfig, out_dir: Path, environ: Mapping[str, str] | None = None) -> list[str]:
    """The folders this job's servers may save to and load from (a save or load request naming a
    path elsewhere is refused: recps.ps.node.server.check_storage_path): the run folder, the
    checkpoint folder, the checkpoint resumed from, the stream's output, and whatever
    $RECPS_STORAGE_ROOTS already names (comma-separated)."""
    from recps.ps.fleet import STORAGE_ROOTS_ENV
    from recps.run import checkpoint_dir

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


def on_this_machine(role) -> bool:
    from recps.ps.roles import ROLE_ENV

    return bool(os.environ.get(ROLE_ENV)) and role.coordinator.startswith(("127.", "localhost", "[::1]"))


# -------------------------------------------------------------------------------------- workers


class ProgressLog:
    """A log line every few seconds from worker 0 (a tqdm bar does not survive line forwarding), and one
    at its first step (with the process's age: benchmarks/startup_bench.py reads it)."""

    def __init__(self, batch_size: int, threads: int) -> None:
        self.batch_size, self.threads = batch_size, threads
        self.start = self.last = time.perf_counter()
        self.lock = threading.Lock()
        self.first = True

    def __call__(self, thread: int, step: int, loss: float) -> None:
        now = time.perf_counter()
        if self.first:
            with self.lock:
                first, self.first = self.first, False
            if first:
                from recps.launch import process_age

                age = process_age()
                log.info("first training step done (loss %.4f)%s", loss,
                         f", {age:.2f} s after this process started" if age is not None else "")
        if now - self.last < _PROGRESS_EVERY_S:
            return
        with self.lock:
            if now - self.last < _PROGRESS_EVERY_S:
                return
            self.last = now
        log.info("step %d, %.0f examples/s on this worker, loss %.4f", step,
                 step * self.batch_size / (now - self.start), loss)


def _worker_data(cfg: DictConfig, role):
    """This worker's training rows only, parsed by it (recps.data.dataset.WorkerExamplesSource: the same
    batches as every row's source gives its threads), and the test rows where it evaluates (worker 0;
    every worker with trainer.observers, which may read them); None where the data set or the task
    needs every row (a dataset _target_, a test_fraction split, a task that binds the data)."""
    from hydra.utils import get_object

    from recps.data.dataset import prepare_data, worker_parses_its_shards

    ds = OmegaConf.to_container(cfg.dataset, resolve=True)
    if not worker_parses_its_shards(ds) or hasattr(get_object(str(cfg.task._target_)), "bind"):
        return None
    threads = int(cfg.trainer.threads)
    return prepare_data(ds, seed=int(cfg.seed), worker=(role.index, role.num_workers, threads),
                        test=role.index == 0 or bool(cfg.trainer.get("observers")))


def _work(cfg: DictConfig, role, out_dir: Path, data=None, observers: Sequence = ()) -> dict[str, Any] | None:
    import torch

    from recps.data.sharding import WorkerShards
    from recps.checkpoint import commit_ps_checkpoint
    from recps.launch import restart_count
    from recps.ps.fleet import DENSE_TABLE, DistributedStrategy
    from recps.run import build_job, checkpoint_dir, evaluate, training_observers
    from recps.trainer import left_of_target, planned_steps

    if data is None:
        data = _worker_data(cfg, role)
    job = build_job(cfg, data)  # the same data, model, task and trainer as ps=local, over a PS-backed collection
    job.trainer.observers = [*job.trainer.observers, *observers]
    strategy = DistributedStrategy(ps_mode(cfg), threads=int(cfg.trainer.threads))
    threads, batch_size = int(cfg.trainer.threads), int(cfg.trainer.batch_size)
    epochs, max_steps = int(cfg.trainer.epochs), int(cfg.trainer.max_steps)
    source = WorkerShards(job.data.train, role.index, role.num_workers)
    if on_this_machine(role):  # W workers share this machine's cores: no oversubscribed OpenMP pools
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // role.num_workers))
    resume = _resume_point(cfg, job, role, threads, batch_size) if cfg.trainer.resume else None
    first_epoch, skip = (resume["epoch"], resume["skip"]) if resume else (0, None)
    # Where this job began (epoch, steps): (0, 0), or the checkpoint a user resumed; its checkpoints record it.
    # A restart that resumes one of them continues the same job: it trains what is left of it, not that much more.
    origin = {"epoch": first_epoch, "steps": job.steps_done}
    if resume and restart_count() > 0 and str(resume["folder"]).startswith(checkpoint_dir(cfg, out_dir).rstrip("/") + "/"):
        origin = resume["manifest"]["progress"].get("origin") or {"epoch": 0, "steps": 0}
        epochs, max_steps = left_of_target(epochs, max_steps, (int(origin["epoch"]), int(origin["steps"])),
                                           first_epoch, job.steps_done)
        log.info("%s: the job began at epoch %d, step %d; left to train: %s", role.name, origin["epoch"],
                 origin["steps"], f"{max_steps} steps" if max_steps > 0 else f"{epochs} epoch(s)")
    per_thread = -1
    if strategy.mode.name == "sync":
        # Every thread of every worker takes the same number of steps (each step waits for all).
        per_thread = min(source.shard_batches(batch_size, threads))
        if skip is not None:
            skip = [min(skip)] * threads  # equal steps for every thread
        if max_steps > 0 and skip is not None:  # a resumed run: the steps left of one epoch
            per_thread, epochs, max_steps = min(per_thread, skip[0] + max(1, max_steps // threads)), 1, -1
        # Else the trainer stops at exactly max_steps, a multiple of the threads (check_cluster_config):
        # each step waits for every thread, so each takes max_steps / threads.

    with fleet_for(cfg, role) as fleet:
        fleet.add_collection(job.collection)
        dist = fleet.distributed_optimizer(job.optimizer, strategy)
        fleet.init_worker(load_from=resume["folder"] if resume else None)
        if resume and resume["state_files"]:
            load_worker_state(resume["folder"], resume["manifest"], resume["state_files"], fleet)
        job.trainer.updater = dist.updater
        job.trainer.prefetch = strategy.mode.prefetches
        fleet.create_dense_table(STATS_TABLE, 4, mode="geo")  # GEO's server half adds what arrives
        job.trainer.on_step = ProgressLog(batch_size, threads) if role.index == 0 else None
        tables = [*job.collection.table_dims(), DENSE_TABLE]  # named: the servers hold other tables too
        pauses = None
        if strategy.mode.checkpoint_every_steps or strategy.mode.checkpoint_every_seconds:
            mine = source.shard_batches(batch_size, threads)[role.index * threads:(role.index + 1) * threads]
            planned = planned_steps(mine, epochs, max_steps, per_thread, skip)
            pauses = CheckpointPauses(fleet, cfg, job, strategy.mode, checkpoint_dir(cfg, out_dir), tables, planned,
                                      origin=origin)
        # Global metrics (merged over every worker and thread through the servers; worker 0
        # logs and writes them) and the debug dump (each worker's threads write their own files).
        with training_observers(job, out_dir, client=fleet.channel(), rank=role.index) as reporter:
            cpu = time.process_time()
            stats = job.trainer.fit(source, batch_size, epochs=epochs, max_steps=max_steps, progress=False,
                                    thread_steps_per_epoch=per_thread, first_epoch=first_epoch, skip=skip,
                                    pauses=pauses)
            cpu = time.process_time() - cpu
        # Everything is sent (geo: the last deltas) and nothing more will be: worker 0 below
        # overwrites its dense params with the servers' values, which must not count as a delta.
        fleet.close_communicators()
        fleet.push_dense(STATS_TABLE, torch.tensor(
            [float(stats.examples), stats.examples_per_sec, stats.seconds, cpu])).wait()
        log.info("%s trained: %d steps, %d examples, %.0f examples/s", role.name, stats.steps, stats.examples,
                 stats.examples_per_sec)
        ckpt = checkpoint_dir(cfg, out_dir)
        if cfg.checkpoint.save:  # where every thread stopped, for a resume
            write_progress(ckpt, role, job.steps_done + stats.steps, stats.positions, fleet)
        fleet.barrier("recps.trained")
        if role.index != 0:
            return None
        # Worker 0: evaluate what the servers hold (every worker's pushes / deltas are in).
        fleet.read_servers()
        metrics: dict[str, Any] = evaluate(job)
        total_examples, total_rate, _, total_cpu = fleet.pull_dense(STATS_TABLE).tolist()
        metrics.update(
            examples_per_sec=total_rate, train_examples=int(total_examples), train_steps=stats.steps,
            worker_cpu_seconds=total_cpu,
            train_seconds=stats.seconds, train_loss=stats.last_loss, first_losses=stats.first_losses,
            model=str(cfg.model._target_), ps=str(cfg.ps.name), threads=threads,
            servers=role.num_servers, workers=role.num_workers,
        )
        if reporter is not None:
            metrics["train_metrics"] = reporter.reports
        if strategy.mode.name == "geo":
            metrics["k_steps"] = strategy.mode.k_steps
        if best := getattr(job.data, "best_auc", None):
            metrics["best_reachable_auc"] = best
        if best_per_label := getattr(job.data, "best_aucs", None):  # multi-label generators: one per label
            metrics["best_reachable_aucs"] = dict(best_per_label)
        if pauses is not None:
            metrics["checkpoints"] = pauses.records
        if cfg.checkpoint.save:
            progress = read_progress(ckpt, role.num_workers)
            commit_ps_checkpoint(ckpt, tables, cfg, {"steps": job.steps_done + stats.steps, "workers": progress,
                                                     "origin": origin},
                                 save=lambda: fleet.save(ckpt, mode="full", tables=tables,
                                                                timeout=max(strategy.mode.timeout_s, 600.0)))
            metrics["checkpoint"] = ckpt
        from recps import fs as rfs

        rfs.write_atomic(str(out_dir / "metrics.json"), json.dumps(metrics, indent=2, sort_keys=True) + "\n",
                         overwrite=True)
        return metrics


# ---------------------------------------------------------------------------- PS checkpoints

_PROGRESS = "progress"
_WORKER_STATE = "workers"


def write_progress(ckpt: str, role, steps: int, positions, fleet) -> None:
    """<checkpoint>/progress/worker-XXXXX.json: this worker's steps and each thread's (epoch, batches);
    and what only the worker holds (Fleet.worker_state: geo's replica and dense optimizer state) in
    <checkpoint>/workers/worker-XXXXX.pt, named by the progress record ("state_file"), so the
    manifest records its size and sha256 (recps.checkpoint.commit_ps_checkpoint)."""
    import io

    import torch

    from recps import fs as rfs

    record = {"worker": role.index, "num_workers": role.num_workers, "steps": steps,
              "positions": [list(p) for p in positions or ()]}
    writes = []
    state = fleet.worker_state()
    if state:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        record["state_file"] = rel = f"{_WORKER_STATE}/worker-{role.index:05d}.pt"
        writes.append(lambda: rfs.write_atomic(rfs.join(ckpt, rel), buffer.getbuffer(), overwrite=True))
    # Both are read only after the meeting's barrier, so they are written at once (rfs.concurrently).
    progress = rfs.join(ckpt, _PROGRESS, f"worker-{role.index:05d}.json")
    writes.append(lambda: rfs.write_atomic(progress, json.dumps(record), overwrite=True))
    rfs.concurrently(writes)


def load_worker_state(folder: str, manifest: dict, state_files: Sequence[str], fleet) -> None:
    """The workers' state files of a checkpoint (each checked against the manifest) into the fleet:
    this worker's own on a resume onto as many workers, else all of them merged
    (recps.ps.fleet.merge_worker_states)."""
    import io

    import torch

    from recps.checkpoint import read_recorded
    from recps.ps.fleet import merge_worker_states

    states = [torch.load(io.BytesIO(read_recorded(folder, manifest, rel)), map_location="cpu", weights_only=True)
              for rel in state_files]
    fleet.load_worker_state(states[0] if len(states) == 1 else merge_worker_states(states))


def read_progress(ckpt: str, num_workers: int) -> list[dict]:
    from recps import fs as rfs

    return [json.loads(rfs.read_bytes(rfs.join(ckpt, _PROGRESS, f"worker-{w:05d}.json")))
            for w in range(num_workers)]


class CheckpointPauses:
    """`recps.trainer.Pauses` of ps.checkpoint_every_steps / ps.checkpoint_every_seconds: committed
    checkpoints of a running job at `<checkpoint dir>/step-N/` (N: each worker's steps, over its
    threads, since the job began: the resumed steps count).

    The workers agree first (one barrier) on the smallest number of steps any of them will take;
    meetings fall strictly before it (the checkpoint at the end covers the rest), so every worker
    meets the same number of times. At a meeting each worker's threads stand between two steps;
    the worker drains its communicators (async: every queued and in-flight push applied; geo: the
    deltas since the last sync sent and added; sync: nothing is pending after a step) and writes
    its progress, then at a barrier of every worker (nothing more is pushed until it ends) worker 0
    has the servers save the tables and commits the manifest. With checkpoint_every_seconds the
    first meeting, after checkpoint_check_steps steps, only measures worker 0's step rate; each
    later one is a checkpoint and worker 0 sets the steps to the next from its rate (through
    CONTROL_TABLE). `records`: per checkpoint its folder, steps, pause and save seconds (worker 0)."""

    def __init__(self, fleet, cfg: DictConfig, job, mode, root: str, tables: Sequence[str], planned: int,
                 origin: dict | None = None) -> None:
        import torch

        self.fleet, self.cfg, self.job, self.root, self.tables = fleet, cfg, job, root, list(tables)
        self.origin = origin or {"epoch": 0, "steps": 0}  # where the job began, recorded in each checkpoint
        self.role = fleet.role
        self.threads = int(cfg.trainer.threads)
        self.unit = self.threads if mode.name == "sync" else 1  # sync: every thread takes each step
        self.every_steps, self.every_s = mode.checkpoint_every_steps, mode.checkpoint_every_seconds
        self.check_steps = int(mode.checkpoint_check_steps)
        self.timeout_s = max(float(mode.timeout_s), 600.0)
        self.records: list[dict] = []
        self.meetings = 0
        self.interval = 0  # checkpoint_every_seconds: the steps to the next meeting
        self.control = 0  # ... as CONTROL_TABLE holds them (worker 0 pushes the change)
        self.met_at = 0  # the fit's steps at the last meeting
        self.at: int | None = None
        self.clock = time.perf_counter()
        w, workers = self.role.index, self.role.num_workers
        fleet.create_dense_table(CONTROL_TABLE, 2 * workers + 1, mode="geo")
        plan = torch.zeros(2 * workers + 1)
        plan[2 * w], plan[2 * w + 1] = float(planned >> 20), float(planned & (2**20 - 1))
        fleet.push_dense(CONTROL_TABLE, plan).wait()
        fleet.barrier("recps.checkpoint.plan", timeout=self.timeout_s)
        values = [int(v) for v in fleet.pull_dense(CONTROL_TABLE).tolist()]
        self.limit = min((values[2 * i] << 20) | values[2 * i + 1] for i in range(workers))
        log.info("%s: checkpoints every %s during training, before step %d (the fewest steps of a worker)",
                 self.role.name, f"{self._round(self.every_steps)} steps" if self.every_steps else f"{self.every_s:g} s",
                 self.limit)

    def _round(self, steps: int) -> int:
        return max(self.unit, -(-int(steps) // self.unit) * self.unit)

    def _next(self, steps: int) -> int | None:
        at = steps + self._round(self.every_steps if self.every_steps else self.interval)
        self.at = at if at < self.limit else None
        return self.at

    def first(self) -> int | None:
        if self.every_steps:
            return self._next(0)
        self.interval = self._round(self.check_steps)
        return self._next(0)

    def pause(self, steps: int, positions: list[tuple[int, int]]) -> int | None:
        import torch

        from recps import fs as rfs
        from recps.checkpoint import commit_ps_checkpoint, is_committed, prune_step_checkpoints

        start = time.perf_counter()
        fleet, role = self.fleet, self.role
        trained_s = start - self.clock
        self.meetings += 1
        saving = bool(self.every_steps) or self.meetings > 1  # (seconds) the first meeting measures the rate
        at = self.at if self.at is not None else steps
        total = self.job.steps_done + at
        folder = rfs.join(self.root, f"step-{total}")
        fleet.flush()  # drained: everything this worker pushed is applied (geo: its deltas added)
        if saving:
            write_progress(folder, role, self.job.steps_done + steps, positions, fleet)
        fleet.barrier(f"recps.checkpoint.{self.meetings}", timeout=self.timeout_s)  # every worker drained
        save_s = 0.0
        if role.index == 0:
            if saving:
                if is_committed(folder):
                    raise ConfigError(f"{folder} holds a committed checkpoint ({folder}/manifest.json); it is never "
                                      "overwritten: give another checkpoint.dir or hydra.run.dir (or move it away)")
                t = time.perf_counter()
                progress = read_progress(folder, role.num_workers)
                commit_ps_checkpoint(folder, self.tables, self.cfg,
                                     {"steps": self.job.steps_done + steps, "workers": progress, "origin": self.origin},
                                     save=lambda: fleet.save(folder, mode="full", tables=self.tables,
                                                              timeout=self.timeout_s))
                save_s = time.perf_counter() - t
                keep = self.cfg.checkpoint.get("keep_last")
                if keep is not None:
                    for old in prune_step_checkpoints(self.root, int(keep)):
                        log.info("%s: removed %s (checkpoint.keep_last=%d)", role.name, old, int(keep))
                for obs in self.job.trainer.observers:
                    if (hook := getattr(obs, "on_checkpoint", None)) is not None:
                        hook(folder, self.job.steps_done + steps, fleet.channel())
            if self.every_s:  # the steps to the next meeting, from worker 0's rate since the last one
                rate = (steps - self.met_at) / max(trained_s, 1e-3)
                interval = min(2**24, self._round(max(1.0, rate * float(self.every_s))))
                change = torch.zeros(2 * role.num_workers + 1)
                change[-1] = float(interval - self.control)
                fleet.push_dense(CONTROL_TABLE, change).wait()
        fleet.barrier(f"recps.checkpoint.{self.meetings}.done", timeout=self.timeout_s)
        if self.every_s:
            self.interval = self.control = int(fleet.pull_dense(CONTROL_TABLE)[-1])
        pause_s = time.perf_counter() - start
        if saving:
            self.records.append({"folder": folder, "steps": self.job.steps_done + steps,
                                 "pause_s": round(pause_s, 3), "save_s": round(save_s, 3)})
            log.info("%s: %s %s at step %d: training paused %.2f s%s", role.name,
                     "committed" if role.index == 0 else "checkpoint", folder, self.job.steps_done + steps, pause_s,
                     f" (save and commit {save_s:.2f} s)" if role.index == 0 else "")
        self.met_at, self.clock = steps, time.perf_counter()
        return self._next(at)


def _resume_point(cfg: DictConfig, job, role, threads: int, batch_size: int) -> dict:
    """Where this worker's threads continue a PS checkpoint: {"folder", "epoch", "skip" per thread}.

    The same workers x threads continue exactly where each thread stopped. Another layout takes
    the fraction of the (earliest) epoch the old threads had trained, from each new shard."""
    from recps.checkpoint import find_checkpoint, verify_ps_checkpoint
    from recps.data.sharding import WorkerShards
    from recps.ps.fleet import DENSE_TABLE

    _, folder = find_checkpoint(str(cfg.trainer.resume))
    # Each worker reads the state files it takes (load_worker_state), not all of them.
    manifest = verify_ps_checkpoint(folder, needed=[*job.collection.table_dims(), DENSE_TABLE], worker_states=False)
    if manifest["model_target"] != str(cfg.model._target_):
        raise ConfigError(f"trainer.resume: {folder} holds a {manifest['model_target']} but model={cfg.model._target_}; "
                          "resume with the model config it was trained with")
    progress = manifest["progress"]
    job.steps_done = int(progress["steps"])
    workers = progress.get("workers") or []
    positions = [p for w in workers for p in w["positions"]]
    if not positions:
        return {"folder": folder, "epoch": 0, "skip": None, "manifest": manifest, "state_files": []}
    old_threads = len(workers[0]["positions"])
    old = WorkerShards(job.data.train, 0, len(workers)).shard_batches(batch_size, old_threads)
    positions = [(e + 1, 0) if n >= old[i] else (e, n) for i, (e, n) in enumerate(positions)]  # epoch done: the next
    epoch = min(e for e, _ in positions)
    # What only the workers held (geo: replica and dense optimizer state) continues on the same workers.
    same_workers = len(workers) == role.num_workers
    state_files = [w["state_file"] for w in workers if w.get("state_file")]
    if same_workers:
        state_files = [workers[role.index]["state_file"]] if workers[role.index].get("state_file") else []
    elif state_files:
        log.info("%s: %s was trained by %d workers, this run has %d: each starts from their local state (geo) "
                 "merged", role.name, folder, len(workers), role.num_workers)
    if same_workers and old_threads == threads:
        mine = positions[role.index * threads : (role.index + 1) * threads]
        skip = [n if e == epoch else old[role.index * threads + t] for t, (e, n) in enumerate(mine)]
    else:
        frac = sum(min(1.0, n / max(1, old[i]) + (e - epoch)) for i, (e, n) in enumerate(positions)) / len(positions)
        new = WorkerShards(job.data.train, role.index, role.num_workers).shard_batches(batch_size, threads)
        skip = [round(frac * new[role.index * threads + t]) for t in range(threads)]
    log.info("%s resumes %s at step %d, epoch %d, skipping %s batches per thread", role.name, folder,
             job.steps_done, epoch, skip)
    return {"folder": folder, "epoch": epoch, "skip": skip, "manifest": manifest, "state_files": state_files}
