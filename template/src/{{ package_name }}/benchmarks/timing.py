"""What every benchmark section shares: the run's context, interleaved timing, A/B ratios with
their spread, formatting, and a bare training step to time.

A ratio of two timings is only worth reading when both were measured under the same
conditions. `measure_many` therefore times its contenders in alternating rounds (A B, B A,
A B, ...) in one run, keeps each round's median, and `compare` reports the ratio as the median
of the per-round ratios with their interquartile range across rounds. When that range covers
1.0 the difference is "within noise": the machine's own variation is as large as the effect.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import benchmark as torch_benchmark
from torch.utils.data import DataLoader, Dataset

from .. import utils
from ..config import Config
from ..runtime import accelerator
from ..train import build_optimizer
from ..training.data_sources import DataInfo
from ..training.task import Task

MIN_RUNS = 5  # timed rounds per measurement, at least (3 with --quick)


class Skip(Exception):
    """A section cannot run here; the message is the reason shown as `skipped: <reason>`."""


@dataclasses.dataclass
class Context:
    config: Config
    device: torch.device
    quick: bool
    min_run_time: float
    loop_steps: int
    min_runs: int  # timed rounds per measurement, at least
    warmup: int  # untimed calls before each measurement
    out: Path
    data_dir: Path | None
    batch: tuple[torch.Tensor, torch.Tensor]  # one training batch, on the host
    base_model: nn.Module  # initial weights every section copies, so all start equal
    info: DataInfo  # the synthetic data's shapes, for building fresh models
    train_set: Dataset[Any]
    task: Task = dataclasses.field(default_factory=Task)  # how a batch becomes logits, targets
    results: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)


def train_loader(ctx: Context, train_set: Dataset[Any], workers: int) -> DataLoader[Any]:
    """The training DataLoader train.py builds, for the sections that time or feed it."""
    return utils.build_dataloader(
        train_set,
        batch_size=ctx.config.optim.batch_size,
        train=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(ctx.config.run.seed),
        device=ctx.device,
    )


# --------------------------------------------------------------------------------------------
# Timing: interleaved rounds, medians, ratios with their spread
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
    seconds (or, with `number`, one block of that many calls), one function after the other,
    in the reverse order every second round (A B, B A, ...): a machine that slows down
    halfway (another job, thermal throttling) slows every contender alike, and none always
    runs right after another. Each result keeps its per-round medians (`rounds_s`) for
    `compare`. `Timer` gets the thread count a real run uses (it defaults to one, which would
    understate multi-threaded CPU kernels) and synchronizes CUDA around each block.
    """
    timers = {}
    for name, fn in fns.items():
        for _ in range(ctx.warmup if warmup is None else warmup):
            fn()
        timers[name] = torch_benchmark.Timer(
            stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
        )
    times: dict[str, list[float]] = {name: [] for name in fns}
    rounds: dict[str, list[float]] = {name: [] for name in fns}
    round_time = ctx.min_run_time / ctx.min_runs
    start = time.perf_counter()
    budget = ctx.min_run_time * len(fns)
    order = list(timers)
    while len(rounds[order[0]]) < ctx.min_runs or time.perf_counter() - start < budget:
        for name in order:
            timer = timers[name]
            if number is None:
                block = timer.blocked_autorange(min_run_time=round_time).times
            else:
                block = timer.timeit(number).times
            times[name].extend(block)
            rounds[name].append(statistics.median(block))
        order.reverse()
    results = {name: summary(values, rounds[name]) for name, values in times.items()}
    if keep_times:
        for name, values in times.items():
            results[name]["times_s"] = values
    return results


def summary(values: list[float], rounds: list[float]) -> dict[str, Any]:
    """The median and IQR of a contender's timings, their count, and each round's median."""
    stats = quartiles(values)
    return {
        "median_s": stats["median"],
        "iqr_s": stats["iqr"],
        "runs": len(values),
        "rounds_s": rounds,
    }


def measure_loaders(
    batches: dict[str, Iterator[Any]], ctx: Context, workers: int
) -> dict[str, dict[str, Any]]:
    """Seconds per batch of each endless DataLoader, as `measure_many` gives them, counting
    only the work each loader does while it is timed.

    Loaders that take turns share the CPUs with each other's workers, which prefetch
    (2 batches each) while another is timed: timing a block of the prefetch depth would time
    the queue, and the refill would land in the next loader's block (the ratios shrink toward
    1). So each block takes the prefetched batches untimed, times twice the depth (at least
    4 batches), then waits while this loader's workers refill, in interleaved rounds."""
    depth = 2 * workers  # utils.build_dataloader's prefetch_factor per worker
    number = max(4, 2 * depth)
    times: dict[str, list[float]] = {name: [] for name in batches}
    start, budget = time.perf_counter(), ctx.min_run_time * len(batches)
    order = list(batches)
    while len(times[order[0]]) < ctx.min_runs or time.perf_counter() - start < budget:
        for name in order:
            for _ in range(depth):
                next(batches[name])
            began = time.perf_counter()
            for _ in range(number):
                next(batches[name])
            per_batch = (time.perf_counter() - began) / number
            times[name].append(per_batch)
            time.sleep(1.5 * depth * per_batch)  # the refill, while no loader is timed
        order.reverse()
    return {name: summary(values, values) for name, values in times.items()}


def measure(fn: Callable[[], Any], ctx: Context, **kwargs: Any) -> dict[str, Any]:
    """`measure_many` for a single function."""
    return measure_many({"fn": fn}, ctx, **kwargs)["fn"]


def quartiles(values: Sequence[float]) -> dict[str, float]:
    """Median and IQR of a list of per-step measurements (seconds or rates)."""
    if len(values) < 2:
        raise Skip("fewer than two measurements")
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": median, "iqr": q3 - q1, "n": len(values)}


def compare_rounds(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, Any]:
    """The ratio of two interleaved measurements, round by round.

    `ratio` is the median of the per-round ratios, `spread` their interquartile range (the
    range itself with fewer than four rounds), `within_noise` whether that spread covers 1.0.
    """
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(
            f"need the same number of rounds on both sides, got {len(numerator)} and "
            f"{len(denominator)}"
        )
    per_round = [a / b for a, b in zip(numerator, denominator, strict=True)]
    if len(per_round) >= 4:
        low, median, high = statistics.quantiles(per_round, n=4, method="inclusive")
    else:
        low, median, high = min(per_round), statistics.median(per_round), max(per_round)
    return {
        "ratio": median,
        "spread": [low, high],
        "rounds": len(per_round),
        "per_round": per_round,
        "within_noise": low <= 1.0 <= high,
    }


def compare(numerator: dict[str, Any], denominator: dict[str, Any]) -> dict[str, Any]:
    """`compare_rounds` of two results of one `measure_many` call."""
    return compare_rounds(numerator["rounds_s"], denominator["rounds_s"])


def ratio(numerator: dict[str, Any], denominator: dict[str, Any]) -> float:
    """The round-by-round ratio of two results of one `measure_many` call."""
    return compare(numerator, denominator)["ratio"]


def invert(comparison: dict[str, Any]) -> dict[str, Any]:
    """B/A from A/B: a speed-up from a time ratio."""
    low, high = comparison["spread"]
    return {
        **comparison,
        "ratio": 1 / comparison["ratio"],
        "spread": [1 / high, 1 / low],
        "per_round": [1 / r for r in comparison["per_round"]],
    }


def fmt_ratio(comparison: dict[str, Any], digits: int = 2) -> str:
    """`1.02 (0.99-1.05, within noise)`: the ratio, its spread across rounds, the verdict."""
    low, high = comparison["spread"]
    noise = ", within noise" if comparison["within_noise"] else ""
    return f"{comparison['ratio']:.{digits}f} ({low:.{digits}f}-{high:.{digits}f}{noise})"


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
    """The optimizer as train.py builds it (AdamW, Muon, or your @slots.optimizer), so step
    times compare like with like."""
    return build_optimizer(config, model, device)


def make_step(
    model: nn.Module,
    ctx: Context,
    *,
    anomaly: bool = False,
    clip: float | None = None,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The minimal step: forward, loss, backward, (clip), optimizer step. Nothing else."""
    optimizer = make_optimizer(model, ctx.config, ctx.device)
    scaler = accelerator.make_grad_scaler(ctx.device, ctx.config.speed.precision)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with utils.anomaly_detection(anomaly):
            with accelerator.autocast(ctx.device, ctx.config.speed.precision):
                loss = F.cross_entropy(*ctx.task.outputs(model, inputs, targets))
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


def endless(loader: DataLoader[Any]) -> Iterator[Any]:
    while True:
        yield from loader
