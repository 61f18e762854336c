"""Server-side update rules, applied in place to a batch of gathered rows.

A rule sees R rows at a time: weights w (R, D) float32, their summed gradients g (R, D)
float32 (duplicate keys already merged by the table) and the rows' optimizer state
(R, S) float32, S = `state_width(D)`. It updates w and state in place. Every rule equals the
matching torch.optim step applied to the same rows with the same gradient (tested to 1e-6):

    SGDRule            torch.optim.SGD(lr, weight_decay=l2)                       S = 0
    AdagradRule        torch.optim.Adagrad(lr, eps=eps, weight_decay=l2,
                                           initial_accumulator_value=...)           S = D
    RowWiseAdagradRule FBGEMM EXACT_ROWWISE_ADAGRAD (L2 weight decay mode):         S = 1
                       g += l2 * w;  s += mean(g**2 over the row);  w -= lr * g / (sqrt(s) + eps)
    AdamRule           torch.optim.Adam(lr, betas, eps, weight_decay=l2), with one   S = 2D + 1
                       step count per row (a row not pushed this step keeps its count)

`bounds=(lo, hi)` clamps weights after each update (Paddle's weight_bounds).

>>> rule = SGDRule(lr=0.5)
>>> w, g = torch.ones(2, 3), torch.ones(2, 3)
>>> rule.apply(w, g, rule.init_state(2, 3))
>>> w[0].tolist()
[0.5, 0.5, 0.5]
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch.optim.adam import adam as _adam  # the functional step torch.optim.Adam runs

from recps.errors import ConfigError

__all__ = ["UpdateRule", "SGDRule", "AdagradRule", "RowWiseAdagradRule", "AdamRule", "make_rule", "RULES"]


@dataclass(frozen=True)
class UpdateRule:
    """Base of the update rules: learning rate, L2 (added to the gradient, as torch's
    weight_decay) and optional weight bounds."""

    lr: float = 0.01
    l2: float = 0.0
    bounds: tuple[float, float] | None = None

    name = "base"
    # True when every element is updated on its own (no row statistic): a dense table then
    # hands a whole parameter over as one row (1, numel), the fastest layout for the kernels.
    per_element = False

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"{type(self).__name__}: lr={self.lr}; it must be a finite number > 0")
        if not self.l2 >= 0:
            raise ConfigError(f"{type(self).__name__}: l2={self.l2}; it must be >= 0")
        if self.bounds is not None:
            lo, hi = self.bounds
            if not lo < hi:
                raise ConfigError(f"{type(self).__name__}: bounds={self.bounds}; need low < high")
            object.__setattr__(self, "bounds", (float(lo), float(hi)))

    def state_width(self, dim: int) -> int:
        """Number of float32 state columns per row of width `dim`."""
        return 0

    def initial_state_value(self) -> float:
        """Every state column of a fresh row starts at this value."""
        return 0.0

    def init_state(self, rows: int, dim: int) -> torch.Tensor:
        """(rows, S) float32 state of fresh rows."""
        return torch.full((rows, self.state_width(dim)), self.initial_state_value(), dtype=torch.float32)

    def apply(self, w: torch.Tensor, g: torch.Tensor, state: torch.Tensor) -> None:
        """Update w (R, D) and state (R, S) in place with gradients g (R, D)."""
        raise NotImplementedError

    def apply_many(self, ws: list[torch.Tensor], gs: list[torch.Tensor], states: list[torch.Tensor]) -> None:
        """`apply` to several (w, g, state) triples (a dense table's parameters) in one call."""
        for w, g, state in zip(ws, gs, states):
            self.apply(w, g, state)

    def config(self) -> dict:
        """Plain-data description, written into checkpoint manifests."""
        out = asdict(self)
        out["name"] = self.name
        if self.bounds is not None:
            out["bounds"] = list(self.bounds)
        return out

    def _decayed(self, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return g.add(w, alpha=self.l2) if self.l2 != 0 else g

    def _clamp(self, w: torch.Tensor) -> None:
        if self.bounds is not None:
            w.clamp_(self.bounds[0], self.bounds[1])


@dataclass(frozen=True)
class SGDRule(UpdateRule):
    """w -= lr * (g + l2 * w)."""

    name = "sgd"
    per_element = True

    def apply(self, w: torch.Tensor, g: torch.Tensor, state: torch.Tensor) -> None:
        w.add_(self._decayed(w, g), alpha=-self.lr)
        self._clamp(w)


@dataclass(frozen=True)
class AdagradRule(UpdateRule):
    """Per-element Adagrad, as torch.optim.Adagrad with lr_decay=0."""

    eps: float = 1e-10
    initial_accumulator_value: float = 0.0

    name = "adagrad"
    per_element = True

    def state_width(self, dim: int) -> int:
        return dim

    def initial_state_value(self) -> float:
        return self.initial_accumulator_value

    def apply(self, w: torch.Tensor, g: torch.Tensor, state: torch.Tensor) -> None:
        g = self._decayed(w, g)  # (R, D)
        # `state` is usually a column slice of the gathered rows; elementwise kernels on a
        # strided view run ~10x slower than on a contiguous copy, so work on one.
        acc = state.contiguous().addcmul_(g, g)  # (R, D) sum of squares; may alias `state`
        if acc.data_ptr() != state.data_ptr():
            state.copy_(acc)
        w.addcdiv_(g, acc.sqrt().add_(self.eps), value=-self.lr)
        self._clamp(w)


@dataclass(frozen=True)
class RowWiseAdagradRule(UpdateRule):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator per row, the mean squared gradient."""

    eps: float = 1e-8
    initial_accumulator_value: float = 0.0

    name = "rowwise_adagrad"

    def state_width(self, dim: int) -> int:
        return 1

    def initial_state_value(self) -> float:
        return self.initial_accumulator_value

    def apply(self, w: torch.Tensor, g: torch.Tensor, state: torch.Tensor) -> None:
        g = self._decayed(w, g)  # (R, D)
        state.add_(g.square().mean(dim=1, keepdim=True))  # (R, 1)
        multiplier = torch.reciprocal(state.sqrt().add_(self.eps)).mul_(self.lr)  # (R, 1)
        w.addcmul_(g, multiplier, value=-1.0)
        self._clamp(w)


@dataclass(frozen=True)
class AdamRule(UpdateRule):
    """torch.optim.Adam (L2 in the gradient, no amsgrad) with a per-row step count.

    State columns: [exp_avg (D) | exp_avg_sq (D) | step (1)].
    """

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    name = "adam"
    per_element = True  # the step count is per row, but a dense parameter is always pushed whole

    def __post_init__(self) -> None:
        super().__post_init__()
        for b in ("beta1", "beta2"):
            if not 0 <= getattr(self, b) < 1:
                raise ConfigError(f"AdamRule: {b}={getattr(self, b)}; it must be in [0, 1)")

    def state_width(self, dim: int) -> int:
        return 2 * dim + 1

    def apply(self, w: torch.Tensor, g: torch.Tensor, state: torch.Tensor) -> None:
        if w.shape[0] == 1:
            self.apply_many([w], [g], [state])
            return
        d = w.shape[1]
        exp_avg, exp_avg_sq, step = state[:, :d], state[:, d : 2 * d], state[:, 2 * d :]  # (R,D) (R,D) (R,1)
        g = self._decayed(w, g)  # (R, D)
        step.add_(1.0)
        exp_avg.lerp_(g, 1.0 - self.beta1)
        exp_avg_sq.mul_(self.beta2).addcmul_(g, g, value=1.0 - self.beta2)
        # Bias corrections in float64, as torch computes them from a Python float step.
        t = step.to(torch.float64)  # (R, 1)
        step_size = (self.lr / (1.0 - torch.pow(self.beta1, t))).to(torch.float32)  # (R, 1)
        bc2_sqrt = torch.sqrt(1.0 - torch.pow(self.beta2, t)).to(torch.float32)  # (R, 1)
        denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(self.eps)  # (R, D)
        w.addcdiv_(exp_avg * step_size, denom, value=-1.0)
        self._clamp(w)

    def apply_many(self, ws: list[torch.Tensor], gs: list[torch.Tensor], states: list[torch.Tensor]) -> None:
        if any(w.shape[0] != 1 for w in ws):
            super().apply_many(ws, gs, states)
            return
        # One row each (a dense table's parameters, see `per_element`): the moments are
        # contiguous slices of the state, and torch's fused Adam kernel steps every parameter
        # in one call and one pass (~20x faster than the per-row path on CTR-DNN's 300k-value tower).
        d = [w.shape[1] for w in ws]
        _adam(ws, [g.contiguous() for g in gs], [s[:, :n] for s, n in zip(states, d)],
              [s[:, n : 2 * n] for s, n in zip(states, d)], [], [s[:, 2 * n :] for s, n in zip(states, d)],
              fused=True, amsgrad=False, beta1=self.beta1, beta2=self.beta2, lr=self.lr, weight_decay=self.l2,
              eps=self.eps, maximize=False)
        for w in ws:
            self._clamp(w)


RULES: dict[str, type[UpdateRule]] = {
    "sgd": SGDRule,
    "adagrad": AdagradRule,
    "rowwise_adagrad": RowWiseAdagradRule,
    "adam": AdamRule,
}


def make_rule(name: str, **kwargs) -> UpdateRule:
    """Rule by config name (sgd, adagrad, rowwise_adagrad, adam) and its keyword arguments.

    >>> make_rule("adagrad", lr=0.1).state_width(8)
    8
    """
    if name not in RULES:
        raise ConfigError(f"optimizer {name!r} is unknown; use one of {sorted(RULES)}")
    if "bounds" in kwargs and kwargs["bounds"] is not None:
        kwargs["bounds"] = tuple(kwargs["bounds"])
    return RULES[name](**kwargs)

