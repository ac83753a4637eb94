"""Spreading one model over the ranks of a torchrun job: DDP or FSDP2.

`--parallel ddp` (the default) keeps a full copy of the model, gradients and optimizer state on
every rank and all-reduces the gradients: the simplest choice while the model fits on one
device. `--parallel fsdp` shards all three over the ranks with FSDP2 (`fully_shard`): each
rank holds 1/N of them and gathers a unit's parameters only while that unit runs, so a model
N times larger fits. Checkpoints of an FSDP run are sharded too (`checkpointing/sharded.py`).

The units FSDP gathers one at a time follow one convention, the only thing asked of model.py:

- a model with an attribute `blocks` that is an `nn.ModuleList` (a transformer's layers) gets
  `fully_shard` on each block, then on the root (which gathers what is left: embeddings, the
  final norm, the head);
- any other model gets `fully_shard` on each direct child module that has parameters, then on
  the root.

Without torchrun (one process) there is nothing to spread: `wrap` returns the model as it is,
apart from activation checkpointing, which saves memory on one device just the same.
"""

from __future__ import annotations

import contextlib
import sys
from collections import OrderedDict
from collections.abc import Iterator
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from .. import utils

KINDS = ("ddp", "fsdp")


def wrap(
    model: nn.Module,
    kind: str,
    *,
    device: torch.device,
    precision: str = "fp32",
    activation_checkpointing: bool = False,
) -> nn.Module:
    """`model` ready to train on every rank: DDP around it, or FSDP2 applied to it in place.

    `model` may be the `torch.compile` wrapper: FSDP2 shards the module inside it (compilation
    is lazy, so the first call traces the sharded module), and DDP wraps the compiled module,
    as before. Build the optimizer after this call: FSDP2 replaces each parameter by its shard
    (a DTensor), and an optimizer built earlier would hold the old, full tensors.
    """
    if kind not in KINDS:
        raise ValueError(f"--parallel {kind}: choose one of {', '.join(KINDS)}")
    inner = utils.unwrap_model(model)
    if activation_checkpointing:
        for unit in units(inner):
            checkpoint_activations(unit)
    if not (dist.is_available() and dist.is_initialized()):
        return model
    if kind == "ddp":
        return DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    shard(inner, device, precision)
    return model


def units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards (and activation checkpointing wraps) one at a time."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    return [child for child in model.children() if any(True for _ in child.parameters())]


def shard(model: nn.Module, device: torch.device, precision: str = "fp32") -> None:
    """FSDP2 in place: each unit, then the root; bf16 compute and fp32 reduction for bf16.

    With `--precision bf16` FSDP casts each unit's parameters to bfloat16 as it gathers them
    (half the traffic of fp32) while the shards, the optimizer and the checkpoints stay in
    fp32, and gradients are reduced in fp32, so a sum over many ranks loses no precision.
    fp16 keeps fp32 parameters under autocast, as in a single process (its GradScaler needs
    fp32 gradients). BatchNorm layers keep fp32 parameters in every case: their running
    statistics are fp32, and batch_norm refuses bf16 weights with fp32 statistics (FSDP1
    left BatchNorm out of mixed precision for the same reason).
    """
    # Imported here: torch.distributed.fsdp takes seconds to import (see _fsdp_module).
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # The mesh names the device explicitly: the default would pick CUDA whenever a GPU is
    # visible, also for a `--device cpu` run on gloo.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    if precision == "bf16":
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                fully_shard(module, mesh=mesh)  # its own unit, fp32 parameters
    own = list(model._forward_pre_hooks)  # the model's own, added when it was built
    for unit in units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # FSDP puts its pre-forward hook (which casts the inputs to bf16) first; the model's own
    # keep running before it, on the batch as loaded, as they do without FSDP.
    hooks = cast(OrderedDict[int, Any], model._forward_pre_hooks)
    for key in reversed(own):
        hooks.move_to_end(key, last=False)


def _fsdp_module() -> Any:
    """FSDP2's module class, or None when torch.distributed.fsdp was never imported: then
    nothing is sharded. Only `shard` imports it: the import took 2.6 of the 3 s every entry
    point (train, evaluate, predict, ...) spent importing this package."""
    return getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)


def is_sharded(model: nn.Module) -> bool:
    """True when FSDP2 sharded the parameters of `model` (or of the module it wraps)."""
    fsdp_module = _fsdp_module()
    return fsdp_module is not None and isinstance(utils.unwrap_model(model), fsdp_module)


def checkpoint_activations(module: nn.Module) -> None:
    """Recompute `module`'s activations during backward instead of keeping them.

    Memory for activations drops to the inputs of each unit, for about one more forward pass
    of compute. Only `forward` is replaced (by `torch.utils.checkpoint.checkpoint` around the
    original), so the module tree, the parameter names and the state dict stay as they were:
    checkpoints of runs with and without it are interchangeable.
    """
    module.forward = partial(checkpoint, module.forward, use_reentrant=False)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip the gradient reduction of the backward passes inside (all but the last micro-batch
    of a step) under DDP (`no_sync`). Not under FSDP2: there `set_requires_gradient_sync(False)`
    keeps every unit's full, unsharded gradient on every rank until the last micro-batch (DDP's
    gradient memory, where accumulation is meant to save memory); each micro-batch's gradients
    are reduce-scattered and accumulate in the sharded `.grad` instead, one reduce-scatter per
    micro-batch (the same sum: the reduction is linear)."""
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """FSDP2: every unit's full parameters on every rank for the duration (evaluation).

    A sharded forward all-gathers each unit, a collective, so every rank would have to run
    the same number of forwards; evaluation shards are uneven (each sample is seen once).
    Gathered once up front, the forwards need no communication and each rank evaluates its
    own share. Costs the memory of the full model, as DDP always does. No-op otherwise.
    """
    inner: Any = utils.unwrap_model(model)
    if not is_sharded(inner):
        yield
        return
    modules: list[Any] = [m for m in inner.modules() if isinstance(m, _fsdp_module())]
    inner.set_reshard_after_forward(False)  # recursive: forwards keep the gathered weights
    for module in modules:
        module.unshard()  # the same modules in the same order on every rank
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
            # Back to the defaults of `fully_shard`: units free their gathered weights after
            # the forward, the root (run first in backward) keeps them.
            module.set_reshard_after_forward(module is not inner, recurse=False)
