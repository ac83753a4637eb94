"""The learning-rate schedules `--lr-schedule` chooses, registered in the extension slots.

Each is `factor(step, total_steps, config)`: the learning rate at optimizer step `step` is
`--lr` times the factor. All start with `--warmup-steps` of linear warmup: train.py applies it
to every schedule, yours too, and these return the same ramp. A schedule of yours is
registered the same way in extensions.py (`@slots.schedule("name")`, slots.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .. import slots


def warmup(step: int, config: Any) -> float | None:
    """The warmup factor while `step` is in `--warmup-steps`, else None."""
    steps = config.optim.warmup_steps
    return (step + 1) / (steps + 1) if step < steps else None


def scheduled(step: int, *, factor: Callable[..., float], total: int, config: Any) -> float:
    """--warmup-steps' linear ramp, then the schedule's `factor` for a run of `total` steps: the
    warm-up holds for every schedule, a registered one too (one that ramps up itself gets the
    same values). The LambdaLR of train.build_scheduler, and of a resume that refits it."""
    early = warmup(step, config)
    return early if early is not None else float(factor(step, total, config))


def _progress(step: int, total: int, config: Any) -> float:
    """How far past the warmup `step` is, from 0 to 1 at `total`."""
    steps = config.optim.warmup_steps
    return min(1.0, (step - steps) / max(1, total - steps))


@slots.schedule("cosine")
def cosine(step: int, total: int, config: Any) -> float:
    """Cosine decay to zero at the last step (the default)."""
    early = warmup(step, config)
    if early is not None:
        return early
    return 0.5 * (1.0 + math.cos(math.pi * _progress(step, total, config)))


@slots.schedule("constant")
def constant(step: int, total: int, config: Any) -> float:
    """The peak rate after warmup, to the end."""
    early = warmup(step, config)
    return 1.0 if early is None else early


@slots.schedule("step")
def step_decay(step: int, total: int, config: Any) -> float:
    """`--step-gamma` times lower at half and again at three quarters of the run."""
    early = warmup(step, config)
    if early is not None:
        return early
    progress = _progress(step, total, config)
    return float(config.optim.step_gamma ** ((progress >= 0.5) + (progress >= 0.75)))


@slots.schedule("wsd")
def warmup_stable_decay(step: int, total: int, config: Any) -> float:
    """Warmup, the peak rate, then linear decay to zero over the last `--decay-fraction` of
    the steps (warmup-stable-decay: a run can be extended from before its decay)."""
    early = warmup(step, config)
    if early is not None:
        return early
    left = 1.0 - _progress(step, total, config)  # 1 after warmup, 0 at the end
    fraction = config.optim.decay_fraction
    return min(1.0, left / fraction) if fraction > 0 else 1.0
