"""GPT-2-format folders in and out: `--init-from FOLDER` and `export --format hf`.

A Hugging Face folder of the GPT-2 architecture (GPT-2 itself, distilgpt2 and their many
fine-tunes: `config.json` with `"model_type": "gpt2"`, `model.safetensors`, `tokenizer.json`)
is read with `safetensors` (the `hf` extra) and `tokenizers` only (no `transformers` at run
time). `--init-from FOLDER` takes its architecture into the run's settings (width, depth,
heads, `--seq-len` = its `n_positions`, learned positions, its GELU), its tokenizer
(`--tokenizer FOLDER`) and its weights; the optimizer and schedule are this run's. The
settings it takes are saved in every checkpoint, so generate, evaluate and resume need the
folder no more.

`export --format hf` writes such a folder from a checkpoint trained with `--position learned`
(GPT-2 has no rotary positions): `transformers.AutoModelForCausalLM.from_pretrained(folder)`
then gives the same logits, and the tokenizer (a byte model's is a byte-level tokenizer.json
of its 256 bytes) reads text as training did.

The names below are model.py's GPT's (`token`, `position`, `blocks.N.norm1`, ...): a model of
yours under other names is refused with one line, not loaded halfway. GPT-2 stores its linear
layers as `Conv1D`, (in, out) where `nn.Linear` is (out, in): each is transposed on the way.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpointing.checkpoint import CheckpointError
from ..config import Config
from ..settings.base import ConfigError
from .tokenizer import Tokenizer, byte_tokenizer_json

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
    path = folder / "config.json"
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"--init-from {folder}: no readable config.json ({error}); give a GPT-2-format "
            "folder (config.json, model.safetensors, tokenizer.json)"
        ) from None
    if not isinstance(hf, dict) or hf.get("model_type") != "gpt2":
        kind = hf.get("model_type") if isinstance(hf, dict) else None
        raise ConfigError(f"--init-from {folder}: model_type {kind!r}, not gpt2")
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
    folder = Path(source)
    hf = read_config(folder)
    if not (folder / "tokenizer.json").is_file():
        raise ConfigError(f"--init-from {folder}: no tokenizer.json beside its weights")
    taken = {
        "width": hf.get("n_embd", 768),
        "depth": hf.get("n_layer", 12),
        "heads": hf.get("n_head", 12),
        "seq_len": hf.get("n_positions", 1024),
        "position": "learned",
        "activation": ACTIVATIONS[hf.get("activation_function", "gelu_new")],
        "tokenizer": str(folder),
    }
    flat = config.flat()
    changed = [f"--{k.replace('_', '-')} {v}" for k, v in taken.items() if flat.get(k) != v]
    if changed:
        log(f"--init-from {folder}: its architecture and tokenizer: {', '.join(changed)}")
    return config.replace(**taken)


def init_from(model: nn.Module, config: Config, log: Callable[[str], None]) -> None:
    """Copy the weights of `config`'s --init-from folder into `model` (in place)."""
    source = getattr(config.run, "init_from", None)
    if source is None:
        return
    folder = Path(source)
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
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        first = str(error).strip().splitlines()[1 if "\n" in str(error) else 0].strip()
        raise CheckpointError(f"--init-from {folder}: the model does not fit ({first})") from None
    count = sum(t.numel() for t in model.parameters())
    log(f"--init-from {folder}: loaded {len(state)} tensors ({count / 1e6:.1f} M parameters)")


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors of `folder`, without the `transformer.` prefix a GPT2LMHeadModel
    saves under, nor the attention masks old saves keep as buffers."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(
            f"--init-from {folder}: no model.safetensors (pytorch_model.bin is not read)"
        )
    try:
        raw = load_file(str(path))
    except (OSError, SafetensorError) as error:
        raise CheckpointError(f"--init-from {path} cannot be read ({error})") from None
    weights = {}
    for name, tensor in raw.items():
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
    return {name: tensor.detach().float().contiguous() for name, tensor in weights.items()}


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
) -> None:
    """Write `out` (config.json, model.safetensors, tokenizer.json) whole or not at all:
    built in a temporary folder beside it, then renamed."""
    from safetensors.torch import save_file

    if out.exists():
        raise ConfigError(f"--out {out} exists; remove it or choose another folder")
    if getattr(config.model, "position", "learned") != "learned":
        raise ConfigError(
            "export --format hf writes GPT-2's architecture, which has learned positions; this "
            "checkpoint was trained with --position rope (train with --position learned)"
        )
    weights = to_gpt2_names(state)
    spec = gpt2_config(config, tokenizer.vocab_size, tokenizer.eot)
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
