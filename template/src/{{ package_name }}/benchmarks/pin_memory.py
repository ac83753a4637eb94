"""2. pin_memory + non_blocking versus pageable, blocking host-to-device copies (CUDA only)."""

from __future__ import annotations

from typing import Any

import torch

from .. import utils
from .timing import (
    Context,
    Skip,
    compare,
    fmt_bytes,
    fmt_ratio,
    fmt_timing,
    fresh_model,
    make_step,
    measure_many,
    train_loader,
)


def section_pin_memory(ctx: Context) -> dict[str, Any]:
    if ctx.device.type != "cuda":
        raise Skip("no accelerator" if ctx.device.type == "cpu" else "pin_memory is for CUDA")
    loader = train_loader(ctx, ctx.train_set, 0)
    pinned = tuple(next(iter(loader)))
    if not all(t.is_pinned() for t in pinned):
        raise Skip("build_dataloader did not pin the batch for this device")
    pageable = tuple(torch.empty(t.shape, dtype=t.dtype).copy_(t) for t in pinned)
    nbytes = sum(t.numel() * t.element_size() for t in pinned)
    device = ctx.device

    copies = measure_many(
        {
            "pageable": lambda: [t.to(device) for t in pageable],
            "pinned": lambda: utils.to_device(pinned, device),
        },
        ctx,
    )
    copy_pageable, copy_pinned = copies["pageable"], copies["pinned"]
    step = make_step(fresh_model(ctx), ctx)
    steps = measure_many(
        {
            "pageable": lambda: step(*[t.to(device) for t in pageable]),
            "pinned": lambda: step(*utils.to_device(pinned, device)),
        },
        ctx,
    )
    step_pageable, step_pinned = steps["pageable"], steps["pinned"]
    copy_speedup = compare(copy_pageable, copy_pinned)
    step_speedup = compare(step_pageable, step_pinned)
    rows = [
        [
            "copy one batch",
            fmt_timing(copy_pageable),
            fmt_timing(copy_pinned),
            fmt_ratio(copy_speedup),
        ],
        [
            "copy + training step",
            fmt_timing(step_pageable),
            fmt_timing(step_pinned),
            fmt_ratio(step_speedup),
        ],
    ]
    gbps = {
        name: nbytes / t["median_s"] / 1e9
        for name, t in (("pageable", copy_pageable), ("pinned", copy_pinned))
    }
    return {
        "batch_bytes": nbytes,
        "copy": {
            "pageable_blocking": copy_pageable,
            "pinned_non_blocking": copy_pinned,
            "speedup": copy_speedup["ratio"],
            "speedup_rounds": copy_speedup,
            "gb_per_s": gbps,
        },
        "step": {
            "pageable_blocking": step_pageable,
            "pinned_non_blocking": step_pinned,
            "speedup": step_speedup["ratio"],
            "speedup_rounds": step_speedup,
        },
        "table": {
            "columns": ["", "pageable, blocking", "pinned, non_blocking", "speed-up (spread)"],
            "rows": rows,
        },
        "notes": [
            f"batch of {fmt_bytes(nbytes)}: {gbps['pageable']:.1f} GB/s pageable, "
            f"{gbps['pinned']:.1f} GB/s pinned"
        ],
    }
