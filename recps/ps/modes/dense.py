"""Dense parameters through the parameter server: the flat vector, the servers' rule, the updater.

Dense parameters live on the PS too (one dense table, the parameters concatenated in order).
The trainer's threads share one copy of them (recps.job.loop); what a step does with their
gradients is the mode's:

    sync   PSDenseUpdater: push (N,) grads; step_end waits for the step's update on the servers,
           then the shared params are refreshed from one pull (once per step, not per thread)
    async  PSDenseUpdater: push (merged and sent in the background); step_end copies the latest
           values the communicator received into the shared params (no network wait)
    geo    GeoDenseUpdater (recps.ps.modes.geo): the trainer's local torch optimizer steps the
           shared params; every k steps the communicator sends their deltas

Shapes: N the flat size of the dense table.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import nn

from recps.device import to_device, to_host
from recps.errors import ConfigError, PSError
from recps.ps.modes.abilities import NumbersSteps

__all__ = ["flatten", "assign_flat", "torch_optimizer_rule", "load_optimizer_state", "LocalDenseUpdater", "PSDenseUpdater"]


def flatten(tensors: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensors (None: zeros shaped as `like`) -> one (N,) float32 vector."""
    return torch.cat([(t if t is not None else torch.zeros_like(p)).detach().reshape(-1).to(torch.float32)
                      for t, p in zip(tensors, like)])


def assign_flat(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy (N,) values into `params` in order (in place: the threads' replicas alias them); values
    from the servers go up to the params' device in one copy (the CPU: no copy)."""
    if params:
        flat = to_device(flat, params[0].device)
    pos = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[pos:pos + n].view_as(p))
            pos += n
    if pos != flat.numel():
        raise PSError(f"dense table holds {flat.numel()} values, the model's dense parameters {pos}; "
                      "the servers hold another model's table (a stale checkpoint?)")


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> list[str]:
    """`optimizer.load_state_dict(state)` keeping its own hyperparameters (lr, betas, weight decay ...):
    a resume takes the saved moments and step counts, and the config's settings, as the servers' tables
    do (torch's load would bring back the saved ones). Returns what the checkpoint had otherwise, e.g.
    ["lr 0.01 -> 0.001"].

    >>> p = nn.Parameter(torch.zeros(1))
    >>> saved = torch.optim.Adam([p], lr=0.01).state_dict()
    >>> load_optimizer_state(torch.optim.Adam([p], lr=0.001), saved)
    ['lr 0.01 -> 0.001']
    """
    configured = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    changed = []
    for group, own in zip(optimizer.param_groups, configured):
        for key, value in own.items():
            saved = group.get(key)
            same = torch.equal(torch.as_tensor(saved), torch.as_tensor(value)) if isinstance(
                saved, torch.Tensor) or isinstance(value, torch.Tensor) else saved == value
            if not same:
                changed.append(f"{key} {saved!r} -> {value!r}")
            group[key] = value
    return changed


def torch_optimizer_rule(optimizer: torch.optim.Optimizer) -> dict:
    """The server-side update rule equal to `optimizer`'s step (SGD, Adam, Adagrad; one param group).

    >>> torch_optimizer_rule(torch.optim.Adam([nn.Parameter(torch.zeros(1))], lr=0.002))["name"]
    'adam'
    """
    if len(optimizer.param_groups) != 1:
        raise ConfigError(f"{type(optimizer).__name__} has {len(optimizer.param_groups)} param groups; "
                          "a PS dense table has one update rule: use one group")
    g = optimizer.param_groups[0]
    l2 = float(g.get("weight_decay", 0.0))
    if isinstance(optimizer, torch.optim.SGD):
        if g.get("momentum", 0.0) or g.get("nesterov"):
            raise ConfigError("torch.optim.SGD with momentum has no server-side rule; use momentum=0, Adam or Adagrad")
        return {"name": "sgd", "lr": float(g["lr"]), "l2": l2}
    if isinstance(optimizer, torch.optim.Adam) and not isinstance(optimizer, torch.optim.AdamW):
        if g.get("amsgrad"):
            raise ConfigError("torch.optim.Adam(amsgrad=True) has no server-side rule; use amsgrad=False")
        b1, b2 = g["betas"]
        return {"name": "adam", "lr": float(g["lr"]), "l2": l2, "beta1": float(b1), "beta2": float(b2),
                "eps": float(g["eps"])}
    if isinstance(optimizer, torch.optim.Adagrad):
        if g.get("lr_decay", 0.0):
            raise ConfigError("torch.optim.Adagrad(lr_decay != 0) has no server-side rule; use lr_decay=0")
        return {"name": "adagrad", "lr": float(g["lr"]), "l2": l2, "eps": float(g["eps"]),
                "initial_accumulator_value": float(g.get("initial_accumulator_value", 0.0))}
    raise ConfigError(f"{type(optimizer).__name__} has no server-side update rule; use torch.optim.SGD, Adam or "
                      "Adagrad for the dense parameters (or ps=geo, which steps any optimizer locally)")


class LocalDenseUpdater:
    """A torch optimizer over the shared dense parameters, stepped under a lock (ps=local; GEO's
    dense replica, recps.ps.modes.geo.GeoDenseUpdater)."""

    def __init__(self, params: Sequence[nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        self._lock = threading.Lock()

    def apply(self, grads: Sequence[torch.Tensor | None]) -> None:
        with self._lock:
            for param, grad in zip(self.params, grads):
                param.grad = grad
            self.optimizer.step()
            for param in self.params:
                param.grad = None

    def step_end(self, thread: int) -> None:
        """Nothing to do locally."""


class PSDenseUpdater:
    """sync / async: the servers own the dense update; see the module docstring.

    Args:
        params: the shared dense parameters, in the dense table's order.
        communicator: a sync or async Communicator.
        table: the dense table's name.
    """

    def __init__(self, params: Sequence[nn.Parameter], communicator, table: str) -> None:
        self.params = list(params)
        self.communicator = communicator
        self.table = table
        self._lock = threading.Lock()
        self._seen = None  # what was copied last: the sync step, or the async values object

    def apply(self, grads: Sequence[torch.Tensor | None]) -> None:
        self.communicator.push_dense(self.table, to_host(flatten(grads, self.params)))  # (N,) on the host

    def step_end(self, thread: int) -> None:
        self.communicator.step_end(thread)
        self.refresh()

    def refresh(self) -> None:
        """Copy the servers' latest values into the shared params (once per sync step / new values)."""
        step = self.communicator.step if self.communicator.mode == "sync" and isinstance(self.communicator, NumbersSteps) \
            else None
        with self._lock:
            if step is not None:
                if step == self._seen:
                    return  # another thread of this worker refreshed after this step
                values = self.communicator.pull_dense(self.table)
                self._seen = step
            else:
                values = self.communicator.pull_dense(self.table)  # async: the latest copy, no wait
                if values is self._seen:
                    return
                self._seen = values
            assign_flat(self.params, values)
