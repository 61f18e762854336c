"""`python -m recps.train ps=sync|async|geo`: real clusters of processes on 127.0.0.1.

Each test runs the CLI as a user does (it launches its servers and workers with recps.launch)
and checks what they computed against single-process training:
- sync, 2 workers x batch B, SGD: the servers' parameters equal plain-torch SGD with batch 2B;
- geo, 1 worker, k = 1, SGD: the same equality with batch 2B (local SGD);
- async and geo (k = 100), 2 workers x 2 threads: test AUC within 0.01 of ps=local;
- a server killed with SIGKILL: the run fails naming it, within the timeout, no process left.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedTensor

from recps.config import PROJECT_ROOT, register_resolvers
from recps.data.dataset import prepare_data
from recps.ps.embedding import salted_keys
from recps.ps.modes import server_halves
from recps.ps.node import PSClient, PSServer
from recps.ps.table import Initializer
from recps.job.build import run_training, seed_everything
from recps.job.loop import dense_parameters
from tests.helpers.cli import CliRun, job_process, recps_train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RUN_TIMEOUT_S = 420


def data_overrides(folder: Path, train_rows: int, test_rows: int, vocab: int) -> list[str]:
    return [f"dataset.dir={folder}", f"dataset.generate.train_rows={train_rows}",
            f"dataset.generate.test_rows={test_rows}", f"dataset.generate.vocab={vocab}"]


def train_cli(run_dir: Path, overrides: list[str], timeout: float = RUN_TIMEOUT_S) -> tuple[CliRun, dict]:
    """`python -m recps.train <overrides>` in `run_dir`; returns the process and metrics.json."""
    proc = recps_train(*overrides, f"hydra.run.dir={run_dir}", timeout=timeout)
    return proc, proc.metrics()


def composed(overrides: list[str]):
    register_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


class ReferenceEBC(nn.Module):
    """Plain torch: every key of the data is a row of one Parameter, initialized as the servers do."""

    def __init__(self, features: list[str], dim: int, keys: torch.Tensor, init_std: float, seed: int) -> None:
        super().__init__()
        self.features, self.dim = features, dim
        self.configs = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=dim, num_embeddings=1, feature_names=[f])
                        for f in features]
        self.ps_keys = torch.unique(torch.cat([salted_keys(keys[:, i], f"t_{f}") for i, f in enumerate(features)]))
        bound = init_std * 3**0.5
        self.weight = nn.Parameter(Initializer("uniform", low=-bound, high=bound)(self.ps_keys, dim, seed=seed))

    def embedding_bag_configs(self):
        return self.configs

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """(N, F) raw keys -> (F*N,) row indices."""
        ps = torch.cat([salted_keys(keys[:, i], f"t_{f}") for i, f in enumerate(self.features)])
        return torch.searchsorted(self.ps_keys, ps)

    def forward(self, kjt) -> KeyedTensor:
        b, f = kjt.stride(), len(self.features)
        keys = kjt.values().view(f, b).t()  # one key per slot per example
        idx = self.lookup(keys)  # (F*B,)
        pooled = F.embedding_bag(idx, self.weight, torch.arange(idx.numel()), mode="sum")  # (F*B, D)
        values = pooled.view(f, b, self.dim).transpose(0, 1).reshape(b, f * self.dim)  # (B, F*D)
        return KeyedTensor(keys=self.features, length_per_key=[self.dim] * f, values=values)


SGD_OVERRIDES = [
    "model=ctr_dnn", "model.hidden=[16,8]", "optimizer=sgd", "optimizer.lr=0.1",
    "ps.table.optimizer.name=sgd", "ps.table.optimizer.lr=0.2", "ps.table.init_std=0.05",
    "+dataset.shuffle=false", "trainer.threads=1", "trainer.max_steps=8",
]


@pytest.mark.parametrize("mode, workers, batch", [("sync", 2, 32), ("geo", 1, 64)])
def test_parameters_equal_single_process_sgd_with_the_merged_batch(tmp_path_factory, mode, workers, batch):
    data_dir = tmp_path_factory.getbasetemp() / "data-small"
    run_dir = tmp_path_factory.mktemp(f"{mode}-equal")
    overrides = SGD_OVERRIDES + data_overrides(data_dir, 2000, 500, 1000) + [
        f"ps={mode}", f"cluster.workers={workers}", f"trainer.batch_size={batch}"]
    if mode == "geo":
        overrides.append("ps.k_steps=1")
    train_cli(run_dir, overrides)

    # Single process, plain torch, batch 2B = 64, the same number of steps, the same initial values.
    cfg = composed(overrides)
    seed_everything(int(cfg.seed))
    data = prepare_data(cfg.dataset, seed=int(cfg.seed))
    features = list(data.schema.feature_names)
    ebc = ReferenceEBC(features, int(cfg.model.embedding_dim), data.train.examples.keys, float(cfg.ps.table.init_std),
                       int(cfg.seed))
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    model_cfg.pop("embedding_dim")
    model = instantiate(model_cfg, embedding_bag_collection=ebc, dense_in_features=data.schema.num_dense)
    dense = [p for _, p in dense_parameters(model, ebc)]
    opt = torch.optim.SGD([{"params": [ebc.weight], "lr": 0.2}, {"params": dense}], lr=0.1)
    batches = iter(data.train.batches(64, 0, 1, 0))
    for _ in range(8):
        batch_ = next(batches)
        loss = F.binary_cross_entropy_with_logits(model(batch_.dense, batch_.sparse), batch_.labels[:, 0])
        opt.zero_grad()
        loss.backward()
        opt.step()
    seen = torch.unique(ebc.lookup(data.train.examples.keys[: 8 * 64]))

    with PSServer(token="check", halves=server_halves()) as server, PSClient([server.endpoint], token="check") as client:
        client.load(str(run_dir / "checkpoint"))  # the tables come back with their mode (sync or geo)
        assert client.table_spec("embedding_d9")["mode"] == client.table_spec("dense")["mode"] == mode
        rows = client.pull("embedding_d9", ebc.ps_keys[seen], create=False).wait()
        torch.testing.assert_close(rows, ebc.weight.detach()[seen], atol=1e-5, rtol=0)
        server_dense = client.dense_layout("dense").unflatten(client.pull_dense("dense").wait())
        assert len(server_dense) == len(dense)
        for i, p in enumerate(dense):
            torch.testing.assert_close(server_dense[f"param{i}"], p.detach(), atol=1e-5, rtol=0)
    assert float((ebc.weight.detach()[seen] - Initializer("uniform", low=-0.05 * 3**0.5, high=0.05 * 3**0.5)(
        ebc.ps_keys[seen], 9, seed=0)).abs().max()) > 1e-4  # rows moved 10x the tolerance: the check has teeth


AUC_OVERRIDES = ["model=ctr_dnn", "model.hidden=[64,32]", "trainer.epochs=3", "checkpoint.save=false", "progress=false"]


def test_async_and_geo_reach_the_auc_of_local_training(tmp_path_factory):
    data = data_overrides(tmp_path_factory.getbasetemp() / "data-auc", 60000, 20000, 100)
    local_dir = tmp_path_factory.mktemp("local")
    cfg = composed(AUC_OVERRIDES + data + ["ps=local", "trainer.threads=2"])
    local = run_training(cfg, local_dir)["auc"]
    assert local > 0.7  # it learned: the comparison below is between trained models
    results = {}
    for mode, extra in (("async", []), ("geo", ["ps.k_steps=100"])):
        _, metrics = train_cli(tmp_path_factory.mktemp(mode), AUC_OVERRIDES + data + [
            f"ps={mode}", "cluster.workers=2", "trainer.threads=2", *extra])
        assert metrics["workers"] == 2 and metrics["threads"] == 2 and metrics["ps"] == mode
        results[mode] = metrics["auc"]
    for mode, auc in results.items():
        assert abs(auc - local) <= 0.01, (mode, auc, local)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_server_killed_mid_run_fails_the_run_naming_it_and_leaves_nothing(tmp_path_factory, launch_output):
    run_dir = tmp_path_factory.mktemp("killed")
    data = data_overrides(tmp_path_factory.getbasetemp() / "data-small", 2000, 500, 1000)
    cmd = [sys.executable, "-m", "recps.train", "model=ctr_dnn", "model.hidden=[16,8]", "ps=async",
           "cluster.workers=2", "trainer.epochs=100000", "trainer.batch_size=16", *data, f"hydra.run.dir={run_dir}"]
    pids: dict[str, int] = {}
    lines: list[str] = []
    deadline = time.monotonic() + RUN_TIMEOUT_S
    with job_process(cmd) as proc:  # its process group killed at the end, whatever ends the block
        # Wait until both workers train (each logs its mode once it joined), then kill the server.
        joined = launch_output(proc, r"\[(worker\d)\].*async mode", lines, pids, deadline, count=2)
        assert joined == {"worker0", "worker1"}, "".join(lines[-40:])
        time.sleep(1.0)
        killed_at = time.monotonic()
        os.kill(pids["server0"], signal.SIGKILL)
        rest, _ = proc.communicate(timeout=60)
        lines.append(rest)
        took = time.monotonic() - killed_at
    out = "".join(lines)
    assert proc.returncode != 0
    assert re.search(r"server0 \(pid \d+\) was killed by SIGKILL", out), out[-3000:]
    assert took < 30
    assert set(pids) == {"server0", "worker0", "worker1"}
    assert not [name for name, pid in pids.items() if _alive(pid)]
