"""Automatic recovery (issue 15 point 2): a cluster that loses a process restarts from its last
committed checkpoint and finishes on its own, with every update counted exactly once.

The counting model (tests/helpers/counting.py): models.LR with rows that start at 0, SGD at lr 1 on the
servers (GEO: on the workers' replicas, whose deltas the servers add, ps.delta_scale=1) and loss = the sum of the
logits, so every row ends at -(its key's occurrences in the training data), counted here from the
data itself with the project's reader. A lost update leaves a row above that, a replayed one below.

- `python -m recps.train ... cluster.restarts=2` under async and GEO: server0 is killed (-9) after the
  first committed checkpoint, then, in the restarted cluster, worker1 after its first one; the job
  exits 0 by itself, its log names each cause and the checkpoint resumed from, and every row equals
  its count.
- server0, and separately worker1, SIGSTOPped for 2.5 x dead_after_s with cluster.restarts=1: the run
  does not end; exact counts.
- the same two kills under `torchrun --max-restarts` (async and GEO): torchrun restarts the processes,
  which find the last committed checkpoint themselves (TORCHELASTIC_RESTART_COUNT); exact counts.
- a tiered table (ps.table.memory_budget): server0 killed inside an eviction batch (both tiers hold its
  rows), cluster.restarts=1: exact counts, no disk tier store left behind.
- stream=hourly (cluster.restarts=3): server0 killed while the stream waits for pass 3; it restarts,
  resumes after its last record, trains pass 3 once; shows equal the data's occurrences.
- cluster.restarts and cluster.checkpoint_every are checked before anything starts.
- GEO: a sync writes the merged values into the replica only between a thread's steps (a TBE backward
  landing inside that write lost its update: the miscount once seen under torchrun).
- a restart of a job started with trainer.resume trains what is left of it, not trainer.epochs more.

The jobs run in sessions of their own (tests.helpers.cli.job_process): whatever ends a test, nothing
it started outlives it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from recps.cluster.driver import apply_checkpoint_every
from recps.config import compose_config, ps_mode, validate_config
from recps.errors import ConfigError
from recps.job.build import prepare_dataset
from tests.helpers.cli import job_process, output_excerpt, torchrun_command
from tests.helpers.counting import COUNTING_TASK, assert_exact_counts

DEAD_AFTER_S = 3
BATCH = 16
EVERY = 40  # steps between committed checkpoints
RUN_TIMEOUT_S = 240


def counting_overrides(tmp_path: Path, mode: str, epochs: int = 1) -> list[str]:
    """A 1-server, 2-worker (1 thread each) counting job on 16,000 generated rows a pass: 500 steps per
    worker (`epochs` > 1: 16,000 rows over as many epochs)."""
    extra = ["ps.k_steps=5", "ps.delta_scale=1"] if mode == "geo" else []  # deltas added as they are (not / W)
    extra.append(f"trainer.epochs={epochs}")
    return ["model=lr", f"task._target_={COUNTING_TASK}", f"ps={mode}", *extra, "ps.table.init_std=0",
            "ps.table.optimizer.name=sgd", "ps.table.optimizer.lr=1", "metrics=off", "progress=false",
            "trainer.threads=1", "cluster.workers=2", f"trainer.batch_size={BATCH}", f"cluster.checkpoint_every={EVERY}",
            f"cluster.dead_after_s={DEAD_AFTER_S}", f"dataset.dir={tmp_path / 'data'}",
            f"dataset.generate.train_rows={16000 // epochs}", "dataset.generate.test_rows=500", "dataset.generate.vocab=500"]


def train_command(overrides: list[str], run: Path) -> list[str]:
    return [sys.executable, "-m", "recps.train", *overrides, f"hydra.run.dir={run}"]


def finish(proc: subprocess.Popen, lines: list[str]) -> str:
    """The job's whole output once it exited (within RUN_TIMEOUT_S), also written beside its run folder."""
    rest, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    lines.append(rest or "")
    out = "".join(lines)
    (Path(proc.args[-1].partition("=")[2]).parent / "job.log").write_text(out)  # beside the run folder, to read after
    return out


# ------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("override, message", [
    ("cluster.restarts=-1", "cluster.restarts=-1; give how many times a failed cluster is restarted"),
    ("cluster.restarts=1.5", "cluster.restarts=1.5"),
    ("cluster.checkpoint_every=0", "cluster.checkpoint_every=0; give steps (an integer >= 1, e.g. 500), seconds"),
    ("cluster.checkpoint_every=soon", "cluster.checkpoint_every='soon'"),
])
def test_bad_recovery_settings_are_refused_before_anything_starts(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(compose_config([override]), [override])


def test_checkpoint_every_sets_the_modes_checkpoints_and_may_not_contradict_them():
    for value, steps, seconds in (("500", 500, None), ("90s", None, 90.0), ("2m", None, 120.0)):
        cfg = compose_config([f"cluster.checkpoint_every={value}"])
        validate_config(cfg)
        apply_checkpoint_every(cfg)
        mode = ps_mode(cfg)
        assert (mode.checkpoint_every_steps, mode.checkpoint_every_seconds) == (steps, seconds)
        apply_checkpoint_every(cfg)  # again, as each process of the cluster does: the same
    override = ["cluster.checkpoint_every=50", "ps.checkpoint_every_seconds=30"]
    with pytest.raises(ConfigError, match=r"cluster.checkpoint_every=50 and ps.checkpoint_every_seconds=30(\.0)? both set"):
        validate_config(compose_config(override), override)
    assert compose_config([]).cluster.restarts == 0
    assert compose_config(["stream=hourly", "stream.root=/r", "stream.out=/o"]).cluster.restarts == 3


# ------------------------------------------------------------------------- GEO's sync vs. training


def test_geo_sync_writes_merged_values_only_between_a_threads_steps():
    """A GEO sync adds the merged values into the replica's rows (read, add, write back); the TBE's
    backward of a step in flight writes the same rows. One landing inside that write was lost for
    good (a row of the counting model once ended with 8 of its 10 updates; a sync thread adding
    zeros to the rows of a TBE that trains lost 122 updates in 5,000 steps). So a sync waits for the
    steps in flight, and a step that begins meanwhile waits for the sync: here a sync started while
    a step is between its forward and step_end ends only after it, and every update counts once."""
    import threading

    from recps.ps.modes import server_halves
    from recps.ps.modes.geo import GeoMode
    from recps.ps.node import PSClient, PSServer, TableConfig

    sgd = {"name": "sgd", "lr": 1.0}
    with PSServer(token="geo-gate", halves=server_halves()) as server, \
            PSClient([server.endpoint], token="geo-gate", timeout_s=20.0) as client:
        client.create_sparse_table("emb", dim=1, optimizer=sgd, initializer={"kind": "zeros"}, mode="geo")
        geo = GeoMode(table=TableConfig(optimizer=sgd), k_steps=1000, background_sync=False, delta_scale=1.0,
                      timeout_s=20.0).communicator(client)
        keys = torch.tensor([3, 5, 5, 8])  # one bag each of 4 features; key 5 twice
        offsets = torch.arange(5)

        def step() -> torch.Tensor:
            return geo.lookup_bags("emb", keys, offsets, 4)  # (1, 4): this thread is inside a step

        step().sum().backward()  # step 1, ended
        geo.step_end(0)
        pooled = step()  # step 2: forward done, its backward not yet
        synced = threading.Event()
        sync = threading.Thread(target=lambda: (geo.sync(), synced.set()), daemon=True)
        sync.start()
        assert not synced.wait(0.5), "the sync wrote the rows while a step was in flight"
        pooled.sum().backward()  # the fused SGD writes the rows now, no sync inside its write
        geo.step_end(0)
        assert synced.wait(10.0), "the sync did not go on after the step ended"
        sync.join(10.0)
        geo.flush()
        rows = client.pull("emb", torch.tensor([3, 5, 8]), assume_unique=True).wait(10.0)[:, 0]
        assert rows.tolist() == [-2.0, -4.0, -2.0]  # 2 steps: key 5 twice a step
        with torch.no_grad():  # a forward without a backward (evaluation) keeps no sync waiting
            step()
        geo.sync()


def test_a_restart_of_a_resumed_job_trains_what_is_left_of_it(tmp_path, monkeypatch, in_process_cluster):
    """A user resumes a 1-epoch checkpoint with trainer.epochs=2: the job trains epochs 1 and 2. A restart
    of it (RECPS_RESTART_COUNT=1) resumes its own last committed checkpoint, step-120 (checkpoints fall on
    the multiples of 30 of the job's step count: 20 steps into epoch 1), and trains what is left of those 2
    epochs (180 steps), not 2 counted from epoch 0 (the rest of epoch 1): every row ends at 3 x its
    occurrences, as the job without a restart."""
    from recps.cluster.driver import resume_after_restart
    from recps.ps.roles import UserDefinedRoleMaker

    base = [o for o in counting_overrides(tmp_path, "async") if not o.startswith(("dataset.generate.train_rows=",
                                                                                   "cluster.checkpoint_every=",
                                                                                   "trainer.epochs=", "cluster.workers="))]
    base += ["cluster.workers=1", "dataset.generate.train_rows=1600"]  # 100 steps an epoch
    first = tmp_path / "first"
    in_process_cluster(compose_config([*base, "trainer.epochs=1"]), first, token="resumed")
    job = [*base, "trainer.epochs=2", f"trainer.resume={first / 'checkpoint'}", "ps.checkpoint_every_steps=30"]
    straight = in_process_cluster(compose_config(job), tmp_path / "straight", token="resumed")
    assert straight["train_steps"] == 200
    # The restarted job: its run folder holds the checkpoint it committed 20 steps after the resume.
    restarted = tmp_path / "restarted"
    shutil.copytree(tmp_path / "straight" / "checkpoint" / "step-120", restarted / "checkpoint" / "step-120")
    monkeypatch.setenv("RECPS_RESTART_COUNT", "1")
    cfg = compose_config(job)
    resume_after_restart(cfg, UserDefinedRoleMaker("worker", 0, 1, 1, "127.0.0.1:1", "t").role(), restarted)
    assert cfg.trainer.resume == str(restarted / "checkpoint" / "step-120")
    metrics = in_process_cluster(cfg, restarted, token="resumed")
    assert metrics["train_steps"] == 180 and metrics["step"] == 300  # the job's count goes on across the restart
    expected = [*base, "trainer.epochs=3"]  # the data's occurrences x 3: the first epoch and the job's 2
    assert assert_exact_counts(expected, restarted / "checkpoint") == assert_exact_counts(expected, tmp_path / "straight"
                                                                                          / "checkpoint") > 500


# ------------------------------------------------------------------------------- under recps.launch


COMMITTED = r"\[worker0\].*committed \S+/(step-\d+)"
RESTART = r"restart (\d) of {n} in [\d.]+ s: (\w+) \(pid \d+\) (was killed by SIGKILL|exited with code \d+)(.*)"


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("mode, epochs", [("async", 1), ("geo", 2)])
def test_killed_server_then_worker_recovered_with_every_row_counted_once(tmp_path, mode, epochs, launch_output):
    """kill -9 of server0 after a committed checkpoint (GEO: 2 epochs of 250 steps, one in the second
    epoch), then of worker1 after one of the restarted cluster. cluster.restarts=4: on a crowded
    machine a process starved at start-up for dead_after_s may cost a restart too (liveness declares
    it dead); those are allowed, the counts hold whatever restarted."""
    overrides = [*counting_overrides(tmp_path, mode, epochs), "cluster.restarts=4"]
    first = COMMITTED if epochs == 1 else r"\[worker0\].*committed \S+/(step-(2[6-9]\d|[3-9]\d\d))"
    run = tmp_path / "run"
    started = time.monotonic()
    pids: dict[str, int] = {}
    lines: list[str] = []
    with job_process(train_command(overrides, run)) as proc:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        launch_output(proc, first, lines, pids, deadline)
        os.kill(pids["server0"], signal.SIGKILL)
        launch_output(proc, r"restart \d of 4 in [\d.]+ s: server0 \(pid \d+\) was killed by SIGKILL", lines, pids, deadline)
        # The restarted cluster resumes from the last committed checkpoint and commits the next one.
        launch_output(proc, COMMITTED, lines, pids, deadline)
        os.kill(pids["worker1"], signal.SIGKILL)
        out = finish(proc, lines)
    took = time.monotonic() - started
    restarts = re.findall(RESTART.format(n=4), out)
    print(f"{mode}: server0 then worker1 killed; {len(restarts)} restarts; {took:.1f} s")
    assert proc.returncode == 0, out[-5000:]
    killed = [(who, rest) for _, who, how, rest in restarts if how == "was killed by SIGKILL"]
    assert [who for who, _ in killed] == ["server0", "worker1"], out[-5000:]
    for _, rest in killed:  # each names the checkpoint it resumes from
        folder = re.search(r"resuming from (\S+/step-\d+)$", rest)
        assert folder and (Path(folder.group(1)) / "manifest.json").is_file(), rest
    metrics = json.loads((run / "metrics.json").read_text())
    assert len(metrics["restarts"]) == len(restarts), metrics.get("restarts")
    assert assert_exact_counts(overrides, run / "checkpoint") > 1000


@pytest.mark.e2e
@pytest.mark.slow
def test_a_server_killed_while_it_evicts_to_its_disk_tier_restarts_with_every_row_counted_once(tmp_path, launch_output):
    """ps.table.memory_budget=200 (the counting model's thousands of rows: most live on disk, every few requests
    evict a batch): once a checkpoint is committed, server0 is killed (-9) inside an eviction batch, its rows
    written to disk and not yet removed from memory (RECPS_TIER_HOLD_EVICTION, a test hook: the server logs
    that it holds there). cluster.restarts=1: the restarted cluster loads the checkpoint into tiered tables and
    finishes; every row equals its count, the job's metrics report the table's tiers, and no disk tier store is
    left under RECPS_TIER_DIR (the killed server's is removed by the restarted one, the last at its stop)."""
    overrides = [*counting_overrides(tmp_path, "async"), "cluster.restarts=1", "ps.table.memory_budget=200"]
    run, tier_dir, marker = tmp_path / "run", tmp_path / "tier", tmp_path / "hold-eviction"
    tier_dir.mkdir()
    env = {**os.environ, "RECPS_TIER_DIR": str(tier_dir), "RECPS_TIER_HOLD_EVICTION": str(marker)}
    pids: dict[str, int] = {}
    lines: list[str] = []
    with job_process(train_command(overrides, run), env=env) as proc:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        launch_output(proc, COMMITTED, lines, pids, deadline)
        marker.write_text("")  # the next eviction batch holds
        launch_output(proc, r"\[server0\].*table embedding_d1: holding an eviction batch of \d+ rows", lines, pids,
                      deadline)
        killed = pids["server0"]
        stores = [p for p in tier_dir.iterdir() if (p / "owner").read_text().split()[1] == str(killed)]
        assert len(stores) == 1, list(tier_dir.iterdir())  # the killed server's store, with rows on disk
        os.kill(killed, signal.SIGKILL)
        launch_output(proc, r"restart 1 of 1 in [\d.]+ s: server0 \(pid \d+\) was killed by SIGKILL.*resuming from "
                            r"\S+/step-\d+", lines, pids, deadline)
        out = finish(proc, lines)
    assert proc.returncode == 0, output_excerpt(lines)
    assert not marker.exists()
    assert re.search(rf"removing the disk tier store {re.escape(str(stores[0]))} of process {killed}, which is gone",
                     out), output_excerpt(lines)
    assert list(tier_dir.iterdir()) == [], list(tier_dir.iterdir())
    metrics = json.loads((run / "metrics.json").read_text())
    assert len(metrics["restarts"]) == 1
    rows = assert_exact_counts(overrides, run / "checkpoint")
    tier = metrics["disk_tier"]["embedding_d1"]
    assert tier["rows_memory"] <= 200 and tier["rows_memory"] + tier["rows_disk"] == rows > 1000


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("victim", ["server0", "worker1"])
def test_a_process_stalled_past_dead_after_s_does_not_end_a_run_with_restarts(tmp_path, victim, launch_output):
    """SIGSTOP for 2.5 x dead_after_s: the stalled process is declared dead, the cluster is stopped (the
    stalled one continued with its SIGTERM) and restarted once, the run exits 0 with exact counts."""
    overrides = [*counting_overrides(tmp_path, "async"), "cluster.restarts=1"]
    run = tmp_path / "run"
    pids: dict[str, int] = {}
    lines: list[str] = []
    with job_process(train_command(overrides, run)) as proc:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        launch_output(proc, r"\[worker0\].*committed \S+/(step-\d+)", lines, pids, deadline)
        stalled = pids[victim]
        os.kill(stalled, signal.SIGSTOP)
        time.sleep(2.5 * DEAD_AFTER_S)
        with contextlib.suppress(ProcessLookupError):  # the launcher has stopped it already (SIGTERM + SIGCONT)
            os.kill(stalled, signal.SIGCONT)
        out = finish(proc, lines)
    assert proc.returncode == 0, out[-5000:]
    restarts = re.findall(RESTART.format(n=1), out)
    assert len(restarts) == 1 and victim in restarts[0][1] + restarts[0][3], out[-5000:]  # the cause names it
    assert re.search(r"resuming from \S+/step-\d+$", restarts[0][3]), restarts
    assert "ignored SIGTERM" not in out, f"the stopped {victim} was not continued with its SIGTERM"
    assert assert_exact_counts(overrides, run / "checkpoint") > 1000


@pytest.mark.e2e
@pytest.mark.slow
def test_a_stream_restarts_itself_and_resumes_from_its_records_exactly_once(tmp_path, launch_output):
    """stream=hourly (cluster.restarts=3 there): server0 killed while the stream waits for pass 3; the
    restarted cluster resumes after the last recorded pass (recps.stream's own resume, as a rerun of
    the command would), trains pass 3 once and finishes; the servers' shows equal the data's
    occurrences over the 3 passes and every record is written once."""
    from recps import fs as rfs
    from recps.data.generators.drifting import write_stream
    from tests.helpers.streams import pass_counts, stats  # the stream tests' recomputations from the data

    day, root, out = "20261201", str(tmp_path / "clicks"), str(tmp_path / "model")
    info = write_stream(root, days=1, hours=3, rows=2000, start_day=day)
    held = rfs.join(info.split_path(day, 120), "_SUCCESS")  # pass 3's split is not ready yet
    fs, held_path = rfs.resolve(held)
    fs.rm_file(held_path)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "recps.train", "stream=hourly", f"stream.root={root}", f"stream.out={out}", "ps=async",
           "model=deepfm", "trainer.threads=1", "trainer.batch_size=256", "cluster.workers=2", f"stream.start_day={day}",
           f"stream.end_day={day}", "stream.hours=3", "stream.data_sleep_second=0.2", f"cluster.dead_after_s={DEAD_AFTER_S}",
           "ps.table.accessor.show_click_decay_rate=1.0", "ps.table.accessor.delete_threshold=0", f"hydra.run.dir={run}"]
    pids: dict[str, int] = {}
    lines: list[str] = []
    with job_process(cmd) as proc:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        launch_output(proc, r"waiting for .*0200/_SUCCESS", lines, pids, deadline)
        os.kill(pids["server0"], signal.SIGKILL)
        launch_output(proc, r"restart 1 of 3 in [\d.]+ s: server0 \(pid \d+\) was killed by SIGKILL.*the stream resumes "
                            r"from its records", lines, pids, deadline)
        launch_output(proc, r"waiting for .*0200/_SUCCESS", lines, pids, deadline)  # the restarted stream
        rfs.write_atomic(held, b"")
        text = finish(proc, lines)
    assert proc.returncode == 0, text[-5000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["stream"]["resumed_from"] == f"{out}/{day}/2"
    assert [p["pass"] for p in metrics["stream"]["passes"] if "pass" in p] == [3]
    records = [line.split("\t") for line in rfs.read_bytes(rfs.join(out, "donefile.txt")).decode().splitlines()]
    assert [(r[0], r[3]) for r in records] == [(day, "1"), (day, "2"), (day, "3"), ("20261202", "-1")], records
    patches = [json.loads(x) for x in rfs.read_bytes(rfs.join(out, "patch_donefile.txt")).decode().splitlines()]
    assert [p["input"].rsplit("/", 1)[-1] for p in patches] == ["delta-1", "delta-2", "delta-3"]  # each once
    final = stats(f"{out}/{day}/3")
    keys = torch.cat([pass_counts(root, day, h)[0] for h in range(3)])
    shows = torch.cat([pass_counts(root, day, h)[1] for h in range(3)])
    uniq, inverse = torch.unique(keys, return_inverse=True)
    total = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, shows)
    assert torch.equal(final["keys"], uniq)
    assert torch.equal(final["show"], total)


# ---------------------------------------------------------------------------------- under torchrun


def _children_by_rank(parent: int) -> dict[int, int]:
    """torchrun's agent's worker processes (its children with RANK in their environment): rank -> pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != parent:
                continue
            env = dict(item.split("=", 1) for item in (entry / "environ").read_bytes().decode(errors="replace")
                       .split("\0") if "=" in item)
        except (OSError, IndexError, ValueError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(entry.name)
    return found


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "geo"])
def test_killed_server_then_worker_recovered_by_torchrun_elastic_restarts(tmp_path, mode, launch_output):
    """torchrun --max-restarts does the restarts (no recps.launch): rank 0 (server0) killed after a
    committed checkpoint, then rank 2 (worker1) after one of the restarted processes; each time they
    find the last committed checkpoint themselves (TORCHELASTIC_RESTART_COUNT > 0)."""
    overrides = counting_overrides(tmp_path, mode)
    run = tmp_path / "run"
    # The data set exists before torchrun starts (a cluster of processes does not generate it).
    cfg = compose_config(overrides)
    prepare_dataset(cfg.dataset, seed=int(cfg.seed))
    # 2 restarts for the kills; the other 8 absorb what a crowded machine adds (a process that fails its
    # start-up costs torchrun a restart too): the assertions below count the restarts the kills caused.
    cmd, ports = torchrun_command(3, "-m", "recps.train", *overrides, f"hydra.run.dir={run}", max_restarts=10)
    started = time.monotonic()
    lines: list[str] = []
    unused: dict[str, int] = {}
    with job_process(cmd, env={**os.environ, **ports, "RECPS_CLUSTER_TOKEN": "torchrun-recovery-token"}) as proc:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        launch_output(proc, r"worker0: committed \S+/step-\d+", lines, unused, deadline)
        ranks = _children_by_rank(proc.pid)
        assert set(ranks) == {0, 1, 2}, (ranks, "".join(lines[-40:]))
        os.kill(ranks[0], signal.SIGKILL)  # rank 0: server0 (the first cluster.servers ranks serve)
        launch_output(proc, r"worker0: restart \d+: resuming from \S+/step-\d+", lines, unused, deadline)
        launch_output(proc, r"worker0: committed \S+/step-\d+", lines, unused, deadline)
        ranks = _children_by_rank(proc.pid)
        os.kill(ranks[2], signal.SIGKILL)  # rank 2: worker1
        out = finish(proc, lines)
    print(f"torchrun {mode}: server0 then worker1 killed; {time.monotonic() - started:.1f} s")
    assert proc.returncode == 0, output_excerpt(lines)
    resumed = re.findall(r"(worker\d|server\d): restart (\d+): resuming from \S+/step-\d+", out)
    by_restart: dict[str, set[str]] = {}
    for who, n in resumed:
        by_restart.setdefault(n, set()).add(who)
    complete = [n for n, who in by_restart.items() if who >= {"server0", "worker0", "worker1"}]
    assert len(complete) >= 2, (resumed, output_excerpt(lines))  # each kill: a restart in which all 3 resumed
    assert assert_exact_counts(overrides, run / "checkpoint") > 1000
