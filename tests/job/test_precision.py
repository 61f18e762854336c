"""trainer.precision (issue 17 point 2): bf16 autocast of the dense part, fp32 rows, refusals.

bf16 must learn what fp32 learns (AUC within 0.002 on generated data: measured 0.00004-0.0002
apart at the same seed, while fp32 itself moves 0.0006-0.0014 between seeds), in every mode;
fp16 needs CUDA, but its loss-scale arithmetic (the Trainer's, CPU autocast in fp16) is checked
here: the rows get unscaled gradients and an overflowing step changes nothing.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

from recps.config import compose_config
from recps.errors import ConfigError
from recps.job.observer import TrainObserver
from recps.job.build import build_job
from recps.job.run import evaluate
from recps.job.loop import Trainer
from recps.job.precision import Precision
from tests.helpers.cli import CliRun, recps_train

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class Dtypes(TrainObserver):
    """What the training threads computed in: the output dtypes of every Linear layer and of the
    embedding collection, and the dtypes of the dense gradients after each backward."""

    def __init__(self) -> None:
        self.linear, self.rows, self.grads = set(), set(), set()
        self.replicas = []

    def on_fit_start(self, replicas) -> None:
        self.replicas = list(replicas)
        for replica in self.replicas:
            for module in replica.modules():
                if isinstance(module, nn.Linear):
                    module.register_forward_hook(lambda m, i, out: self.linear.add(out.dtype))
            replica.sparse_arch.register_forward_hook(lambda m, i, out: self.rows.add(out.values().dtype))

    def after_backward(self, thread) -> None:
        self.grads.update(p.grad.dtype for p in self.replicas[thread].parameters() if p.grad is not None)


def world(tmp, rows: int, test_rows: int, vocab: int) -> list[str]:
    return [f"dataset.dir={tmp}", f"dataset.generate.train_rows={rows}", f"dataset.generate.test_rows={test_rows}",
            f"dataset.generate.vocab={vocab}", "metrics=off", "progress=false", "checkpoint.save=false"]


@pytest.fixture(scope="module")
def quality_data(tmp_path_factory):
    return tmp_path_factory.mktemp("precision-quality")


@pytest.mark.slow  # a whole job trained end to end: e2e, not in make test-fast
@pytest.mark.parametrize("model", ["ctr_dnn", "deepfm"])
def test_bf16_learns_what_fp32_learns(quality_data, model):
    """The same run (seed, one thread, 2 passes over 40,000 rows) in fp32 and in bf16: the held-out
    AUCs (20,000 rows) differ by less than 0.002, both learn (best reachable 0.78); bf16 ran its
    Linear layers in bf16, the rows and every gradient stayed fp32."""
    aucs, seen = {}, {}
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread, no intra-op split: the two runs differ only by precision
    try:
        for precision in ("fp32", "bf16"):
            job = build_job(compose_config(["ps=local", f"model={model}", "trainer.threads=1", "seed=3",
                                            f"trainer.precision={precision}", *world(quality_data, 40_000, 20_000, 100)]))
            seen[precision] = Dtypes()
            job.trainer.observers = [seen[precision]]
            job.trainer.fit(job.data.train, 512, epochs=2, progress=False)
            aucs[precision] = evaluate(job)["auc"]
            assert all(w.dtype == torch.float32 for w in job.collection.state_dict().values())
    finally:
        torch.set_num_threads(previous)
    assert abs(aucs["bf16"] - aucs["fp32"]) < 0.002, aucs
    assert min(aucs.values()) > 0.72, aucs
    assert (seen["fp32"].linear, seen["bf16"].linear) == ({torch.float32}, {torch.bfloat16})
    assert seen["fp32"].rows == seen["bf16"].rows == {torch.float32}
    assert seen["fp32"].grads == seen["bf16"].grads == {torch.float32}


@pytest.mark.parametrize("mode", ["local", "sync", "async", "geo"])
def test_bf16_trains_in_every_mode(tmp_path, in_process_cluster, mode):
    """trainer.precision=bf16 on a real short run of each mode (PS modes: a server and a worker with
    2 threads over ZeroMQ, recps.cluster's code): the threads' Linear layers computed in bf16, the
    rows the collection pooled (pulled from the server, or GEO's replica) and every dense gradient
    pushed or applied are fp32, and the run learns: held-out AUC > 0.64 (this small world's best
    reachable is 0.78; measured twice per mode: fp32 0.668-0.675, bf16 0.663-0.673)."""
    overrides = [f"ps={mode}", "model=ctr_dnn", "trainer.threads=2", "trainer.batch_size=64", "trainer.epochs=2",
                 "trainer.precision=bf16", *world(tmp_path / "data", 8_000, 2_000, 100)]
    seen = Dtypes()
    if mode == "local":
        job = build_job(compose_config(overrides))
        job.trainer.observers = [seen]
        job.trainer.fit(job.data.train, 64, epochs=2, progress=False)
        metrics = evaluate(job)
    else:
        out = tmp_path / "run"
        out.mkdir()
        if mode == "geo":
            overrides.append("ps.k_steps=10")
        metrics = in_process_cluster(compose_config([*overrides, "cluster.workers=1"]), out,
                                     token=f"bf16-{mode}", observers=[seen])
    assert seen.linear == {torch.bfloat16}
    assert seen.rows == seen.grads == {torch.float32}
    assert metrics["auc"] > 0.64, metrics


def test_a_bad_precision_is_refused_before_any_data_is_read(tmp_path):
    """fp8, and fp16 on CPU: a ConfigError naming trainer.precision and the fix, before the data set
    is generated (build_job: what ps=local and every PS worker run)."""
    for value, says in (("fp8", "trainer.precision='fp8' is not one of fp32, bf16, fp16; set trainer.precision=fp32"),
                        ("fp16", "trainer.precision=fp16 with device='cpu': fp16 training needs CUDA")):
        data = tmp_path / value
        for mode in ("local", "geo"):
            with pytest.raises(ConfigError, match="on CPU set trainer.precision=bf16" if value == "fp16" else
                               "set trainer.precision=fp32 \\(the default\\) or bf16") as err:
                build_job(compose_config([f"ps={mode}", f"trainer.precision={value}", *world(data, 1000, 500, 100)]))
            assert says in str(err.value)
        assert not data.exists()
    with pytest.raises(ConfigError, match="trainer.precision=fp16 with device='cpu'"):
        job = build_job(compose_config(["ps=local", "model=ctr_dnn", *world(tmp_path / "d", 1000, 500, 100)]))
        Trainer(job.model, job.collection, job.task, job.trainer.updater, precision="fp16", device="cpu")


def _cli(tmp_path, *overrides: str) -> CliRun:
    """recps.train on a small world, expected to fail (the tests read why)."""
    return recps_train(*overrides, "progress=false", f"hydra.run.dir={tmp_path / 'run'}",
                       *world(tmp_path / "data", 1000, 500, 100)[:4], check=None)


@pytest.mark.e2e
def test_the_cli_refuses_fp8_in_one_line(tmp_path):
    proc = _cli(tmp_path, "ps=local", "trainer.precision=fp8")
    assert proc.returncode != 0
    said = (proc.stdout + proc.stderr).strip().splitlines()
    assert said[-1] == ("recps.train: ConfigError: trainer.precision='fp8' is not one of fp32, bf16, fp16; "
                        "set trainer.precision=fp32 (the default) or bf16 (fp16 on CUDA only)")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "run" / "metrics.json").exists()


@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: device=cuda is valid")
@pytest.mark.parametrize("mode,fix", [(mode, "torch.cuda.is_available() is False on this machine") for mode in ("local", "async")]
                         + [("async", "run `make setup-gpu` and train with .venv-gpu/bin/python (torch's CUDA build "
                                      "with fbgemm-gpu's), or set device=cpu")])
def test_device_cuda_without_a_gpu_names_the_fix(tmp_path, mode, fix):
    """On a CPU-only machine device=cuda fails at once with one line naming the fix, before any data
    is generated or process started."""
    proc = _cli(tmp_path, f"ps={mode}", "device=cuda")
    assert proc.returncode != 0
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1]
    assert last.startswith("recps.train: ConfigError: ") and "device='cuda'" in last and fix in last, last
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "data").exists()


# ------------------------------------------------------------------------ fp16's loss scale (CPU autocast)


def _job(tmp_path, *overrides: str):
    return build_job(compose_config(["ps=local", "model=ctr_dnn", "trainer.threads=1", "seed=5", *overrides,
                                     *world(tmp_path, 4_000, 1_000, 100)]))


def _sgd_job(tmp_path):
    """CTR-DNN whose rows and dense layers train with plain SGD: a step is lr x the gradient, so a
    gradient left scaled would show as a step `scale` times too long (Adagrad or Adam would hide it)."""
    return _job(tmp_path, "ps.table.optimizer.name=sgd", "ps.table.optimizer.lr=0.5", "optimizer=sgd",
                "optimizer.lr=0.5")


def _rows(job) -> torch.Tensor:
    return torch.cat([w.detach().clone().flatten() for w in job.collection.state_dict().values()])


def test_fp16_rows_get_unscaled_gradients(tmp_path):
    """One step at loss scale 2^12 moves the rows as the fp32 step does (the forward hook divides
    the scale out of the gradient reaching them), and the dense parameters likewise."""
    moved = {}
    for name in ("fp32", "fp16"):
        job = _sgd_job(tmp_path)
        precision = Precision(name, "cpu")
        if precision.scaler is not None:
            precision.scaler.scale = 2.0 ** 12
        trainer = Trainer(job.model, job.collection, job.task, job.trainer.updater, precision=precision)
        rows, dense = _rows(job), [p.detach().clone() for p in job.optimizer.param_groups[0]["params"]]
        trainer.fit(job.data.train, 256, max_steps=1, progress=False)
        moved[name] = (_rows(job) - rows,
                       torch.cat([(p.detach() - d).flatten() for p, d in zip(job.optimizer.param_groups[0]["params"], dense)]))
        if precision.scaler is not None:
            assert precision.scaler.skipped == 0
    for fp32, fp16 in zip(moved["fp32"], moved["fp16"]):
        assert fp32.abs().max() > 0
        assert torch.allclose(fp16, fp32, rtol=0.05, atol=0.05 * float(fp32.abs().max())), (fp16 - fp32).abs().max()


def test_fp16_is_refused_where_a_skipped_step_would_stall_the_servers(tmp_path):
    """sync / async push every step's dense gradient (PSDenseUpdater): fp16 could not skip one."""
    from recps.ps.modes.dense import PSDenseUpdater

    job = _job(tmp_path)
    trainer = Trainer(job.model, job.collection, job.task, PSDenseUpdater([], None, "dense"),
                      precision=Precision("fp16", "cpu"))
    with pytest.raises(ConfigError, match="trainer.precision=fp16 with PSDenseUpdater: .* use trainer.precision=bf16"):
        trainer.fit(job.data.train, 64, max_steps=1, progress=False)


@pytest.mark.slow  # a whole job trained end to end: e2e, not in make test-fast
def test_fp16_overflowing_steps_are_skipped_and_the_scale_backs_off(tmp_path):
    """At scale 2^40 the fp16 backward overflows: the step changes neither rows nor dense parameters,
    the scale halves until the gradients fit (~25 skipped steps), and the run then learns about as the
    fp32 run does (this 4,000-row world is noisy: the bound is loose; bf16's quality test is the strict one)."""
    job = _job(tmp_path)
    precision = Precision("fp16", "cpu")
    precision.scaler.scale = 2.0 ** 40
    trainer = Trainer(job.model, job.collection, job.task, job.trainer.updater, precision=precision)
    rows, dense = _rows(job), [p.detach().clone() for p in job.optimizer.param_groups[0]["params"]]
    trainer.fit(job.data.train, 64, max_steps=1, progress=False)
    assert precision.scaler.skipped == 1 and precision.scaler.scale == 2.0 ** 39
    assert torch.equal(_rows(job), rows)
    assert all(torch.equal(p, d) for p, d in zip(job.optimizer.param_groups[0]["params"], dense))
    trainer.fit(job.data.train, 64, epochs=2, progress=False)
    assert 10 < precision.scaler.skipped < 40 and precision.scaler.scale < 2.0 ** 20
    reference = _job(tmp_path)  # fp32, the same steps (skipped ones included)
    reference.trainer.fit(reference.data.train, 64, epochs=2, max_steps=1 + 2 * 63, progress=False)
    fp16, fp32 = evaluate(job)["auc"], evaluate(reference)["auc"]
    assert fp16 > 0.6 and abs(fp16 - fp32) < 0.03, (fp16, fp32)  # measured 0.640 and 0.628 (4,000 rows)
