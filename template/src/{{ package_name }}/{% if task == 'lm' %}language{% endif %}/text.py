"""Text for the language model: tokens in a memory-mapped file (the task that reads them,
`LanguageModelTask`, is in language/lm_task.py).

By default a byte-level BPE trained on the corpus tokenizes the text (`--tokenizer bpe`,
language/tokenizer.py), each file a document followed by `<|endoftext|>`; `--tokenizer bytes` takes
its bytes as the tokens (vocabulary 256), and a tokenizer.json may be given. `--data-dir`
names a text file or a folder (every file below it, in sorted order); without it the corpus
is this Python's own standard library, the `.py` files at the top of its folder in sorted
order: real text that exists on every machine. The
tokens are written once to a token file in `utils.cache_dir()/tokens/`, named by a hash of the
files' names, sizes and modification times (and of the tokenizer), and read back with
`torch.from_file` (memory-mapped: a corpus larger than memory is fine). The last
`--val-fraction` of the tokens is held out for validation; a `--tokenizer bpe` is trained on
the first 1 - `--val-fraction` of the bytes, the text before that tail.

An epoch trains on `--train-samples` windows of `--seq-len` + 1 tokens, drawn afresh every
epoch: the training stream is cut into `--train-samples` equal strata and each window starts
at a random offset inside its own stratum, from a generator seeded by `(--seed, epoch)`. So
every epoch reads from the whole corpus, each byte is read `train_samples * seq_len /
train bytes` times in expectation (about once with the default), no two epochs see the same
windows, and the same seed and epoch give the same windows, in a resumed run too. The
sampler (`data.ResumableSampler`) shuffles their order and hands the dataset `epoch *
len(dataset) + i`, so workers need no state. Validation uses up to `--val-samples` evenly
spaced windows of the held-out tail, the same every epoch. A window gives inputs `w[:-1]`
and next-token targets `w[1:]`.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset

from .. import utils
from ..checkpointing.checkpoint import CheckpointError
from ..config import Config
from ..training.data_sources import DataError, DataInfo
from .corpus import corpus_files, corpus_fingerprint, documents
from .corpus import default_corpus as default_corpus  # where it was before language/corpus.py
from .corpus import load_tokens as load_tokens
from .corpus import read_text_bytes as read_text_bytes
from .prepared import is_prepared, load_prepared, suffix_of
from .tokenizer import (
    HFTokenizer,
    Tokenizer,
    attach_chat_config,
    eos_record,
    from_record,
    tokenizer_at,
    train_bpe,
)

VOCAB_SIZE = 256  # one token per byte value


def token_file(
    files: list[Path],
    cache: Path | None = None,
    tokenizer: Tokenizer | None = None,
    field: str = "text",
) -> Path:
    """Write the corpus's tokens to a token file once (atomically) and return its path: its
    bytes (.u8) by default, else `tokenizer`'s ids, uint16 where the vocabulary fits (.u16),
    int32 otherwise (.i32), each document (a file, or a .jsonl line's `field`) followed by
    the end-of-text token where there is one."""
    folder = (cache or utils.cache_dir()) / "tokens"
    tokenizer = tokenizer or Tokenizer()
    name = corpus_fingerprint(files)
    if any(path.suffix == ".jsonl" for path in files):
        name += "-" + hashlib.sha256(field.encode()).hexdigest()[:8]  # which field was read
    if tokenizer.kind != "bytes":
        name += "-" + tokenizer.fingerprint()
    target = folder / f"{name}{suffix_of(tokenizer)}"
    if target.is_file():
        return target
    if not any(path.stat().st_size for path in files):  # not one end-of-text token either
        raise DataError("the corpus is empty; point --data-dir at text files")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    except OSError as error:  # a data problem, not a checkpoint that could not be saved
        raise DataError(
            f"cannot write the token cache in {folder} ({error.strerror or error}); make it "
            "writable or set XDG_CACHE_HOME to a writable folder"
        ) from None
    try:
        with os.fdopen(handle, "wb") as out:
            if isinstance(tokenizer, HFTokenizer):
                _write_tokens(out, files, tokenizer, field)
            else:
                for path in files:
                    for document in documents(path, field):
                        out.write(document)
        os.replace(tmp, target)  # another process building the same file: either one wins
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def _write_tokens(
    out: Any, files: list[Path], tokenizer: HFTokenizer, field: str, batch: int = 64
) -> None:
    """Encode the documents, `batch` at a time (the library's threads share them), and
    write their ids, each document's followed by the end-of-text token."""
    dtype = torch.uint16 if tokenizer.vocab_size <= 65536 else torch.int32
    stream = (document for path in files for document in documents(path, field))
    while chunk := list(itertools.islice(stream, batch)):
        for ids in tokenizer.encode_documents(chunk):
            ids = ids + ([tokenizer.eot] if tokenizer.eot is not None else [])
            out.write(torch.tensor(ids, dtype=torch.int64).to(dtype).numpy().tobytes())


def corpus_tokenizer(config: Config, files: list[Path], cache: Path | None = None) -> Tokenizer:
    """`--tokenizer`: bytes, a BPE trained on (and cached beside) the corpus's training
    part, or a tokenizer.json file or a folder holding one."""
    spec = getattr(config.data, "tokenizer", "bytes")  # a DataConfig of yours may lack it
    if spec != "bpe":
        return tokenizer_at(spec)
    vocab = getattr(config.data, "vocab_size", 1024)
    field = getattr(config.data, "text_field", "text")  # a DataConfig of yours may lack it
    key = f"{corpus_fingerprint(files)}-bpe{vocab}-val{config.data.val_fraction}-{field}"
    saved = (cache or utils.cache_dir()) / "tokens" / f"{key}.tokenizer.json"
    if saved.is_file():
        return HFTokenizer(saved.read_text(encoding="utf-8"))
    total = sum(path.stat().st_size for path in files)
    if total == 0:
        raise DataError("the corpus is empty; point --data-dir at text files")
    field = getattr(config.data, "text_field", "text")
    texts = _training_texts(files, total * (1 - config.data.val_fraction), field)
    tokenizer = train_bpe(texts, vocab)
    tmp = None
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=saved.parent, suffix=".tmp")
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(tokenizer.to_json() or "")
        os.replace(tmp, saved)  # beside the token files, whole or not at all
    except OSError as error:
        raise DataError(
            f"cannot write the token cache in {saved.parent} ({error.strerror or error}); make "
            "it writable or set XDG_CACHE_HOME to a writable folder"
        ) from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return tokenizer


def _training_texts(files: list[Path], limit: float, field: str) -> Iterator[str]:
    """The corpus's documents up to its first `limit` bytes (the last cut at a character)."""
    left = int(limit)
    for path in files:
        for document in documents(path, field):
            if left <= 0:
                return
            data = document[:left]
            left -= len(data)
            yield data.decode("utf-8", errors="ignore")


def window_pair(
    tokens: torch.Tensor, start: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the window at `start`: `seq_len` tokens and the same shifted by
    one (each position predicts the next byte)."""
    window = tokens[start : start + seq_len + 1].long()
    return window[:-1], window[1:]


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """`(inputs, targets)` of `seq_len` tokens each, from windows starting at `starts`."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, starts: torch.Tensor):
        self.tokens, self.seq_len, self.starts = tokens, seq_len, starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return window_pair(self.tokens, int(self.starts[index]), self.seq_len)


class EpochWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """`count` training windows per epoch at offsets drawn afresh for every epoch.

    Index `epoch * count + i` is window `i` of `epoch` (`data.ResumableSampler` adds the
    offset; a plain index is epoch 0). Window `i` starts uniformly inside the `i`-th of
    `count` equal strata of the stream, from a generator seeded by `(seed, epoch)`.
    """

    drawn_per_epoch = True  # tells ResumableSampler to put the epoch into the index

    def __init__(self, tokens: torch.Tensor, seq_len: int, count: int, seed: int):
        self.tokens, self.seq_len, self.count, self.seed = tokens, seq_len, count, seed
        self._epoch, self._starts = -1, torch.empty(0, dtype=torch.long)

    def __len__(self) -> int:
        return self.count

    def starts(self, epoch: int) -> torch.Tensor:
        """The window offsets of `epoch`: one per stratum, the same for the same seed."""
        if epoch != self._epoch:  # drawn once per epoch (in each worker: no shared state)
            positions = len(self.tokens) - self.seq_len  # possible offsets of a window
            # The CPU generator keeps 32 bits of its seed: mix (seed, epoch) into them.
            mixed = hashlib.sha256(f"windows {self.seed} {epoch}".encode()).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(mixed[:4], "little"))
            edges = torch.arange(self.count + 1) * positions // self.count  # the strata
            widths = (edges[1:] - edges[:-1]).clamp_(min=1)  # more windows than offsets: 1
            jitter = torch.rand(self.count, generator=generator, dtype=torch.float64)
            starts = (edges[:-1] + (jitter * widths).long()).clamp_(max=positions - 1)
            self._epoch, self._starts = epoch, starts
        return self._starts

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, i = divmod(index, self.count)
        return window_pair(self.tokens, int(self.starts(epoch)[i]), self.seq_len)


def split_tokens(tokens: torch.Tensor, config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) token streams: the validation stream is the last val_fraction."""
    num_val = round(len(tokens) * config.data.val_fraction)
    train, val = tokens[: len(tokens) - num_val], tokens[len(tokens) - num_val :]
    check_windows(train, val, config)
    return train, val


def check_windows(train: torch.Tensor, val: torch.Tensor, config: Config) -> None:
    """One line where a stream is shorter than one window."""
    for name, part in (("training", train), ("validation", val)):
        if len(part) < config.model.seq_len + 1:
            raise DataError(
                f"the corpus has {len(train) + len(val)} tokens: its {name} part ({len(part)}) "
                f"is smaller than one window of --seq-len {config.model.seq_len} + 1; "
                "use more text or a smaller --seq-len"
            )


class Streams(NamedTuple):
    """The corpus as token streams, the tokenizer that made them, and their fingerprint."""

    train: torch.Tensor
    val: torch.Tensor
    tokenizer: Tokenizer
    fingerprint: str


def corpus_streams(config: Config, tokenizer: Tokenizer | None = None) -> Streams:
    """--data-dir's training and validation tokens: a folder `prepare` made (its own
    tokenizer, validation held out by documents), or text files read in --tokenizer's
    tokens (default; a checkpoint's `tokenizer`) with the last --val-fraction held out."""
    if is_prepared(config.data.data_dir):
        spec = getattr(config.data, "tokenizer", "bpe")  # bpe: the folder's own, trained BPE
        if tokenizer is None and spec != "bpe":
            tokenizer = tokenizer_at(spec)  # then it must be the folder's
        train, val, own, fingerprint = load_prepared(Path(str(config.data.data_dir)), tokenizer)
        check_windows(train, val, config)
        return Streams(train, val, own, fingerprint)
    files = corpus_files(config.data.data_dir)
    tokenizer = tokenizer or corpus_tokenizer(config, files)
    field = getattr(config.data, "text_field", "text")
    tokens = load_tokens(token_file(files, tokenizer=tokenizer, field=field))
    return Streams(*split_tokens(tokens, config), tokenizer, corpus_fingerprint(files))


def build_datasets(
    config: Config, files: list[Path] | None = None, tokenizer: Tokenizer | None = None
) -> tuple[Dataset[Any], Dataset[Any], DataInfo]:
    """(train, validation, info) for the language model from `files` (default: the corpus
    of --data-dir) in `tokenizer`'s tokens (default: --tokenizer's); info.vocab_size is the
    vocabulary and info.seq_len the window length."""
    if files is None:
        train, val, tokenizer, _ = corpus_streams(config, tokenizer)
    else:
        tokenizer = tokenizer or corpus_tokenizer(config, files)
        field = getattr(config.data, "text_field", "text")
        tokens = load_tokens(token_file(files, tokenizer=tokenizer, field=field))
        train, val = split_tokens(tokens, config)
    return windows(config, train, val, tokenizer)


def windows(
    config: Config, train: torch.Tensor, val: torch.Tensor, tokenizer: Tokenizer
) -> tuple[Dataset[Any], Dataset[Any], DataInfo]:
    """(train, validation, info) over two token streams: `--train-samples` windows drawn
    afresh each epoch, and up to `--val-samples` evenly spaced validation windows."""
    span = config.model.seq_len + 1
    count = min(config.data.val_samples, len(val) // span)
    val_starts = torch.linspace(0, len(val) - span, max(count, 1)).long()
    info = DataInfo(seq_len=config.model.seq_len, vocab_size=tokenizer.vocab_size)
    return (
        EpochWindows(train, config.model.seq_len, config.data.train_samples, config.run.seed),
        Windows(val, config.model.seq_len, val_starts),
        info,
    )


def bytes_per_token(dataset: Dataset[Any], tokenizer: Tokenizer, sample: int = 1 << 20) -> float:
    """The bytes the targets of a `Windows` dataset stand for, per target: exact for its
    windows; for `EpochWindows` (drawn afresh) over up to `sample` evenly spaced tokens of
    its stream. 1 for bytes, or for a dataset of yours."""
    tokens = getattr(dataset, "tokens", None)
    if tokenizer.kind == "bytes" or not isinstance(tokens, torch.Tensor):
        return 1.0
    table = tokenizer.token_bytes()
    if isinstance(dataset, Windows):
        targets = dataset.starts[:, None] + 1 + torch.arange(dataset.seq_len)
        picked = tokens[targets.flatten()].long()
    else:
        picked = tokens[torch.linspace(0, len(tokens) - 1, min(sample, len(tokens))).long()]
    return max(float(table[picked.long()].double().mean()), 1e-9)


def step_budget(config: Config, world_size: int) -> int | None:
    """The run's optimizer steps in all under a budget: `--max-steps N`, or `--max-tokens T`
    as N = T / (global batch x seq_len) rounded up; None without either (--epochs counts).
    The budget counts steps only: --train-samples stays the windows of an epoch (where the
    windows are drawn afresh), --eval-every the steps between validations."""
    optim = config.optim
    steps: int | None = getattr(optim, "max_steps", None)  # an OptimConfig of yours may lack it
    tokens = getattr(optim, "max_tokens", None)
    if steps is not None or tokens is None:
        return steps
    batch = optim.batch_size * optim.grad_accum_steps * world_size  # windows per step
    return max(1, math.ceil(tokens / (batch * config.model.seq_len)))


def bigram_bits_per_byte(train: torch.Tensor, val: torch.Tensor) -> float:
    """Bits per byte on `val` of a bigram model fitted on `train` (add-one smoothing): the
    baseline a language model that uses more than the previous byte must beat."""
    pairs = train[:-1].long() * VOCAB_SIZE + train[1:].long()
    counts = torch.bincount(pairs, minlength=VOCAB_SIZE**2).view(VOCAB_SIZE, VOCAB_SIZE)
    log_probs = (counts.double() + 1).log() - (
        counts.sum(1, keepdim=True).double() + VOCAB_SIZE
    ).log()
    nats = -log_probs[val[:-1].long(), val[1:].long()].mean()
    return float(nats) / math.log(2)


def tokenizer_of(state: dict[str, Any], path: Path) -> Tokenizer:
    """The tokenizer a checkpoint keeps (bytes where it keeps none)."""
    try:
        tokenizer = from_record(state.get("tokenizer"))
        tokenizer.eos_ids = eos_record(state.get("eos_ids"), tokenizer.vocab_size)  # or none
        return attach_chat_config(tokenizer, state.get("chat_template"))  # where it has one
    except DataError as error:
        raise CheckpointError(f"checkpoint {path}: its tokenizer: {error}") from None


def tokenizer_name(state: dict[str, Any]) -> str:
    """The --tokenizer a checkpoint was trained with (its config's), for messages."""
    config = state.get("config")
    name = config.get("tokenizer") if isinstance(config, dict) else None
    return str(name or ("bytes" if state.get("tokenizer") is None else "a tokenizer.json"))
