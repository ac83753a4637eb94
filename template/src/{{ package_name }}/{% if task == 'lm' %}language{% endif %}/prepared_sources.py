"""The sources `prepare` reads: which files, and the documents in each.

A source is a file or a folder. A folder is read file by file in sorted order (hidden files
and folders left out), except a folder a Hugging Face `datasets` saved (`save_to_disk`: a
`state.json` beside `dataset_info.json`), which is read through the arrow files its
`state.json` lists; a `DatasetDict`'s folder holds one such folder per split, and every split
is read. A file is a unit of work by its suffix: `.jsonl` (each line's field), `.parquet`
(each row's field), `.arrow` (an arrow stream, as `datasets` writes it), anything else one
UTF-8 text document. pyarrow reads parquet and arrow, imported only for them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from ..training.data_sources import DataError
from .corpus import documents, read_text_bytes

KINDS = {".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}


@dataclass(frozen=True)
class Unit:
    """One file of a source, and how its documents are read (text, jsonl, parquet, arrow)."""

    path: Path
    kind: str


def source_units(sources: list[str]) -> list[Unit]:
    """The units of every source, in the order given (each folder's in sorted order); a file
    reached twice (named twice, or through a link) is read once, where it is first reached."""
    units: list[Unit] = []
    for source in sources:
        path = Path(source)
        if path.is_file():
            units.append(Unit(path, kind_of(path)))
        elif path.is_dir():
            found = list(_folder_units(path))
            if not found:
                raise DataError(f"source {path} holds no files")
            units.extend(found)
        else:
            raise DataError(f"source {path} is not a file or a folder")
    seen: set[Path] = set()
    first = []
    for unit in units:
        real = unit.path.resolve()
        if real not in seen:
            seen.add(real)
            first.append(unit)
    return first


def kind_of(path: Path) -> str:
    """How a file's documents are read, by its suffix (in any case): text by default."""
    return KINDS.get(path.suffix.lower(), "text")


def _folder_units(folder: Path) -> Iterator[Unit]:
    if (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file():
        yield from _saved_dataset_units(folder)
        return
    if is_prepared_folder(folder):
        return  # an earlier `prepare`'s output: tokens, not text
    for path in sorted(folder.iterdir()):
        if path.name.startswith("."):
            continue  # hidden files and folders (.git) are not text
        if path.is_dir() and not path.is_symlink():  # a link to a folder can loop
            yield from _folder_units(path)
        elif path.is_file() and path.name != "dataset_dict.json":  # a DatasetDict's splits
            yield Unit(path, kind_of(path))


def is_prepared_folder(folder: Path) -> bool:
    """Whether `folder` is what `prepare` writes (a manifest.json naming its request)."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and "request" in manifest and "format" in manifest


def _saved_dataset_units(folder: Path) -> Iterator[Unit]:
    """The arrow files a `save_to_disk` folder's state.json lists, in its order."""
    state_path = folder / "state.json"
    try:
        files = json.loads(state_path.read_text(encoding="utf-8"))["_data_files"]
        names = [entry["filename"] for entry in files]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"{state_path} is not a datasets state.json ({error})") from None
    for name in names:
        path = folder / name
        if not path.is_file():
            raise DataError(f"{state_path} lists {name}, which is missing")
        yield Unit(path, "arrow")


def unit_documents(unit: Unit, field: str) -> Iterator[bytes]:
    """The documents of one unit, as UTF-8 bytes."""
    if unit.kind == "text":
        yield read_text_bytes(unit.path)
    elif unit.kind == "jsonl":
        yield from documents(unit.path, field)
    else:
        yield from _table_documents(unit, field)


def _table_documents(unit: Unit, field: str) -> Iterator[bytes]:
    """The `field` column of a parquet file or an arrow stream, a record batch at a time."""
    pyarrow = _pyarrow()
    try:
        if unit.kind == "parquet":
            table = pyarrow.parquet.ParquetFile(unit.path)
            _check_field(table.schema_arrow.names, field, unit)
            batches = table.iter_batches(batch_size=1024, columns=[field])
        else:
            reader = pyarrow.ipc.open_stream(pyarrow.memory_map(str(unit.path)))
            _check_field(reader.schema.names, field, unit)
            batches = iter(reader)
        row = 0
        for batch in batches:
            for text in batch.column(field).to_pylist():
                if not isinstance(text, str):
                    raise DataError(
                        f"{unit.path}: row {row}'s {field!r} is {type(text).__name__}, not text"
                    )
                row += 1
                yield text.encode("utf-8", errors="replace")
    except (OSError, pyarrow.ArrowException) as error:
        raise DataError(f"cannot read {unit.path} as {unit.kind} ({error})") from None


def _check_field(names: list[str], field: str, unit: Unit) -> None:
    if field not in names:
        raise DataError(
            f"{unit.path} has no column {field!r} (it has {', '.join(names)}); name the "
            "documents' column with --text-field"
        )


@cache
def _pyarrow() -> Any:
    """pyarrow with its parquet and ipc modules, or one line saying how to install it."""
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError(
            "parquet and datasets folders need pyarrow: pip install pyarrow (or the project's "
            "`data` extra)"
        ) from None
    return pyarrow
