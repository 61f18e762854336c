"""device=cuda (issue 17.1): every device-dependent line, on the CPU here and on a GPU where there is one.

Each test that takes the `device` fixture (tests/conftest.py) runs twice: "cpu", the CI path (the same
lines; every host <-> device copy is then the tensor itself), and "cuda", which skips with the reason
"no CUDA device: torch.cuda.is_available() is False" where torch sees no GPU and never skips on a GPU
machine (RECPS_REQUIRE_CUDA=1 makes the absence a failure). The cuda half compares with the CPU:

- the copies (recps.device) and the prefetching batch loader (recps.embeddings.placement);
- GEO's replica as a CUDA TBE and sync's pulled rows on the GPU, both against plain-torch SGD on the
  CPU (the exact equalities of tests/ps/modes/test_geo.py, with tests/helpers/reference.py, to float tolerance);
- ps=local, GEO and async runs of CTR-DNN (recps.job / recps.cluster, servers in this process) on a
  small generated world: first losses and AUC against the same run on the CPU.

On a machine without CUDA, `device=cuda` fails before any data is read or process started, naming
the value, why (torch.cuda.is_available() is False: the CPU build) and the fix (make setup-gpu); the
CLI's one line for it: tests/job/test_precision.py::test_device_cuda_without_a_gpu_names_the_fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recps.config import compose_config, validate_config
from recps.data.reader import TensorBatches
from recps.device import check_device, to_device, to_host
from recps.errors import ConfigError
from recps.embeddings import BatchPlacement
from recps.ps.embedding import PSEmbeddingBagCollection, pool_sum
from recps.ps.modes import server_halves
from recps.ps.modes.dense import PSDenseUpdater
from recps.ps.modes.geo import GeoMode
from recps.ps.modes.synchronous import SyncMode
from recps.ps.node import PSClient, PSServer, TableConfig
from recps.tasks import BinaryTask
from tests.helpers.reference import DIM, FEATURES, INIT, ReferenceEBC, examples, make_model, reference_sgd

NO_CUDA = not torch.cuda.is_available()

# ------------------------------------------------------------------ device=cuda without CUDA


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA: device=cuda is valid here")
@pytest.mark.parametrize("ps", ["local", "async", "sync", "geo"])
def test_device_cuda_without_cuda_names_the_fix(ps):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config([f"ps={ps}", "device=cuda"]))
    message = str(err.value)
    for part in ("device='cuda'", "torch.cuda.is_available() is False on this machine", "make setup-gpu",
                 ".venv-gpu", "device=cpu"):
        assert part in message, message
    if torch.version.cuda is None:
        assert f"the installed torch {torch.__version__} is the CPU build" in message, message


def test_check_device_values(device):
    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"device='gpu': use cpu or cuda \(cuda:N for one GPU\)"):
        check_device("gpu")
    if device == "cuda":
        assert check_device("cuda") == torch.device("cuda") and check_device("cuda:0") == torch.device("cuda", 0)
        count = torch.cuda.device_count()
        with pytest.raises(ConfigError, match=rf"device='cuda:{count}': this machine has {count} GPU"):
            check_device(f"cuda:{count}")
    else:
        with pytest.raises(ConfigError, match="torch.cuda.is_available"):
            check_device("cuda:0")


# ------------------------------------------------------------------------------ the copies


def test_copies_between_host_and_device(device):
    dev = check_device(device)
    host = torch.arange(12, dtype=torch.float32).view(3, 4)
    up = to_device(host, dev)
    assert up.device.type == dev.type and torch.equal(up.cpu(), host)
    down = to_host(up * 2)
    assert down.device.type == "cpu" and torch.equal(down, host * 2)
    assert to_device(up, dev) is up and to_host(host) is host  # where it is: itself, no copy
    if device == "cpu":
        assert up is host
    else:
        assert down.is_pinned()


TOKEN = "cuda-test"


@pytest.mark.parametrize("sparse_on_host", [False, True])
def test_batch_placement_moves_every_batch_in_order(device, sparse_on_host):
    dev = check_device(device)
    batches = list(TensorBatches(examples(100), 16))  # 7 batches, the last one short
    placement = BatchPlacement(dev, "cpu" if sparse_on_host else dev)
    placed = list(placement(batches))
    assert len(placed) == len(batches)
    for mine, theirs in zip(placed, batches):
        assert mine.dense.device.type == mine.labels.device.type == dev.type
        assert mine.sparse.device().type == ("cpu" if sparse_on_host else dev.type)
        assert torch.equal(mine.dense.cpu(), theirs.dense) and torch.equal(mine.labels.cpu(), theirs.labels)
        assert torch.equal(mine.sparse.values().cpu(), theirs.sparse.values())
        assert torch.equal(mine.sparse.lengths().cpu(), theirs.sparse.lengths())
    if device == "cpu":
        assert placement(batches) is batches  # the CPU path: the batches themselves, no loader stage


# ----------------------------------------------- PS collections on the device against plain torch


def test_pool_sum_pads_widths_the_gpu_kernels_refuse(device):
    """FBGEMM's GPU kernels take row widths that are multiples of 4: pool_sum pads D=9 rows to 12 there
    (pad=None: on a GPU) and slices the output back; the padded path (pad=True, run here on `device`)
    equals F.embedding_bag on the CPU, values and row gradients."""
    dev = check_device(device)
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(30, 9, generator=g)
    lengths = torch.randint(0, 4, (3 * 5,), generator=g)  # 3 features x B=5, some bags empty
    inverse = torch.randint(0, 30, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    up = torch.randn(5, 27, generator=g)
    mine = to_device(rows, dev).requires_grad_(True)
    out = pool_sum(mine, to_device(inverse, dev), to_device(offsets, dev), 3, pad=True)  # (5, 27)
    (grad,) = torch.autograd.grad((out * to_device(up, dev)).sum(), mine)
    ref_rows = rows.clone().requires_grad_(True)
    ref = F.embedding_bag(inverse, ref_rows, offsets[:-1], mode="sum").view(3, 5, 9).transpose(0, 1).reshape(5, 27)
    (ref_grad,) = torch.autograd.grad((ref * up).sum(), ref_rows)
    torch.testing.assert_close(out.detach().cpu(), ref.detach())
    torch.testing.assert_close(grad.cpu(), ref_grad)


@pytest.mark.parametrize("mode", ["geo", "sync"])
def test_ps_worker_on_device_equals_local_sgd_on_cpu(device, mode):
    """One worker, SGD everywhere: GEO (k=1, its replica a TBE on `device` with the fused SGD, the
    dense replica stepped there) and sync (rows pulled to the host, copied up, gradients copied down
    and applied by the server) train exactly as plain-torch SGD on the CPU; the servers end with its values."""
    dev = check_device(device)
    data, lr, dense_lr, steps = examples(256), 0.5, 0.1, 10
    with PSServer(token=TOKEN, halves=server_halves()) as server:
        client = PSClient([server.endpoint], token=TOKEN, timeout_s=20.0)
        sgd = {"name": "sgd", "lr": lr}
        client.create_sparse_table("embedding_d9", dim=DIM, optimizer=sgd, initializer=INIT, mode=mode)
        ebc = PSEmbeddingBagCollection.from_features(FEATURES, DIM, device=dev)
        model = make_model(ebc)
        named = {n: p for n, p in model.named_parameters()}  # the PS collection owns none
        client.create_dense_table("dense", {n: p.detach() for n, p in named.items()},
                                  optimizer={"name": "sgd", "lr": dense_lr}, mode=mode)
        model.to(dev)
        if mode == "geo":
            comm = GeoMode(table=TableConfig(optimizer=sgd), k_steps=1, background_sync=False).communicator(client)
            ebc.bind(comm)  # places the replica on `device`
            comm.attach_dense("dense", named)
            opt = torch.optim.SGD(list(named.values()), lr=dense_lr)
            updater = None
        else:
            comm = SyncMode(timeout_s=20.0).communicator(client, threads=1)
            ebc.bind(comm)
            updater = PSDenseUpdater(list(named.values()), comm, "dense")
        ref_ebc, ref, ref_opt = reference_sgd(ebc, data, lr, dense_lr)
        task = BinaryTask()
        batches = list(TensorBatches(data, 16))[:steps]
        for batch, placed in zip(batches, BatchPlacement(dev, "cpu")(batches)):
            logits = model(placed.dense, placed.sparse)
            assert logits.device.type == dev.type
            loss = task.loss(logits, placed)
            loss.backward()
            if updater is None:
                opt.step()
                opt.zero_grad()
                comm.step_end(0)
            else:
                updater.apply([p.grad for p in named.values()])
                for p in named.values():
                    p.grad = None
                updater.step_end(0)
            ref_loss = task.loss(ref(batch.dense, batch.sparse), batch)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-5)
        comm.flush()
        seen = ReferenceEBC(ebc, data.select(slice(0, steps * 16))).keys
        expected = ref_ebc.weight.detach()[torch.searchsorted(ref_ebc.keys, seen)]
        torch.testing.assert_close(client.pull("embedding_d9", seen).wait(), expected, atol=1e-5, rtol=0)
        server_dense = client.dense_layout("dense").unflatten(client.pull_dense("dense").wait())
        for name, p in ref.named_parameters():
            if name != "sparse_arch.weight":
                torch.testing.assert_close(server_dense[name], p.detach(), atol=1e-5, rtol=0)
        if mode == "geo":
            replica = comm._replicas["embedding_d9"]
            assert replica.weights.device.type == dev.type and replica.slot_keys.device.type == "cpu"
        comm.close()
        client.close()


# ------------------------------------------------------- whole runs: ps=local, GEO, async vs the CPU

RUN = ["model=ctr_dnn", "model.hidden=[64,32]", "trainer.threads=1", "trainer.batch_size=64", "trainer.epochs=1",
       "checkpoint.save=false", "progress=false", "metrics=off", "dataset.generate.train_rows=4000",
       "dataset.generate.test_rows=1000", "dataset.generate.vocab=200"]
EXTRA = {"local": ["ps.num_embeddings=2003"], "geo": ["ps.k_steps=8"], "async": []}
# How far a GPU run may land from the CPU's (same data, same first values): the first loss is one
# forward of equal parameters (summation order only); AUC after ~60 steps of float32 on other
# kernels, async also with its background merges (runs on one device differ by ~0.01).
FIRST_LOSS_TOLERANCE = 1e-4
AUC_TOLERANCE = {"local": 0.01, "geo": 0.01, "async": 0.02}

_CPU_RUNS: dict[str, dict] = {}  # mode -> the CPU run's metrics: the reference of the cuda half


def _run(mode: str, device: str, folder, run) -> dict:
    from recps.job.build import run_training

    cfg = compose_config([*RUN, f"ps={mode}", f"device={device}", f"dataset.dir={folder / 'synthetic'}",
                          *EXTRA[mode]])
    out = folder / f"{mode}-{device}"
    out.mkdir()
    if mode == "local":
        return run_training(cfg, out)
    return run(cfg, out, token=f"cuda-{mode}")


@pytest.mark.slow  # a whole job trained end to end: e2e, not in make test-fast
@pytest.mark.parametrize("mode", ["local", "geo", "async"])
def test_run_on_device_matches_cpu(device, mode, tmp_path_factory, in_process_cluster):
    folder = tmp_path_factory.mktemp(f"run-{mode}-{device}")
    metrics = _run(mode, device, folder, in_process_cluster)
    assert metrics["train_steps"] >= 60 and metrics["auc"] > 0.6, metrics  # it learned
    if device == "cpu":
        _CPU_RUNS[mode] = metrics
        return
    cpu = _CPU_RUNS.get(mode) or _run(mode, "cpu", tmp_path_factory.mktemp(f"run-{mode}-ref"), in_process_cluster)
    assert metrics["first_losses"][0] == pytest.approx(cpu["first_losses"][0], abs=FIRST_LOSS_TOLERANCE), (metrics, cpu)
    assert metrics["auc"] == pytest.approx(cpu["auc"], abs=AUC_TOLERANCE[mode]), (metrics["auc"], cpu["auc"])


def test_trainer_places_the_kjt_where_the_collection_or_the_task_reads_it(device):
    """A PS collection reads the batch's KJT on the host when the task hands it over as it is (BinaryTask);
    a task that builds its own KJT from it (passes_batch_sparse False: sequences, skip-gram) gets it on the
    device with the dense part, and the PS collection copies what it is given down (`_split`)."""
    from recps.job.loop import LocalDenseUpdater, Trainer

    class OwnKJTTask(BinaryTask):
        passes_batch_sparse = False

    dev = check_device(device)
    ebc = PSEmbeddingBagCollection.from_features(FEATURES, DIM, device=dev)
    model = make_model(ebc).to(dev)
    dense = list(model.parameters())
    for task, sparse in ((BinaryTask(), "cpu"), (OwnKJTTask(), dev.type)):
        trainer = Trainer(model, ebc, task, LocalDenseUpdater(dense, torch.optim.SGD(dense, lr=0.1)), device=device)
        assert (trainer.placement.device.type, trainer.placement.sparse_device.type) == (dev.type, sparse)
    batch = next(iter(TensorBatches(examples(8), 8)))
    parts, size = ebc._split(batch.sparse.to(dev))  # a KJT on the device (the host's itself on the CPU)
    on_host, _ = ebc._split(batch.sparse)
    assert size == 8 and all(a[1].device.type == "cpu" and torch.equal(a[1], b[1]) for a, b in zip(parts, on_host))
