"""Config helpers: OmegaConf resolvers and validation before anything runs."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Iterable, Sequence

from omegaconf import DictConfig, OmegaConf

from recps.errors import ConfigError

__all__ = ["PROJECT_ROOT", "register_resolvers", "check_target_args", "compose_config"]

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def register_resolvers() -> None:
    """`${recps.root:}` → the checkout's root (configs find generated data and ../shared there)."""
    if not OmegaConf.has_resolver("recps.root"):
        OmegaConf.register_new_resolver("recps.root", lambda: str(PROJECT_ROOT))


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
        raise ConfigError(
            f"{where} ({target}): {exc}; its arguments are {params}"
        ) from exc
