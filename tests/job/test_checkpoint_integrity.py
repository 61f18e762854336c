"""Checkpoint integrity and failed writes (issue 15 point 5), on real files.

Local (ps=local): a short real run's checkpoint.pt carries its sha256 in checkpoint.json; 4 MiB of
overwritten rows, a damaged zip header, a damaged or missing record are refused naming the file,
before torch unpickles anything. A save onto a full file system (a real tmpfs of its own, when
this process may mount one) or a read-only one fails naming the file and what was kept: the
checkpoint already there still loads, no temporary is left.

Parameter server: a load that misses a table's spec.json or the table itself fails naming the
table (it used to drop it in silence); a server's save onto a full file system names the shard
folder and the file it was writing, leaves no temporary and keeps the earlier save loadable.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recps.job.checkpoint import commit_ps_checkpoint, load_checkpoint, save_checkpoint, verify_ps_checkpoint
from recps.job.settings import CheckpointSettings, JobSettings, TrainerSettings
from recps.config import PROJECT_ROOT, register_resolvers
from recps.errors import ConfigError, PSError
from recps.ps.node import PSClient

pytestmark = pytest.mark.timeout(600)

MiB = 1 << 20
LOCAL_RECORD = "checkpoint.json"  # recps.job.checkpoint.LOCAL_RECORD, the file users see


@contextlib.contextmanager
def tmpfs(path: Path, size: int, readonly: bool = False):
    """A tmpfs of `size` bytes mounted at `path` for the block (unmounted after); skips where this
    process may not mount (not root, no CAP_SYS_ADMIN)."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if readonly else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (mount: {proc.stderr.strip() or proc.returncode}); the injected "
                    "failures below still run")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def temporaries(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.rglob("*") if ".tmp-" in p.name)


# ------------------------------------------------------------------------------ local checkpoints


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """A short real ps=local DeepFM run (10 steps) and its checkpoint folder (~7.5 MiB checkpoint.pt)."""
    from recps.job.build import run_training

    register_resolvers()
    root = tmp_path_factory.mktemp("local-run")
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "ps=local", "model=deepfm", "progress=false", f"dataset.dir={root / 'data'}",
            "dataset.generate.train_rows=5000", "dataset.generate.test_rows=1000", "dataset.generate.vocab=100",
            "trainer.max_steps=10", "ps.num_embeddings=2000", "metrics=off"])
    metrics = run_training(cfg, root / "run")
    folder = Path(metrics["checkpoint"])
    assert (folder / "checkpoint.pt").stat().st_size > 5 * MiB
    return cfg, metrics, folder


def fresh_job(cfg):
    from recps.job.build import build_job

    return build_job(cfg)


def copy_of(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(folder, out)
    return out


def test_the_record_holds_both_files_sha256_and_a_load_restores_the_run(local_run):
    from recps.job.run import evaluate

    cfg, metrics, folder = local_run
    record = json.loads((folder / LOCAL_RECORD).read_text())
    assert record["kind"] == "local" and record["steps_done"] == metrics["train_steps"]
    for name in ("checkpoint.pt", "config.yaml"):
        data = (folder / name).read_bytes()
        assert record["files"][name] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    job = fresh_job(cfg)
    load_checkpoint(job, folder)
    assert job.steps_done == metrics["train_steps"]
    assert evaluate(job)["auc"] == pytest.approx(metrics["auc"], abs=1e-9)


def overwrite_rows(file: Path, nbytes: int) -> int:
    """Overwrite `nbytes` of tensor data in the torch zip `file` with plausible float32 rows
    (normal values), largest records first, every zip header left intact: what torch alone loads
    without a word. Returns the bytes overwritten."""
    with zipfile.ZipFile(file) as z:
        records = sorted((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: -i.file_size)
    done = 0
    with open(file, "r+b") as f:
        for info in records:
            f.seek(info.header_offset)
            header = f.read(30)  # the local file header: its name and extra field lengths at 26 and 28
            start = info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
            n = min(info.file_size, nbytes - done) // 4 * 4
            f.seek(start)
            f.write(torch.randn(n // 4, generator=torch.Generator().manual_seed(done)).numpy().tobytes())
            done += n
            if done >= nbytes:
                break
    return done


def test_4_mib_of_overwritten_rows_are_refused_naming_the_file(local_run, tmp_path):
    cfg, _, folder = local_run
    ckpt = copy_of(folder, tmp_path)
    file = ckpt / "checkpoint.pt"
    size = file.stat().st_size
    assert overwrite_rows(file, 4 * MiB) == 4 * MiB
    assert file.stat().st_size == size
    torch.load(file, map_location="cpu", weights_only=True)  # torch itself reads the damaged rows
    with pytest.raises(ConfigError, match=rf"{file} does not match {LOCAL_RECORD} .*corrupted or replaced"):
        load_checkpoint(fresh_job(cfg), ckpt)


def test_a_damaged_header_is_refused_with_a_clear_error(local_run, tmp_path):
    cfg, _, folder = local_run
    ckpt = copy_of(folder, tmp_path)
    file = ckpt / "checkpoint.pt"
    with open(file, "r+b") as f:  # the zip's first local header and record name
        f.seek(0)
        f.write(b"\xff" * 64)
    with pytest.raises(ConfigError, match=rf"{file} does not match {LOCAL_RECORD}"):
        load_checkpoint(fresh_job(cfg), ckpt)


def test_a_damaged_or_missing_record_or_config_is_refused_naming_it(local_run, tmp_path):
    cfg, _, folder = local_run
    ckpt = copy_of(folder, tmp_path)
    (ckpt / "config.yaml").write_text((ckpt / "config.yaml").read_text() + "# edited\n")
    with pytest.raises(ConfigError, match=rf"{ckpt / 'config.yaml'} does not match {LOCAL_RECORD}"):
        load_checkpoint(fresh_job(cfg), ckpt)
    shutil.copy(folder / "config.yaml", ckpt / "config.yaml")
    record = ckpt / LOCAL_RECORD
    record.write_bytes(record.read_bytes()[:40])
    with pytest.raises(ConfigError, match=rf"{record} is damaged .*not loaded"):
        load_checkpoint(fresh_job(cfg), ckpt)
    record.unlink()
    with pytest.raises(ConfigError, match=rf"{record} is missing: .*checkpoint.pt has no checksum record"):
        load_checkpoint(fresh_job(cfg), ckpt)


@pytest.mark.e2e
def test_a_save_onto_a_full_file_system_names_the_file_and_keeps_the_checkpoint(local_run, tmp_path):
    cfg, metrics, folder = local_run
    job = fresh_job(cfg)
    load_checkpoint(job, folder)
    size = (folder / "checkpoint.pt").stat().st_size
    with tmpfs(tmp_path / "small", int(size * 1.5)) as mount:  # one checkpoint fits, not a second beside it
        target = mount / "ckpt"
        save_checkpoint(job, target)
        job.steps_done += 1  # a different checkpoint: its copy beside the first does not fit
        with pytest.raises(OSError, match=rf"cannot write {target / 'checkpoint.pt'}: OSError: \[Errno 28\] No space "
                                          r"left on device; the checkpoint already there is kept as it was") as e:
            save_checkpoint(job, target)
        assert e.value.errno == errno.ENOSPC
        assert sorted(os.listdir(target)) == ["checkpoint.json", "checkpoint.pt", "config.yaml"]
        assert temporaries(mount) == []
        restored = fresh_job(cfg)
        load_checkpoint(restored, target)  # the first save, verified
        assert restored.steps_done == metrics["train_steps"]


@pytest.mark.e2e
def test_a_save_onto_a_read_only_file_system_names_the_file(local_run, tmp_path):
    cfg, _, _ = local_run
    with tmpfs(tmp_path / "ro", MiB, readonly=True) as mount:
        with pytest.raises(OSError, match=rf"cannot write {mount / 'ckpt' / 'checkpoint.pt'}: OSError: \[Errno 30\] "
                                          r"Read-only file system.*; no checkpoint was saved there") as e:
            save_checkpoint(fresh_job(cfg), mount / "ckpt")
        assert e.value.errno == errno.EROFS


def test_an_injected_write_failure_leaves_no_temporary_and_the_old_checkpoint(local_run, tmp_path, monkeypatch):
    cfg, metrics, folder = local_run
    ckpt = copy_of(folder, tmp_path)
    job = fresh_job(cfg)
    job.steps_done = 12345

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=rf"cannot write {ckpt / 'checkpoint.pt'}: .*injected.*kept as it was"):
        save_checkpoint(job, ckpt)
    monkeypatch.undo()
    assert sorted(os.listdir(ckpt)) == ["checkpoint.json", "checkpoint.pt", "config.yaml"]
    restored = fresh_job(cfg)
    load_checkpoint(restored, ckpt)
    assert restored.steps_done == metrics["train_steps"]

    # A failure after the staging (the rename into place): the record is gone first, so the
    # folder is refused, never loaded half old, half new.
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith("config.yaml"):
            raise PermissionError(errno.EACCES, "Permission denied (injected)")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(PermissionError, match=rf"cannot write {ckpt / 'config.yaml'}: .*injected.*{ckpt} holds no "
                                              r"complete checkpoint now"):
        save_checkpoint(job, ckpt)
    monkeypatch.undo()
    assert temporaries(ckpt) == [] and not (ckpt / LOCAL_RECORD).exists()
    with pytest.raises(ConfigError, match=f"{ckpt / LOCAL_RECORD} is missing"):
        load_checkpoint(fresh_job(cfg), ckpt)
    save_checkpoint(job, ckpt)  # saving again repairs it
    restored = fresh_job(cfg)
    load_checkpoint(restored, ckpt)
    assert restored.steps_done == 12345


# ------------------------------------------------------------------------------ PS checkpoints

TOKEN = "integrity"
KEYS = torch.arange(0, 60_000, dtype=torch.int64) * 7919


def trained(client: PSClient) -> None:
    client.create_sparse_table("emb", dim=8, optimizer={"name": "adagrad", "lr": 0.1},
                               initializer={"kind": "normal", "std": 0.1}, seed=3)
    client.create_dense_table("dense", {"w": torch.zeros(5, 3)}, optimizer={"name": "adam", "lr": 0.01})
    gen = torch.Generator().manual_seed(0)
    client.pull("emb", KEYS).wait()
    client.push("emb", KEYS, torch.randn(KEYS.numel(), 8, generator=gen)).wait()
    client.push_dense("dense", torch.randn(15, generator=gen)).wait()


def rows(client: PSClient) -> torch.Tensor:
    return client.pull("emb", KEYS).wait()


@pytest.fixture
def saved(tmp_path, ps_cluster):
    """A PS checkpoint of tables emb (sparse) and dense, committed like a run's; its emb rows."""
    folder = tmp_path / "ps-ckpt"
    with ps_cluster(2, TOKEN) as (_, client):
        trained(client)
        before = rows(client)
        client.save(str(folder))
    cfg = OmegaConf.create({"model": {"_target_": "models.CtrDnn"}})
    settings = JobSettings(TrainerSettings(), CheckpointSettings(), model_target=str(cfg.model._target_), ps="async",
                           config_yaml=OmegaConf.to_yaml(cfg, resolve=True))
    commit_ps_checkpoint(str(folder), ["emb", "dense"], settings, progress={"steps": 1, "workers": []})
    return folder, before


def test_a_fresh_cluster_restores_every_table_of_a_ps_checkpoint(saved, ps_cluster):
    folder, before = saved
    with ps_cluster(1, TOKEN) as (servers, client):
        assert client.load(str(folder)) == {"emb": KEYS.numel(), "dense": 1}
        assert torch.equal(rows(client), before)


def test_a_load_without_a_tables_spec_fails_naming_the_table(saved, ps_cluster):
    folder, _ = saved
    (folder / "emb" / "spec.json").unlink()
    with ps_cluster(1, TOKEN) as (_, client):
        with pytest.raises(PSError, match=rf"table 'emb' of {folder} .*has no spec.json \({folder / 'emb' / 'spec.json'} "
                                          r"is missing\)"):
            client.load(str(folder))
        with pytest.raises(PSError, match=rf"{folder / 'emb' / 'spec.json'} is missing: table 'emb' cannot be created"):
            client.load(str(folder), tables=["emb"])
    with pytest.raises(ConfigError, match=rf"{folder / 'emb' / 'spec.json'} is missing from the committed checkpoint"):
        verify_ps_checkpoint(str(folder))


def test_a_load_that_misses_a_listed_table_fails_naming_it(saved, ps_cluster):
    folder, _ = saved
    shutil.rmtree(folder / "emb")
    with ps_cluster(1, TOKEN) as (_, client):
        with pytest.raises(PSError, match=rf"table 'emb' of {folder} \(listed in its manifest.json\) has no folder"):
            client.load(str(folder))
    with pytest.raises(ConfigError, match=rf"{folder / 'emb'}/\S+ is missing from the committed checkpoint"):
        verify_ps_checkpoint(str(folder))


def test_a_manifest_less_folder_missing_a_spec_also_fails(tmp_path, ps_cluster):
    folder = tmp_path / "bare"
    with ps_cluster(1, TOKEN) as (_, client):
        trained(client)
        client.save(str(folder))
    (folder / "dense" / "spec.json").unlink()
    with ps_cluster(1, TOKEN) as (_, client):
        with pytest.raises(PSError, match=rf"table 'dense' of {folder} has no spec.json"):
            client.load(str(folder))
        with pytest.raises(PSError, match=rf"checkpoint folder {tmp_path / 'nowhere'} does not exist"):
            client.load(str(tmp_path / "nowhere"))


@pytest.mark.e2e
def test_a_ps_save_onto_a_full_file_system_names_the_shard_and_keeps_the_earlier_save(tmp_path, ps_cluster):
    with ps_cluster(1, TOKEN) as (servers, client):
        trained(client)
        before = rows(client)
        with tmpfs(tmp_path / "small", 8 * MiB) as mount:  # emb's shard is ~5 MiB: a second copy does not fit
            client.save(str(mount / "ckpt"))
            client.push("emb", KEYS, torch.ones(KEYS.numel(), 8)).wait()
            shard = mount / "ckpt" / "emb" / "shard-00000-of-00001"
            with pytest.raises(PSError, match=rf"cannot write {shard} \(\w+\.bin\): OSError: \[Errno 28\] No space left "
                                              r"on device; the shard folder there is as it was before this save; the "
                                              r"temporary folder was removed"):
                client.save(str(mount / "ckpt"))
            assert temporaries(mount) == []
            with ps_cluster(1, TOKEN) as (_, reader):
                reader.load(str(mount / "ckpt"))
                assert torch.equal(rows(reader), before)


def test_a_damaged_manifest_among_a_runs_checkpoints_is_named(saved, tmp_path):
    folder, _ = saved
    run = tmp_path / "run-ckpts"
    shutil.copytree(folder, run / "step-1")
    shutil.copytree(folder, run / "step-2")
    manifest = run / "step-2" / "manifest.json"
    manifest.write_bytes(b"\xff\xff" + manifest.read_bytes()[2:])  # a damaged header: not UTF-8
    from recps.job.checkpoint import find_checkpoint

    with pytest.raises(ConfigError, match=rf"{manifest} is damaged \(UnicodeDecodeError: "):
        find_checkpoint(str(run))
    with pytest.raises(ConfigError, match=rf"{manifest} is unreadable"):
        verify_ps_checkpoint(str(run / "step-2"))
