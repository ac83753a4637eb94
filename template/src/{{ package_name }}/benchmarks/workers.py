"""1. DataLoader workers on an on-disk image folder: samples/s per worker count."""

from __future__ import annotations

import contextlib
import math
import tempfile
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from .. import utils
from ..training.task import build_datasets
from .timing import Context, Skip, endless, fmt_timing, measure, quartiles, train_loader


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


def section_workers(ctx: Context) -> dict[str, Any]:
    config = ctx.config
    if ctx.task.name != "image":
        raise Skip(f"the {ctx.task.name} task reads a memory-mapped token file: no workers")
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        data_dir, source = image_folder(ctx, stack)
        on_disk = config.replace(data_dir=str(data_dir))
        try:
            train_set, _, info = build_datasets(on_disk)
        except ValueError as error:  # DataError: the dataset cannot be read
            raise Skip(f"cannot read the on-disk dataset: {error}") from None
        if len(train_set) < config.optim.batch_size:  # type: ignore[arg-type]
            raise Skip(f"the dataset has fewer than --batch-size {config.optim.batch_size} items")
        if info.in_memory:
            notes.append("the dataset is in memory: workers only add inter-process copies")
        # What `train --num-workers auto` picks: measured on this dataset (and cached for
        # --data-dir, as train caches it; a temporary folder gets a throw-away cache).
        auto, _, auto_cached = utils.auto_num_workers(
            train_set,
            batch_size=config.optim.batch_size,
            dataset_id=str(data_dir.resolve()),
            in_memory=info.in_memory,
            device=ctx.device,
            cache=None
            if ctx.data_dir is not None
            else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-cache-"))),
        )
        cpus = utils.available_cpus()
        candidates = sorted({0, *(n for n in (1, 2, 4, 8, 16, 32) if n <= cpus), cpus, auto})
        rows = [_time_workers(ctx, train_set, workers) for workers in candidates]
    fastest = max(rows, key=lambda row: row["samples_per_s"])["workers"]
    rates = {r["workers"]: r["samples_per_s"] for r in rows}
    auto_share = rates[auto] / rates[fastest]
    notes.append(
        f"--num-workers auto chooses {auto} ({'cached' if auto_cached else 'measured'}; "
        f"CPUs available: {cpus}); fastest here: {fastest}; auto reaches {auto_share:.0%} "
        "of the fastest in this sweep"
    )
    columns = ["workers", "samples/s ± IQR", "batch time ± IQR", ""]
    return {
        "dataset": source,
        "batch_size": config.optim.batch_size,
        "cpus": cpus,
        "auto_workers": auto,
        "auto_share_of_fastest": auto_share,
        "fastest_workers": fastest,
        "sweep": rows,
        "table": {"columns": columns, "rows": _table(rows, fastest, auto)},
        "notes": notes,
    }


def image_folder(ctx: Context, stack: contextlib.ExitStack) -> tuple[Path, str]:
    """(--data-dir, or a temporary folder of JPEGs removed with `stack`; its description)."""
    config = ctx.config
    if ctx.data_dir is not None:
        return ctx.data_dir, f"--data-dir {ctx.data_dir}"
    data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-")))
    total = (8 if ctx.quick else 32) * config.optim.batch_size
    size = max(64, 2 * config.data.image_size)
    write_image_folder(data_dir, classes=config.data.num_classes, total=total, size=size)
    source = (
        f"temporary folder: {total} random {size}x{size} JPEGs in "
        f"{config.data.num_classes} class folders (pass --data-dir to use yours)"
    )
    return data_dir, source


def _time_workers(ctx: Context, train_set: Dataset[Any], workers: int) -> dict[str, Any]:
    """The sustained rate of the training DataLoader with `workers` workers."""
    batch_size = ctx.config.optim.batch_size
    loader = train_loader(ctx, train_set, workers)
    batches = endless(loader)
    # Worker start-up and the first prefetched batches are paid once per run (the workers
    # persist), so the steady rate is what is compared.
    for _ in range(2 * workers + 2):
        next(batches)
    # Workers hand over batches in bursts (each prefetches ahead), so one block spans several
    # batches per worker: what is timed is the sustained rate.
    timing = measure(
        lambda batches=batches: next(batches),
        ctx,
        warmup=0,
        number=max(4, 2 * workers),
        keep_times=True,
    )
    rates = quartiles([batch_size / t for t in timing.pop("times_s")])
    batches.close()  # shuts the workers down before the next count starts
    del batches, loader
    return {
        "workers": workers,
        "samples_per_s": rates["median"],
        "iqr_samples_per_s": rates["iqr"],
        "batch_time": timing,
    }


def _table(rows: list[dict[str, Any]], fastest: int, auto: int) -> list[list[str]]:
    def marks(workers: int) -> str:
        return " ".join(
            mark for mark, on in (("fastest", workers == fastest), ("auto", workers == auto)) if on
        )

    return [
        [
            str(r["workers"]),
            f"{r['samples_per_s']:.0f} ± {r['iqr_samples_per_s']:.0f}",
            fmt_timing(r["batch_time"]),
            marks(r["workers"]),
        ]
        for r in rows
    ]
