"""12. Decoding JPEGs to 224-pixel training images: the template's reader (the crop taken while
resampling the file's pixels, a reduced JPEG decode where it keeps the resolution: vision/decode.py)
against the loader a user would write, `Image.open(path).convert("RGB").resize((224, 224))`,
in images/s through the same DataLoader workers, in interleaved rounds (an image task only)."""

from __future__ import annotations

import contextlib
import importlib
import io
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..training.task import build_datasets
from .augmentation import worker_count
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

SIZE = 224  # the side the model reads (ImageNet's)
PHOTO = (500, 375)  # width x height: about an ImageNet photo
COUNT = 10_000  # JPEGs the section writes (--batch-size of them with --quick)
DISTINCT = 100  # distinct pictures among them; the rest are byte copies (same decode cost)
PLAIN = "plain: open, convert, resize"


class PlainLoader(Dataset[tuple[torch.Tensor, int]]):
    """The loader a user would write: decode the whole file, resize it to size x size with
    PIL's default filter (bicubic), and [0, 1] floats as the template's datasets yield.
    `resample` other than None names another filter (the table's bilinear row)."""

    def __init__(self, paths: list[Path], size: int, resample: Any = None):
        self.paths, self.size, self.resample = paths, size, resample

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        image = Image.open(self.paths[index]).convert("RGB")
        if self.resample is None:
            image = image.resize((self.size, self.size))
        else:
            image = image.resize((self.size, self.size), self.resample)
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        return pixels.view(self.size, self.size, 3).permute(2, 0, 1).float() / 255, 0


def write_photos(root: Path, count: int, seed: int = 0) -> list[Path]:
    """`count` JPEGs of PHOTO pixels (quality 90) in two class folders under `root/train/`
    (half each; one more of each in `root/val/`), returned in the order an image folder lists
    them: a smooth random picture (a 12x9 grid of colours, bicubic) under Gaussian grain (std
    16), so the decoder meets both flat areas and detail. DISTINCT pictures, repeated as byte
    copies to make up the count."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    encoded = []
    for _ in range(min(count, DISTINCT)):
        coarse = torch.rand(1, 3, 9, 12, generator=generator) * 255
        smooth = F.interpolate(coarse, size=(PHOTO[1], PHOTO[0]), mode="bicubic")[0]
        grain = torch.randn(smooth.shape, generator=generator) * 16
        pixels = (smooth + grain).clamp(0, 255).to(torch.uint8).permute(1, 2, 0).contiguous()
        data = bytearray(pixels.numel())  # the bytes without numpy (not a dependency)
        torch.frombuffer(data, dtype=torch.uint8).copy_(pixels.flatten())
        buffer = io.BytesIO()
        Image.frombytes("RGB", PHOTO, bytes(data)).save(buffer, format="JPEG", quality=90)
        encoded.append(buffer.getvalue())
    half = (count + 1) // 2
    paths = [
        root / "train" / f"class_{index // half}" / f"{index % half:05d}.jpg"
        for index in range(count)
    ]
    for label in range(2):
        (root / "train" / f"class_{label}").mkdir(parents=True)
        (root / "val" / f"class_{label}").mkdir(parents=True)
        (root / "val" / f"class_{label}" / "00000.jpg").write_bytes(encoded[label % len(encoded)])
    for index, path in enumerate(paths):
        path.write_bytes(encoded[index % len(encoded)])
    return paths


def section_decoding(ctx: Context) -> dict[str, Any]:
    if ctx.task.name != "image":
        raise Skip(f"JPEG decoding is for images; the {ctx.task.name} task reads token windows")
    images = importlib.import_module(
        f"{__package__.rpartition('.')[0]}.vision.images"
    )  # images only
    from PIL import Image

    config = ctx.config
    workers = worker_count(config.data.num_workers)
    count = config.optim.batch_size if ctx.quick else COUNT
    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-jpegs-")))
        paths = write_photos(root, count, config.run.seed)
        try:  # the template's reader: the training split of the folder, as train reads it
            folder, _, _ = build_datasets(config.replace(data_dir=str(root), image_size=SIZE))
        except ValueError as error:  # DataError: a data.py of yours that reads it otherwise
            raise Skip(f"cannot read the JPEG folder: {error}") from None
        held = len(folder)  # type: ignore[arg-type]
        if held != count:
            raise Skip(f"wrote {count} JPEGs to train/ but the training set holds {held}")
        datasets: dict[str, Dataset[Any]] = {
            PLAIN: PlainLoader(paths, SIZE),
            "plain, bilinear resize": PlainLoader(paths, SIZE, Image.Resampling.BILINEAR),
            "template, whole image": folder,
            "template, crop-flip": images.Augmented(
                folder, config.run.seed, images.Recipe("crop-flip")
            ),
        }
        batches = {}
        for name, dataset in datasets.items():
            batches[name] = stack.enter_context(contextlib.closing(endless(
                train_loader(ctx, dataset, workers)
            )))  # fmt: skip
            for _ in range(2 * workers + 2):  # worker start-up and the first prefetches
                next(batches[name])
        timings = measure_loaders(batches, ctx, workers)
    speedups = {name: invert(compare(timings[name], timings[PLAIN])) for name in datasets}
    batch = config.optim.batch_size
    rows = [
        [
            name,
            f"{batch / timings[name]['median_s']:.0f}",
            fmt_timing(timings[name]),
            "1" if name == PLAIN else fmt_ratio(speedups[name]),
        ]
        for name in datasets
    ]
    width, height = PHOTO
    return {
        "jpegs": count,
        "photo_size": list(PHOTO),
        "size": SIZE,
        "workers": workers,
        "batch_size": batch,
        "loaders": {
            name: {"batch_time": timings[name], "vs_plain": speedups[name]} for name in datasets
        },
        "table": {
            "columns": ["loader", "images/s", "batch time ± IQR", "x plain's images/s"],
            "rows": rows,
        },
        "notes": [
            f"{count} temporary {width}x{height} JPEGs (quality 90, {min(count, DISTINCT)} "
            f"distinct pictures) read at {SIZE}x{SIZE} by {workers} DataLoader worker(s), "
            f"batch {batch}; the template's reader decodes them at full size (a 1/2 scale "
            f"would leave fewer than {SIZE} rows), its gain is the resampling"
        ],
    }
