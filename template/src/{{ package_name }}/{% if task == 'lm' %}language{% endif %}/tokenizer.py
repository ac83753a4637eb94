"""Tokenizers for the language model: a BPE from Hugging Face `tokenizers`, or bytes.

`--tokenizer bpe` (the default): a byte-level BPE (GPT-2's kind: any text encodes, and comes
back exactly) of `--vocab-size` tokens, trained on the corpus before its held-out tail, with
`<|endoftext|>` between documents (files); 0.33 bits per byte below bytes in the same CPU
time on the default run (docs/language-model.md). `--tokenizer PATH`: a `tokenizer.json`, or
a folder holding one, such as a hub model's. `--tokenizer bytes`: token i is byte i,
vocabulary 256.

Every checkpoint keeps its tokenizer (`to_json`): generate, evaluate and compress read text
with the checkpoint's own. A Hugging Face folder's tokenizer keeps the folder's own
end-of-text tokens too (`eos_ids`, `read_eos_ids`: Llama's `</s>`, Qwen2's `<|im_end|>`...),
where generation stops; checkpoints keep them as `eos_ids` beside the tokenizer.

Bits per byte stays the one quality figure across tokenizers: a token stands for a definite
string of UTF-8 bytes (`pieces`; none for `<|endoftext|>`), and a text's bits are divided by
its bytes, not by its tokens. For a byte-level tokenizer the pieces are exact
(decode(encode(text)) == text); another tokenizer.json (a SentencePiece kind) decodes token
by token, which can drop the spaces its decoder adds between words.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import torch

from ..training.data_sources import DataError

EOT = "<|endoftext|>"  # GPT-2's document separator, and the one a trained BPE gets
MIN_VOCAB = 257  # the 256 bytes a byte-level BPE starts from, and <|endoftext|>


class Tokenizer:
    """Bytes: token i is byte i. The base of every tokenizer the project reads."""

    kind = "bytes"
    vocab_size = 256
    eot: int | None = None  # the end-of-text token between documents; bytes have none
    # A model folder's own end-of-text tokens (`read_eos_ids`: Llama's </s>, Qwen2's
    # <|im_end|>...): generation stops at them too. () for the project's own tokenizers.
    eos_ids: tuple[int, ...] = ()
    # The chat template and its special-token strings, where the tokenizer came with one
    # (language/chat.py; None: the default template).
    chat_config: dict[str, Any] | None = None

    def encode(self, data: bytes) -> list[int]:
        """The tokens of UTF-8 `data`."""
        return list(data)

    def decode(self, ids: Iterable[int]) -> bytes:
        """The bytes the tokens stand for (end-of-text: none)."""
        return bytes(ids)

    def piece(self, token: int) -> bytes:
        """The bytes one token stands for."""
        return bytes([token])

    def end_ids(self) -> set[int]:
        """The tokens that end a text (`generate` stops at them): the end-of-text token and a
        model folder's own eos tokens."""
        return {*self.eos_ids, *(() if self.eot is None else (self.eot,))}

    def token_bytes(self) -> torch.Tensor:
        """(vocab,) int64: how many bytes each token stands for (bits per byte divides by
        their sum over the predicted tokens)."""
        return torch.tensor([len(self.piece(i)) for i in range(self.vocab_size)])

    def to_json(self) -> str | None:
        """What a checkpoint keeps to rebuild it (`from_record`); None for bytes."""
        return None

    def fingerprint(self) -> str:
        """A short name of exactly this tokenizer: token files and checkpoints record it."""
        return "bytes"


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` from its JSON (a tokenizer.json file's text)."""

    kind = "hf"

    def __init__(self, text: str):
        library = _library()
        try:
            self.inner = library.Tokenizer.from_str(text)
        except Exception as error:  # the library's own exception type is not exported
            raise DataError(f"not a tokenizer.json ({str(error).splitlines()[0]})") from None
        # A literal "<|endoftext|>" inside a document is text, not the separator.
        self.inner.encode_special_tokens = True
        self.json = text
        self.vocab_size = self.inner.get_vocab_size(with_added_tokens=True)
        self.eot = self.inner.token_to_id(EOT)
        special = {i for i, t in self.inner.get_added_tokens_decoder().items() if t.special}
        byte_level = _is_byte_level(json.loads(text))
        self.pieces = [self._piece(i, special, byte_level) for i in range(self.vocab_size)]

    def _piece(self, token: int, special: set[int], byte_level: bool) -> bytes:
        name = self.inner.id_to_token(token)
        if name is None or token in special:
            return b""
        if byte_level and all(char in BYTE_OF for char in name):
            return bytes(BYTE_OF[char] for char in name)
        return self.inner.decode([token], skip_special_tokens=True).encode("utf-8")

    def encode(self, data: bytes) -> list[int]:
        text = data.decode("utf-8", errors="replace")  # a prompt need not be UTF-8
        return list(self.inner.encode(text, add_special_tokens=False).ids)

    def encode_documents(self, documents: list[bytes]) -> list[list[int]]:
        """Each document's tokens (in parallel: the library's threads)."""
        texts = [document.decode("utf-8") for document in documents]
        return [e.ids for e in self.inner.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.pieces[i] for i in ids)

    def piece(self, token: int) -> bytes:
        return self.pieces[token]

    def to_json(self) -> str | None:
        return self.json

    def fingerprint(self) -> str:
        return "hf-" + hashlib.sha256(self.json.encode()).hexdigest()[:16]


def train_bpe(texts: Iterator[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE of `vocab_size` tokens (the 256 bytes, `<|endoftext|>`, merges)
    learned from `texts`; the same texts give the same tokenizer."""
    if vocab_size < MIN_VOCAB:
        raise DataError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least {MIN_VOCAB}")
    library = _library()
    inner = library.Tokenizer(library.models.BPE())
    inner.pre_tokenizer = library.pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = library.decoders.ByteLevel()
    trainer = library.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=library.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    inner.train_from_iterator(texts, trainer)
    return HFTokenizer(inner.to_str())


# A Hugging Face folder's special-token strings a chat template may name (chat.py renders it).
CONFIG_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


def read_chat_config(folder: Path) -> dict[str, Any]:
    """The chat template and the special-token strings of a Hugging Face tokenizer folder
    (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`; a list of named
    templates: the one named "default"), {} where it has none."""
    path = folder / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as error:
        raise DataError(f"cannot read {path} ({error})") from None
    if not isinstance(config, dict):
        raise DataError(f"{path} is not a JSON object")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if not isinstance(template, str) or not template:
        return {}
    tokens = {}
    for name in CONFIG_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[name] = value
    return {"template": template, "tokens": tokens}


def attach_chat_config(tokenizer: Tokenizer, config: object) -> Tokenizer:
    """Give `tokenizer` the chat template of `config` (`read_chat_config`'s, or a
    checkpoint's record of it; None or {}: the default template)."""
    if isinstance(config, dict) and isinstance(config.get("template"), str):
        tokens = config.get("tokens") or {}
        tokenizer.chat_config = {
            "template": config["template"],
            "tokens": {str(k): str(v) for k, v in dict(tokens).items()},
        }
    return tokenizer


def tokenizer_at(spec: str) -> Tokenizer:
    """`--tokenizer` other than bpe: bytes, or a tokenizer.json file or a folder holding one."""
    if spec == "bytes":
        return Tokenizer()
    path = Path(spec) / "tokenizer.json" if Path(spec).is_dir() else Path(spec)
    try:
        tokenizer = HFTokenizer(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"--tokenizer {spec}: cannot read {path} ({error})") from None
    except DataError as error:
        raise DataError(f"--tokenizer {spec}: {path} is {error}") from None
    tokenizer.eos_ids = read_eos_ids(path.parent, tokenizer)
    return attach_chat_config(tokenizer, read_chat_config(path.parent))


def read_eos_ids(folder: Path, tokenizer: Tokenizer) -> tuple[int, ...]:
    """A Hugging Face folder's own end-of-text tokens: `eos_token_id` (an id or a list) of its
    config.json and generation_config.json, and tokenizer_config.json's `eos_token` (its id),
    those inside the tokenizer's vocabulary; () where it names none."""
    found: list[object] = []
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        path = folder / name
        try:
            spec = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (OSError, ValueError) as error:
            raise DataError(f"cannot read {path} ({error})") from None
        if not isinstance(spec, dict):
            continue
        ids = spec.get("eos_token_id")
        found += ids if isinstance(ids, list) else [ids]
        token = spec.get("eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and isinstance(tokenizer, HFTokenizer):
            found.append(tokenizer.inner.token_to_id(token))
    return eos_record(found, tokenizer.vocab_size)


def eos_record(ids: object, vocab_size: int) -> tuple[int, ...]:
    """The eos ids of a list (a folder's, a checkpoint's `eos_ids`), those that are token
    ids of a `vocab_size` vocabulary, sorted; () for anything else (an old checkpoint's None)."""
    if not isinstance(ids, list):
        return ()
    kept = {i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0}
    return tuple(sorted(i for i in kept if i < vocab_size))


def byte_tokenizer_json() -> str:
    """A tokenizer.json that reads text as `Tokenizer` (bytes) does: a byte-level BPE of the
    256 bytes in byte order and no merges, so token i is byte i in any library."""
    library = _library()
    inner = library.Tokenizer(library.models.BPE(vocab=dict(BYTE_OF), merges=[]))
    inner.pre_tokenizer = library.pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = library.decoders.ByteLevel()
    return str(inner.to_str())


def from_record(text: object) -> Tokenizer:
    """The tokenizer a checkpoint recorded (its JSON; bytes when it has none)."""
    if text is None:
        return Tokenizer()
    if not isinstance(text, str):
        raise DataError("the recorded tokenizer is not a tokenizer.json text")
    return HFTokenizer(text)


def _is_byte_level(spec: dict[str, Any]) -> bool:
    """Whether the tokenizer's decoder maps characters back to bytes as GPT-2's does."""
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if isinstance(decoder, dict) else []
    return any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in parts)


def _byte_of() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character standing for each
    byte (printable bytes stand for themselves, the rest for characters from U+0100 on)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = list(kept), 0
    for byte in range(256):
        if byte not in kept:
            kept.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(kept, chars, strict=True)}


BYTE_OF = _byte_of()


@cache
def _library() -> Any:
    """Hugging Face `tokenizers`, or one line saying how to install it."""
    try:
        import tokenizers
    except ImportError:
        raise DataError(
            "--tokenizer other than bytes needs Hugging Face tokenizers (a dependency of "
            "this project): pip install tokenizers"
        ) from None
    return tokenizers
