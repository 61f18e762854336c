"""What a stream job trains, in which order: days, passes of splits, and what each pass saves.

A day of `hours` hours (24 by default) holds 60 * hours / split_interval splits; a pass is
`split_per_pass` consecutive splits (Paddle's get_online_pass_interval). Paddle drops the
splits a day has past its last whole pass; here they form a shorter last pass, and the plan
says so once (a warning). Passes are numbered from 1 within each day, as Paddle's pass_id.

What a pass saves (`StreamPlan.saves`): a checkpoint (Paddle's save mode 0) every
`checkpoint_per_pass` passes, and always on a pass that publishes a delta (mode 1, every
`save_delta_frequency` passes) and on the day's last pass: the committed checkpoint is where a
restarted job resumes, so a published delta or day end is never redone from an earlier state
(exactly once, recps.stream.donefile).

>>> plan = StreamPlan(StreamConfig(root="r", out="o", start_day="20261201", end_day="20261201",
...                                 hours=2, split_interval=30, split_per_pass=3))
>>> [(p.index, p.minutes) for p in plan.passes_of_day("20261201")]
[(1, (0, 30, 60)), (2, (90,))]
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, fields
from typing import Any, Mapping

from recps.data.partitions import DEFAULT_DONEFILE, LAYOUTS, first_day, split_path
from recps.errors import ConfigError

__all__ = ["StreamConfig", "StreamPlan", "Pass", "next_day", "parse_day", "with_start_day"]

log = logging.getLogger("recps.stream")


def parse_day(value: Any, where: str) -> str:
    """A YYYYMMDD day (a str, or an int as YAML reads 20261201), checked against the calendar."""
    day = str(value)
    try:
        dt.datetime.strptime(day, "%Y%m%d")
    except ValueError:
        raise ConfigError(f"{where}={value!r} is not a day; write YYYYMMDD, e.g. 20261201") from None
    if len(day) != 8:
        raise ConfigError(f"{where}={value!r} is not a day; write YYYYMMDD, e.g. 20261201")
    return day


def next_day(day: str) -> str:
    return (dt.datetime.strptime(day, "%Y%m%d") + dt.timedelta(days=1)).strftime("%Y%m%d")


@dataclass(frozen=True)
class StreamConfig:
    """conf/stream/hourly.yaml's keys (see there for what each one means)."""

    root: str
    out: str
    start_day: str | None = None
    end_day: str | None = None
    follow: bool = False
    hours: int = 24
    split_interval: int = 60
    split_per_pass: int = 1
    layout: str = "hhmm"
    data_donefile: str = DEFAULT_DONEFILE
    data_sleep_second: float = 10.0
    wait_timeout_s: float = 3600.0
    checkpoint_per_pass: int = 1
    save_delta_frequency: int = 1
    shrink: bool = True
    eval_before_train: bool = True

    def __post_init__(self) -> None:
        def whole(name: str, low: int, high: int | None = None) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
                bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise ConfigError(f"stream.{name}={value!r}; it must be a whole number {bound}")

        for name in ("root", "out"):
            if not str(getattr(self, name) or "").strip() or str(getattr(self, name)) == "???":
                raise ConfigError(f"stream.{name} is not set; give a path or fsspec URL, e.g. "
                                  f"stream.{name}=hdfs://namenode:9000/{'clicks' if name == 'root' else 'model'}")
        whole("hours", 1, 24)
        whole("split_interval", 1, 1440)
        whole("split_per_pass", 1)
        whole("checkpoint_per_pass", 1)
        whole("save_delta_frequency", 0)
        if 60 * self.hours % self.split_interval:
            raise ConfigError(f"stream.split_interval={self.split_interval} does not divide the day's "
                              f"{60 * self.hours} minutes (stream.hours={self.hours}); pick a divisor, e.g. 60 or 30")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"stream.layout={self.layout!r}; use one of {LAYOUTS}")
        if self.layout != "hhmm" and self.split_interval % 60:
            raise ConfigError(f"stream.layout={self.layout} holds hourly splits, stream.split_interval="
                              f"{self.split_interval}; use layout=hhmm for shorter splits")
        for name in ("data_sleep_second", "wait_timeout_s"):
            if not float(getattr(self, name)) > 0:
                raise ConfigError(f"stream.{name}={getattr(self, name)!r}; it must be > 0 seconds")
        if not str(self.data_donefile).strip() or "/" in str(self.data_donefile):
            raise ConfigError(f"stream.data_donefile={self.data_donefile!r}; give a file name, e.g. _SUCCESS")
        for name in ("start_day", "end_day"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, parse_day(getattr(self, name), f"stream.{name}"))
        if self.start_day is None:  # (recps.train fills it from the stream first: with_start_day)
            raise ConfigError("stream.start_day is not set; give the first day to train, YYYYMMDD "
                              "(e.g. stream.start_day=20261201)")
        if self.end_day is None and not self.follow:
            raise ConfigError("stream.end_day is not set and stream.follow=false; give the last day (YYYYMMDD) "
                              "or stream.follow=true to wait for new days")
        if self.end_day is not None and self.end_day < self.start_day:
            raise ConfigError(f"stream.end_day={self.end_day} is before stream.start_day={self.start_day}")

    @classmethod
    def from_config(cls, node: Mapping[str, Any]) -> "StreamConfig":
        """From cfg.stream (its `enabled` key aside); an unknown key is a ConfigError naming it."""
        values = {k: v for k, v in dict(node).items() if k != "enabled"}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"stream: unknown key(s) {unknown}; the stream's keys are {sorted(known)}")
        return cls(**values)


def with_start_day(values: Mapping[str, Any]) -> dict[str, Any]:
    """conf `stream:`'s values, a null `start_day` taken from the stream itself
    (recps.data.partitions.first_day: the start_day of `<root>/_stream.json`, else its first day folder)
    and the choice logged. The root is read in a child forked for it (recps.cluster.launch.run_in_fork: an
    HDFS client's threads end with it, and the launcher can still fork its processes)."""
    values = dict(values)
    root = values.get("root")
    if values.get("start_day") is not None or not str(root or "").strip() or str(root) == "???":
        return values  # given, or no root to look in (StreamConfig names what is missing)
    from recps.cluster.launch import run_in_fork  # deferred: the launcher's module, only when the day is looked for

    layout = str(values.get("layout") or "hhmm")
    day, source = run_in_fork(lambda: first_day(str(root), layout), "looking for the stream's first day")
    log.info("stream.start_day not set: %s, from %s (stream.start_day=YYYYMMDD starts elsewhere)", day, source)
    values["start_day"] = day
    return values


@dataclass(frozen=True)
class Pass:
    """Pass `index` (1-based) of `day`: its splits' start minutes; `last`: the day's last pass."""

    day: str
    index: int
    minutes: tuple[int, ...]
    last: bool

    @property
    def name(self) -> str:
        return f"{self.day}/{self.index}"


class StreamPlan:
    """The passes of a StreamConfig and the saves each one makes."""

    def __init__(self, config: StreamConfig) -> None:
        self.config = config
        c = config
        splits = 60 * c.hours // c.split_interval
        self.passes_per_day = -(-splits // c.split_per_pass)
        rest = splits % c.split_per_pass
        if rest:
            log.warning("stream: a day holds %d splits of %d min, not a multiple of split_per_pass=%d; its last pass "
                        "takes the %d left (Paddle drops them)", splits, c.split_interval, c.split_per_pass, rest)
        self._splits = splits

    def passes_of_day(self, day: str) -> list[Pass]:
        c = self.config
        starts = [m * c.split_interval for m in range(self._splits)]
        groups = [tuple(starts[i:i + c.split_per_pass]) for i in range(0, len(starts), c.split_per_pass)]
        return [Pass(day, i + 1, g, i + 1 == len(groups)) for i, g in enumerate(groups)]

    def split_folders(self, p: Pass) -> list[str]:
        return [split_path(self.config.root, p.day, m, self.config.layout) for m in p.minutes]

    def days(self, first: str):
        """Days from `first` to end_day (inclusive), or on without end with follow."""
        day = first
        while self.config.end_day is None or day <= self.config.end_day:
            yield day
            day = next_day(day)

    def saves(self, p: Pass) -> tuple[bool, bool]:
        """(checkpoint, delta) after pass `p`."""
        c = self.config
        delta = bool(c.save_delta_frequency) and p.index % c.save_delta_frequency == 0
        return delta or p.last or p.index % c.checkpoint_per_pass == 0, delta
