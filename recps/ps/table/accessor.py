"""CTR accessor (row statistics, score, shrink rule) and admission entries.

Modelled on Paddle's CtrCommonAccessor. Each row of a table with an accessor carries
show and click counts (summed from pushes), unseen days (whole days, i.e. `shrink()` calls,
since the row was last pushed) and a delta score (score gained since the last serving
export, used by delta saves). The row's score is

    score = nonclk_coeff * (show - click) + click_coeff * click

`SparseTable.shrink()` ends a day: it multiplies show and click by
`show_click_decay_rate`, deletes rows whose decayed score < `delete_threshold` or whose
unseen days > `delete_after_unseen_days`, then adds one unseen day to the survivors.

Entries decide when a new key gets a row (until then pull returns zeros and pushes for
the key are dropped):
- `CountFilterEntry(n)`: after n sightings (occurrences in pull requests);
- `ProbabilityEntry(p)`: each sighting admits the key with probability p.

>>> round(CtrAccessor(nonclk_coeff=0.1, click_coeff=1.0).score(torch.tensor([10.0]), torch.tensor([2.0])).item(), 5)
2.8
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from recps.errors import ConfigError

__all__ = ["CtrAccessor", "CountFilterEntry", "ProbabilityEntry", "Entry", "META_COLUMNS", "meta_columns"]

# Float32 statistics columns stored with every row when the table has an accessor.
META_COLUMNS = ("show", "click", "unseen_days", "delta_score", "dirty")


def meta_columns(has_accessor: bool) -> tuple[str, ...]:
    """Statistics columns of a row: all of META_COLUMNS with an accessor, only `dirty` without."""
    return META_COLUMNS if has_accessor else ("dirty",)


@dataclass(frozen=True)
class CtrAccessor:
    """Show/click statistics, score, decay and deletion thresholds of a sparse table."""

    nonclk_coeff: float = 0.1
    click_coeff: float = 1.0
    show_click_decay_rate: float = 0.98
    delete_threshold: float = 0.8
    delete_after_unseen_days: float = 30.0
    base_threshold: float = 1.5
    delta_threshold: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.show_click_decay_rate <= 1.0:
            raise ConfigError(
                f"CtrAccessor: show_click_decay_rate={self.show_click_decay_rate}; it must be in (0, 1]"
            )
        if self.delete_after_unseen_days < 0:
            raise ConfigError(
                f"CtrAccessor: delete_after_unseen_days={self.delete_after_unseen_days}; it must be >= 0"
            )

    def score(self, show: torch.Tensor, click: torch.Tensor) -> torch.Tensor:
        """(R,) show, (R,) click -> (R,) score."""
        return (show - click) * self.nonclk_coeff + click * self.click_coeff

    def config(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class CountFilterEntry:
    """Admit a key once it has been seen `count` times in pull requests."""

    count: int = 1

    def __post_init__(self) -> None:
        if int(self.count) != self.count or self.count < 1:
            raise ConfigError(f"CountFilterEntry: count={self.count}; it must be an integer >= 1")

    def config(self) -> dict:
        return {"name": "count_filter", **asdict(self)}


@dataclass(frozen=True)
class ProbabilityEntry:
    """Admit a key at each sighting with probability `probability`."""

    probability: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.probability <= 1.0:
            raise ConfigError(f"ProbabilityEntry: probability={self.probability}; it must be in (0, 1]")

    def config(self) -> dict:
        return {"name": "probability", **asdict(self)}


Entry = CountFilterEntry | ProbabilityEntry
