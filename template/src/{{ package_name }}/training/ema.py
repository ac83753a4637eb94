"""An exponential moving average of the weights (`--ema-decay`), built on the extension slots.

The template's own EMA uses only what a user's would (slots.py): a `state` slot, so the
average rides in every checkpoint and a resumed run continues it exactly; an `after_step`
callback that updates it; and a `validation_model` slot, so validation, best.pt's choice and
the checkpoints' `val_*` numbers are the averaged model's. Buffers (batch-norm statistics)
are averaged too. Off (0) by default.

`EMA` computes what `torch.optim.swa_utils.AveragedModel` with `get_ema_multi_avg_fn` and
`use_buffers=True` does (the first update copies, each later one is one fused lerp per dtype
and device), and saves the same state (`module.*` and `n_averaged`), so checkpoints from
before it load and continue bitwise. It differs in one thing: AveragedModel keeps its count in
a tensor and reads or copies it to the device at every update (on CUDA, a blocking host sync
per step, two with BatchNorm's integer buffer); here the count that decides is a Python int.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import slots

if TYPE_CHECKING:
    from .run import Run


class EMA(nn.Module):
    """An averaged copy of `model` (on its device) that `update_parameters` moves towards
    the model by `1 - decay`. The first update copies the model. With `use_buffers` the
    buffers are averaged as the parameters are (integer ones rounded down, as AveragedModel
    does), without they are copied."""

    n_averaged: torch.Tensor

    def __init__(self, model: nn.Module, decay: float, use_buffers: bool = True):
        super().__init__()
        self.module = copy.deepcopy(model)
        self.decay = decay
        self.use_buffers = use_buffers
        # Saved as AveragedModel saves it; on the CPU, so updating it never waits for a GPU.
        self.register_buffer("n_averaged", torch.tensor(0, dtype=torch.long))
        self.updates = 0  # what decides: a host number, read without asking the device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        result = super().load_state_dict(state_dict, strict, assign)
        self.updates = int(self.n_averaged)  # once, on resume
        return result

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """Move the average towards `model`'s parameters (and buffers): no host sync."""
        averaged: list[torch.Tensor] = [*self.module.parameters()]
        current: list[torch.Tensor] = [*model.parameters()]
        if self.use_buffers:
            averaged += self.module.buffers()
            current += model.buffers()
        else:
            for mine, theirs in zip(self.module.buffers(), model.buffers(), strict=True):
                mine.copy_(theirs.detach())
        if len(averaged) != len(current):
            raise ValueError("the EMA's model and the trained model differ in their tensors")
        if self.updates == 0:
            for mine, theirs in zip(averaged, current, strict=True):
                mine.detach().copy_(theirs.detach())
        else:
            _lerp(averaged, current, self.decay)
        self.updates += 1
        self.n_averaged += 1  # a CPU tensor: no device involved


def _lerp(averaged: list[torch.Tensor], current: list[torch.Tensor], decay: float) -> None:
    """`averaged = decay * averaged + (1 - decay) * current`, one fused lerp per device and
    dtype for floating tensors; integer ones (BatchNorm's count) as AveragedModel does them."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
    for mine, theirs in zip(averaged, current, strict=True):
        group = groups.setdefault((mine.device, mine.dtype), ([], []))
        group[0].append(mine.detach())
        group[1].append(theirs.detach().to(mine.device))
    for mine_list, theirs_list in groups.values():
        if mine_list[0].is_floating_point() or mine_list[0].is_complex():
            torch._foreach_lerp_(mine_list, theirs_list, 1 - decay)
        else:
            for mine, theirs in zip(mine_list, theirs_list, strict=True):
                mine.copy_(mine * decay + theirs * (1 - decay))


def _decay(run: Run) -> float:
    return float(getattr(run.config.optim, "ema_decay", 0.0))  # a config.py from before it


@slots.state("ema")
def make_ema(run: Run) -> EMA | None:
    """The averaged copy of the unwrapped model, on its device (None without --ema-decay)."""
    decay = _decay(run)
    if not decay:
        return None
    return EMA(run.raw_model, decay, use_buffers=True)


@slots.callback("after_step")
def update_ema(run: Run) -> None:
    ema = run.states.get("ema")
    if isinstance(ema, EMA):
        ema.update_parameters(run.raw_model)


@slots.validation_model
def ema_model(run: Run) -> nn.Module | None:
    ema = run.states.get("ema")
    return ema.module if isinstance(ema, EMA) else None
