"""Every YAML under conf/ composes; the count is asserted so no file is silently skipped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recps.config import (
    PROJECT_ROOT,
    TASK_ENGINE_KEYS,
    check_target_args,
    compose_config,
    register_resolvers,
    validate_config,
)
from recps.errors import ConfigError
from recps.job.build import MODEL_ENGINE_KEYS, MODEL_INJECTED

CONF = PROJECT_ROOT / "conf"
GROUP_FILES = sorted(p for p in CONF.rglob("*.yaml") if p.parent != CONF)
EXPECTED_FILES = 63  # update when a config is added: the count proves the walk saw them all


def test_conf_file_count():
    all_files = sorted(CONF.rglob("*.yaml"))
    assert len(all_files) == EXPECTED_FILES, [str(p.relative_to(CONF)) for p in all_files]


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: str(p.relative_to(CONF)))
def test_every_group_option_composes(path: Path):
    register_resolvers()
    group = str(path.parent.relative_to(CONF))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"{group}={path.stem}"])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    node = cfg
    for part in group.split("/"):
        node = node[part]
    assert node == OmegaConf.load(path) or "_target_" not in node or node._target_
    assert resolved["seed"] == 0
    if group == "model":
        check_target_args(cfg.model, "model", injected=MODEL_INJECTED, engine_keys=MODEL_ENGINE_KEYS)
    if group in ("optimizer", "task"):
        check_target_args(node, group, injected=("params",), engine_keys=TASK_ENGINE_KEYS)
    if group == "stream" and path.stem == "hourly":  # its root and out have no default (???)
        with pytest.raises(ConfigError, match=r"stream.out, stream.root not set .*stream.out=\.\.\."):
            validate_config(cfg)
        cfg = compose_config(["stream=hourly", "stream.root=/r", "stream.out=/o", "stream.start_day=20261201",
                              "stream.end_day=20261201"])
    validate_config(cfg)  # the whole config, as recps.train checks it before anything starts
    if group == "ps" and path.stem != "local":  # a PS mode: one constructor, its table node another
        from recps.config import ps_mode

        # binds `ps` and `ps.table` to their constructors' signatures, then builds: every value
        # passes the constructor's own checks
        mode = ps_mode(cfg)
        assert mode.name == path.stem == node.name


def test_each_ps_knob_has_one_default_the_constructors():
    """conf/ps/<mode>.yaml writes no knob's default: they come from the constructor's signature."""
    import dataclasses

    from recps.ps.modes import MODES

    for name, mode in MODES.items():
        written = OmegaConf.load(CONF / "ps" / f"{name}.yaml")
        knobs = {f.name for f in dataclasses.fields(mode)} - {"table"}
        assert not knobs & set(written), (name, knobs & set(written))
        assert set(written.table) <= {"optimizer", "seed"} and set(written.table.optimizer) == {"lr"}


def test_unknown_model_argument_is_named():
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+model.hiden=[8]"])
    with pytest.raises(ConfigError, match=r"model \(models.DeepFM\).*hiden"):
        check_target_args(cfg.model, "model", injected=MODEL_INJECTED, engine_keys=MODEL_ENGINE_KEYS)


# ------------------------------------------------------------------ validate_config (issue 18, point 3)


@pytest.mark.parametrize("override, message", [
    ("trainer.batch_size=-1", "trainer.batch_size=-1: give the examples per batch (per thread), 1 or more"),
    ("trainer.batch_size=0", "trainer.batch_size=0: give the examples per batch"),
    ("trainer.threads=0", "trainer.threads=0: give the training threads per process, 1 or more"),
    ("trainer.epochs=-2", "trainer.epochs=-2: give the number of passes"),
    ("trainer.max_steps=0", "trainer.max_steps=0: give -1 (no limit"),
    ("trainer.eval_batch_size=1.5", "trainer.eval_batch_size=1.5: give the examples per evaluation batch"),
    ("cluster.workers=0", "cluster.workers=0; it must be an integer >= 1"),
    ("cluster.servers=two", "cluster.servers='two'; it must be an integer >= 1"),
    ("cluster.dead_after_s=0", "cluster.dead_after_s=0; give a number of seconds > 0"),
    ("cluster.server_threads=-1", "cluster.server_threads=-1; give null (chosen from the cores here) or an integer"),
    ("trainer.precision=fp8", "trainer.precision='fp8'"),
    ("cluster.encryption=tls", "cluster.encryption='tls'; use curve (authenticated, encrypted), off"),
    ("device=gpu", "device='gpu': use cpu or cuda"),
    ("checkpoint.save=maybe", "checkpoint.save='maybe': use true or false"),
    ("ps.max_pending=0", "max_pending"),
])
def test_a_bad_value_is_refused_naming_it(override, message):
    """Each under the default ps=async: the launcher refuses it before any process starts."""
    cfg = compose_config([override])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, [override])
    assert message in str(err.value)


def test_cluster_values_are_not_checked_under_ps_local():
    validate_config(compose_config(["ps=local", "cluster.workers=0"]))  # ps=local starts no cluster


def test_an_added_key_nothing_reads_is_refused_with_the_closest_key():
    """Hydra's hint for a key the config lacks is `+trainer.thread=2`: following it must not train with
    the key ignored."""
    cfg = compose_config(["+trainer.thread=2"])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, ["+trainer.thread=2"])
    assert str(err.value).startswith("trainer.thread=2 (from the override +trainer.thread=2) is read by nothing")
    assert "did you mean trainer.threads?" in str(err.value)
    for override, where in (("+cluster.worker=2", "did you mean cluster.workers?"),
                            ("+checkpoint.dri=/x", "did you mean checkpoint.dir?"),
                            ("+sed=3", "did you mean seed?"),
                            ("+model.hiden=[8]", "did you mean model.hidden?"),
                            ("+ps.max_pendin=3", "did you mean ps.max_pending?"),
                            ("+task.metric=[auc]", "did you mean task.metrics?")):
        with pytest.raises(ConfigError, match=re.escape(where)):
            validate_config(compose_config([override]), [override])
    with pytest.raises(ConfigError, match=re.escape("did you mean ps.num_embeddings?")):
        validate_config(compose_config(["ps=local", "+ps.num_embedding=7"]))


def test_an_added_key_that_a_value_interpolates_is_kept():
    """A user's own top-level value that others refer to (`data_root`) is read, through the interpolation."""
    cfg = compose_config(["+data_root=/data", "dataset.dir=${data_root}/synthetic"])
    validate_config(cfg)
    assert cfg.dataset.train == ["/data/synthetic/train.txt"]
    validate_config(compose_config(["++trainer.observers=[]"]))  # an optional key the engine reads


def test_a_key_the_config_lacks_gets_the_closest_one():
    from hydra.errors import ConfigCompositionException

    from recps.config import composition_error_message

    for override, expected in (
        ("trainer.thread=2", "trainer.thread=2: trainer has no key 'thread'; did you mean trainer.threads? "
                             "(trainer's keys: epochs, max_steps, batch_size, threads, eval_batch_size, resume"),
        ("model.hiden=[8]", "model.hiden=[8]: model has no key 'hiden'; did you mean model.hidden?"),
        ("sed=1", "sed=1: the config has no key 'sed'; did you mean seed?"),
        ("cluster.zzz=1", "cluster.zzz=1: cluster has no key 'zzz' (cluster's keys: name, servers"),
    ):
        with pytest.raises(ConfigCompositionException) as err:
            compose_config([override])
        assert composition_error_message(err.value).startswith(expected), composition_error_message(err.value)


def test_a_misspelled_group_option_gets_one_line_with_the_closest_option():
    """Issue 32.8: Hydra's multi-line "Could not find 'model/deepfmm'" and its search path become one line."""
    from hydra.errors import ConfigCompositionException

    from recps.config import composition_error_message

    for override, expected in (
        ("model=deepfmm", "model=deepfmm: no such model; did you mean deepfm? (the options: autoint, bst, "),
        ("ps=asnyc", "ps=asnyc: no such ps; did you mean async? (the options: async, geo, local, sync)"),
        ("pipeline=video_funel", "pipeline=video_funel: no such pipeline; did you mean video_funnel? (the options: "
                                 "movielens_funnel, none, video_funnel)"),
        ("stream=zzz", "stream=zzz: no such stream (the options: hourly, off)"),
    ):
        with pytest.raises(ConfigCompositionException) as err:
            compose_config([override])
        message = composition_error_message(err.value)
        assert message is not None and message.startswith(expected) and "\n" not in message, message


def test_one_value_where_a_group_of_settings_belongs_is_named():
    """Issue 32.12: `checkpoint=false` (a natural guess) ended in an AttributeError traceback, `trainer=null`
    and `cluster=3` in Hydra's ValueError, `trainer=[1]` in a TypeError."""
    from recps.config import check_group_overrides

    with pytest.raises(ConfigError, match=r"^checkpoint=False \(from the override checkpoint=false\): checkpoint is "
                                          r"a group of settings, not one value; set its keys instead, e\.g\. "
                                          r"checkpoint\.save=\.\.\. \(checkpoint's keys: save, dir, keep_last\)$"):
        validate_config(compose_config(["checkpoint=false"]), overrides=["checkpoint=false"])
    for override, group in (("trainer=null", "trainer"), ("cluster=3", "cluster"), ("trainer=[1]", "trainer")):
        with pytest.raises(ConfigError, match=rf"^{re.escape(override)}: {group} is a config group: choose one of "
                                              rf"its options \(.*\), e\.g\. {group}=\w+, or set one of its keys"):
            check_group_overrides(["-m", override, "seed=1"])
    check_group_overrides(["model=deepfm,fm", "ps@pipeline.stages.coarse.ps=geo", "checkpoint.save=false", "--cfg"])


def test_a_missing_value_and_an_unresolvable_one_are_named():
    with pytest.raises(ConfigError, match=r"^dataset.dir=\$\{nope\} does not resolve: Interpolation key 'nope'"):
        validate_config(compose_config(["dataset.dir=${nope}"]))
    with pytest.raises(ConfigError, match=r"^trainer.resume not set \(\?\?\? in the config\)"):
        validate_config(compose_config(["trainer.resume=???"]))


def test_the_task_sets_the_objective_unless_the_command_line_does():
    """Point 5: a next-item or retrieval run returns one of its own metrics to sweepers by default."""
    assert compose_config([]).objective == "auc"
    assert compose_config(["model=gru4rec"]).objective == "recall@20"
    assert compose_config(["model=two_tower"]).objective == "recall@50"
    assert compose_config(["model=word2vec"]).objective == "wordsim353_spearman"
    assert compose_config(["model=gru4rec", "objective=mrr@20"]).objective == "mrr@20"
    assert compose_config(["model=mmoe"]).objective == "auc"  # multi-task: the mean AUC (no objective of its own)
    for name in ("binary", "multitask", "multitask_esmm", "next_item", "retrieval", "skipgram", "skipgram_sessions"):
        task = OmegaConf.load(CONF / "task" / f"{name}.yaml")
        assert task.get("objective", "auc") in task.metrics, name
