"""Llama, Mistral and Qwen2 folders in and out of `--model llama` (language/llama.py).

`--init-from FOLDER` (or a hub id already in the local Hugging Face cache) with a config.json
whose model_type is llama, mistral or qwen2 (LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM) takes its architecture into the run's settings (`--model llama`, width,
depth, heads, --kv-heads, --mlp-width, --norm-eps = rms_norm_eps, --rope-base = rope_theta,
--tie-head = tie_word_embeddings, --qkv-bias: Qwen2's), its tokenizer.json and its weights.
`--seq-len` stays the run's, at most max_position_embeddings (and at most an active sliding
window: within it, sliding-window attention is full attention). What `--model llama` does not
implement is refused in one line: rope scaling (linear, dynamic, yarn, llama3...), partial
rotary, another activation than SiLU, biases other than Qwen2's, a head size other than
width / heads. Embedding rows past the tokenizer's vocabulary (Qwen2 pads its matrix to a
multiple of 128) are dropped, with one line.

`export --format hf` of a `--model llama` checkpoint writes a LlamaForCausalLM folder, or a
Qwen2ForCausalLM one with --qkv-bias; transformers loads either with this project's logits.
Both sides place rotary positions alike (a head's first half of dimensions paired with its
second half), so the q and k rows are copied as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpointing.checkpoint import CheckpointError
from ..config import Config
from ..settings.base import ConfigError
from ..settings.checks import check_ranges
from . import hf_folders
from .llama import default_mlp_width, settings
from .tokenizer import Tokenizer

MODEL_TYPES = ("llama", "mistral", "qwen2")
# --model llama's name for each Hugging Face name inside a block, and outside the blocks.
BLOCK_NAMES = {
    "input_layernorm": "norm1",
    "self_attn.q_proj": "attn.q",
    "self_attn.k_proj": "attn.k",
    "self_attn.v_proj": "attn.v",
    "self_attn.o_proj": "attn.o",
    "post_attention_layernorm": "norm2",
    "mlp.gate_proj": "mlp.gate",
    "mlp.up_proj": "mlp.up",
    "mlp.down_proj": "mlp.down",
}
TOP_NAMES = {"model.embed_tokens": "token", "model.norm": "norm", "lm_head": "head"}


def rope(hf: dict[str, Any]) -> tuple[float, list[str]]:
    """(rope_theta, what of the rotary settings --model llama does not implement)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default")) if params else "default"
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    problems = [] if kind == "default" else [f"rope scaling {kind!r}"]
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append("partial rotary positions")
    return float(theta), problems


def whole(hf: dict[str, Any], key: str, default: int, folder: Path) -> int:
    """config.json's `key` (`default` where absent or null): a whole number >= 1, or one line."""
    value = hf.get(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"--init-from {folder}: its config.json's {key} is {value!r}, not a whole number >= 1"
        )
    return value


def architecture(hf: dict[str, Any], folder: Path, seq_len: int) -> dict[str, Any]:
    """The run's settings for the folder's model, or one line naming what does not fit."""
    kind = hf.get("model_type")
    width, heads = (
        whole(hf, "hidden_size", 4096, folder),
        whole(hf, "num_attention_heads", 32, folder),
    )
    theta, problems = rope(hf)
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf.get('hidden_act')!r} (SwiGLU's is silu)")
    if kind == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        problems.append("attention_bias or mlp_bias (biases beyond q, k and v)")
    if hf.get("head_dim") not in (None, width // heads):
        problems.append(f"head_dim {hf['head_dim']} (not hidden_size / heads = {width // heads})")
    if problems:
        raise ConfigError(f"--init-from {folder}: not --model llama's: {'; '.join(problems)}")
    depth = whole(hf, "num_hidden_layers", 32, folder)
    window = hf.get("sliding_window")
    sliding = "sliding_attention" in (hf.get("layer_types") or [])
    if (
        kind == "qwen2"
        and not sliding
        and not (hf.get("use_sliding_window") and hf.get("max_window_layers", depth) < depth)
    ):
        window = None  # Qwen2 names a window it does not use
    limits = [seq_len, whole(hf, "max_position_embeddings", 2048, folder), window or seq_len]
    return {
        "model": "llama",
        "width": width,
        "depth": depth,
        "heads": heads,
        "kv_heads": whole(hf, "num_key_value_heads", heads, folder),
        "mlp_width": whole(hf, "intermediate_size", 11008, folder),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_base": theta,
        "tie_head": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": kind == "qwen2",
        "seq_len": min(limits),
    }


def adopt(config: Config, folder: Path, hf: dict[str, Any], log: Callable[[str], None]) -> Config:
    """`config` with the folder's architecture and tokenizer (logged where they change)."""
    if not (folder / "tokenizer.json").is_file():
        raise ConfigError(
            f"--init-from {folder}: no tokenizer.json beside its weights (a tokenizer.model "
            "alone is not read)"
        )
    taken = architecture(hf, folder, config.model.seq_len)
    taken["tokenizer"] = str(folder)
    flat = config.flat()
    changed = [f"--{k.replace('_', '-')} {v}" for k, v in taken.items() if flat.get(k) != v]
    if changed:
        log(f"--init-from {folder}: its architecture and tokenizer: {', '.join(changed)}")
    return checked(config.replace(**taken, init_from=str(folder)), folder)


def checked(adopted: Config, folder: Path) -> Config:
    """`adopted` (a run's settings with a folder's architecture), if the flags' range checks
    pass it (--kv-heads 3 of 2 heads is refused there too), else one line naming the folder."""
    try:
        check_ranges(adopted)
    except ValueError as error:
        raise ConfigError(f"--init-from {folder}: its config.json gives {error}") from None
    return adopted


def to_model_names(weights: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors under language/llama.py's names; an unknown one is refused."""
    state = {}
    for name, tensor in weights.items():
        parts = name.split(".")
        if parts[-1] == "inv_freq":  # old saves keep the rotary frequencies: recomputed
            continue
        if parts[:2] == ["model", "layers"] and len(parts) >= 5:
            layer = ".".join(parts[3:-1])
            if layer in BLOCK_NAMES:
                state[f"blocks.{parts[2]}.{BLOCK_NAMES[layer]}.{parts[-1]}"] = tensor
                continue
        elif ".".join(parts[:-1]) in TOP_NAMES:
            state[f"{TOP_NAMES['.'.join(parts[:-1])]}.{parts[-1]}"] = tensor
            continue
        raise CheckpointError(f"--init-from {folder}: unknown tensor {name}")
    return state


def init_from(model: nn.Module, folder: Path, log: Callable[[str], None]) -> None:
    """Copy the folder's weights into `model` (built by `adopt`'s settings), in place."""
    state = to_model_names(hf_folders.read_safetensors(folder), folder)
    own = model.state_dict()
    rows = own["token.weight"].shape[0] if "token.weight" in own else 0
    stored = state["token.weight"].shape[0] if "token.weight" in state else 0
    if stored > rows > 0:  # rows no token of the tokenizer reaches
        log(f"--init-from {folder}: its {stored} embedding rows cut to the tokenizer's {rows}")
        state = {
            k: v[:rows] if k in ("token.weight", "head.weight") else v for k, v in state.items()
        }
    head_layer, token_layer = getattr(model, "head", None), getattr(model, "token", None)
    if head_layer is not None and getattr(head_layer, "weight", 0) is getattr(
        token_layer, "weight", 1
    ):
        head, token = state.get("head.weight"), state.get("token.weight")
        if head is not None and (token is None or not torch.equal(head, token)):
            raise CheckpointError(
                f"--init-from {folder}: its lm_head differs from embed_tokens, and the run's "
                "output layer is tied (tie_word_embeddings true): not loaded"
            )
        state["head.weight"] = state.get("token.weight", torch.empty(0))
    hf_folders.load_weights(model, state, folder, log)


def to_hf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """--model llama's weights under Hugging Face's Llama names."""
    block_names = {ours: theirs for theirs, ours in BLOCK_NAMES.items()}
    top_names = {ours: theirs for theirs, ours in TOP_NAMES.items()}
    weights = {}
    for name, tensor in state.items():
        parts = name.split(".")
        layer = ".".join(parts[2:-1])
        if parts[0] == "blocks" and layer in block_names:
            weights[f"model.layers.{parts[1]}.{block_names[layer]}.{parts[-1]}"] = tensor
        elif ".".join(parts[:-1]) in top_names:
            weights[f"{top_names['.'.join(parts[:-1])]}.{parts[-1]}"] = tensor
        else:
            raise CheckpointError(f"export --format hf: {name} has no Llama name")
    return weights


def hf_config(config: Config, vocab_size: int, eot: int | None) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM (Qwen2ForCausalLM with --qkv-bias) like `config`'s."""
    given = settings(config)
    width, heads, base = given["width"], given["heads"], given["rope_base"]
    qwen = bool(given["qkv_bias"])
    spec = {
        "model_type": "qwen2" if qwen else "llama",
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": width,
        "intermediate_size": given["mlp_width"] or default_mlp_width(width),
        "num_hidden_layers": given["depth"],
        "num_attention_heads": heads,
        "num_key_value_heads": given["kv_heads"] or heads,
        "head_dim": width // heads,
        "hidden_act": "silu",
        "max_position_embeddings": config.model.seq_len,
        "rms_norm_eps": given["eps"],
        "rope_theta": base,  # transformers 4's key; 5 reads rope_parameters
        "rope_parameters": {"rope_type": "default", "rope_theta": base},
        "tie_word_embeddings": bool(given["tie_head"]),
        "attention_dropout": given["dropout"],
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
    }
    if qwen:
        spec.update(
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=spec["num_hidden_layers"],
        )
    else:
        spec.update(attention_bias=False, mlp_bias=False)
    return spec


def write_folder(
    state: dict[str, torch.Tensor], config: Config, tokenizer: Tokenizer, out: Path
) -> str:
    """Write a --model llama checkpoint's weights as a Llama (or Qwen2) folder; its name."""
    spec = hf_config(config, state["token.weight"].shape[0], tokenizer.eot)
    if spec["tie_word_embeddings"]:
        state = {name: tensor for name, tensor in state.items() if name != "head.weight"}
    hf_folders.write_folder(out, spec, to_hf_names(state), tokenizer)
    return str(spec["architectures"][0])
