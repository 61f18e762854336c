"""Where tensors live: the `device` config value checked, and host <-> device copies.

`device=cuda` needs torch's CUDA build with a GPU it can see, and fbgemm-gpu's CUDA build (the
`make setup-gpu` venv, .venv-gpu); `check_device` says which of them is missing before any data
is read or process started. The copies are what every worker-side path uses to move a tensor:

    to_device(t, device)   host -> device through pinned host memory, non-blocking (the kernels
                           that read the copy queue behind it on the same stream); t itself when
                           it is there already
    to_host(t)             device -> host through pinned memory, waited for (the caller reads it,
                           or sends it); t itself on the host

On `device=cpu` both return their argument unchanged: the CPU path runs the same lines, with
the same tensors, as before they existed.

>>> t = torch.arange(3)
>>> to_device(t, torch.device("cpu")) is t, to_host(t) is t
(True, True)
>>> check_device("tpu")
Traceback (most recent call last):
...
recps.errors.ConfigError: device='tpu': use cpu or cuda (cuda:N for one GPU)
"""

from __future__ import annotations

import re
from importlib import metadata

import torch

from recps.errors import ConfigError

__all__ = ["check_device", "cuda_unavailable_reason", "same_device", "to_device", "to_host"]

_FIX = ("run `make setup-gpu` and train with .venv-gpu/bin/python (torch's CUDA build with fbgemm-gpu's), "
        "or set device=cpu")


def cuda_unavailable_reason() -> str | None:
    """Why this process cannot train on CUDA (None: it can): no CUDA build of torch, no GPU that
    torch sees, or fbgemm-gpu's CPU build (fbgemm-gpu-cpu has no CUDA kernels)."""
    if torch.version.cuda is None:
        return (f"torch.cuda.is_available() is False on this machine: the installed torch {torch.__version__} "
                "is the CPU build")
    if _gpus() == 0:
        return (f"torch.cuda.is_available() is False on this machine: torch {torch.__version__} (CUDA "
                f"{torch.version.cuda}) sees no GPU (check the driver, nvidia-smi and CUDA_VISIBLE_DEVICES)")
    try:
        metadata.distribution("fbgemm-gpu-cpu")
    except metadata.PackageNotFoundError:
        return None
    return ("fbgemm-gpu-cpu is installed in this environment: FBGEMM's CPU build, without the CUDA embedding "
            "kernels (the CUDA stack is fbgemm-gpu, in .venv-gpu)")


def check_device(device, where: str = "device") -> torch.device:
    """`device` ("cpu", "cuda", "cuda:N") as a torch.device this process can compute on, else a
    ConfigError naming the value, why and the fix. "cuda" stays without an index (the current GPU;
    `same_device` matches it with every cuda:N). Initialises no CUDA driver (`_gpus`)."""
    name = str(device)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise ConfigError(f"{where}={name!r}: use cpu or cuda (cuda:N for one GPU)")
    if name == "cpu":
        return torch.device("cpu")
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise ConfigError(f"{where}={name!r}: {reason}; {_FIX}")
    index, count = name.partition(":")[2], _gpus()
    if index and int(index) >= count:
        raise ConfigError(f"{where}={name!r}: this machine has {count} GPU(s) that torch sees (cuda:0 .. "
                          f"cuda:{count - 1}); pick one of them or set CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", int(index)) if index else torch.device("cuda")


def _gpus() -> int:
    """The GPUs torch sees, by NVML where it can: no CUDA driver is initialised in this process,
    which a launcher may fork its cluster's processes from (recps.launch; a child forked after a
    cuInit cannot use CUDA). torch.cuda.is_available() would initialise it (cudaGetDeviceCount)."""
    return torch.cuda.device_count()


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether a tensor on `a` is on `b` ("cuda" without an index matches every GPU's)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`: itself when it is there; from the host to a GPU through pinned memory,
    non-blocking (torch's caching host allocator keeps the pinned block until the copy is done)."""
    if same_device(t.device, device):
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        staged = t if t.is_pinned() else t.pin_memory()
        return staged.to(device, non_blocking=True)
    return t.to(device)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host, ready to read: itself when it is there; from a GPU through pinned memory,
    after its copy finished (the caller sends it or reads it next)."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    done.synchronize()  # bounded: it waits for kernels already queued, never for another process
    return out
