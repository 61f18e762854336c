"""`python -m recps.serve RUN_DIR` of a funnel run: POST /v1/recommend answers the lists
`recps.pipeline.recommend` computes for the same users (the server is a client of the same code),
and refuses what it cannot answer (a user the run does not know, too many users, the other route)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import requests
import torch

from recps.cluster.launch import free_port
from tests.helpers.cli import PROJECT_ROOT, child_env, recps_train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TINY = [
    "pipeline=video_funnel",
    "pipeline.world.users=300", "pipeline.world.items=800", "pipeline.world.creators=80",
    "pipeline.world.metric_users=50", "pipeline.world.impressions_per_user=40",
    "pipeline.world.random_items_per_user=200",
    "pipeline.stages.recall.keep=100", "pipeline.stages.coarse.keep=40", "pipeline.stages.fine.keep=20",
]
MAX_USERS = 16


@pytest.fixture(scope="module")
def funnel_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-funnel")
    run = root / "run"
    recps_train(*TINY, f"pipeline.world.dir={root / 'world'}", f"hydra.run.dir={run}", timeout=600)
    port = free_port()
    log = root / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "recps.serve", str(run), "--port", str(port),
                                 "--max-users", str(MAX_USERS)], cwd=PROJECT_ROOT, env=child_env(), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if requests.get(url + "/healthz", timeout=10).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.3)
        yield run, url
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


def post(url: str, body) -> requests.Response:
    return requests.post(url + "/v1/recommend", data=json.dumps(body), headers={"Content-Type": "application/json"},
                         timeout=60)


def test_recommend_answers_recps_pipeline_recommends_lists(funnel_server):
    from recps.pipeline.recommend import load_funnel, recommend

    run, url = funnel_server
    users = [0, 7, 42, 299]
    r = post(url, {"users": users})
    assert r.status_code == 200, r.text
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server's: the same kernels, the same scores
    try:
        expected = recommend(load_funnel(run), torch.tensor(users))
    finally:
        torch.set_num_threads(threads)
    assert r.json()["lists"] == json.loads(json.dumps(expected))
    assert all(len(row["items"]) > 0 and set(row["scores"]) == {"recall", "coarse", "fine", "fusion"}
               for row in r.json()["lists"])


def test_recommend_refuses_what_it_cannot_answer(funnel_server):
    _, url = funnel_server
    r = post(url, {"users": [0, 300]})
    assert r.status_code == 422 and "[300] are not users of this run" in r.json()["detail"]
    r = post(url, {"users": list(range(MAX_USERS + 1))})
    assert r.status_code == 413 and f"at most {MAX_USERS}" in r.json()["detail"]
    r = post(url, {"users": ["a"]})
    assert r.status_code == 422 and "users.0" in r.json()["detail"]
    r = requests.post(url + "/v1/score", data=json.dumps({"candidates": [{}]}),
                      headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 404 and "/v1/recommend" in r.json()["detail"]
    assert post(url, {"users": [1]}).status_code == 200
