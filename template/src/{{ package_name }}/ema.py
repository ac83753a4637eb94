"""An exponential moving average of the weights (`--ema-decay`), built on the extension slots.

The template's own EMA uses only what a user's would (slots.py): a `state` slot, so the
average rides in every checkpoint and a resumed run continues it exactly; an `after_step`
callback that updates it; and a `validation_model` slot, so validation, best.pt's choice and
the checkpoints' `val_*` numbers are the averaged model's. It is PyTorch's own
`torch.optim.swa_utils.AveragedModel` with `get_ema_multi_avg_fn` (one fused lerp per dtype
and device); buffers (batch-norm statistics) are averaged too. Off (0) by default.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from . import slots


def _decay(run: Any) -> float:
    return float(getattr(run.config.optim, "ema_decay", 0.0))  # a config.py from before it


@slots.state("ema")
def make_ema(run: Any) -> AveragedModel | None:
    """The averaged copy of the unwrapped model, on its device (None without --ema-decay)."""
    decay = _decay(run)
    if not decay:
        return None
    return AveragedModel(run.raw_model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)


@slots.callback("after_step")
def update_ema(run: Any) -> None:
    ema = run.states.get("ema")
    if ema is not None:
        ema.update_parameters(run.raw_model)


@slots.validation_model
def ema_model(run: Any) -> nn.Module | None:
    ema = run.states.get("ema")
    return None if ema is None else ema.module
