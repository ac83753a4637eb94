"""The matmul peak MFU divides by: measured here and cached, or from NVIDIA's datasheets.

Two peaks, both per precision (fp32, tf32, bf16, fp16):

- **measured**: the dense matmul rate this device reaches here, from a short calibration (square
  GEMMs grown until one takes 20 ms, after a warm-up; the best of several, 2 n^3 FLOPs each).
  It exists on every device (CPU, MPS, any GPU, a MIG slice) and is cached per device,
  precision, thread count and torch version in `utils.cache_dir()`, so it costs about a second
  once per machine. Other load only slows a calibration, so the cache keeps the best quiet
  one (`_busy`): `python -m <package>.observability.mfu --refresh` replaces it only with a
  higher one, `--reset` with any. A busy calibration is used by the run that made it, not
  cached. Each run times a few matmuls at start-up (the probe): far below the cached peak, it
  warns of a busy machine; above it, it raises the peak.
- **datasheet**: NVIDIA's dense (no sparsity) tensor-core peak for known GPUs, as a second
  reference: what the hardware could do in principle. Not for MIG slices (a slice has a
  fraction of the GPU's cores) and not for CPUs.

observability/mfu.py counts the FLOPs and divides.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from .. import utils
from ..runtime import accelerator

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
# A start-up probe below this share of the cached peak means a busy machine: warn.
BUSY_PROBE_SHARE = 0.5
# A calibration is cached only when other processes took at most this many CPUs (on average)
# beyond those torch's threads leave free, while it ran: one CPU-bound neighbour takes more.
QUIET_OTHER_CPUS = 0.25
# ... and when its median product took at most this much longer than its best (another job
# on the same GPU slows some products and not others).
QUIET_SPREAD = 1.15
# Other processes' CPU time is read over at least this long (a calibration can be shorter).
QUIET_WINDOW_S = 0.5

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

# The largest matrix size a cached peak may name (calibrations stop at 8192): a larger one,
# written by hand or garbled, would have the start-up probe allocate gigabytes.
MAX_CACHED_SIZE = 16384

# Calibrations measured on a busy machine: used by this process, never cached.
_UNCACHED: dict[Path, dict[str, Any]] = {}

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


def rate(tflops: float) -> str:
    """A FLOP rate as people read it: GFLOP/s under 1 TFLOP/s."""
    return f"{tflops:.3g} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:,.1f} GFLOP/s"


def measured_peak(device: torch.device, precision: str, *, max_size: int | None = None,
                  repeats: int = 10, refresh: bool = False, reset: bool = False,
                  cache: Path | None = None, probe: bool = False) -> dict[str, Any]:  # fmt: skip
    """The dense matmul rate of this device in `precision`, measured once and cached.

    Returns {"tflops", "precision", "size", "device_name", "cached"}: square matmuls of
    `size` (doubled from 256 until one product takes 20 ms, at most `max_size`), the best of
    `repeats`. `refresh` measures again and keeps the higher of the new and the cached peak
    ("note" says when the cached one stayed); `reset` replaces the cached peak. A calibration
    on a busy device is returned with "busy" (why) and not cached. With `probe`, a cached peak
    is checked by a few matmuls now: "probe_tflops", a "warning" when they reach under
    BUSY_PROBE_SHARE of it, and a higher peak when they beat it.
    `precision` is the run's; fp32 is calibrated as tf32 where TF32 is on (`matmul_precision`).
    A calibration that fails (an unsupported dtype here) returns {"tflops": None, "reason"}.
    """
    precision = matmul_precision(device, precision)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    folder = cache if cache is not None else utils.cache_dir()
    path = folder / f"peak-{_cache_key(device, precision)}.json"
    cached = _read_cached(path)
    if cached is not None and not (refresh or reset):
        return _with_probe(cached, device, precision, path) if probe else cached
    if path in _UNCACHED and not (refresh or reset):
        return _UNCACHED[path]  # measured on a busy machine by this process: not again
    if max_size is None:
        max_size = 8192 if device.type == "cuda" else 2048
    try:
        result = _calibrate(device, precision, max_size, repeats)
    except RuntimeError as error:
        return {"tflops": None, "precision": precision, "reason": str(error).splitlines()[0]}
    return _keep_best(result, None if reset else cached, path)


def _read_cached(path: Path) -> dict[str, Any] | None:
    """The cached peak at `path`, or None (measure again) where it is absent, unreadable or
    not what `_keep_best` writes: a finite positive rate, a matrix size the probe can time."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict):
        return None
    tflops, size = found.get("tflops"), found.get("size")
    if not (isinstance(tflops, float) and 0 < tflops < math.inf):  # NaN fails both
        return None
    if size is not None and not (type(size) is int and 0 < size <= MAX_CACHED_SIZE):
        return None
    return {**found, "cached": True}


def _keep_best(result: dict[str, Any], cached: dict[str, Any] | None, path: Path) -> dict[str, Any]:
    """The higher of a calibration and the cached peak; the calibration is cached when it is
    the higher and the device was quiet. "note" says why a calibration was not kept."""
    measured, busy = result["tflops"], result.get("busy")
    if cached is not None and cached["tflops"] > measured:
        why = f"({busy})" if busy else "below it"
        note = f"measured {rate(measured)} now {why}: kept the cached peak (--reset replaces it)"
        return {**cached, "measured_tflops": measured, "note": note}
    if busy:  # use it (a lower bound of the peak), do not keep it
        note = f"the matmul peak was measured now, not cached ({busy}): MFU may read high"
        _UNCACHED[path] = {**result, "cached": False, "note": note}
        return _UNCACHED[path]
    try:  # atomically: concurrent runs on one machine share the cache
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        scratch.write_text(json.dumps(result) + "\n")
        scratch.replace(path)
    except OSError:
        pass  # a read-only home: measure again next time
    return {**result, "cached": False}


def _calibrate(device: torch.device, precision: str, max_size: int, repeats: int,
               start: int = 256, window: float = QUIET_WINDOW_S) -> dict[str, Any]:  # fmt: skip
    """One calibration, with "busy" (why) when other work shared the device while it ran (on
    a CPU, read over at least `window` seconds)."""
    before = _cpu_counters()
    tflops, size, spread = _time_matmul(device, _DTYPES[precision], max_size, repeats, start)
    after = _cpu_counters()
    if before and after and after[0] - before[0] < window and device.type == "cpu":
        time.sleep(window - (after[0] - before[0]))  # a short one: others' use after it
        after = _cpu_counters()
    others = _other_cpus(before, after) if device.type == "cpu" else None
    result = {"tflops": tflops, "precision": precision, "size": size, "spread": spread,
              "device_name": device_name(device),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
    busy = _busy(device, spread, others)
    return {**result, "busy": busy} if busy else result


def _busy(device: torch.device, spread: float, others: float | None) -> str:
    """Why a calibration cannot be kept ('' for a quiet device): other processes took over
    QUIET_OTHER_CPUS from torch's threads (/proc/stat on Linux, else the load average over
    the CPU count), or its repeats spread over QUIET_SPREAD (another job on the same GPU)."""
    if others is not None and others > QUIET_OTHER_CPUS:
        return f"busy: other processes took {others:.2f} CPUs from torch's threads"
    if spread > QUIET_SPREAD:
        return f"busy: its median product took {spread:.2f}x its best (a shared {device.type})"
    return ""


def _cpu_counters() -> tuple[float, float, float] | None:
    """(now, CPU-seconds the CPUs this process may use were busy, this process's CPU-seconds)
    from /proc/stat (Linux, steal time counts as busy); None where there is none."""
    try:
        names = {f"cpu{n}" for n in os.sched_getaffinity(0)}
        busy = 0
        for line in Path("/proc/stat").read_text().splitlines():
            name, *fields = line.split()
            if name in names:  # user nice system idle iowait irq softirq steal
                ticks = [int(field) for field in fields[:8]]
                busy += sum(ticks) - ticks[3] - ticks[4]
        return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), time.process_time()
    except (AttributeError, OSError, ValueError, IndexError):
        return None


def _other_cpus(
    before: tuple[float, float, float] | None, after: tuple[float, float, float] | None
) -> float | None:
    """CPUs other processes took from torch's threads between the counters (those the
    threads leave free do not count): from /proc/stat, else the 1-minute load average beyond
    the CPUs; None when neither says (a window under 0.2 s is too coarse for /proc/stat)."""
    free = max(utils.available_cpus() - torch.get_num_threads(), 0)
    if before is not None and after is not None and after[0] - before[0] >= 0.2:
        others = (after[1] - before[1] - (after[2] - before[2])) / (after[0] - before[0])
        return max(others - free, 0.0)
    try:
        return max(os.getloadavg()[0] - utils.available_cpus(), 0.0) if before is None else None
    except (AttributeError, OSError):
        return None


def _time_matmul(
    device: torch.device, dtype: torch.dtype, max_size: int, repeats: int, start: int = 256
) -> tuple[float, int, float]:
    """(TFLOP/s, size, spread) of square matmuls: the size doubles from 256 until one product
    takes 20 ms or reaches `max_size`, so a slow path (fp16 on a CPU) costs seconds, not
    minutes; spread is the median product's time over the best's."""
    generator = torch.Generator().manual_seed(0)

    def operands(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
        b = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
        return a, b

    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        accelerator.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        accelerator.synchronize(device)
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
    times = [timed(a, b) for _ in range(repeats)]
    seconds, spread = min(times), statistics.median(times) / max(min(times), 1e-12)
    return 2 * size**3 / seconds / 1e12, size, spread  # n x n by n x n: n^3 multiply-adds


def _with_probe(
    found: dict[str, Any], device: torch.device, precision: str, path: Path
) -> dict[str, Any]:
    """`found` (a cached peak) with a quick probe at its size: a warning when the probe
    reaches under BUSY_PROBE_SHARE of it (other processes hold the device now), the probe's
    rate as the peak (cached when quiet) when it beats it (the cache was low)."""
    size = int(found.get("size") or 1024)
    try:
        now = _calibrate(device, precision, size, repeats=3, start=size, window=0.0)
    except RuntimeError:
        return found
    best = _keep_best(now, found, path)
    if best["tflops"] > found["tflops"]:  # the cached peak was low: measured on a busy day
        kept = f"not cached ({now['busy']})" if now.get("busy") else "cached"
        note = f"the start-up probe beat the cached peak {rate(found['tflops'])}: {kept}"
        return {**best, "probe_tflops": now["tflops"], "note": note}
    found = {**found, "probe_tflops": now["tflops"]}
    if now["tflops"] < BUSY_PROBE_SHARE * found["tflops"]:
        found["warning"] = (
            f"the start-up matmul probe reached {rate(now['tflops'])}, "
            f"{now['tflops'] / found['tflops']:.0%} of this machine's cached peak "
            f"{rate(found['tflops'])}: the {device.type} is busy, so throughput and MFU "
            "(against the cached peak) will read low"
        )
    return found
