"""The input normalisation that travels with the model: built once with it, used alike by
the training step, validation, evaluate, predict and export.

As timm's `pretrained_cfg` keeps a model's preprocessing with the model, the per-channel
`(x - mean) / std` here belongs to the model, not to the code that calls it. `prepare`
(vision/images.py) decides it once for the data (`normalization_for`): the mean and std
measured on the training split (cached), a `--model hf`'s own from its preprocessor config,
or none for the built-in synthetic data. It travels in `DataInfo.normalization`, and
`build_model_for` (training/task.py), through which every model is built, attaches it
(`attach`) to the model your registration returns:

- two non-persistent buffers, `normalization_mean` and `normalization_std` ((1, C, 1, 1),
  float32): they move with `model.to(device)` and are not in `state_dict()`, so checkpoints,
  `--init-from`, the converter and sharded checkpoints see your model's own keys only;
- a forward pre-hook that normalises the batch as the dataset yields it (float, or uint8
  read as its values) on the device, before your model's forward runs.

So `model(images)` is the whole model wherever it runs: in the training step and validation
(through DDP, FSDP2, torch.compile and channels-last alike; under FSDP2 it runs before
FSDP's input cast, on the batch as loaded), in evaluate and predict, and in the program
export writes (torch.export traces the hook into the `.pt2`). Your model never knows.
The run record of metrics.jsonl and of every checkpoint keeps mean and std
(`run["dataset"]`), as it always has; vision/trained.py gives them back to `build_model_for`
(`from_record`), so any checkpoint normalises as it was trained.

Measuring: per-channel mean and std over at most `MAX_MEASURED` evenly spaced training
samples (float64 sums), cached in `utils.cache_dir()/normalization.json` by `dataset_key`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from ..runtime.stopping import stops_between_batches
from ..utils import SignalSafeLoader, cache_dir, seed_worker
from . import hub_models

MAX_MEASURED = 4096  # samples the mean/std is measured on
NORMALIZATION_CACHE = "normalization.json"
MEAN, STD = "normalization_mean", "normalization_std"  # the model's buffers (not saved)


@dataclass(frozen=True)
class Normalization:
    """Per-channel `(x - mean) / std`, the first step of every model this project runs."""

    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def identity(cls, channels: int) -> Normalization:
        """Mean 0, std 1: the images as they are."""
        return cls((0.0,) * channels, (1.0,) * channels)

    @classmethod
    def from_record(cls, dataset: dict[str, Any], channels: int) -> Normalization:
        """The one a run record's "dataset" entry keeps; none in a record from before it
        kept one."""
        default = cls.identity(channels)
        mean = tuple(float(v) for v in dataset.get("mean", default.mean))
        std = tuple(float(v) for v in dataset.get("std", default.std))
        return cls(mean, std)

    def record(self) -> dict[str, list[float]]:
        """Its entries in the run record (metrics.jsonl and every checkpoint)."""
        return {"mean": list(self.mean), "std": list(self.std)}


def attach(model: nn.Module, normalization: Normalization | None) -> nn.Module:
    """`model` normalising its inputs by `normalization`: its buffers set, and the hook added
    once. None, or the identity on a model without one, leaves it as it is (no kernel that
    changes no value)."""
    if normalization is None:
        return model
    attached = isinstance(getattr(model, MEAN, None), torch.Tensor)
    if not attached and normalization == Normalization.identity(len(normalization.mean)):
        return model
    for name, values in ((MEAN, normalization.mean), (STD, normalization.std)):
        tensor = torch.tensor(values, dtype=torch.float32).view(1, -1, 1, 1)
        model.register_buffer(name, tensor, persistent=False)
    if not attached:
        model.register_forward_pre_hook(normalize_inputs)
    return model


def normalize_inputs(model: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The forward pre-hook: the first positional input normalised, in float32 (in the
    input's own dtype where it is a lower-precision float, as FSDP2's bf16 cast makes it)."""
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    images = args[0]
    mean, std = getattr(model, MEAN), getattr(model, STD)
    normalized = (images.float() - mean) / std
    if images.is_floating_point():
        normalized = normalized.to(images.dtype)
    return (normalized, *args[1:])


def normalization_for(
    config: Any, train: Dataset[Any], key: str | None, say: Callable[[str], None]
) -> Normalization | None:
    """The data's normalisation: a `--model hf`'s own (from its preprocessor config), else
    the one measured on `train` (cached under `key`), else none (`key` None: synthetic data)."""
    pretrained = hub_models.preprocessing(config)
    if pretrained is not None:  # a --model hf: the inputs its weights were trained on
        mean, std = pretrained[0], pretrained[1]
        say(f"normalisation (--hf-model's preprocessor config): mean {mean} std {std}")
        return Normalization(tuple(mean), tuple(std))
    if key is None:
        return None
    mean, std, cached = measure_mean_std(train, key)
    say(f"normalisation ({'cached' if cached else 'measured'}): mean {mean} std {std}")
    return Normalization(tuple(mean), tuple(std))


def measure_mean_std(
    dataset: Dataset[Any], key: str, cache: Path | None = None
) -> tuple[list[float], list[float], bool]:
    """Per-channel (mean, std) of `dataset`'s images and whether they came from the cache.

    At most MAX_MEASURED evenly spaced samples are read (in float64 sums); a channel whose
    std is (nearly) zero gets 1, so a constant channel is only centred.
    """
    path = (cache if cache is not None else cache_dir()) / NORMALIZATION_CACHE
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    if isinstance(stored, dict) and isinstance(stored.get(key), dict):
        entry = stored[key]
        return list(entry["mean"]), list(entry["std"]), True
    size = len(dataset)  # type: ignore[arg-type]
    picked = torch.linspace(0, size - 1, min(size, MAX_MEASURED)).round().long().unique().tolist()
    workers = 0 if len(picked) <= 512 else min(4, os.cpu_count() or 1)
    # A generator of its own: the loader's seed would otherwise come from the global RNG, and
    # the run's random streams would depend on whether the answer was cached. Its workers
    # leave a stop signal (Ctrl-C to the process group) to the main process, as training's do.
    loader = SignalSafeLoader(
        Subset(dataset, picked),
        batch_size=64,
        num_workers=workers,
        generator=torch.Generator().manual_seed(0),
        worker_init_fn=seed_worker,
    )
    total = squares = None
    count = 0
    with stops_between_batches() as check:  # a Ctrl-C waits for the batch in flight
        for images, _ in loader:
            check()
            values = images.double().transpose(0, 1).flatten(1)  # (C, N*H*W)
            total = values.sum(1) if total is None else total + values.sum(1)
            squares = (values**2).sum(1) if squares is None else squares + (values**2).sum(1)
            count += values.shape[1]
    assert total is not None and squares is not None
    mean = total / count
    std = (squares / count - mean**2).clamp_min(0).sqrt()
    std = torch.where(std < 1e-6, torch.ones_like(std), std)
    result = [round(v, 6) for v in mean.tolist()], [round(v, 6) for v in std.tolist()]
    stored = stored if isinstance(stored, dict) else {}
    stored[key] = {"mean": result[0], "std": result[1]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs measuring again next time
    return result[0], result[1], False


def dataset_key(root: Path, image_size: int, samples: int, detail: str) -> str:
    """What a cached mean/std is keyed by: the folder and its modification time (which
    changes when a class folder is added or removed), the image size, the number of images
    and the split. Replacing images under the same names keeps the key: delete the cache."""
    stamp = root.stat().st_mtime_ns if root.exists() else 0
    return f"{root.resolve()}|{stamp}|{image_size}|{samples}|{detail}"
