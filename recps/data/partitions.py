"""Time-partitioned data (a stream): where a split's files live and when it is ready.

A stream root (any fsspec URL, recps.fs) holds one folder per split of `split_interval` minutes:

    <root>/<YYYYMMDD>/<HHMM>/part-00000 ...      layout "hhmm" (Paddle's online trainer, minutes)
    <root>/<YYYYMMDD>/<HH>/part-00000 ...        layout "hh"   (hourly splits only)
    <root>/day=<YYYYMMDD>/hour=<HH>/...          layout "hive" (hourly splits only)

A split is ready when its data donefile (default `_SUCCESS`, written last by the producer) exists.
Where a stream starts (`first_day`): the `start_day` of its `<root>/_stream.json` (what
recps.data.generators.drifting writes), else its earliest day folder.
"""

from __future__ import annotations

import json
import re

from recps import fs as rfs
from recps.errors import ConfigError

__all__ = ["LAYOUTS", "DEFAULT_DONEFILE", "STREAM_FILE", "split_path", "first_day"]

LAYOUTS = ("hhmm", "hh", "hive")
DEFAULT_DONEFILE = "_SUCCESS"
STREAM_FILE = "_stream.json"  # a stream's description, written by its producer before any split


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


def first_day(root: str, layout: str = "hhmm") -> tuple[str, str]:
    """(the first day of the stream under `root`, YYYYMMDD; what said so): the `start_day` of
    `<root>/_stream.json` when there is one, else the earliest day folder (`<root>/<YYYYMMDD>/`; layout
    hive: `<root>/day=<YYYYMMDD>/`). A ConfigError names the root when neither says, and the file
    when its start_day is not a day."""
    if layout not in LAYOUTS:
        raise ConfigError(f"stream layout={layout!r}; use one of {LAYOUTS}")
    described = rfs.join(root, STREAM_FILE)
    if rfs.exists(described):
        try:
            day = str(json.loads(rfs.read_bytes(described))["start_day"])
        except (ValueError, KeyError, TypeError):
            day = ""
        if not re.fullmatch(r"\d{8}", day):
            raise ConfigError(f"{described} holds no start_day (YYYYMMDD) to start the stream at; "
                              "give stream.start_day=YYYYMMDD")
        return day, described
    fs, path = rfs.resolve(root)
    pattern = re.compile(r"day=(\d{8})" if layout == "hive" else r"(\d{8})")
    days = sorted(m.group(1) for info in (fs.ls(path, detail=True) if fs.exists(path) else [])
                  if info.get("type") == "directory"
                  and (m := pattern.fullmatch(str(info["name"]).rstrip("/").rsplit("/", 1)[-1])))
    if not days:
        folder = "day=YYYYMMDD/" if layout == "hive" else "YYYYMMDD/"
        raise ConfigError(f"stream.start_day is not set and {root} holds neither {STREAM_FILE} nor a day folder "
                          f"({folder}) to start at; give stream.start_day=YYYYMMDD")
    first = days[0]
    return first, rfs.join(root, f"day={first}" if layout == "hive" else first)
