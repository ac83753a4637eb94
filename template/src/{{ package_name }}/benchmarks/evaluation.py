"""4. Evaluation under inference_mode versus no_grad versus grad-enabled: time, peak memory."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..runtime import accelerator
from .timing import (
    Context,
    compare,
    device_batch,
    fmt_bytes,
    fmt_ratio,
    fmt_timing,
    fresh_model,
    measure_many,
)


def peak_memory(fn: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """Peak and held bytes allocated by torch while `fn` runs (its result is kept alive).

    CUDA: the caching allocator's statistics. CPU: the profiler's memory events (the torch
    CPU allocator's running total, read from a Chrome trace). "held" is what the result
    keeps alive afterwards: with autograd on, that is the graph's saved activations.
    """
    if device.type == "cuda":
        accelerator.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        result = fn()
        accelerator.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        held = torch.cuda.memory_allocated(device) - base
        del result
        return {"peak_bytes": peak, "held_bytes": held, "source": "torch.cuda.max_memory_allocated"}
    if device.type != "cpu":
        return {"peak_bytes": None, "held_bytes": None, "source": f"n/a on {device.type}"}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    del result
    memory = sorted(
        (e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
        key=lambda e: float(e["ts"]),
    )
    if not memory:
        return {"peak_bytes": 0, "held_bytes": 0, "source": "torch.profiler memory events"}
    base = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    peak = max(e["args"]["Total Allocated"] for e in memory) - base
    held = memory[-1]["args"]["Total Allocated"] - base
    return {"peak_bytes": peak, "held_bytes": held, "source": "torch.profiler memory events"}


def section_evaluation(ctx: Context) -> dict[str, Any]:
    model = fresh_model(ctx).eval()
    inputs, _ = device_batch(ctx)

    def forward_under(mode: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> torch.Tensor:
            with mode(), accelerator.autocast(ctx.device, ctx.config.speed.precision):
                return model(inputs)

        return run

    modes = {
        "inference_mode": torch.inference_mode,
        "no_grad": torch.no_grad,
        "grad enabled": torch.enable_grad,
    }
    runs = {name: forward_under(mode) for name, mode in modes.items()}
    timings = measure_many(runs, ctx)
    results = {
        name: {"time": timings[name], **peak_memory(run, ctx.device)} for name, run in runs.items()
    }
    base = results["inference_mode"]["time"]
    rows = []
    for name, r in results.items():
        r["vs_inference_mode"] = compare(r["time"], base)
        peak = "n/a" if r["peak_bytes"] is None else fmt_bytes(r["peak_bytes"])
        held = "n/a" if r["held_bytes"] is None else fmt_bytes(r["held_bytes"])
        rows.append([name, fmt_timing(r["time"]), fmt_ratio(r["vs_inference_mode"]), peak, held])
    return {
        "modes": results,
        "table": {
            "columns": [
                "mode (model.eval())",
                "forward ± IQR",
                "time vs inference_mode (spread)",
                "peak memory",
                "held by output",
            ],
            "rows": rows,
        },
        "notes": [
            f"memory: {results['inference_mode']['source']}; one forward of a "
            f"batch of {ctx.config.optim.batch_size}"
        ],
    }
