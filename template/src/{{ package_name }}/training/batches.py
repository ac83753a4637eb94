"""The batch slot and the training loss slot, as a training step applies them.

`--batch-transform NAME` runs the transform registered under NAME (`@slots.batch_transform`;
an image project's built-in `mixup` and `cutmix`, vision/mixing.py) on each training
micro-batch, on the device, after the host-to-device copy and before the forward pass.
Validation (and evaluate, predict) see the batches as loaded. A transform's randomness comes
from its `Draw`, seeded by (--seed, the optimizer step, the micro-batch, the rank) and never by
the global RNG: a run stopped mid-epoch and resumed draws what it would have drawn, and a draw
on the host reads nothing from the device.

`loss_of` is a training step's loss: a `@slots.training_loss` (which sees the config, the
inputs and the model too) where one is registered, else `run.loss_fn` (the `@slots.loss` or
the default cross-entropy, smoothed by --smoothing). A transform may return the targets as
(N, C) class probabilities (mixup's): the losses take them, and training accuracy and the
`@slots.train_metric`s get `labels_of` them, the class of the largest share.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import slots
from ..config import Config
from .run import Run


@dataclass(frozen=True)
class Draw:
    """Where a training micro-batch sits, and randomness seeded by that alone."""

    seed: int  # --seed
    step: int  # the optimizer step the batch is for, counted from 0
    micro: int  # the micro-batch within the step (--grad-accum-steps), from 0
    rank: int  # under torchrun each rank draws its own
    num_classes: int  # the data's classes: the width of soft targets

    def random(self) -> random.Random:
        """A Python RNG of this batch's own (on the host: nothing is read from the device)."""
        return random.Random(f"{self.seed}/{self.step}/{self.micro}/{self.rank}")

    def generator(self, device: torch.device | str) -> torch.Generator:
        """A torch generator on `device`, of this batch's own, for draws on the device."""
        return torch.Generator(device).manual_seed(self.random().getrandbits(63))


@dataclass(frozen=True)
class LossInputs:
    """What a `@slots.training_loss` sees beside the logits and the targets."""

    config: Config
    inputs: Any  # the micro-batch's inputs, after --batch-transform
    model: nn.Module  # the model the step runs (compiled, wrapped under torchrun)
    step: int  # the optimizer step, counted from 0


def transform_of(config: Config) -> Callable[..., tuple[Any, Any]] | None:
    """The transform --batch-transform names (checked by the settings), None for none."""
    name = getattr(config.data, "batch_transform", "none")  # a DataConfig of yours
    return None if name == "none" else slots.load().batch_transforms[name]


def transform_batch(run: Run, inputs: Any, targets: Any, step: int, micro: int) -> tuple[Any, Any]:
    """A training micro-batch, already on the device, through --batch-transform."""
    transform = transform_of(run.config)
    if transform is None:
        return inputs, targets
    classes = run.info.num_classes if run.info is not None else 0
    draw = Draw(run.config.run.seed, step, micro, run.ctx.rank, classes)
    return transform(run.config, inputs, targets, draw)


def loss_of(run: Run, logits: torch.Tensor, targets: torch.Tensor, inputs: Any) -> torch.Tensor:
    """The training step's loss: the registered training loss, else `run.loss_fn`."""
    custom = slots.load().training_loss
    if custom is None:
        return run.loss_fn(logits, targets)
    return custom(logits, targets, LossInputs(run.config, inputs, run.model, run.global_step))


def labels_of(targets: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Class indices: the targets as they are, or the largest share's class of (N, C)
    class probabilities (no read: argmax stays on the device)."""
    if targets.dim() == logits.dim() and targets.is_floating_point():
        return targets.argmax(-1)
    return targets
