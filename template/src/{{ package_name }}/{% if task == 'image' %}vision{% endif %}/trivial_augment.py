"""TrivialAugment for training images (`--trivial-augment`), in torch ops: no torchvision.

Müller and Hutter's TrivialAugment (2021) applies to each image one operation drawn uniformly
from a fixed set, at a strength drawn uniformly: nothing to tune. The set and the ranges are
RandAugment's fourteen. images.Recipe calls `trivial_augment` after the crop, with the image's
own generator (seeded by seed, epoch and index), so a resumed run draws the same operations.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def trivial_augment(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """TrivialAugment (Muller & Hutter, 2021): one operation of `TRIVIAL_OPS`, drawn uniformly,
    at a strength drawn uniformly in [0, 1] and a random sign, on RandAugment's ranges."""
    pick, strength, sign = torch.rand(3, generator=generator, dtype=torch.float64).tolist()
    op = TRIVIAL_OPS[min(int(pick * len(TRIVIAL_OPS)), len(TRIVIAL_OPS) - 1)]
    signed = strength if sign < 0.5 else -strength
    return op(image.float(), signed).clamp_(0, 1).to(image.dtype)


# The TrivialAugment operations on a float (C, H, W) image in [0, 1], each taking a strength
# in [-1, 1] (the sign matters to the geometric and the enhancing ones) and scaled to
# RandAugment's ranges: shear 0.3, translation 45% of the side, rotation 30 degrees, enhance
# factors 1 +- 0.9, posterize to 8-4 bits, solarize above 1 - |strength|. Geometric ones fill
# uncovered pixels with 0 and interpolate bilinearly; the colour ones follow PIL's ImageOps and
# ImageEnhance (a generated test compares them).


def gray(image: torch.Tensor) -> torch.Tensor:
    """(1, H, W) luma: ITU-R 601 weights for RGB (PIL's "L"), the channel mean otherwise."""
    if image.shape[0] == 3:
        weights = torch.tensor([0.299, 0.587, 0.114], dtype=image.dtype).view(3, 1, 1)
        return (image * weights).sum(0, keepdim=True)
    return image.mean(0, keepdim=True)


def blend(degenerate: torch.Tensor, image: torch.Tensor, factor: float) -> torch.Tensor:
    """PIL's Image.blend: degenerate + factor * (image - degenerate), clamped to [0, 1]."""
    return (degenerate + factor * (image - degenerate)).clamp(0, 1)


def warp(
    image: torch.Tensor, matrix: list[list[float]], shift: tuple[float, float]
) -> torch.Tensor:
    """The image sampled at `matrix @ p + shift` for each output pixel p (pixel units, from the
    image's centre, x right and y down): bilinear, 0 outside."""
    _, height, width = image.shape
    sx, sy = width / 2, height / 2  # pixels -> affine_grid's [-1, 1] coordinates
    (a, b), (c, d) = matrix
    theta = torch.tensor(
        [[a, b * sy / sx, shift[0] / sx], [c * sx / sy, d, shift[1] / sy]], dtype=torch.float32
    )
    grid = F.affine_grid(theta[None], [1, *image.shape], align_corners=False)
    return F.grid_sample(image[None].float(), grid, align_corners=False)[0].to(image.dtype)


def shear_x(image: torch.Tensor, strength: float) -> torch.Tensor:
    return warp(image, [[1, 0.3 * strength], [0, 1]], (0, 0))


def shear_y(image: torch.Tensor, strength: float) -> torch.Tensor:
    return warp(image, [[1, 0], [0.3 * strength, 1]], (0, 0))


def translate_x(image: torch.Tensor, strength: float) -> torch.Tensor:
    return warp(image, [[1, 0], [0, 1]], (-0.45 * strength * image.shape[2], 0))


def translate_y(image: torch.Tensor, strength: float) -> torch.Tensor:
    return warp(image, [[1, 0], [0, 1]], (0, -0.45 * strength * image.shape[1]))


def rotate(image: torch.Tensor, strength: float) -> torch.Tensor:
    """Counter-clockwise by 30 x strength degrees on screen (y down), about the centre."""
    angle = math.radians(30 * strength)
    cos, sin = math.cos(angle), math.sin(angle)
    return warp(image, [[cos, -sin], [sin, cos]], (0, 0))


def brightness(image: torch.Tensor, strength: float) -> torch.Tensor:
    return blend(torch.zeros_like(image), image, 1 + 0.9 * strength)


def color(image: torch.Tensor, strength: float) -> torch.Tensor:
    return blend(gray(image).expand_as(image), image, 1 + 0.9 * strength)


def contrast(image: torch.Tensor, strength: float) -> torch.Tensor:
    return blend(gray(image).mean().expand_as(image), image, 1 + 0.9 * strength)


def sharpness(image: torch.Tensor, strength: float) -> torch.Tensor:
    """Blend with PIL's SMOOTH filter (centre 5, neighbours 1, /13); the border stays as is."""
    kernel = torch.ones(3, 3, dtype=image.dtype)
    kernel[1, 1] = 5
    smooth = F.conv2d(image[:, None], (kernel / 13).view(1, 1, 3, 3))[:, 0]
    degenerate = image.clone()
    degenerate[:, 1:-1, 1:-1] = smooth
    return blend(degenerate, image, 1 + 0.9 * strength)


def posterize(image: torch.Tensor, strength: float) -> torch.Tensor:
    bits = 8 - int(4 * abs(strength))
    levels = (image * 255).round().to(torch.uint8) & (0xFF << (8 - bits) & 0xFF)
    return levels.to(image.dtype) / 255


def solarize(image: torch.Tensor, strength: float) -> torch.Tensor:
    return torch.where(image >= 1 - abs(strength), 1 - image, image)


def autocontrast(image: torch.Tensor, strength: float) -> torch.Tensor:
    """Each channel stretched from its own min..max to 0..1 (a flat channel is left)."""
    lo = image.amin(dim=(1, 2), keepdim=True)
    hi = image.amax(dim=(1, 2), keepdim=True)
    flat = hi <= lo
    return torch.where(flat, image, (image - lo) / torch.where(flat, 1, hi - lo))


def equalize(image: torch.Tensor, strength: float) -> torch.Tensor:
    """PIL's ImageOps.equalize per channel, on the image's 8-bit levels."""
    levels = (image * 255).round().long().clamp(0, 255)
    out = []
    for channel in levels:
        histogram = torch.bincount(channel.flatten(), minlength=256)
        last = int(histogram[histogram.nonzero().max()])
        step = (int(histogram.sum()) - last) // 255
        if step == 0:
            out.append(channel)
            continue
        before = torch.cumsum(histogram, 0) - histogram  # pixels below each level
        lut = ((before + step // 2) // step).clamp(max=255)
        out.append(lut[channel])
    return torch.stack(out).to(image.dtype) / 255


def identity(image: torch.Tensor, strength: float) -> torch.Tensor:
    return image


TRIVIAL_OPS: tuple[Callable[[torch.Tensor, float], torch.Tensor], ...] = (
    identity, shear_x, shear_y, translate_x, translate_y, rotate, brightness, color,
    contrast, sharpness, posterize, solarize, autocontrast, equalize,
)  # fmt: skip
