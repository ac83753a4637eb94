"""7. Throughput in samples/s, achieved FLOP/s and model FLOPs utilization (MFU).

MFU is divided by two peaks for the run's matmul precision (see `mfu.py`): the one measured
on this device (every device has one), and the datasheet's where the GPU is in the table.
"""

from __future__ import annotations

from typing import Any

from .. import mfu, utils
from .timing import Context, device_batch, fmt_timing, fresh_model, make_step, measure


def section_throughput(ctx: Context) -> dict[str, Any]:
    config = ctx.config
    loop = ctx.results.get(6, {})
    if loop.get("status") == "measured":
        step, source = loop["loop"], "training loop (section 6)"
        samples = config.optim.batch_size * config.optim.grad_accum_steps
    else:
        inputs, targets = device_batch(ctx)
        bare = make_step(fresh_model(ctx), ctx)
        step, source = measure(lambda: bare(inputs, targets), ctx), "bare step on one batch"
        samples = config.optim.batch_size
    median = step["median_s"]
    rate = samples / median
    # The IQR of a rate, from the step-time quartiles (rate falls as time rises).
    low = samples / (median + step["iqr_s"] / 2)
    high = samples / max(median - step["iqr_s"] / 2, 1e-12)
    inputs, _ = ctx.batch
    flops = mfu.training_flops(ctx.base_model, tuple(inputs.shape), ctx.info.num_classes)
    flops *= samples // config.optim.batch_size
    achieved = flops / median / 1e12
    precision = mfu.matmul_precision(ctx.device, config.speed.precision)
    calibration = mfu.measured_peak(ctx.device, config.speed.precision)
    measured = calibration.get("tflops")
    datasheet, device_name = mfu.datasheet_peak(ctx.device, config.speed.precision)
    mfu_measured = mfu.utilization(achieved, measured)
    mfu_datasheet = mfu.utilization(achieved, datasheet)
    if measured:
        how = "cached" if calibration["cached"] else "measured now"
        measured_text = (
            f"{mfu_measured:.1%} of {measured:.3g} TFLOP/s ({precision} matmul "
            f"{calibration['size']}x{calibration['size']}, {how})"
        )
    else:
        measured_text = f"n/a ({calibration.get('reason', 'calibration failed')})"
    datasheet_text = (
        f"{mfu_datasheet:.2%} of {datasheet:g} TFLOP/s ({device_name})"
        if datasheet
        else f"n/a ({device_name})"
    )
    rows = [
        ["samples/s", f"{rate:.1f} (IQR {low:.1f}-{high:.1f})"],
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
        # Before schema 2: MFU against the bf16 datasheet peak, whatever the precision.
        "mfu": mfu_datasheet if mfu_datasheet is not None else "unknown",
        "table": {"columns": ["", "value"], "rows": rows},
        "notes": [
            f"step time from the {source}; precision {config.speed.precision}; FLOPs counted "
            "once by torch.utils.flop_counter.FlopCounterMode on a meta-device copy; the "
            f"measured peak is cached in {utils.cache_dir()}"
        ],
    }
