"""Datasets: a built-in synthetic one (offline, deterministic, learnable) and on-disk data.

Every dataset yields `(image, label)` with `image` a float32 tensor of shape (C, H, W).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset, TensorDataset

from .config import Config


class DataError(ValueError):
    """Bad input data: the message names the file or sample and says how to fix it."""


@dataclass
class DataInfo:
    in_channels: int
    image_size: int
    num_classes: int
    in_memory: bool  # True when items are ready tensors (workers would not help)


def make_synthetic(
    num_samples: int, *, num_classes: int, image_size: int, channels: int = 3, seed: int = 0,
    noise: float = 1.0,
) -> TensorDataset:
    """Class-conditional images: a smooth per-class pattern plus Gaussian noise.

    The patterns depend only on `num_classes`, `image_size` and `channels`, so a training set
    and a validation set drawn with different `seed`s share them; the noise makes the task
    non-trivial. A small CNN or MLP gets well above chance within one or two epochs.
    """
    pattern_gen = torch.Generator().manual_seed(1234)
    coarse = torch.randn(num_classes, channels, 4, 4, generator=pattern_gen)
    patterns = torch.nn.functional.interpolate(
        coarse, size=(image_size, image_size), mode="bilinear", align_corners=False
    )
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(num_classes, (num_samples,), generator=gen)
    images = patterns[labels] + noise * torch.randn(
        num_samples, channels, image_size, image_size, generator=gen
    )
    return TensorDataset(images, labels)


def build_datasets(config: Config) -> tuple[Dataset, Dataset, DataInfo]:
    """Return (train, validation, info) for `config`: synthetic data unless --data-dir is set."""
    if config.data_dir is None:
        shape = dict(num_classes=config.num_classes, image_size=config.image_size)
        train = make_synthetic(config.train_samples, seed=1, **shape)
        val = make_synthetic(config.val_samples, seed=2, **shape)
        return train, val, DataInfo(3, config.image_size, config.num_classes, in_memory=True)
    raise DataError(f"--data-dir {config.data_dir}: on-disk datasets are not implemented yet")
