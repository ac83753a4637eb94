"""The interface every training task implements (`Task`), and its default datasets.

A `Task` says how to build the datasets, how a batch becomes `(logits, targets)` for the
loss, which extra metrics a log line gets, and how many FLOPs one sample costs; the loop
asks it and nothing else differs between tasks. training/task.py holds this project's task
(`task_for`) and the pieces of a training step built on the interface; a task folder holds
its own subclass (the language model's: language/lm_task.py). This module imports neither,
so both build on it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from .. import slots
from ..config import Config
from ..observability import mfu
from . import data_sources
from .data_sources import DataInfo, Datasets


class Task:
    """What a training task supplies to the one loop: its datasets, how a batch becomes
    `(logits, targets)` for the loss, what its run record keeps, and its FLOPs. This project's
    task is the one `task_for` (training/task.py) returns."""

    name = "task"
    unit = "samples"  # what the shared `samples_per_s` counts
    # The validation figure best.pt is chosen by, and whether higher is better.
    best_by: tuple[str, bool] = ("val_acc", True)

    def datasets(self, config: Config) -> tuple[Dataset[Any], Dataset[Any], DataInfo]:
        """(train, validation, info) for `config`: by default data.py's sources as they are."""
        return build_datasets(config)

    def budget(self, config: Config, world_size: int) -> int | None:
        """The run's optimizer steps in all when a budget replaces --epochs: `--max-steps`
        (None: `--epochs` of full epochs, the default)."""
        steps: int | None = getattr(config.optim, "max_steps", None)  # an OptimConfig of yours
        return steps

    def outputs(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `model` on a batch: (N, C) logits and the N targets the loss compares them to
        (by default the model's output and the batch's targets as they are)."""
        return model(inputs), targets

    def record(self) -> dict[str, Any]:
        """What the run record (metrics.jsonl, every checkpoint) keeps of the data."""
        return {}

    def checkpoint_extra(self) -> dict[str, Any]:
        """What every checkpoint keeps beside the run record, too large for metrics.jsonl
        (the language model's tokenizer); nothing by default."""
        return {}

    def check_resume(
        self, state: dict[str, Any], config: Config, path: Path, log: Callable[[str], None]
    ) -> None:
        """Refuse (CheckpointError) a checkpoint whose data this run cannot continue; nothing
        beyond check_compatible's settings by default."""

    def metrics(self, record: dict[str, Any], prefix: str = "") -> dict[str, float]:
        """Metrics derived from a log line's `loss` and `samples_per_s`, named with `prefix`
        ("train_", "val_"); none beyond loss and accuracy by default."""
        return {}

    def utilization(
        self, model: nn.Module, config: Config, info: DataInfo, device: torch.device, on: bool
    ) -> mfu.Utilization:
        """FLOPs per sample counted on the meta device from the dataset's shape
        (observability/mfu.py)."""
        return mfu.Utilization.for_run(model, config, info, device, on)


def build_datasets(config: Config) -> Datasets:
    """(train, validation, info): data.py's `build_datasets` where yours has one, else the
    first of data.py's `SOURCES` and then the template's (training/data_sources.py) that takes
    it."""
    custom = slots.user_attr("data", "build_datasets")
    if custom is not None:
        result: Datasets = custom(config)
        return result
    sources = [*slots.user_attr("data", "SOURCES", []), *data_sources.SOURCES]
    return data_sources.first_source(config, sources)
