"""A PS job's servers save and load only inside the job's folders (recps.cluster.driver.storage_roots):
a request naming any other path is refused (recps.ps.node.server.check_storage_path), so a
client holding the token cannot have a server write elsewhere. cluster.encryption reaches every
process the job starts."""

from __future__ import annotations

import os

import pytest

from recps.cluster.driver import storage_roots
from recps.config import compose_config
from recps.errors import ConfigError
from recps.ps.node.server import check_storage_path
from tests.helpers.cli import recps_train


def test_the_roots_are_the_run_the_checkpoint_the_resume_and_the_stream_folders(tmp_path):
    cfg = compose_config(["ps=async", "checkpoint.dir=hdfs://nn:9000/ckpt", f"trainer.resume={tmp_path / 'old'}"])
    roots = storage_roots(cfg, tmp_path / "run", environ={"RECPS_STORAGE_ROOTS": "/extra/a,/extra/b"})
    assert roots == [str(tmp_path / "run"), "hdfs://nn:9000/ckpt", str(tmp_path / "old"), "/extra/a", "/extra/b"]
    stream = compose_config(["ps=async", "stream=hourly", "stream.root=/clicks", "stream.out=hdfs://nn:9000/model"])
    assert "hdfs://nn:9000/model" in storage_roots(stream, tmp_path / "run", environ={})
    assert storage_roots(compose_config(["ps=async"]), tmp_path / "run", environ={})[1] == str(tmp_path / "run" / "checkpoint")
    check_storage_path(f"{tmp_path}/run/checkpoint/step-20", roots, "save")
    with pytest.raises(ConfigError, match="outside the storage roots"):
        check_storage_path("hdfs://nn:9000/elsewhere", roots, "save")


@pytest.mark.e2e
@pytest.mark.slow
def test_a_ps_run_confines_its_servers_and_passes_encryption_off(tmp_path):
    run = tmp_path / "run"
    recps_train("ps=async", "trainer.max_steps=20", "progress=false", f"checkpoint.dir={tmp_path / 'ckpt'}",
                "cluster.encryption=off", f"hydra.run.dir={run}", timeout=600)
    log = (run / "cluster.log").read_text()
    assert "is not confined" not in log  # the servers knew the job's folders
    assert "in clear" in log  # encryption off reached the server processes
    assert (tmp_path / "ckpt" / "manifest.json").is_file()


def test_an_in_process_cluster_leaves_the_environment_as_it_was(tmp_path, in_process_cluster, monkeypatch):
    """The roots go to the server object, not into os.environ, where every later server of the
    process (other tests' in-process ones) would have read a stale run's folders."""
    monkeypatch.delenv("RECPS_STORAGE_ROOTS", raising=False)
    cfg = compose_config(["ps=async", "trainer.max_steps=4", "metrics=off", "progress=false", "model=ctr_dnn",
                          "model.hidden=[8]", f"dataset.dir={tmp_path / 'data'}", "dataset.generate.train_rows=2000",
                          "dataset.generate.test_rows=200", f"checkpoint.dir={tmp_path / 'ckpt'}"])
    (tmp_path / "run").mkdir()
    in_process_cluster(cfg, tmp_path / "run", token="roots")
    assert "RECPS_STORAGE_ROOTS" not in os.environ
    assert (tmp_path / "ckpt" / "manifest.json").is_file()  # the server saved inside its roots
