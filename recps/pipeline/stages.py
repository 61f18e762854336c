"""A pipeline config (conf/pipeline/*.yaml) read into `StageSpec`s and checked before any process starts.

`pipeline_specs(cfg)` binds every stage's model, task and optimizer to their constructors, builds its
PS mode (the stage's `ps` node, a conf/ps group), and checks the stages against each other: an
upstream that is not an earlier stage, a `keep` larger than what the stage receives, features a model
reads that the stage's inputs lack, a mode the stage cannot train in, an `inputs.share` that is not an
earlier stage's table of the same width, a `pipeline.schedule` group whose stages depend on each other
(`schedule(cfg, specs)`). `check_data(specs, data)` checks
them against the data once it is loaded (features it lacks, recall's keep against the catalogue), still
in the launcher. Every message names the stage, the key and the fix.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from recps.config import MODEL_ENGINE_KEYS, MODEL_INJECTED, PS_MODES, TASK_ENGINE_KEYS, check_target_args
from recps.errors import ConfigError
from recps.pipeline.sasrec_alone import sasrec_settings

__all__ = ["StageSpec", "EvalSettings", "eval_settings", "enabled", "pipeline_specs", "schedule", "check_data", "ease_settings", "validation_fraction",
           "stream_validation_note",
           "refresh_epochs", "sasrec_baseline", "item_cf_settings", "STAGE_KEYS", "INPUT_KEYS", "EASE_DEFAULTS",
           "ITEM_CF", "COUNT_FEATURES", "COUNT_PRIOR"]

STAGE_KEYS = ("model", "task", "optimizer", "trainer", "ps", "keep", "inputs", "score_weights")
INPUT_KEYS = ("features", "upstream", "train_on", "candidates_per_user", "candidate_users", "scores", "share",
              "score_norm", "counts", "count_prior")
# How a ranker reads its `scores`: none (as they are: logits, item_cf's score) or request (each column
# standardised over the request's candidates, (x - mean) / sd: what the ranker learns then survives a
# shift of an upstream's scale, e.g. a stage trained again on more data, or EASE fitted on more history).
SCORE_NORMS = ("none", "request")
TRAINER_KEYS = ("epochs", "batch_size", "threads", "max_steps")
PIPELINE_KEYS = ("name", "world", "top_n", "eval_users", "eval_batch_users", "index", "stages", "objective",
                 "schedule", "baselines", "validation_fraction", "refresh")
# What a stage trains on: positives (recall: the clicked exposures); exposures (labelled) and candidates
# (unexposed upstream candidates, label 0); validation: the upstream's candidates of the validation period's
# requests, labelled by what the user did in that period (recps.pipeline.data.validation_period);
# validation_exposures: what the period showed those requests, with its labels (where the unexposed have no
# label, e.g. the video world, which would click many of them).
VALIDATION = ("validation", "validation_exposures")
TRAIN_ON = ("positives", "exposures", "candidates", *VALIDATION)
# A score a ranker may read beside the stages' (inputs.scores): the item-item score X_u·B[:, item] of EASE
# fitted on the rows the stage's data holds (recps.pipeline.ease.EaseBaseline.pair_scores), with
# pipeline.baselines.ease's settings. Read as of the data's training rows, so only a stage trained on the
# validation period may read it (its requests come after every row EASE saw).
ITEM_CF = "item_cf"
# Counting features a ranker may read as dense inputs (inputs.counts; recps.pipeline.counts): the item's and the
# user x category's shows and clicks, from the stage's counting table's CTR accessor on the servers.
COUNT_FEATURES = ("item_id", "user_category")
COUNT_PRIOR = 10.0  # inputs.count_prior: pseudo-shows at the feature's CTR in the smoothed CTR
# The features a model reads, by constructor argument (zoo models name them so).
_FEATURE_ARGS = ("query_features", "candidate_features", "user_features", "item_features", "features")
# ... and by a behaviour-history model (models/_behaviour.py), defaults included: a DIN without
# history_item_id among its stage's inputs.features fails here, naming the stage and the key.
_SEQUENCE_ARGS = ("target_features", "history_features", "history_flags", "other_features")
# pipeline.baselines.ease (every key optional): enabled; grid, the L2 weights tried on the validation split;
# validation_fraction, each user's latest share of training rows held out for that choice; interactions,
# "exposures" (every training row, e.g. every MovieLens rating) or "clicks" (label 0 > 0); max_items, the
# most interacted items it models (the Gram matrix is max_items² floats); dtype; in_stream, whether the
# streaming funnel refits it at every pass's evaluation (off: a fit per pass is minutes).
EASE_DEFAULTS: dict[str, Any] = {"enabled": True, "grid": [100.0, 300.0, 1000.0], "validation_fraction": 0.2,
                                 "interactions": "exposures", "max_items": 4000, "dtype": "float32",
                                 "in_stream": False}


@dataclass
class StageSpec:
    """One stage of the funnel, as its config says (see conf/pipeline/video_funnel.yaml)."""

    name: str
    index: int
    model: DictConfig
    task: DictConfig
    optimizer: DictConfig
    ps: DictConfig
    mode: Any  # the recps.ps.modes object its `ps` node builds
    keep: int
    features: list[str]
    upstream: str | None
    train_on: list[str]
    candidates_per_user: int = 0
    candidate_users: int = 0  # training users whose upstream candidates it trains on (0: all)
    scores: list[str] = field(default_factory=list)
    score_norm: str = "none"
    counts: list[str] = field(default_factory=list)  # counting features read as dense inputs (recps.pipeline.counts)
    count_prior: float = COUNT_PRIOR
    share: dict[str, str] = field(default_factory=dict)  # feature -> the earlier stage whose table it reads (frozen)
    score_weights: list[float] | None = None
    epochs: int = 1
    batch_size: int = 256
    threads: int = 1
    max_steps: int = -1

    @property
    def where(self) -> str:
        return f"pipeline.stages.{self.name}"

    @property
    def is_retrieval(self) -> bool:
        return self.upstream is None

    @property
    def validates(self) -> bool:
        """Whether the stage trains on a validation period (`validation`, `validation_exposures`): in the batch
        funnel each user's latest pipeline.validation_fraction, in a stream each pass (recps.pipeline.incremental)."""
        return bool(set(VALIDATION) & set(self.train_on))

    @property
    def reads_dense(self) -> bool:
        """Whether the stage's model reads dense inputs: its `scores` and / or its counting features."""
        return bool(self.scores or self.counts)

    @property
    def sequence(self) -> bool:
        """Whether the stage's model reads unpooled rows (it takes an `embedding_collection`: models.DIN,
        models.BST, which read behaviour history); else a pooled bag collection."""
        from hydra.utils import get_object

        return "embedding_collection" in inspect.signature(get_object(str(self.model._target_))).parameters


def enabled(cfg: DictConfig) -> bool:
    node = cfg.get("pipeline")
    return node is not None and str(node.get("name", "none")) != "none"


def _plain(node) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node


def _mode(stage: str, ps: DictConfig):
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    where = f"pipeline.stages.{stage}.ps"
    name = str(ps.get("name", ""))
    if name not in PS_MODES:
        raise ConfigError(f"{where}.name={name!r}: the funnel's stages train on the parameter server; choose "
                          f"ps@{where}={'|'.join(PS_MODES)}")
    check_target_args(ps, where, engine_keys=("name",))
    if ps.get("table") is not None:
        check_target_args(ps.table, f"{where}.table")
    node = _plain(ps)
    node.pop("name", None)
    try:
        return instantiate(node, _convert_="all")
    except InstantiationException as e:
        raise ConfigError(f"{where} ({name}): {e.__cause__ or e}; fix that knob") from e


def _int(node, key: str, where: str, minimum: int) -> int:
    value = node.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}.{key}={value!r}: give an integer >= {minimum}")
    return int(value)


def _share(name: str, where: str, node: DictConfig, share, features: list[str], earlier: list[StageSpec],
           names: list[str]) -> dict[str, str]:
    """inputs.share {feature: stage}: the feature's rows are that earlier stage's (one table on the servers),
    read frozen by this stage (see docs/funnel.md, "Stages sharing a table")."""
    if share is None:
        return {}
    if not isinstance(share, DictConfig):
        raise ConfigError(f"{where}.inputs.share={_plain(share)!r}: give a mapping feature: stage, e.g. "
                          "{item_id: recall}")
    by_name = {s.name: s for s in earlier}
    out: dict[str, str] = {}
    for feature, owner in share.items():
        feature, owner = str(feature), str(owner)
        key = f"{where}.inputs.share.{feature}={owner}"
        if owner not in by_name:
            what = ("the stage itself" if owner == name else "a later stage" if owner in names
                    else f"no stage (stages: {', '.join(names)})")
            raise ConfigError(f"{key}: {owner!r} is {what}; a stage shares the table of a stage trained before "
                              f"it ({', '.join(by_name) or 'none'}): name one of them or drop the share")
        if feature not in features:
            raise ConfigError(f"{key}: {feature!r} is not among {where}.inputs.features {features}; add it there "
                              "or drop the share")
        source = by_name[owner]
        if feature not in source.features:
            raise ConfigError(f"{key}: stage {owner} has no {feature!r} table (its inputs.features are "
                              f"{source.features}); share a feature it trains or drop the share")
        if feature in source.share:
            raise ConfigError(f"{key}: {owner}'s {feature!r} is itself {source.share[feature]}'s table; share it "
                              f"from its owner: {where}.inputs.share.{feature}={source.share[feature]}")
        dim, owner_dim = int(node.model.embedding_dim), int(source.model.embedding_dim)
        if dim != owner_dim:
            raise ConfigError(f"{key}: {where}.model.embedding_dim={dim} but pipeline.stages.{owner}.model."
                              f"embedding_dim={owner_dim}; one table has one width: set {where}.model."
                              f"embedding_dim={owner_dim} or drop the share")
        out[feature] = owner
    if out and len(out) == len(features):
        raise ConfigError(f"{where}.inputs.share={out}: every feature of the stage is shared; it would train no "
                          "rows of its own: keep at least one of its inputs.features unshared")
    return out


def pipeline_specs(cfg: DictConfig) -> list[StageSpec]:
    """The stages of `cfg.pipeline`, in order, checked (see the module docstring); ConfigError otherwise."""
    from hydra.utils import get_object

    p = cfg.pipeline
    for key in p.keys():
        if key not in PIPELINE_KEYS:
            raise ConfigError(f"pipeline.{key} is read by nothing; the pipeline's keys are {', '.join(PIPELINE_KEYS)}")
    stages = p.get("stages")
    if not isinstance(stages, DictConfig) or not len(stages):
        raise ConfigError(f"pipeline={p.get('name')} has no stages; give pipeline.stages.<name>: {{model, task, ps, "
                          "keep, inputs}} in order (recall first)")
    if p.get("world") is None or not p.world.get("_target_"):
        raise ConfigError("pipeline.world has no _target_; give the data builder, e.g. recps.pipeline.data.movielens")
    top_n = _int(p, "top_n", "pipeline", 1)
    length = p.world.get("history_length")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
        readers = [str(n) for n, node in (p.get("stages") or {}).items()
                   if any(str(f).startswith("history_") for f in ((node.get("inputs") or {}).get("features") or ()))]
        raise ConfigError(f"pipeline.world.history_length={length!r}; use an integer >= 1 (the interactions a history "
                          f"feature holds{'; read by stages ' + ', '.join(readers) if readers else ''})")
    specs: list[StageSpec] = []
    for index, (name, node) in enumerate(stages.items()):
        name = str(name)
        where = f"pipeline.stages.{name}"
        if not isinstance(node, DictConfig):
            raise ConfigError(f"{where}={node!r}: a stage is a mapping of {', '.join(STAGE_KEYS)}")
        for key in node.keys():
            if key not in STAGE_KEYS:
                raise ConfigError(f"{where}.{key} is read by nothing; a stage's keys are {', '.join(STAGE_KEYS)}")
        for key in ("model", "task", "optimizer", "ps", "keep", "inputs"):
            if node.get(key) is None:
                raise ConfigError(f"{where}.{key} is not set; every stage gives {key} (see conf/pipeline/video_funnel.yaml)")
        # The model: a zoo `_target_` that imports, can serve as this stage, and takes these arguments.
        target = node.model.get("_target_")
        try:
            model_cls = get_object(str(target))
        except Exception as exc:  # hydra raises ImportError/AttributeError variants
            raise ConfigError(f"{where}.model._target_={target!r} cannot be imported ({exc}); fix the name "
                              "(a zoo model: models.TwoTower, models.MMoE, ...)") from exc
        if index == 0:
            for method in ("encode", "score"):
                if not callable(getattr(model_cls, method, None)):
                    raise ConfigError(f"{where}.model._target_={target} has no {method}(): the first stage exports "
                                      "an item tower into the index; use a two-tower model (models.TwoTower, "
                                      "models.YoutubeDNN)")
        check_target_args(node.model, f"{where}.model", injected=MODEL_INJECTED, engine_keys=MODEL_ENGINE_KEYS)
        check_target_args(node.task, f"{where}.task", engine_keys=TASK_ENGINE_KEYS)
        check_target_args(node.optimizer, f"{where}.optimizer", injected=("params",))
        if node.model.get("embedding_dim") is None:
            raise ConfigError(f"{where}.model.embedding_dim is not set; give the width of the stage's embedding rows")
        inputs = node.inputs
        for key in inputs.keys():
            if key not in INPUT_KEYS:
                raise ConfigError(f"{where}.inputs.{key} is read by nothing; a stage's inputs are {', '.join(INPUT_KEYS)}")
        features = [str(f) for f in (inputs.get("features") or ())]
        if not features:
            raise ConfigError(f"{where}.inputs.features is empty; list the data's features the model reads")
        upstream = inputs.get("upstream")
        earlier = [s.name for s in specs]
        if index == 0 and upstream is not None:
            raise ConfigError(f"{where}.inputs.upstream={upstream!r}: the first stage retrieves from the whole "
                              "catalogue; set it to null (or put the stage after its upstream)")
        if index > 0 and upstream not in earlier:
            raise ConfigError(f"{where}.inputs.upstream={upstream!r} is not an earlier stage ({', '.join(earlier)}); "
                              "name the stage whose candidates it scores")
        scores = [str(s) for s in (inputs.get("scores") or ())]
        for s in scores:
            if s not in earlier and s != ITEM_CF:
                raise ConfigError(f"{where}.inputs.scores: {s!r} is not an earlier stage ({', '.join(earlier)}) nor "
                                  f"{ITEM_CF}; name stages above it")
        score_norm = str(inputs.get("score_norm") or "none")
        if score_norm not in SCORE_NORMS:
            raise ConfigError(f"{where}.inputs.score_norm={score_norm!r}; use one of {list(SCORE_NORMS)}")
        takes = inspect.signature(model_cls).parameters
        counts, count_prior = _counts(cfg, name, where, index, node, inputs, takes)
        if scores and "dense_in_features" not in takes:
            raise ConfigError(f"{where}.inputs.scores={scores}: {node.model._target_} takes no dense inputs; "
                              "use a model with dense_in_features (models.CTRDNN, models.DeepFM) or drop scores")
        sequence = "embedding_collection" in takes
        if "embedding_bag_collection" not in takes and not sequence:
            raise ConfigError(f"{where}.model._target_={node.model._target_} takes neither an embedding_bag_collection "
                              "nor an embedding_collection; a funnel stage builds its model over a PS-backed "
                              "collection: use a pooled zoo model (two_tower, youtube_dnn, deepfm, dcn_v2, mmoe, "
                              "ctr_dnn) or a behaviour-history one (din, bst)")
        if sequence and inputs.get("share"):
            raise ConfigError(f"{where}.inputs.share: {node.model._target_} reads unpooled rows of its own tables; "
                              "sharing another stage's table is for pooled models: drop inputs.share")
        for arg in (*_FEATURE_ARGS, *(_SEQUENCE_ARGS if sequence else ())):
            wanted = node.model.get(arg)
            if wanted is None and arg in _SEQUENCE_ARGS and arg in takes:  # the model's default names count too
                default = takes[arg].default
                wanted = None if default is inspect.Parameter.empty else default
            if wanted is not None:
                lacking = [str(f) for f in wanted if str(f) not in features]
                if lacking:
                    raise ConfigError(f"{where}.model.{arg}: {lacking} are not among the stage's inputs.features "
                                      f"{features}; add them there or drop them from the model")
        share = _share(name, where, node, inputs.get("share"), features, specs, [str(n) for n in stages.keys()])
        train_on = [str(t) for t in (inputs.get("train_on") or ())]
        tuned_on_test = [t for t in train_on if t in ("test", "held_out", "held-out", "test_positives")]
        if tuned_on_test:
            raise ConfigError(f"{where}.inputs.train_on={train_on}: {tuned_on_test[0]!r} is the held-out requests the "
                              "funnel is evaluated on; a stage never trains or tunes on them: use validation (each "
                              "user's latest pipeline.validation_fraction of the TRAINING exposures)")
        if not train_on or any(t not in TRAIN_ON for t in train_on):
            raise ConfigError(f"{where}.inputs.train_on={train_on}: give some of {list(TRAIN_ON)}")
        mixed = [t for t in train_on if t not in VALIDATION]
        if _streaming(cfg) and mixed and len(mixed) < len(train_on):
            raise ConfigError(f"{where}.inputs.train_on={train_on} with stream.enabled: a stream's validation period is "
                              f"the pass itself, scored by the stages of the previous pass, so {mixed} would be the "
                              f"same impressions again; use {[t for t in train_on if t in VALIDATION]} or {mixed}")
        if counts and not set(train_on) <= set(VALIDATION) and not _streaming(cfg):
            raise ConfigError(f"{where}.inputs.counts={counts} but train_on={train_on}: the batch funnel reads the "
                              "counts as of the end of the period its stages train on, so a training exposure's own "
                              "label would be in its counts; a stage reading counts trains on [validation] and/or "
                              "[validation_exposures] only (or drop inputs.counts; a streaming funnel reads the "
                              "previous pass's counts)")
        if ITEM_CF in scores and not set(train_on) <= set(VALIDATION):
            raise ConfigError(f"{where}.inputs.scores reads {ITEM_CF} but train_on={train_on}: EASE is fitted on the "
                              "training rows, so a training exposure's own future would be in its score; a stage "
                              f"reading {ITEM_CF} trains on [validation] only (and/or [validation_exposures]; or drop "
                              f"{ITEM_CF})")
        if index == 0 and train_on != ["positives"]:
            raise ConfigError(f"{where}.inputs.train_on={train_on}: the recall stage trains on [positives] (its "
                              "softmax takes the other rows' items as negatives)")
        if index > 0 and "positives" in train_on:
            raise ConfigError(f"{where}.inputs.train_on={train_on}: a ranker trains on exposures (labelled) and/or "
                              "candidates; use [exposures, candidates]")
        keep = _int(node, "keep", where, 1)
        if index > 0:
            upstream_keep = next(s.keep for s in specs if s.name == upstream)
            if keep > upstream_keep:
                raise ConfigError(f"{where}.keep={keep} is larger than its input: {upstream}.keep={upstream_keep} "
                                  f"candidates reach it; lower {where}.keep or raise pipeline.stages.{upstream}.keep")
        trainer = node.get("trainer") or OmegaConf.create({})
        for key in trainer.keys():
            if key not in TRAINER_KEYS:
                raise ConfigError(f"{where}.trainer.{key} is read by nothing; a stage's trainer keys are "
                                  f"{', '.join(TRAINER_KEYS)}")
        mode = _mode(name, node.ps)
        threads = int(trainer.get("threads", 1))
        max_steps = int(trainer.get("max_steps", -1))
        if mode.name == "sync" and max_steps > 0 and max_steps % threads:
            raise ConfigError(f"{where}.trainer.max_steps={max_steps} with ps sync and {threads} threads: every thread "
                              f"takes the same steps; give a multiple of {threads}")
        weights = node.get("score_weights")
        if weights is not None:
            weights = [float(w) for w in weights]
            tasks = node.model.get("num_tasks")
            if tasks is not None and len(weights) != int(tasks):
                raise ConfigError(f"{where}.score_weights={weights}: {len(weights)} weights for model.num_tasks={tasks} "
                                  "objectives; give one weight per objective")
        specs.append(StageSpec(
            name=name, index=index, model=node.model, task=node.task, optimizer=node.optimizer, ps=node.ps, mode=mode,
            keep=keep, features=features, upstream=None if upstream is None else str(upstream), train_on=train_on,
            candidates_per_user=int(inputs.get("candidates_per_user") or 0),
            candidate_users=int(inputs.get("candidate_users") or 0), scores=scores, score_norm=score_norm, share=share, score_weights=weights,
            counts=counts, count_prior=count_prior,
            epochs=_int(trainer, "epochs", f"{where}.trainer", 1) if "epochs" in trainer else 1,
            batch_size=_int(trainer, "batch_size", f"{where}.trainer", 1) if "batch_size" in trainer else 256,
            threads=threads, max_steps=max_steps,
        ))
    last = specs[-1]
    if last.keep != top_n:
        raise ConfigError(f"pipeline.stages.{last.name}.keep={last.keep} but pipeline.top_n={top_n}: the last stage "
                          "keeps the final list; make them equal")
    if len({s.threads for s in specs}) != 1:
        raise ConfigError("pipeline.stages.*.trainer.threads differ "
                          f"({', '.join(f'{s.name}={s.threads}' for s in specs)}): one worker's threads train every "
                          "stage in turn; give every stage the same threads")
    schedule(cfg, specs)  # pipeline.schedule checked too, before any process starts
    ease_settings(cfg)  # pipeline.baselines.ease too
    sasrec_baseline(cfg)  # and pipeline.baselines.sasrec
    validation_fraction(cfg, specs)  # and pipeline.validation_fraction
    if _streaming(cfg) and ((cfg.pipeline.get("world") or {}).get("tune") or False):
        raise ConfigError("pipeline.world.tune=true with stream.enabled: a stream trains on the world's passes (its "
                          "training impressions, whole) and would be evaluated on the tune split's requests; drop "
                          "pipeline.world.tune (choose settings on a run without stream=hourly)")
    return specs


def _counts(cfg: DictConfig, name: str, where: str, index: int, node: DictConfig, inputs: DictConfig,
            takes) -> tuple[list[str], float]:
    """inputs.counts (counting features, checked) and inputs.count_prior of a stage."""
    given = inputs.get("counts")
    prior = inputs.get("count_prior")
    prior = COUNT_PRIOR if prior is None else prior
    if isinstance(prior, bool) or not isinstance(prior, (int, float)) or not prior >= 0:
        raise ConfigError(f"{where}.inputs.count_prior={prior!r}; give the smoothed CTR's pseudo-shows, a number "
                          f">= 0 (default {COUNT_PRIOR:g})")
    if given is None:
        return [], float(prior)
    counts = [str(f) for f in (_plain(given) if isinstance(given, ListConfig) else [given])]
    unknown = [f for f in counts if f not in COUNT_FEATURES]
    if unknown or len(set(counts)) != len(counts):
        raise ConfigError(f"{where}.inputs.counts={counts}: {unknown or 'a repeated name'}; the counting features are "
                          f"{list(COUNT_FEATURES)} (each once)")
    if not counts:
        return [], float(prior)
    if index == 0:
        raise ConfigError(f"{where}.inputs.counts={counts}: the recall stage retrieves by its towers and reads no "
                          "dense inputs; give counting features to a ranker")
    if "dense_in_features" not in takes:
        raise ConfigError(f"{where}.inputs.counts={counts}: {node.model._target_} takes no dense inputs; use a model "
                          "with dense_in_features (models.DIN, models.DeepFM, models.LR) or drop inputs.counts")
    accessor = (node.ps.get("table") or {}).get("accessor")
    if accessor is None and _streaming(cfg):  # a streaming funnel's stages take ps.table.accessor when null
        accessor = ((cfg.get("ps") or {}).get("table") or {}).get("accessor")
    if accessor is None:
        raise ConfigError(f"{where}.inputs.counts={counts}: counting features are the statistics of the CTR "
                          f"accessor of the stage's tables (its counting table {name}_counts), and "
                          f"{where}.ps.table.accessor is null: give it one, e.g. '{where}.ps.table.accessor={{}}' "
                          "(recps.ps.table.accessor.CtrAccessor's defaults), or drop inputs.counts")
    return counts, float(prior)


def _streaming(cfg: DictConfig) -> bool:
    """Whether the run is a streaming funnel (stream.enabled)."""
    return bool((cfg.get("stream") or {}).get("enabled", False))


def validation_fraction(cfg: DictConfig, specs: list[StageSpec]) -> float | None:
    """pipeline.validation_fraction when a stage trains on `validation` (then required, in (0, 1)), else None.
    With a validation stage every stage trains on the earlier part of the training data (the period is what
    the funnel trained on the rest retrieves and ranks); the held-out requests are never read for it.
    `pipeline.refresh` ({stage: epochs}) is checked too (`refresh_epochs`). A streaming funnel's validation
    period is each pass (recps.pipeline.incremental): None, the value is not read (`stream_validation_note`)."""
    users = [s.name for s in specs if s.validates]
    value = cfg.pipeline.get("validation_fraction")
    refresh_epochs(cfg, specs)
    if not users or _streaming(cfg):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) < 1.0:
        raise ConfigError(f"pipeline.validation_fraction={value!r} but stage(s) {users} train on validation; set it in "
                          "(0, 1), e.g. +pipeline.validation_fraction=0.2 (each user's latest share of training "
                          "exposures)")
    return float(value)


def stream_validation_note(cfg: DictConfig, specs: list[StageSpec]) -> str | None:
    """The line a streaming funnel with validation stages logs once (None without them): their period is each
    pass, and the batch funnel's pipeline.validation_fraction and pipeline.refresh are not used."""
    users = [s.name for s in specs if s.validates]
    if not users or not _streaming(cfg):
        return None
    p = cfg.pipeline
    return (f"stream: stage(s) {', '.join(users)} train on a validation period, which in a stream is each pass: its "
            "impressions, scored by the stages as of the end of the previous pass (from the second pass on); "
            f"pipeline.validation_fraction ({p.get('validation_fraction')}) and pipeline.refresh "
            f"({_plain(p.get('refresh'))}) are the batch funnel's and are not used")


def refresh_epochs(cfg: DictConfig, specs: list[StageSpec]) -> dict[str, int]:
    """pipeline.refresh: {stage: epochs}, the stages trained again on ALL training data for that many epochs
    once every stage is trained (a funnel with a validation stage trains the others on the period's past
    first: refreshed, their users' latest exposures count too). Only stages that do not train on
    `validation`, and only when one does. {} when unset."""
    node = cfg.pipeline.get("refresh")
    plain = _plain(node) if node is not None else {}
    validation_stages = [s.name for s in specs if set(VALIDATION) & set(s.train_on)]
    if not plain:
        return {}
    names = {s.name: s for s in specs}
    if not isinstance(plain, dict):
        raise ConfigError(f"pipeline.refresh={plain!r}; give {{stage: epochs}}, e.g. {{recall: 3}}")
    if not validation_stages:
        raise ConfigError(f"pipeline.refresh={plain} but no stage trains on validation: every stage already trains "
                          "on all training data; drop pipeline.refresh")
    out = {}
    for name, epochs in plain.items():
        if name not in names:
            raise ConfigError(f"pipeline.refresh.{name}: no such stage; the stages are {list(names)}")
        if name in validation_stages:
            raise ConfigError(f"pipeline.refresh.{name}: stage {name} trains on the validation period; refresh only "
                              "the stages trained on the period's past")
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ConfigError(f"pipeline.refresh.{name}={epochs!r}; give the epochs on all training data, an "
                              "integer >= 1")
        out[str(name)] = int(epochs)
    return out


def _reads(spec: StageSpec) -> list[tuple[str, str]]:
    """(stage, what of it `spec` reads) for every stage whose training must come before spec's."""
    out = []
    if spec.upstream is not None:
        out.append((spec.upstream, f"candidates (pipeline.stages.{spec.name}.inputs.upstream={spec.upstream})"))
    out += [(s, f"scores (pipeline.stages.{spec.name}.inputs.scores={spec.scores})") for s in spec.scores
            if s != ITEM_CF]
    out += [(o, f"{f} table (pipeline.stages.{spec.name}.inputs.share.{f}={o})") for f, o in spec.share.items()]
    return out


def schedule(cfg: DictConfig, specs: list[StageSpec]) -> list[list[StageSpec]]:
    """`pipeline.schedule`: the stages in groups trained one group after the other, the stages of a group
    at the same time (recps.pipeline.runner); null: one stage per group, in order. A group may hold only
    independent stages: one that reads another's candidates, scores or table must come in a later group."""
    node = cfg.pipeline.get("schedule")
    if node is None:
        return [[s] for s in specs]
    plain = _plain(node)
    names = [s.name for s in specs]
    if not isinstance(plain, list) or not plain:
        raise ConfigError(f"pipeline.schedule={plain!r}: give a list of groups of stages, e.g. "
                          f"[[{names[0]}], [{', '.join(names[1:3])}], ...], or null (one stage after another)")
    groups = [[str(g)] if isinstance(g, str) else [str(x) for x in g] if isinstance(g, list) else None for g in plain]
    if any(not g for g in groups):
        raise ConfigError(f"pipeline.schedule={plain}: every group is a non-empty list of stage names")
    flat = [n for g in groups for n in g]
    if flat != names:
        raise ConfigError(f"pipeline.schedule={plain} lists {flat}; it must list every stage once, in the order of "
                          f"pipeline.stages ({names}): group consecutive stages")
    by_name = {s.name: s for s in specs}
    out = [[by_name[n] for n in g] for g in groups]
    for group in out:
        here = {s.name for s in group}
        for s in group:
            for other, what in _reads(s):
                if other in here:
                    raise ConfigError(f"pipeline.schedule: stages {s.name} and {other} are in one group "
                                      f"{[g.name for g in group]}, but {s.name} reads {other}'s {what}; they "
                                      f"cannot train concurrently: put {s.name} in a group after {other}'s")
    return out


def ease_settings(cfg: DictConfig) -> dict[str, Any] | None:
    """pipeline.baselines.ease over EASE_DEFAULTS, checked (ConfigError naming the key); None: not computed
    (enabled false, or a streaming run without in_stream)."""
    node = ((cfg.pipeline.get("baselines") or {}) or {}).get("ease")
    given = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
    out = _ease_checked(given)
    if not out["enabled"] or (_streaming(cfg) and not out["in_stream"]):
        return None
    return out


def _ease_checked(given: dict[str, Any]) -> dict[str, Any]:
    """pipeline.baselines.ease's keys over EASE_DEFAULTS, checked (ConfigError naming the key)."""
    unknown = [k for k in given if k not in EASE_DEFAULTS]
    if unknown:
        raise ConfigError(f"pipeline.baselines.ease.{unknown[0]} is read by nothing; its keys are "
                          f"{', '.join(EASE_DEFAULTS)}")
    out = {**EASE_DEFAULTS, **given}
    grid = [float(v) for v in (out["grid"] or ())]
    if not grid or any(not v > 0 for v in grid):
        raise ConfigError(f"pipeline.baselines.ease.grid={out['grid']}; give L2 weights > 0, e.g. [100, 300, 1000]")
    if not 0.0 < float(out["validation_fraction"]) < 1.0:
        raise ConfigError(f"pipeline.baselines.ease.validation_fraction={out['validation_fraction']}; use a value in "
                          "(0, 1): each user's latest share of TRAINING rows the L2 weight is chosen on")
    if out["interactions"] not in ("exposures", "clicks"):
        raise ConfigError(f"pipeline.baselines.ease.interactions={out['interactions']!r}; use exposures or clicks")
    if int(out["max_items"]) < 1:
        raise ConfigError(f"pipeline.baselines.ease.max_items={out['max_items']}; use an integer >= 1")
    if out["dtype"] not in ("float32", "float64"):
        raise ConfigError(f"pipeline.baselines.ease.dtype={out['dtype']!r}; use float32 or float64")
    out["grid"] = grid
    return out


def item_cf_settings(cfg: DictConfig, specs: list[StageSpec]) -> dict[str, Any] | None:
    """The settings of the item_cf score (pipeline.baselines.ease's, checked as ease_settings does, whether
    or not the baseline is reported) when a stage reads it, else None."""
    if not any(ITEM_CF in s.scores for s in specs):
        return None
    node = ((cfg.pipeline.get("baselines") or {}) or {}).get("ease")
    given = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
    return _ease_checked({**given, "enabled": True})


def sasrec_baseline(cfg: DictConfig) -> dict[str, Any] | None:
    """pipeline.baselines.sasrec over SASREC_DEFAULTS (recps.pipeline.sasrec_alone), checked (ConfigError
    naming the key); None: not computed (no such node, enabled false, or a streaming run)."""
    node = ((cfg.pipeline.get("baselines") or {}) or {}).get("sasrec")
    if node is None:
        return None
    given = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
    out = sasrec_settings(given)
    return out if out["enabled"] and not _streaming(cfg) else None


@dataclass(frozen=True)
class EvalSettings:
    """What the held-out evaluation reads of pipeline.*: the final list's length, how many requests (0:
    all) in batches of how many users, and the full-catalogue baselines' settings (None: not computed)."""

    top_n: int
    eval_users: int = 0
    eval_batch_users: int = 256
    ease: dict[str, Any] | None = None
    sasrec: dict[str, Any] | None = None


def eval_settings(cfg: DictConfig) -> EvalSettings:
    """pipeline.top_n, eval_users, eval_batch_users and baselines.{ease,sasrec}, checked (ConfigError)."""
    p = cfg.pipeline
    return EvalSettings(top_n=int(p.top_n), eval_users=int(p.get("eval_users") or 0),
                        eval_batch_users=int(p.get("eval_batch_users") or 256), ease=ease_settings(cfg),
                        sasrec=sasrec_baseline(cfg))


def check_data(specs: list[StageSpec], data) -> None:
    """The stages against the loaded data (launcher, before any process starts)."""
    for s in specs:
        data.check_features(s.name, s.features)
        if "user_category" in s.counts and "category" not in data.item_features:
            raise ConfigError(f"{s.where}.inputs.counts names user_category, but the data {data.name!r} has no item "
                              f"feature category (it has {list(data.item_features)}); drop user_category there")
        if s.is_retrieval and s.keep > data.num_items:
            raise ConfigError(f"{s.where}.keep={s.keep} is larger than its input: the catalogue holds "
                              f"{data.num_items} items; lower {s.where}.keep")
