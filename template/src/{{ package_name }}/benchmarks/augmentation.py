"""11. Training-image augmentation: the loader's samples/s with each part of the recipe, as a
share of the same loader without augmentation (an image task only)."""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

from .. import utils
from ..training.task import build_datasets
from .timing import (
    Context,
    Skip,
    compare,
    endless,
    fmt_ratio,
    fmt_timing,
    invert,
    measure_loaders,
    train_loader,
)
from .workers import image_folder

RECIPES: dict[str, dict[str, Any]] = {  # images.Recipe's arguments; None: no augmentation
    "none": {},
    "crop-flip": {"policy": "crop-flip"},
    "crop-flip + trivial-augment": {"policy": "crop-flip", "trivial": True},
    "crop-flip + trivial-augment + erase 0.25": {
        "policy": "crop-flip",
        "trivial": True,
        "erase": 0.25,
    },
}


def section_augmentation(ctx: Context) -> dict[str, Any]:
    if ctx.task.name != "image":
        raise Skip(f"augmentation is for images; the {ctx.task.name} task reads token windows")
    images = importlib.import_module(
        f"{__package__.rpartition('.')[0]}.vision.images"
    )  # images only

    config = ctx.config
    workers = worker_count(config.data.num_workers)
    with contextlib.ExitStack() as stack:
        data_dir, source = image_folder(ctx, stack)
        try:
            plain, _, info = build_datasets(config.replace(data_dir=str(data_dir)))
        except ValueError as error:  # DataError: the dataset cannot be read
            raise Skip(f"cannot read the on-disk dataset: {error}") from None
        if len(plain) < config.optim.batch_size:  # type: ignore[arg-type]
            raise Skip(f"the dataset has fewer than --batch-size {config.optim.batch_size} items")
        fill = tuple([0.5] * info.in_channels)
        batches = {}
        for name, recipe in RECIPES.items():
            dataset = (
                images.Augmented(plain, config.run.seed, images.Recipe(**recipe, fill=fill))
                if recipe
                else plain
            )
            batches[name] = stack.enter_context(contextlib.closing(endless(
                train_loader(ctx, dataset, workers)
            )))  # fmt: skip
            for _ in range(2 * workers + 2):  # worker start-up and the first prefetches
                next(batches[name])
        # The sustained rate of each, in rounds that alternate the recipes, so a machine that
        # slows down slows all; no recipe's prefetching lands in another's time.
        timings = measure_loaders(batches, ctx, workers)
    shares = {name: invert(compare(timings[name], timings["none"])) for name in RECIPES}
    rows = [
        [
            name,
            f"{config.optim.batch_size / timings[name]['median_s']:.0f}",
            fmt_timing(timings[name]),
            "1" if name == "none" else fmt_ratio(shares[name]),
        ]
        for name in RECIPES
    ]
    return {
        "dataset": source,
        "workers": workers,
        "batch_size": config.optim.batch_size,
        "recipes": {
            name: {"batch_time": timings[name], "share_of_none": shares[name]} for name in RECIPES
        },
        "table": {
            "columns": ["recipe", "samples/s", "batch time ± IQR", "share of none's samples/s"],
            "rows": rows,
        },
        "notes": [
            f"{workers} DataLoader worker(s) ({source}); a share of 0.80 means the "
            "augmentation costs 20% of the loader's throughput"
        ],
    }


def worker_count(requested: str) -> int:
    """`--num-workers` when it is a number; for `auto`, two (the issue's comparison) where
    the CPUs allow."""
    if requested.strip().lower() == "auto":
        return min(2, utils.available_cpus())
    return utils.resolve_num_workers(requested)
