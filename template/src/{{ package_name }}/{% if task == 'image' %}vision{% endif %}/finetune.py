"""`--init-from CHECKPOINT` and `--freeze`: start a new run from another run's weights.

Only the weights come over: the optimizer, schedule, step counters and run dir are this
run's own (to continue the same run, use `--resume`). The classifier head is the model's last
`nn.Linear`; when the class count differs (fine-tuning on other classes), its weights are
left freshly initialised and the log names them. Any other difference (another architecture,
width or channel count) is an incompatible checkpoint: one line, exit 2. `--freeze` trains the
head only: every other parameter gets `requires_grad=False` (BatchNorm statistics still
follow the new data; use `model.eval()` on those layers in model.py to pin them too).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpointing.checkpoint import CheckpointError, load_checkpoint


def head_prefix(model: nn.Module) -> str:
    """The name of the model's last nn.Linear (its classifier head), e.g. "classifier"."""
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not names:
        raise CheckpointError("--init-from/--freeze: the model has no nn.Linear classifier head")
    return names[-1]


def init_from(model: nn.Module, config: object, log: Callable[[str], None]) -> None:
    """Apply `--init-from` and `--freeze` of `config` to a freshly built `model` (in place)."""
    run = getattr(config, "run", None)
    source = getattr(run, "init_from", None)
    if source is not None:
        load_weights(model, Path(source), log)
    if getattr(run, "freeze", False):  # --init-from's, or --model hf's pretrained weights
        frozen = freeze_all_but_head(model)
        log(f"--freeze: {frozen} parameter tensors frozen, training {head_prefix(model)} only")


def load_weights(model: nn.Module, path: Path, log: Callable[[str], None]) -> list[str]:
    """Copy the weights of checkpoint `path` into `model`; returns the names not loaded (the
    head's, when its class count differs). Anything else that does not fit: CheckpointError."""
    if path.is_dir():
        raise CheckpointError(
            f"--init-from {path} is a sharded checkpoint folder; convert it to one file with "
            "python -m <package>.checkpointing.convert first"
        )
    state = load_checkpoint(path, flag="--init-from")["model"]
    own = model.state_dict()
    head = head_prefix(model) + "."
    # In the model's order (the checkpoint's for names only it has): the first one named is
    # the layer nearest the input, where the user looks first.
    missing = [name for name in own if name not in state]
    unexpected = [name for name in state if name not in own]
    wrong = [
        name
        for name in own
        if name in state
        and (not isinstance(state[name], torch.Tensor) or state[name].shape != own[name].shape)
    ]
    skipped = [name for name in wrong if name.startswith(head)]
    problem = missing or unexpected or [name for name in wrong if not name.startswith(head)]
    if problem:
        name = problem[0]
        what = (
            "is missing from the checkpoint"
            if name in missing
            else "is not in this model"
            if name in unexpected
            else f"has shape {tuple(state[name].shape)} there, {tuple(own[name].shape)} here"
        )
        raise CheckpointError(
            f"--init-from {path}: incompatible architecture: {name} {what} "
            f"({len(problem)} such); use the same --model and --width as that run"
        )
    with torch.no_grad():
        for name, value in own.items():
            if name not in skipped:
                value.copy_(state[name])
    loaded = len(own) - len(skipped)
    log(f"--init-from {path}: loaded {loaded} of {len(own)} tensors")
    if skipped:
        there, here = state[skipped[0]].shape[0], own[skipped[0]].shape[0]
        log(
            f"--init-from: the head has {there} classes there, {here} here; not loaded "
            f"(re-initialised): {', '.join(skipped)}"
        )
    return skipped


def freeze_all_but_head(model: nn.Module) -> int:
    """`requires_grad=False` for every parameter outside the head; returns how many."""
    head = head_prefix(model) + "."
    frozen = 0
    for name, param in model.named_parameters():
        if not name.startswith(head):
            param.requires_grad_(False)
            frozen += 1
    return frozen


def backbone_groups(
    model: nn.Module, groups: list[dict[str, Any]], backbone_lr: float
) -> list[dict[str, Any]]:
    """`groups` (slots.param_groups') each split in two: the head's parameters as they are,
    the rest at `backbone_lr` (`--backbone-lr-factor`); empty groups dropped."""
    prefix = head_prefix(model) + "."
    head = {id(p) for name, p in model.named_parameters() if name.startswith(prefix)}
    split = []
    for group in groups:
        params = group["params"]
        split.append({**group, "params": [p for p in params if id(p) in head]})
        rest = [p for p in params if id(p) not in head]
        split.append({**group, "params": rest, "lr": backbone_lr})
    return [group for group in split if group["params"]]
