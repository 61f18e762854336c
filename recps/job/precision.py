"""Mixed precision of the training loop (`trainer.precision`): fp32, bf16 (CPU and CUDA), fp16 (CUDA).

`Precision` runs the forward pass under torch.autocast in bf16 or fp16 (with a dynamic loss scale,
`LossScaler`). Autocast lowers the dense part (linear layers, matmuls); the parameters, their
gradients and optimizer state stay fp32, and so do the embedding rows (lookups and pooling are no
autocast ops): the collection and the servers see fp32 values and fp32 gradients whatever the
precision. The task's loss runs in fp32 on the forward's outputs cast back to fp32.
`check_precision` (the config's check, recps.config) is re-exported here.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor

from recps.config import PRECISIONS, check_precision
from recps.errors import ConfigError

__all__ = ["LossScaler", "PRECISIONS", "Precision", "check_precision"]


class LossScaler:
    """The dynamic loss scale of fp16 training, shared by the training threads.

    A step multiplies its loss by `scale` (read once at its start: `scale` may change while it
    runs), divides its gradients by the same value (`unscale`) and reports whether they were all
    finite (`update`). A step with a non-finite gradient is skipped and halves the scale (at most
    once per scale: threads that overflowed at the same scale halve it once); `growth_interval`
    finite steps in a row double it. torch.amp.GradScaler's rule, over gradient lists rather than an
    optimizer (the dense updater and the embedding collection apply them, not this loop).

    >>> s = LossScaler(init_scale=8.0, growth_interval=2)
    >>> s.update(False, 8.0), s.update(False, 8.0), s.update(True, 4.0), s.update(True, 4.0)
    (4.0, 4.0, 4.0, 8.0)
    >>> s.update(False, 4.0)  # a step begun at 4 overflowed: 4 was too large already
    2.0
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 2000, min_scale: float = 1.0) -> None:
        self.scale = float(init_scale)
        self.growth_interval = int(growth_interval)
        self.min_scale = float(min_scale)
        self.skipped = 0  # steps whose gradients were not finite
        self._good = 0
        self._lock = threading.Lock()

    @staticmethod
    def unscale(grads: Sequence[torch.Tensor | None], scale: float) -> bool:
        """Divides each gradient by `scale` in place; whether all are finite."""
        present = [g for g in grads if g is not None]
        if not present:
            return True
        torch._foreach_mul_(present, 1.0 / scale)
        return bool(torch.stack([torch.isfinite(g).all() for g in present]).all())

    def update(self, finite: bool, used: float) -> float:
        """Records a step taken at scale `used`; returns the scale now."""
        with self._lock:
            if not finite:
                self.skipped += 1
                self._good = 0
                self.scale = max(self.min_scale, min(self.scale, used * 0.5))
            elif used == self.scale:
                self._good += 1
                if self._good >= self.growth_interval:
                    self.scale, self._good = self.scale * 2.0, 0
            return self.scale


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`, zeroes it where any of it is
    not finite and records that in `flag` (fp16: what reaches the embedding rows is unscaled)."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, factor: float, flag: list) -> torch.Tensor:
        ctx.factor, ctx.flag = factor, flag
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad * ctx.factor
        if not bool(torch.isfinite(grad).all()):
            ctx.flag.append(True)
            grad = torch.zeros_like(grad)  # the rows' optimizer sees no update from this step
        return grad, None, None


class Precision:
    """How the training threads compute: fp32, or autocast in bf16 / fp16 on `device`'s type.

    `autocast()` is the forward's context; `to_fp32(output)` casts the forward's low-precision
    floating tensors (a tensor, or inside a tuple / list / dict) back to fp32 for the loss and the
    observers. fp16 adds `scaler` (LossScaler) and `unscaled_rows(collection)`: a forward hook that
    divides the gradient reaching the embedding rows by the step's scale (the collection's fused
    optimizer applies it inside backward, where no scaler can reach), dropping a non-finite one.
    fp16 on CPU runs here (torch's CPU autocast, slowly: tests use it); a Trainer given the name
    refuses it (check_precision), as the config does.

    >>> p = Precision("bf16", "cpu")
    >>> with p.autocast():
    ...     y = torch.nn.Linear(4, 2)(torch.ones(3, 4))
    >>> y.dtype, p.to_fp32((y, "x"))[0].dtype
    (torch.bfloat16, torch.float32)
    """

    def __init__(self, name: str = "fp32", device: str = "cpu") -> None:
        check_precision(name, "cuda")  # the value; whether `device` should run it is check_precision's (Trainer)
        self.name = name
        self.device_type = "cuda" if str(device).startswith("cuda") else "cpu"
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
        self.scaler = LossScaler() if name == "fp16" else None
        self._step = threading.local()  # per thread: (scale, flag) of the step in flight

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def to_fp32(self, output):
        if self.dtype is None:
            return output
        if isinstance(output, torch.Tensor):
            return output.float() if output.dtype == self.dtype else output
        if isinstance(output, (tuple, list)) and type(output) in (tuple, list):
            return type(output)(self.to_fp32(o) for o in output)
        if isinstance(output, dict):
            return {k: self.to_fp32(v) for k, v in output.items()}
        return output

    # ---------------------------------------------------------------- fp16: the loss scale per step

    def begin_step(self) -> float:
        """The scale this thread's step uses (1.0 without a scaler)."""
        scale = self.scaler.scale if self.scaler is not None else 1.0
        self._step.scale, self._step.flag = scale, []
        return scale

    def end_step(self, grads: Sequence[torch.Tensor | None]) -> bool:
        """Unscales the dense gradients of the thread's step; whether to apply them (all finite,
        and the rows' gradient was finite)."""
        if self.scaler is None:
            return True
        scale, flag = self._step.scale, self._step.flag
        finite = LossScaler.unscale(grads, scale) and not flag
        self.scaler.update(finite, scale)
        self._step.scale = None
        return finite

    def unscaled_rows(self, collection: nn.Module):
        """fp16: a forward hook on `collection` (its handle: remove() it after the fit); else None."""
        if self.scaler is None:
            return None

        def hook(module, inputs, output):
            scale = getattr(self._step, "scale", None)
            if scale is None or not torch.is_grad_enabled():
                return None  # evaluation, or a forward outside a training step
            return _map_values(output, lambda v: _ScaleGrad.apply(v, 1.0 / scale, self._step.flag))

        return collection.register_forward_hook(hook)


def _map_values(output, fn):
    """`output` of an embedding collection with `fn` applied to its value tensors: a tensor, a
    torchrec KeyedTensor (bag collections) or a dict of JaggedTensors (EmbeddingCollection)."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, KeyedTensor):
        return KeyedTensor(keys=output.keys(), length_per_key=output.length_per_key(), values=fn(output.values()),
                           key_dim=output.key_dim())
    if isinstance(output, dict) and all(isinstance(v, JaggedTensor) for v in output.values()):
        return {k: JaggedTensor(values=fn(v.values()), weights=v.weights_or_none(), lengths=v.lengths())
                for k, v in output.items()}
    raise ConfigError(f"trainer.precision=fp16: the embedding collection returns {type(output).__name__}, whose "
                      "gradients this loop cannot unscale; use trainer.precision=bf16 (no loss scale) or fp32")
