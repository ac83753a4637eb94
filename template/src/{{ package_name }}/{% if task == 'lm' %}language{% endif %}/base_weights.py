"""`--init-from`'s base weights, and the base beneath a LoRA checkpoint's adapters.

`--init-from` takes a GPT-2-format folder (language/gpt2_format.py) or a checkpoint file of
this project (`best.pt`, `last.pt`, a `step-N.pt`): the checkpoint's architecture (the model
group's settings but --dropout: --model, --width, --depth, ...) becomes this run's, and so
does its tokenizer (written to the run dir as base-tokenizer.json; bytes where it kept none);
its weights (the EMA's average where it kept one, as evaluate reads it) are loaded into the
model built from them; the optimizer, schedule and data are this run's. Data prepared with
another tokenizer is refused in one line.

A LoRA run's checkpoints hold adapters only (training/lora.py). `with_base` rebuilds what they
adapt for evaluate, generate and export: the base from the --init-from the checkpoint was
trained with, checked against the fingerprint it recorded, then the adapters beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from torch import nn

from ..checkpointing.checkpoint import CheckpointError, read_model, with_old_defaults
from ..config import Config
from ..runtime import files
from ..training import lora
from . import gpt2_format

# Of the model group's settings, those that are the run's own, not the architecture's.
NOT_ARCHITECTURE = ("dropout",)


def _source(config: Config) -> Path | None:
    source = getattr(config.run, "init_from", None)  # a RunConfig of yours may lack it
    return None if source is None else Path(source)


def adopt(config: Config, log: Callable[[str], None]) -> Config:
    """`config` with its --init-from's architecture (a folder's: gpt2_format.adopt); logs
    what it changed."""
    path = _source(config)
    if path is None or not path.is_file():
        return gpt2_format.adopt(config, log)
    flat = config.flat()
    state = read_model(path)
    saved = with_old_defaults(state["config"], flat)
    names = [f.name for f in fields(config.model) if f.name not in NOT_ARCHITECTURE]
    taken: dict[str, Any] = {k: saved[k] for k in names if k in saved}
    taken["tokenizer"] = "bytes"  # what a checkpoint without a tokenizer's JSON read text with
    text = state.get("tokenizer")
    if isinstance(text, str):  # its tokenizer.json, in the run dir for --tokenizer
        taken["tokenizer"] = str(Path(config.run.run_dir) / "base-tokenizer.json")
        files.write_atomically(Path(taken["tokenizer"]), text, "--run-dir")
    changed = [f"--{k.replace('_', '-')} {v}" for k, v in taken.items() if flat.get(k) != v]
    if changed:
        log(f"--init-from {path}: its architecture and tokenizer: {', '.join(changed)}")
    return config.replace(**taken)


def init_from(
    model: nn.Module, config: Config, log: Callable[[str], None], tokenizer: str | None = None
) -> None:
    """Load --init-from's weights into `model` (in place). `tokenizer`: the fingerprint of the
    tokenizer this run reads text with, which a checkpoint's must equal (None: not checked)."""
    path = _source(config)
    if path is None:
        return
    if not path.is_file():
        gpt2_format.init_from(model, config, log)
        return
    state = read_model(path)
    if lora.settings_of(state["config"])[0]:
        raise CheckpointError(
            f"--init-from {path}: a LoRA run's checkpoint holds adapters, not a whole model; "
            "start from its base (its own --init-from) instead"
        )
    record = state.get("run")
    theirs = record.get("tokenizer", "bytes") if isinstance(record, dict) else "bytes"
    if tokenizer is not None and theirs != tokenizer:
        raise CheckpointError(
            f"--init-from {path} reads text with another tokenizer ({theirs}) than this run "
            f"({tokenizer}); give --tokenizer or prepared data with the checkpoint's"
        )
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, KeyError) as error:
        first = str(error).strip().splitlines()[0]
        raise CheckpointError(f"--init-from {path}: the model does not fit ({first})") from None
    count = sum(t.numel() for t in model.parameters())
    log(f"--init-from {path}: loaded {len(state['model'])} tensors ({count:,} parameters)")


def with_base(
    model: nn.Module, config: Config, state: dict[str, Any], path: Path
) -> dict[str, Any]:
    """Checkpoint `state` (read from `path`) as a whole model's for `model` (built from its
    config): a LoRA checkpoint's adapters beside its base, loaded into `model` from --init-from
    and checked against the recorded fingerprint, `model` given adapters to load them into
    (`lora.merge` folds them in). Any other checkpoint's `state` as it is."""
    if not lora.settings(config)[0]:
        return state
    try:
        init_from(model, config, _quiet)
    except (CheckpointError, ValueError) as error:
        raise CheckpointError(f"checkpoint {path} adapts a base it cannot load: {error}") from None
    lora.attach(model, config, fresh=False)
    return lora.completed(model, state, path)


def _quiet(message: str) -> None:
    """No log line while a checkpoint's base is loaded."""
