"""`python -m recps.serve`: a real HTTP server following a stream that trains on the real HDFS.

One stream (2 days x 2 hourly passes, 1 server + 1 worker) trains while the server follows its
donefiles from before the first record (module fixture, shared by the tests). What is checked:
- before anything is committed, /healthz and /v1/score answer 503 "not ready";
- a client polling /v1/score sees the served (day, pass) and version only go forward, and every
  answer equals, bit for bit, the model of the version it names recomputed independently: a PS
  server in this process loads the version's base and then its deltas (SparseTable.load's own delta
  application), the model reads it through ServerReader, and the request's rows are the Criteo
  reader's parse of the same values written as a data line;
- every delta the server applied, it applied once (its log), and /metrics names the final version;
- a corrupted delta is refused and the previous version kept (in /healthz, /metrics and the log),
  applied once repaired; a folder without its manifest (a save cut short) is refused; a server
  killed with SIGKILL and started again comes back at the newest version the records name, also when
  killed in the middle of applying a delta (a test hook holds it there); a newer
  base of another model is refused, naming it, and the served version kept (a restart takes it); a
  server restarted while the newest base is corrupt serves the newest earlier base with its deltas;
- bad requests get 400 / 413 / 422 naming what was wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import torch

from recps import fs as rfs
from recps.cluster.launch import free_port
from recps.data.generators.drifting import write_stream
from recps.data.reader import load_tensors
from recps.stream.donefile import Donefiles
from tests.helpers.cli import PROJECT_ROOT, child_env, job_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DAYS, HOURS, ROWS = ("20261201", "20261202"), 2, 1500
TRAIN_TIMEOUT_S = 420
READY_TIMEOUT_S = 120
MAX_CANDIDATES = 64
TABLE = "embedding_d11"  # deepfm's one PS table (conf/model/deepfm.yaml: every feature 11 wide)


# ------------------------------------------------------------------------------------ the server


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path

    def get(self, path: str) -> requests.Response:
        return requests.get(self.url + path, timeout=30)

    def score(self, body) -> requests.Response:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return requests.post(self.url + "/v1/score", data=data, headers={"Content-Type": "application/json"},
                             timeout=60)

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in self.get("/metrics").text.splitlines():
            if line.startswith("recps_"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait(self, ready, what: str, timeout: float = READY_TIMEOUT_S) -> dict:
        """Polls /healthz until `ready(body)`; returns the body."""
        deadline = time.monotonic() + timeout
        body: dict = {}
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"recps.serve exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
            try:
                body = self.get("/healthz").json()
                if ready(body):
                    return body
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"recps.serve: no {what} within {timeout:.0f} s; /healthz {body}\n"
                             f"{self.log.read_text()[-3000:]}")


def start_server(out: str, log: Path, env: dict[str, str] | None = None) -> Server:
    """`python -m recps.serve OUT` on a free port of 127.0.0.1, its output to `log` (`env`: added variables)."""
    port = free_port()
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "recps.serve", out, "--port", str(port), "--poll-seconds", "0.2",
                                 "--max-candidates", str(MAX_CANDIDATES)], cwd=PROJECT_ROOT, env=child_env() | (env or {}),
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:  # listening (ready or not)
        assert proc.poll() is None, f"recps.serve exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            server.get("/healthz")
            return server
        except requests.ConnectionError:
            time.sleep(0.2)
    stop(server)
    raise AssertionError(f"recps.serve did not listen within {READY_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def stop(server: Server, sig: int = signal.SIGTERM) -> None:
    """Stops the server by its PID (SIGKILL if SIGTERM is not enough within 30 s)."""
    if server.proc.poll() is None:
        os.kill(server.proc.pid, sig)
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(server.proc.pid, signal.SIGKILL)
            server.proc.wait()


# ------------------------------------------------------------------- requests and their reference


def request_rows(root: str) -> tuple[dict, list[dict], str]:
    """A request made of the stream's own values (the user: line 0's I1..I13 and C1..C13; each
    candidate: C14..C26 of a later line), plus one candidate with a value never seen and one with
    missing values; and the same rows as Criteo text lines (label 0) for the reader."""
    part = rfs.read_bytes(rfs.join(root, DAYS[0], "0000", "part-00000")).decode()
    lines = [x.split("\t") for x in part.splitlines()[:8]]
    dense = [None if v == "" else (float(v) if "." in v else int(v)) for v in lines[0][1:14]]
    user = {f"I{i + 1}": v for i, v in enumerate(dense)} | {f"C{i}": lines[0][13 + i] or None for i in range(1, 14)}
    candidates = [{f"C{i}": line[13 + i] or None for i in range(14, 27)} for line in lines[1:]]
    candidates.append({"C14": "never-seen-value", "C15": None})
    text = []
    for c in candidates:
        fields = ["0", *("" if v is None else str(v) for v in dense),
                  *(user[f"C{i}"] or "" for i in range(1, 14)), *((c.get(f"C{i}") or "") for i in range(14, 27))]
        text.append("\t".join(fields))
    return user, candidates, "\n".join(text) + "\n"


class Reference:
    """The model of a version, recomputed without recps.serve: a PS server in this process loads the
    version's base, then each of its deltas in order; the model reads it through ServerReader."""

    def __init__(self, out: str, examples_file: Path) -> None:
        from omegaconf import OmegaConf

        from recps.config import register_resolvers
        from recps.job.build import build_job, schema_data

        register_resolvers()
        done = Donefiles(out)
        self.bases, self.patches = done.bases(), done.patches()
        some = done.export_folder(self.patches[0])
        cfg = OmegaConf.create(rfs.read_bytes(rfs.join(some, "config.yaml")).decode())
        self.job = build_job(cfg, schema_data(cfg))
        self.examples = load_tensors(examples_file, self.job.data.schema, error_budget=0.0)
        self.cache: dict[tuple[str, int], list] = {}

    def folders(self, version: dict) -> list[str]:
        key, n = version["base_key"], version["deltas"]
        base = [Donefiles.export_folder(b) for b in self.bases if b["key"] == key]
        deltas = [Donefiles.export_folder(p) for p in self.patches if p["key"] == key]
        assert len(deltas) >= n, (version, deltas)
        return base + deltas[:n]

    def probs(self, version: dict) -> list:
        from recps.data.dataset import ExamplesSource
        from recps.ps.fleet import DENSE_TABLE
        from recps.ps.modes import ServerReader
        from recps.ps.modes.dense import assign_flat
        from tests.helpers.cluster import ps_servers

        ident = (version["base_key"], version["deltas"])
        if ident not in self.cache:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # as the server's (--threads 1): the same kernels, the same bits
            with ps_servers(1) as (_, client):
                for folder in self.folders(version):  # a base replaces, a delta is applied on top
                    client.load(folder, tables=[TABLE, DENSE_TABLE])
                self.job.collection.bind(ServerReader(client))
                params = [p for g in self.job.optimizer.param_groups for p in g["params"]]
                assign_flat(params, client.pull_dense(DENSE_TABLE).wait())
                probs, _ = self.job.trainer.predict(ExamplesSource(self.examples, False), len(self.examples))
            torch.set_num_threads(threads)
            self.cache[ident] = probs.tolist()
        return self.cache[ident]


# --------------------------------------------------------------------------- the followed stream


@dataclass
class Followed:
    server: Server
    out: str
    root: str
    user: dict
    candidates: list[dict]
    reference: Reference
    answers: list[dict]  # every 200 /v1/score body, in order
    not_ready: tuple[requests.Response, requests.Response]  # /healthz, /v1/score before any record
    tmp: Path


@pytest.fixture(scope="module")
def followed(hdfs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    root, out = f"{hdfs.url}/serve/clicks", f"{hdfs.url}/serve/model"
    write_stream(root, days=len(DAYS), hours=HOURS, rows=ROWS, start_day=DAYS[0])
    user, candidates, text = request_rows(root)
    (tmp / "request.txt").write_text(text)
    server = start_server(out, tmp / "serve.log")
    try:
        not_ready = (server.get("/healthz"), server.score({"user": user, "candidates": candidates}))
        cmd = [sys.executable, "-m", "recps.train", "stream=hourly", f"stream.root={root}", f"stream.out={out}",
               "ps=async", "model=deepfm", "trainer.threads=1", "trainer.batch_size=256", "cluster.workers=1",
               f"stream.start_day={DAYS[0]}", f"stream.end_day={DAYS[-1]}", f"stream.hours={HOURS}",
               "stream.data_sleep_second=0.2", "ps.table.accessor.base_threshold=1.45", f"hydra.run.dir={tmp / 'run'}"]
        answers = []
        with job_process(cmd, env=child_env()) as train:
            deadline = time.monotonic() + TRAIN_TIMEOUT_S
            while train.poll() is None and time.monotonic() < deadline:
                r = server.score({"user": user, "candidates": candidates})
                if r.status_code == 200:
                    answers.append(r.json())
                time.sleep(0.25)
            output = train.stdout.read()
            assert train.wait(timeout=60) == 0, output[-4000:]
        last_base = f"{out}/20261203/base"  # the end of day 2: the newest version there is
        server.wait(lambda b: b.get("ready") and b["version"]["base"] == last_base, "final base")
        answers.append(server.score({"user": user, "candidates": candidates}).json())
        yield Followed(server, out, root, user, candidates, Reference(out, tmp / "request.txt"), answers, not_ready,
                       tmp)
    finally:
        stop(server)


def _order(f: Followed, version: dict) -> tuple:
    """A version's place in the stream: (day, pass, base record index (-1: none yet), deltas)."""
    keys = [b["key"] for b in f.reference.bases]
    return (version["day"], version["pass"], keys.index(version["base_key"]) if version["base_key"] in keys else -1,
            version["deltas"])


def test_not_ready_until_a_version_is_committed(followed):
    health, score = followed.not_ready
    assert health.status_code == 503 and health.json()["ready"] is False
    assert "no base or delta is recorded" in health.json()["reason"]
    assert score.status_code == 503 and score.json()["detail"].startswith("not ready")


def test_answers_follow_the_stream_and_equal_the_version_they_name(followed):
    answers = followed.answers
    versions = [a["version"] for a in answers]
    assert len({(v["base_key"], v["deltas"]) for v in versions}) >= 3, versions  # it followed, not just loaded
    places = [_order(followed, v) for v in versions]
    assert places == sorted(places), places  # (day, pass) and the version only go forward
    for a in answers:
        assert len(a["probs"]) == len(followed.candidates)
        # bit for bit: float32 probabilities through JSON (a float64 repr) come back exactly
        assert a["probs"] == followed.reference.probs(a["version"]), a["version"]
    assert answers[-1]["unknown_keys"] >= 1  # the never-seen value reads the zero row, counted


def test_each_delta_applied_once_and_metrics_name_the_served_version(followed):
    log = followed.server.log.read_text()
    applied = re.findall(r"\(delta (\S+) applied", log)
    assert applied and len(applied) == len(set(applied)), applied
    bases = re.findall(r"\(base (\S+) applied", log)
    assert bases[-1] == f"{followed.out}/20261203/base" and len(bases) == len(set(bases)), bases
    m = followed.server.metrics()
    final = followed.answers[-1]["version"]
    assert m["recps_served_day"] == int(final["day"]) == 20261202 and m["recps_served_pass"] == final["pass"] == HOURS
    assert m["recps_served_base_key"] == int(final["base_key"]) and m["recps_served_deltas"] == 0
    assert m["recps_deltas_applied_total"] == len(applied) and m["recps_bases_loaded_total"] == len(bases)
    assert m['recps_refused_total{kind="delta"}'] == 0 and m["recps_ready"] == 1
    assert m["recps_served_staleness_seconds"] >= 0
    assert m['recps_requests_total{code="200",route="/v1/score"}'] == len(followed.answers)
    assert m['recps_served_rows{table="embedding_d11"}'] == int(
        json.loads(rfs.read_bytes(f"{followed.out}/20261203/base/manifest.json"))["progress"]["stream"]["rows"])


def test_bad_requests_are_answered_4xx_naming_the_fault(followed):
    s, user, candidates = followed.server, followed.user, followed.candidates
    r = s.score('{"user": {"I1": 3,')
    assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]
    r = s.score({"user": user, "candidates": candidates, "rank": True})
    assert r.status_code == 422 and "unknown field 'rank'" in r.json()["detail"]
    r = s.score({"user": user, "candidates": [{"C99": "a"}]})
    assert r.status_code == 422 and "unknown feature(s) ['C99']" in r.json()["detail"]
    r = s.score({"user": user, "candidates": [{"C14": "a"}] * (MAX_CANDIDATES + 1)})
    assert r.status_code == 413 and f"at most {MAX_CANDIDATES}" in r.json()["detail"]
    r = s.score({"user": {"I1": "three"}, "candidates": [{"C14": "a"}]})
    assert r.status_code == 422 and "dense feature I1 takes a number" in r.json()["detail"]
    r = s.score({"user": user, "candidates": []})
    assert r.status_code == 422 and "candidates" in r.json()["detail"]
    r = s.score({"user": {"C1": "a"}, "candidates": [{"C1": "b"}]})
    assert r.status_code == 422 and "given for the user and for a candidate" in r.json()["detail"]
    assert s.score({"user": user, "candidates": candidates}).status_code == 200  # nothing served was lost


def _copy(src: str, dst: str, skip: tuple[str, ...] = ()) -> None:
    fs, base = rfs.resolve(src)
    _, target = rfs.resolve(dst)
    for path in fs.find(base):
        rel = path[len(base.rstrip("/")) + 1:]
        if rel.rsplit("/", 1)[-1] not in skip:
            fs.pipe_file(f"{target.rstrip('/')}/{rel}", fs.cat_file(path))


def test_killed_in_the_middle_of_a_delta_a_restart_serves_the_newest_committed_version(followed):
    """A second stream.out whose records name day 1's base and day 2's delta-1; delta-2's record is
    appended while the server runs, and the server is held in the middle of applying it (the test hook
    RECPS_SERVE_HOLD_DELTA: its files read, its version not made; the log says so), killed with
    SIGKILL there, and started again: it serves the base with both deltas."""
    out = f"{followed.out.rsplit('/', 1)[0]}/killed"
    src = Donefiles(followed.out)
    base = next(b for b in src.bases() if b["input"].endswith("20261202/base"))
    first, second = [p for p in src.patches() if p["key"] == base["key"]][:2]
    rfs.write_atomic(f"{out}/base_donefile.txt", json.dumps(base) + "\n", overwrite=True)
    rfs.write_atomic(f"{out}/patch_donefile.txt", json.dumps(first) + "\n", overwrite=True)
    held = Donefiles.export_folder(second)
    server = start_server(out, followed.tmp / "killed.log", env={"RECPS_SERVE_HOLD_DELTA": held})
    try:
        server.wait(lambda b: b.get("ready") and b["version"]["deltas"] == 1, "the first delta")
        rfs.write_atomic(f"{out}/patch_donefile.txt", json.dumps(first) + "\n" + json.dumps(second) + "\n",
                         overwrite=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while f"holding delta {held} in the middle of its application" not in server.log.read_text():
            assert time.monotonic() < deadline and server.proc.poll() is None, server.log.read_text()[-3000:]
            time.sleep(0.1)
        body = server.get("/healthz").json()  # mid-application: the version before it, whole
        assert body["version"]["deltas"] == 1 and body["version"]["delta_folders"] == [Donefiles.export_folder(first)]
        stop(server, signal.SIGKILL)
        assert server.proc.returncode == -signal.SIGKILL

        server = start_server(out, followed.tmp / "killed-restarted.log")
        body = server.wait(lambda b: b.get("ready") and b["version"]["deltas"] == 2, "the newest version")
        assert body["version"]["delta_folders"] == [Donefiles.export_folder(first), held]
        answer = server.score({"user": followed.user, "candidates": followed.candidates}).json()
        assert (answer["version"]["base_key"], answer["version"]["deltas"]) == (base["key"], 2)
        assert answer["probs"] == followed.reference.probs(answer["version"])
        assert server.metrics()["recps_deltas_applied_total"] == 2
    finally:
        stop(server)


def test_a_corrupt_delta_is_refused_and_the_last_good_version_kept(followed):
    """A second stream.out whose records name day 1's base, day 2's delta-1, a copy of delta-2 with one
    byte flipped, then a copy of delta-2 without its manifest (a save cut short)."""
    out = f"{followed.out.rsplit('/', 1)[0]}/corrupt"
    src = Donefiles(followed.out)
    base = next(b for b in src.bases() if b["input"].endswith("20261202/base"))
    good = [p for p in src.patches() if p["key"] == base["key"]]
    copy, cut = f"{out}/20261202/delta-2", f"{out}/20261202/delta-3"
    _copy(Donefiles.export_folder(good[1]), copy)
    _copy(Donefiles.export_folder(good[1]), cut, skip=("manifest.json",))
    fs, values = rfs.resolve(f"{copy}/{TABLE}/shard-00000-of-00001/values.bin")
    original = fs.cat_file(values)
    fs.pipe_file(values, original[:100] + bytes([original[100] ^ 1]) + original[101:])  # same size, another sha256
    rfs.write_atomic(f"{out}/base_donefile.txt", json.dumps(base) + "\n", overwrite=True)
    rfs.write_atomic(f"{out}/patch_donefile.txt", "".join(json.dumps(r) + "\n" for r in (
        good[0], dict(good[1], input=copy), dict(good[1], input=cut))), overwrite=True)

    server = start_server(out, followed.tmp / "corrupt.log")
    try:
        body = server.wait(lambda b: b.get("ready") and b.get("refused"), "refusal")
        assert body["version"]["deltas"] == 1 and body["refused"]["folder"] == copy
        assert "checksum mismatch" in body["refused"]["error"] and "values.bin" in body["refused"]["error"]
        m = server.metrics()
        assert m['recps_refused_total{kind="delta"}'] >= 1 and m["recps_refused_pending"] == 1
        assert m["recps_served_deltas"] == 1 and m["recps_deltas_applied_total"] == 1
        answer = server.score({"user": followed.user, "candidates": followed.candidates}).json()
        assert answer["version"]["deltas"] == 1
        assert answer["probs"] == followed.reference.probs(answer["version"])  # the last good version, intact
        assert re.search(rf"delta {re.escape(copy)} refused \(attempt 1\).*checksum mismatch.*still serving "
                         r"20261202/1 base \d+\+1", server.log.read_text())

        fs.pipe_file(values, original)  # repaired: the retry applies it; the cut one is refused next
        body = server.wait(lambda b: b["version"]["deltas"] == 2 and b["refused"] and b["refused"]["folder"] == cut,
                           "the repaired delta")
        assert "manifest.json is missing" in body["refused"]["error"]
        answer = server.score({"user": followed.user, "candidates": followed.candidates}).json()
        assert answer["version"]["deltas"] == 2 and answer["version"]["pass"] == 2
        assert answer["probs"] == followed.reference.probs(answer["version"])
        stop(server, signal.SIGKILL)

        server = start_server(out, followed.tmp / "corrupt-restarted.log")  # comes back at the newest version
        body = server.wait(lambda b: b.get("ready") and b["version"]["deltas"] == 2, "the newest version")
        assert body["version"]["delta_folders"] == [Donefiles.export_folder(good[0]), copy]
        assert server.metrics()["recps_deltas_applied_total"] == 2

        # A newer base of another model (its config.yaml's model differs, its manifest agrees): refused, named
        other = f"{out}/20261203/base"
        _copy(f"{followed.out}/20261203/base", other)
        config = fs.cat_file(rfs.resolve(f"{other}/config.yaml")[1])
        assert b"embedding_lr: 0.01\n" in config
        config = config.replace(b"embedding_lr: 0.01\n", b"embedding_lr: 0.02\n")
        fs.pipe_file(rfs.resolve(f"{other}/config.yaml")[1], config)
        manifest = json.loads(fs.cat_file(rfs.resolve(f"{other}/manifest.json")[1]))
        manifest["files"]["config.yaml"] = {"bytes": len(config), "sha256": hashlib.sha256(config).hexdigest()}
        fs.pipe_file(rfs.resolve(f"{other}/manifest.json")[1], json.dumps(manifest).encode())
        rfs.write_atomic(f"{out}/base_donefile.txt", json.dumps(base) + "\n" + json.dumps(
            dict(base, id="1", key="1", input=other)) + "\n", overwrite=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while server.metrics()['recps_refused_total{kind="base"}'] < 1:
            assert time.monotonic() < deadline, server.log.read_text()[-3000:]
            time.sleep(0.2)
        assert re.search(rf"base {re.escape(other)} refused \(attempt 1\): ConfigError: .* another model or schema",
                         server.log.read_text())
        answer = server.score({"user": followed.user, "candidates": followed.candidates}).json()
        assert (answer["version"]["base_key"], answer["version"]["deltas"]) == (base["key"], 2)  # kept
        stop(server, signal.SIGKILL)

        # A restart is how a server takes another model: it serves the newest base, the other model's
        server = start_server(out, followed.tmp / "corrupt-restarted-2.log")
        body = server.wait(lambda b: b.get("ready"), "the other model's base")
        assert (body["version"]["base"], body["version"]["base_key"]) == (other, "1")
        stop(server, signal.SIGKILL)

        # Restarted while the newest base is corrupt: the newest earlier base that loads, with its deltas
        fs, values = rfs.resolve(f"{other}/{TABLE}/shard-00000-of-00001/values.bin")
        data = fs.cat_file(values)
        fs.pipe_file(values, data[:7] + bytes([data[7] ^ 1]) + data[8:])
        server = start_server(out, followed.tmp / "corrupt-restarted-3.log")
        body = server.wait(lambda b: b.get("ready") and b["version"]["deltas"] == 2, "the earlier base's chain")
        assert body["version"]["base"] == Donefiles.export_folder(base)
        assert re.search(rf"base {re.escape(other)} refused \(attempt 1\).*checksum mismatch", server.log.read_text())
    finally:
        stop(server)
