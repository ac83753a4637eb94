"""Step checkpoints: saves between epochs' ends, kept K deep, written in the background.

A `kill -9`, the kernel's OOM killer or a lost node is no signal: without these, everything
since the last epoch's end is lost. `--save-every N` (optimizer steps) or `--save-every-minutes
M` also saves in the middle of an epoch, a checkpoint as exact for a resume as the one a stop
signal saves, so such a kill costs at most N steps (M minutes).

- `--keep-last K` keeps the K newest checkpoints. With K > 1 each save is
  `checkpoints/step-<step>.pt` (a `.dcp` folder under FSDP), `last.pt` is a hard link to the
  newest (no second copy on disk) and the step checkpoints beyond the K newest are deleted;
  with K = 1 (the default) a save replaces `last.pt`, as it always did. `best.pt` is apart.
- `--save-in-background` (on by default) writes a single-file checkpoint on a thread. The
  training thread checks the weights first (nothing non-finite is saved), copies the state
  into CPU memory and goes on; the thread writes the copy as `checkpoint.save_checkpoint`
  always does: a temporary file, fsync, rename, fsync of the folder. At most one save is in
  flight: the next save, a stop signal and the end of training wait for it, and a write that
  failed raises its `SaveError` there (exit 74, the previous checkpoint kept), on every rank.
  Sharded (FSDP) checkpoints are written in the foreground.
- `--resume auto` (`newest`) takes the newest complete checkpoint: when an older one exists,
  a newest one that is partial or unreadable is skipped with one line naming it.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..runtime import console, distributed
from . import checkpoint
from . import resume as resume_choice
from . import sharded as sharded_checkpoint
from .checkpoint import SaveError

if TYPE_CHECKING:
    from ..training.run import Run


class BackgroundWriter:
    """One thread at a time runs a write; its failure is kept for `wait` to return."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> None:
        """Start `job` on a thread; the caller has waited for the previous one."""
        self._thread = threading.Thread(
            target=self._run, args=(job,), name="checkpoint-writer", daemon=False
        )
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as error:  # kept for the training thread, which raises it
            self._failure = error

    def wait(self) -> BaseException | None:
        """Wait for the write in flight, if any; its failure, or None."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        failure, self._failure = self._failure, None
        return failure


@dataclass
class Saver:
    """A run's saving settings and its writer (`saver` makes one per run, on first use)."""

    every: int | None
    minutes: float | None
    keep: int
    writer: BackgroundWriter | None  # rank 0 of a single-file run with --save-in-background
    last_save: float = field(default_factory=time.monotonic)
    # --save-every-minutes under torchrun: every rank's verdict, agreed in the step's one
    # all-reduce (loop.train_step, with the health flag and the stop request).
    agreed_late: bool = False


def saver(run: Run) -> Saver:
    """`run.saver`, made from the run's config the first time."""
    if run.saver is None:
        config = run.config.run
        background = config.save_in_background and not run.sharded and run.ctx.is_main
        run.saver = Saver(
            config.save_every,
            config.save_every_minutes,
            config.keep_last,
            BackgroundWriter() if background else None,
        )
    return run.saver


def due(run: Run, step_in_epoch: int) -> bool:
    """Whether --save-every (or --save-every-minutes) asks for a save after this step; the
    same answer on every rank. Never on an epoch's last step: the epoch's end saves."""
    plan = saver(run)
    if step_in_epoch + 1 >= run.steps_per_epoch or run.global_step >= run.total_steps:
        return False
    if plan.every is not None:
        return bool(run.global_step % plan.every == 0)
    if plan.minutes is None:
        return False
    # Clocks differ, so under torchrun rank 0's verdict is not enough: the step agreed on it.
    return plan.agreed_late if run.ctx.enabled else late(run)


def late(run: Run) -> bool:
    """Whether --save-every-minutes' time is up on this rank's clock (False without it)."""
    plan = saver(run)
    return plan.minutes is not None and time.monotonic() - plan.last_save >= 60 * plan.minutes


def agree_late(run: Run, verdict: bool) -> None:
    """Keep the ranks' agreed `late` verdict of this step for `due`."""
    saver(run).agreed_late = verdict


def target(run: Run) -> Path:
    """Where a save writes: last.pt, or with --keep-last > 1 step-<step>.pt (or .dcp)."""
    if saver(run).keep == 1:
        return Path(run.last_path)
    return Path(run.last_path).with_name(f"step-{run.global_step}{run.last_path.suffix}")


def save_file(run: Run, state: dict[str, Any], improved: bool) -> None:
    """Rank 0 of a single-file run: write `state` (best.pt too if `improved`), now or on the
    writer's thread from a CPU copy. A previous background write that failed raises here."""
    plan = saver(run)
    if plan.writer is not None:
        failure = plan.writer.wait()
        if failure is not None:
            raise failure
    path, last, best = target(run), run.last_path, run.best_path if improved else None
    plan.last_save = time.monotonic()
    if plan.writer is None:
        write_file(state, path, last, best, plan.keep)
        return
    copied = cpu_copy(state, {})  # on this thread: the next step changes the originals
    plan.writer.submit(lambda: write_file(copied, path, last, best, plan.keep))


def write_file(state: dict[str, Any], path: Path, last: Path, best: Path | None, keep: int) -> None:
    """Write `state` to `path` atomically, make `last` name it, copy it to `best`, rotate."""
    checkpoint.save_checkpoint(state, path, previous=last)
    if path != last:
        link(path, last)
    if best is not None:
        checkpoint.copy_checkpoint(last, best)
    if keep > 1:
        rotate(path.parent, keep, path)


def save_sharded(run: Run, state: dict[str, Any], improved: bool) -> None:
    """Every rank of an FSDP run: write the shards (checkpointing/sharded.py), then on rank 0
    point last.dcp at them and rotate; a failure anywhere raises SaveError on every rank."""
    plan, path, last = saver(run), target(run), run.last_path
    best = run.best_path if improved else None
    sharded_checkpoint.save(state, path, run.raw_model, run.optimizer, best, run.ctx, run.device)
    plan.last_save = time.monotonic()
    if path == last:
        return

    def point_last_at_it() -> None:
        if run.ctx.is_main:
            link_folder(path, last)
            rotate(path.parent, plan.keep, path)

    sharded_checkpoint._together(point_last_at_it, last, run.device)


def finish(run: Run) -> None:
    """Wait for the save in flight; if it failed, raise its SaveError on every rank."""
    plan = run.saver
    failure = plan.writer.wait() if plan is not None and plan.writer is not None else None
    if distributed.any_rank(failure is not None, run.device):
        raise failure or SaveError("rank 0 could not write the checkpoint; see its message")


def stopping(run: Run, stop: Any) -> bool:
    """Whether a stop signal arrived (on any rank) while the run saved: it stops now, on the
    checkpoint just written (no extra step, no second save), once the write is done."""
    if not distributed.any_rank(stop.signum is not None, run.device):
        return False
    finish(run)
    return True


def close(run: Run) -> None:
    """At the run's end, also on an error: never leave a write half-done behind the exit."""
    plan = run.saver
    if plan is not None and plan.writer is not None:
        failure = plan.writer.wait()
        if failure is not None:
            console.safe_print(f"error: {failure}", file=sys.stderr)


def cpu_copy(value: Any, memo: dict[Any, torch.Tensor]) -> Any:
    """`value` with every tensor copied into CPU memory (tensors that share storage, like a
    tied embedding, share their copy) and every dict, list and tuple rebuilt."""
    if isinstance(value, torch.Tensor):
        key = (
            value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
            value.stride(), value.dtype, value.device,
        )  # fmt: skip
        if key not in memo:
            memo[key] = value.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(value, dict):
        return {key: cpu_copy(item, memo) for key, item in value.items()}
    if isinstance(value, list):
        return [cpu_copy(item, memo) for item in value]
    if isinstance(value, tuple):
        return tuple(cpu_copy(item, memo) for item in value)
    return value


def link(source: Path, target: Path) -> None:
    """Make `target` another name of file `source` (a hard link: no second copy), atomically;
    where the file system has no hard links, a copy."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.link.tmp")
    try:
        tmp.unlink(missing_ok=True)
        os.link(source, tmp)
    except OSError:
        checkpoint.copy_checkpoint(source, target)
        return
    try:
        os.replace(tmp, target)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        cause = error.strerror or type(error).__name__
        raise SaveError(
            f"could not write {target}: {cause}; {source} holds the newest checkpoint"
        ) from None
    checkpoint.fsync_folder(target.parent)


def link_folder(source: Path, target: Path) -> None:
    """`link` for a sharded checkpoint's folder: a folder of hard links, swapped in whole."""
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(source, tmp, copy_function=os.link)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp)
    sharded_checkpoint._replace(tmp, target)


def rotate(folder: Path, keep: int, newest: Path) -> None:
    """Delete all but the `keep` newest step checkpoints (never `newest`, just written)."""
    older = [path for _, path in resume_choice.step_checkpoints(folder) if path != newest]
    for path in older[: max(0, len(older) - (keep - 1))]:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
