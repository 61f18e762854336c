"""Config helpers: OmegaConf resolvers, the PS modes' defaults, validation before anything runs.

The knobs of a PS mode and their defaults live in one place, the mode's constructor
(recps.ps.modes: SyncMode, AsyncMode, GeoMode, and TableConfig for `ps.table`).
`register_resolvers()` stores each as a Hydra config `recps_defaults/ps/<mode>` generated
from its dataclass fields; conf/ps/<mode>.yaml composes it into the `ps` node, so every knob
is listed by `--cfg job` and overridable as `ps.<knob>=...` without a second copy of its default.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from pathlib import Path
from typing import Any, Iterable, Sequence

from omegaconf import DictConfig, OmegaConf

from recps.errors import ConfigError

__all__ = ["PROJECT_ROOT", "register_resolvers", "check_target_args", "compose_config"]

PROJECT_ROOT = Path(__file__).resolve().parents[1]


MODE_DEFAULTS_GROUP = "recps_defaults/ps"


def register_resolvers() -> None:
    """`${recps.root:}` → the checkout's root (configs find generated data and ../shared there),
    and the PS modes' defaults (`recps_defaults/ps/<mode>`, see the module docstring). Call it
    before composing conf/ (recps.train and compose_config do)."""
    if not OmegaConf.has_resolver("recps.root"):
        OmegaConf.register_new_resolver("recps.root", lambda: str(PROJECT_ROOT))
    from hydra.core.config_store import ConfigStore

    from recps.ps.modes import MODES

    store = ConfigStore.instance()
    for name, mode in MODES.items():
        store.store(group=MODE_DEFAULTS_GROUP, name=name, node=constructor_defaults(mode))


def constructor_defaults(cls) -> dict:
    """A dataclass's fields and defaults as a config node; a field whose default is a dataclass
    becomes a nested node with its own `_target_`.

    >>> from recps.ps.node.specs import TableConfig
    >>> constructor_defaults(TableConfig)["capacity"]
    0
    """
    node = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            continue
        if dataclasses.is_dataclass(value):
            value = {"_target_": f"{type(value).__module__}.{type(value).__qualname__}",
                     **constructor_defaults(type(value))}
        node[f.name] = value
    return node


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The config `python -m recps.train <overrides>` would run, for notebooks, tests and benchmarks.

    >>> compose_config(["model=ctr_dnn", "ps=local"]).model._target_
    'models.CTRDNN'
    """
    from hydra import compose, initialize_config_dir

    register_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def check_target_args(node: DictConfig, where: str, injected: Iterable[str] = (),
                      engine_keys: Iterable[str] = ()) -> None:
    """Binds a `_target_` node's keys to its constructor's signature (torchtune-style).

    `injected` are arguments the engine passes itself; `engine_keys` are keys the engine
    reads and removes before instantiating. Unknown keys raise a ConfigError naming them.
    """
    from hydra.utils import get_object

    target = node.get("_target_")
    if target is None:
        raise ConfigError(f"{where} has no _target_; name the class to build, e.g. models.DeepFM")
    try:
        obj = get_object(target)
    except Exception as exc:  # hydra raises ImportError/AttributeError variants
        raise ConfigError(f"{where}._target_={target!r} cannot be imported ({exc}); fix the name") from exc
    keys = [k for k in node.keys() if not str(k).startswith("_") and k not in set(engine_keys)]
    signature = inspect.signature(obj)
    try:
        kwargs: dict[str, Any] = {k: None for k in keys}
        kwargs.update({k: None for k in injected if k in signature.parameters})
        signature.bind_partial(**kwargs)  # required arguments may be injected at build time
    except TypeError as exc:
        params = [p for p in signature.parameters if p != "self"]
        unknown = [k for k in keys if k not in signature.parameters]
        hint = ""
        if unknown and (close := difflib.get_close_matches(str(unknown[0]), params, n=1)):
            hint = f"; did you mean {where}.{close[0]}?"
        raise ConfigError(
            f"{where} ({target}): {exc}{hint}; its arguments are {params}"
        ) from exc
