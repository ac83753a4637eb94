"""Profile a few steps of the real training loop: `python -m <package>.profiling --help`.

Runs `train.train` (same flags as training) under `torch.profiler` for
`--profile-wait` + `--profile-warmup` + `--profile-steps` optimizer steps, then:

- writes a Chrome trace, `<out>/trace.json`: open it at https://ui.perfetto.dev (or
  chrome://tracing). The training loop labels every step's phases `data`, `forward`,
  `backward`, `sync` and `optimizer`, so they show up as named ranges above the operators;
- prints the operators that took the most time of their own (device time on an accelerator,
  CPU time otherwise), also saved as `<out>/top_operators.txt`;
- prints how the step time splits between the phases, above all the share spent waiting for
  data: a large share means the GPU/CPU idles while the DataLoader catches up (raise
  `--num-workers`, see `python -m <package>.benchmark`);
- with `--memory-snapshot` on CUDA, records every allocation and writes
  `<out>/memory_snapshot.pickle` for https://pytorch.org/memory_viz.

The wait steps absorb one-time costs (worker start-up, torch.compile, cuDNN autotuning) and
the warm-up steps let the profiler settle; only the active steps are recorded. Checkpoints of
the profiled run go to `<out>/run`, never to your `--run-dir`.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from . import utils
from .config import Config
from .runtime import accelerator, exits
from .settings.parsing import build_parser, parse_config
from .training.task import task_for

# "sync" is the finite-loss check: on the device in one process; under torchrun the step's one
# host sync, where on a GPU it absorbs the wait for the queued forward and backward kernels.
PHASES = ("data", "forward", "backward", "sync", "optimizer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("profiling")
    group.add_argument(
        "--out",
        type=Path,
        default=Path("runs/profile"),
        help="folder for trace.json, top_operators.txt and the memory snapshot",
    )
    group.add_argument(
        "--profile-wait",
        type=int,
        default=1,
        help="steps run before profiling starts (one-time costs; raise it with --compile on)",
    )
    group.add_argument(
        "--profile-warmup", type=int, default=1, help="steps the profiler runs but discards"
    )
    group.add_argument("--profile-steps", type=int, default=5, help="steps recorded")
    group.add_argument("--row-limit", type=int, default=15, help="operators in the printed table")
    group.add_argument(
        "--memory-snapshot",
        action="store_true",
        help="CUDA only: record allocations and dump a snapshot for memory_viz",
    )


def profiled_config(config: Config, total_steps: int, out: Path) -> Config:
    """The user's config, cut to `total_steps` optimizer steps, writing into `out/run`."""
    train_set, _, _ = task_for(config).datasets(config)
    steps_per_epoch = len(train_set) // (config.optim.batch_size * config.optim.grad_accum_steps)  # type: ignore[arg-type]
    if steps_per_epoch < 1:
        raise ValueError(
            f"the training set ({len(train_set)} samples) is smaller than one optimizer step "  # type: ignore[arg-type]
            f"of --batch-size {config.optim.batch_size} x --grad-accum-steps "
            f"{config.optim.grad_accum_steps}"
        )
    return config.in_epochs(
        epochs=math.ceil(total_steps / steps_per_epoch),
        max_steps_per_epoch=min(total_steps, steps_per_epoch),
        run_dir=str(out / "run"),
        resume=None,
        tracker="none",  # the training step's trace, not a tracker's I/O
    )


def phase_shares(averages: Any) -> tuple[dict[str, float], float, int]:
    """Seconds per labelled phase, total step seconds, and the number of recorded steps.

    Step time is the sum of the profiler's `ProfilerStep#N` ranges, one per `prof.step()`,
    i.e. per optimizer step (`key_averages` groups them as `ProfilerStep*`). Phases are the
    CPU-side durations of the loop's `record_function` labels: the time the training
    process spent in each.
    """
    phases = dict.fromkeys(PHASES, 0.0)
    total = 0.0
    steps = 0
    for event in averages:
        if event.key in phases:
            phases[event.key] += event.cpu_time_total / 1e6
        elif event.key.startswith("ProfilerStep"):  # "ProfilerStep*" once averaged
            total += event.cpu_time_total / 1e6
            steps += event.count
    return phases, total, steps


def main(argv: list[str] | None = None) -> int:
    """`profiling`; a stop signal or a known failure is one line and its exit code."""
    return exits.exit_code(lambda: _profile(argv), kept="what profiling wrote so far is kept")


def _profile(argv: list[str] | None) -> int:
    parser = build_parser("Profile a few steps of the training loop with torch.profiler.")
    add_arguments(parser)
    config, args = parse_config(argv, None, parser, cls=Config)
    for name in ("profile_wait", "profile_warmup"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("profile_steps", "row_limit"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        device = accelerator.resolve_device(config.run.device)
    except ValueError as error:
        parser.error(str(error))
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    total_steps = args.profile_wait + args.profile_warmup + args.profile_steps
    try:
        run_config = profiled_config(config, total_steps, out)
    except ValueError as error:  # DataError included: one line, no traceback
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    on_accelerator = device.type == "cuda"
    snapshot = args.memory_snapshot and on_accelerator
    if args.memory_snapshot and not snapshot:
        print(f"--memory-snapshot needs CUDA (device is {device}): no snapshot")
    averages = _profile_run(parser, args, run_config, on_accelerator, snapshot)
    if averages is None:
        parser.exit(
            1,
            f"{parser.prog}: error: the run ended before the profiler recorded a "
            "step; lower --profile-wait/--profile-warmup\n",
        )
    _report(averages, args, on_accelerator)
    if snapshot:
        print(
            f"Memory snapshot: {out / 'memory_snapshot.pickle'} "
            "(open at https://pytorch.org/memory_viz)"
        )
    return 0


def _profile_run(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    run_config: Config,
    on_accelerator: bool,
    snapshot: bool,
) -> Any:
    """Train under the profiler; its key averages, or None when no step was recorded.
    Bad input and a blown-up run exit here with their code (2, 1) and one line."""
    from .train import train  # imported late so `--help` stays fast

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_accelerator else [])
    trace_path = args.out / "trace.json"
    captured: dict[str, Any] = {}

    def on_trace_ready(prof: profile) -> None:
        prof.export_chrome_trace(str(trace_path))
        captured["averages"] = prof.key_averages()

    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        with profile(
            activities=activities,
            schedule=schedule(
                wait=args.profile_wait,
                warmup=args.profile_warmup,
                active=args.profile_steps,
                repeat=1,
            ),
            on_trace_ready=on_trace_ready,
            record_shapes=True,
            profile_memory=True,
        ) as prof:
            try:
                # A scratch run: a previous profile's checkpoints are not a run to protect.
                shutil.rmtree(Path(run_config.run.run_dir) / "checkpoints", ignore_errors=True)
                train(run_config, on_step=lambda _step: prof.step())
            except ValueError as error:  # ConfigError, DataError: bad input, one line
                parser.exit(2, f"{parser.prog}: error: {error}\n")
            except utils.NonFiniteLossError as error:
                parser.exit(1, f"{parser.prog}: error: {error}\n")
        if snapshot:
            torch.cuda.memory._dump_snapshot(str(args.out / "memory_snapshot.pickle"))
    finally:
        if snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
    return captured.get("averages")


def _report(averages: Any, args: argparse.Namespace, on_accelerator: bool) -> None:
    """Write top_operators.txt; print the table, the phases' shares and where the trace is."""
    sort_by = "self_device_time_total" if on_accelerator else "self_cpu_time_total"
    table = averages.table(sort_by=sort_by, row_limit=args.row_limit)
    (args.out / "top_operators.txt").write_text(table + "\n")
    phases, total, steps = phase_shares(averages)
    print(f"\nTop operators by {sort_by} over {steps} profiled steps:")
    print(table)
    if total > 0:
        parts = ", ".join(f"{name} {seconds / total:.1%}" for name, seconds in phases.items())
        other = max(total - sum(phases.values()), 0.0)
        print(
            f"Step time {total / max(steps, 1) * 1e3:.2f} ms on average: {parts}, "
            f"other {other / total:.1%}"
        )
        print(
            f"Waiting for data: {phases['data'] / total:.1%} of step time"
            + (" (CPU-side time; the GPU may run ahead of it)" if on_accelerator else "")
        )
    if steps < args.profile_steps:
        print(
            f"note: only {steps} of {args.profile_steps} active steps were recorded "
            "(the run was shorter)"
        )
    print(f"Trace: {args.out / 'trace.json'} (open at https://ui.perfetto.dev)")


if __name__ == "__main__":
    sys.exit(main())
