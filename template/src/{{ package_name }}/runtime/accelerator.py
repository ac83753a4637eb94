"""Devices, mixed precision and timing: what the loop, the benchmarks and the commands share.

`resolve_device` maps `--device` to a device (one line when it is absent), `autocast` and
`make_grad_scaler` set up `--precision`, `set_tf32` the fp32 matmul precision, and
`synchronize` waits for queued device work before a timer is read.

This file belongs to the template: `copier update` keeps improving it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = [
    "PRECISIONS",
    "autocast",
    "make_grad_scaler",
    "resolve_device",
    "set_tf32",
    "synchronize",
]


def resolve_device(name: str = "auto") -> torch.device:
    """Map `--device` (auto, cpu, cuda, cuda:N, mps) to a device, failing clearly if absent."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was requested but no CUDA device is visible")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(
            f"--device {name} was requested but {torch.cuda.device_count()} CUDA device(s) "
            f"are visible (cuda:0 to cuda:{torch.cuda.device_count() - 1})"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {name} was requested but MPS is not available")
    available = getattr(getattr(torch, device.type, None), "is_available", None)  # torch.xpu
    if device.type not in ("cpu", "cuda", "mps") and not (available and available()):
        raise ValueError(f"--device {name} was requested but this PyTorch build cannot use it")
    return device


PRECISIONS = ("fp32", "bf16", "fp16")


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def autocast(device: torch.device | str, precision: str) -> contextlib.AbstractContextManager[Any]:
    """Autocast context for `precision`: bf16 (CPU or modern GPUs), fp16, or nothing (fp32).

    Matmuls and convolutions run in the low-precision dtype; reductions and losses stay in
    fp32, which is why autocast is used instead of casting the model with `.half()`.
    """
    _check_precision(precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def make_grad_scaler(
    device: torch.device | str, precision: str, *, init_scale: float = 2.0**16
) -> torch.amp.GradScaler:
    """A GradScaler that is enabled only for fp16, where small gradients would underflow.

    bf16 has fp32's exponent range, so it needs no scaling; a disabled scaler's methods are
    no-ops, so the training loop calls them unconditionally. The default `init_scale` (65536)
    is above fp16's largest value (65504): a loss whose gradient is ~1 per fp16 element
    overflows on the first steps, which the scaler skips while it lowers the scale. Tests that
    need the first step to count pass a small `init_scale`.
    """
    _check_precision(precision)
    return torch.amp.GradScaler(
        torch.device(device).type, init_scale=init_scale, enabled=precision == "fp16"
    )


def set_tf32(enabled: bool) -> None:
    """Let fp32 matmuls and convolutions use TF32 tensor cores on Ampere and newer GPUs.

    TF32 keeps fp32's range with a 10-bit mantissa (about 3 decimal digits) inside the
    multiply; inputs, outputs and accumulation stay fp32. It makes fp32 matmuls several times
    faster on Ampere or newer, and changes nothing on CPUs or older GPUs. PyTorch's own
    defaults are IEEE fp32 for matmuls and TF32 for cuDNN convolutions; this sets both one
    way. Through the legacy API, which (torch 2.9 to 2.13 at least) also sets the new
    `fp32_precision` attributes consistently: writing only the new ones makes
    `torch.get_float32_matmul_precision()` and `cudnn.allow_tf32` raise ("mix of the legacy
    and new APIs"), and inductor's autotuner (`--compile-mode max-autotune*`) reads the first.
    """
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


def synchronize(device: torch.device) -> None:
    """Wait for queued device work: needed before reading a timer, never inside the loop."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    elif device.type == "xpu":
        torch.xpu.synchronize(device)
