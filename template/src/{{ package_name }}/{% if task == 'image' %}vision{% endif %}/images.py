"""Images beyond decoding: split layouts, augmentation, and what a run's data is prepared with.

Template-owned helpers that data.py (yours), training/task.py and the inference commands (evaluate,
predict, export) share, so all of them read a folder and augment the same way.

- Layouts: `root/<class>/<image>`, or pre-split `root/train/<class>/...`, `root/val/<class>/...`
  and optionally `root/test/<class>/...` (`find_splits`). Pre-split data keeps its split:
  validation is `val/`, never a random part of `train/`.
- Augmentation (`--augment`): `crop-flip` is a random resized crop (area 25-100% of the image,
  aspect ratio 3/4 to 4/3, resized back with bilinear interpolation) and a horizontal flip
  with probability 1/2, in torch ops (torchvision is not needed); `crop` is the crop alone
  (for classes a mirror changes: digits, text). `--trivial-augment` then applies one
  TrivialAugment step (`vision/trivial_augment.py`): one operation drawn from RandAugment's
  fourteen at a uniformly drawn strength. `--erase p` last fills a random rectangle (2-33%
  of the area) of a share p of the images with the measured mean (zero after normalisation), as
  torchvision's RandomErasing. It all runs in the DataLoader workers; each sample's
  randomness depends only on (seed, epoch, index), so a resumed run sees exactly the images
  an uninterrupted one would. `auto` (the default) is `crop-flip` for an image folder and
  `none` for synthetic data and `data.pt` tensors (which need not be natural images: turn it
  on with `--augment crop-flip`).
- Normalisation: decided once per run by `prepare` (the mean and std measured on the training
  split, or a `--model hf`'s own) and carried by the model itself: vision/normalization.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset
from tqdm import tqdm

from .normalization import Normalization, dataset_key, normalization_for
from .trivial_augment import trivial_augment

SPLITS = ("train", "val", "test")
AUGMENT_POLICIES = ("auto", "crop-flip", "crop", "none")
CROP_SCALE = (0.25, 1.0)  # share of the image's area a random resized crop keeps
CROP_RATIO = (3 / 4, 4 / 3)
ERASE_SCALE = (0.02, 1 / 3)  # share of the area an erased rectangle covers (torchvision's)
ERASE_RATIO = (0.3, 3.3)


def find_splits(root: Path) -> dict[str, Path] | None:
    """The split folders of a pre-split root (`train/` and `val/`, optionally `test/`), or None
    for another layout. `train/` and `test/` without `val/` counts as pre-split too (data.py
    refuses it, naming the missing folder)."""
    present = {name: root / name for name in SPLITS if (root / name).is_dir()}
    if "train" in present and len(present) > 1:
        return present
    return None


def hidden(path: Path) -> bool:
    """A dot-name (.ipynb_checkpoints/, .DS_Store, macOS's ._x.png): never a class or image."""
    return path.name.startswith(".")


def stray_folders(root: Path) -> list[str]:
    """Folders of a pre-split root that are not a split (a class folder left next to train/),
    which are ignored: the caller says so."""
    return sorted(
        p.name for p in root.iterdir() if p.is_dir() and p.name not in SPLITS and not hidden(p)
    )


def class_mismatch(classes: dict[str, list[str]]) -> str | None:
    """The first difference between the class folders of the splits, in words, or None."""
    train = set(classes["train"])
    for split, names in classes.items():
        extra, missing = sorted(set(names) - train), sorted(train - set(names))
        if extra:
            return f"class {extra[0]!r} is in {split}/ but not in train/ ({len(extra)} such)"
        if missing:
            return f"class {missing[0]!r} is in train/ but not in {split}/ ({len(missing)} such)"
    return None


# --------------------------------------------------------------------------------------------
# Augmentation
# --------------------------------------------------------------------------------------------


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A seed for one sample's augmentation, from (seed, epoch, index) only."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def uniform_draws(seed: int, block: int) -> tuple[float, ...]:
    """Block `block` of `seed`'s stream: five draws in [0, 1) from a keyed blake2b hash.

    A crop reads a block per try, so it hashes about 40 bytes for what it uses, where a
    torch.Generator would fill its 2.5 kB state first (the largest cost of a 32-pixel crop)."""
    digest = hashlib.blake2b(
        block.to_bytes(8, "little"), digest_size=40, key=(seed & (2**64 - 1)).to_bytes(8, "little")
    ).digest()
    return tuple(value * 2.0**-64 for value in struct.unpack("<5Q", digest))


def crop_box(height: int, width: int, seed: int) -> tuple[int, int, int, int, bool]:
    """(top, left, crop height, crop width, mirror): a random resized crop of a height x width
    image (as torchvision's: ten tries at a box that fits, else the whole image) and whether
    the flip's draw says mirror. Try k reads `uniform_draws(seed, k)`; the flip is block 0's
    fifth draw, the same whichever try fits."""
    lo, hi = math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1])
    first = uniform_draws(seed, 0)
    mirror = first[4] < 0.5
    for attempt in range(10):
        scale, log_ratio, y, x = (first if attempt == 0 else uniform_draws(seed, attempt))[:4]
        area = height * width * (CROP_SCALE[0] + (CROP_SCALE[1] - CROP_SCALE[0]) * scale)
        ratio = math.exp(lo + (hi - lo) * log_ratio)
        w, h = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < w <= width and 0 < h <= height:
            top, left = int(y * (height - h + 1)), int(x * (width - w + 1))
            return top, left, h, w, mirror
    return 0, 0, height, width, mirror


def crop_flip(image: torch.Tensor, seed: int, flip: bool = True) -> torch.Tensor:
    """Random resized crop then (with `flip`) random horizontal flip of a (C, H, W) image, same
    shape out, drawn from `seed` (`sample_seed`). `flip` changes nothing but the mirror."""
    _, height, width = image.shape
    top, left, crop_h, crop_w, mirror = crop_box(height, width, seed)
    crop = image[:, top : top + crop_h, left : left + crop_w]
    if (crop_h, crop_w) != (height, width):
        crop = F.interpolate(
            crop[None].float(), size=(height, width), mode="bilinear", align_corners=False
        )[0].to(image.dtype)
    if flip and mirror:
        crop = crop.flip(-1)
    return crop.contiguous()


def cropping_reader(dataset: Dataset[Any], index: int) -> tuple[Any, int]:
    """(the dataset under `dataset`'s Subsets that crops while it decodes, its index), or
    (None, index): an image folder takes the crop from the decoded file in 8 bits, before its
    resize and the float conversion (data_sources.ImageFolder.read_cropped). A subclass of
    yours that reads items its own way (its own `__getitem__`) is cropped after it instead."""
    while isinstance(dataset, Subset):
        index = int(dataset.indices[index])
        dataset = dataset.dataset
    kind = type(dataset)
    owner = next((c for c in kind.__mro__ if "read_cropped" in vars(c)), None)
    if owner is not None and kind.__getitem__ is vars(owner).get("__getitem__"):
        return dataset, index  # the class that crops while decoding also reads the items
    return None, index


class Augmented(Dataset[tuple[torch.Tensor, Any]]):
    """`dataset` with `Recipe` applied to each image, seeded by (seed, epoch, index).

    The epoch lives in a shared-memory tensor, so persistent DataLoader workers see
    `set_epoch` (data.ResumableSampler.set_epoch calls it before each epoch's batches are
    requested).
    """

    def __init__(self, dataset: Dataset[Any], seed: int, recipe: Recipe | None = None):
        self.dataset = dataset
        self.seed = seed
        self.recipe = recipe if recipe is not None else Recipe()
        self.epoch = torch.zeros(1, dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch[0] = epoch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, Any]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, Any]]:
        """The items `indices` (a batch: the DataLoader's fetcher calls this in the worker),
        each as `self[index]` alone gives it. The draws of the whole batch come first, then
        the decoding, each in a loop of its own: interleaved, each evicted the other's code
        and data from the CPU's caches, which cost a 32-pixel image a third more time."""
        epoch = int(self.epoch[0])
        seeds = [sample_seed(self.seed, epoch, int(index)) for index in indices]
        recipe = self.recipe
        places = [cropping_reader(self.dataset, int(index)) for index in indices]
        if recipe.policy == "none" or any(reader is None for reader, _ in places):
            items = [self.dataset[index] for index in indices]
            return [
                (recipe.apply(image, seed), label)
                for (image, label), seed in zip(items, seeds, strict=True)
            ]
        boxes = [
            crop_box(reader.image_size, reader.image_size, seed)
            for (reader, _), seed in zip(places, seeds, strict=True)
        ]
        out = []
        for (reader, position), (top, left, height, width, mirror), seed in zip(
            places, boxes, seeds, strict=True
        ):
            flip = mirror and recipe.policy == "crop-flip"
            image, label = reader.read_cropped(position, (top, left, height, width), flip)
            out.append((recipe.after_crop(image, seed), label))
        return out


@dataclass(frozen=True)
class Recipe:
    """What happens to a training image, in this order: the `--augment` policy (`crop-flip`,
    `crop` or `none`), a TrivialAugment step (`--trivial-augment`), random erasing of a share
    `erase` of the images with `fill` per channel (`--erase`; None: zeros)."""

    policy: str = "crop-flip"
    trivial: bool = False
    erase: float = 0.0
    fill: tuple[float, ...] | None = None

    def __bool__(self) -> bool:  # whether it changes anything
        return self.policy != "none" or self.trivial or self.erase > 0

    def apply(self, image: torch.Tensor, seed: int) -> torch.Tensor:
        """The recipe on `image`, drawn from `seed` (`sample_seed(seed, epoch, index)`)."""
        if self.policy != "none":
            image = crop_flip(image, seed, flip=self.policy == "crop-flip")
        return self.after_crop(image, seed)

    def after_crop(self, image: torch.Tensor, seed: int) -> torch.Tensor:
        """What follows the crop; a torch.Generator seeded by `seed` is made only for it."""
        if not (self.trivial or self.erase):
            return image
        generator = torch.Generator().manual_seed(seed)
        if self.trivial:
            image = trivial_augment(image, generator)
        if self.erase:
            image = random_erase(image, generator, self.erase, self.fill)
        return image


def random_erase(
    image: torch.Tensor, generator: torch.Generator, p: float, fill: Sequence[float] | None
) -> torch.Tensor:
    """With probability `p`, a rectangle of 2-33% of the area (aspect 0.3 to 3.3) set to `fill`
    (per channel), in ten tries as torchvision's RandomErasing; else the image as it is."""
    _, height, width = image.shape
    draws = torch.rand(41, generator=generator, dtype=torch.float64).tolist()
    if draws[40] >= p:
        return image
    lo, hi = math.log(ERASE_RATIO[0]), math.log(ERASE_RATIO[1])
    for attempt in range(10):
        scale, log_ratio, y, x = draws[4 * attempt : 4 * attempt + 4]
        area = height * width * (ERASE_SCALE[0] + (ERASE_SCALE[1] - ERASE_SCALE[0]) * scale)
        ratio = math.exp(lo + (hi - lo) * log_ratio)
        h, w = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < h < height and 0 < w < width:
            top, left = int(y * (height - h + 1)), int(x * (width - w + 1))
            values = torch.tensor(fill or [0.0] * image.shape[0], dtype=image.dtype)
            image = image.clone()
            image[:, top : top + h, left : left + w] = values.view(-1, 1, 1)
            return image
    return image


def augment_policy(requested: str, in_memory: bool) -> str:
    """What `--augment` means for this data: `auto` is crop-flip for image folders only."""
    if requested == "auto":
        return "none" if in_memory else "crop-flip"
    return requested


def prepare(
    config: Any, train: Dataset[Any], info: Any
) -> tuple[Dataset[Any], Any, dict[str, Any]]:
    """The training set as the loop reads it (augmented per `--augment`), its `info` with the
    input normalisation every model built for it carries (vision/normalization.py), and the
    run record's "dataset" entry."""
    policy = augment_policy(getattr(config.data, "augment", "none"), info.in_memory)
    key = None  # what the measured mean/std is cached by: none for synthetic data
    if config.data.data_dir is not None:
        root = Path(config.data.data_dir)
        splits = find_splits(root)
        if splits is not None:
            stray = stray_folders(root)  # e.g. a class folder left next to train/
            say(
                f"--data-dir {root} is split ({', '.join(splits)}): validation is val/, "
                "--val-fraction is ignored"
                + (f"; ignored folder(s): {', '.join(stray)}" if stray else "")
            )
        measured = splits["train"] if splits else root
        detail = "train" if splits else f"val_fraction={config.data.val_fraction}"
        key = dataset_key(measured, info.image_size, len(train), detail)  # type: ignore[arg-type]
    found = normalization_for(config, train, key, say)
    info = dataclasses.replace(info, normalization=found)
    normalization = found or Normalization.identity(info.in_channels)
    data = config.data  # a config of yours may lack the recipe's newer fields
    recipe = Recipe(
        policy,
        getattr(data, "trivial_augment", False),
        getattr(data, "erase", 0.0),
        normalization.mean,
    )
    if recipe:
        train = Augmented(train, config.run.seed, recipe)
    record = {
        "classes": info.classes or [str(index) for index in range(info.num_classes)],
        "num_classes": info.num_classes,
        "in_channels": info.in_channels,
        "image_size": info.image_size,
        **normalization.record(),
        "augment": policy,
        "trivial_augment": recipe.trivial,
        "erase": recipe.erase,
    }
    return train, info, record


def say(message: str) -> None:
    """A log line from rank 0 only (the data is prepared on every rank)."""
    if int(os.environ.get("RANK", "0")) == 0:
        tqdm.write(message)
