"""Model FLOPs utilization: FLOPs counted once per model and batch shape, divided by a peak.

The peak is this device's measured dense matmul rate in the run's precision, cached per
machine, beside NVIDIA's datasheet figure where one is known (observability/peaks.py). An
achieved rate above the peak measures it again; still above, MFU is unknown with the reason,
never over 100% (`utilization`).

`training_flops` counts forward + backward of one batch with
`torch.utils.flop_counter.FlopCounterMode` on a copy of the model on the meta device: no
memory, no compute, no effect on the real model's weights, buffers or gradients.

`python -m <package>.observability.mfu` prints the peaks (`--refresh`, `--reset`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import accelerator, console, exits
from .peaks import (
    DATASHEET_TFLOPS,
    PRECISIONS,
    datasheet_peak,
    device_name,
    matmul_precision,
    measured_peak,
    peak_tflops,
    rate,
)

# The peaks' names, imported from here before they had a module of their own.
__all__ = ["DATASHEET_TFLOPS", "PRECISIONS", "Utilization", "above_peak", "datasheet_peak"]
__all__ += ["device_name", "main", "matmul_precision", "measured_peak", "peak_tflops", "rate"]
__all__ += ["training_flops", "utilization"]


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
    """MFU, or None without a peak or when `achieved_tflops` is above it: never over 100%
    (a peak measured on a busy machine, or FLOPs counted too high; `above_peak` says)."""
    if not peak or achieved_tflops > peak:
        return None
    return achieved_tflops / peak


def above_peak(achieved_tflops: float, peak: float, which: str) -> str:
    """Why MFU is unknown when the achieved rate beats the peak."""
    return (
        f"achieved {rate(achieved_tflops)} is above the {which} peak {rate(peak)}: that peak "
        "is too low (measured on a busy machine: `mfu --reset` on a quiet one) or the FLOPs "
        "are counted too high"
    )


class Utilization:
    """Achieved TFLOP/s and MFU for each log line of a training run.

    FLOPs are counted once, from the shape of one training sample; the peaks are measured (or
    read from the cache) once. `record(samples_per_s)` then costs two divisions. Anything
    that cannot be counted (a model FlopCounterMode cannot trace on the meta device, inputs
    of another shape) turns the columns off with a reason, never the run. A rate above the
    measured peak measures the peak again, once; still above, MFU is null in metrics.jsonl
    with `mfu_unknown` (the reason), and the log says so once.
    """

    flops_per_sample: float | None
    peak: float | None
    datasheet: float | None

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
        self._reset(device, precision)
        if not enabled:
            return
        try:
            shape = (batch_size, *sample_shape)
            self.flops_per_sample = training_flops(model, shape, num_classes) / batch_size
        except Exception as error:  # a user model or dataset this counter cannot trace
            self.reason = f"FLOPs not counted: {type(error).__name__}: {error}".splitlines()[0]
            return
        self._set_peaks()

    def _reset(self, device: torch.device, precision: str) -> None:
        self.device, self.precision = device, precision
        self.flops_per_sample, self.peak, self.datasheet = None, None, None
        self.reason = ""  # why there is no MFU, when there is none
        self.warning = ""  # the peak is in doubt (a busy device now, or when measured)
        self.measured_again = False  # a rate above the peak measures it again, once
        self.told: set[str] = set()  # the unknown MFUs the log has already explained

    def _set_peaks(self) -> None:
        found = measured_peak(self.device, self.precision, probe=True)
        self.peak = found.get("tflops")
        self.warning = found.get("warning") or found.get("note") or ""
        self.datasheet = datasheet_peak(self.device, self.precision)[0]

    @classmethod
    def for_run(
        cls, model: nn.Module, config: Any, info: Any, device: torch.device, enabled: bool
    ) -> Utilization:
        """For `train.py`: the sample shape and classes from an image dataset's `DataInfo`
        (a language model's task counts its FLOPs per token instead: language/lm_task.py)."""
        shape = (info.in_channels, info.image_size, info.image_size)
        return cls(model, shape, info.num_classes, config.optim.batch_size, device,
                   config.speed.precision, enabled=enabled)  # fmt: skip

    @classmethod
    def per_sample(
        cls, flops: float | None, device: torch.device, precision: str, *, enabled: bool = True
    ) -> Utilization:
        """For a model that counts its own FLOPs per sample (a language model: per token);
        `flops` None turns the columns off with a reason."""
        self = cls.__new__(cls)
        self._reset(device, precision)
        if not enabled:
            return self
        if flops is None:
            self.reason = "the model has no flops_per_token()"
            return self
        self.flops_per_sample = flops
        self._set_peaks()
        return self

    def record(self, samples_per_s: float) -> dict[str, float | str | None]:
        """`tflops` achieved per device, `mfu` against the measured peak and, on a known GPU,
        `mfu_datasheet`; nothing when FLOPs are unknown. An MFU that would exceed 1 is None
        with `mfu_unknown` (`mfu_datasheet_unknown`) saying why."""
        if self.flops_per_sample is None:
            return {}
        achieved = self.flops_per_sample * samples_per_s / 1e12
        record: dict[str, float | str | None] = {"tflops": achieved}
        if self.peak and achieved > self.peak and not self.measured_again:
            self.measured_again = True  # the cache keeps the higher, and only when quiet
            again = measured_peak(self.device, self.precision, refresh=True).get("tflops")
            self.peak = max(self.peak, again or 0.0)
        for key, peak, which in (
            ("mfu", self.peak, "measured (and measured again)"),
            ("mfu_datasheet", self.datasheet, "datasheet"),
        ):
            if peak:
                record[key] = utilization(achieved, peak)
                if record[key] is None:
                    record[f"{key}_unknown"] = above_peak(achieved, peak, which)
                    self._tell(key, f"{key} unknown: {record[f'{key}_unknown']}")
        return record

    def _tell(self, key: str, message: str) -> None:
        if key not in self.told:  # once per run, not on every log line
            self.told.add(key)
            console.log(message)


def main(argv: list[str] | None = None) -> int:
    """Print this machine's measured peak (the cached one, `--refresh` to measure again and
    keep the higher, `--reset` to replace it). Exit 0 with a peak (the line says whether a
    new measurement was kept), 1 when none could be measured."""
    parser = exits.Parser(prog="mfu", description=main.__doc__)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS)
    parser.add_argument(
        "--refresh", action="store_true", help="measure again; the cache keeps the higher peak"
    )
    parser.add_argument(
        "--reset", action="store_true", help="measure again and replace the cached peak"
    )
    args = parser.parse_args(argv)
    try:
        device = accelerator.resolve_device(args.device)
    except (RuntimeError, ValueError) as error:  # cuda:abc, or a device this build lacks
        parser.error(str(error))
    found = measured_peak(device, args.precision, refresh=args.refresh, reset=args.reset)
    if found.get("tflops") is None:
        print(f"no measured peak: {found.get('reason')}")
        return 1
    how = "cached" if found["cached"] else "measured and cached"
    if found.get("busy") and not found["cached"]:
        how = f"measured now, NOT cached ({found['busy']}): run it again on a quiet machine"
    elif found.get("note"):
        how = f"cached; {found['note']}"
    print(
        f"{found['device_name']}: {found['tflops'] * 1e3:,.1f} GFLOP/s {found['precision']} "
        f"(square matmuls of {found['size']}, {how})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
