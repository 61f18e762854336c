"""Every YAML under conf/ composes; the count is asserted so no file is silently skipped."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recps.config import PROJECT_ROOT, check_target_args, register_resolvers
from recps.errors import ConfigError
from recps.run import MODEL_ENGINE_KEYS, MODEL_INJECTED  # what the engine injects into / reads from a model config

CONF = PROJECT_ROOT / "conf"
GROUP_FILES = sorted(p for p in CONF.rglob("*.yaml") if p.parent != CONF)
EXPECTED_FILES = 55  # update when a config is added: the count proves the walk saw them all


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
        check_target_args(node, group, injected=("params",))
    if group == "ps" and path.stem != "local":  # a PS mode: one constructor, its table node another
        from recps.cluster import ps_mode

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
