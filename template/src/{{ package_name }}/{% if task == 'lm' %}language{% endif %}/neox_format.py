"""model.py's GPT with rotary positions out as a Hugging Face GPT-NeoX folder (`export --format
hf`): GPTNeoXForCausalLM is the same network when configured as below.

- Blocks: pre-norm LayerNorms (weight and bias, eps 1e-5) and one residual after the other
  (`use_parallel_residual: false`), a 4x MLP with biases and GELU (`hidden_act` gelu, exact,
  or gelu_pytorch_tanh for --activation gelu-tanh), attention with biases
  (`attention_bias: true`) scaled by 1/sqrt(head size).
- Rotary positions on every dimension of a head (`partial_rotary_factor` / `rotary_pct` 1.0,
  base 10000), a head's first half of dimensions paired with its second half: the layout
  model.py's `rotate` uses, so no row of q or k is permuted.
- The fused projection: model.py's `attn.qkv` rows are all queries, then all keys, then all
  values (head by head within each); GPT-NeoX's `query_key_value` rows are head by head, each
  head's query, key and value rows together. The rows (and the bias) are reordered for that.
- The output layer tied to the token embedding (`tie_word_embeddings: true`).

The names below are model.py's GPT's: a model of yours under other names is refused in one
line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..checkpointing.checkpoint import CheckpointError
from ..config import Config
from . import hf_folders
from .tokenizer import Tokenizer

BLOCK_NAMES = {
    "norm1": "input_layernorm",
    "attn.qkv": "attention.query_key_value",
    "attn.proj": "attention.dense",
    "norm2": "post_attention_layernorm",
    "expand": "mlp.dense_h_to_4h",
    "contract": "mlp.dense_4h_to_h",
}
TOP_NAMES = {"token": "gpt_neox.embed_in", "norm": "gpt_neox.final_layer_norm"}


def head_by_head(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """(3 * width, ...) rows ordered [q | k | v] (each head by head) -> ordered head by head,
    each head's [q, k, v]."""
    rest = tensor.shape[1:]
    grouped = tensor.reshape(3, heads, -1, *rest)  # (qkv, head, head_dim, ...)
    return grouped.transpose(0, 1).reshape(tensor.shape)


def to_neox_names(state: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """model.py's GPT's weights under GPT-NeoX's names (the tied head once, as embed_in)."""
    weights = {}
    for name, tensor in state.items():
        parts = name.split(".")
        layer = ".".join(parts[2:-1])
        if name == "head.weight":
            continue  # tied: transformers ties lm_head to embed_in on loading
        if parts[0] == "blocks" and layer in BLOCK_NAMES:
            if layer == "attn.qkv":
                tensor = head_by_head(tensor, heads)
            weights[f"gpt_neox.layers.{parts[1]}.{BLOCK_NAMES[layer]}.{parts[-1]}"] = tensor
        elif parts[0] in TOP_NAMES and len(parts) == 2:
            weights[f"{TOP_NAMES[parts[0]]}.{parts[1]}"] = tensor
        else:
            raise CheckpointError(f"export --format hf: {name} has no GPT-NeoX name")
    return weights


def neox_config(config: Config, vocab_size: int, eot: int | None) -> dict[str, Any]:
    """config.json of a GPTNeoXForCausalLM that computes what model.py's rotary GPT does."""
    model = config.model
    tanh = getattr(model, "activation", "gelu") == "gelu-tanh"
    return {
        "model_type": "gpt_neox",
        "architectures": ["GPTNeoXForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": model.width,
        "num_hidden_layers": model.depth,
        "num_attention_heads": model.heads,
        "intermediate_size": 4 * model.width,
        "hidden_act": "gelu_pytorch_tanh" if tanh else "gelu",
        "max_position_embeddings": model.seq_len,
        "layer_norm_eps": 1e-5,
        "use_parallel_residual": False,
        "attention_bias": True,
        "rotary_pct": 1.0,  # transformers 4's keys; 5 reads rope_parameters
        "rotary_emb_base": 10000,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 1.0,
        },
        "attention_dropout": model.dropout,
        "hidden_dropout": model.dropout,
        "tie_word_embeddings": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
    }


def write_folder(
    state: dict[str, torch.Tensor], config: Config, tokenizer: Tokenizer, out: Path
) -> str:
    """Write the rotary GPT's weights as a GPT-NeoX folder; its architecture's name."""
    weights = to_neox_names(state, config.model.heads)
    spec = neox_config(config, tokenizer.vocab_size, tokenizer.eot)
    hf_folders.write_folder(out, spec, weights, tokenizer)
    return "GPTNeoXForCausalLM"
