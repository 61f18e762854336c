"""DebugDump: per-example fields and parameters of every step, per worker and thread (Paddle's
dump_fields / dump_param), written so that two runs can be diffed (``python -m recps.debug diff``).

A ``TrainObserver``; with ``debug=off`` (the default) it is not built at all, so nothing
is hooked and nothing is copied. Each training thread writes its own files,
``<run dir>/dump/worker<rank>-thread<t>.{bin,idx}`` (format in ``recps.debug.format``).

Records of one step, always in this order (B batch, K keys, F features, I dense, T labels):

    keys.values (K,) int64, keys.lengths (F*B,)   fields, in the order `fields` names them
    dense (B, I), labels (B, T), logits (B,), predictions (B,), loss ()
    out/<module>            (B, ...)  forward output of each named submodule, in `modules` order
                                      (a KeyedTensor gives its values (B, F*D); a tuple out/<m>.<i>)
    grad/out/<module>       (B, ...)  d loss / d that output (module_grads)
    grad/<param>                      dense parameter gradients before the update, sorted by name
    param/<param>                     dense parameter values after the update, sorted by name
    table/<t>.ids (U,) int64          rows of table t this batch touched (key mod num_embeddings,
    table/<t>.rows (U, D)             as ps=local folds them) and their values after the update

Steps are the trainer's global steps; a step is written when start_step <= step (<= end_step
if > 0) and (step - start_step) % every_steps == 0. Intermediates are captured on every step
while dumping is on (a thread learns its step number only after the update).

With one training thread per process (ps=local, or ps=sync with trainer.threads=1 and any
number of workers: `recps.cluster` gives each worker its own files), the same seed gives
byte-identical files: nothing but the numbers goes into them, in an order fixed by the
config. Several threads per process are not reproducible: the trainer numbers steps in the
order the threads finish them (and, in sync mode, the threads' sparse gradients are
concatenated in arrival order, which changes the order rows are summed in).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from recps.debug.format import DumpWriter
from recps.errors import ConfigError, DataError
from recps.observer import TrainObserver

__all__ = ["DebugDump", "FIELDS", "build_dump", "check_debug_config"]

log = logging.getLogger(__name__)

#: Per-example fields a dump can name.
FIELDS = ("keys", "dense", "labels", "logits", "predictions", "loss")


class _Pending:
    """What one thread captured during the current step, written by on_batch."""

    __slots__ = ("outputs", "output_grads", "grads")

    def __init__(self) -> None:
        self.outputs: dict[str, list[torch.Tensor]] = {}
        self.output_grads: dict[str, list[torch.Tensor | None]] = {}
        self.grads: list[tuple[str, torch.Tensor]] = []


class DebugDump(TrainObserver):
    """Writes the configured records of every selected step (see the module docstring).

    Args:
        out_dir: the run's folder; files go to ``out_dir/dump/``.
        fields: per-example fields, from ``FIELDS``.
        modules: names of submodules (``model.named_modules()``) whose outputs are dumped.
        module_grads: also the gradients of those outputs.
        params: glob patterns over the dense parameter names (``"*"``: all).
        param_grads: with `params`, also their gradients before the update.
        tables: glob patterns over embedding table names (``t_C1``, ``"*"``); ps=local only.
        every_steps, start_step, end_step: which global steps are written.
        task: turns logits into predictions (needed for the ``predictions`` field).
        collection: the embedding collection (its parameters are not dense; tables read it).
        role, rank: this process in the cluster (``worker``/``server``, its index).
        step_base: global step of the next fit's first step (resumed runs); grows per fit.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        fields: Sequence[str] = ("labels", "predictions"),
        modules: Sequence[str] = (),
        module_grads: bool = False,
        params: Sequence[str] = (),
        param_grads: bool = True,
        tables: Sequence[str] = (),
        every_steps: int = 1,
        start_step: int = 1,
        end_step: int = 0,
        task: Any = None,
        collection: nn.Module | None = None,
        role: str = "worker",
        rank: int = 0,
        step_base: int = 0,
    ) -> None:
        unknown = [f for f in fields if f not in FIELDS]
        if unknown:
            raise ConfigError(f"debug.fields={list(fields)}: unknown {unknown}; the fields are {list(FIELDS)} "
                              f"(intermediate tensors: name their submodules in debug.modules)")
        if len(set(fields)) != len(fields) or len(set(modules)) != len(modules):
            raise ConfigError(f"debug.fields={list(fields)}, debug.modules={list(modules)}: a name appears twice")
        if "predictions" in fields and task is None:
            raise ConfigError("debug.fields has 'predictions' but no task was given to turn logits into probs")
        if int(every_steps) < 1 or int(start_step) < 0:
            raise ConfigError(f"debug.every_steps={every_steps}, debug.start_step={start_step}; use every_steps >= 1, start_step >= 0")
        if tables and collection is None:
            raise ConfigError("debug.tables needs the embedding collection; pass collection=")
        self.folder = Path(out_dir) / "dump"
        self.fields = list(fields)
        self.modules = list(modules)
        self.module_grads = bool(module_grads)
        self.params = list(params)
        self.param_grads = bool(param_grads) and bool(self.params)
        self.tables = list(tables)
        self.every_steps, self.start_step, self.end_step = int(every_steps), int(start_step), int(end_step)
        self.task = task
        self.collection = collection
        self.role, self.rank = role, int(rank)
        self.step_base = int(step_base)
        self._writers: list[DumpWriter] = []
        self._batches: list[int] = []
        self._pending: list[_Pending] = []
        self._params: list[list[tuple[str, nn.Parameter]]] = []
        self._table_specs: list[tuple[str, str, int, torch.Tensor, int]] = []  # name, feature, rows, weight, dim
        self._hooks: list[Any] = []
        self._tls = threading.local()
        self._fit_steps = 0
        self._steps_lock = threading.Lock()

    # ---- TrainObserver ----------------------------------------------------------------------------

    def on_fit_start(self, replicas: Sequence[nn.Module]) -> None:
        if self._writers and len(replicas) != len(self._writers):
            raise ConfigError(f"DebugDump: the trainer now runs {len(replicas)} threads, earlier {len(self._writers)}")
        # Resolve every name first: a config error leaves no files behind.
        self._params = [self._select_params(r) for r in replicas]
        self._table_specs = self._select_tables() if self.tables else []
        modules: dict[int, tuple[str, nn.Module]] = {}
        for replica in replicas:
            for name in self.modules:
                module = _submodule(replica, name)
                modules.setdefault(id(module), (name, module))  # one hook on a module the replicas share
        if not self._writers:
            self._writers = [DumpWriter(self.folder, self.role, self.rank, t) for t in range(len(replicas))]
            self._batches = [0] * len(replicas)
            log.info("[%s %d] debug dump on: %s", self.role, self.rank, self.folder)
        self._pending = [_Pending() for _ in replicas]
        self._fit_steps = 0
        self._hooks = [module.register_forward_hook(self._hook(name)) for name, module in modules.values()]

    def on_thread_start(self, thread: int) -> None:
        self._tls.thread = thread

    def after_backward(self, thread: int) -> None:
        if self.param_grads:
            self._pending[thread].grads = [
                (name, p.grad.detach().clone()) for name, p in self._params[thread] if p.grad is not None
            ]

    def on_batch(self, thread: int, step: int, epoch: int, batch: Any, logits: torch.Tensor, loss: float) -> None:
        self._batches[thread] += 1
        with self._steps_lock:
            self._fit_steps = max(self._fit_steps, step)
        pending, self._pending[thread] = self._pending[thread], _Pending()
        gstep = self.step_base + step
        if not self._selected(gstep):
            return
        out, n = self._writers[thread], self._batches[thread]
        with torch.no_grad():
            for f in self.fields:
                if f == "keys":
                    out.write(gstep, n, "keys.values", batch.sparse.values())
                    out.write(gstep, n, "keys.lengths", batch.sparse.lengths())
                elif f == "dense":
                    out.write(gstep, n, "dense", batch.dense)
                elif f == "labels":
                    out.write(gstep, n, "labels", batch.labels)
                elif f == "logits":
                    out.write(gstep, n, "logits", logits)
                elif f == "predictions":
                    out.write(gstep, n, "predictions", self.task.predict(logits.detach()))
                elif f == "loss":
                    out.write(gstep, n, "loss", torch.tensor(float(loss), dtype=torch.float64))
            for name in self.modules:
                for i, t in enumerate(pending.outputs.get(name, [])):
                    out.write(gstep, n, _part(f"out/{name}", i, len(pending.outputs[name])), t)
            if self.module_grads:
                for name in self.modules:
                    grads = pending.output_grads.get(name, [])
                    for i, g in enumerate(grads):
                        if g is not None:
                            out.write(gstep, n, _part(f"grad/out/{name}", i, len(grads)), g)
            for name, g in pending.grads:
                out.write(gstep, n, f"grad/{name}", g)
            for name, p in self._params[thread]:
                out.write(gstep, n, f"param/{name}", p)
            if self._table_specs:
                self._write_tables(out, gstep, n, batch)

    def on_fit_end(self, failed: bool) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._tls = threading.local()
        self.step_base += self._fit_steps
        for w in self._writers:
            w.flush()

    def close(self) -> None:
        """Closes every thread's files (idempotent)."""
        for w in self._writers:
            w.close()

    # ---- helpers ---------------------------------------------------------------------------------

    def _selected(self, step: int) -> bool:
        if step < self.start_step or (self.end_step > 0 and step > self.end_step):
            return False
        return (step - self.start_step) % self.every_steps == 0

    def _select_params(self, replica: nn.Module) -> list[tuple[str, nn.Parameter]]:
        if not self.params:
            return []
        owned = {id(p) for p in self.collection.parameters()} if self.collection is not None else set()
        dense = [(n, p) for n, p in replica.named_parameters() if id(p) not in owned]
        chosen = sorted(((n, p) for n, p in dense if any(fnmatch.fnmatchcase(n, pat) for pat in self.params)),
                        key=lambda item: item[0])
        missing = [pat for pat in self.params if not any(fnmatch.fnmatchcase(n, pat) for n, _ in dense)]
        if missing:
            raise ConfigError(f"debug.params: {missing} match no dense parameter; they are {[n for n, _ in dense]}")
        return chosen

    def _select_tables(self) -> list[tuple[str, str, int, torch.Tensor, int]]:
        c = self.collection
        configs = c.embedding_bag_configs() if hasattr(c, "embedding_bag_configs") else []
        names = [cfg.name for cfg in configs]
        missing = [pat for pat in self.tables if not any(fnmatch.fnmatchcase(n, pat) for n in names)]
        if missing:
            raise ConfigError(f"debug.tables: {missing} match no table of {type(c).__name__}; tables are {names}")
        weights = {k.rsplit(".", 2)[-2]: v for k, v in c.state_dict(keep_vars=True).items() if k.endswith(".weight")}
        specs = []
        for cfg in sorted(configs, key=lambda cfg: cfg.name):
            if not any(fnmatch.fnmatchcase(cfg.name, pat) for pat in self.tables):
                continue
            if cfg.name not in weights or len(cfg.feature_names) != 1:
                raise ConfigError(
                    f"debug.tables: table {cfg.name!r} of {type(c).__name__} has no local weight of one feature; "
                    f"table rows are dumped for ps=local (on a PS, the rows live on the servers)"
                )
            specs.append((cfg.name, cfg.feature_names[0], int(cfg.num_embeddings), weights[cfg.name], int(cfg.embedding_dim)))
        return specs

    def _write_tables(self, out: DumpWriter, step: int, n: int, batch: Any) -> None:
        features = batch.sparse.to_dict()
        for name, feature, rows, weight, dim in self._table_specs:
            if feature not in features:
                raise DataError(f"debug.tables: table {name} reads feature {feature!r}, which the batch lacks")
            ids = torch.unique(torch.remainder(features[feature].values(), rows))  # (U,) sorted
            out.write(step, n, f"table/{name}.ids", ids)
            out.write(step, n, f"table/{name}.rows", weight.detach()[ids, :dim])  # (U, D)

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            thread = getattr(self._tls, "thread", None)
            if thread is None:  # not a training thread of this fit (evaluation)
                return
            pending = self._pending[thread]
            tensors = _tensors(output, name)
            pending.outputs[name] = [t.detach().clone() for t in tensors]
            if self.module_grads:
                grads: list[torch.Tensor | None] = [None] * len(tensors)
                pending.output_grads[name] = grads
                for i, t in enumerate(tensors):
                    if t.requires_grad:
                        t.register_hook(_grad_catcher(grads, i))

        return hook


def _grad_catcher(slots: list, i: int):
    def catch(grad: torch.Tensor) -> None:
        slots[i] = grad.detach().clone()

    return catch


def _part(name: str, i: int, n: int) -> str:
    return name if n == 1 else f"{name}.{i}"


def _tensors(output: Any, name: str) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if hasattr(output, "values") and callable(output.values) and isinstance(output.values(), torch.Tensor):
        return [output.values()]  # KeyedTensor / JaggedTensor
    if isinstance(output, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in output):
        return list(output)
    raise DataError(f"debug.modules: {name!r} returned a {type(output).__name__}; dump modules that return tensors")


def _submodule(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n and "." not in n]
        raise ConfigError(f"debug.modules: {type(model).__name__} has no submodule {name!r}; its top-level "
                          f"modules are {names} (nested ones as a.b.c)") from None


_INJECTED = ("out_dir", "task", "collection", "role", "rank", "step_base")


def check_debug_config(cfg: Mapping[str, Any] | None) -> None:
    """Binds conf/debug to DebugDump's signature before anything runs (unknown keys, bad fields)."""
    if cfg is None or not bool(cfg.get("enabled", False)):
        return
    if cfg.get("_target_") is not None:
        from recps.config import check_target_args

        check_target_args(cfg, "debug", injected=_INJECTED, engine_keys=("enabled",))
    fields = [str(f) for f in (cfg.get("fields") or [])]
    unknown = [f for f in fields if f not in FIELDS]
    if unknown:
        raise ConfigError(f"debug.fields={fields}: unknown {unknown}; the fields are {list(FIELDS)} "
                          f"(intermediate tensors: name their submodules in debug.modules)")


def build_dump(cfg: Mapping[str, Any] | None, out_dir: str | os.PathLike, *, task: Any = None,
               collection: nn.Module | None = None, role: str = "worker", rank: int = 0,
               step_base: int = 0) -> DebugDump | None:
    """The dump `cfg` (conf/debug/*.yaml) asks for, or None when it is off (the default)."""
    if cfg is None or not bool(cfg.get("enabled", False)):
        return None
    check_debug_config(cfg)
    kwargs = {str(k): v for k, v in dict(cfg).items() if not str(k).startswith("_") and k != "enabled"}
    for key in ("fields", "modules", "params", "tables"):
        if key in kwargs:
            value = kwargs[key]
            if isinstance(value, str):
                raise ConfigError(f"debug.{key}={value!r} is a string; write a list, e.g. [{value}]")
            kwargs[key] = [str(v) for v in (value or [])]
    return DebugDump(out_dir, task=task, collection=collection, role=role, rank=rank, step_base=step_base, **kwargs)
