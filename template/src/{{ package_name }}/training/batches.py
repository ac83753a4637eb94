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
from ..settings.base import ConfigError
from .run import Run

# The dtype each mixed --precision autocasts to: a transform may return its inputs in it.
LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
    out = transform(run.config, inputs, targets, draw)
    low = LOW_PRECISION.get(run.config.speed.precision)  # autocast's dtype takes it too
    fault = batch_fault(out, inputs, targets, classes, low)
    if fault is not None:
        name = getattr(run.config.data, "batch_transform", "none")
        raise ConfigError(
            f"--batch-transform {name} returned {fault}; a @slots.batch_transform returns "
            "(inputs, targets) on the batch's device, of one batch size, floating inputs in "
            "their dtype and targets as labels or (N, classes) probabilities"
        )
    return out[0], out[1]


def batch_fault(
    out: Any, inputs: Any, targets: Any, classes: int, low: torch.dtype | None = None
) -> str | None:
    """What is wrong with a transform's (inputs, targets), or None: checked on the host by
    types, shapes, dtypes and devices alone (nothing is read from the device), so a wrong
    return is one line, not a traceback from deep inside the forward pass or the loss.
    Floating inputs keep their dtype, or take `low`, the dtype --precision autocasts to; the
    targets are what the template's cross-entropy takes, unless a loss of yours takes them."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        return f"a {type(out).__name__}, not a pair (inputs, targets)"
    for what, given, got in (("inputs", inputs, out[0]), ("targets", targets, out[1])):
        if not isinstance(given, torch.Tensor):
            continue  # a batch of your own structure: yours to check
        if not isinstance(got, torch.Tensor):
            return f"{what} of type {type(got).__name__}, not a tensor"
        if got.device != given.device:
            return f"{what} on {got.device}, not on the batch's {given.device}"
    new_inputs, new_targets = out
    if not (isinstance(new_inputs, torch.Tensor) and isinstance(new_targets, torch.Tensor)):
        return None
    if new_inputs.shape[:1] != new_targets.shape[:1]:
        return f"{len(new_inputs)} inputs but {len(new_targets)} targets"
    if inputs.is_floating_point() and new_inputs.dtype not in (inputs.dtype, low):
        return f"inputs of {new_inputs.dtype}, not the batch's {inputs.dtype} (--precision casts)"
    registry = slots.load()
    if registry.loss is not None or registry.training_loss is not None:
        return None  # your loss takes the targets: whatever it takes is yours to check
    if not new_targets.is_floating_point():
        if new_targets.dtype != targets.dtype:
            return f"targets of {new_targets.dtype}, not the batch's {targets.dtype}"
    elif not targets.is_floating_point() and classes and new_targets.shape[-1] != classes:
        return f"targets of shape {tuple(new_targets.shape)}, not (..., {classes}) probabilities"
    return None


def loss_of(run: Run, logits: torch.Tensor, targets: torch.Tensor, inputs: Any) -> torch.Tensor:
    """The training step's loss: the registered training loss, else `run.loss_fn`."""
    custom = slots.load().training_loss
    if custom is None:
        return run.loss_fn(logits, targets)
    loss = custom(logits, targets, LossInputs(run.config, inputs, run.model, run.global_step))
    fault = loss_fault(loss)
    if fault is not None:
        raise ConfigError(
            f"your @slots.training_loss returned {fault}; it must return a scalar floating "
            "tensor computed from the logits (reduce it, e.g. .mean())"
        )
    return loss


def loss_fault(loss: Any) -> str | None:
    """What is wrong with a training loss, or None (its metadata only: no read)."""
    if not isinstance(loss, torch.Tensor):
        return f"a {type(loss).__name__}, not a tensor"
    if loss.dim() != 0:
        return f"a tensor of shape {tuple(loss.shape)}, not a scalar"
    if not loss.is_floating_point():
        return f"a tensor of {loss.dtype}"
    if torch.is_grad_enabled() and not loss.requires_grad:
        return "a tensor without a gradient (detached, or not computed from the logits)"
    return None


def labels_of(targets: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Class indices: the targets as they are, or the largest share's class of (N, C)
    class probabilities (no read: argmax stays on the device)."""
    if targets.dim() == logits.dim() and targets.is_floating_point():
        return targets.argmax(-1)
    return targets
