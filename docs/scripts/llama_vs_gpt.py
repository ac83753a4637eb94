"""Interleaved step times of --model gpt and --model llama at configs/cpu-30min.toml's size
(width 192, 4 blocks, 6 heads, windows of 128 tokens, batch 32, vocabulary 1,024): forward,
loss, backward, optimizer step (Muon on the hidden matrices, AdamW on the rest, as configured),
bf16 autocast, one thread. Prints tokens/s per model, the llama/gpt step-time ratio of each
round (median and IQR) and MFU against this machine's cached one-thread bf16 matmul peak
(written by the project's first bf16 run or `python -m <package>.observability.mfu`).

From the root of a language-model project generated with the default package name:

    OMP_NUM_THREADS=1 PYTHONPATH=src python docs/scripts/llama_vs_gpt.py ROUNDS STEPS
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import my_torch_project  # noqa: F401  (the package's import registers the models)
import torch
from my_torch_project.config import parse_config
from my_torch_project.train import build_optimizer
from my_torch_project.training.data_sources import DataInfo
from my_torch_project.training.task import build_model_for

BATCH, WINDOW, VOCAB = 32, 128, 1024


def make(name: str) -> tuple[Callable[[], None], int, int]:
    """One training step of `--model name` at the configuration's size, its FLOPs per token
    and its parameter count."""
    config = parse_config(["--config", "configs/cpu-30min.toml", "--model", name])[0]
    torch.manual_seed(0)
    model = build_model_for(config, DataInfo(seq_len=WINDOW, vocab_size=VOCAB))
    model.train()
    optimizer = build_optimizer(config, model, torch.device("cpu"))
    tokens = torch.randint(
        0, VOCAB, (BATCH, WINDOW + 1), generator=torch.Generator().manual_seed(1)
    )

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        targets = tokens[:, 1:].flatten()
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    params = sum(p.numel() for p in model.parameters())
    return step, int(model.flops_per_token()), params


def cached_peak() -> float:
    """The one-thread bf16 matmul peak this machine's runs measured and cached, in FLOP/s."""
    found = sorted(Path.home().glob(".cache/my_torch_project*/peak-*1_threads*bf16*.json"))
    if not found:
        sys.exit("no cached one-thread bf16 peak: run one bf16 training run first")
    return float(json.loads(found[0].read_text())["tflops"]) * 1e12


def main() -> None:
    rounds, steps = int(sys.argv[1]), int(sys.argv[2])
    built = {name: make(name) for name in ("gpt", "llama")}
    for step, _, _ in built.values():
        for _ in range(3):  # warm-up
            step()
    times: dict[str, list[float]] = {name: [] for name in built}
    for round_ in range(rounds):  # interleaved, the order alternating
        for name in ("gpt", "llama") if round_ % 2 == 0 else ("llama", "gpt"):
            start = time.perf_counter()
            for _ in range(steps):
                built[name][0]()
            times[name].append((time.perf_counter() - start) / steps)
    peak = cached_peak()
    for name, (_, flops, params) in built.items():
        median = statistics.median(times[name])
        low, _, high = statistics.quantiles(times[name], n=4)
        rate = BATCH * WINDOW / median
        print(
            f"{name:6s} {params:,} params, {flops / 1e6:.1f} MFLOP/token: "
            f"{median * 1e3:.0f} ms/step (IQR {low * 1e3:.0f}-{high * 1e3:.0f}), "
            f"{rate:,.0f} tokens/s, MFU {rate * flops / peak:.1%} of {peak / 1e9:.0f} GFLOP/s"
        )
    ratios = [a / b for a, b in zip(times["llama"], times["gpt"], strict=True)]
    low, _, high = statistics.quantiles(ratios, n=4)
    print(
        f"llama/gpt step time: median {statistics.median(ratios):.3f} (IQR {low:.3f}-{high:.3f})"
        f" over {rounds} interleaved rounds of {steps} steps"
    )


if __name__ == "__main__":
    main()
