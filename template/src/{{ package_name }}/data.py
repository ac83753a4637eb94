"""Your data: `build_datasets` gives training its (train, validation, info) from a source.

The template's sources live in data_sources.py, which template updates change: built-in
synthetic data without `--data-dir`, and for `--data-dir` a folder holding `data.pt` or an
image folder (its docstring has the layouts). This file is yours and a template release leaves
it alone. Add a source of your own: a function that takes the config and returns `(train,
val, DataInfo(in_channels, image_size, num_classes, in_memory))`, or None when the config is
not for it, listed in `SOURCES`:

    def my_csv(config: Config) -> Datasets | None:
        if config.data.data_dir is None or not config.data.data_dir.endswith(".csv"):
            return None
        ...

    SOURCES: list[Source] = [my_csv]

Yours are tried first, in order, then the template's. Each dataset yields `(input, label)`.
"""

from __future__ import annotations

from . import data_sources
from .config import Config
from .data_sources import (
    IMAGE_SUFFIXES,
    DataError,
    DataInfo,
    Datasets,
    ImageFolder,
    ResumableSampler,
    Source,
    checked_folder,
    shard,
)

# The names template code and model.py import from here.
__all__ = ["IMAGE_SUFFIXES", "DataError", "DataInfo", "Datasets", "ImageFolder"]
__all__ += ["ResumableSampler", "Source", "build_datasets", "checked_folder", "shard"]

# Your data sources, tried in this order before the template's (data_sources.SOURCES).
SOURCES: list[Source] = []


def build_datasets(config: Config) -> Datasets:
    """(train, validation, info) from the first source that takes `config`."""
    return data_sources.first_source(config, [*SOURCES, *data_sources.SOURCES])
