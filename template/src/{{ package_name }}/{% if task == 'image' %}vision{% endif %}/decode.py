"""Decoding an image file at the size the model reads it (template-owned).

`read_pixels` is what data_sources.ImageFolder reads a file with: the training crop is taken
while resampling the file's own pixels in 8 bits (PIL's `resize(box=...)` below
TORCH_RESAMPLING_FROM pixels, torch's antialiased bilinear `interpolate` from there), and a
JPEG is decoded at a reduced scale when that cannot change what the model sees beyond
resampling. PIL's draft mode has libjpeg decode at 1/2, 1/4 or 1/8 of the size (the DCT's own
down-scaling: less entropy decoding, fewer pixels to resample); the scale asked for keeps at
least the output's resolution across the crop in both directions, so a 4000x3000 photo read at
224 pixels decodes at 1/8, while a 500x375 one read at 224 keeps its full size (a 1/2 scale
would leave 187 rows).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

# (top, left, height, width) in pixels of the size x size image the model reads
Box = tuple[int, int, int, int]
# (left, upper, right, lower) in pixels of the decoded file, as PIL's resize takes it
Region = tuple[float, float, float, float]
# The output side from which torch's resampling replaces PIL's: its AVX2 kernel for 8-bit
# channels-last images resizes a 400x300 crop to 224 pixels in a third of PIL's time, but
# costs more per call (19 against 13 us for a 32-pixel image).
TORCH_RESAMPLING_FROM = 64


def file_region(box: Box | None, size: int, width: int, height: int) -> Region:
    """Where `box` of the size x size image lies in a width x height file (the whole file for
    None): the image is the file stretched to a square, so each axis scales by its own
    factor."""
    if box is None:
        return 0.0, 0.0, float(width), float(height)
    top, left, box_h, box_w = box
    sx, sy = width / size, height / size
    return left * sx, top * sy, (left + box_w) * sx, (top + box_h) * sy


def draft_request(region: Region, size: int, width: int, height: int) -> tuple[int, int]:
    """The smallest decoded size whose copy of `region` still has `size` pixels both ways:
    PIL's draft picks the largest scale 1/s (s in 1, 2, 4, 8) with s <= file // request on
    both axes, and s <= width / request <= region width / size."""
    left, upper, right, lower = region
    return math.ceil(size * width / (right - left)), math.ceil(size * height / (lower - upper))


def drafted(opened: Image.Image, region: Region, size: int) -> Region:
    """Set `opened` (a JPEG not yet loaded) to decode at the smallest DCT scale that keeps
    `region` at `size` pixels or more; return `region` in the pixels it will decode to."""
    width, height = opened.size
    request = draft_request(region, size, width, height)
    if 2 * request[0] > width or 2 * request[1] > height:
        return region  # only the full scale keeps the resolution: leave the decoder as it is
    result = opened.draft("RGB", request)
    if result is None:  # a progressive or multi-tile file PIL does not draft
        return region
    _, (_, _, scaled_w, scaled_h) = result  # the file's size in decoded pixels (width / s)
    fx, fy = scaled_w / width, scaled_h / height
    left, upper, right, lower = region
    return left * fx, upper * fy, right * fx, lower * fy


def read_pixels(
    path: Path, size: int, box: Box | None = None, mirror: bool = False
) -> torch.Tensor:
    """The file at `path` as a (3, size, size) uint8 RGB tensor, or the part `box` of it (pixels
    of that image), resized with bilinear filtering from the file's own pixels (a JPEG's
    reduced decode when it keeps the resolution, see the module's docstring), mirrored if
    asked. Raises what PIL raises for a file it cannot read."""
    with Image.open(path) as opened:
        region = file_region(box, size, *opened.size)
        if opened.format == "JPEG":
            region = drafted(opened, region, size)
        rgb = opened if opened.mode == "RGB" else opened.convert("RGB")
        if size < TORCH_RESAMPLING_FROM:
            image = rgb.resize((size, size), Image.Resampling.BILINEAR, box=region)
            if mirror:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            return pixels_of(image)
        pixels = pixels_of(rgb)
    return resample(pixels, region, size, mirror)


def pixels_of(image: Image.Image) -> torch.Tensor:
    """A (3, H, W) uint8 view of an RGB image's bytes (channels last in memory)."""
    data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return data.view(image.height, image.width, 3).permute(2, 0, 1)


def resample(pixels: torch.Tensor, region: Region, size: int, mirror: bool) -> torch.Tensor:
    """`region` of a (3, H, W) uint8 image resized to size x size with torch's antialiased
    bilinear filter (PIL's BILINEAR, within rounding), mirrored if asked. The region is
    rounded to whole pixels: a shift of at most half a decoded pixel, which the draft keeps
    at most half an output pixel."""
    left, upper, right, lower = (round(edge) for edge in region)
    crop = pixels[:, upper : max(lower, upper + 1), left : max(right, left + 1)]
    if crop.shape[1:] != (size, size):
        crop = F.interpolate(crop[None], size=(size, size), mode="bilinear", antialias=True)[0]
    return crop.flip(-1) if mirror else crop
