"""The language model's corpus: which files, their text, their documents and fingerprint.

`--data-dir` names a text file or a folder (every file below it, in sorted order, hidden ones
left out); without it the corpus is this Python's own standard library, the `.py` files at
the top of its folder. Each file is a document, except a `.jsonl` file (JSON lines, the
usual format of LM datasets): each of its lines is an object whose `--text-field` (default
`text`) holds one document. A binary file, a line that is not such an object, or text that
is not UTF-8 is one line naming the file (and the line) and exit code 2.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

from ..runtime.files import folder_problem
from ..training.data_sources import DataError


def default_corpus() -> list[Path]:
    """The standard library's top-level `.py` files, sorted: the same selection every run."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(path for path in stdlib.glob("*.py") if path.is_file())
    if not files:
        raise DataError(f"no .py files in {stdlib} for the default corpus; pass --data-dir")
    return files


def corpus_files(data_dir: str | None) -> list[Path]:
    """The files of the corpus: `data_dir` itself, every file below it, or the default."""
    if data_dir is None:
        return default_corpus()
    root = Path(data_dir)
    if root.is_file():
        return [root]
    problem = folder_problem(root)  # a FIFO or /dev/null: it exists, but holds no text
    if problem is not None:
        raise DataError(f"--data-dir {root} {problem.replace('a folder', 'a text file or folder')}")
    files = sorted(
        path
        for path in root.rglob("*")
        if path.is_file() and not any(p.startswith(".") for p in path.relative_to(root).parts)
    )  # hidden files and folders (.git) are not text
    if not files:
        raise DataError(f"--data-dir {root} holds no files; point it at text files")
    return files


def read_text_bytes(path: Path) -> bytes:
    """The bytes of one text file; a binary file (NUL bytes, not UTF-8) raises DataError."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise DataError(f"cannot read {path}: {error.strerror or error}") from None
    bad = raw.find(b"\0")
    if bad < 0:
        try:
            raw.decode("utf-8")
            return raw
        except UnicodeDecodeError as error:
            bad = error.start
    raise DataError(f"{path} is not UTF-8 text (byte {bad}); remove binary files from the corpus")


def corpus_fingerprint(files: list[Path]) -> str:
    """A hash of the files' resolved paths, sizes and modification times: the token file's
    name, and what every LM checkpoint records so a resume on other text is refused."""
    key = hashlib.sha256()
    for path in files:
        stat = path.stat()
        key.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return key.hexdigest()[:32]


def documents(path: Path, field: str = "text") -> Iterator[bytes]:
    """The documents of one corpus file, as UTF-8 bytes: the file's text, or each line's
    `field` of a .jsonl file (blank lines skipped)."""
    if path.suffix != ".jsonl":
        yield read_text_bytes(path)
        return
    try:
        with path.open("rb") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    yield _json_document(line, field, f"{path}:{number}")
    except OSError as error:
        raise DataError(f"cannot read {path}: {error.strerror or error}") from None


def _json_document(line: bytes, field: str, where: str) -> bytes:
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError) as error:
        raise DataError(f"{where} is not a JSON line ({error}); fix or remove it") from None
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise DataError(
            f"{where} has no string field {field!r}; name the document's field with --text-field"
        )
    return text.encode("utf-8", errors="replace")  # a lone surrogate from JSON's \ud800


def load_tokens(path: Path) -> torch.Tensor:
    """The token file as a tensor backed by the file (`torch.from_file`, mmap): uint8 bytes,
    uint16 or int32 ids by its suffix."""
    dtype = {".u16": torch.uint16, ".i32": torch.int32}.get(path.suffix, torch.uint8)
    size = path.stat().st_size // dtype.itemsize
    if size == 0:
        raise DataError("the corpus is empty; point --data-dir at text files")
    return torch.from_file(str(path), shared=False, size=size, dtype=dtype)
