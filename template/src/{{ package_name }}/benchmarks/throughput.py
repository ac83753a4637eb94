"""7. Throughput in samples/s, achieved FLOP/s and model FLOPs utilization (MFU).

A language model counts tokens (every target position of a batch) instead of samples, and
its FLOPs per token come from the model's own count (parameters and attention).

MFU is divided by two peaks for the run's matmul precision (see `observability/mfu.py`): the one
measured
on this device (every device has one), and the datasheet's where the GPU is in the table.
"""

from __future__ import annotations

from typing import Any

from .. import utils
from ..observability import mfu
from .timing import Context, Skip, device_batch, fmt_timing, fresh_model, make_step, measure


def section_throughput(ctx: Context) -> dict[str, Any]:
    config = ctx.config
    per_batch = ctx.batch[1].numel()  # samples, or tokens: one per target
    unit = ctx.task.unit
    loop = ctx.results.get(6, {})
    if loop.get("status") == "measured":
        step, source = loop["loop"], "training loop (section 6)"
        samples = per_batch * config.optim.grad_accum_steps
    else:
        inputs, targets = device_batch(ctx)
        bare = make_step(fresh_model(ctx), ctx)
        step, source = measure(lambda: bare(inputs, targets), ctx), "bare step on one batch"
        samples = per_batch
    median = step["median_s"]
    rate = samples / median
    # The IQR of a rate, from the step-time quartiles (rate falls as time rises).
    low = samples / (median + step["iqr_s"] / 2)
    high = samples / max(median - step["iqr_s"] / 2, 1e-12)
    counter = ctx.task.utilization(ctx.base_model, config, ctx.info, ctx.device, True)
    if counter.flops_per_sample is None:
        raise Skip(counter.reason)
    flops = counter.flops_per_sample * samples
    achieved = flops / median / 1e12
    precision = mfu.matmul_precision(ctx.device, config.speed.precision)
    calibration = mfu.measured_peak(ctx.device, config.speed.precision)
    if calibration.get("tflops") and achieved > calibration["tflops"]:  # a low cached peak
        calibration = mfu.measured_peak(ctx.device, config.speed.precision, refresh=True)
    measured = calibration.get("tflops")
    datasheet, device_name = mfu.datasheet_peak(ctx.device, config.speed.precision)
    how = "cached" if calibration.get("cached") else "measured now"
    if calibration.get("busy") and not calibration.get("cached"):
        how = f"measured now, not cached: {calibration['busy']}"
    size = calibration.get("size")
    mfu_measured, measured_text, measured_unknown = _against(
        achieved,
        measured,
        "measured (and measured again now)",
        f"TFLOP/s ({precision} matmul {size}x{size}, {how})",
        calibration.get("reason", "calibration failed"),
        ".1%",
    )
    mfu_datasheet, datasheet_text, datasheet_unknown = _against(
        achieved, datasheet, "datasheet", f"TFLOP/s ({device_name})", device_name, ".2%"
    )
    unknown = {"mfu_unknown": measured_unknown, "mfu_datasheet_unknown": datasheet_unknown}
    rows = [
        [f"{unit}/s", f"{rate:.1f} (IQR {low:.1f}-{high:.1f})"],
        ["step time", fmt_timing(step)],
        ["FLOPs per step (fwd+bwd)", f"{flops / 1e9:.3f} GFLOP"],
        ["achieved", f"{achieved:.4f} TFLOP/s"],
        [f"MFU vs measured {precision} peak", measured_text],
        [f"MFU vs datasheet {precision} peak", datasheet_text],
    ]
    return {
        "step_source": source,
        "samples_per_step": samples,
        "samples_per_s": rate,
        "samples_per_s_iqr": [low, high],
        "unit": unit,
        "step": step,
        "flops_per_step": flops,
        "achieved_tflops": achieved,
        "matmul_precision": precision,
        "peak_measured_tflops": measured,
        "peak_datasheet_tflops": datasheet,
        "peak_bf16_tflops": mfu.datasheet_peak(ctx.device, "bf16")[0],
        "device_name": device_name,
        "mfu_measured": mfu_measured,
        "mfu_datasheet": mfu_datasheet,
        **{key: why for key, why in unknown.items() if why},
        # Before schema 2: MFU against the bf16 datasheet peak, whatever the precision.
        "mfu": mfu_datasheet if mfu_datasheet is not None else "unknown",
        "table": {"columns": ["", "value"], "rows": rows},
        "notes": [
            f"step time from the {source}; precision {config.speed.precision}; FLOPs counted "
            "once by torch.utils.flop_counter.FlopCounterMode on a meta-device copy; the "
            f"measured peak is cached in {utils.cache_dir()}"
        ],
    }


def _against(
    achieved: float, peak: float | None, which: str, what: str, missing: str, percent: str
) -> tuple[float | None, str, str]:
    """(MFU, its table text, why it is unknown): never above 100% (`mfu.utilization`)."""
    if not peak:
        return None, f"n/a ({missing})", ""
    value = mfu.utilization(achieved, peak)
    if value is None:
        why = mfu.above_peak(achieved, peak, which)
        return None, f"unknown: {why}", why
    return value, f"{value:{percent}} of {peak:.4g} {what}", ""
