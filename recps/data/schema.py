"""The column schema a dataset config gives the readers.

One schema drives every tabular format (Criteo raw text, CSV with or without a header,
Parquet): which columns are labels, dense inputs, single-valued sparse slots, and
multi-valued sequence slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from recps.errors import ConfigError

__all__ = ["Schema", "CRITEO_DENSE", "CRITEO_SPARSE"]

CRITEO_DENSE = tuple(f"I{i}" for i in range(1, 14))
CRITEO_SPARSE = tuple(f"C{i}" for i in range(1, 27))

_FORMATS = ("criteo", "csv", "parquet")
_DENSE_TRANSFORMS = ("none", "log1p")


@dataclass(frozen=True)
class Schema:
    """Columns and parsing options of a tabular data set.

    Attributes:
        labels: label columns, in task order (T of them).
        dense: dense (float) columns (I of them); missing values read as 0.
        sparse: single-valued categorical columns; each value hashes to an int64 key.
        sequence: multi-valued columns, values joined by `sequence_separator`.
        format: "criteo" (TAB-separated, no header, label + I1..I13 + C1..C26),
            "csv" (any separator) or "parquet".
        separator: field separator for text formats.
        header: whether a text file starts with a header line.
        columns: every column in file order, for text files without a header.
        sequence_separator: separator inside a sequence cell.
        dense_transform: "none" or "log1p" (sign(x)*log(1+|x|), Criteo's usual transform).
        hash_values: hash categorical values (strings) into int64 keys; when False the
            values must already be integers and are used as keys unchanged.
        label_range: the values the task trains on, [lo, hi] inclusive, for every label column
            ([lo, hi]) or per label ({label: [lo, hi]}); a row whose label lies outside (after the
            cast to float32) is a bad row. The tabular configs take the task's
            (`${oc.select:task.label_range,null}`: binary tasks [0, 1]); None checks nothing but
            finiteness. Held as {label: (lo, hi)}.
    """

    labels: tuple[str, ...]
    dense: tuple[str, ...] = ()
    sparse: tuple[str, ...] = ()
    sequence: tuple[str, ...] = ()
    format: str = "csv"
    separator: str = ","
    header: bool = True
    columns: tuple[str, ...] | None = None
    sequence_separator: str = "|"
    dense_transform: str = "none"
    hash_values: bool = True
    label_range: Any = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("labels", "dense", "sparse", "sequence"):
            object.__setattr__(self, name, tuple(getattr(self, name) or ()))
        if self.columns is not None:
            object.__setattr__(self, "columns", tuple(self.columns))
        if self.format not in _FORMATS:
            raise ConfigError(
                f"dataset.schema.format={self.format!r} is not one of {_FORMATS}; set it to one of them"
            )
        if self.dense_transform not in _DENSE_TRANSFORMS:
            raise ConfigError(
                f"dataset.schema.dense_transform={self.dense_transform!r} is not one of "
                f"{_DENSE_TRANSFORMS}; set it to one of them"
            )
        if not self.labels:
            raise ConfigError("dataset.schema.labels is empty; name at least one label column")
        used = self.labels + self.dense + self.sparse + self.sequence
        dupes = sorted({c for c in used if used.count(c) > 1})
        if dupes:
            raise ConfigError(f"dataset.schema names columns {dupes} twice; give each one role")
        object.__setattr__(self, "label_range", _label_bounds(self.label_range, self.labels))
        if self.columns is not None:
            missing = [c for c in used if c not in self.columns]
            if missing:
                raise ConfigError(
                    f"dataset.schema uses columns {missing} that dataset.schema.columns does not "
                    f"list; add them to columns or remove them"
                )

    @classmethod
    def criteo(cls, **overrides: Any) -> "Schema":
        """The Criteo display-ads schema: label, I1..I13, C1..C26, TAB, no header, log1p."""
        base: dict[str, Any] = dict(
            labels=("label",),
            dense=CRITEO_DENSE,
            sparse=CRITEO_SPARSE,
            format="criteo",
            separator="\t",
            header=False,
            columns=("label",) + CRITEO_DENSE + CRITEO_SPARSE,
            dense_transform="log1p",
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "Schema":
        """Builds a schema from a dataset config's `schema` mapping (OmegaConf or dict)."""
        cfg = dict(cfg)
        if cfg.get("format") == "criteo" and not cfg.get("columns"):
            rest = {k: v for k, v in cfg.items() if v is not None}
            return cls.criteo(**{k: v for k, v in rest.items() if k != "format"})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ConfigError(
                f"dataset.schema has unknown keys {unknown}; known keys are {sorted(known)}"
            )
        return cls(**{k: (tuple(v) if isinstance(v, Sequence) and not isinstance(v, str) else v)
                      for k, v in cfg.items()})

    @property
    def feature_names(self) -> tuple[str, ...]:
        """Sparse feature names in KeyedJaggedTensor order: sparse slots, then sequences."""
        return self.sparse + self.sequence

    @property
    def num_dense(self) -> int:
        return len(self.dense)


def _label_bounds(value: Any, labels: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """dataset.schema.label_range as {label: (lo, hi)}: None -> {}, [lo, hi] -> every label,
    {label: [lo, hi] | None} -> those labels; anything else raises naming the value and the fix."""
    if value is None:
        return {}
    where = f"dataset.schema.label_range={value!r} (the tabular configs take task.label_range)"
    if isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in labels)
        if unknown:
            raise ConfigError(f"{where} names labels {unknown} that dataset.schema.labels {list(labels)} does not "
                              "list; name label columns, or give one [lo, hi] for all")
        pairs = {str(k): v for k, v in value.items() if v is not None}
    else:
        pairs = dict.fromkeys(labels, value)
    bounds = {}
    for label, pair in pairs.items():
        ok = (isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) == 2
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x) for x in pair))
        if not ok or pair[0] > pair[1]:
            raise ConfigError(f"{where}: label {label} needs [lo, hi] with numbers lo <= hi (binary: [0, 1]); "
                              "set it so, or null to check only finiteness")
        bounds[label] = (float(pair[0]), float(pair[1]))
    return bounds
