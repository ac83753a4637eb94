"""Measure what each technique buys on this machine: `python -m <package>.benchmark --help`.

Seven sections, side by side in one run. Every figure is a measurement from this run with its
spread (median and interquartile range from `torch.utils.benchmark`), or a ratio of two such
medians, or `skipped: <reason>`; nothing is looked up or assumed, except the datasheet peak
that model FLOPs utilization is divided by.

1. DataLoader workers on an on-disk image folder: samples/s per worker count
2. pin_memory + non_blocking versus pageable, blocking host-to-device copies (CUDA only)
3. torch.compile versus eager: training-step time, and the first (compiling) call
4. evaluation under inference_mode versus no_grad versus grad-enabled: time and peak memory
5. anomaly detection, deterministic mode, gradient clipping: step time on / off
6. the real training loop (`train.train`) versus a bare loop over the same model and data
7. throughput in samples/s; on CUDA, achieved TFLOP/s and model FLOPs utilization (MFU)

The table is printed, the numbers go to `<out>/benchmark.json`, and a chart to
`<out>/benchmark.png` when matplotlib is installed (`pip install '.[plot]'`). `--quick` takes
seconds and is for tests and smoke checks; drop it for numbers worth acting on. Timings share
the machine with everything else that runs: close other heavy programs first.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import functools
import io
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import benchmark as torch_benchmark
from torch.utils.data import DataLoader, Dataset

from . import utils
from .config import Config, build_parser, parse_config
from .data import DataInfo, build_datasets
from .train import build_model_for  # model.build_model_for, or one line on what to add

# Dense bf16 tensor-core peaks in TFLOP/s from NVIDIA's datasheets (the "with sparsity" figures
# are twice these). Matched against torch.cuda.get_device_name() in order; a device that matches
# nothing gets MFU "unknown" rather than a guess. Add your device here.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"H200(?!.*NVL)", 989.0),
    (r"H100(?!.*(PCIe|NVL))", 989.0),  # SXM
    (r"H100.*PCIe", 756.0),
    (r"A100", 312.0),
    (r"L40S", 362.0),
    (r"\bL4\b", 121.0),
    (r"\bA10\b", 125.0),
)

SECTIONS = {
    1: ("dataloader_workers", "DataLoader workers (on-disk images)"),
    2: ("pin_memory", "pin_memory + non_blocking vs pageable blocking copies"),
    3: ("compile", "torch.compile vs eager (training step)"),
    4: ("evaluation", "Evaluation: inference_mode vs no_grad vs grad-enabled"),
    5: ("debug_switches", "Debug switches: step time on / off"),
    6: ("loop_overhead", "Training loop vs bare reference loop"),
    7: ("throughput", "Throughput and model FLOPs utilization"),
}


MIN_RUNS = 5  # timed blocks per measurement, at least (3 with --quick)


class Skip(Exception):
    """A section cannot run here; the message is the reason shown as `skipped: <reason>`."""


@dataclasses.dataclass
class Context:
    config: Config
    device: torch.device
    quick: bool
    min_run_time: float
    loop_steps: int
    min_runs: int  # timed blocks per measurement, at least
    warmup: int  # untimed calls before each measurement
    out: Path
    data_dir: Path | None
    batch: tuple[torch.Tensor, torch.Tensor]  # one training batch, on the host
    base_model: nn.Module  # initial weights every section copies, so all start equal
    info: DataInfo  # the synthetic data's shapes, for building fresh models
    train_set: Dataset[Any]
    results: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# Timing helpers
# --------------------------------------------------------------------------------------------


def measure_many(
    fns: dict[str, Callable[[], Any]],
    ctx: Context,
    *,
    warmup: int | None = None,
    number: int | None = None,
    keep_times: bool = False,
) -> dict[str, dict[str, Any]]:
    """Median and IQR, in seconds, of each `fn()`, timed in interleaved rounds.

    Each round gives every function a `blocked_autorange` of `min_run_time / min_runs`
    seconds (or, with `number`, one block of that many calls), one function after the other.
    Interleaving matters for the ratios: a machine that slows down halfway (another job,
    thermal throttling) slows every contender alike instead of whichever ran last.
    `Timer` gets the thread count a real run uses (it defaults to one, which would understate
    multi-threaded CPU kernels) and synchronizes CUDA around each block.
    """
    timers = {}
    for name, fn in fns.items():
        for _ in range(ctx.warmup if warmup is None else warmup):
            fn()
        timers[name] = torch_benchmark.Timer(
            stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
        )
    times: dict[str, list[float]] = {name: [] for name in fns}
    round_time = ctx.min_run_time / ctx.min_runs
    start = time.perf_counter()
    budget = ctx.min_run_time * len(fns)
    while (
        min(len(t) for t in times.values()) < ctx.min_runs or time.perf_counter() - start < budget
    ):
        for name, timer in timers.items():
            if number is None:
                times[name].extend(timer.blocked_autorange(min_run_time=round_time).times)
            else:
                times[name].extend(timer.timeit(number).times)
    results = {}
    for name, values in times.items():
        stats = quartiles(values)
        results[name] = {"median_s": stats["median"], "iqr_s": stats["iqr"], "runs": len(values)}
        if keep_times:
            results[name]["times_s"] = values
    return results


def measure(fn: Callable[[], Any], ctx: Context, **kwargs: Any) -> dict[str, Any]:
    """`measure_many` for a single function."""
    return measure_many({"fn": fn}, ctx, **kwargs)["fn"]


def quartiles(values: Sequence[float]) -> dict[str, float]:
    """Median and IQR of a list of per-step measurements (seconds or rates)."""
    if len(values) < 2:
        raise Skip("fewer than two measurements")
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": median, "iqr": q3 - q1, "n": len(values)}


def ratio(numerator: dict[str, float], denominator: dict[str, float]) -> float:
    return numerator["median_s"] / denominator["median_s"]


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def fmt_time(seconds: float) -> str:
    if abs(seconds) >= 1:
        return f"{seconds:.2f} s"
    if abs(seconds) >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def fmt_timing(timing: dict[str, float]) -> str:
    return f"{fmt_time(timing['median_s'])} ± {fmt_time(timing['iqr_s'])}"


def fmt_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{count:.0f} B"
        count /= 1024
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------------
# A bare training step, shared by sections 2-7
# --------------------------------------------------------------------------------------------


def fresh_model(ctx: Context) -> nn.Module:
    model = copy.deepcopy(ctx.base_model).to(ctx.device)
    model.train()
    return model


def make_optimizer(model: nn.Module, config: Config, device: torch.device) -> torch.optim.Optimizer:
    """AdamW as train.py builds it (fused on CUDA), so step times compare like with like."""
    return torch.optim.AdamW(
        model.parameters(),
        lr=config.lr,
        weight_decay=config.weight_decay,
        fused=device.type == "cuda",
    )


def make_step(
    model: nn.Module,
    ctx: Context,
    *,
    anomaly: bool = False,
    clip: float | None = None,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The minimal step: forward, loss, backward, (clip), optimizer step. Nothing else."""
    optimizer = make_optimizer(model, ctx.config, ctx.device)
    scaler = utils.make_grad_scaler(ctx.device, ctx.config.precision)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with utils.anomaly_detection(anomaly):
            with utils.autocast(ctx.device, ctx.config.precision):
                loss = F.cross_entropy(model(inputs), targets)
            scaler.scale(loss).backward()
        if clip is not None:
            utils.clip_gradients(model.parameters(), clip, scaler=scaler, optimizer=optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def device_batch(ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = ctx.batch
    return inputs.to(ctx.device), targets.to(ctx.device)


# --------------------------------------------------------------------------------------------
# 1. DataLoader workers
# --------------------------------------------------------------------------------------------


def write_image_folder(root: Path, *, classes: int, total: int, size: int) -> None:
    """Random-noise JPEGs, one sub-folder per class: decoding them costs real CPU per item.

    Noise is the worst case for JPEG (little to compress), which keeps decode cost honest.
    """
    from PIL import Image

    per_class = math.ceil(total / classes)
    for label in range(classes):
        folder = root / f"class_{label:03d}"
        folder.mkdir(parents=True)
        for index in range(per_class):
            channels = [Image.effect_noise((size, size), 64) for _ in range(3)]
            Image.merge("RGB", channels).save(folder / f"{index:05d}.jpg", quality=90)


def endless(loader: DataLoader[Any]) -> Iterator[Any]:
    while True:
        yield from loader


def section_workers(ctx: Context) -> dict[str, Any]:
    config = ctx.config
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        if ctx.data_dir is not None:
            data_dir = ctx.data_dir
            source = f"--data-dir {data_dir}"
        else:
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-")))
            total = (8 if ctx.quick else 32) * config.batch_size
            size = max(64, 2 * config.image_size)
            write_image_folder(data_dir, classes=config.num_classes, total=total, size=size)
            source = (
                f"temporary folder: {total} random {size}x{size} JPEGs in "
                f"{config.num_classes} class folders (pass --data-dir to use yours)"
            )
        on_disk = dataclasses.replace(config, data_dir=str(data_dir))
        try:
            train_set, _, info = build_datasets(on_disk)
        except ValueError as error:  # DataError: the dataset cannot be read
            raise Skip(f"cannot read the on-disk dataset: {error}") from None
        if len(train_set) < config.batch_size:  # type: ignore[arg-type]
            raise Skip(f"the dataset has fewer than --batch-size {config.batch_size} items")
        if info.in_memory:
            notes.append("the dataset is in memory: workers only add inter-process copies")
        auto = utils.resolve_num_workers("auto", in_memory=info.in_memory)
        cpus = utils.available_cpus()
        candidates = sorted({0, *(n for n in (1, 2, 4, 8, 16, 32) if n <= cpus), cpus, auto})
        rows = []
        for workers in candidates:
            loader = utils.build_dataloader(
                train_set,
                batch_size=config.batch_size,
                train=True,
                num_workers=workers,
                generator=torch.Generator().manual_seed(config.seed),
                device=ctx.device,
            )
            batches = endless(loader)
            # Worker start-up and the first prefetched batches are paid once per run (the
            # workers persist), so the steady rate is what is compared.
            for _ in range(2 * workers + 2):
                next(batches)
            # Workers hand over batches in bursts (each prefetches ahead), so one block spans
            # several batches per worker: what is timed is the sustained rate.
            timing = measure(
                lambda batches=batches: next(batches),
                ctx,
                warmup=0,
                number=max(4, 2 * workers),
                keep_times=True,
            )
            rates = quartiles([config.batch_size / t for t in timing.pop("times_s")])
            rows.append(
                {
                    "workers": workers,
                    "samples_per_s": rates["median"],
                    "iqr_samples_per_s": rates["iqr"],
                    "batch_time": timing,
                }
            )
            batches.close()  # shuts the workers down before the next count starts
            del batches, loader
    fastest = max(rows, key=lambda row: row["samples_per_s"])["workers"]
    table = [
        [
            str(r["workers"]),
            f"{r['samples_per_s']:.0f} ± {r['iqr_samples_per_s']:.0f}",
            fmt_timing(r["batch_time"]),
            " ".join(
                mark
                for mark, on in (
                    ("fastest", r["workers"] == fastest),
                    ("auto", r["workers"] == auto),
                )
                if on
            ),
        ]
        for r in rows
    ]
    notes.append(
        f"--num-workers auto chooses {auto} (CPUs available: {cpus}); fastest here: {fastest}"
    )
    return {
        "dataset": source,
        "batch_size": config.batch_size,
        "cpus": cpus,
        "auto_workers": auto,
        "fastest_workers": fastest,
        "sweep": rows,
        "table": {"columns": ["workers", "samples/s ± IQR", "batch time ± IQR", ""], "rows": table},
        "notes": notes,
    }


# --------------------------------------------------------------------------------------------
# 2. pin_memory + non_blocking
# --------------------------------------------------------------------------------------------


def section_pin_memory(ctx: Context) -> dict[str, Any]:
    if ctx.device.type != "cuda":
        raise Skip("no accelerator" if ctx.device.type == "cpu" else "pin_memory is for CUDA")
    loader = utils.build_dataloader(
        ctx.train_set,
        batch_size=ctx.config.batch_size,
        train=True,
        num_workers=0,
        generator=torch.Generator().manual_seed(ctx.config.seed),
        device=ctx.device,
    )
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
    rows = [
        [
            "copy one batch",
            fmt_timing(copy_pageable),
            fmt_timing(copy_pinned),
            f"{ratio(copy_pageable, copy_pinned):.2f}",
        ],
        [
            "copy + training step",
            fmt_timing(step_pageable),
            fmt_timing(step_pinned),
            f"{ratio(step_pageable, step_pinned):.2f}",
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
            "speedup": ratio(copy_pageable, copy_pinned),
            "gb_per_s": gbps,
        },
        "step": {
            "pageable_blocking": step_pageable,
            "pinned_non_blocking": step_pinned,
            "speedup": ratio(step_pageable, step_pinned),
        },
        "table": {
            "columns": ["", "pageable, blocking", "pinned, non_blocking", "speed-up"],
            "rows": rows,
        },
        "notes": [
            f"batch of {fmt_bytes(nbytes)}: {gbps['pageable']:.1f} GB/s pageable, "
            f"{gbps['pinned']:.1f} GB/s pinned"
        ],
    }


# --------------------------------------------------------------------------------------------
# 3. torch.compile
# --------------------------------------------------------------------------------------------


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
        backend, mode = config.compile_backend, config.compile_mode
    inputs, targets = device_batch(ctx)

    def first_call(step: Callable[..., Any]) -> float:
        utils.synchronize(ctx.device)
        start = time.perf_counter()
        step(inputs, targets)
        utils.synchronize(ctx.device)
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
    speedup = ratio(eager, compiled)
    rows = [
        ["eager", fmt_timing(eager), fmt_time(eager_first), "1.00"],
        [
            f"compiled ({backend}, {mode})",
            fmt_timing(compiled),
            fmt_time(compiled_first),
            f"{speedup:.2f}",
        ],
    ]
    extra = compiled_first - eager_first
    saved = eager["median_s"] - compiled["median_s"]
    payback = (
        f"after about {math.ceil(extra / saved)} steps" if saved > 0 else "never at this step time"
    )
    notes.append(f"compiling costs {fmt_time(extra)} once; it pays off {payback}")
    return {
        "backend": backend,
        "mode": mode,
        "eager": eager,
        "compiled": compiled,
        "eager_first_call_s": eager_first,
        "compiled_first_call_s": compiled_first,
        "speedup": speedup,
        "table": {"columns": ["", "step time ± IQR", "first call", "speed-up"], "rows": rows},
        "notes": notes,
    }


# --------------------------------------------------------------------------------------------
# 4. Evaluation without autograd
# --------------------------------------------------------------------------------------------


def peak_memory(fn: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """Peak and held bytes allocated by torch while `fn` runs (its result is kept alive).

    CUDA: the caching allocator's statistics. CPU: the profiler's memory events (the torch
    CPU allocator's running total, read from a Chrome trace). "held" is what the result
    keeps alive afterwards: with autograd on, that is the graph's saved activations.
    """
    if device.type == "cuda":
        utils.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        result = fn()
        utils.synchronize(device)
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
            with mode(), utils.autocast(ctx.device, ctx.config.precision):
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
        peak = "n/a" if r["peak_bytes"] is None else fmt_bytes(r["peak_bytes"])
        held = "n/a" if r["held_bytes"] is None else fmt_bytes(r["held_bytes"])
        rows.append([name, fmt_timing(r["time"]), f"{ratio(r['time'], base):.2f}", peak, held])
    return {
        "modes": results,
        "table": {
            "columns": [
                "mode (model.eval())",
                "forward ± IQR",
                "time vs inference_mode",
                "peak memory",
                "held by output",
            ],
            "rows": rows,
        },
        "notes": [
            f"memory: {results['inference_mode']['source']}; one forward of a "
            f"batch of {ctx.config.batch_size}"
        ],
    }


# --------------------------------------------------------------------------------------------
# 5. Debug switches
# --------------------------------------------------------------------------------------------


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
    clip = ctx.config.grad_clip if ctx.config.grad_clip is not None else 1.0
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
    rows = [["all off", fmt_timing(off), "1.00"]]
    rows += [[name, fmt_timing(t), f"{ratio(t, off):.2f}"] for name, t in switches.items()]
    notes = []
    if unsupported:
        notes.append(
            "deterministic mode: ops without a deterministic kernel ran their default "
            "kernel (warn_only): " + "; ".join(unsupported)
        )
    return {
        "off": off,
        "on": switches,
        "ratios": {name: ratio(t, off) for name, t in switches.items()},
        "table": {
            "columns": ["switch on (others off)", "step time ± IQR", "vs all off"],
            "rows": rows,
        },
        "notes": notes,
    }


# --------------------------------------------------------------------------------------------
# 6. Training loop vs bare loop
# --------------------------------------------------------------------------------------------


Stamp = tuple[float, float]  # (wall clock, this process's CPU time) after an optimizer step


def stamp() -> Stamp:
    return time.perf_counter(), time.process_time()


def step_intervals(stamps: list[Stamp], skip: int) -> list[Stamp]:
    """Per-step (wall, CPU) durations, leaving out the first `skip` steps (warm-up)."""
    pairs = zip(stamps[skip:], stamps[skip + 1 :], strict=False)
    return [(b[0] - a[0], b[1] - a[1]) for a, b in pairs]


def section_loop_overhead(ctx: Context) -> dict[str, Any]:
    from .train import lr_factor, train

    warmup = 3
    total_steps = ctx.loop_steps + warmup + 1
    config = ctx.config
    train_set = ctx.train_set
    steps_per_epoch = len(train_set) // config.batch_size // config.grad_accum_steps  # type: ignore[arg-type]
    if steps_per_epoch < 1:
        raise Skip("the training set is smaller than one optimizer step")
    run_dir = ctx.out / "loop-run"
    loop_config = dataclasses.replace(
        config,
        compile="off",
        epochs=math.ceil(total_steps / steps_per_epoch),
        max_steps_per_epoch=min(total_steps, steps_per_epoch),
        run_dir=str(run_dir),
        resume=None,
        progress=False,
    )

    # The bare loop: same initial weights, same data and loader settings, same precision,
    # clipping and learning-rate schedule (a different schedule gives different weights, and
    # on a CPU the values can change the speed), no logging, metrics or checkpoints.
    schedule_steps = loop_config.epochs * (loop_config.max_steps_per_epoch or steps_per_epoch)
    workers = utils.resolve_num_workers(config.num_workers, in_memory=True)

    def bare_loop() -> tuple[Callable[[int], list[Stamp]], Iterator[Any]]:
        """A paused-and-resumed bare run: `run(n)` does the next n steps of the same run."""
        utils.seed_everything(config.seed)
        loader = utils.build_dataloader(
            train_set,
            batch_size=config.batch_size,
            train=True,
            num_workers=workers,
            generator=torch.Generator().manual_seed(config.seed),
            device=ctx.device,
        )
        model = build_model_for(config, ctx.info).to(ctx.device)
        model.train()
        optimizer = make_optimizer(model, config, ctx.device)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            functools.partial(lr_factor, warmup=config.warmup_steps, total=schedule_steps),
        )
        scaler = utils.make_grad_scaler(ctx.device, config.precision)
        batches = endless(loader)

        def run(steps: int) -> list[Stamp]:
            stamps = [stamp()]  # the start: the first interval is the first step
            for _ in range(steps):
                for _ in range(config.grad_accum_steps):
                    inputs, targets = utils.to_device(next(batches), ctx.device)
                    with utils.autocast(ctx.device, config.precision):
                        loss = F.cross_entropy(model(inputs), targets) / config.grad_accum_steps
                    scaler.scale(loss).backward()
                if config.grad_clip is not None:
                    utils.clip_gradients(
                        model.parameters(), config.grad_clip, scaler=scaler, optimizer=optimizer
                    )
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                utils.synchronize(ctx.device)
                stamps.append(stamp())
            return stamps

        return run, batches

    stamps: list[Stamp] = []

    def on_step(_: int) -> None:
        utils.synchronize(ctx.device)
        stamps.append(stamp())

    # The bare run does its first half of the steps before train() and the rest after, as
    # one run paused in between: a machine that speeds up or slows down during the section
    # biases neither side, and both loops time the same step numbers (on a CPU the step's
    # values, which change as training goes on, can change its speed).
    run_bare, bare_batches = bare_loop()
    first_half = ctx.loop_steps // 2
    # train()'s first stamp comes after its step 1, the bare run's before its step 1: one
    # more skipped interval here makes both start at the same step.
    bare = step_intervals(run_bare(first_half + warmup + 1), warmup + 1)
    shutil.rmtree(run_dir, ignore_errors=True)  # a scratch run: an earlier one is not kept
    with contextlib.redirect_stdout(io.StringIO()):
        train(loop_config, on_step=on_step)
    if len(stamps) < warmup + 3:
        raise Skip(f"train() reported only {len(stamps)} steps")
    stamps = stamps[:total_steps]
    # The first step after the pause runs with caches that train() evicted: left out.
    bare += step_intervals(run_bare(ctx.loop_steps - first_half + 1), 1)
    bare_batches.close()

    loop_steps = step_intervals(stamps, warmup)
    loop = quartiles([wall for wall, _ in loop_steps])
    reference = quartiles([wall for wall, _ in bare])
    # With one torch thread, CPU time per step barely moves when other programs compete for
    # the cores (wall time does): on a busy machine it is the steadier view of the loop's
    # own cost. With several threads it also counts the time they spin waiting for each other.
    loop_cpu = quartiles([cpu for _, cpu in loop_steps])
    bare_cpu = quartiles([cpu for _, cpu in bare])
    cpu_ratio = loop_cpu["median"] / bare_cpu["median"] if bare_cpu["median"] > 0 else None
    overhead = loop["median"] / reference["median"]

    def as_timing(stats: dict[str, float]) -> dict[str, float]:
        return {"median_s": stats["median"], "iqr_s": stats["iqr"], "runs": stats["n"]}

    cpu_text = "n/a" if cpu_ratio is None else f"{cpu_ratio:.3f}"
    rows = [
        [
            "train.train (on_step)",
            fmt_timing(as_timing(loop)),
            f"{overhead:.3f}",
            fmt_timing(as_timing(loop_cpu)),
            cpu_text,
        ],
        [
            "bare loop",
            fmt_timing(as_timing(reference)),
            "1.000",
            fmt_timing(as_timing(bare_cpu)),
            "1.000",
        ],
    ]
    verdict = "within" if overhead <= 1.05 else "above"
    return {
        "steps": loop["n"],
        "workers": workers,
        "loop": as_timing(loop),
        "bare": as_timing(reference),
        "ratio": overhead,
        "overhead_per_step_s": loop["median"] - reference["median"],
        "target": 1.05,
        "cpu_time": {"loop": as_timing(loop_cpu), "bare": as_timing(bare_cpu), "ratio": cpu_ratio},
        "table": {
            "columns": ["", "median step ± IQR", "ratio", "CPU time/step ± IQR", "CPU ratio"],
            "rows": rows,
        },
        "notes": [
            f"median step-time ratio {overhead:.3f}: {verdict} the 1.05 target; the loop "
            f"adds {fmt_time(loop['median'] - reference['median'])} per step "
            f"({loop['n']} steps each after {warmup} warm-up, the same step numbers in both; "
            f"the bare run was paused around train(); compile and progress bar off in both; "
            f"{workers} workers)",
            "CPU time is this process's (all its threads, not DataLoader workers); with one "
            "torch thread other programs barely move it, with several their waiting counts too",
        ],
    }


# --------------------------------------------------------------------------------------------
# 7. Throughput and MFU
# --------------------------------------------------------------------------------------------


def peak_tflops(device: torch.device) -> tuple[float | None, str]:
    if device.type != "cuda":
        return None, f"no peak table for {device.type}"
    name = torch.cuda.get_device_name(device)
    for pattern, peak in PEAK_BF16_TFLOPS:
        if re.search(pattern, name):
            return peak, name
    return None, f"{name} is not in PEAK_BF16_TFLOPS"


def count_step_flops(ctx: Context) -> int:
    """FLOPs of one forward + backward on the batch (the optimizer is not counted, as in MFU)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = fresh_model(ctx)
    inputs, targets = device_batch(ctx)
    with FlopCounterMode(display=False) as counter:
        with utils.autocast(ctx.device, ctx.config.precision):
            loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
    return counter.get_total_flops()


def section_throughput(ctx: Context) -> dict[str, Any]:
    config = ctx.config
    loop = ctx.results.get(6, {})
    if loop.get("status") == "measured":
        step, source = loop["loop"], "training loop (section 6)"
        samples = config.batch_size * config.grad_accum_steps
    else:
        inputs, targets = device_batch(ctx)
        bare = make_step(fresh_model(ctx), ctx)
        step, source = measure(lambda: bare(inputs, targets), ctx), "bare step on one batch"
        samples = config.batch_size
    median = step["median_s"]
    rate = samples / median
    # The IQR of a rate, from the step-time quartiles (rate falls as time rises).
    low = samples / (median + step["iqr_s"] / 2)
    high = samples / max(median - step["iqr_s"] / 2, 1e-12)
    flops = count_step_flops(ctx) * (samples // config.batch_size)
    achieved = flops / median / 1e12
    peak, device_name = peak_tflops(ctx.device)
    mfu: float | str = achieved / peak if peak else "unknown"
    rows = [
        ["samples/s", f"{rate:.1f} (IQR {low:.1f}-{high:.1f})"],
        ["step time", fmt_timing(step)],
        ["FLOPs per step (fwd+bwd)", f"{flops / 1e9:.3f} GFLOP"],
        ["achieved", f"{achieved:.4f} TFLOP/s"],
        [
            "MFU (vs bf16 dense peak)",
            f"{mfu:.2%} of {peak:g} TFLOP/s ({device_name})"
            if peak
            else f"unknown ({device_name})",
        ],
    ]
    return {
        "step_source": source,
        "samples_per_step": samples,
        "samples_per_s": rate,
        "samples_per_s_iqr": [low, high],
        "step": step,
        "flops_per_step": flops,
        "achieved_tflops": achieved,
        "peak_bf16_tflops": peak,
        "device_name": device_name,
        "mfu": mfu,
        "table": {"columns": ["", "value"], "rows": rows},
        "notes": [
            f"step time from the {source}; precision {config.precision}; FLOPs counted "
            "by torch.utils.flop_counter.FlopCounterMode"
        ],
    }


# --------------------------------------------------------------------------------------------
# Running, reporting
# --------------------------------------------------------------------------------------------

RUNNERS: dict[int, Callable[[Context], dict[str, Any]]] = {
    1: section_workers,
    2: section_pin_memory,
    3: section_compile,
    4: section_evaluation,
    5: section_debug_switches,
    6: section_loop_overhead,
    7: section_throughput,
}


def run_section(number: int, ctx: Context, selected: set[int]) -> dict[str, Any]:
    key, title = SECTIONS[number]
    head: dict[str, Any] = {"id": number, "key": key, "title": title}
    if number not in selected:
        return {**head, "status": "skipped", "reason": "not selected (--sections)"}
    start = time.perf_counter()
    try:
        body = RUNNERS[number](ctx)
    except Skip as reason:
        return {**head, "status": "skipped", "reason": str(reason)}
    except Exception as error:  # report it and go on: the other sections still mean something
        return {**head, "status": "failed", "reason": f"{type(error).__name__}: {error}"}
    return {**head, "status": "measured", "seconds": time.perf_counter() - start, **body}


def print_section(section: dict[str, Any]) -> None:
    print(f"\n{section['id']}. {section['title']}")
    if section["status"] != "measured":
        print(f"   {section['status']}: {section['reason']}")
        return
    table = section["table"]
    lines = [table["columns"], *table["rows"]]
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(table["columns"]))]
    for index, line in enumerate(lines):
        cells = (str(cell).ljust(width) for cell, width in zip(line, widths, strict=True))
        print(("   " + "  ".join(cells)).rstrip())
        if index == 0:
            print("   " + "  ".join("-" * width for width in widths))
    for note in section.get("notes", []):
        print(f"   note: {note}")


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def describe_machine(device: torch.device, quick: bool) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "cpu": cpu_model(),
        "cpus_available": utils.available_cpus(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "quick": quick,
        "load_average_at_start": load_average(),
    }


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): how busy the machine was."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_note(load: float | None, cpus: int) -> str | None:
    if load is None or load < 0.5 * cpus:
        return None
    return (
        f"note: load average {load:.1f} on {cpus} CPUs: other programs compete for the CPU, "
        "so timings are noisy (compare the IQRs before trusting a ratio); multi-threaded "
        "kernels suffer most, as their threads wait for each other"
    )


def write_chart(report: dict[str, Any], path: Path) -> str:
    """A PNG with the worker sweep and every on/off ratio; a note when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install matplotlib, or the 'plot' extra)"
    sections = {s["id"]: s for s in report["sections"] if s["status"] == "measured"}
    ratios: dict[str, float] = {}
    if 3 in sections:
        ratios["compiled / eager"] = 1 / sections[3]["speedup"]
    if 2 in sections:
        ratios["pinned / pageable (copy + step)"] = 1 / sections[2]["step"]["speedup"]
    if 4 in sections:
        base = sections[4]["modes"]["inference_mode"]["time"]
        for name in ("no_grad", "grad enabled"):
            ratios[f"{name} / inference_mode"] = ratio(sections[4]["modes"][name]["time"], base)
    if 5 in sections:
        ratios.update({f"{name} on / off": value for name, value in sections[5]["ratios"].items()})
    if 6 in sections:
        ratios["train loop / bare loop"] = sections[6]["ratio"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    if 1 in sections:
        sweep = sections[1]["sweep"]
        left.bar(
            [str(r["workers"]) for r in sweep],
            [r["samples_per_s"] for r in sweep],
            yerr=[r["iqr_samples_per_s"] / 2 for r in sweep],
            capsize=4,
        )
        left.set_xlabel("DataLoader workers")
        left.set_ylabel("samples/s (bar: median, whisker: IQR)")
        left.set_title("1. workers, on-disk images")
    right.barh(list(ratios), list(ratios.values()))
    right.axvline(1.0, color="black", linewidth=1)
    right.set_xlabel("median time ratio (below 1: faster than the baseline)")
    right.set_title("time ratios measured in this run")
    figure.suptitle(f"{report['machine']['device_name']} ({report['machine']['date']})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return f"chart: {path}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument(
        "--out",
        type=Path,
        default=Path("runs/benchmark"),
        help="folder for benchmark.json and benchmark.png",
    )
    group.add_argument(
        "--quick",
        action="store_true",
        help="a run of seconds (tests, smoke checks); numbers are rough",
    )
    group.add_argument(
        "--sections", default="1,2,3,4,5,6,7", help="comma-separated section numbers to run"
    )
    group.add_argument(
        "--min-run-time",
        type=float,
        default=argparse.SUPPRESS,  # no "(default: None)": the default depends on --quick
        help="seconds each timing runs (default 0.05 with --quick, 1.0 otherwise)",
    )
    group.add_argument(
        "--loop-steps",
        type=int,
        default=argparse.SUPPRESS,
        help="measured steps per loop in section 6 (default 8 quick, 40 otherwise)",
    )


def parse_sections(text: str, parser: argparse.ArgumentParser) -> set[int]:
    try:
        chosen = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        chosen = set()
    if not chosen or not chosen <= set(SECTIONS):
        parser.error(f"--sections must be numbers from 1 to 7 separated by commas, got {text!r}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = build_parser("Measure what each technique buys on this machine.")
    add_arguments(parser)
    config, args = parse_config(argv, parser=parser)
    selected = parse_sections(args.sections, parser)
    args.min_run_time = getattr(args, "min_run_time", None)
    args.loop_steps = getattr(args, "loop_steps", None)
    if args.min_run_time is not None and args.min_run_time <= 0:
        parser.error(f"--min-run-time must be > 0, got {args.min_run_time}")
    if args.loop_steps is not None and args.loop_steps < 2:
        parser.error(f"--loop-steps must be >= 2, got {args.loop_steps}")
    try:
        device = utils.resolve_device(config.device)
    except ValueError as error:
        parser.error(str(error))
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(config.data_dir) if config.data_dir is not None else None
    if data_dir is not None:
        try:  # a --data-dir given on purpose must be readable: say so now, not in section 1
            build_datasets(config)
        except ValueError as error:
            parser.error(str(error))

    utils.seed_everything(config.seed)
    torch.backends.cudnn.benchmark = config.cudnn_benchmark
    # Sections 2-7 time the model, not the disk: they use the synthetic in-memory data.
    synthetic = dataclasses.replace(config, data_dir=None)
    train_set, _, info = build_datasets(synthetic)
    loader = DataLoader(train_set, batch_size=config.batch_size, shuffle=False)
    batch = next(iter(loader))
    base_model = build_model_for(config, info)
    ctx = Context(
        config=synthetic,
        device=device,
        quick=args.quick,
        min_run_time=args.min_run_time or (0.05 if args.quick else 1.0),
        loop_steps=args.loop_steps or (8 if args.quick else 40),
        min_runs=3 if args.quick else MIN_RUNS,
        warmup=1 if args.quick else 2,
        out=out,
        data_dir=data_dir,
        batch=(batch[0], batch[1]),
        base_model=base_model,
        info=info,
        train_set=train_set,
    )
    machine = describe_machine(device, args.quick)
    print(
        f"benchmark on {machine['device_name']} ({device}), {machine['cpus_available']} CPUs, "
        f"{machine['torch_threads']} torch threads, torch {machine['torch']}, "
        f"{machine['date']}{' (--quick)' if args.quick else ''}"
    )
    print(
        f"model {config.model} width {config.width}, batch {config.batch_size}, "
        f"image {config.image_size}, precision {config.precision}; "
        "each time is median ± IQR"
    )
    note = busy_note(machine["load_average_at_start"], machine["cpus_available"])
    if note:
        print(note)
    sections = []
    for number in SECTIONS:
        section = run_section(number, ctx, selected)
        ctx.results[number] = section
        print_section(section)
        sections.append(section)
    machine["load_average_at_end"] = load_average()
    report = {"machine": machine, "config": config.to_dict(), "sections": sections}
    path = out / "benchmark.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"\nresults: {path}")
    if machine["load_average_at_end"] is not None:
        print(
            f"load average: {machine['load_average_at_start']:.1f} at start, "
            f"{machine['load_average_at_end']:.1f} at end (this run counts for up to "
            f"{machine['torch_threads']}) on {machine['cpus_available']} CPUs"
        )
    print(write_chart(report, out / "benchmark.png"))
    failed = [s for s in sections if s["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
