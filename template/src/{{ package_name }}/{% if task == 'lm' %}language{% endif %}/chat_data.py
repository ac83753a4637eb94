"""Chat data: conversations prepared into tokens and a loss mask, and the windows training
reads from them.

    python -m <package>.prepare chats.jsonl --format chat --out data/chat --tokenizer FOLDER
    python -m <package>.train --data-dir data/chat --max-steps 500

`prepare --format chat` reads JSON lines (files, or folders of them), each line a
conversation `{"messages": [{"role": ..., "content": ...}, ...]}` as OpenAI's and Hugging
Face's chat datasets write them, renders each with the tokenizer's chat template
(language/chat.py) and writes, per split, the tokens (`train.u16`...), one byte per token
saying whether the loss covers it (`train.mask.u8`: the assistants' turns) and where each
conversation starts (`train.starts.i64`, with the end last), beside the tokenizer.json, the
chat template (`tokenizer_config.json`, where the tokenizer came with one) and a
manifest.json that says `"chat": true`. Conversations are held out for validation by a hash
of their messages (as canonical JSON), as documents are. It runs in one process (`--workers`
and `--text-field` are text's) and starts again from the beginning if stopped.

Training on such a folder (`--data-dir`) reads one conversation per window: its first
`--seq-len` + 1 tokens, padded after its end; conversations never share a window, so none
attends to another and the model needs no attention mask (model.py is unchanged). The
targets the loss does not cover (system and user messages, the template's headers, the
padding) are `chat.IGNORE_INDEX`; the task leaves them out before the loss
(language/lm_task.py), so cross-entropy, a loss of yours (`@slots.loss`), the accuracy, the
metrics and bits per byte see only the assistants' tokens. A conversation with no covered
target in its window (its answer starts past `--seq-len`) is left out. An epoch is
`--train-samples` conversations, taken in turn (the next epoch goes on where this one
ended, round the training set and again), in an order drawn from the seed.
"""

from __future__ import annotations

import json
import os
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset

from ..config import Config
from ..runtime.files import write_atomically
from ..training.data_sources import DataError
from .chat import IGNORE_INDEX, chat_tokens_and_mask, check_messages
from .corpus import load_tokens
from .prepared import (
    FORMAT,
    held_out,
    load_prepared,
    read_manifest,
    refuse_foreign,
    request_key,
    suffix_of,
)
from .prepared_sources import source_units
from .tokenizer import Tokenizer, attach_chat_config, read_chat_config, tokenizer_at, train_bpe

MASK = ".mask.u8"  # beside each split's token file: 1 where the loss covers the token
STARTS = ".starts.i64"  # each conversation's first token, and the split's end


def conversations(sources: list[str]) -> Iterator[tuple[bytes, list[dict[str, str]]]]:
    """(its messages as canonical JSON, the checked messages) of every JSON line of the
    sources, in order: the same conversation written otherwise is the same bytes, and so
    held out alike."""
    for unit in source_units(sources):
        try:
            with unit.path.open("rb") as lines:
                for number, line in enumerate(lines, 1):
                    if line.strip():
                        messages = _messages(line, f"{unit.path}:{number}")
                        canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False)
                        yield canonical.encode("utf-8"), messages
        except OSError as error:
            raise DataError(f"cannot read {unit.path}: {error.strerror or error}") from None


def _messages(line: bytes, where: str) -> list[dict[str, str]]:
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError) as error:
        raise DataError(f"{where} is not a JSON line ({error}); fix or remove it") from None
    if not isinstance(record, dict) or "messages" not in record:
        raise DataError(f'{where} has no "messages" (each line is one conversation: its messages)')
    return check_messages(record["messages"], where)


def trained_bpe(sources: list[str], vocab_size: int, fraction: float, mb: int) -> Tokenizer:
    """A BPE trained on up to `mb` MB of the training conversations' messages."""

    def texts() -> Iterator[str]:
        left = mb << 20
        for line, messages in conversations(sources):
            if left <= 0:
                return
            if not held_out(line, fraction):
                left -= len(line)
                yield from (message["content"] for message in messages)

    return train_bpe(texts(), vocab_size)


def prepare_chat(
    sources: list[str],
    out: Path,
    tokenizer_spec: str = "bpe",
    vocab_size: int = 1024,
    val_fraction: float = 0.1,
    bpe_sample_mb: int = 64,
) -> dict[str, Any]:
    """Prepare the conversations of `sources` into `out`; return the manifest."""
    if not sources:
        raise DataError('--format chat needs sources: JSON lines of {"messages": [...]}')
    units = source_units(sources)
    given = None if tokenizer_spec == "bpe" else tokenizer_at(tokenizer_spec)
    template = json.dumps(given.chat_config if given else None, sort_keys=True)
    which = f"chat {given.fingerprint()} {template}" if given else f"chat bpe {vocab_size}"
    key = request_key(units, f"{which} {bpe_sample_mb}", "messages", val_fraction)
    if (out / "manifest.json").is_file():
        manifest = read_manifest(out)
        if manifest.get("request") == key:
            return manifest
        raise DataError(f"--out {out} holds another prepared corpus; choose another --out")
    refuse_foreign(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DataError(f"cannot make --out {out} ({error.strerror or error})") from None
    tokenizer = given or trained_bpe(sources, vocab_size, val_fraction, bpe_sample_mb)
    suffix = suffix_of(tokenizer)
    splits = {name: _SplitWriter(out, name, suffix) for name in ("train", "val")}
    try:
        for line, messages in conversations(sources):
            ids, mask = chat_tokens_and_mask(tokenizer, messages)
            split = splits["val" if held_out(line, val_fraction) else "train"]
            split.add(ids, mask, len(line))
        totals = {name: split.finish() for name, split in splits.items()}
    finally:
        for split in splits.values():
            split.close()
    for name, label in (("train", "training"), ("val", "validation")):
        if totals[name]["documents"] == 0:
            raise DataError(
                f"the {label} split holds no conversation; use more conversations or "
                "another --val-fraction"
            )
    if tokenizer.kind != "bytes":
        write_atomically(out / "tokenizer.json", tokenizer.to_json() or "", "--out")
    if tokenizer.chat_config is not None:
        config = {"chat_template": tokenizer.chat_config["template"]}
        config.update(tokenizer.chat_config["tokens"])
        write_atomically(out / "tokenizer_config.json", json.dumps(config, indent=1), "--out")
    manifest = {
        "format": FORMAT,
        "chat": True,
        "request": key,
        "fingerprint": f"prepared-{key}",
        "sources": sources,
        "files": len(units),
        "val_fraction": val_fraction,
        "tokenizer": {
            "kind": tokenizer.kind,
            "fingerprint": tokenizer.fingerprint(),
            "vocab_size": tokenizer.vocab_size,
            "eos_ids": list(tokenizer.eos_ids),  # a model folder's own (tokenizer.read_eos_ids)
        },
        **{name: {"file": f"{name}{suffix}", **totals[name]} for name in totals},
    }
    write_atomically(out / "manifest.json", json.dumps(manifest, indent=1), "--out")
    mode = (out / f"train{suffix}").stat().st_mode & 0o777  # as the token files
    for small in ("manifest.json", "tokenizer.json", "tokenizer_config.json"):
        if (out / small).is_file():
            (out / small).chmod(mode)  # written through a private temporary file (0600)
    return manifest


class _SplitWriter:
    """One split's token, mask and start files, written whole and then renamed."""

    def __init__(self, out: Path, name: str, suffix: str):
        self.paths = [out / f"{name}{suffix}", out / f"{name}{MASK}", out / f"{name}{STARTS}"]
        self.typecode = {".u8": "B", ".u16": "H"}.get(suffix, "i")
        self.files = [path.with_name(path.name + ".tmp").open("wb") for path in self.paths]
        self.starts, self.covered, self.size = [0], 0, 0  # size: the conversations' JSON bytes

    def add(self, ids: list[int], mask: list[bool], size: int) -> None:
        self.files[0].write(array(self.typecode, ids).tobytes())
        self.files[1].write(bytes(mask))
        self.starts.append(self.starts[-1] + len(ids))
        self.covered += sum(mask)
        self.size += size

    def finish(self) -> dict[str, int]:
        self.files[2].write(array("q", self.starts).tobytes())
        for handle in self.files:
            handle.close()
        for path in self.paths:
            os.replace(path.with_name(path.name + ".tmp"), path)
        count = len(self.starts) - 1
        return {
            "documents": count,
            "tokens": self.starts[-1],
            "loss_tokens": self.covered,
            "bytes": self.size,
        }

    def close(self) -> None:
        """Close the files and remove what was not renamed (an interrupted split)."""
        for handle in self.files:
            handle.close()
        for path in self.paths:
            path.with_name(path.name + ".tmp").unlink(missing_ok=True)


def is_chat(folder: str | Path | None) -> bool:
    """Whether `--data-dir` is a folder `prepare --format chat` made."""
    if folder is None:
        return False
    try:
        manifest = json.loads((Path(folder) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("chat") is True


class Split(NamedTuple):
    """One split of a chat folder: tokens, their loss mask, the conversations' starts."""

    tokens: torch.Tensor
    mask: torch.Tensor
    starts: torch.Tensor


def load_chat(folder: Path, tokenizer: Tokenizer | None) -> tuple[Split, Split, Tokenizer, str]:
    """(train, val, tokenizer with its chat template, fingerprint) of a chat folder."""
    train, val, own, fingerprint = load_prepared(folder, tokenizer)
    config = folder / "tokenizer_config.json"
    if config.is_file():
        attach_chat_config(own, read_chat_config(folder))
    splits = []
    for name, tokens in (("train", train), ("val", val)):
        try:
            mask = load_tokens(folder / f"{name}{MASK}")
            path = folder / f"{name}{STARTS}"
            count = path.stat().st_size // 8
            starts = torch.from_file(str(path), shared=False, size=count, dtype=torch.int64)
        except (OSError, DataError) as error:
            raise DataError(f"{folder} is not whole ({error}); prepare it again") from None
        if len(mask) != len(tokens) or count < 2 or int(starts[-1]) != len(tokens):
            raise DataError(f"{folder}'s {name} files disagree; prepare it again")
        splits.append(Split(tokens, mask, starts))
    return splits[0], splits[1], own, fingerprint


class ChatWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """One conversation per item: (inputs, targets) of `seq_len` tokens, its first
    `seq_len` + 1 tokens padded after its end; targets the loss does not cover (and the
    padding) are IGNORE_INDEX. `conversations`: the indices of the split's kept ones.

    With `per_epoch` (training), an epoch is that many items, the conversations taken in
    turn: index `epoch * per_epoch + i` (data.ResumableSampler adds the offset) is
    conversation `index % len(conversations)`, so each epoch goes on where the last ended."""

    def __init__(self, split: Split, seq_len: int, conversations: torch.Tensor, per_epoch: int = 0):
        self.split, self.seq_len, self.conversations = split, seq_len, conversations
        self.per_epoch, self.drawn_per_epoch = per_epoch, per_epoch > 0

    def __len__(self) -> int:
        return self.per_epoch or len(self.conversations)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.per_epoch:
            index %= len(self.conversations)
        number = int(self.conversations[index])
        start = int(self.split.starts[number])
        stop = min(int(self.split.starts[number + 1]), start + self.seq_len + 1)
        window = torch.zeros(self.seq_len + 1, dtype=torch.long)
        covered = torch.zeros(self.seq_len + 1, dtype=torch.bool)
        window[: stop - start] = self.split.tokens[start:stop].long()
        covered[: stop - start] = self.split.mask[start:stop].bool()
        targets = window[1:].masked_fill(~covered[1:], IGNORE_INDEX)
        return window[:-1], targets

    def bytes_per_target(self, tokenizer: Tokenizer, sample: int = 1024) -> float:
        """The bytes a covered target stands for, on average over up to `sample` evenly
        spaced items (all of a validation set's): what bits per byte divides by."""
        table = tokenizer.token_bytes()
        picked = torch.linspace(0, len(self) - 1, min(sample, len(self))).long().tolist()
        targets = torch.cat([self[i][1] for i in picked]) if picked else torch.zeros(0)
        covered = targets[targets != IGNORE_INDEX].long()
        return max(float(table[covered].double().mean()), 1e-9) if len(covered) else 1.0


def kept_conversations(split: Split, seq_len: int) -> torch.Tensor:
    """The conversations with a covered target inside their window (its tokens 1 to
    seq_len: the targets)."""
    covered = split.mask.bool().cumsum(0)  # covered tokens up to each position
    first, ends = split.starts[:-1], split.starts[1:]
    last = torch.minimum(ends, first + seq_len + 1) - 1  # the window's last token
    inside = covered[last.clamp(min=0)] - covered[first.clamp(max=len(covered) - 1)]
    return torch.nonzero((inside > 0) & (ends > first)).flatten()


def chat_windows(config: Config, train: Split, val: Split) -> tuple[ChatWindows, ChatWindows]:
    """(train, validation) windows: `--train-samples` of the kept training conversations an
    epoch, in turn, and up to `--val-samples` evenly spaced kept validation ones."""
    seq_len = config.model.seq_len
    kept = {"train": kept_conversations(train, seq_len), "val": kept_conversations(val, seq_len)}
    for name, label in (("train", "training"), ("val", "validation")):
        if len(kept[name]) == 0:
            raise DataError(
                f"no {label} conversation has an assistant's token within its first "
                f"--seq-len {seq_len} + 1 tokens; use a longer --seq-len"
            )
    count = min(config.data.val_samples, len(kept["val"]))
    picked = kept["val"][torch.linspace(0, len(kept["val"]) - 1, count).long()]
    count = config.data.train_samples
    return ChatWindows(train, seq_len, kept["train"], count), ChatWindows(val, seq_len, picked)
