"""`--model llama`: a Llama-style decoder (Llama 2/3, Mistral, Qwen2 are this shape).

Pre-norm blocks with RMSNorm (`--norm-eps`), grouped-query attention (`--heads` query heads
sharing `--kv-heads` key/value heads; the default, as many as --heads, is plain multi-head
attention), rotary positions (`--rope-base`, Llama's rope_theta) in Hugging Face's layout
(each head's first half of dimensions paired with its second half), a SwiGLU MLP of
`--mlp-width` hidden units (default 8/3 of --width, rounded up to a multiple of 32), no biases
but optional ones on the query, key and value projections (`--qkv-bias`, Qwen2's), and an
output layer tied to the token embedding or its own (`--no-tie-head`).

It is the template's (this file is refreshed by `copier update`), registered like model.py's
GPT, and offers what the template asks of a model: `blocks` (an `nn.ModuleList`: FSDP units,
activation checkpointing), `new_cache` and `model(tokens, cache=...)` (generate's key/value
cache; the cache holds the --kv-heads heads, not the repeated ones), `flops_per_token` (MFU),
and its output layer as its last `nn.Linear` (Muon's hidden matrices are the others).
Hugging Face folders in and out: language/hf_llama.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import slots
from ..config import Config
from ..training.data_sources import DataInfo


def default_mlp_width(width: int) -> int:
    """Llama's SwiGLU width: 8/3 of the model's (the parameters of a 4x GELU MLP), rounded up
    to a multiple of 32."""
    return 32 * math.ceil(8 * width / 3 / 32)


class KVCache:
    """Each block's keys and values (B, kv_heads, seq_len, head_dim) for the first `length`
    positions, for generation (`Llama.new_cache`); the protocol of model.py's GPT's."""

    def __init__(
        self, blocks: int, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype
    ):
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(blocks)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(blocks)]
        self.length = 0

    def extend(self, block: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store this block's new keys and values after the cached ones; return all so far."""
        end = self.length + k.shape[2]
        self.keys[block][:, :, self.length : end] = k
        self.values[block][:, :, self.length : end] = v
        return self.keys[block][:, :, :end], self.values[block][:, :, :end]


def rotary_angles(
    positions: torch.Tensor, head_dim: int, base: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of RoPE's angles, (T, head_dim / 2) each: position p turns dimension pair i
    by p / base^(2i / head_dim) (Hugging Face's inv_freq, in float32)."""
    pairs = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
    inverse = 1.0 / (base ** (pairs / head_dim))
    angles = positions.float()[:, None] * inverse[None, :]
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Turn each (first-half, second-half) dimension pair of (B, heads, T, D) `x` by its
    position's angles (Hugging Face's rotate_half), in float32, back in `x`'s dtype."""
    cos, sin = angles
    first, second = x.float().chunk(2, dim=-1)
    turned = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return turned.to(x.dtype)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, in float32, back in x's dtype (Llama's)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention: `heads` query heads, `kv_heads` key/value heads, each
    shared by heads / kv_heads consecutive query heads."""

    def __init__(self, width: int, heads: int, kv_heads: int, bias: bool, dropout: float):
        super().__init__()
        self.heads, self.kv_heads, self.dropout = heads, kv_heads, dropout
        self.head_dim = width // heads
        self.q = nn.Linear(width, heads * self.head_dim, bias=bias)
        self.k = nn.Linear(width, kv_heads * self.head_dim, bias=bias)
        self.v = nn.Linear(width, kv_heads * self.head_dim, bias=bias)
        self.o = nn.Linear(heads * self.head_dim, width, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        angles: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
        index: int = 0,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q(x).view(batch, length, self.heads, -1).transpose(1, 2)
        k = self.k(x).view(batch, length, self.kv_heads, -1).transpose(1, 2)
        v = self.v(x).view(batch, length, self.kv_heads, -1).transpose(1, 2)
        q, k = rotate(q, angles), rotate(k, angles)  # the cache keeps keys already turned
        mask, causal = None, True
        if cache is not None and cache.length:  # new positions see the cached ones and their own
            k, v = cache.extend(index, k, v)
            causal = False
            if length > 1:
                seen = torch.arange(k.shape[2], device=x.device)
                at = torch.arange(cache.length, cache.length + length, device=x.device)
                mask = seen <= at[:, None]
        elif cache is not None:
            cache.extend(index, k, v)
        groups = self.heads // self.kv_heads
        if groups > 1:  # key/value head j serves query heads j * groups ... (j + 1) * groups - 1
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, dropout_p=self.dropout * self.training
        )
        return self.o(y.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, width: int, heads: int, kv_heads: int, hidden: int, options: dict):
        super().__init__()
        self.norm1 = RMSNorm(width, options["eps"])
        self.attn = Attention(width, heads, kv_heads, options["bias"], options["dropout"])
        self.norm2 = RMSNorm(width, options["eps"])
        self.mlp = MLP(width, hidden)
        self.drop = nn.Dropout(options["dropout"])

    def forward(
        self,
        x: torch.Tensor,
        angles: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
        index: int = 0,
    ) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), angles, cache, index))
        return x + self.drop(self.mlp(self.norm2(x)))


class Llama(nn.Module):
    """Token embedding, `depth` blocks, a final RMSNorm, an output layer (tied or not)."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        width: int = 128,
        depth: int = 2,
        heads: int = 4,
        kv_heads: int | None = None,
        mlp_width: int | None = None,
        *,
        eps: float = 1e-5,
        rope_base: float = 10000.0,
        tie_head: bool = True,
        qkv_bias: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        kv_heads = heads if kv_heads is None else kv_heads
        if width % heads or (width // heads) % 2:
            raise ValueError(f"width {width} / heads {heads} must be a whole, even head size")
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"kv_heads {kv_heads} must divide heads {heads}")
        self.seq_len, self.heads, self.kv_heads = seq_len, heads, kv_heads
        self.head_dim, self.rope_base = width // heads, rope_base
        hidden = mlp_width or default_mlp_width(width)
        options = {"eps": eps, "bias": qkv_bias, "dropout": dropout}
        self.token = nn.Embedding(vocab_size, width)
        self.drop = nn.Dropout(dropout)
        blocks = [Block(width, heads, kv_heads, hidden, options) for _ in range(depth)]
        self.blocks = nn.ModuleList(blocks)
        self.norm = RMSNorm(width, eps)
        self.head = nn.Linear(width, vocab_size, bias=False)  # the last Linear: Muon skips it
        if tie_head:
            self.head.weight = self.token.weight
        self.apply(_init)
        for block in blocks:  # GPT-2's: residual outputs scaled down by depth
            for layer in (block.attn.o, block.mlp.down):
                nn.init.normal_(layer.weight, std=0.02 / math.sqrt(2 * depth))

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """(B, T) token ids -> (B, T, vocab) logits; with a `cache` (`new_cache`), `tokens`
        follow the positions it holds, and the cache then holds these too."""
        start = cache.length if cache is not None else 0
        length = tokens.shape[1]
        if start + length > self.seq_len:
            raise ValueError(
                f"sequence of {start + length} tokens is longer than seq_len {self.seq_len}"
            )
        positions = torch.arange(start, start + length, device=tokens.device)
        angles = rotary_angles(positions, self.head_dim, self.rope_base)
        x = self.drop(self.token(tokens))
        for index, block in enumerate(self.blocks):
            x = block(x, angles, cache, index)
        if cache is not None:
            cache.length += length
        return self.head(self.norm(x))

    def new_cache(self, batch: int = 1) -> KVCache:
        """An empty key/value cache for `batch` sequences of up to `seq_len` positions."""
        weight = self.token.weight
        shape = (batch, self.kv_heads, self.seq_len, self.head_dim)
        return KVCache(len(self.blocks), shape, weight.device, weight.dtype)

    def flops_per_token(self) -> int:
        """Training FLOPs per token (PaLM, appendix B): 6 per weight of a matrix multiply,
        plus 6 * 2 * depth * heads * head_dim * seq_len for the attention scores and their
        weighted sum. The token embedding is a lookup: counted only as a tied output layer."""
        tied = self.head.weight is self.token.weight
        weights = sum(p.numel() for p in self.parameters())
        if not tied:
            weights -= self.token.weight.numel()
        inner = self.heads * self.head_dim
        return 6 * weights + 12 * len(self.blocks) * inner * self.seq_len


def _init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def settings(config: Config) -> dict:
    """The Llama's keyword arguments from `config` (a ModelConfig of yours may lack them)."""
    model = config.model
    return {
        "width": model.width,
        "depth": model.depth,
        "heads": model.heads,
        "kv_heads": getattr(model, "kv_heads", None),
        "mlp_width": getattr(model, "mlp_width", None),
        "eps": getattr(model, "norm_eps", 1e-5),
        "rope_base": getattr(model, "rope_base", 10000.0),
        "tie_head": getattr(model, "tie_head", True),
        "qkv_bias": getattr(model, "qkv_bias", False),
        "dropout": model.dropout,
    }


def llama_memory(config: Config) -> int:
    """A rough floor: the weights (the embedding counted for a 256-token vocabulary, twice
    untied), fp32 weights, gradients and two AdamW moments, and one batch's activations kept
    for backward (about 16 width per token and block, plus the logits)."""
    given = settings(config)
    width, depth, length = given["width"], given["depth"], config.model.seq_len
    kv = width // given["heads"] * (given["kv_heads"] or given["heads"])
    hidden = given["mlp_width"] or default_mlp_width(width)
    weights = depth * (2 * width * width + 2 * width * kv + 3 * width * hidden)
    weights += 256 * width * (1 if given["tie_head"] else 2)
    activations = length * (16 * depth * width + 256)
    return 4 * (4 * weights + config.optim.batch_size * activations)


@slots.model(
    "llama",
    help="a Llama-style decoder: RMSNorm, SwiGLU, grouped-query attention (--kv-heads), RoPE",
    memory=llama_memory,
)
def build_llama(config: Config, info: DataInfo) -> nn.Module:
    """The Llama with `config`'s architecture and the dataset's vocabulary."""
    return Llama(info.vocab_size, config.model.seq_len, **settings(config))
