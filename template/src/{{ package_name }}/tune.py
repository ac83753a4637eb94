"""Find the fastest settings for this model, data and machine: `python -m <package>.tune --help`.

Short trials of the real training step (`train.train`, stopped after a few steps), over the
settings that matter on the device, one at a time from the current choice (a greedy search):

1. precision: fp32, bf16 where the device supports it, fp16 on CUDA
2. memory layout: channels-last or not, for a model with convolutions
3. TF32 on or off, on CUDA when the precision is fp32
4. torch.compile: off, on (default mode), and on CUDA the CUDA-graph modes where they are safe
5. DataLoader workers: 0, 1, 2, ... for data read from disk (in-memory data keeps 0)
6. on accelerators, the largest batch size that fits (reported, not applied: a bigger batch
   changes the optimisation, so it needs its own learning rate)

Every comparison is timed as the benchmark times it: candidates alternate in rounds (A B, B A,
...), each round's median step time gives one ratio, and a candidate replaces the current
choice only when it is faster beyond the spread across rounds. The result is written to
`tuned.toml` with every candidate's samples/s as comments, and `train --config tuned.toml`
trains with it. Exit codes: 0 done, 2 bad flags.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from . import utils
from .benchmarks.timing import compare_rounds
from .config import Config
from .runtime import accelerator, exits, files
from .runtime.stopping import Interrupted, Stopped
from .settings.base import ConfigError
from .settings.parsing import build_parser, parse_config, to_toml
from .training.task import resolve_precision, task_for

# The settings tune chooses: what `tuned.toml` holds.
TUNED = ("precision", "channels_last", "tf32", "compile", "compile_mode", "num_workers")


class _TrialDone(Exception):
    """Raised from `on_step` to end a trial after its last timed step."""


def time_steps(config: Config, steps: int, warmup: int) -> list[float]:
    """Seconds per optimizer step of `train.train(config)`, after `warmup` untimed steps."""
    from .train import train

    stamps: list[float] = []
    device = accelerator.resolve_device(config.run.device)

    def on_step(step: int) -> None:
        accelerator.synchronize(device)
        stamps.append(time.perf_counter())
        if step >= warmup + steps:
            raise _TrialDone

    with tempfile.TemporaryDirectory(prefix="tune-") as run_dir:
        trial = config.in_epochs(
            epochs=warmup + steps,  # enough also when an epoch is shorter than the trial
            max_steps_per_epoch=warmup + steps,
            run_dir=run_dir,
            resume=None,
            progress=False,
            log_every=10**9,
            tracker="none",  # the step alone: a tracker's I/O is not what is measured
        )
        with contextlib.suppress(_TrialDone), contextlib.redirect_stdout(io.StringIO()):
            try:
                train(trial, on_step=on_step)
            except Interrupted as stopped:  # its checkpoint is in this temporary folder
                raise Stopped(stopped.signum) from None
    intervals = [b - a for a, b in itertools.pairwise(stamps)]
    return intervals[warmup - 1 :] if warmup > 0 else intervals


@dataclasses.dataclass
class Trial:
    label: str
    overrides: dict[str, Any]
    samples_per_s: float | None = None
    note: str = ""


def run_rounds(
    base: Config, trials: list[Trial], *, steps: int, warmup: int, rounds: int
) -> dict[str, list[float]]:
    """Median step time per round for each trial, the trials alternating in order."""
    medians: dict[str, list[float]] = {t.label: [] for t in trials}
    order = list(trials)
    for _ in range(rounds):
        for trial in order:
            if trial.note.startswith("failed"):
                continue
            config = base.replace(**trial.overrides)
            try:
                times = time_steps(config, steps, warmup)
            except (ConfigError, RuntimeError, ValueError) as error:  # e.g. an OOM, no compiler
                text = str(error).strip().splitlines()
                trial.note = f"failed: {text[0] if text else type(error).__name__}"
                continue
            medians[trial.label].append(statistics.median(times))
        order.reverse()
    samples = base.optim.batch_size * base.optim.grad_accum_steps
    for trial in trials:
        if medians[trial.label] and not trial.note.startswith("failed"):
            trial.samples_per_s = samples / statistics.median(medians[trial.label])
    return medians


def choose(
    base: Config,
    name: str,
    candidates: list[Trial],
    *,
    steps: int,
    warmup: int,
    rounds: int,
    report: list[str],
) -> tuple[Config, list[Trial]]:
    """Time `candidates` (the first is the current choice) and keep the fastest that beats
    the current one beyond noise. A lone candidate is kept untimed."""
    current = candidates[0]
    if len(candidates) == 1:
        report.append(f"{name}: kept {current.label}: {current.note or 'no alternative here'}")
        return base.replace(**current.overrides), candidates
    medians = run_rounds(base, candidates, steps=steps, warmup=warmup, rounds=rounds)
    best, best_ratio, why = current, None, f"kept {current.label}"
    for trial in candidates[1:]:
        if trial.note.startswith("failed") or len(medians[trial.label]) != len(
            medians[current.label]
        ):
            continue
        # speed-up of trial over the current choice, round by round
        comparison = compare_rounds(medians[current.label], medians[trial.label])
        low, high = comparison["spread"]
        trial.note = f"{comparison['ratio']:.2f}x {current.label} ({low:.2f}-{high:.2f})"
        if low > 1.0 and (best_ratio is None or comparison["ratio"] > best_ratio):
            best, best_ratio = trial, comparison["ratio"]
    if best is not current:
        why = f"chose {best.label}: {best.note}, faster beyond the spread across {rounds} rounds"
    else:
        others = candidates[1:]
        why = f"kept {current.label}: " + "; ".join(
            f"{t.label} {t.note or 'not faster'}" for t in others
        )
        if any(t.note and not t.note.startswith("failed") for t in others):
            why += " (none faster beyond noise)"
    report.append(f"{name}: {why}")
    return base.replace(**best.overrides), candidates


def precision_candidates(config: Config, device: torch.device) -> list[Trial]:
    available = ["fp32"]
    if device.type == "cuda":
        available += (
            ["bf16", "fp16"]
            if torch.cuda.is_bf16_supported(including_emulation=False)
            else ["fp16"]
        )
    elif device.type in ("cpu", "mps"):
        available.append("bf16")  # fp16 on a CPU is slow, and MPS has no GradScaler
    ordered = [config.speed.precision, *(p for p in available if p != config.speed.precision)]
    return [Trial(p, {"precision": p}) for p in ordered]


def layout_candidates(config: Config, info: Any) -> list[Trial]:
    """Channels-last or not, for a model with 4-D weights (convolutions); else nothing."""
    from .training.task import build_model_for

    with torch.device("meta"):  # the shapes alone: no memory, no initialisation
        model = build_model_for(config.replace(channels_last=False), info)
    current = config.speed.channels_last
    label = {False: "contiguous (NCHW)", True: "channels-last (NHWC)"}
    trials = [Trial(label[current], {"channels_last": current})]
    if not any(p.dim() == 4 for p in model.parameters()):
        trials[0].note = "no convolutions: the layout changes nothing"
    elif config.speed.parallel == "fsdp":
        trials[0].note = "FSDP2 shards contiguous weights only"
    else:
        trials.append(Trial(label[not current], {"channels_last": not current}))
    return trials


def tf32_candidates(config: Config, device: torch.device) -> list[Trial]:
    """TF32 on and off, where it does something: fp32 on a CUDA device. Its precision cost is
    a 10-bit mantissa inside the multiply (docs/training.md, Mixed precision)."""
    current = config.speed.tf32
    trials = [Trial(f"tf32 {'on' if current else 'off'}", {"tf32": current})]
    if device.type == "cuda" and config.speed.precision == "fp32":
        trials.append(Trial(f"tf32 {'off' if current else 'on'}", {"tf32": not current}))
    else:
        trials[0].note = "only read by fp32 matmuls and convolutions on CUDA"
    return trials


def compile_candidates(config: Config, device: torch.device, quick: bool) -> list[Trial]:
    on = config.speed.compile == "on" or (config.speed.compile == "auto" and device.type == "cuda")
    current = Trial(f"compile {'on' if on else 'off'}", {"compile": "on" if on else "off"})
    if quick and device.type == "cpu":
        current.note = "alternatives not tried with --quick (inductor compiles for tens of s)"
        return [current]
    other = "off" if on else "on"
    trials = [current, Trial(f"compile {other}", {"compile": other, "compile_mode": "default"})]
    if device.type == "cuda":
        modes = ["max-autotune-no-cudagraphs"]
        if config.optim.grad_accum_steps == 1:  # CUDA graphs and accumulation do not mix
            modes.append("reduce-overhead")
        trials += [Trial(f"compile {m}", {"compile": "on", "compile_mode": m}) for m in modes]
    return trials


def worker_candidates(config: Config, in_memory: bool) -> list[Trial]:
    if in_memory:
        return [Trial("0 workers", {"num_workers": "0"}, note="in-memory data: nothing to load")]
    cpus = utils.available_cpus()
    counts = sorted({0, *(n for n in (1, 2, 4, 8) if n <= cpus)})
    current = utils.resolve_num_workers(config.data.num_workers, in_memory=False)
    counts = [current, *(n for n in counts if n != current)]
    return [Trial(f"{n} workers", {"num_workers": str(n)}) for n in counts]


def largest_batch(config: Config, device: torch.device, steps: int) -> tuple[int | None, str]:
    """The largest power-of-two multiple of --batch-size whose training step fits in memory.

    Compiled graphs and CUDA-graph pools of each trial are freed before the next (else later
    sizes look smaller than they are). An out-of-memory raised inside inductor's compilation
    arrives wrapped in another error; any other failure stops the search, keeping what fitted.
    """
    if device.type != "cuda":
        return None, "not searched: only on accelerators (a CPU has no memory wall to find)"
    fits, size = config.optim.batch_size, config.optim.batch_size
    for _ in range(6):  # up to 64x
        size *= 2
        try:
            time_steps(config.replace(batch_size=size), 1, 1)
        except (ConfigError, ValueError, RuntimeError) as error:  # OutOfMemoryError included
            if _out_of_memory(error):
                break
            return fits, f"stopped at {fits}: {(str(error).splitlines() or [repr(error)])[0]}"
        finally:
            _free_device_memory()
        fits = size
    return fits, "largest power-of-two multiple of --batch-size that fits (up to 64x)"


def _out_of_memory(error: BaseException | None) -> bool:
    """True for an out-of-memory error, or one raised while handling or because of one."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _free_device_memory() -> None:
    """Drop compiled graphs (and their CUDA-graph pools), then the cached blocks."""
    import torch._dynamo  # here: the import takes a second, and only the batch search needs it

    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def write_toml(
    path: Path, config: Config, sections: list[tuple[str, list[Trial]]], extra: list[str]
) -> None:
    lines = [
        f"# Written by `python -m {__package__}.tune`; train with `--config {path.name}`.",
        "# samples/s of every candidate (median of interleaved rounds, this machine, this run):",
    ]
    for name, trials in sections:
        for trial in trials:
            rate = f"{trial.samples_per_s:.1f} samples/s" if trial.samples_per_s else "-"
            lines.append(f"#   {name:<10} {trial.label:<32} {rate:<20} {trial.note}".rstrip())
    lines += [f"# {line}" for line in extra]
    tuned = {k: config.flat()[k] for k in TUNED}
    files.write_atomically(path, "\n".join(lines) + "\n" + to_toml(tuned, Config), "--out")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tune")
    group.add_argument("--out", type=Path, default=Path("tuned.toml"), help="file to write")
    group.add_argument(
        "--quick", action="store_true", help="seconds, not minutes: few steps, no CPU compile"
    )
    group.add_argument(
        "--steps",
        type=int,
        default=argparse.SUPPRESS,
        help="timed steps per trial (default 4 quick, 20 otherwise)",
    )
    group.add_argument(
        "--rounds",
        type=int,
        default=argparse.SUPPRESS,
        help="interleaved rounds (default 2 quick, 3 otherwise)",
    )


def main(argv: list[str] | None = None) -> int:
    """`tune`; a stop signal or a known failure is one line and its exit code."""
    return exits.exit_code(lambda: _tune(argv), kept="--out is written only when tune finishes")


def _tune(argv: list[str] | None) -> int:
    parser = build_parser("Measure settings on this machine and write the fastest to a TOML file.")
    add_arguments(parser)
    config, args = parse_config(argv, None, parser, cls=Config)
    steps = getattr(args, "steps", 4 if args.quick else 20)
    rounds = getattr(args, "rounds", 2 if args.quick else 3)
    if steps < 2:
        parser.error(f"--steps must be >= 2, got {steps}")
    if rounds < 2:
        parser.error(f"--rounds must be >= 2 (a spread needs two rounds), got {rounds}")
    if not args.out.parent.is_dir() or args.out.is_dir():  # found out before, not after, minutes
        parser.error(f"--out {args.out}: {args.out.parent} must be an existing folder; create it")
    files.check_output(args.out, "--out")  # unwritable, a FIFO, ...: one line, exit 2
    try:
        device = accelerator.resolve_device(config.run.device)
        config = resolve_precision(config, device, print)  # tune from what auto picks
        _, _, info = task_for(config).datasets(config)  # a language model reads text
    except ValueError as error:
        parser.error(str(error))
    warmup = 2
    report: list[str] = []
    sections: list[tuple[str, list[Trial]]] = []
    # Measure under the run's own worker count first: it does not change the step's compute.
    start = config.replace(
        num_workers=str(
            utils.resolve_num_workers(config.data.num_workers, in_memory=info.in_memory)
        ),
    )
    tuned = start
    # One setting at a time, each from the choices before it (TF32 after precision: it
    # matters only in fp32).
    searches = (
        ("precision", lambda: precision_candidates(config, device)),
        ("layout", lambda: layout_candidates(config, info)),
        ("tf32", lambda: tf32_candidates(tuned, device)),
        ("compile", lambda: compile_candidates(config, device, args.quick)),
        ("workers", lambda: worker_candidates(config, info.in_memory)),
    )
    for name, candidates in searches:
        tuned, trials = choose(
            tuned, name, candidates(), steps=steps, warmup=warmup, rounds=rounds, report=report
        )
        sections.append((name, trials))
    # Tuned against default, timed together in fresh interleaved rounds.
    final = [
        Trial("default", {}),
        Trial("tuned", {k: tuned.flat()[k] for k in TUNED}),
    ]
    medians = run_rounds(start, final, steps=steps, warmup=warmup, rounds=rounds)
    sections.append(("result", final))
    extra = list(report)
    if medians["default"] and medians["tuned"]:
        comparison = compare_rounds(medians["default"], medians["tuned"])
        low, high = comparison["spread"]
        noise = ", within noise" if comparison["within_noise"] else ""
        extra.append(f"tuned vs default: {comparison['ratio']:.2f}x ({low:.2f}-{high:.2f}{noise})")
        if high < 1.0:  # slower beyond noise together: the choices did not add up here
            tuned = start
            extra.append("tuned was slower than default in the final rounds: default written")
    batch, why = largest_batch(tuned, device, steps)
    extra.append(f"batch_size: {why}" + (f": {batch}" if batch else ""))
    if batch and batch != config.optim.batch_size:
        extra.append(f"batch_size = {batch}  # not applied: scale --lr with the batch")
    write_toml(args.out, tuned, sections, extra)
    print(
        f"tune on {device} ({config.model.model}, batch {config.optim.batch_size}): "
        f"{steps} timed steps per trial, {rounds} interleaved rounds"
    )
    for name, trials in sections:
        for trial in trials:
            rate = f"{trial.samples_per_s:8.1f} samples/s" if trial.samples_per_s else "       -"
            print(f"  {name:<10} {trial.label:<32} {rate}  {trial.note}".rstrip())
    for line in extra:
        print(line)
    print(f"written: {args.out} (train with: python -m {__package__}.train --config {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
