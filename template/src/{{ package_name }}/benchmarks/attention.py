"""8. Attention: the fused `scaled_dot_product_attention` kernels versus its math kernel.

`F.scaled_dot_product_attention` picks the fastest kernel the device has (flash or
memory-efficient attention on CUDA, a fused flash kernel on CPU); the math kernel computes
softmax(QK^T / sqrt(d)) V step by step, as a hand-written attention would, and keeps the
(T, T) score matrix for backward. Both train the same model on the same batch, selected with
`torch.nn.attention.sdpa_kernel`. A model that never calls the function is skipped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from .timing import (
    Context,
    Skip,
    compare,
    device_batch,
    fmt_ratio,
    fmt_timing,
    fresh_model,
    make_step,
    measure_many,
)


class _CountAttention(TorchFunctionMode):
    """Counts calls of `F.scaled_dot_product_attention` during a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is F.scaled_dot_product_attention:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def attention_calls(model: torch.nn.Module, inputs: torch.Tensor) -> int:
    """How many times one forward of `model` calls scaled_dot_product_attention."""
    counter = _CountAttention()
    with torch.no_grad(), counter:
        model(inputs)
    return counter.calls


def section_attention(ctx: Context) -> dict[str, Any]:
    inputs, targets = device_batch(ctx)
    model = fresh_model(ctx)
    calls = attention_calls(model, inputs)
    if calls == 0:
        raise Skip("the model calls no F.scaled_dot_product_attention")
    fused_step = make_step(model, ctx)
    math_step = make_step(fresh_model(ctx), ctx)

    def with_math() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.MATH]):
            return math_step(inputs, targets)

    timings = measure_many(
        {"fused": lambda: fused_step(inputs, targets), "math": with_math},
        ctx,
    )
    fused, math = timings["fused"], timings["math"]
    speedup = compare(math, fused)
    tokens = targets.numel()
    rows = [
        ["fused (default kernels)", fmt_timing(fused), f"{tokens / fused['median_s']:.0f}/s"],
        ["math kernel", fmt_timing(math), f"{tokens / math['median_s']:.0f}/s"],
        ["speed-up of fused", fmt_ratio(speedup), ""],
    ]
    return {
        "attention_calls_per_forward": calls,
        "fused": fused,
        "math": math,
        "speedup": speedup,
        "table": {"columns": ["", "step time", "tokens"], "rows": rows},
        "notes": [
            f"{calls} attention calls per forward; training step on one batch of {tokens} "
            "targets; the math kernel keeps the (T, T) scores for backward"
        ],
    }
