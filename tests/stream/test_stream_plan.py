"""recps.stream's pieces without a cluster: the pass plan, its checks, the donefiles, the wait."""

from __future__ import annotations

import json
import time

import pytest

from recps.data.generators.drifting import write_stream
from recps.errors import ConfigError, DataError
from recps.stream.donefile import BASE_DONEFILE, PATCH_DONEFILE, Donefiles, ModelRecord
from recps.stream.plan import StreamConfig, StreamPlan
from recps.stream.source import pass_files, wait_for_splits, worker_files
from recps.stream.pass_loop import resume_point


def config(**kw) -> StreamConfig:
    base = dict(root="/r", out="/o", start_day="20261201", end_day="20261202")
    return StreamConfig(**{**base, **kw})


def test_passes_keep_the_remainder_as_a_shorter_last_pass(caplog):
    plan = StreamPlan(config(hours=5, split_interval=60, split_per_pass=2))
    passes = plan.passes_of_day("20261201")
    assert [(p.index, p.minutes, p.last) for p in passes] == [
        (1, (0, 60), False), (2, (120, 180), False), (3, (240,), True)]
    assert "takes the 1 left" in caplog.text
    assert [f.rsplit("/", 1)[-1] for f in plan.split_folders(passes[0])] == ["0000", "0100"]


def test_a_checkpoint_goes_with_every_delta_and_every_day_end():
    plan = StreamPlan(config(hours=6, checkpoint_per_pass=4, save_delta_frequency=3))
    saves = {p.index: plan.saves(p) for p in plan.passes_of_day("20261201")}
    assert saves == {1: (False, False), 2: (False, False), 3: (True, True), 4: (True, False),
                     5: (False, False), 6: (True, True)}


@pytest.mark.parametrize("kw, says", [
    (dict(root="???"), "stream.root is not set"),
    (dict(start_day="2026-12-01"), "stream.start_day='2026-12-01' is not a day"),
    (dict(start_day="20261301"), "is not a day"),
    (dict(end_day=None), "stream.end_day is not set and stream.follow=false"),
    (dict(end_day="20261130"), "is before stream.start_day"),
    (dict(split_interval=50), "does not divide the day's 1440 minutes"),
    (dict(layout="hh", split_interval=30), "holds hourly splits"),
    (dict(split_per_pass=0), "stream.split_per_pass=0"),
    (dict(data_donefile="a/b"), "stream.data_donefile"),
])
def test_bad_settings_are_refused_naming_the_key(kw, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace("?", r"\?")):
        config(**kw)


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['spilt_interval'\]"):
        StreamConfig.from_config({"enabled": True, "root": "/r", "out": "/o", "start_day": 20261201,
                                  "end_day": 20261201, "spilt_interval": 30})


def test_wait_is_bounded_and_names_the_split(tmp_path):
    (tmp_path / "0000").mkdir()
    now = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    with pytest.raises(DataError, match=r"0000 has no _SUCCESS after 25 s \(stream.wait_timeout_s=25\)"):
        wait_for_splits([str(tmp_path / "0000")], "_SUCCESS", sleep_s=10, timeout_s=25, clock=lambda: now[0], sleep=sleep)
    assert sleeps == [10, 10, 5]
    (tmp_path / "0000" / "_SUCCESS").touch()
    assert wait_for_splits([str(tmp_path / "0000")], "_SUCCESS", sleep_s=10, timeout_s=25) == pytest.approx(0, abs=1)


def test_an_unreachable_file_system_is_waited_on_within_the_bound_then_named(caplog):
    from recps.cluster.launch import free_port

    split = f"hdfs://127.0.0.1:{free_port()}/clicks/20261201/0000"  # nothing listens there
    t = time.monotonic()
    with pytest.raises(DataError) as e:
        wait_for_splits([split], "_SUCCESS", sleep_s=0.2, timeout_s=2)
    assert 2 <= time.monotonic() - t < 30
    message = str(e.value)
    assert message.startswith(f"stream split {split}: its file system did not answer")
    assert "stream.wait_timeout_s=2" in message and "NameNode" in message and "run the same command again" in message
    assert sum("cannot be looked at" in r.message for r in caplog.records) == 1  # one line per outage


def test_files_of_a_pass_skip_markers_and_shard_by_worker(tmp_path):
    info = write_stream(str(tmp_path / "s"), days=1, hours=1, rows=100, files_per_split=3)
    folder = info.split_paths()[0]
    files = pass_files([folder])
    assert [f.rsplit("/", 1)[-1] for f in files] == ["part-00000", "part-00001", "part-00002"]
    assert worker_files(files, 1, 2, whole_pass=False) == ([files[1]], 0, 1)
    assert worker_files(files, 1, 4, whole_pass=False) == (files, 1, 4)  # fewer files than workers: rows
    assert worker_files(files, 0, 2, whole_pass=True) == (files, 0, 2)  # sync: every worker reads the pass
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "_SUCCESS").touch()
    with pytest.raises(DataError, match="marked ready but holds no data file"):
        pass_files([str(tmp_path / "empty")])


def test_donefiles_append_atomically_and_refuse_a_bad_line(tmp_path):
    done = Donefiles(str(tmp_path))
    done.add_model(ModelRecord("20261201", 7, f"{tmp_path}/20261201/1", 1))
    done.add_model(ModelRecord("20261201", 7, f"{tmp_path}/20261201/2", 2))
    lines = (tmp_path / "donefile.txt").read_text().splitlines()
    assert lines == [f"20261201\t7\t{tmp_path}/20261201/1\t1\t0", f"20261201\t7\t{tmp_path}/20261201/2\t2\t0"]
    record = done.add_export(PATCH_DONEFILE, f"{tmp_path}/20261201/delta-1", 7, rows=5, data_path="/r",
                             monitor={"auc": 0.7}, workers=2)
    # `input` names the folder itself (recps.serve and read_ps_checkpoint open it), not Paddle's `/000`
    assert record["input"] == f"{tmp_path}/20261201/delta-1" and record["key"] == "7"
    assert json.loads((tmp_path / PATCH_DONEFILE).read_text())["monitor_data"] == {"auc": 0.7}
    assert done.published(PATCH_DONEFILE, f"{tmp_path}/20261201/delta-1")
    assert not done.published(BASE_DONEFILE, f"{tmp_path}/20261201/delta-1")
    assert Donefiles.input_of("hdfs://127.0.0.1:9000/model/20261202/base") == "hdfs://127.0.0.1:9000/model/20261202/base"
    # a record an earlier recps wrote with Paddle's `/000` still names its folder: a stream begun before resumes
    legacy = {"input": "hdfs://127.0.0.1:9000/model/20261202/base/000"}
    assert Donefiles.export_folder(legacy) == "hdfs://127.0.0.1:9000/model/20261202/base"
    old = dict(record, input=f"{tmp_path}/20261201/delta-2/000")
    with open(tmp_path / PATCH_DONEFILE, "a") as f:
        f.write(json.dumps(old) + "\n")
    assert done.record_of(PATCH_DONEFILE, f"{tmp_path}/20261201/delta-2") == old
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary left beside them
    with open(tmp_path / "donefile.txt", "a") as f:
        f.write("20261201\tseven\t/x\t3\t0\n")
    with pytest.raises(ConfigError, match=r"donefile.txt line 3 does not parse"):
        done.models()
    (tmp_path / PATCH_DONEFILE).write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"patch_donefile.txt line 1 does not parse"):
        done.patches()


def test_resume_point_refuses_a_history_that_goes_back_in_time(tmp_path):
    done = Donefiles(str(tmp_path))
    done.add_model(ModelRecord("20261202", 1, f"{tmp_path}/20261202/1", 1))
    done.add_model(ModelRecord("20261201", 1, f"{tmp_path}/20261201/2", 2))
    with pytest.raises(ConfigError, match="went back in time"):
        resume_point(config(out=str(tmp_path), hours=2))


def test_resume_point_of_a_fresh_out_is_the_first_pass(tmp_path):
    r = resume_point(config(out=str(tmp_path / "none"), hours=2))
    assert r.folder is None and r.next.name == "20261201/1" and r.day_end is None


def test_patch_ids_are_unique_and_increasing_within_one_second(tmp_path):
    done = Donefiles(str(tmp_path))
    ids = [int(done.add_export(PATCH_DONEFILE, f"{tmp_path}/20261201/delta-{p}", 7, rows=1, data_path="/r", monitor={},
                               workers=1)["id"]) for p in range(1, 5)]
    assert ids == sorted(set(ids)) and ids[0] >= int(time.time()) - 60, ids


def test_resume_point_keeps_a_delta_published_before_its_checkpoint(tmp_path):
    """A crash between a delta's record and its pass's checkpoint: the pass is trained again and the
    published delta is its own (never exported again, never removed as a leftover)."""
    out = str(tmp_path)
    done = Donefiles(out)
    for p in (1, 2):
        (tmp_path / "20261201" / f"delta-{p}").mkdir(parents=True)
        (tmp_path / "20261201" / f"delta-{p}" / "manifest.json").write_text(
            json.dumps({"progress": {"stream": {"rows": 1}}}))
        done.add_export(PATCH_DONEFILE, f"{out}/20261201/delta-{p}", 7, rows=1, data_path="/r", monitor={}, workers=1)
    (tmp_path / "20261201" / "1").mkdir()
    (tmp_path / "20261201" / "1" / "manifest.json").write_text(json.dumps({"progress": {"steps": 3, "stream": {
        "day": "20261201", "pass": 1, "base_key": 7, "delta": f"{out}/20261201/delta-1", "passes_done": 1}}}))
    done.add_model(ModelRecord("20261201", 7, f"{out}/20261201/1", 1))
    r = resume_point(config(out=out, hours=3))
    assert r.folder == f"{out}/20261201/1" and r.next.name == "20261201/2" and r.base_key == 7
    assert r.published_delta == f"{out}/20261201/delta-2" and r.publish_delta is None


@pytest.mark.parametrize("layout", ["hhmm", "hive"])
def test_a_missing_start_day_is_the_streams_own_and_logged(tmp_path, caplog, layout):
    """Issue 32.2: stream.start_day was required though the stream's _stream.json or its first partition
    says where it starts."""
    import logging

    from recps.stream.plan import with_start_day

    described = tmp_path / "described"
    write_stream(str(described), days=2, hours=1, rows=20, start_day="20261130")
    bare = tmp_path / "bare"
    for day in ("20261203", "20261202"):
        (bare / (f"day={day}" if layout == "hive" else day) / "part").mkdir(parents=True)
    (bare / "tmp").mkdir()  # not a day
    values = {"root": str(described), "out": "/o", "start_day": None, "end_day": "20261201", "layout": layout}
    with caplog.at_level(logging.INFO, logger="recps.stream"):
        assert with_start_day(values)["start_day"] == "20261130"
        assert with_start_day({**values, "root": str(bare)})["start_day"] == "20261202"
        assert with_start_day({**values, "start_day": "20261201"})["start_day"] == "20261201"  # given: kept
    first = "day=20261202" if layout == "hive" else "20261202"
    assert [r.getMessage() for r in caplog.records if "start_day" in r.getMessage()] == [
        f"stream.start_day not set: 20261130, from {described}/_stream.json (stream.start_day=YYYYMMDD starts elsewhere)",
        f"stream.start_day not set: 20261202, from {bare}/{first} (stream.start_day=YYYYMMDD starts elsewhere)"]
    StreamConfig.from_config(with_start_day(values))  # a whole config
    with pytest.raises(ConfigError, match=f"stream.start_day is not set and {tmp_path / 'empty'} holds neither "
                                          r"_stream.json nor a day folder .* give stream.start_day=YYYYMMDD"):
        with_start_day({**values, "root": str(tmp_path / "empty")})
    (bare / "_stream.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"_stream.json holds no start_day \(YYYYMMDD\).*give stream.start_day"):
        with_start_day({**values, "root": str(bare)})
