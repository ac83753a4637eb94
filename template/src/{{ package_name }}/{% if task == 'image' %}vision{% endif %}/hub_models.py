"""Pretrained image classifiers from Hugging Face `transformers`: `--model hf --hf-model SOURCE`.

SOURCE is a local folder (`config.json`, `model.safetensors`, `preprocessor_config.json`, as
`save_pretrained` writes it) or a hub id such as `microsoft/resnet-50` (downloaded once into
the hub's cache). Any `AutoModelForImageClassification` architecture works: ResNet, ConvNeXt,
ViT, EfficientNet, Swin and the rest. The classifier head is resized to the data's classes and
freshly initialised when their count differs (`ignore_mismatched_sizes`); the input size
(`--image-size`) and the normalisation come from the model's preprocessor config, not from a
measurement of your images, because the weights were trained on inputs normalised that way.
`export` folds that normalisation into the `.pt2`, as it does the measured one.

Fine-tuning: `--backbone-lr-factor 0.1` trains everything but the head at a tenth of `--lr`;
`--freeze` trains the head only (with `--init-from`, as for the built-in models). Needs the
`hub` extra (`pip install -e ".[hub]"`); the template never imports transformers otherwise.
The model is registered through the same slot a model of yours uses (`@slots.model`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import slots
from ..settings.base import ConfigError

PREPROCESSOR = "preprocessor_config.json"


class HubClassifier(nn.Module):
    """A transformers image classifier as this project calls models: images in, logits out."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.inner(pixel_values=x).logits
        return logits


@slots.model("hf", help="a transformers image classifier: --hf-model FOLDER or hub id")
def build_hf(config: Any, info: Any) -> nn.Module:
    """The `--hf-model` classifier with a head for `info.num_classes` classes, on the CPU."""
    folder = local_folder(config)
    library = _library()
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"--hf-model {folder} has no config.json: not a transformers folder "
            "(save_pretrained writes config.json and model.safetensors)"
        )
    try:
        spec = library.AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as error:  # not JSON, or no model_type transformers knows
        raise ConfigError(f"--hf-model {folder}: {str(error).splitlines()[0]}") from None
    channels = getattr(spec, "num_channels", info.in_channels)
    if channels != info.in_channels:
        raise ConfigError(
            f"--hf-model {folder}: the model takes {channels}-channel images, the data has "
            f"{info.in_channels}"
        )
    names = info.classes or [str(index) for index in range(info.num_classes)]
    verbosity = library.logging.get_verbosity()
    library.logging.set_verbosity_error()  # the head's re-initialisation is said below
    try:
        inner = library.AutoModelForImageClassification.from_pretrained(
            folder,
            num_labels=info.num_classes,
            id2label=dict(enumerate(names)),
            label2id={name: index for index, name in enumerate(names)},
            ignore_mismatched_sizes=True,
            **float32(library),
        )
    except (OSError, ValueError) as error:
        raise ConfigError(f"--hf-model {folder}: {str(error).splitlines()[0]}") from None
    finally:
        library.logging.set_verbosity(verbosity)
    return HubClassifier(inner)


def float32(library: Any) -> dict[str, torch.dtype]:
    """`from_pretrained`'s argument for float32 weights whatever dtype the folder was saved
    in (transformers 5 loads the config's by default, `dtype="auto"`): --precision alone
    decides how training computes. `dtype` since transformers 4.56, `torch_dtype` before."""
    major, minor = (int(part) for part in re.findall(r"\d+", library.__version__)[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.float32}


def local_folder(config: Any) -> Path:
    """The `--hf-model` folder: as given, or the hub's cached download of a hub id."""
    source = getattr(config.model, "hf_model", None)
    if not source:
        raise ConfigError("--model hf needs --hf-model: a transformers folder or a hub id")
    if Path(source).is_dir():
        return Path(source)
    if Path(source).is_absolute() or source.startswith((".", "~")) or source.count("/") > 1:
        raise ConfigError(f"--hf-model {source}: no such folder (nor a hub id: owner/name)")
    _library()
    from huggingface_hub import snapshot_download

    try:
        patterns = ["*.json", "*.safetensors"]
        return Path(snapshot_download(source, allow_patterns=patterns))
    except Exception as error:  # the hub's errors have no common base but Exception
        raise ConfigError(
            f"--hf-model {source}: not a folder, and not downloadable from the hub "
            f"({str(error).splitlines()[0]})"
        ) from None


def preprocessing(config: Any) -> tuple[list[float], list[float], int | None] | None:
    """(mean, std, input size) from the `--hf-model` preprocessor config; None when the
    model is not `hf`. A missing preprocessor config means ImageNet's (transformers' default);
    `do_normalize: false`, none (mean 0, std 1). The input size is its crop's, else its
    resize's."""
    if getattr(config.model, "model", None) != "hf":
        return None
    path = local_folder(config) / PREPROCESSOR
    try:
        spec = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as error:
        raise ConfigError(f"--hf-model: cannot read {path} ({error})") from None
    mean = [float(v) for v in spec.get("image_mean", [0.485, 0.456, 0.406])]
    std = [float(v) for v in spec.get("image_std", [0.229, 0.224, 0.225])]
    if spec.get("do_normalize") is False:  # its weights take the [0, 1] pixels as they are
        mean, std = [0.0] * len(mean), [1.0] * len(std)
    size = spec.get("crop_size") or spec.get("size") or {}
    side = size.get("height", size.get("shortest_edge")) if isinstance(size, dict) else size
    return mean, std, int(side) if side else None


def adopt(config: Any, log: Callable[[str], None]) -> Any:
    """`config` with `--image-size` from the `--hf-model` preprocessor config (as it is for
    other models), logged when it changes."""
    found = preprocessing(config)
    if found is None or found[2] is None or found[2] == config.data.image_size:
        return config
    log(f"--hf-model: --image-size {found[2]}, the model's input size")
    return config.replace(image_size=found[2])


@cache
def _library() -> Any:
    """Hugging Face `transformers`, or one line saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            '--model hf needs Hugging Face transformers: pip install -e ".[hub]"'
        ) from None
    return transformers
