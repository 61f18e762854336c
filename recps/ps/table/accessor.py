"""CTR accessor (row statistics, score, save and shrink rules) and admission entries.

Modelled on Paddle's CtrCommonAccessor. Each row of a table with an accessor carries
show and click counts (summed from pushes), unseen days (batch saves since the row was
last pushed) and a delta score (score gained since the row was last written by a delta or
base save). The row's score is

    score = nonclk_coeff * (show - click) + click_coeff * click

Save modes (`SparseTable.save`; Paddle's numbers in brackets) select rows and, only once
the shard was written, update their statistics (`save_selects` holds the selection):

    full  (0)  every row                                           nothing changes
    delta (1)  score >= base_threshold, delta_score >= delta_threshold,
               unseen_days <= delta_keep_days                      their delta_score = 0
    base  (2)  as delta with delta_threshold = 0                   their delta_score = 0
    batch (3)  every row                                           every row's unseen_days += 1

`SparseTable.shrink()` multiplies show and click by `show_click_decay_rate` and deletes
rows whose decayed score < `delete_threshold` or whose unseen days >
`delete_after_unseen_days`; it does not count days (a batch save does).

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
    """Show/click statistics, score, save filters, decay and deletion thresholds of a sparse
    table (the fields of Paddle's CtrAccessorParameter).

    Args:
        nonclk_coeff, click_coeff: score weights of a show without click and of a click.
        show_click_decay_rate: show and click are multiplied by it at each shrink.
        delete_threshold: shrink deletes rows whose decayed score is below it.
        delete_after_unseen_days: shrink deletes rows unseen for more batch saves than this.
        base_threshold: delta and base saves write rows whose score reaches it.
        delta_threshold: delta saves write rows whose delta_score reaches it.
        delta_keep_days: delta and base saves skip rows unseen for more batch saves than this.
    """

    nonclk_coeff: float = 0.1
    click_coeff: float = 1.0
    show_click_decay_rate: float = 0.98
    delete_threshold: float = 0.8
    delete_after_unseen_days: float = 30.0
    base_threshold: float = 1.5
    delta_threshold: float = 0.0
    delta_keep_days: float = 16.0

    def __post_init__(self) -> None:
        if not 0.0 < self.show_click_decay_rate <= 1.0:
            raise ConfigError(
                f"CtrAccessor: show_click_decay_rate={self.show_click_decay_rate}; it must be in (0, 1]"
            )
        if self.delete_after_unseen_days < 0:
            raise ConfigError(
                f"CtrAccessor: delete_after_unseen_days={self.delete_after_unseen_days}; it must be >= 0"
            )
        if self.delta_keep_days < 0:
            raise ConfigError(f"CtrAccessor: delta_keep_days={self.delta_keep_days}; it must be >= 0")

    def score(self, show: torch.Tensor, click: torch.Tensor) -> torch.Tensor:
        """(R,) show, (R,) click -> (R,) score."""
        return (show - click) * self.nonclk_coeff + click * self.click_coeff

    def save_selects(
        self, mode: str, show: torch.Tensor, click: torch.Tensor, unseen_days: torch.Tensor, delta_score: torch.Tensor
    ) -> torch.Tensor:
        """(R,) statistics of rows -> (R,) bool: the rows a save of `mode` writes (Paddle's
        CtrCommonAccessor::Save). "delta" and "base" filter as in the module docstring;
        "full" and "batch" write every row."""
        if mode not in ("delta", "base"):
            return torch.ones(show.shape, dtype=torch.bool)
        delta_threshold = self.delta_threshold if mode == "delta" else 0.0
        return (
            (self.score(show, click) >= self.base_threshold)
            & (delta_score >= delta_threshold)
            & (unseen_days <= self.delta_keep_days)
        )

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
