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

Size. A dump grows by the same bytes every dumped step (the selected dense parameters twice,
values and gradients, dominate: the default DeepFM writes 3.7 MB a step, 1.4 GB a pass). When
the fit's first step is done, the dump logs what it will write (`DumpEstimate`): the bytes of
that step's records times the steps of the fit's plan it selects (`Trainer.fit` hands the plan
to `on_fit_plan`), with the free space there; a WARNING when that is over 1 GB or half the free
space. `debug.every_steps`, `debug.params`, `debug.fields`, `debug.end_step` write less.

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
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from recps.debug.format import DumpWriter, Record
from recps.errors import ConfigError, DataError
from recps.job.observer import TrainObserver
from recps.targets import check_target_args

__all__ = ["DebugDump", "DumpEstimate", "FIELDS", "build_dump", "check_debug_config"]

log = logging.getLogger(__name__)

#: Per-example fields a dump can name.
FIELDS = ("keys", "dense", "labels", "logits", "predictions", "loss")


#: Above this many bytes (or half the free space) the estimate is logged as a WARNING.
WARN_BYTES = 10**9

#: What the log line offers to write less (conf/debug/dump.yaml).
LIMITS = ("debug.every_steps=N (every Nth step), debug.params=[glob,...] (fewer dense parameters; [] none), "
          "debug.param_grads=false, debug.fields=[...], debug.start_step / debug.end_step")


@dataclass(frozen=True)
class DumpEstimate:
    """What one fit of a dump writes in this process (all its threads' files together).

    step_bytes: .bin bytes of one dumped step, summed from the fit's first step's records (their
    numel x element size); param_bytes / grad_bytes: of which dense parameter values / gradients;
    index_bytes: .idx bytes of one dumped step; steps: dumped steps of the plan (None: the trainer
    could not say how many steps the fit takes); planned: the fit's steps; total_bytes: steps x
    (step_bytes + index_bytes) (None without a plan); free_bytes: free space in the dump folder.
    Exact for batches of one size and fixed shapes; a smaller last batch, multi-hot keys or
    table rows vary per step."""

    step_bytes: int
    param_bytes: int
    grad_bytes: int
    index_bytes: int
    steps: int | None
    planned: int | None
    total_bytes: int | None
    free_bytes: int

    def describe(self, folder: Path) -> str:
        rest = self.step_bytes - self.param_bytes - self.grad_bytes
        per_step = (f"{_size(self.step_bytes)} a step (dense parameters {_size(self.param_bytes)}, their gradients "
                    f"{_size(self.grad_bytes)}, other records {_size(rest)})")
        if self.total_bytes is None:
            where = f"{per_step} (this process's files) into {folder}; the number of steps is unknown"
        else:
            where = (f"{_size(self.total_bytes)} (this process's files) into {folder}: {self.steps} of the "
                     f"{self.planned} planned steps x {per_step}")
        return f"{where}; {_size(self.free_bytes)} free there. To write less: {LIMITS}"

    @property
    def warn(self) -> bool:
        total = self.total_bytes if self.total_bytes is not None else self.step_bytes
        return total > WARN_BYTES or total > self.free_bytes // 2


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


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
        self._planned: int | None = None  # steps of the coming fit (on_fit_plan)
        self._estimated = False
        #: The last fit's `DumpEstimate` (None before its first step).
        self.estimate: DumpEstimate | None = None

    # ---- TrainObserver ----------------------------------------------------------------------------

    def on_fit_plan(self, steps: int | None) -> None:
        """Before on_fit_start (recps.job.loop.Trainer.fit): the steps the fit takes over all its threads
        (None: unknown); its first step's records times the ones selected give the size estimate."""
        self._planned = None if steps is None else int(steps)

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
        self._estimated = False
        self.estimate = None
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
            first, self._estimated = not self._estimated, True
        pending, self._pending[thread] = self._pending[thread], _Pending()
        gstep = self.step_base + step
        selected = self._selected(gstep)
        if not (selected or first):
            return
        n = self._batches[thread]
        with torch.no_grad():
            records = self._records(thread, pending, batch, logits, loss)
        if first:
            self._log_estimate(gstep, records)
        if selected:
            out = self._writers[thread]
            for name, t in records:
                out.write(gstep, n, name, t)

    def _records(self, thread: int, pending: _Pending, batch: Any, logits: torch.Tensor,
                 loss: float) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of every record of one step, in the order they are written."""
        records: list[tuple[str, torch.Tensor]] = []
        for f in self.fields:
            if f == "keys":
                records += [("keys.values", batch.sparse.values()), ("keys.lengths", batch.sparse.lengths())]
            elif f == "dense":
                records.append(("dense", batch.dense))
            elif f == "labels":
                records.append(("labels", batch.labels))
            elif f == "logits":
                records.append(("logits", logits.detach()))
            elif f == "predictions":
                records.append(("predictions", self.task.predict(logits.detach())))
            elif f == "loss":
                records.append(("loss", torch.tensor(float(loss), dtype=torch.float64)))
        for name in self.modules:
            outputs = pending.outputs.get(name, [])
            records += [(_part(f"out/{name}", i, len(outputs)), t) for i, t in enumerate(outputs)]
        if self.module_grads:
            for name in self.modules:
                grads = pending.output_grads.get(name, [])
                records += [(_part(f"grad/out/{name}", i, len(grads)), g) for i, g in enumerate(grads) if g is not None]
        records += [(f"grad/{name}", g) for name, g in pending.grads]
        records += [(f"param/{name}", p.detach()) for name, p in self._params[thread]]
        if self._table_specs:
            records += self._table_records(batch)
        return records

    def _log_estimate(self, step: int, records: list[tuple[str, torch.Tensor]]) -> None:
        """Sizes the fit's dump from its first step's records and the plan (see DumpEstimate)."""
        sizes = [(name, t.numel() * t.element_size()) for name, t in records]
        step_bytes = sum(n for _, n in sizes)
        planned = self._planned
        steps = self.selected_steps(self.step_base + 1, self.step_base + planned) if planned is not None else None
        bin_total = step_bytes * (steps or 0)
        # index lines as format.DumpWriter writes them, with the widest step, batch and offset numbers
        last = max(step, self.step_base + (planned or 0))
        index_bytes = sum(len(Record(last, last, name, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                                     bin_total, size).line().encode()) for (name, t), (_, size) in zip(records, sizes))
        self.estimate = estimate = DumpEstimate(
            step_bytes=step_bytes,
            param_bytes=sum(n for name, n in sizes if name.startswith("param/")),
            grad_bytes=sum(n for name, n in sizes if name.startswith("grad/") and not name.startswith("grad/out/")),
            index_bytes=index_bytes, steps=steps, planned=planned,
            total_bytes=None if steps is None else steps * (step_bytes + index_bytes),
            free_bytes=shutil.disk_usage(self.folder).free,
        )
        log.log(logging.WARNING if estimate.warn else logging.INFO, "[%s %d] debug dump: %s", self.role, self.rank,
                estimate.describe(self.folder))

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

    def selected_steps(self, first: int, last: int) -> int:
        """How many of the global steps first..last (inclusive) are written."""
        lo, hi = max(first, self.start_step), last if self.end_step <= 0 else min(last, self.end_step)
        if hi < lo:
            return 0
        k_lo = -(-(lo - self.start_step) // self.every_steps)  # first k with start + k * every >= lo
        return max(0, (hi - self.start_step) // self.every_steps - k_lo + 1)

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

    def _table_records(self, batch: Any) -> list[tuple[str, torch.Tensor]]:
        features = batch.sparse.to_dict()
        records = []
        for name, feature, rows, weight, dim in self._table_specs:
            if feature not in features:
                raise DataError(f"debug.tables: table {name} reads feature {feature!r}, which the batch lacks")
            ids = torch.unique(torch.remainder(features[feature].values(), rows))  # (U,) sorted
            records += [(f"table/{name}.ids", ids), (f"table/{name}.rows", weight.detach()[ids, :dim])]  # (U,), (U, D)
        return records

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
