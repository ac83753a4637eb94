"""GPT-2-format folders in and out: `--init-from FOLDER` and `export --format hf`.

(The entry points here also send other folders on: a Llama, Mistral or Qwen2 folder in, and a
`--model llama` checkpoint out, to language/hf_llama.py; the rotary GPT out as GPT-NeoX to
language/neox_format.py. `--init-from` takes a hub id already in the local Hugging Face cache
as well as a folder: language/hf_folders.py.)

A Hugging Face folder of the GPT-2 architecture (GPT-2 itself, distilgpt2 and their many
fine-tunes: `config.json` with `"model_type": "gpt2"`, `model.safetensors`, `tokenizer.json`)
is read with `safetensors` (the `hf` extra) and `tokenizers` only (no `transformers` at run
time). `--init-from FOLDER` takes its architecture into the run's settings (width, depth,
heads, `--seq-len` = its `n_positions`, learned positions, its GELU), its tokenizer
(`--tokenizer FOLDER`) and its weights; the optimizer and schedule are this run's. The
settings it takes are saved in every checkpoint, so generate, evaluate and resume need the
folder no more.

`export --format hf` writes such a folder from a checkpoint trained with `--position learned`
(GPT-2 has no rotary positions; a rotary one goes out as GPT-NeoX):
`transformers.AutoModelForCausalLM.from_pretrained(folder)` then gives the same logits, and
the tokenizer (a byte model's is a byte-level tokenizer.json of its 256 bytes) reads text as
training did.

The names below are model.py's GPT's (`token`, `position`, `blocks.N.norm1`, ...): a model of
yours under other names is refused with one line, not loaded halfway. GPT-2 stores its linear
layers as `Conv1D`, (in, out) where `nn.Linear` is (out, in): each is transposed on the way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpointing.checkpoint import CheckpointError
from ..config import Config
from ..settings.base import ConfigError
from . import hf_folders, hf_llama, neox_format
from .tokenizer import Tokenizer

# GPT-2's activation_function values and model.py's --activation for each.
ACTIVATIONS = {"gelu_new": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh", "gelu": "gelu"}
TRANSPOSED = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # Conv1D: (in, out)
# model.py's name for each GPT-2 name, per block ({} the block's index) and outside blocks.
BLOCK_NAMES = {
    "ln_1": "norm1",
    "attn.c_attn": "attn.qkv",
    "attn.c_proj": "attn.proj",
    "ln_2": "norm2",
    "mlp.c_fc": "expand",
    "mlp.c_proj": "contract",
}
TOP_NAMES = {"wte": "token", "wpe": "position", "ln_f": "norm"}


def read_config(folder: Path) -> dict[str, Any]:
    """The folder's config.json, if it describes a GPT-2 this project's model can be."""
    hf = hf_folders.read_json(folder)
    if hf.get("model_type") != "gpt2":
        kinds = ", ".join(hf_llama.MODEL_TYPES)
        raise ConfigError(
            f"--init-from {folder}: model_type {hf.get('model_type')!r}, not gpt2, {kinds}"
        )
    problems = []
    if hf.get("activation_function", "gelu_new") not in ACTIVATIONS:
        problems.append(f"activation_function {hf.get('activation_function')!r}")
    if hf.get("n_inner") not in (None, 4 * hf.get("n_embd", 768)):
        problems.append(f"n_inner {hf['n_inner']} (model.py's MLP is 4 x n_embd)")
    if not math.isclose(hf.get("layer_norm_epsilon", 1e-5), 1e-5):
        problems.append(f"layer_norm_epsilon {hf['layer_norm_epsilon']} (model.py's is 1e-5)")
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("scale_attn_weights") is False:
        problems.append("attention scaled other than by 1/sqrt(head size)")
    if problems:
        raise ConfigError(f"--init-from {folder}: not model.py's GPT: {'; '.join(problems)}")
    return hf


def adopt(config: Config, log: Callable[[str], None]) -> Config:
    """`config` with the architecture and tokenizer of its `--init-from` folder (as it is
    without one); logs what it changed."""
    source = getattr(config.run, "init_from", None)  # a RunConfig of yours may lack it
    if source is None:
        return config
    folder = hf_folders.resolve(source)
    hf = hf_folders.read_json(folder)
    if hf.get("model_type") in hf_llama.MODEL_TYPES:
        return hf_llama.adopt(config, folder, hf, log)
    hf = read_config(folder)
    if not (folder / "tokenizer.json").is_file():
        raise ConfigError(f"--init-from {folder}: no tokenizer.json beside its weights")
    taken = {
        "width": hf_llama.whole(hf, "n_embd", 768, folder),
        "depth": hf_llama.whole(hf, "n_layer", 12, folder),
        "heads": hf_llama.whole(hf, "n_head", 12, folder),
        "seq_len": hf_llama.whole(hf, "n_positions", 1024, folder),
        "position": "learned",
        "activation": ACTIVATIONS[hf.get("activation_function", "gelu_new")],
        "tokenizer": str(folder),
    }
    flat = config.flat()
    changed = [f"--{k.replace('_', '-')} {v}" for k, v in taken.items() if flat.get(k) != v]
    if changed:
        log(f"--init-from {folder}: its architecture and tokenizer: {', '.join(changed)}")
    return hf_llama.checked(config.replace(**taken, init_from=str(folder)), folder)


def init_from(model: nn.Module, config: Config, log: Callable[[str], None]) -> None:
    """Copy the weights of `config`'s --init-from folder into `model` (in place)."""
    source = getattr(config.run, "init_from", None)
    if source is None:
        return
    folder = hf_folders.resolve(source)
    if hf_folders.read_json(folder).get("model_type") in hf_llama.MODEL_TYPES:
        hf_llama.init_from(model, folder, log)
        return
    hf = read_config(folder)
    wanted = ACTIVATIONS[hf.get("activation_function", "gelu_new")]
    if getattr(model, "activation", "gelu") != wanted:
        raise ConfigError(
            f"--init-from {folder}: its MLP uses {wanted}, and model.py's GPT has no "
            "--activation setting (see the Upgrade notes)"
        )
    state = to_model_names(read_weights(folder), folder)
    head, token = state.get("head.weight"), state.get("token.weight")
    if head is not None and (token is None or not torch.equal(head, token)):
        raise CheckpointError(
            f"--init-from {folder}: its lm_head is not tied to wte (tie_word_embeddings "
            "false), and model.py's GPT ties them: not loaded"
        )
    own = model.state_dict()
    if "head.weight" in own and "head.weight" not in state:
        state["head.weight"] = state.get("token.weight", torch.empty(0))  # tied to wte
    hf_folders.load_weights(model, state, folder, log)


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's safetensors, without the `transformer.` prefix a GPT2LMHeadModel saves
    under, nor the attention masks old saves keep as buffers."""
    weights = {}
    for name, tensor in hf_folders.read_safetensors(folder).items():
        name = name.removeprefix("transformer.")
        parts = name.split(".")  # h.N.attn.bias: the causal mask (bool or float), not c_attn's
        if parts[-2:] in (["attn", "bias"], ["attn", "masked_bias"]):
            continue
        weights[name] = tensor
    return weights


def to_model_names(weights: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """GPT-2's tensors under model.py's names, Conv1D weights transposed; an unknown name
    (another architecture) raises CheckpointError."""
    state = {}
    for name, tensor in weights.items():
        if name == "lm_head.weight":
            state["head.weight"] = tensor
            continue
        parts = name.split(".")
        if parts[0] == "h" and len(parts) >= 4:
            layer, leaf = ".".join(parts[2:-1]), parts[-1]
            if layer not in BLOCK_NAMES:
                raise CheckpointError(f"--init-from {folder}: unknown tensor {name}")
            if layer in TRANSPOSED and leaf == "weight":
                tensor = tensor.t()
            state[f"blocks.{parts[1]}.{BLOCK_NAMES[layer]}.{leaf}"] = tensor.contiguous()
        elif parts[0] in TOP_NAMES and len(parts) == 2:
            state[f"{TOP_NAMES[parts[0]]}.{parts[1]}"] = tensor
        else:
            raise CheckpointError(f"--init-from {folder}: unknown tensor {name}")
    return state


def to_gpt2_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """model.py's GPT's weights under GPT-2's names (the tied head once, as wte)."""
    block_names = {ours: theirs for theirs, ours in BLOCK_NAMES.items()}
    top_names = {ours: theirs for theirs, ours in TOP_NAMES.items()}
    weights = {}
    for name, tensor in state.items():
        parts = name.split(".")
        if name == "head.weight":
            continue  # tied to the token embedding: GPT-2 ties lm_head to wte on loading
        if parts[0] == "blocks" and ".".join(parts[2:-1]) in block_names:
            layer = block_names[".".join(parts[2:-1])]
            if layer in TRANSPOSED and parts[-1] == "weight":
                tensor = tensor.t()
            weights[f"transformer.h.{parts[1]}.{layer}.{parts[-1]}"] = tensor
        elif parts[0] in top_names and len(parts) == 2:
            weights[f"transformer.{top_names[parts[0]]}.{parts[1]}"] = tensor
        else:
            raise CheckpointError(f"export --format hf: {name} has no GPT-2 name")
    return weights


def gpt2_config(config: Config, vocab_size: int, eot: int | None) -> dict[str, Any]:
    """config.json of a GPT-2 with `config`'s architecture."""
    activation = getattr(config.model, "activation", "gelu")
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": vocab_size,
        "n_positions": config.model.seq_len,
        "n_embd": config.model.width,
        "n_layer": config.model.depth,
        "n_head": config.model.heads,
        "n_inner": None,
        "activation_function": "gelu_new" if activation == "gelu-tanh" else "gelu",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": config.model.dropout,
        "embd_pdrop": config.model.dropout,
        "attn_pdrop": config.model.dropout,
        "tie_word_embeddings": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
    }


def write_folder(
    state: dict[str, torch.Tensor], config: Config, tokenizer: Tokenizer, out: Path
) -> str:
    """Write `out` (config.json, model.safetensors, tokenizer.json) whole or not at all, in
    the architecture that computes what the checkpoint's model does: GPT-2 (learned
    positions), GPT-NeoX (model.py's GPT with rotary ones), Llama or Qwen2 (`--model llama`).
    Returns the architecture's name."""
    if getattr(config.model, "model", "gpt") == "llama":
        return hf_llama.write_folder(state, config, tokenizer, out)
    if getattr(config.model, "position", "learned") != "learned":
        return neox_format.write_folder(state, config, tokenizer, out)
    spec = gpt2_config(config, tokenizer.vocab_size, tokenizer.eot)
    hf_folders.write_folder(out, spec, to_gpt2_names(state), tokenizer)
    return "GPT2LMHeadModel"
