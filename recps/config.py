"""Config helpers: OmegaConf resolvers, the PS modes' defaults, validation before anything runs.

`validate_config(cfg)` checks the whole composed config (`recps.train` calls it in the launching
process before any data is read or process is started); `composition_error_message` turns Hydra's
"Could not override" into one line naming the closest key.

The knobs of a PS mode and their defaults live in one place, the mode's constructor
(recps.ps.modes: SyncMode, AsyncMode, GeoMode, and TableConfig for `ps.table`).
`register_resolvers()` stores each as a Hydra config `recps_defaults/ps/<mode>` generated
from its dataclass fields; conf/ps/<mode>.yaml composes it into the `ps` node, so every knob
is listed by `--cfg job` and overridable as `ps.<knob>=...` without a second copy of its default.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import re
from pathlib import Path
from typing import Iterable, Sequence

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recps.data.schema import Schema  # no torch, no reader
from recps.errors import ConfigError
from recps.targets import check_target_args  # re-exported: config validation binds every _target_ with it

__all__ = ["PROJECT_ROOT", "PRECISIONS", "check_group_overrides", "check_precision", "register_resolvers", "check_target_args", "compose_config", "validate_config",
           "composition_error_message", "did_you_mean", "PLAIN_KEYS", "MODEL_ENGINE_KEYS", "MODEL_INJECTED",
           "TASK_ENGINE_KEYS", "PS_MODES", "ps_mode", "check_cluster_config",
           "cluster_checkpoint_every", "check_optimizer_values", "dataset_feature_names", "override_source"]

PROJECT_ROOT = Path(__file__).resolve().parents[1]


MODE_DEFAULTS_GROUP = "recps_defaults/ps"
PS_MODES = ("sync", "async", "geo")  # ps= values that run on parameter servers (recps.cluster)


def register_resolvers() -> None:
    """`${recps.root:}` → the checkout's root (configs find generated data and ../shared there),
    and the PS modes' defaults (`recps_defaults/ps/<mode>`, see the module docstring). Call it
    before composing conf/ (recps.train and compose_config do)."""
    if not OmegaConf.has_resolver("recps.root"):
        OmegaConf.register_new_resolver("recps.root", lambda: str(PROJECT_ROOT))
    from recps.ps.modes import MODES  # deferred: torch; `import recps.config` stays light for the launcher and --cfg

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
    register_resolvers()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


# ------------------------------------------------------------------------------------ validation

# Keys of conf/model/*.yaml that the engine reads itself (it builds the tables from them;
# a session dataset reads `batching` to form the batches the model trains on).
MODEL_ENGINE_KEYS = ("embedding_dim", "batching", "embedding_lr")
# The collection a model takes: pooled (ranking, retrieval) or per key (sequence models).
MODEL_INJECTED = ("embedding_bag_collection", "embedding_collection", "dense_in_features")
# Keys of conf/task/*.yaml that the engine reads itself: `objective`, the metric `main` hands to
# sweepers unless the command line sets `objective=` (conf/config.yaml).
TASK_ENGINE_KEYS = ("objective",)

# The nodes without a `_target_` and the keys the engine reads from each ("": the root). A key that
# is not here is read by nothing: it is refused, unless another value interpolates it (a user's
# `data_root: /x` used as `${data_root}`). Nodes with a `_target_` are bound to their constructor
# instead (check_target_args); `stream`, `metrics` and `debug` are checked by their own code.
PLAIN_KEYS: dict[str, tuple[str, ...]] = {
    "": ("dataset", "ps", "cluster", "trainer", "optimizer", "task", "metrics", "model", "debug", "stream", "pipeline",
         "seed", "device", "progress", "checkpoint", "objective"),
    "trainer": ("epochs", "max_steps", "batch_size", "threads", "eval_batch_size", "resume", "observers", "precision"),
    "cluster": ("name", "servers", "workers", "host", "timeout_s", "connect_timeout_s", "dead_after_s",
                "server_threads", "server_torch_threads", "encryption", "restarts", "checkpoint_every"),
    "checkpoint": ("save", "dir", "keep_last"),
}
# ps=local (conf/ps/local.yaml) has no constructor either.
LOCAL_PS_KEYS: dict[str, tuple[str, ...]] = {
    "ps": ("name", "num_embeddings", "table"),
    "ps.table": ("optimizer", "init_std"),
    "ps.table.optimizer": ("name", "lr", "eps"),
}


def did_you_mean(key: str, options: Iterable[str], where: str = "") -> str:
    """`"; did you mean trainer.threads?"` for the option closest to `key`, else ``""``.

    >>> did_you_mean("thread", ["epochs", "threads"], "trainer")
    '; did you mean trainer.threads?'
    """
    close = difflib.get_close_matches(str(key), [str(o) for o in options], n=1, cutoff=0.6)
    return f"; did you mean {where + '.' if where else ''}{close[0]}?" if close else ""


def _added_by(path: str, overrides: Sequence[str]) -> str:
    """Where a key came from: the `+key=...` override that added it, else a config file."""
    for o in overrides:
        name = o.lstrip("+~").split("=", 1)[0]
        if name == path:
            return f"the override {o}"
    return "a config file (conf/ or your --config-dir)"


def _check_groups_are_groups(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """A group of settings that an override replaced by one value (`checkpoint=false`) fails here, naming
    the override and the group's keys, before a check reads the group's keys from it. (A config group of
    conf/, `model=false`, is an option Hydra does not find: `composition_error_message`.)"""
    for path, known in {**PLAIN_KEYS, **LOCAL_PS_KEYS}.items():
        parent, _, key = path.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if not path or not isinstance(node, DictConfig) or key not in node or isinstance(node[key], DictConfig):
            continue
        if path in LOCAL_PS_KEYS and cfg.ps.get("_target_") is not None:
            continue  # a PS mode's own ps.table is checked by its constructor
        raise ConfigError(f"{path}={_show(node, key)} (from {_added_by(path, overrides)}): {path} is a group of "
                          f"settings, not one value; set its keys instead, e.g. {path}.{known[0]}=... ({path}'s "
                          f"keys: {', '.join(known)})")


def _check_plain_keys(cfg: DictConfig, overrides: Sequence[str]) -> None:
    _check_groups_are_groups(cfg, overrides)
    schema = dict(PLAIN_KEYS)
    if cfg.ps.get("_target_") is None:
        schema.update(LOCAL_PS_KEYS)
    for path, known in schema.items():
        node = OmegaConf.select(cfg, path) if path else cfg
        if not isinstance(node, DictConfig):
            continue
        for key in node.keys():
            key = str(key)
            full = f"{path}.{key}" if path else key
            if key in known or _interpolated(cfg, full):
                continue
            where = f"{path}'s" if path else "the top level's"
            raise ConfigError(
                f"{full}={_show(node, key)} (from {_added_by(full, overrides)}) is read by nothing and would be "
                f"ignored{did_you_mean(key, known, path)} ({where} keys: {', '.join(known)})")


def _interpolated(cfg: DictConfig, full: str) -> bool:
    """Whether another value of `cfg` reads `full` through an interpolation (`${data_root}`): without
    it, some other value changes or no longer resolves."""
    def drop(container: dict) -> dict:
        parent, _, key = full.rpartition(".")
        node = container
        for part in parent.split(".") if parent else ():
            node = node[part]
        del node[key]
        return container

    before = drop(OmegaConf.to_container(cfg, resolve=True))
    try:
        after = OmegaConf.to_container(OmegaConf.create(drop(OmegaConf.to_container(cfg, resolve=False))), resolve=True)
    except Exception:  # noqa: BLE001 (omegaconf's interpolation errors; a resolver's own)
        return True
    return after != before


def _show(node: DictConfig, key: str) -> str:
    value = OmegaConf.to_container(node, resolve=False)[key]  # as the user wrote it
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def _int_at_least(cfg: DictConfig, path: str, low: int, fix: str, allowed: tuple[int, ...] = ()) -> None:
    value = OmegaConf.select(cfg, path)
    if value in allowed and not isinstance(value, bool):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{path}={value!r}: {fix}")


PRECISIONS = ("fp32", "bf16", "fp16")


def check_precision(precision, device: str = "cpu", where: str = "trainer.precision") -> str:
    """`precision` if it is one of PRECISIONS and `device` can run it, else a ConfigError naming
    `where` and the fix. fp16 needs CUDA (half-precision units and a loss scale); bf16 runs on
    every CPU (fast where it has bf16 units: AVX-512-BF16, AMX; converted otherwise).

    >>> check_precision("bf16")
    'bf16'
    >>> check_precision("fp8")
    Traceback (most recent call last):
    ...
    recps.errors.ConfigError: trainer.precision='fp8' is not one of fp32, bf16, fp16; set trainer.precision=fp32 (the default) or bf16 (fp16 on CUDA only)
    """
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ConfigError(f"{where}={precision!r} is not one of {', '.join(PRECISIONS)}; set {where}=fp32 "
                          "(the default) or bf16 (fp16 on CUDA only)")
    if precision == "fp16" and not str(device).startswith("cuda"):
        raise ConfigError(f"{where}=fp16 with device={device!r}: fp16 training needs CUDA (its half-precision "
                          f"units and a loss scale); on CPU set {where}=bf16 (or fp32)")
    return precision


def _check_values(cfg: DictConfig) -> None:
    """The plain nodes' values (the constructors check their own)."""
    _int_at_least(cfg, "trainer.epochs", 0, "give the number of passes over the training data, 0 or more")
    _int_at_least(cfg, "trainer.max_steps", 1, "give -1 (no limit: trainer.epochs passes) or a number of steps "
                  ">= 1 (summed over threads)", allowed=(-1,))
    _int_at_least(cfg, "trainer.batch_size", 1, "give the examples per batch (per thread), 1 or more")
    _int_at_least(cfg, "trainer.threads", 1, "give the training threads per process, 1 or more")
    _int_at_least(cfg, "trainer.eval_batch_size", 1, "give the examples per evaluation batch, 1 or more")
    _int_at_least(cfg, "seed", 0, "give an integer >= 0")
    resume = cfg.trainer.get("resume")
    if resume is not None and not isinstance(resume, str):
        raise ConfigError(f"trainer.resume={resume!r}: give a checkpoint folder (a path or URL) or null")
    device = str(cfg.device)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ConfigError(f"device={device!r}: use cpu or cuda (cuda:N for one GPU)")
    if device != "cpu":
        from recps.device import check_device  # deferred: torch only for a GPU run; a CPU launcher need not import it

        check_device(device)  # CUDA build, a GPU torch sees, fbgemm-gpu's CUDA build; else the fix
    if cfg.checkpoint.get("keep_last") is not None:
        _int_at_least(cfg, "checkpoint.keep_last", 1, "keep at least the newest committed checkpoint (what a restart "
                      "resumes from): give 1 or more, or null to keep all")
    for path in ("progress", "checkpoint.save"):
        if not isinstance(OmegaConf.select(cfg, path), bool):
            raise ConfigError(f"{path}={OmegaConf.select(cfg, path)!r}: use true or false")
    if not isinstance(cfg.get("objective"), str) or not cfg.objective:
        raise ConfigError(f"objective={cfg.get('objective')!r}: name the metric sweepers maximise, e.g. "
                          "objective=auc (the task's metrics are in task.metrics)")
    if cfg.ps.get("_target_") is None and cfg.ps.name == "local":
        _int_at_least(cfg, "ps.num_embeddings", 1, "give the rows per table, 1 or more")
    check_precision(cfg.trainer.get("precision", "fp32"), device)


def ps_mode(cfg: DictConfig):
    """The mode object conf/ps/<mode>.yaml builds (its `_target_`, recps.ps.modes): SyncMode,
    AsyncMode or GeoMode with their knobs and `table:` settings. Raises ConfigError naming a bad key."""
    check_target_args(cfg.ps, "ps", engine_keys=("name",))
    if cfg.ps.get("table") is not None:
        check_target_args(cfg.ps.table, "ps.table")
    node = OmegaConf.to_container(cfg.ps, resolve=True)
    node.pop("name", None)
    try:
        return instantiate(node, _convert_="all")
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(f"ps={cfg.ps.name}: {e}") from e


def cluster_checkpoint_every(cfg: DictConfig) -> tuple[int | None, float | None]:
    """cluster.checkpoint_every as (steps, seconds), one of them set, or (None, None) when it is null:
    an integer is steps, "<number>s" seconds ("90s"), "<number>m" minutes. It stands for
    ps.checkpoint_every_steps / ps.checkpoint_every_seconds (recps.cluster sets those from it); a
    different value there too is refused.

    >>> from omegaconf import OmegaConf
    >>> cluster_checkpoint_every(OmegaConf.create({"cluster": {"checkpoint_every": "2m"}, "ps": {}}))
    (None, 120.0)
    """
    value = cfg.cluster.get("checkpoint_every")
    if value is None:
        return None, None
    steps = seconds = None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        steps = value
    elif isinstance(value, str) and re.fullmatch(r"\d+(\.\d*)?[sm]", value.strip()) and float(value.strip()[:-1]) > 0:
        seconds = float(value.strip()[:-1]) * (60.0 if value.strip().endswith("m") else 1.0)
    else:
        raise ConfigError(f"cluster.checkpoint_every={value!r}; give steps (an integer >= 1, e.g. 500), seconds or "
                          "minutes (\"90s\", \"10m\"), or null (none during training)")
    for key, mine in (("checkpoint_every_steps", steps), ("checkpoint_every_seconds", seconds)):
        theirs = cfg.ps.get(key)
        if theirs is not None and (mine is None or float(theirs) != float(mine)):
            raise ConfigError(f"cluster.checkpoint_every={value!r} and ps.{key}={theirs!r} both set when checkpoints "
                              "are taken; set one of them")
    return steps, seconds


def check_cluster_config(cfg: DictConfig) -> None:
    """What a parameter-server run needs of `ps`, `device`, `cluster` and `metrics` (recps.config.validate_config
    calls it before anything starts)."""
    if cfg.ps.name not in PS_MODES:
        raise ConfigError(f"ps={cfg.ps.name!r} is not a parameter-server mode {PS_MODES}")
    # device=cuda: the workers compute on their GPU, the servers stay CPU processes (_check_values checks it)
    if cfg.cluster.name != "local":
        raise ConfigError(f"cluster={cfg.cluster.name!r} is unknown; use cluster=local (started processes with "
                          "role variables act as their role under it)")
    for key in ("servers", "workers"):
        value = cfg.cluster[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"cluster.{key}={value!r}; it must be an integer >= 1")
    seconds, cores = "a number of seconds > 0", "null (chosen from the cores here) or "
    for key, what, ok in (("timeout_s", f"null (no limit) or {seconds}", lambda v: v is None or v > 0),
                          ("connect_timeout_s", seconds, lambda v: v is not None and v > 0),
                          ("dead_after_s", seconds, lambda v: v is not None and v > 0),
                          ("server_threads", cores + "an integer >= 0",
                           lambda v: v is None or (isinstance(v, int) and v >= 0)),
                          ("server_torch_threads", cores + "an integer >= 1",
                           lambda v: v is None or (isinstance(v, int) and v >= 1))):
        value = cfg.cluster.get(key)
        if isinstance(value, bool) or not (value is None or isinstance(value, (int, float))) or not ok(value):
            raise ConfigError(f"cluster.{key}={value!r}; give {what}")
    threads, max_steps = int(cfg.trainer.threads), int(cfg.trainer.max_steps)
    if cfg.ps.name == "sync" and max_steps > 0 and max_steps % threads:
        lower = max_steps - max_steps % threads
        raise ConfigError(f"trainer.max_steps={max_steps} with ps=sync and trainer.threads={threads}: every thread takes "
                          f"the same steps (each step waits for all), so give a multiple of {threads}, e.g. "
                          f"trainer.max_steps={lower or threads} or {lower + threads}")
    restarts = cfg.cluster.get("restarts", 0)
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ConfigError(f"cluster.restarts={restarts!r}; give how many times a failed cluster is restarted from its "
                          "last committed checkpoint, an integer >= 0 (0: a failure ends the run)")
    cluster_checkpoint_every(cfg)
    encryption = cfg.cluster.get("encryption")
    if encryption is not None and str(encryption) not in ("curve", "off"):
        raise ConfigError(f"cluster.encryption={encryption!r}; use curve (authenticated, encrypted), off (a trusted "
                          "network) or null ($RECPS_TRANSPORT_ENCRYPTION, else curve)")
    metrics = cfg.get("metrics")
    if metrics is not None and bool(metrics.get("enabled", True)) and str(metrics.get("merge", "auto")) == "gloo":
        raise ConfigError(f"metrics.merge=gloo with ps={cfg.ps.name}: parameter-server workers open no torch.distributed "
                          "group; their metrics merge through the servers: use metrics.merge=auto (or ps)")


def validate_config(cfg: DictConfig, overrides: Sequence[str] = ()) -> None:
    """Everything about a composed config that can be checked before data is read or any process
    starts; raises a ConfigError naming the value, where it came from and the fix.

    `overrides`: the command line's (to say which one added an unknown key). Cheap checks come
    first (unknown keys, the trainer's and cluster's values, the PS mode's knobs); binding the
    model, task, optimizer, data set and observers to their constructors imports those classes.
    stream=hourly's own keys are checked by recps.stream (before it launches anything).

    >>> validate_config(compose_config(["ps=local", "trainer.batch_size=-1"]))
    Traceback (most recent call last):
    ...
    recps.errors.ConfigError: trainer.batch_size=-1: give the examples per batch (per thread), 1 or more
    """
    try:
        missing = sorted(OmegaConf.missing_keys(cfg))
        if not missing:
            OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:  # an interpolation that does not resolve: omegaconf names the key
        key = str(getattr(exc, "full_key", None) or "")
        parent, _, last = key.rpartition(".")
        node = OmegaConf.select(cfg, parent, throw_on_resolution_failure=False) if parent else cfg
        raw = f"={_show(node, last)}" if isinstance(node, DictConfig) and last in node else ""
        raise ConfigError(f"{key or 'the config'}{raw} does not resolve: {str(exc).splitlines()[0]}; "
                          "fix the interpolation or give a value") from exc
    if missing:
        raise ConfigError(f"{', '.join(missing)} not set (??? in the config); give a value on the command line, "
                          f"e.g. {missing[0]}=...")
    _check_plain_keys(cfg, overrides)
    _check_values(cfg)
    name = str(cfg.ps.name)
    if name in PS_MODES:
        check_cluster_config(cfg)
        mode = ps_mode(cfg)  # binds ps and ps.table to their constructors and builds the mode (its own checks)
        dim = cfg.model.get("embedding_dim")
        if isinstance(dim, int) and not isinstance(dim, bool) and dim > 0 and getattr(mode, "table", None) is not None:
            mode.table.budget_rows(dim)  # a byte budget too small for one row of the model's width fails now
    elif name != "local":
        raise ConfigError(f"ps={name!r} is not one of local, {', '.join(PS_MODES)}; pick one of them")
    # stream=hourly: recps.stream checks its own keys (a layer above) before it launches anything.
    # Binding to constructors: imports the classes (models: torchrec), still before any data or process.
    check_target_args(cfg.model, "model", injected=MODEL_INJECTED, engine_keys=MODEL_ENGINE_KEYS)
    check_target_args(cfg.task, "task", engine_keys=TASK_ENGINE_KEYS)
    check_target_args(cfg.optimizer, "optimizer", injected=("params",))
    check_optimizer_values(cfg.optimizer, overrides)
    if cfg.dataset.get("_target_"):
        check_target_args(cfg.dataset, "dataset", injected=("seed",))
    for i, spec in enumerate(cfg.trainer.get("observers") or ()):
        check_target_args(spec, f"trainer.observers[{i}]", injected=("job",))
    # deferred: torch (the observers' modules); `import recps.config` stays light for the launcher and --cfg
    from recps.debug.dump import check_debug_config
    from recps.metrics.groups import check_run_groups
    from recps.metrics.reporter import check_metrics_config

    check_metrics_config(cfg.get("metrics"))
    check_debug_config(cfg.get("debug"))
    if not _pipeline(cfg):  # a pipeline's stages read pipeline.world's data and compute no grouped metrics of these
        check_run_groups(cfg.task.get("metrics"), cfg.get("metrics"), dataset_feature_names(cfg.dataset),
                         source=override_source("metrics.group_key", overrides),
                         data=f"dataset {cfg.dataset.get('name')}")
    metrics = cfg.get("metrics")
    if metrics is not None and bool(metrics.get("tensorboard", False)):  # the held-out metrics go there too
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("metrics.tensorboard=true needs the tensorboard package, which is not installed: "
                              "pip install tensorboard (or set metrics.tensorboard=false)")


def _pipeline(cfg: DictConfig) -> bool:
    """Whether `cfg` runs a pipeline (recps.pipeline: its stages, not `model`, `task` and `dataset`)."""
    return cfg.get("pipeline") is not None and str(cfg.pipeline.get("name", "none")) != "none"


def override_source(path: str, overrides: Sequence[str]) -> str:
    """`the override metrics.group_key=x` when the command line set `path`, else ``""``."""
    said = _added_by(path, overrides)
    return said if said.startswith("the override") else ""


def dataset_feature_names(dataset: DictConfig) -> tuple[str, ...] | None:
    """The sparse features (KeyedJaggedTensor keys) a tabular dataset config's `schema` declares, as the
    readers will name them (recps.data.schema.Schema.feature_names); None for a data set a `_target_`
    builds (its features are known once it is read). A bad schema raises its ConfigError here.

    >>> dataset_feature_names(compose_config(["dataset=criteo_tiny"]).dataset)[:3]
    ('C1', 'C2', 'C3')
    """
    if dataset.get("_target_") or dataset.get("schema") is None:
        return None
    return Schema.from_config(OmegaConf.to_container(dataset.schema, resolve=True)).feature_names


# torch.optim's words for an argument in its errors ("Invalid learning rate: -1"), and a value to give.
_OPTIMIZER_ARGS = {"lr": ("learning rate", "a learning rate > 0, e.g. 0.001"),
                   "eps": ("epsilon", "a small number >= 0, e.g. 1e-8"),
                   "betas": ("beta", "two numbers in [0, 1), e.g. [0.9, 0.999]"),
                   "weight_decay": ("weight_decay", "a number >= 0"),
                   "momentum": ("momentum", "a number >= 0")}


def check_optimizer_values(node: DictConfig, overrides: Sequence[str] = (), where: str = "optimizer") -> None:
    """Builds the dense optimizer `node` names over one parameter, so that its constructor's own checks
    (torch.optim's "Invalid learning rate: -1") fail here, before any process starts, as a ConfigError
    naming the argument, where it came from and the fix. torch is imported by then (the PS modes)."""
    import torch  # deferred: `import recps.config` stays torch-free (the modes' register_resolvers loads it)

    try:
        instantiate(node)([torch.nn.Parameter(torch.zeros(1))])  # (1,)
    except (ValueError, TypeError, InstantiationException) as exc:
        target = node.get("_target_")
        args = {str(k): v for k, v in OmegaConf.to_container(node, resolve=True).items() if not str(k).startswith("_")}
        said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        for key, (word, give) in _OPTIMIZER_ARGS.items():
            if key in args and word in said.lower():
                source = override_source(f"{where}.{key}", overrides)
                raise ConfigError(f"{where}.{key}={args[key]!r}{f' (from {source})' if source else ''}: {target} "
                                  f"refuses it ({said}); set {where}.{key} to {give}") from exc
        shown = ", ".join(f"{where}.{k}={v!r}" for k, v in args.items())
        raise ConfigError(f"{where} ({target}) refuses its arguments ({shown}): {said}; give each a value of the type "
                          f"and range {target} takes") from exc


def check_group_overrides(args: Sequence[str]) -> None:
    """Command-line overrides that give a config group of conf/ (model, ps, trainer, ...) something other
    than an option's name (`trainer=null`, `cluster=3`, `trainer=[1]`): a ConfigError naming the override
    and the group's options, before Hydra fails on it with a traceback. Sweeps and what does not parse are
    left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser  # deferred: Hydra's parser

    parser = OverridesParser.create()
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = parser.parse_override(arg)
        except Exception:  # noqa: BLE001 (Hydra reports what it cannot parse)
            continue
        group = PROJECT_ROOT / "conf" / str(override.key_or_group)
        if not group.is_dir() or override.is_sweep_override():
            continue
        value = override.value()
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            continue
        options = sorted(f.stem for f in group.glob("*.yaml"))
        raise ConfigError(f"{arg}: {override.key_or_group} is a config group: choose one of its options "
                          f"({', '.join(options)}), e.g. {override.key_or_group}={options[0]}, or set one of its "
                          f"keys, e.g. {override.key_or_group}.<key>=...")


def composition_error_message(exc: BaseException) -> str | None:
    """A one-line message for Hydra's "Could not override 'trainer.thread'" (a key the config does not
    have), with the closest key, and for a group option conf/ does not have (`model=deepfmm`), with the
    closest option; None for any other error.

    >>> from hydra.errors import ConfigCompositionException
    >>> try:
    ...     compose_config(["trainer.thread=2"])
    ... except ConfigCompositionException as e:
    ...     print(composition_error_message(e))  # doctest: +ELLIPSIS
    trainer.thread=2: trainer has no key 'thread'; did you mean trainer.threads? (trainer's keys: epochs, ...)
    """
    missing, options = getattr(exc, "missing_cfg_file", None), getattr(exc, "options", None)
    if missing and options:  # Hydra's MissingConfigException: a group option conf/ does not have
        group, _, name = str(missing).rpartition("/")
        return (f"{group.replace('/', '.')}={name}: no such {group.rsplit('/', 1)[-1]}"
                f"{did_you_mean(name, options)} (the options: {', '.join(str(o) for o in options)})")
    cause = exc.__cause__
    parent = getattr(cause, "parent_node", None)
    full_key = getattr(cause, "full_key", None)
    if not isinstance(parent, DictConfig) or not full_key or "not in struct" not in str(cause):
        return None
    path, _, key = str(full_key).rpartition(".")
    keys = [str(k) for k in parent.keys() if str(k) != "hydra"]
    override = re.search(r"use (\+\S+)", str(exc))
    shown = override.group(1)[1:] if override else full_key
    where = path or "the config"
    return f"{shown}: {where} has no key {key!r}{did_you_mean(key, keys, path)} ({where}'s keys: {', '.join(keys)})"
