"""3. torch.compile versus eager: training-step time, and the first (compiling) call."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import utils
from ..runtime import accelerator
from .timing import (
    Context,
    Skip,
    compare,
    device_batch,
    first_line,
    fmt_ratio,
    fmt_time,
    fmt_timing,
    fresh_model,
    make_step,
    measure_many,
)


def section_compile(ctx: Context) -> dict[str, Any]:
    config = ctx.config
    notes = []
    if ctx.quick:
        backend, mode = "eager", "default"
        notes.append(
            "--quick: backend eager (Dynamo capture only, no generated kernels), so this "
            "shows compile overhead, not inductor's speed-up"
        )
    else:
        backend, mode = config.speed.compile_backend, config.speed.compile_mode
    inputs, targets = device_batch(ctx)

    def first_call(step: Callable[..., Any]) -> float:
        accelerator.synchronize(ctx.device)
        start = time.perf_counter()
        step(inputs, targets)
        accelerator.synchronize(ctx.device)
        return time.perf_counter() - start

    eager_step = make_step(fresh_model(ctx), ctx)
    eager_first = first_call(eager_step)

    torch._dynamo.reset()  # a fresh compile, not one cached by an earlier section
    compiled_model = utils.maybe_compile(fresh_model(ctx), True, mode=mode, backend=backend)
    compiled_step = make_step(compiled_model, ctx)
    with contextlib.ExitStack() as stack:
        if backend == "inductor":
            # Inductor keeps compiled kernels in an on-disk cache, so a second benchmark run
            # would report a first call that a user's first run never sees: measure it cold.
            from torch._inductor import config as inductor_config

            stack.enter_context(inductor_config.patch(force_disable_caches=True))
            notes.append("first compiled call measured with inductor's caches disabled (cold)")
        try:
            compiled_first = first_call(compiled_step)
        except Exception as error:  # e.g. inductor without a C++ compiler
            reason = f"torch.compile (backend {backend}) failed here: {first_line(error)}"
            raise Skip(reason) from None
        # One more warm-up call than usual: Dynamo may recompile once after the first step.
        timings = measure_many(
            {
                "eager": lambda: eager_step(inputs, targets),
                "compiled": lambda: compiled_step(inputs, targets),
            },
            ctx,
            warmup=ctx.warmup + 1,
        )
    eager, compiled = timings["eager"], timings["compiled"]
    torch._dynamo.reset()
    speedup = compare(eager, compiled)
    rows = [
        ["eager", fmt_timing(eager), fmt_time(eager_first), "1.00"],
        [
            f"compiled ({backend}, {mode})",
            fmt_timing(compiled),
            fmt_time(compiled_first),
            fmt_ratio(speedup),
        ],
    ]
    extra = compiled_first - eager_first
    saved = eager["median_s"] - compiled["median_s"]
    if speedup["within_noise"]:
        payback = "never measurably: the step times are within noise of each other"
    elif saved > 0:
        payback = f"after about {math.ceil(extra / saved)} steps"
    else:
        payback = "never at this step time"

    notes.append(f"compiling costs {fmt_time(extra)} once; it pays off {payback}")
    return {
        "backend": backend,
        "mode": mode,
        "eager": eager,
        "compiled": compiled,
        "eager_first_call_s": eager_first,
        "compiled_first_call_s": compiled_first,
        "speedup": speedup["ratio"],
        "speedup_rounds": speedup,
        "table": {
            "columns": ["", "step time ± IQR", "first call", "speed-up (spread)"],
            "rows": rows,
        },
        "notes": notes,
    }
