"""Binding a config node's `_target_` to its constructor's signature before anything is built.

A base module (it imports only recps.errors): the config validation (recps.config), the pipeline's
stage checks and the observers' own config checks (recps.metrics.reporter, recps.debug.dump) all
call `check_target_args`, none of them through another.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Iterable, Mapping

from hydra.utils import get_object

from recps.errors import ConfigError

__all__ = ["check_target_args"]


def check_target_args(node: Mapping[str, Any], where: str, injected: Iterable[str] = (),
                      engine_keys: Iterable[str] = ()) -> None:
    """Binds a `_target_` node's keys to its constructor's signature (torchtune-style).

    `node`: a composed config's node (omegaconf's are Mappings) or a plain dict; only read.

    `injected` are arguments the engine passes itself; `engine_keys` are keys the engine
    reads and removes before instantiating. Unknown keys raise a ConfigError naming them.
    """
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
