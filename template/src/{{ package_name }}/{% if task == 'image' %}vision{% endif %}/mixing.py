"""Mixup and CutMix: `--batch-transform mixup|cutmix`, on each training batch on the device.

Both pair each image with the batch's mirror image (sample i with sample N-1-i; the loader's
order is random, so the pairs are, as timm pairs them) and mix the two labels into (N, C)
class probabilities by the share lambda of the image each one keeps:

- mixup (Zhang et al., 2018): lambda ~ Beta(a, a), x_i' = lambda x_i + (1 - lambda) x_j;
- CutMix (Yun et al., 2019): a box of 1 - lambda of the image's area (sides of sqrt(1 -
  lambda) times the image's, rounded down), centred on a uniform pixel and clipped at the
  edges, is pasted from x_j; lambda becomes the share of x_i's pixels kept.

`a` is --mix-alpha. Every draw comes from the batch's `Draw` (training/batches.py): on the
host, seeded by (--seed, step, micro-batch, rank), so nothing is read from the device and a
resumed run draws the same. The soft targets go to the loss, which takes probabilities
(cross-entropy, and --smoothing on top); validation never sees a mixed batch.

Both are registered in the extension slots (`@slots.batch_transform`), as a transform of yours is;
the package's import (__init__.py) loads this module.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .. import slots

if TYPE_CHECKING:
    from ..training.batches import Draw


def share(config: Any, rng: random.Random) -> float:
    """lambda ~ Beta(a, a), a = --mix-alpha (checked > 0 by the settings)."""
    alpha = getattr(config.data, "mix_alpha", 1.0)  # a DataConfig of yours may lack it
    return rng.betavariate(alpha, alpha)


def soft_targets(targets: torch.Tensor, kept: float, num_classes: int) -> torch.Tensor:
    """kept x each sample's label + (1 - kept) x its mirror's, as (N, C) probabilities."""
    own = targets.float() if targets.dim() == 2 else F.one_hot(targets, num_classes).float()
    return kept * own + (1 - kept) * own.flip(0)


@slots.batch_transform("mixup")
def mixup(
    config: Any, inputs: torch.Tensor, targets: torch.Tensor, draw: Draw
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image blended with its mirror's, lambda of its own."""
    kept = share(config, draw.random())
    images = inputs if inputs.is_floating_point() else inputs.float()
    mixed = kept * images + (1 - kept) * images.flip(0)
    return mixed, soft_targets(targets, kept, draw.num_classes)


def box(height: int, width: int, kept: float, rng: random.Random) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of CutMix's box: 1 - kept of the area, clipped at the edges."""
    side = math.sqrt(1 - kept)
    cut_h, cut_w = int(height * side), int(width * side)
    centre_y, centre_x = rng.randrange(height), rng.randrange(width)
    top, left = centre_y - cut_h // 2, centre_x - cut_w // 2
    return max(top, 0), min(top + cut_h, height), max(left, 0), min(left + cut_w, width)


@slots.batch_transform("cutmix")
def cutmix(
    config: Any, inputs: torch.Tensor, targets: torch.Tensor, draw: Draw
) -> tuple[torch.Tensor, torch.Tensor]:
    """A box of each image replaced by the same box of its mirror's."""
    rng = draw.random()
    height, width = inputs.shape[-2:]
    top, bottom, left, right = box(height, width, share(config, rng), rng)
    mixed = inputs.clone()
    mixed[..., top:bottom, left:right] = inputs.flip(0)[..., top:bottom, left:right]
    kept = 1 - (bottom - top) * (right - left) / (height * width)
    return mixed, soft_targets(targets, kept, draw.num_classes)
