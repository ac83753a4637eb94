"""The command line: parse flags, run the selected sections in order, print and save."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from .. import utils
from ..config import Config
from ..runtime import accelerator, exits
from ..settings.parsing import build_parser, parse_config
from ..training.task import (  # build_model_for: one line if model.py lacks it
    build_model_for,
    resolve_precision,
    task_for,
)
from . import (
    attention,
    augmentation,
    compiling,
    debug_switches,
    decoding,
    evaluation,
    generation,
    loop_overhead,
    pin_memory,
    saving,
    throughput,
    workers,
)
from .report import busy_note, describe_machine, load_average, print_section, write_chart
from .timing import MIN_RUNS, Context, Skip

SCHEMA_VERSION = 3  # of benchmark.json; see CHANGELOG.md for what changed

# Section number: (key in benchmark.json, title, function). Numbers and keys are stable.
SECTIONS: dict[int, tuple[str, str]] = {
    1: ("dataloader_workers", "DataLoader workers (on-disk images)"),
    2: ("pin_memory", "pin_memory + non_blocking vs pageable blocking copies"),
    3: ("compile", "torch.compile vs eager (training step)"),
    4: ("evaluation", "Evaluation: inference_mode vs no_grad vs grad-enabled"),
    5: ("debug_switches", "Debug switches: step time on / off"),
    6: ("loop_overhead", "Training loop vs bare reference loop"),
    7: ("throughput", "Throughput and model FLOPs utilization"),
    8: ("attention", "Attention: fused SDPA kernels vs the math kernel (training step)"),
    9: ("checkpoint_saves", "Checkpoint saves: step time during a save vs without one"),
    10: ("generation", "Generation: key/value cache vs recomputing the window"),
    11: ("augmentation", "Training-image augmentation: loader samples/s vs none"),
    12: ("jpeg_decoding", "JPEG decoding to 224-pixel images: loader images/s vs plain PIL"),
}

RUNNERS: dict[int, Callable[[Context], dict[str, Any]]] = {
    1: workers.section_workers,
    2: pin_memory.section_pin_memory,
    3: compiling.section_compile,
    4: evaluation.section_evaluation,
    5: debug_switches.section_debug_switches,
    6: loop_overhead.section_loop_overhead,
    7: throughput.section_throughput,
    8: attention.section_attention,
    9: saving.section_checkpoint_saves,
    10: generation.section_generation,
    11: augmentation.section_augmentation,
    12: decoding.section_decoding,
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
        "--sections",
        default=",".join(map(str, SECTIONS)),
        help="comma-separated section numbers to run (default: all)",
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
        help="timed steps per block in section 6, which times 2 blocks with --quick and 5 "
        "otherwise (default 8 quick, 40 otherwise)",
    )


def parse_sections(text: str, parser: argparse.ArgumentParser) -> set[int]:
    try:
        chosen = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        chosen = set()
    if not chosen or not chosen <= set(SECTIONS):
        parser.error(
            f"--sections must be numbers from 1 to {len(SECTIONS)} separated by commas, "
            f"got {text!r}"
        )
    return chosen


def main(argv: list[str] | None = None) -> int:
    """The benchmark; a stop signal or a known failure is one line and its exit code."""
    kept = "benchmark.json is written when the run finishes"
    return exits.exit_code(lambda: _benchmark(argv), kept=kept)


def _benchmark(argv: list[str] | None) -> int:
    parser = build_parser("Measure what each technique buys on this machine.")
    add_arguments(parser)
    config, args = parse_config(argv, None, parser, cls=Config)
    selected = parse_sections(args.sections, parser)
    args.min_run_time = getattr(args, "min_run_time", None)
    args.loop_steps = getattr(args, "loop_steps", None)
    if args.min_run_time is not None and args.min_run_time <= 0:
        parser.error(f"--min-run-time must be > 0, got {args.min_run_time}")
    if args.loop_steps is not None and args.loop_steps < 2:
        parser.error(f"--loop-steps must be >= 2, got {args.loop_steps}")
    try:
        device = accelerator.resolve_device(config.run.device)
    except ValueError as error:
        parser.error(str(error))
    config = resolve_precision(config, device, print)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(config.data.data_dir) if config.data.data_dir is not None else None
    task = task_for(config)
    if data_dir is not None:
        try:  # a --data-dir given on purpose must be readable: say so now, not in section 1
            task.datasets(config)
        except ValueError as error:
            parser.error(str(error))

    utils.seed_everything(config.run.seed)
    torch.backends.cudnn.benchmark = config.speed.cudnn_benchmark
    # Sections 2-8 time the model, not the disk: they use the built-in data (synthetic
    # images, or the default corpus of a language model).
    synthetic = config.replace(data_dir=None)
    train_set, _, info = task.datasets(synthetic)
    loader = DataLoader(train_set, batch_size=config.optim.batch_size, shuffle=False)
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
        task=task,
    )
    machine = describe_machine(device, args.quick)
    print(
        f"benchmark on {machine['device_name']} ({device}), {machine['cpus_available']} CPUs, "
        f"{machine['torch_threads']} torch threads, torch {machine['torch']}, "
        f"{machine['date']}{' (--quick)' if args.quick else ''}"
    )
    print(
        f"model {config.model.model} width {config.model.width}, batch {config.optim.batch_size}, "
        f"image {config.data.image_size}, precision {config.speed.precision}; "
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
    report = {
        "schema_version": SCHEMA_VERSION,
        "machine": machine,
        "config": config.flat(),
        "sections": sections,
    }
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
