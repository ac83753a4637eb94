"""What every Hugging Face folder format here shares: finding the folder (a path, or a hub id
already in the local Hugging Face cache: nothing is downloaded), reading its config.json and
safetensors weights (one file, or shards with an index), and writing one whole or not at all.
language/gpt2_format.py (GPT-2), language/hf_llama.py (Llama, Mistral, Qwen2) and
language/neox_format.py (GPT-NeoX, for the rotary GPT) build on it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..checkpointing.checkpoint import CheckpointError
from ..settings.base import ConfigError
from ..training.data_sources import DataError
from .chat import chat_template, end_of_turn_ids
from .tokenizer import Tokenizer, byte_tokenizer_json


def resolve(source: str) -> Path:
    """The folder `--init-from SOURCE` names: a folder, or a hub id (`owner/name`) whose
    snapshot is in the local Hugging Face cache (HF_HOME / HF_HUB_CACHE); never a download."""
    folder = Path(source)
    if folder.is_dir() or source.count("/") != 1 or source.startswith((".", "/")):
        return folder
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return folder  # no hub library: the folder's own error follows
    try:
        return Path(snapshot_download(source, local_files_only=True))
    except Exception as error:  # LocalEntryNotFoundError, an invalid repo id, an offline hub
        from huggingface_hub.constants import HF_HUB_CACHE

        raise ConfigError(
            f"--init-from {source}: no such folder, and not in the local Hugging Face cache "
            f"{HF_HUB_CACHE} ({type(error).__name__}); download it first "
            f"(huggingface-cli download {source}) or give its folder"
        ) from None


def read_json(folder: Path) -> dict[str, Any]:
    """The folder's config.json as a dict, or one line saying why not."""
    path = folder / "config.json"
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"--init-from {folder}: no readable config.json ({error}); give a Hugging Face "
            "model folder (config.json, model.safetensors, tokenizer.json)"
        ) from None
    if not isinstance(spec, dict):
        raise ConfigError(f"--init-from {folder}: config.json is not a JSON object")
    return spec


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `folder`'s model.safetensors, or of the shards its
    model.safetensors.index.json names."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(
                set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"--init-from {index} cannot be read ({error})") from None
        paths = [folder / name for name in names]
    else:
        paths = [folder / "model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for path in paths:
        if not path.is_file():
            raise CheckpointError(
                f"--init-from {folder}: no {path.name} (pytorch_model.bin is not read)"
            )
        try:
            weights.update(load_file(str(path)))
        except (OSError, SafetensorError) as error:
            raise CheckpointError(f"--init-from {path} cannot be read ({error})") from None
    return weights


def write_folder(
    out: Path, spec: dict[str, Any], weights: dict[str, torch.Tensor], tokenizer: Tokenizer
) -> None:
    """Write `out` (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
    generation_config.json) whole or not at all: built in a temporary folder beside it, then
    renamed; an existing `out` is refused. config.json's eos_token_id: the tokens that end a
    text (`Tokenizer.end_ids`)."""
    from safetensors.torch import save_file

    if out.exists():
        raise ConfigError(f"--out {out} exists; remove it or choose another folder")
    weights = {name: tensor.detach().float().contiguous() for name, tensor in weights.items()}
    spec = {**spec, "eos_token_id": eos_value(tokenizer.end_ids())}
    configs = token_configs(tokenizer)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    except OSError as error:
        raise ConfigError(f"--out {out}: cannot write there ({error.strerror or error})") from None
    try:
        (tmp / "config.json").write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        text = tokenizer.to_json() or byte_tokenizer_json()
        (tmp / "tokenizer.json").write_text(text, encoding="utf-8")
        for name, content in configs.items():
            (tmp / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def eos_value(ids: set[int]) -> int | list[int] | None:
    """eos_token_id as transformers reads it: one id, a list of them, or None."""
    ordered = sorted(ids)
    return (ordered[0] if len(ordered) == 1 else ordered) if ordered else None


def token_configs(tokenizer: Tokenizer) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json and generation_config.json of an exported folder: the chat
    template the checkpoint's conversations use (its own, else the default where the
    tokenizer can end a turn) with its special-token strings, so transformers'
    `apply_chat_template` gives `render_chat`'s ids; eos_token_id: the tokens that end a text
    and, with a template, a turn (where `generate --chat` stops)."""
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    ends = tokenizer.end_ids()
    try:
        template, tokens = chat_template(tokenizer)
    except DataError:  # no template of its own and no end-of-text token to end a turn
        template, tokens = None, {}
    if template is not None:
        if tokenizer.kind == "bytes":  # its end of turn (0x04) is text: no token to name
            eos = "{" * 2 + " eos_token " + "}" * 2  # the default template's place for it
            template = template.replace(eos, tokens.pop("eos_token", ""))
        config["chat_template"] = template
        ends |= set(end_of_turn_ids(tokenizer))
    inner = getattr(tokenizer, "inner", None)
    if "eos_token" not in tokens and tokenizer.end_ids() and inner is not None:
        tokens["eos_token"] = inner.id_to_token(min(tokenizer.end_ids()))
    config.update(tokens)
    return {
        "tokenizer_config.json": config,
        "generation_config.json": {"eos_token_id": eos_value(ends)},
    }


def load_weights(
    model: torch.nn.Module,
    state: dict[str, torch.Tensor],
    folder: Path | str,
    log: Callable[[str], None],
) -> None:
    """Load a folder's weights (named as `model`'s) into `model`, or one line saying why they
    do not fit; log how many were loaded."""
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        first = str(error).strip().splitlines()[1 if "\n" in str(error) else 0].strip()
        raise CheckpointError(f"--init-from {folder}: the model does not fit ({first})") from None
    count = sum(t.numel() for t in model.parameters())
    log(f"--init-from {folder}: loaded {len(state)} tensors ({count / 1e6:.1f} M parameters)")
