"""What evaluate, predict and export share: a trained model back from its checkpoint.

`load_trained` reads a checkpoint file (last.pt, best.pt, or a single-file conversion of a
sharded one) with `weights_only=True`, rebuilds the config it was trained with, the model
through `build_model_for` with the input normalisation it was trained with (the mean and std
of its run record, `run["dataset"]`: the model normalises its inputs itself, as in training,
vision/normalization.py), and the class names (written by train since the class names were
recorded; an older checkpoint gets class names "0", "1", ... and no normalisation).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ..checkpointing.checkpoint import CheckpointError, checked_config, load_state_into, read_model
from ..config import Config
from ..runtime.files import folder_problem
from ..settings.parsing import leaf_fields
from ..training import data_sources
from ..training.data_sources import DataError, DataInfo
from ..training.task import build_datasets, build_model_for
from . import images
from . import shards as image_shards
from .normalization import Normalization


@dataclass
class Trained:
    model: nn.Module  # in eval mode, on the device asked for; normalises its inputs itself
    config: Config
    info: DataInfo
    classes: list[str]


def load_trained(path: Path, device: torch.device) -> Trained:
    """The model of checkpoint `path` and what it needs to run; CheckpointError if unusable."""
    if path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} is a sharded folder; convert it to one file with "
            f"python -m {__package__.rpartition('.')[0]}.checkpointing.convert first"
        )
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; train first or fix the path")
    state = read_model(path)  # finite weights, a config table, this format
    config = saved_config(state["config"], path)
    run: dict[str, Any] = state["run"] if isinstance(state.get("run"), dict) else {}
    dataset: dict[str, Any] = run["dataset"] if isinstance(run.get("dataset"), dict) else {}
    num_classes = int(dataset.get("num_classes", config.data.num_classes))
    classes = [str(name) for name in dataset.get("classes", range(num_classes))]
    channels = int(dataset.get("in_channels", 3))
    info = DataInfo(
        channels,
        int(dataset.get("image_size", config.data.image_size)),
        num_classes,
        in_memory=False,
        classes=classes,
        normalization=Normalization.from_record(dataset, channels),
    )
    model = build_model_for(config.replace(channels_last=False), info)
    load_state_into(model, state["model"], "model", path)
    return Trained(model.to(device).eval(), config, info, classes)


def saved_config(saved: Any, path: Path) -> Config:
    """The Config a checkpoint was trained with (stored flat); fields this code lacks are
    ignored."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {path}: 'config' is not a dict")
    leaves = leaf_fields(Config)
    try:
        config = Config.from_flat({k: v for k, v in saved.items() if k in leaves}, "saved config: ")
    except ValueError as error:
        raise CheckpointError(f"checkpoint {path}: {error}") from None
    return checked_config(config, path)  # train's validation: no model built from bad values


def split_dataset(trained: Trained, data_dir: str | None, split: str) -> tuple[Dataset[Any], str]:
    """The images of `split` of `data_dir` (default: the one trained on), unnormalised, with
    labels in the checkpoint's class order; and a description of where they came from.

    train/val/test of a pre-split folder are its sub-folders; of a folder of classes (or
    `data.pt`, or synthetic data), train and val are training's own seeded split, and `all`
    is every image of a folder of classes.
    """
    config = trained.config
    if data_dir is not None:
        config = config.replace(data_dir=data_dir)
    root = Path(config.data.data_dir) if config.data.data_dir is not None else None
    problem = folder_problem(root) if root is not None else None
    if problem is not None:
        raise DataError(f"--data-dir {root} {problem}")
    shipped = image_shards.split_of(config, split)  # WebDataset shards, a datasets folder
    if shipped is not None:
        return shipped
    splits = images.find_splits(root) if root is not None else None
    if split == "all" or (splits is not None and split in splits):
        folder_root = splits[split] if splits is not None and split != "all" else root
        if folder_root is None:
            raise DataError(
                "--split all needs --data-dir (the model was trained on synthetic data)"
            )
        folder = data_sources.checked_folder(folder_root, trained.info.image_size)
        if folder.classes != trained.classes:
            unknown = sorted(set(folder.classes) - set(trained.classes))
            detail = f"{unknown[0]!r} is not one of them" if unknown else "some are missing"
            raise DataError(
                f"{folder_root}: its class folders differ from the {len(trained.classes)} "
                f"classes the model was trained on ({detail})"
            )
        return folder, str(folder_root)
    if split == "test" or splits is not None:
        raise DataError(f"--data-dir {root} has no {split}/ folder (splits: {list(splits or [])})")
    train, val, _ = build_datasets(config)
    where = f"{root or 'synthetic data'} ({split} part of training's seeded split)"
    return (train if split == "train" else val), where
