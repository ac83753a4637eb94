"""Model FLOPs utilization: FLOPs counted once per model and batch shape, divided by a peak.

Two peaks, both per precision (fp32, tf32, bf16, fp16):

- **measured**: the dense matmul rate this device reaches here, from a short calibration (square
  GEMMs grown until one takes 20 ms, after a warm-up; the best of several, 2 n^3 FLOPs each).
  It exists on every device (CPU, MPS, any GPU, a MIG slice) and is cached per device,
  precision, thread count and torch version in `utils.cache_dir()`, so it costs about a second
  once per machine; `python -m <package>.mfu --refresh` measures it again. A calibration on a
  busy CPU is used but not cached. With a cached peak, each run still times a few matmuls at
  start-up (the probe) and warns when they reach less than half the peak: the machine is busy
  now, and tokens/s and MFU will read low (MFU stays against the cached peak, so runs compare).
- **datasheet**: NVIDIA's dense (no sparsity) tensor-core peak for known GPUs, as a second
  reference: what the hardware could do in principle. Not for MIG slices (a slice has a
  fraction of the GPU's cores) and not for CPUs.

`training_flops` counts forward + backward of one batch with
`torch.utils.flop_counter.FlopCounterMode` on a copy of the model on the meta device: no
memory, no compute, no effect on the real model's weights, buffers or gradients.
"""

from __future__ import annotations

import copy
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import rundir, utils

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
# A start-up probe below this share of the cached peak means a busy machine: warn.
BUSY_PROBE_SHARE = 0.5

# Dense peaks in TFLOP/s from NVIDIA's datasheets (the "with sparsity" figures are twice the
# tensor-core ones), per precision: fp32 = CUDA cores, the others = tensor cores. Matched
# against torch.cuda.get_device_name() in order. Add your device here.
DATASHEET_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H200(?!.*NVL)", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.0, "fp16": 989.0}),
    (r"H100(?!.*(PCIe|NVL))", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.0, "fp16": 989.0}),
    (r"H100.*PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    (r"A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0, "fp16": 362.0}),
    (r"\bL4\b", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    (r"\bA10\b", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
)

_DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def matmul_precision(device: torch.device, precision: str) -> str:
    """The precision the model's matmuls actually run in: fp32 becomes tf32 on CUDA with TF32."""
    if precision == "fp32" and device.type == "cuda" and _tf32_enabled():
        return "tf32"
    return precision


def _tf32_enabled() -> bool:
    backend = torch.backends.cuda.matmul
    setting = getattr(backend, "fp32_precision", None)  # torch >= 2.9
    if isinstance(setting, str) and setting not in ("none", "ieee"):
        return setting == "tf32"
    return bool(backend.allow_tf32)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        with_model = utils.cpu_name()
        return f"{with_model} ({torch.get_num_threads()} threads)"
    return device.type


def datasheet_peak(device: torch.device, precision: str) -> tuple[float | None, str]:
    """(TFLOP/s, device name) from the datasheet table, or (None, why not)."""
    if device.type != "cuda":
        return None, f"no datasheet peak for {device.type}"
    name = torch.cuda.get_device_name(device)
    if "MIG" in name:
        return None, f"{name} is a MIG slice: the datasheet peak is the whole GPU's"
    precision = matmul_precision(device, precision)
    for pattern, peaks in DATASHEET_TFLOPS:
        if re.search(pattern, name):
            return peaks[precision], name
    return None, f"{name} is not in DATASHEET_TFLOPS"


def peak_tflops(device: torch.device, precision: str = "bf16") -> tuple[float | None, str]:
    """The datasheet peak (kept under its old name: `benchmark.peak_tflops`)."""
    return datasheet_peak(device, precision)


def _cache_key(device: torch.device, precision: str) -> str:
    raw = f"{device_name(device)}-{device.index or 0}-{precision}-torch{torch.__version__}"
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", raw).strip("_")


def measured_peak(
    device: torch.device,
    precision: str,
    *,
    max_size: int | None = None,
    repeats: int = 10,
    refresh: bool = False,
    cache: Path | None = None,
    probe: bool = False,
) -> dict[str, Any]:
    """The dense matmul rate of this device in `precision`, measured once and cached.

    Returns {"tflops", "precision", "size", "device_name", "cached"}: square matmuls of
    `size` (doubled from 256 until one product takes 20 ms, at most `max_size`), the best of
    `repeats`. `refresh` measures again. With `probe`, a cached peak is checked by a few
    matmuls now: "probe_tflops", and a "warning" when they reach under BUSY_PROBE_SHARE of it.
    `precision` is the run's; fp32 is calibrated as tf32 where TF32 is on (`matmul_precision`).
    A calibration that fails (an unsupported dtype here) returns {"tflops": None, "reason"}.
    """
    precision = matmul_precision(device, precision)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    folder = cache if cache is not None else utils.cache_dir()
    path = folder / f"peak-{_cache_key(device, precision)}.json"
    if not refresh:
        try:
            found = json.loads(path.read_text())
            if isinstance(found.get("tflops"), float) and found["tflops"] > 0:
                found = {**found, "cached": True}
                return _with_probe(found, device, precision) if probe else found
        except (OSError, ValueError, AttributeError):
            pass  # absent or unreadable: measure again
    if max_size is None:
        max_size = 8192 if device.type == "cuda" else 2048
    try:
        tflops, size = _time_matmul(device, _DTYPES[precision], max_size, repeats)
    except RuntimeError as error:
        return {"tflops": None, "precision": precision, "reason": str(error).splitlines()[0]}
    result = {
        "tflops": tflops,
        "precision": precision,
        "size": size,
        "device_name": device_name(device),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if (
        device.type == "cpu" and _oversubscribed()
    ):  # a CPU shared with other jobs now: use it, do not keep it
        return {**result, "cached": False, "note": "not cached: the machine was busy"}
    try:  # atomically: concurrent runs on one machine share the cache
        folder.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        scratch.write_text(json.dumps(result) + "\n")
        scratch.replace(path)
    except OSError:
        pass  # a read-only home: measure again next time
    return {**result, "cached": False}


def _oversubscribed() -> bool:
    """More runnable processes than 1.5x the CPUs: a CPU calibration now would be low."""
    try:
        return os.getloadavg()[0] > 1.5 * utils.available_cpus()
    except (AttributeError, OSError):
        return False


def _time_matmul(
    device: torch.device, dtype: torch.dtype, max_size: int, repeats: int, start: int = 256
) -> tuple[float, int]:
    """(TFLOP/s, size) of square matmuls: the size doubles from 256 until one product takes
    20 ms or reaches `max_size`, so a slow path (fp16 on a CPU) costs seconds, not minutes."""
    generator = torch.Generator().manual_seed(0)

    def operands(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
        b = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
        return a, b

    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        utils.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        utils.synchronize(device)
        return time.perf_counter() - start

    size = min(start, max_size)
    a, b = operands(size)
    timed(a, b)  # the first call loads kernels and warms the allocator
    while timed(a, b) < 0.02 and size < max_size:
        size = min(2 * size, max_size)
        a, b = operands(size)
        timed(a, b)
    timed(a, b)  # warm-up at the final size (clocks ramp up under load)
    # The best, not the median: other processes only ever slow a product down.
    seconds = min(timed(a, b) for _ in range(repeats))
    return 2 * size**3 / seconds / 1e12, size  # an n x n by n x n product: n^3 multiply-adds


def _with_probe(found: dict[str, Any], device: torch.device, precision: str) -> dict[str, Any]:
    """`found` (a cached peak) with a quick probe at its size, and a warning when the probe
    reaches under BUSY_PROBE_SHARE of it (other processes hold the device now)."""
    size = int(found.get("size") or 1024)
    try:
        tflops, _ = _time_matmul(device, _DTYPES[precision], size, repeats=3, start=size)
    except RuntimeError:
        return found
    found = {**found, "probe_tflops": tflops}
    if tflops < BUSY_PROBE_SHARE * found["tflops"]:
        found["warning"] = (
            f"the start-up matmul probe reached {tflops:.3g} TFLOP/s, "
            f"{tflops / found['tflops']:.0%} of this machine's cached peak "
            f"{found['tflops']:.3g}: the {device.type} is busy, so throughput and MFU "
            "(against the cached peak) will read low"
        )
    return found


def training_flops(
    model: nn.Module,
    input_shape: tuple[int, ...],
    num_classes: int,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
) -> int:
    """FLOPs of one forward + backward on a batch of `input_shape` (the optimizer is not
    counted, as in MFU), on a meta-device copy of `model`: free, and the real model is not
    touched."""
    from torch.utils.flop_counter import FlopCounterMode

    meta = _meta_copy(model)
    meta.train()
    inputs = torch.empty(input_shape, device="meta")
    targets = torch.zeros(input_shape[0], dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        loss(meta(inputs), targets % max(num_classes, 1)).backward()
    return counter.get_total_flops()


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy whose parameters and buffers live on the meta device (no data copied)."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        memo[id(tensor)] = tensor.to("meta")
        if isinstance(tensor, nn.Parameter):
            memo[id(tensor)] = nn.Parameter(memo[id(tensor)], tensor.requires_grad)
    return copy.deepcopy(model, memo)


def utilization(achieved_tflops: float, peak: float | None) -> float | None:
    return achieved_tflops / peak if peak else None


class Utilization:
    """Achieved TFLOP/s and MFU for each log line of a training run.

    FLOPs are counted once, from the shape of one training sample; the peaks are measured (or
    read from the cache) once. `record(samples_per_s)` then costs two divisions. Anything
    that cannot be counted (a model FlopCounterMode cannot trace on the meta device, inputs
    of another shape) turns the columns off with a reason, never the run.
    """

    def __init__(
        self,
        model: nn.Module,
        sample_shape: tuple[int, ...],
        num_classes: int,
        batch_size: int,
        device: torch.device,
        precision: str,
        *,
        enabled: bool = True,
    ):
        self.flops_per_sample: float | None = None
        self.peak: float | None = None
        self.datasheet: float | None = None
        self.reason = ""  # why there is no MFU, when there is none
        self.warning = ""  # the start-up probe read far below the cached peak: a busy device
        if not enabled:
            return
        try:
            shape = (batch_size, *sample_shape)
            self.flops_per_sample = training_flops(model, shape, num_classes) / batch_size
        except Exception as error:  # a user model or dataset this counter cannot trace
            self.reason = f"FLOPs not counted: {type(error).__name__}: {error}".splitlines()[0]
            return
        self._set_peaks(device, precision)

    def _set_peaks(self, device: torch.device, precision: str) -> None:
        found = measured_peak(device, precision, probe=True)
        self.peak, self.warning = found.get("tflops"), found.get("warning", "")
        self.datasheet = datasheet_peak(device, precision)[0]

    @classmethod
    def for_run(
        cls, model: nn.Module, config: Any, info: Any, device: torch.device, enabled: bool
    ) -> Utilization:
        """For `train.py`: the sample shape and classes from the dataset's `DataInfo`."""
        shape = (info.in_channels, info.image_size, info.image_size)
        return cls(
            model,
            shape,
            info.num_classes,
            config.optim.batch_size,
            device,
            config.speed.precision,
            enabled=enabled,
        )

    @classmethod
    def per_sample(
        cls, flops: float | None, device: torch.device, precision: str, *, enabled: bool = True
    ) -> Utilization:
        """For a model that counts its own FLOPs per sample (a language model: per token);
        `flops` None turns the columns off with a reason."""
        self = cls.__new__(cls)
        self.flops_per_sample, self.peak, self.datasheet, self.reason = None, None, None, ""
        self.warning = ""
        if not enabled:
            return self
        if flops is None:
            self.reason = "the model has no flops_per_token()"
            return self
        self.flops_per_sample = flops
        self._set_peaks(device, precision)
        return self

    def record(self, samples_per_s: float) -> dict[str, float]:
        """`tflops` achieved per device, `mfu` against the measured peak and, on a known GPU,
        `mfu_datasheet`; nothing when FLOPs are unknown."""
        if self.flops_per_sample is None:
            return {}
        achieved = self.flops_per_sample * samples_per_s / 1e12
        record = {"tflops": achieved}
        if self.peak:
            record["mfu"] = achieved / self.peak
        if self.datasheet:
            record["mfu_datasheet"] = achieved / self.datasheet
        return record


def main(argv: list[str] | None = None) -> int:
    """Print this machine's measured peak (the cached one, or `--refresh` to measure again)."""
    parser = rundir.Parser(prog="mfu", description=main.__doc__)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS)
    parser.add_argument("--refresh", action="store_true", help="measure again, ignore the cache")
    args = parser.parse_args(argv)
    try:
        device = utils.resolve_device(args.device)
    except (RuntimeError, ValueError) as error:  # cuda:abc, or a device this build lacks
        parser.error(str(error))
    found = measured_peak(device, args.precision, refresh=args.refresh)
    if found.get("tflops") is None:
        print(f"no measured peak: {found.get('reason')}")
        return 1
    how = "cached" if found["cached"] else found.get("note", "measured and cached")
    print(
        f"{found['device_name']}: {found['tflops'] * 1e3:,.1f} GFLOP/s {found['precision']} "
        f"(square matmuls of {found['size']}, {how})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
