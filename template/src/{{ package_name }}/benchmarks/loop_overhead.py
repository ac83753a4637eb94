"""6. The real training loop (`train.train`) versus a bare loop over the same model and data.

The two run in lockstep, one step each in turn: after each of train()'s optimizer steps its
`on_step` hook times that step and then runs the bare loop's step of the same number. Both
sides of every pair see the same moment of the machine. Timing whole runs one after the
other (in alternating rounds) was not enough here: on a shared 2-CPU machine the ratio of
four such benchmark runs read 0.95, 1.05, 1.15 and 1.31, each with a tight spread of its
own, while four lockstep runs read 0.994, 1.034, 1.019 and 1.015.
"""

from __future__ import annotations

import contextlib
import io
import math
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

from .. import utils
from ..config import Config
from ..runtime import accelerator
from ..train import build_model_for  # model.build_model_for, or one line on what to add
from ..training.task import loss_function
from .timing import (
    Context,
    Skip,
    compare_rounds,
    endless,
    fmt_ratio,
    fmt_time,
    fmt_timing,
    make_optimizer,
    quartiles,
    train_loader,
)

Stamp = tuple[float, float]  # (wall clock, this process's CPU time)


def stamp() -> Stamp:
    return time.perf_counter(), time.process_time()


def since(start: Stamp) -> Stamp:
    now = stamp()
    return now[0] - start[0], now[1] - start[1]


def section_loop_overhead(ctx: Context) -> dict[str, Any]:
    warmup = 3
    rounds = 2 if ctx.quick else max(2, ctx.min_runs)
    wanted = warmup + 1 + rounds * ctx.loop_steps
    loop_config, epoch_steps = _loop_config(ctx, wanted)
    workers = utils.resolve_num_workers(ctx.config.data.num_workers, in_memory=True)
    pairs = _lockstep(ctx, loop_config, epoch_steps, workers)
    steps = [step for step in sorted(pairs) if step > warmup + 1][: rounds * ctx.loop_steps]
    timed = [pairs[step] for step in steps]
    if len(timed) < 2 * rounds:
        raise Skip(f"train() reported only {len(timed)} timed steps")
    # Rounds are consecutive blocks of steps; each gives the ratio of its two medians.
    size = len(timed) // rounds
    timed = timed[: size * rounds]
    blocks = [timed[index * size : (index + 1) * size] for index in range(rounds)]
    round_medians: dict[str, list[float]] = {
        f"{which}{kind}": [statistics.median(pair[side][part] for pair in b) for b in blocks]
        for side, which in enumerate(("loop", "bare"))
        for part, kind in enumerate(("", "_cpu"))
    }
    result = _report(timed, round_medians, steps[: size * rounds], rounds=rounds, workers=workers)
    low, high = result["ratio_rounds"]["spread"]
    loop, reference = result["loop"], result["bare"]
    result["notes"] = [
        f"step-time ratio {result['ratio']:.3f}, {low:.3f}-{high:.3f} across {rounds} "
        f"blocks of {size} steps: {_verdict(result['ratio_rounds'])}; the loop adds "
        f"{fmt_time(loop['median_s'] - reference['median_s'])} per step (the two loops in "
        f"lockstep, one step each in turn, after {warmup} warm-up steps; steps after an "
        f"epoch's end left out; compile and progress bar off in both; {workers} workers)",
        "CPU time is this process's (all its threads, not DataLoader workers); with one "
        "torch thread other programs barely move it, with several their waiting counts too",
    ]
    return result


def _loop_config(ctx: Context, wanted: int) -> tuple[Config, int]:
    """train()'s config for `wanted` timed steps, and its steps per epoch."""
    config = ctx.config
    step_samples = config.optim.batch_size * config.optim.grad_accum_steps
    steps_per_epoch = len(ctx.train_set) // step_samples  # type: ignore[arg-type]
    if steps_per_epoch < 1:
        raise Skip("the training set is smaller than one optimizer step")
    # One step after each epoch's end is not timed (see `on_step`): that many more steps.
    total_steps = wanted + wanted // steps_per_epoch + 1
    epoch_steps = min(total_steps, steps_per_epoch)
    loop_config = config.in_epochs(
        compile="off",
        epochs=math.ceil(total_steps / epoch_steps),
        max_steps_per_epoch=epoch_steps,
        run_dir=str(ctx.out / "loop-run"),
        resume=None,
        progress=False,
        tracker="none",  # the loop alone: a tracker's I/O is not what is measured
    )
    return loop_config, epoch_steps


def _bare_loop(ctx: Context, schedule_steps: int, workers: int) -> tuple[Callable[[], None], Any]:
    """(one step of the bare loop, its endless batches to close).

    Same initial weights, same data and loader settings, same precision, clipping and
    learning-rate schedule as train() (a different schedule gives different weights, and on a
    CPU the values can change the speed); no logging, metrics or checkpoints.
    """
    from ..train import build_scheduler

    config = ctx.config
    utils.seed_everything(config.run.seed)
    loader = train_loader(ctx, ctx.train_set, workers)
    model = build_model_for(config, ctx.info).to(ctx.device)
    model.train()
    optimizer = make_optimizer(model, config, ctx.device)
    scheduler = build_scheduler(config, optimizer, schedule_steps)
    loss_fn = loss_function()  # the registered loss (slots.py), as train() uses
    scaler = accelerator.make_grad_scaler(ctx.device, config.speed.precision)
    batches = endless(loader)

    def bare_step() -> None:
        for _ in range(config.optim.grad_accum_steps):
            inputs, targets = utils.to_device(next(batches), ctx.device)
            with accelerator.autocast(ctx.device, config.speed.precision):
                logits, labels = ctx.task.outputs(model, inputs, targets)
                loss = loss_fn(logits, labels) / config.optim.grad_accum_steps
            scaler.scale(loss).backward()
        if config.optim.grad_clip is not None:
            utils.clip_gradients(
                model.parameters(), config.optim.grad_clip, scaler=scaler, optimizer=optimizer
            )
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        accelerator.synchronize(ctx.device)

    return bare_step, batches


def _lockstep(
    ctx: Context, loop_config: Config, epoch_steps: int, workers: int
) -> dict[int, tuple[Stamp, Stamp]]:
    """Run train() with the bare loop's step in its `on_step`: {step: (loop time, bare time)}.

    train()'s step is timed from the end of the previous pair's bare step to its own on_step
    call. Steps right after an epoch's end also hold its evaluation and checkpoint: left out,
    the figure is per step.
    """
    from ..train import train

    bare_step, batches = _bare_loop(ctx, loop_config.optim.epochs * epoch_steps, workers)
    pairs: dict[int, tuple[Stamp, Stamp]] = {}
    last: list[Stamp] = []

    def on_step(step: int) -> None:
        accelerator.synchronize(ctx.device)
        loop_time = since(last[0]) if last else None
        started = stamp()
        bare_step()
        bare_time = since(started)
        if loop_time is not None and (step - 1) % epoch_steps != 0:
            pairs[step] = (loop_time, bare_time)
        last[:] = [stamp()]

    # A scratch run: an earlier one is not kept.
    shutil.rmtree(loop_config.run.run_dir, ignore_errors=True)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            train(loop_config, on_step=on_step)
    finally:
        batches.close()
    return pairs


def _report(
    timed: list[tuple[Stamp, Stamp]],
    round_medians: dict[str, list[float]],
    timed_steps: list[int],
    *,
    rounds: int,
    workers: int,
) -> dict[str, Any]:
    """The section's record: wall and CPU-time quartiles, their ratios and the table."""
    loop = _as_timing(quartiles([loop_time[0] for loop_time, _ in timed]))
    reference = _as_timing(quartiles([bare_time[0] for _, bare_time in timed]))
    comparison = compare_rounds(round_medians["loop"], round_medians["bare"])
    # With one torch thread, CPU time per step barely moves when other programs compete for
    # the cores (wall time does): on a busy machine it is the steadier view of the loop's
    # own cost. With several threads it also counts the time they spin waiting for each other.
    loop_cpu = _as_timing(quartiles([loop_time[1] for loop_time, _ in timed]))
    bare_cpu = _as_timing(quartiles([bare_time[1] for _, bare_time in timed]))
    cpu_comparison = (
        compare_rounds(round_medians["loop_cpu"], round_medians["bare_cpu"])
        if min(round_medians["bare_cpu"]) > 0
        else None
    )
    cpu_text = "n/a" if cpu_comparison is None else fmt_ratio(cpu_comparison, 3)
    rows = [
        [
            "train.train (on_step)",
            fmt_timing(loop),
            fmt_ratio(comparison, 3),
            fmt_timing(loop_cpu),
            cpu_text,
        ],
        ["bare loop", fmt_timing(reference), "1.000", fmt_timing(bare_cpu), "1.000"],
    ]
    columns = ["", "median step ± IQR", "ratio (spread)", "CPU time/step ± IQR"]
    return {
        "steps": len(timed) // rounds,
        "pairing": "lockstep",
        "timed_steps": timed_steps,
        "rounds": rounds,
        "workers": workers,
        "loop": loop,
        "bare": reference,
        "ratio": comparison["ratio"],
        "ratio_rounds": comparison,
        "overhead_per_step_s": loop["median_s"] - reference["median_s"],
        "target": 1.05,
        "cpu_time": {
            "loop": loop_cpu,
            "bare": bare_cpu,
            "ratio": None if cpu_comparison is None else cpu_comparison["ratio"],
            "ratio_rounds": cpu_comparison,
        },
        "table": {"columns": [*columns, "CPU ratio (spread)"], "rows": rows},
    }


def _as_timing(stats: dict[str, float]) -> dict[str, float]:
    return {"median_s": stats["median"], "iqr_s": stats["iqr"], "runs": stats["n"]}


def _verdict(comparison: dict[str, Any]) -> str:
    low, high = comparison["spread"]
    if comparison["within_noise"]:
        return "within noise of 1 (no measurable overhead)"
    if high <= 1.05:
        return "within the 1.05 target"
    if low > 1.05:
        return "above the 1.05 target"
    return "spread across the 1.05 target: rerun on a quieter machine"
