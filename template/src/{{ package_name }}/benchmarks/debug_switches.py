"""5. Anomaly detection, deterministic mode, gradient clipping: step time on / off."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from .. import utils
from .timing import (
    Context,
    compare,
    device_batch,
    fmt_ratio,
    fmt_timing,
    fresh_model,
    make_step,
    measure_many,
)


@contextlib.contextmanager
def deterministic_mode(unsupported: list[str]) -> Iterator[None]:
    """Deterministic kernels on (warn_only), then the previous settings back.

    Ops without a deterministic kernel run their default one and warn; their messages are
    collected into `unsupported` so the report can name them.
    """
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        utils.set_deterministic(True, warn_only=True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
            torch.backends.cudnn.benchmark = previous[2]
            torch.backends.cudnn.deterministic = previous[3]
    for warning in caught:
        text = str(warning.message).splitlines()[0]
        if "deterministic" in text and text not in unsupported:
            unsupported.append(text)


def section_debug_switches(ctx: Context) -> dict[str, Any]:
    inputs, targets = device_batch(ctx)
    clip = ctx.config.optim.grad_clip if ctx.config.optim.grad_clip is not None else 1.0
    clip_name = f"clip_grad_norm (max_norm={clip:g})"
    steps = {
        "all off": make_step(fresh_model(ctx), ctx),
        "anomaly_detection": make_step(fresh_model(ctx), ctx, anomaly=True),
        "deterministic": make_step(fresh_model(ctx), ctx),
        clip_name: make_step(fresh_model(ctx), ctx, clip=clip),
    }
    unsupported: list[str] = []

    def deterministic_step() -> None:
        with deterministic_mode(unsupported):
            steps["deterministic"](inputs, targets)

    fns = {name: functools.partial(step, inputs, targets) for name, step in steps.items()}
    fns["deterministic"] = deterministic_step
    with warnings.catch_warnings():
        # Its "will increase the runtime" warning is what this section measures.
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        timings = measure_many(fns, ctx)
    off = timings.pop("all off")
    switches = timings
    comparisons = {name: compare(t, off) for name, t in switches.items()}
    rows = [["all off", fmt_timing(off), "1.00"]]
    rows += [[name, fmt_timing(t), fmt_ratio(comparisons[name])] for name, t in switches.items()]
    notes = []
    if unsupported:
        notes.append(
            "deterministic mode: ops without a deterministic kernel ran their default "
            "kernel (warn_only): " + "; ".join(unsupported)
        )
    return {
        "off": off,
        "on": switches,
        "ratios": {name: c["ratio"] for name, c in comparisons.items()},
        "ratio_rounds": comparisons,
        "table": {
            "columns": ["switch on (others off)", "step time ± IQR", "vs all off (spread)"],
            "rows": rows,
        },
        "notes": notes,
    }
