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
from pathlib import Path
from typing import Any

import torch

from ..checkpointing.checkpoint import CheckpointError
from ..settings.base import ConfigError
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
    """Write `out` (config.json, model.safetensors, tokenizer.json) whole or not at all: built
    in a temporary folder beside it, then renamed; an existing `out` is refused."""
    from safetensors.torch import save_file

    if out.exists():
        raise ConfigError(f"--out {out} exists; remove it or choose another folder")
    weights = {name: tensor.detach().float().contiguous() for name, tensor in weights.items()}
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
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
