"""The Fleet example's size (issue 18 point 10) and the convenience that keeps it small.

The example itself trains in tests/ps/test_fleet.py (1 server + 2 workers against the local script).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading

import pytest
import torch
import torch.nn.functional as F
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recps.config import PROJECT_ROOT
from recps.cluster.launch import free_port
from recps.embeddings import LocalEmbeddingBagCollection
from recps.ps.fleet import DistributedStrategy, Fleet
from recps.ps.modes import SyncMode
from recps.ps.roles import UserDefinedRoleMaker

EXAMPLES = PROJECT_ROOT / "examples"
FLEET_LINES = 12  # what `diff -w` shows of train_fleet.py: the lines a user adds or changes
LOCAL_LINES = 5  # ... and of train_local.py: the lines those replace


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("diff") is None, reason="needs the diff tool")
def test_the_fleet_part_of_the_example_is_twelve_lines():
    """`diff -w examples/train_local.py examples/train_fleet.py`, the command both files print: the
    Fleet lines (">") and the local lines they replace ("<"); it showed 22 and 7 before. The number
    the examples' docstring gives is this count."""
    proc = subprocess.run(["diff", "-w", str(EXAMPLES / "train_local.py"), str(EXAMPLES / "train_fleet.py")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1, proc.stderr  # they differ
    lines = proc.stdout.splitlines()
    fleet = [line for line in lines if line.startswith("> ")]
    local = [line for line in lines if line.startswith("< ")]
    assert (len(fleet), len(local)) == (FLEET_LINES, LOCAL_LINES), proc.stdout
    doc = (EXAMPLES / "train_fleet.py").read_text()
    assert re.search(rf"its Fleet part, {FLEET_LINES} lines", doc)
    assert not [line for line in fleet if line.lstrip("> ").startswith('"""')]  # the docstrings are one text


def test_embedding_bag_collection_from_features_is_the_local_layout_on_the_servers():
    """`Fleet.embedding_bag_collection_from_features(features, dim, n)`: the tables the local collection
    of the same arguments has (t_<feature>, dim, n), registered with the Fleet: init_worker creates
    them on the servers and binds the collection, which then pulls the same initial rows as one
    built from those configs, and trains."""
    features, dim, rows = ["x", "y"], 4, 20
    local = LocalEmbeddingBagCollection(features, dim, rows).embedding_bag_configs()
    address = f"127.0.0.1:{free_port()}"
    server_role, worker_role = (UserDefinedRoleMaker(kind, 0, 1, 1, coordinator=address, token="from-features")
                                for kind in ("server", "worker"))
    kjt = KeyedJaggedTensor.from_lengths_sync(features, torch.tensor([3, 7, 3, 11]), torch.ones(4, dtype=torch.int64))
    seen: dict = {}
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with Fleet(worker_role, connect_timeout_s=30) as f:
                ebc = f.embedding_bag_collection_from_features(features, dim, rows, prefix="a")
                seen["configs"] = [(c.name, c.embedding_dim, c.num_embeddings, c.feature_names)
                                   for c in ebc.embedding_bag_configs()]
                twin = f.embedding_bag_collection([EmbeddingBagConfig(name=f"t_{n}", embedding_dim=dim, num_embeddings=rows,
                                                                      feature_names=[n]) for n in features], prefix="b")
                linear = torch.nn.Linear(len(features) * dim, 1)
                opt = f.distributed_optimizer(torch.optim.SGD(linear.parameters(), lr=0.5),
                                              DistributedStrategy(SyncMode(timeout_s=30)))
                f.init_worker()
                seen["spec"] = f.client.table_spec("a_d4")["dim"]
                seen["first"], seen["twin"] = ebc(kjt).values().detach(), twin(kjt).values().detach()
                loss = F.binary_cross_entropy_with_logits(linear(ebc(kjt).values()).squeeze(1), torch.ones(2))
                opt.zero_grad()
                loss.backward()
                opt.step()
                seen["trained"] = ebc(kjt).values().detach()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with Fleet(server_role) as server:
        server.init_server()
        worker = threading.Thread(target=work)
        worker.start()
        worker.join(120)
        stopped = server._node is not None and server._node.wait(0.1 if errors else 30)
    assert not errors, errors
    assert stopped  # the worker stopped the server
    assert seen["configs"] == [(c.name, c.embedding_dim, c.num_embeddings, c.feature_names) for c in local]
    assert seen["spec"] == dim
    torch.testing.assert_close(seen["first"], seen["twin"], atol=0, rtol=0)  # (B, F*D) the same rows
    assert seen["first"].abs().sum() > 0 and not torch.equal(seen["first"], seen["trained"])
