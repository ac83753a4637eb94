"""The language model's training task: next-token prediction on windows of a corpus's tokens
(or a chat folder's conversations), reported in bits per byte.

Its (B, T, V) logits are flattened to (B*T, V) for B*T next-token targets, so cross-entropy,
accuracy and the metrics count tokens: for this task a "sample" in metrics.jsonl is a token.
Chat data's targets outside the assistant's turns are skipped (`outputs`). `task_for`
(training/task.py) returns it; `Task` (training/task_base.py) is the interface it implements.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from .. import slots
from ..checkpointing.checkpoint import CheckpointError
from ..config import Config
from ..observability import mfu
from ..training.data_sources import DataInfo
from ..training.task_base import Task
from . import chat_data
from .chat import IGNORE_INDEX
from .prepared import is_prepared
from .text import bytes_per_token, corpus_streams, step_budget, tokenizer_name, windows
from .tokenizer import Tokenizer, tokenizer_at


class LanguageModelTask(Task):
    """Next-token prediction: (B, T) windows in, (B*T, vocab) logits and B*T targets out."""

    name = "lm"
    unit = "tokens"
    best_by = ("val_bpb", False)  # bits per byte: lower is better, and fair across tokenizers

    def __init__(self) -> None:
        super().__init__()
        self.corpus = ""  # corpus_fingerprint of the text, set by datasets()
        self.tokenizer = Tokenizer()
        self.bytes_per_token = {"train_": 1.0, "val_": 1.0}  # bits per byte = bits / these
        self.chat = False  # chat data (language/chat_data.py): targets the loss skips

    def datasets(self, config: Config) -> tuple[Dataset[Any], Dataset[Any], DataInfo]:
        """The first of data.py's `SOURCES` (yours) that takes `config`, else the corpus of
        --data-dir: windows of --tokenizer's tokens (a chat folder's: one conversation
        each)."""
        for source in slots.user_attr("data", "SOURCES", []):
            found = source(config)
            if found is not None:
                return found
        if chat_data.is_chat(config.data.data_dir):
            return self.chat_datasets(config)
        streams = corpus_streams(config)
        self.corpus, self.tokenizer = streams.fingerprint, streams.tokenizer
        train, val, info = windows(config, streams.train, streams.val, streams.tokenizer)
        self.bytes_per_token = {
            "train_": bytes_per_token(train, self.tokenizer),
            "val_": bytes_per_token(val, self.tokenizer),
        }
        return train, val, info

    def chat_datasets(self, config: Config) -> tuple[Dataset[Any], Dataset[Any], DataInfo]:
        """A `prepare --format chat` folder's conversations, one per window."""
        spec = getattr(config.data, "tokenizer", "bpe")  # bpe: the folder's own
        given = tokenizer_at(spec) if spec != "bpe" else None
        folder = Path(str(config.data.data_dir))
        train_split, val_split, self.tokenizer, self.corpus = chat_data.load_chat(folder, given)
        train, val = chat_data.chat_windows(config, train_split, val_split)
        self.chat = True
        self.bytes_per_token = {
            "train_": train.bytes_per_target(self.tokenizer),
            "val_": val.bytes_per_target(self.tokenizer, len(val)),
        }
        info = DataInfo(seq_len=config.model.seq_len, vocab_size=self.tokenizer.vocab_size)
        return train, val, info

    def budget(self, config: Config, world_size: int) -> int | None:
        """`--max-steps`, or `--max-tokens` as steps (`step_budget`)."""
        return step_budget(config, world_size)

    def record(self) -> dict[str, Any]:
        """The corpus's fingerprint and the tokenizer: every checkpoint says which text it
        was trained on, and reads text as it was read (tokenizer.from_record)."""
        record = {**super().record(), "corpus": self.corpus}
        if self.tokenizer.kind != "bytes":
            record["tokenizer"] = self.tokenizer.fingerprint()
        return record

    def checkpoint_extra(self) -> dict[str, Any]:
        """The tokenizer's JSON in every checkpoint (none for bytes), its chat template and a
        model folder's eos ids where it has them: generate, evaluate and compress read text
        with it (`tokenizer_of`)."""
        text, chat = self.tokenizer.to_json(), self.tokenizer.chat_config
        eos = list(self.tokenizer.eos_ids)
        return {
            **({} if text is None else {"tokenizer": text}),
            **({} if chat is None else {"chat_template": chat}),
            **({"eos_ids": eos} if eos else {}),
        }

    def check_resume(
        self, state: dict[str, Any], config: Config, path: Path, log: Callable[[str], None]
    ) -> None:
        """Refuse to continue a checkpoint on another corpus (other paths, sizes or
        modification times) unless --allow-corpus-change says it is intended."""
        record = state.get("run")
        record = record if isinstance(record, dict) else {}
        if record.get("tokenizer", "bytes") != self.tokenizer.fingerprint():
            folder = config.data.data_dir
            if folder is not None and is_prepared(folder):  # the folder's tokenizer, not a flag
                raise CheckpointError(
                    f"checkpoint {path} reads its text with another tokenizer than the one "
                    f"--data-dir {folder} was prepared with; resume on the text it was trained "
                    "on, or start a new --run-dir"
                )
            raise CheckpointError(
                f"checkpoint {path} reads its text with another tokenizer than this run's "
                f"--tokenizer; use the one it was trained with ({tokenizer_name(state)})"
            )
        saved = record.get("corpus")
        if not saved:
            log(f"{path} records no corpus (saved by an older version): not checked")
        elif saved != self.corpus:
            # getattr: a config.py from before the flag (config.py is the user's) still works.
            if not getattr(config.run, "allow_corpus_change", False):
                raise CheckpointError(
                    f"checkpoint {path} was trained on another corpus (fingerprint {saved}, "
                    f"this run's {self.corpus}: the files' paths, sizes or modification times "
                    "differ); use the same --data-dir, or pass --allow-corpus-change to "
                    "continue on this text"
                )
            log(f"--allow-corpus-change: {path} was trained on another corpus; continuing")

    def outputs(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits, targets = model(inputs).flatten(0, 1), targets.flatten()
        if self.chat:  # only the covered targets reach the loss and the metrics (a host sync)
            covered = targets != IGNORE_INDEX
            return logits[covered], targets[covered]
        return logits, targets

    def metrics(self, record: dict[str, Any], prefix: str = "") -> dict[str, float]:
        """Bits per byte (the loss in bits per token, over the bytes a token stands for:
        exact on the validation windows, from a sample of the training text) and tokens per
        second (a sample in the shared metrics is a token here)."""
        per_token = self.bytes_per_token.get(prefix, self.bytes_per_token["train_"])
        values = {f"{prefix}bpb": record["loss"] / math.log(2) / per_token}
        if "samples_per_s" in record:
            values[f"{prefix}tokens_per_s"] = record["samples_per_s"]
        return values

    def utilization(
        self, model: nn.Module, config: Config, info: DataInfo, device: torch.device, on: bool
    ) -> mfu.Utilization:
        """FLOPs per token from the model's own count (parameters and attention)."""
        count = getattr(model, "flops_per_token", None)
        flops = float(count()) if callable(count) else None
        return mfu.Utilization.per_sample(flops, device, config.speed.precision, enabled=on)
