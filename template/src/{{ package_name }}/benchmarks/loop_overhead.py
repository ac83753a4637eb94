"""6. The real training loop (`train.train`) versus a bare loop over the same model and data."""

from __future__ import annotations

import contextlib
import functools
import io
import math
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .. import utils
from ..train import build_model_for  # model.build_model_for, or one line on what to add
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

Stamp = tuple[float, float]  # (wall clock, this process's CPU time) after an optimizer step


def stamp() -> Stamp:
    return time.perf_counter(), time.process_time()


def step_intervals(stamps: list[Stamp], skip: int) -> list[Stamp]:
    """Per-step (wall, CPU) durations, leaving out the first `skip` steps (warm-up)."""
    pairs = zip(stamps[skip:], stamps[skip + 1 :], strict=False)
    return [(b[0] - a[0], b[1] - a[1]) for a, b in pairs]


def section_loop_overhead(ctx: Context) -> dict[str, Any]:
    from ..train import lr_factor, train

    warmup = 3
    total_steps = ctx.loop_steps + warmup + 1
    config = ctx.config
    train_set = ctx.train_set
    steps_per_epoch = len(train_set) // config.optim.batch_size // config.optim.grad_accum_steps  # type: ignore[arg-type]
    if steps_per_epoch < 1:
        raise Skip("the training set is smaller than one optimizer step")
    run_dir = ctx.out / "loop-run"
    loop_config = config.replace(
        compile="off",
        epochs=math.ceil(total_steps / steps_per_epoch),
        max_steps_per_epoch=min(total_steps, steps_per_epoch),
        run_dir=str(run_dir),
        resume=None,
        progress=False,
        tracker="none",  # the loop alone: a tracker's I/O is not what is measured
    )

    # The bare loop: same initial weights, same data and loader settings, same precision,
    # clipping and learning-rate schedule (a different schedule gives different weights, and
    # on a CPU the values can change the speed), no logging, metrics or checkpoints.
    schedule_steps = loop_config.optim.epochs * (
        loop_config.optim.max_steps_per_epoch or steps_per_epoch
    )
    workers = utils.resolve_num_workers(config.data.num_workers, in_memory=True)

    def bare_loop() -> tuple[Callable[[int], list[Stamp]], Iterator[Any]]:
        """A fresh bare run: `run(n)` does its next n steps."""
        utils.seed_everything(config.run.seed)
        loader = train_loader(ctx, train_set, workers)
        model = build_model_for(config, ctx.info).to(ctx.device)
        model.train()
        optimizer = make_optimizer(model, config, ctx.device)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            functools.partial(lr_factor, warmup=config.optim.warmup_steps, total=schedule_steps),
        )
        scaler = utils.make_grad_scaler(ctx.device, config.speed.precision)
        batches = endless(loader)

        def run(steps: int) -> list[Stamp]:
            stamps = [stamp()]  # the start: the first interval is the first step
            for _ in range(steps):
                for _ in range(config.optim.grad_accum_steps):
                    inputs, targets = utils.to_device(next(batches), ctx.device)
                    with utils.autocast(ctx.device, config.speed.precision):
                        logits, labels = ctx.task.outputs(model, inputs, targets)
                        loss = F.cross_entropy(logits, labels) / config.optim.grad_accum_steps
                    scaler.scale(loss).backward()
                if config.optim.grad_clip is not None:
                    utils.clip_gradients(
                        model.parameters(),
                        config.optim.grad_clip,
                        scaler=scaler,
                        optimizer=optimizer,
                    )
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                utils.synchronize(ctx.device)
                stamps.append(stamp())
            return stamps

        return run, batches

    def run_loop() -> list[Stamp]:
        stamps: list[Stamp] = []

        def on_step(_: int) -> None:
            utils.synchronize(ctx.device)
            stamps.append(stamp())

        shutil.rmtree(run_dir, ignore_errors=True)  # a scratch run: an earlier one is not kept
        with contextlib.redirect_stdout(io.StringIO()):
            train(loop_config, on_step=on_step)
        if len(stamps) < warmup + 3:
            raise Skip(f"train() reported only {len(stamps)} steps")
        return step_intervals(stamps[:total_steps], warmup)

    def run_bare() -> list[Stamp]:
        run, batches = bare_loop()
        # train()'s first stamp comes after its step 1, the bare run's before its step 1: one
        # more skipped interval here makes both time the same step numbers (on a CPU the
        # step's values, which change as training goes on, can change its speed).
        intervals = step_intervals(run(total_steps), warmup + 1)
        batches.close()
        return intervals

    # Interleaved rounds, each a fresh run of both loops, in alternating order (bare first,
    # then the loop first, ...): a machine that speeds up or slows down during the section
    # biases neither side, and the spread across rounds says how far one run's ratio can be
    # trusted. Each round's ratio is of its two median step times.
    rounds = 2 if ctx.quick else max(2, ctx.min_runs)
    loop_steps: list[Stamp] = []
    bare: list[Stamp] = []
    round_medians: dict[str, list[float]] = {"loop": [], "bare": [], "loop_cpu": [], "bare_cpu": []}
    for index in range(rounds):
        measured = {}
        for which in ("bare", "loop") if index % 2 == 0 else ("loop", "bare"):
            measured[which] = run_bare() if which == "bare" else run_loop()
        loop_steps += measured["loop"]
        bare += measured["bare"]
        for which in ("loop", "bare"):
            round_medians[which].append(statistics.median(w for w, _ in measured[which]))
            round_medians[f"{which}_cpu"].append(statistics.median(c for _, c in measured[which]))

    loop = quartiles([wall for wall, _ in loop_steps])
    reference = quartiles([wall for wall, _ in bare])
    comparison = compare_rounds(round_medians["loop"], round_medians["bare"])
    overhead = comparison["ratio"]
    # With one torch thread, CPU time per step barely moves when other programs compete for
    # the cores (wall time does): on a busy machine it is the steadier view of the loop's
    # own cost. With several threads it also counts the time they spin waiting for each other.
    loop_cpu = quartiles([cpu for _, cpu in loop_steps])
    bare_cpu = quartiles([cpu for _, cpu in bare])
    cpu_comparison = (
        compare_rounds(round_medians["loop_cpu"], round_medians["bare_cpu"])
        if min(round_medians["bare_cpu"]) > 0
        else None
    )

    def as_timing(stats: dict[str, float]) -> dict[str, float]:
        return {"median_s": stats["median"], "iqr_s": stats["iqr"], "runs": stats["n"]}

    cpu_text = "n/a" if cpu_comparison is None else fmt_ratio(cpu_comparison, 3)
    rows = [
        [
            "train.train (on_step)",
            fmt_timing(as_timing(loop)),
            fmt_ratio(comparison, 3),
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
    low, high = comparison["spread"]
    if comparison["within_noise"]:
        verdict = "within noise of 1 (no measurable overhead)"
    elif high <= 1.05:
        verdict = "within the 1.05 target"
    elif low > 1.05:
        verdict = "above the 1.05 target"
    else:
        verdict = "spread across the 1.05 target: rerun on a quieter machine"
    return {
        "steps": ctx.loop_steps,
        "rounds": rounds,
        "workers": workers,
        "loop": as_timing(loop),
        "bare": as_timing(reference),
        "ratio": overhead,
        "ratio_rounds": comparison,
        "overhead_per_step_s": loop["median"] - reference["median"],
        "target": 1.05,
        "cpu_time": {
            "loop": as_timing(loop_cpu),
            "bare": as_timing(bare_cpu),
            "ratio": None if cpu_comparison is None else cpu_comparison["ratio"],
            "ratio_rounds": cpu_comparison,
        },
        "table": {
            "columns": [
                "",
                "median step ± IQR",
                "ratio (spread)",
                "CPU time/step ± IQR",
                "CPU ratio (spread)",
            ],
            "rows": rows,
        },
        "notes": [
            f"step-time ratio {overhead:.3f}, {low:.3f}-{high:.3f} across {rounds} interleaved "
            f"rounds: {verdict}; the loop adds "
            f"{fmt_time(loop['median'] - reference['median'])} per step ({ctx.loop_steps} "
            f"steps per round after {warmup} warm-up, the same step numbers in both; compile "
            f"and progress bar off in both; {workers} workers)",
            "CPU time is this process's (all its threads, not DataLoader workers); with one "
            "torch thread other programs barely move it, with several their waiting counts too",
        ],
    }
