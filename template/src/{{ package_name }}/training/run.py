"""`Run`: one training run, the record every part of the loop takes.

It sits at the bottom of the package: at run time it imports only torch and the sharded
checkpoints' suffix, so every module that takes a run (the loop, checkpointing, the EMA, the
slots' callbacks) can name its type without an import cycle. The types of its parts are
imported for the type checker only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..checkpointing import sharded as sharded_checkpoint

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from .. import slots
    from ..checkpointing.checkpointer import Checkpointer
    from ..config import Config
    from ..observability.mfu import Utilization
    from ..runtime import distributed
    from .data_sources import DataInfo, ResumableSampler
    from .loop import Guard
    from .metrics import Meter
    from .task import Task

__all__ = ["Run"]


@dataclass
class Run:
    """One training run: the parts `train.build_run` makes, then where the run stands.

    The fields after `log` are what a checkpoint saves and a resume restores; the loop's
    functions advance them. One plain record rather than a Trainer class: every part of the
    loop is a function of it that a reader (or a test) can take alone.
    """

    config: Config
    ctx: distributed.Context
    task: Task
    raw_model: nn.Module  # unwrapped: what is saved, evaluated and clipped
    model: nn.Module  # what the step runs: compiled, and under torchrun DDP- or FSDP-wrapped
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    sampler: ResumableSampler
    train_loader: DataLoader[Any]
    val_loader: DataLoader[Any]
    meter: Meter
    utilization: Utilization
    steps_per_epoch: int  # the epoch: where the sampler reshuffles, nothing more
    total_steps: int  # the budget: --epochs x steps_per_epoch, or --max-steps (--max-tokens)
    header: str  # the one line that describes the run when it starts
    record: dict[str, Any]  # metrics.run_record: the run's first metrics line, in checkpoints
    log: Callable[[str], None]  # console.log on rank 0, silent elsewhere
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # task.training_loss(config)
    # (a @slots.training_loss takes the steps' place of it: training/batches.py's loss_of)
    info: DataInfo | None = None  # the data's shapes: --batch-transform's soft targets' width
    # The step's micro-batches (inputs, targets) on the device, after --batch-transform: what
    # an after_step callback sees of the batch (empty outside it, so no batch outlives its step)
    batches: list[tuple[Any, Any]] = field(default_factory=list)
    eval_every: int = 1  # validate (and save best.pt, last.pt) every N steps: --eval-every
    # Where the run stands: saved in every checkpoint (checkpointing/state.py), restored on
    # resume, with the `@slots.state` objects (the EMA, yours) by name.
    epoch: int = 0  # the checkpoint's epoch and samples done in it (per rank), as restored
    skip_samples: int = 0
    global_step: int = 0  # optimizer steps done: the loop's one counter
    validated_step: int = 0  # the step of the last validation (0: none yet)
    # The step at which epoch 0 began: 0, unless a resume under --epochs changed the steps
    # of an epoch (checkpointer._fit_schedule: the data continues where it stood)
    origin: int = 0
    best: float | None = None  # the best validation figure of task.best_by so far
    # The train metrics' totals since the last validation (the key keeps its old name)
    epoch_totals: dict[str, float] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)  # the last validation's metrics
    states: dict[str, slots.Stateful] = field(default_factory=dict)
    # Its saves (when, where, in the background), resume and stop path: made by train()
    checkpointer: Checkpointer | None = None
    guard: Guard | None = None  # the non-finite guard's device-side record
    # The stop request and --save-every-minutes' time, agreed by the ranks (loop.train_step)
    agreement: distributed.HostAgreement | None = None

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def sharded(self) -> bool:
        """An FSDP run writes sharded checkpoint folders (checkpointing/sharded.py), others
        files."""
        return self.config.speed.parallel == "fsdp"

    @property
    def last_path(self) -> Path:
        return self._checkpoint("last")

    @property
    def best_path(self) -> Path:
        return self._checkpoint("best")

    def _checkpoint(self, name: str) -> Path:
        suffix = sharded_checkpoint.SUFFIX if self.sharded else ".pt"
        return Path(self.config.run.run_dir) / "checkpoints" / f"{name}{suffix}"

    def position(self, step: int) -> tuple[int, int]:
        """Where the data stands after `step` optimizer steps: (epoch, steps done in it)."""
        epoch, index = divmod(step - self.origin, self.steps_per_epoch)
        return epoch, index

    def epoch_of(self, step: int) -> int:
        """The epoch (from 1) that optimizer step `step` (from 1) trained in."""
        return self.position(step - 1)[0] + 1

    def validates_at(self, step: int) -> bool:
        """Whether a validation follows optimizer step `step` (from 1): every --eval-every
        steps (counted where the epochs are), and at the budget's end."""
        if step <= 0:
            return False
        return (step - self.origin) % self.eval_every == 0 or step >= self.total_steps

    @property
    def samples_per_step(self) -> int:
        return self.config.optim.grad_accum_steps * self.config.optim.batch_size  # per rank
