"""Time-partitioned data (a stream): where a split's files live and when it is ready.

A stream root (any fsspec URL, recps.fs) holds one folder per split of `split_interval` minutes:

    <root>/<YYYYMMDD>/<HHMM>/part-00000 ...      layout "hhmm" (Paddle's online trainer, minutes)
    <root>/<YYYYMMDD>/<HH>/part-00000 ...        layout "hh"   (hourly splits only)
    <root>/day=<YYYYMMDD>/hour=<HH>/...          layout "hive" (hourly splits only)

A split is ready when its data donefile (default `_SUCCESS`, written last by the producer) exists.
"""

from __future__ import annotations

from recps import fs as rfs
from recps.errors import ConfigError

__all__ = ["LAYOUTS", "DEFAULT_DONEFILE", "split_path"]

LAYOUTS = ("hhmm", "hh", "hive")
DEFAULT_DONEFILE = "_SUCCESS"


def split_path(root: str, day: str, minute: int, layout: str = "hhmm") -> str:
    """The folder of the split of `day` (YYYYMMDD) starting `minute` minutes after midnight."""
    if layout not in LAYOUTS:
        raise ConfigError(f"stream layout={layout!r}; use one of {LAYOUTS}")
    if not (len(day) == 8 and day.isdigit()):
        raise ConfigError(f"stream day={day!r}; days are YYYYMMDD (e.g. 20261201)")
    if not 0 <= minute < 24 * 60:
        raise ConfigError(f"stream split at minute {minute} of day {day}; it must be in [0, 1440)")
    hour, rest = divmod(minute, 60)
    if layout == "hhmm":
        return rfs.join(root, day, f"{hour:02d}{rest:02d}")
    if rest:
        raise ConfigError(f"stream layout={layout!r} holds hourly splits, but a split starts at minute {minute} "
                          f"of day {day}; use layout=hhmm for splits shorter than an hour")
    if layout == "hh":
        return rfs.join(root, day, f"{hour:02d}")
    return rfs.join(root, f"day={day}", f"hour={hour:02d}")
