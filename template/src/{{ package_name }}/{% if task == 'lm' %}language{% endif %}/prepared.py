"""A folder `prepare` wrote (`--data-dir`): its manifest, which documents are held out, the
token files' suffix, and reading it back. Here, beneath prepare.py (the command that writes
one), so that reading a folder (training, evaluate, compress, chat data) never imports it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from ..training.data_sources import DataError
from .corpus import load_tokens
from .prepared_sources import Unit
from .tokenizer import HFTokenizer, Tokenizer, eos_record

FORMAT = 1  # manifest.json's "format": what load_prepared reads
PARTS = ".parts"  # finished parts of a run that has not ended yet


def held_out(document: bytes, fraction: float) -> bool:
    """Whether a document is validation: its text's hash, as a number in [0, 1), is below
    `fraction` (the same document is always on the same side)."""
    digest = hashlib.blake2b(document, digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def suffix_of(tokenizer: Tokenizer) -> str:
    """The token files' suffix: .u8 bytes, .u16 ids that fit, .i32 otherwise."""
    if tokenizer.kind == "bytes":
        return ".u8"
    return ".u16" if tokenizer.vocab_size <= 65536 else ".i32"


def request_key(units: list[Unit], tokenizer: str, field: str, fraction: float) -> str:
    """What the prepared folder is of: the sources (paths, sizes, modification times), the
    tokenizer (a given one's hash, or the BPE's settings) and the other settings. A rerun
    with the same key finds the work done."""
    key = hashlib.sha256(f"{tokenizer}\0{field}\0{fraction!r}\n".encode())
    for unit in units:
        stat = unit.path.stat()
        key.update(f"{unit.path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return key.hexdigest()[:32]


def refuse_foreign(out: Path) -> None:
    """One line unless `out` is new, empty, or a folder a `prepare` began (its `.parts`): the
    files of a folder without a manifest and without parts are not prepare's to replace."""
    try:
        names = sorted(path.name for path in out.iterdir()) if out.is_dir() else []
    except OSError:
        return  # an --out that cannot be listed cannot be made either: said below
    if names and PARTS not in names:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise DataError(
            f"--out {out} holds files prepare did not write ({shown}) and no manifest.json; "
            "choose a new or empty --out (nothing in it was changed)"
        )


def read_manifest(folder: Path) -> dict[str, Any]:
    """A prepared folder's manifest, or one line saying what is wrong with it."""
    path = folder / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DataError(f"cannot read {path} ({error}); prepare the folder again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path} is not a manifest this version reads; prepare the folder again")
    return manifest


def is_prepared(data_dir: str | None) -> bool:
    """Whether `--data-dir` names a folder `prepare` made (one with a manifest.json)."""
    return data_dir is not None and (Path(data_dir) / "manifest.json").is_file()


def load_prepared(
    folder: Path, tokenizer: Tokenizer | None = None
) -> tuple[torch.Tensor, torch.Tensor, Tokenizer, str]:
    """(train tokens, validation tokens, tokenizer, fingerprint) of a prepared folder, the
    tokens memory-mapped. `tokenizer` (a checkpoint's) must be the one it was prepared with."""
    manifest, saved = read_manifest(folder), folder / "tokenizer.json"
    try:
        named, fingerprint = manifest["tokenizer"]["fingerprint"], str(manifest["fingerprint"])
        files = [folder / manifest[split]["file"] for split in ("train", "val")]
        own = HFTokenizer(saved.read_text(encoding="utf-8")) if saved.is_file() else Tokenizer()
    except (KeyError, TypeError, OSError, DataError) as error:  # incomplete, or unreadable
        said = error if isinstance(error, (OSError, DataError)) else f"manifest.json: {error!r}"
        raise DataError(f"{folder} is not whole ({said}); prepare it again") from None
    lost = [path for path in files if not path.is_file()]  # bytes: no tokenizer.json
    if lost or (own.fingerprint() != named and not saved.is_file()):
        raise DataError(f"{(lost or [saved])[0]} is missing; prepare {folder} again")
    if own.fingerprint() != named:
        raise DataError(f"{saved} is not the tokenizer {folder}'s manifest names; prepare it again")
    if tokenizer is not None and tokenizer.fingerprint() != own.fingerprint():
        raise DataError(
            f"--data-dir {folder} was prepared with another tokenizer ({own.fingerprint()}) than "
            f"the model's or --tokenizer's ({tokenizer.fingerprint()}); prepare the text again "
            "with that --tokenizer"
        )
    own.eos_ids = (
        tokenizer.eos_ids
        if tokenizer is not None
        else eos_record(manifest["tokenizer"].get("eos_ids"), own.vocab_size)
    )
    train, val = (load_tokens(path) for path in files)
    return train, val, own, fingerprint
