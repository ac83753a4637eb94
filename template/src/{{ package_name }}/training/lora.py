"""LoRA: low-rank adapters on a model's `nn.Linear` layers (`--lora-rank`, docs/language-model.md).

Each adapted layer computes `x W^T + b + (alpha / r) * dropout(x) A^T B^T` with `A` (r, in) and
`B` (out, r) the only trainable tensors; `B` starts at zero, so the adapted model starts as its
base. The layer stays an `nn.Linear` (its class becomes `LoRALinear`, a subclass), so the base
keeps its names in the state dict (`blocks.0.attn.qkv.weight`) and the adapters sit beside it
(`blocks.0.attn.qkv.lora_a`, `.lora_b`). `merge` folds `(alpha / r) B A` into `W` and turns the
layer back into a plain `nn.Linear`: what export writes, and what evaluate and generate run.

Written here rather than taken from PEFT: PEFT wraps the model (`base_model.model.` before
every name, `base_layer` inside each layer), which this project's checkpoints, its resume
checks, export's name mapping and your model's own attributes (`flops_per_token`, a cache)
would each have to see through, and it would be an extra to install; this is one small class
that torch.compile and DDP see as an `nn.Linear` with two more parameters.

A checkpoint of a LoRA run saves the adapters only, and names its base by `fingerprint`: the
SHA-256 of the base's tensors (names, dtypes, shapes and bytes) once loaded from --init-from.
A resume, evaluate, generate and export rebuild the base from --init-from and refuse, in one
line, a base whose fingerprint differs.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpointing.checkpoint import CheckpointError, flat_record
from ..settings.base import ConfigError

ADAPTERS = ("lora_a", "lora_b")
FINGERPRINT = "lora_base"  # the run record's key (every checkpoint's "run")


class LoRALinear(nn.Linear):
    """An `nn.Linear` with a frozen weight and bias plus the trainable `lora_a`, `lora_b`."""

    lora_a: nn.Parameter
    lora_b: nn.Parameter
    lora_scale: float
    lora_dropout: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = F.linear(F.linear(self.lora_dropout(x), self.lora_a), self.lora_b)
        return F.linear(x, self.weight, self.bias) + low * self.lora_scale


def settings(config: Any) -> tuple[int, float, str, float]:
    """(rank, alpha, targets, dropout) of `config`; rank 0 where LoRA is off or a config of
    yours lacks the flags."""
    run = config.run
    return (
        int(getattr(run, "lora_rank", 0) or 0),
        float(getattr(run, "lora_alpha", 16.0)),
        str(getattr(run, "lora_targets", "auto")),
        float(getattr(run, "lora_dropout", 0.0)),
    )


def settings_of(saved: dict[str, Any]) -> tuple[int, float, str, float]:
    """`settings` of a checkpoint's config record (rank 0: not a LoRA run's)."""
    flat = flat_record(saved) if isinstance(saved, dict) else {}
    return (
        int(flat.get("lora_rank", 0) or 0),
        float(flat.get("lora_alpha", 16.0)),
        str(flat.get("lora_targets", "auto")),
        float(flat.get("lora_dropout", 0.0)),
    )


def trained_only(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param `groups` with only the parameters that train, empty groups dropped: under LoRA
    the optimizer sees the adapters and nothing else."""
    kept = [
        {**group, "params": [p for p in group["params"] if p.requires_grad]} for group in groups
    ]
    return [group for group in kept if group["params"]]


def adaptable(model: nn.Module) -> list[str]:
    """The layers LoRA can adapt: each `nn.Linear` (the class itself, not a subclass with its
    own forward) whose weight no other layer shares (folding an adapter into a head tied to
    the token embedding would change the embedding too)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and owners[id(module.weight)] == 1
    ]


def default_targets(model: nn.Module) -> list[str]:
    """`adaptable` layers but the output layer: none whose outputs number an embedding's rows
    (a head over the vocabulary; a tied head is not adaptable at all)."""
    rows = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    modules = dict(model.named_modules())
    return [name for name in adaptable(model) if modules[name].out_features not in rows]


def matches(name: str, pattern: str) -> bool:
    """`pattern` (a glob or a name's last parts: `qkv`, `attn.proj`, `blocks.*.expand`) fits
    the module name `name`."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def chosen(model: nn.Module, targets: str) -> list[str]:
    """The names of the layers `--lora-targets` picks (`auto`: `default_targets`); a pattern
    that picks no adaptable `nn.Linear` is a ConfigError."""
    if targets == "auto":
        names = default_targets(model)
        if not names:
            raise ConfigError(
                "--lora-targets auto: this model has no nn.Linear but its output layer to "
                "adapt; name the layers with --lora-targets (globs of module names)"
            )
        return names
    linears = adaptable(model)
    picked: dict[str, None] = {}
    for pattern in (p.strip() for p in targets.split(",")):
        found = [name for name in linears if matches(name, pattern)]
        if not found:
            some = ", ".join(linears[:4]) or "none"
            raise ConfigError(
                f"--lora-targets {pattern!r} matches no nn.Linear LoRA can adapt (one whose "
                f"weight no other layer shares; this model's first: {some}); give globs or "
                "last parts of module names"
            )
        picked.update(dict.fromkeys(found))
    return list(picked)


def attach(
    model: nn.Module, config: Any, log: Callable[[str], None] | None = None, fresh: bool = True
) -> bool:
    """With --lora-rank: freeze `model`, record its base's fingerprint on it, and turn the
    chosen layers into `LoRALinear`s (new adapters, `B` zero; `fresh` False: `A` zero too, for
    a checkpoint's to be loaded, drawing nothing from the random generators). False (nothing
    done) without."""
    rank, alpha, targets, dropout = settings(config)
    if not rank:
        return False
    names = chosen(model, targets)
    setattr(model, FINGERPRINT, fingerprint(model))  # of the base: before any adapter
    for param in model.parameters():
        param.requires_grad_(False)
    modules = dict(model.named_modules())
    for name in names:
        layer = modules[name]
        weight = layer.weight
        layer.__class__ = LoRALinear
        a = torch.empty(rank, layer.in_features, device=weight.device, dtype=weight.dtype)
        if fresh:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as nn.Linear's own weights
        else:
            a.zero_()
        layer.lora_a = nn.Parameter(a)
        layer.lora_b = nn.Parameter(torch.zeros(layer.out_features, rank, device=weight.device,
                                                dtype=weight.dtype))  # fmt: skip
        layer.lora_scale = alpha / rank
        layer.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
    if log is not None:
        trained, total = trainable(model), sum(p.numel() for p in model.parameters())
        log(
            f"LoRA rank {rank}, alpha {alpha:g} on {len(names)} layers: {trained:,} of "
            f"{total:,} parameters train ({100 * trained / total:.2f}%)"
        )
    return True


def trainable(model: nn.Module) -> int:
    """How many parameters of `model` train."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def adapted(model: nn.Module) -> list[str]:
    """The names of `model`'s adapter tensors, as its state dict names them."""
    return [
        f"{name}.{part}"
        for name, module in model.named_modules()
        if isinstance(module, LoRALinear)
        for part in ADAPTERS
    ]


def fingerprint(model: nn.Module) -> str:
    """SHA-256 of `model`'s state dict without adapters: names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    skip = set(adapted(model))
    for name, tensor in sorted(model.state_dict().items()):
        if name in skip or not isinstance(tensor, torch.Tensor):
            continue
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def record(model: nn.Module) -> dict[str, Any]:
    """The run record's entry naming the base (nothing without LoRA)."""
    base = getattr(model, FINGERPRINT, None)
    return {} if base is None else {FINGERPRINT: base}


def saved_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of `model`: the adapters under LoRA, else its state dict."""
    state = model.state_dict()
    names = adapted(model)
    return {name: state[name] for name in names} if names else state


def check_base(model: nn.Module, saved: dict[str, Any], path: Path) -> None:
    """Refuse checkpoint `saved` (read from `path`) if it adapts another base than `model`'s."""
    record_ = saved.get("run")
    theirs = record_.get(FINGERPRINT) if isinstance(record_, dict) else None
    ours = getattr(model, FINGERPRINT, None)
    if theirs != ours:
        raise CheckpointError(
            f"checkpoint {path} adapts another base model (fingerprint {str(theirs)[:12]}, "
            f"this one's {str(ours)[:12]}); it needs the --init-from it was trained on, "
            "unchanged (or, to resume, a new --run-dir)"
        )


def completed(model: nn.Module, state: dict[str, Any], path: Path) -> dict[str, Any]:
    """Checkpoint `state` with its adapters beside `model`'s own base, for a strict
    `load_state_dict`; `state` itself where `model` has no adapters."""
    names = adapted(model)
    if not names:
        return state
    check_base(model, state, path)
    saved = state["model"]
    if not isinstance(saved, dict) or sorted(saved) != sorted(names):
        extra = sorted(set(saved) - set(names)) if isinstance(saved, dict) else []
        raise CheckpointError(
            f"checkpoint {path} does not hold exactly this run's LoRA adapters "
            f"({len(names)} tensors{'; it holds ' + extra[0] if extra else ''}); use the "
            "same --lora-targets or a new --run-dir"
        )
    return {**state, "model": {**model.state_dict(), **saved}}


def merge(model: nn.Module) -> nn.Module:
    """Fold each adapter into its weight (`W + (alpha / r) B A`) and make the layer a plain
    `nn.Linear` again; `model`, changed in place."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                delta = module.lora_b @ module.lora_a
                module.weight += module.lora_scale * delta
                for part in (*ADAPTERS, "lora_dropout"):
                    delattr(module, part)
                del module.lora_scale
                module.__class__ = nn.Linear  # type: ignore[assignment]
    for param in model.parameters():
        param.requires_grad_(True)
    if hasattr(model, FINGERPRINT):
        delattr(model, FINGERPRINT)
    return model
