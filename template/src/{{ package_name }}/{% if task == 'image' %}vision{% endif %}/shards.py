"""Images as datasets are shipped: WebDataset tar shards and Hugging Face `datasets` folders.

`--data-dir` may name either, beside an image folder and `data.pt` (training/data_sources.py):

- **WebDataset shards**: a folder of `.tar` files, or one with `train/` and `val/` (and
  `test/`) folders of them. A sample is the members that share a key (`dir/key.ext`): an
  image (`.jpg`, `.png`, ...) and its class in `.cls` (an integer, as WebDataset writes it).
  A `classes.txt` beside the shards (one name per line) names the classes; otherwise they are
  the numbers 0 to the largest label, which must be below `MAX_CLASSES` (1,000,000: a larger
  one is a broken label, not a class). The shards' tar headers are read once, into each
  image's offset and size. Gzipped shards (`.tar.gz`) cannot be read by index: refused.
- **A `datasets` folder** (`save_to_disk`): a `Dataset`, or a `DatasetDict` with `train` and
  `validation` (or `val`) splits. Its `Image` column holds the images and its `ClassLabel`
  column the classes (their names); the arrow files are memory-mapped with pyarrow (the
  project's `data` extra). Rows that hold a path instead of bytes read the file.

Both are read like an image folder: by index, one sample at a time in the DataLoader workers,
cropped while decoding (`ImageFolder.read_cropped`). So the sampler's shuffle, its split
across ranks and workers, each sample once per epoch and an exact resume position hold as
for a folder; a set written from a folder in the folder's order trains exactly as it does.
Without train/ and val/ (or the splits), `--val-fraction` holds out a seeded share.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from ..training.data_sources import (
    IMAGE_SUFFIXES,
    SOURCES,
    DataError,
    DataInfo,
    ImageFolder,
    image_folder,
    split,
)

SHARD_SPLITS = ("train", "val", "test")
VALIDATION_SPLITS = ("validation", "val", "valid")
MAX_CLASSES = 1_000_000  # without class names, a label this large is a broken one


class Member(io.BytesIO):
    """A sample's image bytes, named for messages (`shard.tar:key.jpg`)."""

    def __init__(self, data: bytes, where: str):
        super().__init__(data)
        self.where = where

    def __str__(self) -> str:
        return self.where


class TarShards(ImageFolder):
    """The image samples of WebDataset shards, in shard then member order."""

    def __init__(self, shards: list[Path], image_size: int, classes: list[str] | None):
        self.root, self.image_size = shards[0].parent, image_size
        self.index: list[tuple[Path, int, int, str]] = []  # shard, offset, size, name
        labels: list[int] = []
        for shard in shards:
            for (offset, size, name), label in _tar_samples(shard):
                self.index.append((shard, offset, size, name))
                labels.append(label)
        if not labels:
            raise DataError(f"{self.root}: no samples (an image and a .cls each) in its shards")
        limit = MAX_CLASSES if classes is None else len(classes)
        bad = next((i for i, label in enumerate(labels) if not 0 <= label < limit), None)
        if bad is not None:
            shard, _, _, name = self.index[bad]
            raise DataError(f"{shard}: {name}'s {label_problem(labels[bad], classes)}")
        self.classes = classes if classes is not None else numbers(labels)
        self.samples = [
            (Path(f"{s.name}:{name}"), label)
            for (s, _, _, name), label in zip(self.index, labels, strict=True)
        ]

    def sample(self, index: int) -> tuple[Any, int]:
        shard, offset, size, name = self.index[index]
        with shard.open("rb") as file:
            file.seek(offset)
            data = file.read(size)
        return Member(data, f"{shard}:{name}"), self.samples[index][1]


def _tar_samples(shard: Path) -> list[tuple[tuple[int, int, str], int]]:
    """((offset, size, member name) of each image, its label) in one shard, by key."""
    images: dict[str, tuple[int, int, str]] = {}
    labels: dict[str, int] = {}
    try:
        with tarfile.open(shard) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                folder, _, base = member.name.rpartition("/")
                stem, _, extension = base.partition(".")
                key = f"{folder}/{stem}"
                if f".{extension.lower()}" in IMAGE_SUFFIXES:
                    images[key] = (member.offset_data, member.size, member.name)
                elif extension == "cls":
                    text = tar.extractfile(member).read()  # type: ignore[union-attr]
                    labels[key] = _label(text, shard, member.name)
    except (OSError, tarfile.TarError) as error:
        raise DataError(f"cannot read the shard {shard} ({error}); replace it") from None
    missing = sorted(set(images) - set(labels))
    if missing:
        raise DataError(f"{shard}: sample {missing[0]} has an image but no .cls label")
    return [(where, labels[key]) for key, where in images.items()]


def _label(text: bytes, shard: Path, name: str) -> int:
    try:
        return int(text.decode().strip())
    except (UnicodeDecodeError, ValueError):
        raise DataError(f"{shard}: {name} is not an integer class label") from None


def label_problem(label: int, classes: list[str] | None) -> str:
    """What is wrong with a class label outside the classes, and what to do."""
    if classes is not None:
        return (
            f"label {label} is outside the {len(classes)} classes of classes.txt; fix the "
            "labels or the class list"
        )
    if label < 0:
        return (
            f"label {label} is negative, and there is no classes.txt: the classes are the "
            "labels 0, 1, 2, ...; fix the label"
        )
    return (
        f"label {label} is too large: without a classes.txt the classes are the numbers 0 to "
        f"the largest label, at most {MAX_CLASSES:,}; fix the label or name the classes in a "
        "classes.txt"
    )


def numbers(labels: list[int]) -> list[str]:
    """Class names of labels without a class list: the numbers up to the largest label."""
    return [str(i) for i in range(max(labels) + 1)]


def compressed(folder: Path) -> list[Path]:
    return sorted([*folder.glob("*.tar.gz"), *folder.glob("*.tgz")])


def shard_files(folder: Path) -> list[Path]:
    """The folder's .tar shards; one line where gzipped shards lie beside them (they cannot
    be read by index, and leaving them out would drop their samples)."""
    shards = sorted(path for path in folder.glob("*.tar") if path.is_file())
    packed = compressed(folder)
    if shards and packed:
        raise DataError(
            f"{packed[0]} is a compressed shard beside {len(shards)} .tar shards, and cannot "
            "be read by index (leaving it out would drop its samples); decompress it (gunzip) "
            "into a .tar"
        )
    return shards


def class_names(root: Path) -> list[str] | None:
    path = root / "classes.txt"
    if not path.is_file():
        return None
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def webdataset_shards(config: Any) -> tuple[Dataset[Any], Dataset[Any], DataInfo] | None:
    """--data-dir of WebDataset shards: its train/ and val/ shards, or its own split by
    --val-fraction."""
    root = Path(config.data.data_dir) if config.data.data_dir is not None else None
    if root is None or not root.is_dir():
        return None
    size, names = config.data.image_size, class_names(root)
    folders = {name: shard_files(root / name) for name in SHARD_SPLITS if (root / name).is_dir()}
    if folders.get("train") and folders.get("val"):
        train, val = (TarShards(folders[name], size, names) for name in ("train", "val"))
        classes = names or [str(i) for i in range(max(len(train.classes), len(val.classes)))]
        train.classes = val.classes = classes
    elif shard_files(root):
        whole = TarShards(shard_files(root), size, names)
        classes = whole.classes
        train, val = split(whole, config.data.val_fraction, root)  # type: ignore[assignment]
    elif any(compressed(root / name) for name in ("", *SHARD_SPLITS)):
        raise DataError(
            f"--data-dir {root} holds compressed shards (.tar.gz), which cannot be read by "
            "index; decompress them (gunzip) into .tar files"
        )
    else:
        return None
    return train, val, DataInfo(3, size, len(classes), in_memory=False, classes=classes)


class ArrowImages(ImageFolder):
    """The rows of a `datasets` split: its arrow files, memory-mapped, opened in each worker."""

    def __init__(self, folder: Path, image_size: int):
        self.root, self.image_size = folder, image_size
        info = _json(folder / "dataset_info.json")
        features = info.get("features") or {}
        self.image_column = _column(features, "Image", folder)
        self.label_column = _column(features, "ClassLabel", folder)
        self.classes = list(features[self.label_column].get("names") or [])
        state = _json(folder / "state.json")
        self.files = [folder / entry["filename"] for entry in state.get("_data_files", [])]
        labels = self._table().column(self.label_column).to_pylist()
        _check_rows(folder, labels, len(self.classes))
        self.classes = self.classes or numbers(labels)
        self.samples = [
            (Path(f"{folder.name}:{row}"), int(label)) for row, label in enumerate(labels)
        ]
        self._opened: Any = None

    def _table(self) -> Any:
        pyarrow = _pyarrow()
        if not self.files:  # what save_to_disk writes for a dataset of no rows
            raise DataError(f"the dataset {self.root} holds no rows (no arrow files)")
        try:
            parts = [
                pyarrow.ipc.open_stream(pyarrow.memory_map(str(f))).read_all() for f in self.files
            ]
        except (OSError, pyarrow.ArrowException) as error:
            raise DataError(f"cannot read the dataset {self.root} ({error})") from None
        return pyarrow.concat_tables(parts)

    def __getstate__(self) -> dict[str, Any]:  # a worker maps the files itself
        return {**self.__dict__, "_opened": None}

    def sample(self, index: int) -> tuple[Any, int]:
        if self._opened is None:
            self._opened = self._table().column(self.image_column)
        cell = self._opened[index].as_py() or {}
        where = f"{self.root}:{index}"
        if cell.get("bytes") is not None:
            return Member(cell["bytes"], where), self.samples[index][1]
        if cell.get("path"):
            return Path(cell["path"]), self.samples[index][1]
        raise DataError(f"{where}: the row holds no image; drop it from the dataset")


def _check_rows(folder: Path, labels: list[int | None], classes: int) -> None:
    """One line for a split of no rows, or a row whose label is missing (datasets writes -1
    or None) or outside the classes (without names: 0 to MAX_CLASSES - 1)."""
    if not labels:
        raise DataError(f"the dataset {folder} holds no rows; save it again with its images")
    limit = classes or MAX_CLASSES
    outside = [row for row, label in enumerate(labels) if label is None or not 0 <= label < limit]
    if outside:
        first = labels[outside[0]]
        said = "no label" if first is None else f"label {first}"
        named = f"the {limit} classes" if classes else f"0 to {MAX_CLASSES - 1:,}"
        raise DataError(
            f"{folder}: row {outside[0]} has {said}, outside {named} ({len(outside)} such "
            "rows); drop or label them"
        )


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DataError(f"cannot read {path} ({error}); save the dataset again") from None
    return data if isinstance(data, dict) else {}


def _column(features: dict[str, Any], kind: str, folder: Path) -> str:
    for name, feature in features.items():
        if isinstance(feature, dict) and feature.get("_type") == kind:
            return name
    raise DataError(f"the dataset {folder} has no {kind} column (an image classifier needs one)")


def saved_dataset(config: Any) -> tuple[Dataset[Any], Dataset[Any], DataInfo] | None:
    """--data-dir a `datasets` folder: its train and validation splits, or its one split
    divided by --val-fraction."""
    root = Path(config.data.data_dir) if config.data.data_dir is not None else None
    size = config.data.image_size
    if root is None:
        return None
    if (root / "dataset_dict.json").is_file():
        splits = _json(root / "dataset_dict.json").get("splits") or []
        val_name = next((name for name in VALIDATION_SPLITS if name in splits), None)
        if "train" not in splits or val_name is None:
            raise DataError(
                f"the dataset {root} has splits {', '.join(splits)}; training needs `train` "
                "and `validation` (or `val`)"
            )
        train, val = ArrowImages(root / "train", size), ArrowImages(root / val_name, size)
        classes = train.classes
    elif (root / "state.json").is_file() and (root / "dataset_info.json").is_file():
        whole = ArrowImages(root, size)
        classes = whole.classes
        train, val = split(whole, config.data.val_fraction, root)  # type: ignore[assignment]
    else:
        return None
    return train, val, DataInfo(3, size, len(classes), in_memory=False, classes=classes)


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
    except ImportError:
        raise DataError(
            "a datasets folder needs pyarrow: pip install pyarrow (or the project's `data` extra)"
        ) from None
    return pyarrow


def split_of(config: Any, split: str) -> tuple[Dataset[Any], str] | None:
    """`evaluate`'s `--split` of a --data-dir of shards or a `datasets` folder: train and val
    as training reads them, test from test/ shards or a `test` split; None for other data."""
    root = Path(config.data.data_dir) if config.data.data_dir is not None else None
    found = webdataset_shards(config) or saved_dataset(config)
    if root is None or found is None:
        return None
    if split in ("train", "val"):
        return (found[0] if split == "train" else found[1]), f"{root} ({split})"
    size, tests = config.data.image_size, shard_files(root / "test")
    if split == "test" and tests:
        dataset: ImageFolder = TarShards(tests, size, class_names(root))
    elif split == "test" and "test" in _json_or_empty(root / "dataset_dict.json").get("splits", []):
        dataset = ArrowImages(root / "test", size)
    else:
        raise DataError(f"--data-dir {root} has no {split} split to evaluate (train, val, test)")
    dataset.classes = found[2].classes or dataset.classes
    return dataset, f"{root} ({split})"


def _json_or_empty(path: Path) -> dict[str, Any]:
    return _json(path) if path.is_file() else {}


# Tried before the image folder, which would take a folder of shards for one of images: the
# package's import (__init__.py) imports this module as it does the slots' registrations.
_folder = SOURCES.index(image_folder)
SOURCES[_folder:_folder] = [webdataset_shards, saved_dataset]
