"""The checkpointer: the one object `train()` asks about checkpoints, from the resume to the
last write (as torchtitan's `CheckpointManager` is its trainer's: `load()`, then a save call
every step that decides for itself whether to write).

`train()` makes one per run, right after building it, and then calls
`load()` once, `step(...)` after every optimizer step, `after_validation()` after each
validation, `finish()` at the end, and leaves its `with` (also on an error). What it owns:

- **Resume** (`load`): `--resume PATH`, or for `--resume auto` the newest complete
  checkpoint of the run dir (checkpointing/resume.py: a partial newest one is skipped);
  every part of checkpointing/state.py comes back, and metrics.jsonl loses the records of
  the steps that will be redone.
- **When to save** (`step`): `--save-every N` (optimizer steps) or `--save-every-minutes M`
  (under torchrun the ranks' agreed "time is up": `loop._agree` asks `late` and hands the
  verdict to `agree_late`), never on a validation's step: the validation saves
  (`loop.end_interval` calls `save`, best.pt with it when the validation improved). A kill -9
  then costs at most N steps (M minutes).
- **How** (`save`): every rank checks the weights first (nothing non-finite is saved) and
  learns every verdict, so a refusal or a failed write stops all ranks together. The file
  (an FSDP run's sharded folder) is written now or, with `--save-in-background`, from CPU
  copies on a thread (checkpointing/steps.py): at most one save is in flight; a write that
  failed raises its `SaveError` at the next save, a stop or the end (exit 74, the previous
  checkpoint kept), on every rank. `--keep-last K` keeps the K newest.
- **Stop signals** (`signals`, a runtime/stopping.StopSignal that `train()` enters once the
  run has started): the step every rank agreed to stop at (in one process: the step the
  signal arrived in) saves, waits for its write and raises `Interrupted` (exit 128+N); a
  signal during a save or a validation stops on that checkpoint, with no step more.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import slots, utils
from ..runtime import console, distributed, exits
from ..runtime.stopping import Interrupted, StopSignal
from ..training import schedules
from ..training.loop import check_health
from . import checkpoint, rundir, steps
from . import resume as resume_choice
from . import sharded as sharded_checkpoint
from . import state as checkpoint_state
from .checkpoint import SaveError

if TYPE_CHECKING:
    from ..training.run import Run

__all__ = ["Checkpointer"]


class Checkpointer:
    """Resume, saves and the stop path of one run (the module's docstring says when)."""

    def __init__(self, run: Run) -> None:
        config = run.config.run
        self.run = run
        self.every, self.minutes, self.keep = (
            config.save_every, config.save_every_minutes, config.keep_last,
        )  # fmt: skip
        # With --save-in-background: rank 0 of a single-file run, every rank of an FSDP run.
        background = config.save_in_background and (run.sharded or run.ctx.is_main)
        self.writer = steps.BackgroundWriter() if background else None
        self.staging = steps.Staging()  # the CPU buffers of background saves, kept
        self.dcp: Any = None  # an FSDP run's sharded_checkpoint.AsyncWrites, made on first use
        self.signals = StopSignal()
        # --save-every-minutes: the clock, the ranks' agreed "time is up" under torchrun and
        # the number of saves so far, which tells a verdict asked before the latest save.
        self.last_save = time.monotonic()
        self.agreed_late = False
        self.saves = 0
        run.checkpointer = self

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def load(self) -> bool:
        """Continue from --resume's checkpoint, if any: every part checkpointing/state.py
        lists (weights, optimizer, schedule, scaler, RNG, where the run stood, each
        `@slots.state`). Returns whether it resumed."""
        run, config = self.run, self.run.config
        run_dir = Path(config.run.run_dir)
        resume_path = resume_choice.resolve_resume(config.run.resume, run_dir)
        if config.run.resume == "auto" and resume_path is None:
            run.log(f"--resume auto: no checkpoint in {run.last_path.parent}, starting fresh")
            if run.ctx.is_main:  # a run killed before its first save: its steps are redone
                rundir.trim_metrics(run_dir / "metrics.jsonl", 0)
        if resume_path is None:
            return False
        budgeted = _budgeted(config)  # its position is its step: bounded by its own budget
        state = checkpoint.load_checkpoint(
            sharded_checkpoint.state_file(resume_path),
            run.device,
            None if budgeted else run.sampler.total_size,
        )
        checkpoint.check_compatible(state, config.flat(), resume_path)
        run.task.check_resume(state, config, resume_path, run.log)  # the LM's corpus
        checkpoint_state.restore(run, state, resume_path)  # every part of checkpointing/state.py
        _validated_before(run, state)  # a checkpoint from before runs recorded it
        if budgeted:
            _place_in_budget(run)
        else:
            _fit_schedule(run)
        if run.ctx.is_main:  # steps after the checkpoint will be redone: not recorded twice
            rundir.trim_metrics(run_dir / "metrics.jsonl", run.global_step)
        # The epoch of the next step; at the budget's end, of the run's last step (not one
        # past --epochs)
        step = run.global_step + (run.global_step < run.total_steps)
        epoch = run.epoch_of(max(step, 1))
        run.log(f"resumed from {resume_path}: epoch {epoch}, step {run.global_step}")
        slots.run_callbacks("after_resume", run)
        return True

    def step(self, stop_now: bool, log: Callable[[], None]) -> None:
        """After every optimizer step: save when --save-every or --save-every-minutes asks, or
        when the ranks agreed to stop (`stop_now`, from loop.train_step). `log` writes the
        train record of the steps not yet recorded, called first: the saved totals include
        them. A stop raises Interrupted once its checkpoint is written (a stop in the step
        before a validation too: the resumed run validates first), and so does a signal
        that arrived during this save."""
        run = self.run
        # A signal that arrived during this step stops right here in a single process; under
        # DDP the ranks stop where the agreed flag told all of them to (the step after it was
        # raised: loop._agree).
        stop_now = stop_now or (self.signals.signum is not None and not run.ctx.enabled)
        save_now = self.due()  # --save-every, --save-every-minutes
        if not (stop_now or save_now):
            return
        if run.meter.steps:  # none when this step's own record was just written
            log()
        # The epoch this step trained in and its steps done: an epoch's last step stands at
        # the epoch's end, not the next one's start (an old checkpoint's form, kept)
        epoch, index = run.position(run.global_step - 1)
        done = (index + 1) * run.samples_per_step
        self.save(epoch, done, run.epoch_totals, improved=False, val_loss=0.0)
        # A signal during a step checkpoint's save stops on it: no step, no save more.
        if stop_now or self.stopping():
            self.finish()  # written before the line says it is
            raise self._interrupted()

    def after_validation(self) -> None:
        """After a validation (its checkpoint, train()'s on_epoch): a signal that arrived
        meanwhile stops on that checkpoint (Interrupted, once it is written), unless it was
        the run's last, which `finish` ends."""
        if self.run.global_step < self.run.total_steps and self.stopping():
            raise self._interrupted()

    def due(self) -> bool:
        """Whether --save-every (or --save-every-minutes) asks for a save after this step; the
        same answer on every rank. Never on a validation's step: the validation saves."""
        run = self.run
        if run.validates_at(run.global_step):
            return False
        if self.every is not None:
            return bool(run.global_step % self.every == 0)
        if self.minutes is None:
            return False
        # Clocks differ, so under torchrun rank 0's verdict is not enough: the step agreed on it.
        return self.agreed_late if run.ctx.enabled else self.late()

    def late(self) -> bool:
        """Whether --save-every-minutes' time is up on this rank's clock (False without it)."""
        return self.minutes is not None and time.monotonic() - self.last_save >= 60 * self.minutes

    def agree_late(self, verdict: bool, asked_after: int) -> None:
        """Keep the ranks' agreed `late` verdict for `due`. It was asked a step ago, after
        `asked_after` saves: a save since then restarted the clock, and the verdict is stale."""
        self.agreed_late = verdict and asked_after == self.saves

    def save(
        self, epoch: int, samples: int, totals: dict[str, float], *, improved: bool, val_loss: float
    ) -> None:
        """Write where the run stands (in `epoch`, `samples` of it done per rank, its metric
        `totals`): last.pt, or with --keep-last > 1 step-<step>.pt that last.pt names, and
        best.pt if `improved`; never a non-finite model.

        Every rank checks its weights and buffers and every rank learns the verdicts, so a
        refusal or a failed write stops all ranks together.
        """
        run = self.run
        device, last_path, best_path = run.device, run.last_path, run.best_path
        check_health(run)  # a skipped non-finite step is never saved over
        slots.run_callbacks("before_save", run)
        bad = checkpoint.first_nonfinite(run.raw_model)
        if bad is None and not math.isfinite(val_loss):
            bad = f"validation loss ({val_loss})"
        if distributed.any_rank(bad is not None, device):
            kept = exits.kept(last_path, best_path)
            raise utils.NonFiniteLossError(
                f"non-finite {bad or 'weights on another rank'} at step {run.global_step}, "
                f"epoch {epoch + (samples > 0)}: not saved; {kept}; "
                "lower --lr, set --grad-clip, or check the data",
                step=run.global_step,
            )
        failure = None
        ranks = checkpoint_state.gather_rank_states(run)  # every rank's per-rank @slots.state
        at = checkpoint_state.Position(epoch, samples, totals, ranks)
        if run.sharded:  # every rank writes its shards; a failure raises on every rank
            self._save_sharded(checkpoint_state.snapshot(run, at), improved)
        elif run.ctx.is_main:
            try:
                self._save_file(checkpoint_state.snapshot(run, at), improved)
            except SaveError as error:
                failure = error
        # On every rank, the ranks that write nothing too: --save-every-minutes' clock starts
        # again, and verdicts asked before this save are stale.
        self.last_save = time.monotonic()
        self.saves += 1
        if distributed.any_rank(failure is not None, device):
            raise failure or SaveError("rank 0 could not write the checkpoint; see its message")

    def _target(self) -> Path:
        """Where a save writes: last.pt, or with --keep-last > 1 step-<step>.pt (or .dcp)."""
        last = Path(self.run.last_path)
        if self.keep == 1:
            return last
        return last.with_name(f"step-{self.run.global_step}{last.suffix}")

    def _save_file(self, state: dict[str, Any], improved: bool) -> None:
        """Rank 0 of a single-file run: write `state` (best.pt too if `improved`), now or on
        the writer's thread from a CPU copy. A previous background write that failed raises
        here."""
        if self.writer is not None:
            failure = self.writer.wait()
            if failure is not None:
                raise failure
        path, last = self._target(), self.run.last_path
        best, keep = self.run.best_path if improved else None, self.keep
        if self.writer is None:
            steps.write_file(state, path, last, best, keep)
            return
        copied = self.staging.stage(state)  # on this thread: the next step changes the originals
        self.writer.submit(lambda: steps.write_file(copied, path, last, best, keep))

    def _save_sharded(self, state: dict[str, Any], improved: bool) -> None:
        """Every rank of an FSDP run: write the shards (checkpointing/sharded.py), then on rank
        0 point last.dcp at them and rotate; a failure anywhere raises SaveError on every rank.
        With a writer, the shards are staged here and written by DCP's `async_save`, and rank
        0 finishes the folder on the writer's thread; a previous write that failed raises
        here."""
        run, path, keep = self.run, self._target(), self.keep
        last, best = run.last_path, run.best_path if improved else None
        if self.writer is not None:
            self.finish()  # at most one save in flight; its failure stops every rank here
            if self.dcp is None:
                self.dcp = sharded_checkpoint.AsyncWrites(run.ctx.enabled, run.device)
            staged = self.staging.stage(state) if run.ctx.is_main else {}
            write = sharded_checkpoint.write_async(
                staged, path, run.raw_model, run.optimizer, self.dcp, is_main=run.ctx.is_main,
                device=run.device,
            )  # fmt: skip
            main = run.ctx.is_main

            def job() -> None:
                write()
                if main:
                    steps.finish_folder(path, last, best, keep)

            self.writer.submit(job)
            return
        sharded_checkpoint.save(
            state, path, run.raw_model, run.optimizer, best, run.ctx, run.device
        )
        if path == last:
            return

        def point_last_at_it() -> None:
            if run.ctx.is_main:
                steps.link_folder(path, last)
                steps.rotate(path.parent, keep, path)

        sharded_checkpoint._together(point_last_at_it, last, run.device)

    def finish(self) -> None:
        """Wait for the save in flight; if it failed, raise its SaveError on every rank."""
        failure = self.writer.wait() if self.writer is not None else None
        if distributed.any_rank(failure is not None, self.run.device):
            raise failure or SaveError(
                "another rank could not write the checkpoint; see its message"
            )

    def wait_for_write(self) -> None:
        """Wait for the write in flight, if any (a blow-up's message then names what is on
        disk); a failure stays for the next save, `finish` or `close`."""
        if self.writer is not None:
            self.writer.join()

    def stopping(self) -> bool:
        """Whether a stop signal arrived (on any rank) while the run saved: it stops now, on
        the checkpoint just written (no extra step, no second save), once the write is done."""
        if not distributed.any_rank(self.signals.signum is not None, self.run.device):
            return False
        self.finish()
        return True

    def _interrupted(self) -> Interrupted:
        run = self.run
        last = run.last_path if run.ctx.is_main else None
        return Interrupted(self.signals.signum or signal.SIGTERM, run.global_step, last)

    def close(self) -> None:
        """At the run's end, also on an error: the ranks' agreement in flight (every rank
        started it) and the write in flight are waited for, never cut off; a write that
        failed is reported in one line."""
        if self.run.agreement is not None:
            self.run.agreement.finish()
        if self.writer is not None:
            failure = self.writer.wait()
            if failure is not None:
                console.safe_print(f"error: {failure}", file=sys.stderr)


# ---- where a resumed run continues, when its budget changed -----------------------------


def _budgeted(config: Any) -> bool:
    """Whether the run's length is a step budget (the LM's --max-steps or --max-tokens)."""
    optim = config.optim  # getattr: an image project's settings have neither
    return bool(getattr(optim, "max_steps", None) or getattr(optim, "max_tokens", None))


def _validated_before(run: Run, state: dict[str, Any]) -> None:
    """The step of the checkpoint's last validation. One saved before checkpoints kept it
    stands at an epoch's start (validated there) or inside it (not since its start), but a
    stop in an epoch's last step saved the whole epoch done and not validated: the resumed
    run validates first, as it did then."""
    if "validated_step" not in state:
        run.validated_step = run.global_step if run.skip_samples == 0 else 0


def _place_in_budget(run: Run) -> None:
    """Under a step budget the run's step says where it stands, whatever the checkpoint's
    epoch says (a budget changed on resume, another --batch-size: the epochs moved); the data
    continues in the epoch of that step. A run at or past the budget trains nothing."""
    if run.global_step >= run.total_steps:
        run.log(f"nothing left to train: the checkpoint is at step {run.global_step}, "
                f"this run's budget is {run.total_steps} steps")  # fmt: skip
        run.total_steps = run.global_step
        return
    at = run.epoch * run.steps_per_epoch + run.skip_samples // run.samples_per_step
    if at != run.global_step:
        run.log(f"the epochs changed ({run.steps_per_epoch} steps each now): "
                f"continuing at step {run.global_step} of {run.total_steps}")  # fmt: skip


def _fit_schedule(run: Run) -> None:
    """A --batch-size, --grad-accum-steps or --max-steps-per-epoch changed on resume changes
    the steps of an epoch. Under --epochs the data continues where the checkpoint stood (its
    epoch, its samples done), so epoch 0 now began at `run.origin`, and the run ends with
    this run's --epochs: the schedule, which would end at --epochs x the new steps per epoch
    (before the checkpoint's step: cosine at zero for every epoch left, or long after the
    run), is fitted to end with this run's last step."""
    at = run.epoch * run.steps_per_epoch + run.skip_samples // run.samples_per_step
    if at == run.global_step:
        return
    total = run.global_step + max(0, run.total_steps - at)
    run.origin, run.total_steps = run.global_step - at, total
    run.log(f"the steps per epoch changed since the checkpoint: the learning-rate schedule "
            f"now ends at step {total}")  # fmt: skip
    factor = slots.load().schedules[run.config.optim.lr_schedule]
    scheduled = partial(schedules.scheduled, factor=factor, total=total, config=run.config)
    scheduler = run.scheduler
    scheduler.lr_lambdas = [scheduled] * len(run.optimizer.param_groups)
    for group, peak in zip(run.optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = peak * scheduled(scheduler.last_epoch)
