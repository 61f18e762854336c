"""The Fleet-style API: the example twin on 1 server + 2 workers, Fleets as plain objects in one
process (no singleton), a wrong token, a server killed under a worker."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recps.config import PROJECT_ROOT
from recps.errors import ConfigError, PSError, PSTimeoutError
from recps.cluster.launch import free_port, launch
from recps.ps.embedding import salted_keys
from recps.ps.fleet import DistributedStrategy, Fleet
from recps.ps.modes import AsyncMode, GeoMode, SyncMode
from recps.ps.node import ServerNode, TableConfig
from recps.ps.roles import UserDefinedRoleMaker

EXAMPLES = PROJECT_ROOT / "examples"


def roles(workers: int, token: str = "fleet-test"):
    address = f"127.0.0.1:{free_port()}"
    server = UserDefinedRoleMaker("server", 0, 1, workers, coordinator=address, token=token)
    return server, [UserDefinedRoleMaker("worker", w, 1, workers, coordinator=address, token=token)
                    for w in range(workers)]


def serve_while(server_role, work, workers: int) -> None:
    """Server 0 in this thread while `work(w)` runs in one thread per worker; worker 0 stops it."""
    with Fleet(server_role) as server:
        assert server.is_server()
        server.init_server()
        threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert server._node is not None and server._node.wait(30)  # worker 0 stopped the server


class TinyModel(torch.nn.Module):
    def __init__(self, ebc) -> None:
        super().__init__()
        self.sparse_arch = ebc
        self.linear = torch.nn.Linear(8 + 2, 1)

    def forward(self, dense, kjt):
        return self.linear(torch.cat([self.sparse_arch(kjt).values(), dense], dim=1)).squeeze(1)


def tiny_batch(worker: int, step: int):
    g = torch.Generator().manual_seed(100 * worker + step)
    kjt = KeyedJaggedTensor.from_lengths_sync(["x", "y"], torch.randint(0, 20, (8,), generator=g),
                                              torch.ones(8, dtype=torch.int64))
    return torch.randn(4, 2, generator=g), kjt, torch.randint(0, 2, (4,), generator=g).float()


def test_two_worker_fleets_in_one_process_train_sync_to_one_model():
    """Fleets are objects: one server and two workers live in this process; sync keeps them equal."""
    server_role, worker_roles = roles(2)
    configs = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=4, num_embeddings=20, feature_names=[f]) for f in "xy"]
    initial, finals, errors = {}, {}, []

    def work(w: int) -> None:
        try:
            with Fleet(worker_roles[w], connect_timeout_s=30) as f:
                assert f.is_worker() and not f.is_server() and f.worker_index() == w and f.worker_num() == 2
                torch.manual_seed(w)  # different initial values: init_worker makes them equal
                model = TinyModel(f.embedding_bag_collection(configs))
                opt = f.distributed_optimizer(torch.optim.SGD(model.linear.parameters(), lr=0.5),
                                              DistributedStrategy(SyncMode(timeout_s=30, table=TableConfig(
                                                  capacity=1000, optimizer={"name": "sgd", "lr": 0.5}))))
                f.init_worker()
                assert f.client.table_spec("embedding_d4")["capacity"] == 1000  # rows reserved on the servers
                initial[w] = [p.detach().clone() for p in model.linear.parameters()]
                for step in range(5):
                    dense, kjt, labels = tiny_batch(w, step)
                    loss = F.binary_cross_entropy_with_logits(model(dense, kjt), labels)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                f.barrier("done")
                finals[w] = [p.detach().clone() for p in model.linear.parameters()]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    serve_while(server_role, work, 2)
    assert not errors, errors
    for a, b, c, d in zip(initial[0], initial[1], finals[0], finals[1]):
        torch.testing.assert_close(a, b)  # worker 1 started from worker 0's values (the first creator's)
        torch.testing.assert_close(c, d)
        assert not torch.allclose(a, c)  # trained


def test_wrong_token_is_refused():
    server_role, _ = roles(1, token="right")
    address = server_role.role().coordinator
    wrong = UserDefinedRoleMaker("worker", 0, 1, 1, coordinator=address, token="wrong")
    with ServerNode(server_role.role(), timeout_s=10, halves={}).start():
        f = Fleet(wrong, connect_timeout_s=5)
        with pytest.raises(PSError, match="refused"):
            f.init_worker()


def test_api_misuse_is_named():
    server_role, worker_roles = roles(1)
    with pytest.raises(ConfigError, match="init_worker: this process is server0; only workers call it"):
        Fleet(server_role).init_worker()
    with pytest.raises(ConfigError, match="run_server: this process is worker0"):
        Fleet(worker_roles[0]).run_server()
    with pytest.raises(ConfigError, match="mode='hogwild'"):
        DistributedStrategy(mode="hogwild")
    with pytest.raises(ConfigError, match="k_steps=0"):
        DistributedStrategy(GeoMode(k_steps=0))
    with pytest.raises(ConfigError, match="momentum"):
        Fleet(worker_roles[0]).distributed_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1,
                                                                     momentum=0.9))


@pytest.mark.e2e
@pytest.mark.slow
def test_worker_fails_naming_the_server_when_it_is_killed():
    """No launcher here: the worker itself must notice, within its timeout, and name the server."""
    server_role, worker_roles = roles(1)
    env = dict(os.environ, **server_role.role().to_env())
    server = subprocess.Popen([sys.executable, "-m", "recps.ps"], env=env, cwd=PROJECT_ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        f = Fleet(worker_roles[0], connect_timeout_s=120)
        ebc = f.embedding_bag_collection([EmbeddingBagConfig(name="t_x", embedding_dim=4, num_embeddings=1,
                                                             feature_names=["x"])])
        f.init_worker(DistributedStrategy(SyncMode(timeout_s=5)))
        kjt = KeyedJaggedTensor.from_lengths_sync(["x"], torch.tensor([1, 2]), torch.tensor([1, 1]))
        ebc(kjt).values().sum().backward()  # the cluster works
        f.communicator.step_end(0)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        start = time.monotonic()
        with pytest.raises(PSTimeoutError, match=r"server0 at tcp://127\.0\.0\.1:\d+.*pull"):
            ebc(kjt)
        assert time.monotonic() - start < 10
        f._close_on_error()
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.mark.e2e
@pytest.mark.slow
def test_fleet_example_runs_on_one_server_and_two_workers_and_learns_like_the_local_script():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import train_local
    finally:
        sys.path.remove(str(EXAMPLES))
    args = ["--rows", "16000", "--epochs", "3", "--vocab", "100"]
    local = train_local.main(args)
    output = io.StringIO()
    result = launch([sys.executable, str(EXAMPLES / "train_fleet.py"), *args, "--mode", "async"],
                    servers=1, workers=2, timeout=400, output=output)
    text = output.getvalue()
    assert result.ok, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("[worker0] {")]
    assert len(lines) == 1, text[-3000:]
    fleet = json.loads(lines[0][len("[worker0] "):])
    assert local["auc"] > 0.65
    assert abs(fleet["auc"] - local["auc"]) <= 0.02, (fleet, local)


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01),
    lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.001),
    lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-9, initial_accumulator_value=0.1),
])
def test_dense_rule_on_the_servers_equals_the_torch_optimizer(make):
    """sync / async apply the dense update on the servers: the rule derived from the torch optimizer
    gives the same parameters after several steps."""
    from recps.ps.table import DenseTable, make_rule
    from recps.ps.modes.dense import torch_optimizer_rule

    g = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(3, 4, generator=g))
    rule = torch_optimizer_rule(make([param]))
    table = DenseTable({"w": param.detach()}, optimizer=make_rule(**rule))
    opt = make([param])
    for _ in range(4):
        grad = torch.randn(3, 4, generator=g)
        param.grad = grad.clone()
        opt.step()
        table.push({"w": grad})
    torch.testing.assert_close(table.pull()["w"], param.detach(), atol=1e-6, rtol=1e-5)


def test_geo_sync_settings_travel_from_conf_to_the_communicator():
    """ps.background_sync / ps.local_init of conf/ps/geo.yaml reach GeoCommunicator."""
    from recps.config import ps_mode
    from recps.config import compose_config
    from recps.ps.node import PSClient, PSServer

    default = ps_mode(compose_config(["ps=geo"]))
    assert isinstance(default, GeoMode) and (default.background_sync, default.local_init) == (None, True)
    mode = ps_mode(compose_config(["ps=geo", "ps.k_steps=50", "ps.background_sync=false", "ps.local_init=false"]))
    with PSServer(token="t") as server, PSClient([server.endpoint], token="t") as client:
        comm = mode.communicator(client)
        try:
            assert (comm.k_steps, comm.background_sync, comm.local_init) == (50, False, False)
        finally:
            comm.close()
        comm = default.communicator(client)
        try:
            assert (comm.background_sync, comm.local_init) == (True, True)  # k_steps 100 > 1: background
        finally:
            comm.close()


def test_table_capacity_from_conf_and_its_errors():
    """ps.table.capacity reserves the sparse tables' rows up front; a bad value names the fix."""
    from recps.config import ps_mode
    from recps.config import compose_config

    assert ps_mode(compose_config(["ps=async"])).table.capacity == 0
    assert ps_mode(compose_config(["ps=sync", "ps.table.capacity=3000000"])).table.capacity == 3_000_000
    with pytest.raises(ConfigError, match="capacity=-1; it must be an integer >= 0"):
        AsyncMode(table=TableConfig(capacity=-1))
    with pytest.raises(ConfigError, match="capacity=-1; it must be an integer >= 0"):
        ps_mode(compose_config(["ps=async", "ps.table.capacity=-1"]))


def test_async_merge_settings_travel_from_conf_to_the_communicator():
    """ps.min_merge / ps.dense_min_merge of conf/ps/async.yaml reach AsyncCommunicator; bad values name the fix."""
    from recps.config import ps_mode
    from recps.config import compose_config
    from recps.ps.node import PSClient, PSServer

    default = ps_mode(compose_config(["ps=async"]))
    assert (default.min_merge, default.dense_min_merge) == (1, None)
    mode = ps_mode(compose_config(["ps=async", "ps.min_merge=3", "ps.dense_min_merge=2"]))
    with PSServer(token="t") as server, PSClient([server.endpoint], token="t") as client:
        for m, expected in ((mode, (3, 2)), (default, (1, 1))):
            comm = m.communicator(client)
            try:
                assert (comm.min_merge, comm.dense_min_merge) == expected
            finally:
                comm.close()
    with pytest.raises(ConfigError, match="min_merge=9 exceeds max_pending=8"):
        AsyncMode(min_merge=9, merge_threshold=9)
    with pytest.raises(ConfigError, match="dense_min_merge=0; it must be an integer >= 1"):
        AsyncMode(dense_min_merge=0)


def test_prefetch_is_async_only_and_on_by_default_there():
    from recps.config import ps_mode
    from recps.config import compose_config

    assert ps_mode(compose_config(["ps=async"])).prefetches
    assert not ps_mode(compose_config(["ps=async", "ps.prefetch=false"])).prefetches
    assert not ps_mode(compose_config(["ps=sync"])).prefetches
    for mode in ("sync", "geo"):  # not a knob of theirs: refused before anything starts
        with pytest.raises(ConfigError, match="prefetch.*its arguments are"):
            ps_mode(compose_config([f"ps={mode}", "+ps.prefetch=true"]))


def test_a_misspelled_mode_knob_fails_before_anything_starts_naming_the_key_and_the_fix():
    """`ps.k_step=5` is refused by Hydra (the key is not in conf); `+ps.k_step=5` by the mode's
    signature, which names the knob meant."""
    from hydra.errors import ConfigCompositionException

    from recps.config import ps_mode
    from recps.config import compose_config

    with pytest.raises(ConfigCompositionException, match="ps.k_step"):
        compose_config(["ps=geo", "ps.k_step=5"])
    with pytest.raises(ConfigError, match=r"k_step.*did you mean ps\.k_steps\?"):
        ps_mode(compose_config(["ps=geo", "+ps.k_step=5"]))
    with pytest.raises(ConfigError, match=r"max_pendin.*did you mean ps\.max_pending\?"):
        ps_mode(compose_config(["ps=async", "+ps.max_pendin=5"]))


LR = 0.1


def _two_mode_batch(worker: int, step: int):
    g = torch.Generator().manual_seed(1000 * worker + step)
    x = KeyedJaggedTensor.from_lengths_sync(["x"], torch.randint(0, 6, (4,), generator=g), torch.ones(4, dtype=torch.int64))
    y = KeyedJaggedTensor.from_lengths_sync(["y"], torch.randint(0, 6, (4,), generator=g), torch.ones(4, dtype=torch.int64))
    return x, y, torch.randn(4, 2, generator=g), torch.randn(4, 2, generator=g)


def _sync_loss(rows_x, b, x, t):  # the sync half of the model: rows of x plus a dense bias
    return ((rows_x + b - t) ** 2).sum()


def _geo_loss(rows_y, t):
    return ((rows_y - t) ** 2).sum()


def test_two_modes_in_one_job_each_table_follows_its_own_mode():
    """One model, two embedding collections: `a` trained sync (the strategy's mode, with the dense
    bias), `b` trained GEO, against the same server, two workers. The sync table and the bias equal
    single-process SGD on the mean of the workers' gradients; the GEO table on the server equals its
    initial value plus the workers' deltas (each worker's local SGD, scaled 1/W), not an update rule
    applied to them; the server tags each table with its mode."""
    server_role, worker_roles = roles(2)
    steps, dim = 4, 2
    table = TableConfig(optimizer={"name": "sgd", "lr": LR}, init_std=0.0)  # rows start at 0
    cfg = lambda f: [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=dim, num_embeddings=6, feature_names=[f])]
    results, errors = {}, []

    def work(w: int) -> None:
        try:
            with Fleet(worker_roles[w], connect_timeout_s=30) as f:
                ebc_x = f.embedding_bag_collection(cfg("x"), prefix="a")
                ebc_y = f.embedding_bag_collection(cfg("y"), prefix="b", mode=GeoMode(
                    k_steps=1000, background_sync=False, table=table))  # deltas sent once, at the end
                bias = torch.nn.Parameter(torch.zeros(dim))
                opt = f.distributed_optimizer(torch.optim.SGD([bias], lr=LR),
                                              DistributedStrategy(SyncMode(timeout_s=30, table=table)))
                f.init_worker()
                for step in range(steps):
                    x, y, tx, ty = _two_mode_batch(w, step)
                    loss = _sync_loss(ebc_x(x).values(), bias, x, tx) + _geo_loss(ebc_y(y).values(), ty)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                f.close_communicators()  # GEO's deltas go out
                f.barrier("trained")
                keys = torch.arange(6)
                results[w] = {
                    "a": f.client.pull("a_d2", salted_keys(keys, "t_x"), create=False).wait(),
                    "b": f.client.pull("b_d2", salted_keys(keys, "t_y"), create=False).wait(),
                    "bias": bias.detach().clone(),
                    "modes": {t: f.client.table_spec(t)["mode"] for t in ("a_d2", "b_d2", "dense")},
                }
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    serve_while(server_role, work, 2)
    assert not errors, errors

    # Reference, one process: sync = SGD on the mean of the two workers' gradients per step.
    rows_x, bias = torch.zeros(6, dim), torch.zeros(dim)
    local_y = [torch.zeros(6, dim), torch.zeros(6, dim)]  # GEO: each worker's own SGD, no exchange
    for step in range(steps):
        grads_x, grads_b = [], []
        for w in range(2):
            x, y, tx, ty = _two_mode_batch(w, step)
            rx, b = rows_x.clone().requires_grad_(True), bias.clone().requires_grad_(True)
            _sync_loss(rx[x.values()], b, x, tx).backward()
            grads_x.append(rx.grad)
            grads_b.append(b.grad)
            ry = local_y[w].clone().requires_grad_(True)
            _geo_loss(ry[y.values()], ty).backward()
            local_y[w] = local_y[w] - LR * ry.grad
        rows_x = rows_x - LR * (grads_x[0] + grads_x[1]) / 2
        bias = bias - LR * (grads_b[0] + grads_b[1]) / 2
    geo_server = 0.0 + (local_y[0] - 0.0) / 2 + (local_y[1] - 0.0) / 2  # initial value + the deltas, scaled 1/W

    for w in range(2):
        assert results[w]["modes"] == {"a_d2": "sync", "b_d2": "geo", "dense": "sync"}
        torch.testing.assert_close(results[w]["a"], rows_x, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(results[w]["bias"], bias, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(results[w]["b"], geo_server, atol=1e-5, rtol=1e-5)
    # Not what the other mode would give: the GEO table is no SGD run on the mean gradients.
    assert not torch.allclose(geo_server, local_y[0])


def test_merge_worker_states_unions_replicas_and_averages_optimizer_state():
    from recps.cluster.checkpoint import merge_worker_states

    a = {"sparse": {"t": {"keys": torch.tensor([5, 1, 9]), "state": torch.tensor([1.0, 2.0, 3.0])}},
         "dense_optimizer": {"param_groups": [{"lr": 0.1, "params": [0]}],
                             "state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.tensor([1.0, 3.0])}}}}
    b = {"sparse": {"t": {"keys": torch.tensor([9, 2]), "state": torch.tensor([5.0, 7.0])},
                    "u": {"keys": torch.tensor([3]), "state": torch.tensor([0.5])}},
         "dense_optimizer": {"param_groups": [{"lr": 0.1, "params": [0]}],
                             "state": {0: {"step": torch.tensor(6.0), "exp_avg": torch.tensor([3.0, 5.0])}}}}
    merged = merge_worker_states([a, b])
    assert merged["sparse"]["t"]["keys"].tolist() == [1, 2, 5, 9]
    assert merged["sparse"]["t"]["state"].tolist() == [2.0, 7.0, 1.0, 4.0]  # key 9: mean of 3 and 5
    assert merged["sparse"]["u"]["keys"].tolist() == [3]
    state = merged["dense_optimizer"]["state"][0]
    assert state["step"].item() == 5.0 and state["exp_avg"].tolist() == [2.0, 4.0]
    assert merged["dense_optimizer"]["param_groups"] == a["dense_optimizer"]["param_groups"]


def test_the_table_verbs_orchestration_uses_beside_the_optimizer():
    """What recps.pipeline and recps.cluster call instead of fleet.client: create_dense_table (the first
    creator's values win, later creators change nothing), wait_for_workers, pull_dense_into (the servers'
    values into parameters, in the table's order), push_dense on a geo table (the workers' pushes add up),
    table_mode (default: the strategy's mode), channel() (this worker's place)."""
    with pytest.raises(PSError, match=r"pull_dense: call init_worker\(\) first"):
        Fleet(UserDefinedRoleMaker("worker", 0, 1, 1, coordinator="127.0.0.1:1", token="t")).pull_dense("x")
    server_role, worker_roles = roles(2)
    got: dict = {}
    errors: list = []

    def work(w: int) -> None:
        try:
            with Fleet(worker_roles[w], connect_timeout_s=60) as fleet:
                fleet.init_worker(DistributedStrategy(mode=SyncMode()))
                mine = {"a": torch.full((2, 3), float(w + 1)), "b": torch.arange(4.0) + 10 * w}
                if w == 0:
                    fleet.create_dense_table("stage_dense", mine)
                fleet.wait_for_workers("test.created", timeout=60)
                if w == 1:
                    fleet.create_dense_table("stage_dense", mine)  # idempotent: worker 0's values stay
                fleet.create_dense_table("stats", 3, mode="geo")
                fleet.wait_for_workers("test.created.twice", timeout=60)
                params = [torch.zeros(2, 3), torch.zeros(4)]
                fleet.pull_dense_into("stage_dense", params, timeout=60)
                fleet.push_dense("stats", torch.full((3,), float(w + 1))).wait(60)
                fleet.wait_for_workers("test.pushed", timeout=60)
                channel = fleet.channel()
                got[w] = {"params": params, "stats": fleet.pull_dense("stats", 60),
                          "modes": (fleet.table_mode("stage_dense"), fleet.table_mode("stats")),
                          "place": (channel.worker_index, channel.num_workers)}
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    serve_while(server_role, work, 2)
    assert not errors, errors
    for w in (0, 1):
        assert torch.equal(got[w]["params"][0], torch.ones(2, 3))  # worker 0's values, on both workers
        assert torch.equal(got[w]["params"][1], torch.arange(4.0))
        assert got[w]["stats"].tolist() == [3.0, 3.0, 3.0]  # 1 + 2: a geo table adds what arrives
        assert got[w]["modes"] == ("sync", "geo")
        assert got[w]["place"] == (w, 2)


def test_counting_table_adds_the_workers_shows_and_clicks_and_trains_nothing():
    """A counting table (create_counting_table: width 1, an accessor, tagged geo) holds, after both workers
    counted their shares (duplicates inside a push too), each key's shows and clicks summed: pull_statistics
    equals the arithmetic; its rows stay 0 (nothing trained); a key never counted reads (0, 0) and gets no row;
    pull_statistics of a table without an accessor fails naming it and the fix."""
    server_role, worker_roles = roles(2, token="fleet-counts")
    got: dict = {}
    errors: list = []
    keys = {0: torch.tensor([5, 7, 5, 9]), 1: torch.tensor([7, 7, 11])}
    shows = {0: torch.tensor([1.0, 1.0, 1.0, 2.0]), 1: torch.tensor([1.0, 1.0, 1.0])}
    clicks = {0: torch.tensor([1.0, 0.0, 1.0, 1.0]), 1: torch.tensor([1.0, 0.0, 0.0])}

    def work(w: int) -> None:
        try:
            with Fleet(worker_roles[w], connect_timeout_s=60) as fleet:
                fleet.init_worker(DistributedStrategy(mode=SyncMode()))
                fleet.create_counting_table("fine_counts", {})
                fleet.create_dense_table("plain", 2)
                fleet.wait_for_workers("test.counts.created", timeout=60)
                fleet.count("fine_counts", keys[w], shows[w], clicks[w]).wait(60)
                fleet.wait_for_workers("test.counts.counted", timeout=60)
                got[w] = {"stats": fleet.pull_statistics("fine_counts", torch.tensor([5, 7, 9, 11, 13]), 60),
                          "rows": fleet.channel().pull("fine_counts", torch.tensor([5, 7, 13])).wait(60),
                          "mode": fleet.table_mode("fine_counts")}
                if w == 0:
                    with pytest.raises(ConfigError, match="create_counting_table 'x': no accessor"):
                        fleet.create_counting_table("x", None)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    serve_while(server_role, work, 2)
    assert not errors, errors
    for w in (0, 1):
        assert got[w]["stats"].tolist() == [[2.0, 2.0], [3.0, 1.0], [2.0, 1.0], [1.0, 0.0], [0.0, 0.0]]
        assert got[w]["rows"].tolist() == [[0.0], [0.0], [0.0]]
        assert got[w]["mode"] == "geo"


def test_pull_statistics_of_a_table_without_an_accessor_names_the_table_and_the_fix():
    from recps.ps.modes import server_halves
    from recps.ps.node.client import PSClient
    from recps.ps.node.server import PSServer

    with PSServer(token="t", halves=server_halves()) as server, PSClient([server.endpoint], token="t") as client:
        client.create_sparse_table("plain", dim=2)
        client.create_sparse_table("counted", dim=1, accessor={}, initializer={"kind": "zeros"})
        client.push("counted", torch.tensor([3, 3]), torch.zeros(2, 1), shows=torch.ones(2), clicks=torch.ones(2)).wait()
        assert client.pull_statistics("counted", torch.tensor([3, 4, 3])).wait().tolist() == [[2.0, 2.0], [0.0, 0.0],
                                                                                            [2.0, 2.0]]
        with pytest.raises(Exception, match=r"table 'plain' keeps no show/click statistics \(no accessor\).*ps.table.accessor"):
            client.pull_statistics("plain", torch.tensor([1])).wait()
