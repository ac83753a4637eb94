"""10. Generation: a key/value cache versus recomputing the window for every token.

A model that keeps its keys and values (`new_cache`, as the language model's GPT does) runs
one position per generated token; without the cache, every token recomputes the whole window
before it. Both generate the same number of tokens from the same prompt with the project's
own `generate.sample`, greedily: the prompt fills three quarters of the window (`--seq-len`)
and the tokens the last quarter, so recomputing runs a forward over three quarters to all of
the window for every token, and both see the same tokens and give the same text (the section
says whether they did). A model without `new_cache` (the image models) is skipped.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from .timing import Context, Skip, compare, fmt_ratio, fmt_timing, fresh_model, measure_many


def section_generation(ctx: Context) -> dict[str, Any]:
    model = fresh_model(ctx).eval()
    if not callable(getattr(model, "new_cache", None)):
        raise Skip("the model keeps no key/value cache (no new_cache): nothing to compare")
    generate = importlib.import_module(f"{__package__.rpartition('.')[0]}.generate")
    window = int(getattr(model, "seq_len", ctx.config.model.seq_len))
    new = max(1, window // 4)
    prompt_length = window - new
    prompt = bytes(torch.randint(0, 256, (prompt_length,), generator=torch.Generator()).tolist())

    def run(cache: bool) -> Any:
        return lambda: generate.sample(
            model, prompt, max_new_tokens=new, temperature=0.0, seq_len=window, cache=cache
        )

    same = run(True)() == run(False)()  # greedy: the same text, or the cache is wrong
    timings = measure_many({"cached": run(True), "recompute": run(False)}, ctx, number=1)
    cached, recompute = timings["cached"], timings["recompute"]
    speedup = compare(recompute, cached)
    rows = [
        ["key/value cache", fmt_timing(cached), f"{new / cached['median_s']:.0f}/s"],
        ["recompute the window", fmt_timing(recompute), f"{new / recompute['median_s']:.0f}/s"],
        ["speed-up of the cache", fmt_ratio(speedup), ""],
    ]
    return {
        "window": window,
        "prompt_tokens": prompt_length,
        "new_tokens": new,
        "same_text": same,
        "cached": cached,
        "recompute": recompute,
        "speedup": speedup,
        "table": {"columns": ["", f"{new} tokens", "tokens"], "rows": rows},
        "notes": [
            f"greedy generation of {new} tokens after a {prompt_length}-token prompt in a "
            f"{window}-token window (--seq-len); same text both ways: {same}"
        ],
    }
