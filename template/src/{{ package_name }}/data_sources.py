"""The template's data sources (synthetic data, `data.pt`, image folders) and data machinery.

This module is the template's (`copier update` refreshes it); data.py is yours: its
`build_datasets` takes the first source of its own `SOURCES`, then of `SOURCES` here, that
returns data for the config, so a source the template adds lands here and yours never
conflict. A source is a function of the config returning `(train, val, DataInfo)`, or None
when the config is not for it.

Every dataset yields `(image, label)`: `image` a float32 tensor of shape (C, H, W), `label` an
int64 class index. Without `--data-dir`, built-in synthetic data; `--data-dir` accepts:

- an image folder with one sub-folder per class (`root/cat/001.png`, `root/dog/xyz.jpg`);
  images are decoded with Pillow in `__getitem__` (the CPU work DataLoader workers exist for),
  converted to RGB in [0, 1] and resized to `--image-size`;
- the same, already split: `root/train/<class>/...`, `root/val/<class>/...` and optionally
  `root/test/<class>/...` (detected by those folder names, images.find_splits); validation is
  `val/` (`--val-fraction` is ignored), every split must have the same class folders;
- a folder holding `data.pt`, a dict `{"inputs": float tensor (N, C, H, W), "targets": int64
  tensor (N,)}` and optionally `"num_classes": int`, loaded with `weights_only=True`.

A folder of classes and `data.pt` are split into training and validation sets by
`--val-fraction`, with a fixed seed so the validation set does not change with `--seed`.
Augmentation and per-channel normalisation are added by task.py (images.py). Template code
imports these names from here; data.py re-exports those that code written against earlier
releases imports from it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset, DistributedSampler, Subset, TensorDataset

from .config_base import BaseConfig
from .files import folder_problem
from .images import class_mismatch, find_splits, hidden

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm")
MAX_CLASSES = 10**6  # a data.pt claiming more is corrupt (the classifier would not fit)
SPLIT_SEED = 0  # the train/val split of --data-dir; independent of --seed on purpose


class DataError(ValueError):
    """Bad input data: the message names the file or sample and says how to fix it."""


@dataclass
class DataInfo:
    """The data's shapes, which the model is built for (model.py's `build_model_for`)."""

    in_channels: int
    image_size: int
    num_classes: int
    in_memory: bool  # True when items are ready tensors (workers would not help)
    classes: list[str] | None = None  # class names by index (an image folder's sub-folders)


# --------------------------------------------------------------------------------------------
# Built-in synthetic data
# --------------------------------------------------------------------------------------------


def make_synthetic(
    num_samples: int,
    *,
    num_classes: int,
    image_size: int,
    channels: int = 3,
    seed: int = 0,
    noise: float = 6.0,
) -> TensorDataset:
    """Class-conditional images: a smooth per-class pattern buried in Gaussian noise.

    The patterns depend only on `num_classes`, `image_size` and `channels`, so training and
    validation sets drawn with different `seed`s share them. With the default noise (6.0) the
    default model reaches about 80% validation accuracy after one epoch and more with a few
    more; a trivially easy task (noise 1.0 gives 100% at once) would hide training bugs.
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


# --------------------------------------------------------------------------------------------
# On-disk data
# --------------------------------------------------------------------------------------------


class ImageFolder(Dataset[tuple[torch.Tensor, int]]):
    """`root/<class>/<image>`: classes are the sorted sub-folder names, decoded lazily.

    Decoding happens in `__getitem__`, so it runs in the DataLoader workers, in parallel with
    the training step. A file that Pillow cannot read raises `DataError` naming the file.
    """

    def __init__(self, root: Path, image_size: int):
        self.root = root
        self.image_size = image_size
        self.samples: list[tuple[Path, int]] = []
        try:
            # Hidden entries (.ipynb_checkpoints/, macOS ._x.png) are not classes or images.
            self.classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not hidden(p))
            for label, name in enumerate(self.classes):
                files = sorted(
                    p
                    for p in (root / name).iterdir()
                    if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES and not hidden(p)
                )
                self.samples.extend((path, label) for path in files)
        except OSError as error:  # an unreadable class folder (EACCES), a vanished one
            where = error.filename or root
            raise DataError(
                f"cannot list the folder {where} ({error.strerror or error}); fix its "
                "permissions or remove it"
            ) from None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        try:
            with Image.open(path) as opened:
                image = opened.convert("RGB").resize(
                    (self.image_size, self.image_size), Image.Resampling.BILINEAR
                )
                data = bytearray(image.tobytes())
        except Image.DecompressionBombError as error:
            raise DataError(
                f"image {path} is too large to decode safely ({error}); shrink or remove it"
            ) from None
        except (OSError, UnidentifiedImageError, ValueError) as error:
            raise DataError(
                f"cannot read image {path}: {error}; delete or replace the file"
            ) from None
        pixels = torch.frombuffer(data, dtype=torch.uint8)
        pixels = pixels.view(self.image_size, self.image_size, 3).permute(2, 0, 1)
        # [0, 255] -> [0, 1]; the measured per-channel normalisation centres it (images.py).
        return pixels.float().div_(255.0), label


def load_tensor_file(path: Path, default_classes: int) -> tuple[TensorDataset, int]:
    """Load and check `data.pt`; return the dataset and its number of classes."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for a corrupt or foreign file
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(
            f"{path} is not a readable tensor file ({first}); re-save it with "
            "torch.save({'inputs': ..., 'targets': ...})"
        ) from None
    if not isinstance(data, dict) or not {"inputs", "targets"} <= data.keys():
        raise DataError(f"{path} must hold a dict with keys 'inputs' and 'targets'")
    inputs, targets = data["inputs"], data["targets"]
    if not isinstance(inputs, torch.Tensor) or not inputs.is_floating_point() or inputs.dim() != 4:
        raise DataError(f"{path}: 'inputs' must be a float tensor of shape (N, C, H, W)")
    if 0 in inputs.shape:
        raise DataError(f"{path}: 'inputs' has an empty dimension, shape {tuple(inputs.shape)}")
    if inputs.shape[2] != inputs.shape[3]:
        raise DataError(
            f"{path}: images must be square, got H={inputs.shape[2]} W={inputs.shape[3]}"
        )
    if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64 or targets.dim() != 1:
        raise DataError(f"{path}: 'targets' must be an int64 tensor of shape (N,)")
    if len(inputs) != len(targets):
        raise DataError(f"{path}: {len(inputs)} inputs but {len(targets)} targets")
    num_classes = data.get("num_classes", default_classes)
    if isinstance(num_classes, torch.Tensor) and num_classes.numel() == 1:
        num_classes = num_classes.item()
    if not isinstance(num_classes, int) or isinstance(num_classes, bool):
        raise DataError(f"{path}: 'num_classes' must be an integer, got {num_classes!r}")
    if not 2 <= num_classes <= MAX_CLASSES:
        raise DataError(f"{path}: 'num_classes' must be in [2, {MAX_CLASSES}], got {num_classes}")
    bad = (~torch.isfinite(inputs.flatten(1))).any(1).nonzero()
    if len(bad):
        raise DataError(
            f"{path}: sample {int(bad[0])} holds a NaN or Inf value "
            f"({len(bad)} such samples); clean or drop them"
        )
    outside = ((targets < 0) | (targets >= num_classes)).nonzero()
    if len(outside):
        index = int(outside[0])
        raise DataError(
            f"{path}: sample {index} has label {int(targets[index])}, outside "
            f"[0, {num_classes}); fix the label or set --num-classes "
            "(or 'num_classes' in the file)"
        )
    if len(targets.unique()) < 2:
        raise DataError(
            f"{path}: every sample has label {int(targets[0])}; a classifier needs at least "
            "two classes in the data"
        )
    return TensorDataset(inputs.float(), targets), num_classes


def split(dataset: Dataset[Any], val_fraction: float, source: Path) -> tuple[Subset, Subset]:
    """A seeded random split (same on every run and every rank) into train and validation."""
    size = len(dataset)  # type: ignore[arg-type]
    num_val = max(1, round(size * val_fraction))
    if size - num_val < 1:
        raise DataError(f"{source}: {size} samples are too few to split off a validation set")
    order = torch.randperm(size, generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    return Subset(dataset, order[num_val:]), Subset(dataset, order[:num_val])


Datasets = tuple[Dataset[Any], Dataset[Any], DataInfo]
# A data source: (train, validation, info) for a config (config.py's Config), or None when the
# config is not for it.
Source = Callable[[Any], Datasets | None]


def synthetic(config: BaseConfig) -> Datasets | None:
    """Built-in synthetic data, when no --data-dir is given."""
    if config.data.data_dir is not None:
        return None
    shape: dict[str, Any] = dict(
        num_classes=config.data.num_classes,
        image_size=config.data.image_size,
        noise=config.data.synthetic_noise,
    )
    train: Dataset[Any] = make_synthetic(config.data.train_samples, seed=1, **shape)
    val: Dataset[Any] = make_synthetic(config.data.val_samples, seed=2, **shape)
    return train, val, DataInfo(3, config.data.image_size, config.data.num_classes, in_memory=True)


def tensor_file(config: BaseConfig) -> Datasets | None:
    """--data-dir holding data.pt, split by --val-fraction."""
    if config.data.data_dir is None or not (Path(config.data.data_dir) / "data.pt").is_file():
        return None
    path = Path(config.data.data_dir) / "data.pt"
    dataset, num_classes = load_tensor_file(path, config.data.num_classes)
    inputs = dataset.tensors[0]
    train, val = split(dataset, config.data.val_fraction, path)
    return train, val, DataInfo(inputs.shape[1], inputs.shape[2], num_classes, in_memory=True)


def image_folder(config: BaseConfig) -> Datasets | None:
    """--data-dir as an image folder: pre-split (train/ val/) or split by --val-fraction."""
    if config.data.data_dir is None:
        return None
    root = Path(config.data.data_dir)
    problem = folder_problem(root)  # a FIFO or /dev/null: it exists, but is no folder
    if problem is not None:
        raise DataError(f"--data-dir {root} {problem}")
    splits = find_splits(root)
    if splits is not None:
        return split_folders(root, splits, config.data.image_size)
    folder = checked_folder(root, config.data.image_size)
    train, val = split(folder, config.data.val_fraction, root)
    info = DataInfo(3, config.data.image_size, len(folder.classes), False, folder.classes)
    return train, val, info


# The template's sources, in the order data.py's build_datasets tries them (after yours).
SOURCES: list[Source] = [synthetic, tensor_file, image_folder]


def first_source(config: BaseConfig, sources: Sequence[Source]) -> Datasets:
    """The data of the first of `sources` that takes `config`."""
    for source in sources:
        found = source(config)
        if found is not None:
            return found
    raise DataError(f"no data source takes --data-dir {config.data.data_dir}")


def checked_folder(root: Path, image_size: int) -> ImageFolder:
    """`ImageFolder(root)` with at least two class folders, each holding an image."""
    folder = ImageFolder(root, image_size)
    if not folder.classes:
        raise DataError(
            f"--data-dir {root} has no class sub-folders and no data.pt; expected "
            f"{root}/<class>/<image>, {root}/train/<class>/<image> or {root}/data.pt"
        )
    if not folder.samples:
        suffixes = " ".join(IMAGE_SUFFIXES)
        raise DataError(f"--data-dir {root}: no images ({suffixes}) in its class folders")
    if len(folder.classes) < 2:
        raise DataError(
            f"--data-dir {root} has one class folder ({folder.classes[0]}); a classifier "
            "needs at least two"
        )
    used = {label for _, label in folder.samples}
    empty = [name for label, name in enumerate(folder.classes) if label not in used]
    if empty:
        raise DataError(f"--data-dir {root}: class folder {root / empty[0]} holds no images")
    return folder


def split_folders(
    root: Path, splits: dict[str, Path], image_size: int
) -> tuple[Dataset, Dataset, DataInfo]:
    """A pre-split root: train/ for training, val/ for validation, the same classes in each."""
    if "val" not in splits:
        raise DataError(
            f"--data-dir {root} has train/ and test/ but no val/; add {root}/val/<class>/... "
            f"or move the class folders of train/ up to {root}"
        )
    folders = {name: checked_folder(path, image_size) for name, path in splits.items()}
    mismatch = class_mismatch({name: folder.classes for name, folder in folders.items()})
    if mismatch:
        raise DataError(f"--data-dir {root}: {mismatch}; every split needs the same classes")
    classes = folders["train"].classes
    info = DataInfo(3, image_size, len(classes), in_memory=False, classes=classes)
    return folders["train"], folders["val"], info


# --------------------------------------------------------------------------------------------
# Samplers
# --------------------------------------------------------------------------------------------


class ResumableSampler(DistributedSampler):
    """`DistributedSampler` that can start an epoch part-way through.

    The order of an epoch depends only on `(seed, epoch)`, so a run resumed in the middle of
    an epoch rebuilds the same order and skips the first `start` indices of this rank's share
    without loading them. Set `start` for the resumed epoch only, then back to 0.
    Without torchrun it is an ordinary seeded shuffler (`num_replicas=1, rank=0`).
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        num_replicas: int,
        rank: int,
        seed: int,
        shuffle: bool = True,
    ):
        # drop_last: every rank gets the same number of samples, so the ranks take the same
        # number of steps (a rank with one step more would wait forever in all-reduce).
        super().__init__(
            dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=True,
        )
        self.start = 0

    def __iter__(self) -> Iterator[int]:
        indices = itertools.islice(super().__iter__(), self.start, None)
        if getattr(self.dataset, "drawn_per_epoch", False):
            # New samples every epoch (text.EpochWindows): index epoch * len(dataset) + i.
            offset = self.epoch * len(self.dataset)  # type: ignore[arg-type]
            return (offset + index for index in indices)
        return indices

    def set_epoch(self, epoch: int) -> None:
        """The epoch for the order, and for the dataset's augmentation (images.Augmented)."""
        super().set_epoch(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return super().__len__() - self.start


def shard(dataset: Dataset[Any], rank: int, world_size: int) -> Dataset[Any]:
    """This rank's share of an evaluation set: every sample exactly once across the ranks.

    DistributedSampler would pad the shares to equal length with repeated samples, which
    skews the metrics; evaluation runs no collectives, so unequal shares are fine.
    """
    if world_size == 1:
        return dataset
    return Subset(dataset, range(rank, len(dataset), world_size))  # type: ignore[arg-type]
