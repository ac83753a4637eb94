"""Step checkpoints: saves between epochs' ends, kept K deep, written in the background.

A `kill -9`, the kernel's OOM killer or a lost node is no signal: without these, everything
since the last epoch's end is lost. `--save-every N` (optimizer steps) or `--save-every-minutes
M` also saves in the middle of an epoch, a checkpoint as exact for a resume as the one a stop
signal saves, so such a kill costs at most N steps (M minutes).

- `--keep-last K` keeps the K newest checkpoints. With K > 1 each save is
  `checkpoints/step-<step>.pt` (a `.dcp` folder under FSDP), `last.pt` is a hard link to the
  newest (no second copy on disk) and the step checkpoints beyond the K newest are deleted;
  with K = 1 (the default) a save replaces `last.pt`, as it always did. `best.pt` is apart.
- `--save-in-background` (on by default) writes checkpoints on a thread. The training thread
  checks the weights first (nothing non-finite is saved), copies the state into CPU buffers
  (`Staging`: kept from one save to the next, page-locked where CUDA is, filled by copies
  queued together and waited for once) and goes on; the thread writes the copy as
  `checkpoint.save_checkpoint` always does: a temporary file, fsync, rename, fsync of the
  folder. Under FSDP every rank stages its shards and DCP's `async_save` writes them
  (sharded_checkpoint.write_async); the folder is complete only when its train state is in.
  At most one save is in flight: the next save, a stop signal and the end of training wait
  for it, and a write that failed raises its `SaveError` there (exit 74, the previous
  checkpoint kept), on every rank.
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
    # With --save-in-background: rank 0 of a single-file run, every rank of an FSDP run.
    writer: BackgroundWriter | None
    last_save: float = field(default_factory=time.monotonic)
    staging: Staging = field(default_factory=lambda: Staging())
    dcp: Any = None  # an FSDP run's sharded_checkpoint.AsyncWrites, made on its first save
    # --save-every-minutes under torchrun: the ranks' agreed "time is up" (loop.train_step,
    # with the stop request, one step late: runtime/distributed.HostAgreement), and the
    # number of saves so far, which tells a verdict asked before the latest save.
    agreed_late: bool = False
    saves: int = 0


def saver(run: Run) -> Saver:
    """`run.saver`, made from the run's config the first time."""
    if run.saver is None:
        config = run.config.run
        background = config.save_in_background and (run.sharded or run.ctx.is_main)
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


def agree_late(run: Run, verdict: bool, asked_after: int) -> None:
    """Keep the ranks' agreed `late` verdict for `due`. It was asked a step ago, after
    `asked_after` saves: a save since then restarted the clock, and the verdict is stale."""
    plan = saver(run)
    plan.agreed_late = verdict and asked_after == plan.saves


def restart_clock(run: Run) -> None:
    """A save was made (every rank calls this, the ranks that write nothing too): the
    --save-every-minutes clock starts again, and agreed verdicts asked before are stale."""
    plan = saver(run)
    plan.last_save = time.monotonic()
    plan.saves += 1


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
    if plan.writer is None:
        write_file(state, path, last, best, plan.keep)
        return
    copied = plan.staging.stage(state)  # on this thread: the next step changes the originals
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
    point last.dcp at them and rotate; a failure anywhere raises SaveError on every rank.
    With a writer, the shards are staged here and written by DCP's `async_save`, and rank 0
    finishes the folder on the writer's thread; a previous write that failed raises here."""
    plan, path, last = saver(run), target(run), run.last_path
    best = run.best_path if improved else None
    if plan.writer is not None:
        finish(run)  # at most one save in flight; its failure stops every rank here
        if plan.dcp is None:
            plan.dcp = sharded_checkpoint.AsyncWrites(run.ctx.enabled, run.device)
        staged = plan.staging.stage(state) if run.ctx.is_main else {}
        write = sharded_checkpoint.write_async(
            staged, path, run.raw_model, run.optimizer, plan.dcp, is_main=run.ctx.is_main,
            device=run.device,
        )  # fmt: skip
        main = run.ctx.is_main

        def job() -> None:
            write()
            if main:
                finish_folder(path, last, best, plan.keep)

        plan.writer.submit(job)
        return
    sharded_checkpoint.save(state, path, run.raw_model, run.optimizer, best, run.ctx, run.device)
    if path == last:
        return

    def point_last_at_it() -> None:
        if run.ctx.is_main:
            link_folder(path, last)
            rotate(path.parent, plan.keep, path)

    sharded_checkpoint._together(point_last_at_it, last, run.device)


def finish_folder(path: Path, last: Path, best: Path | None, keep: int) -> None:
    """Rank 0's end of a background sharded save, once the folder is complete: last.dcp,
    best.dcp and the rotation, as a foreground save does them; a failure is a SaveError."""
    writing = last
    try:
        if path != last:
            link_folder(path, last)
            rotate(path.parent, keep, path)
        if best is not None:
            writing = best
            sharded_checkpoint.copy_folder(path, best)
    except OSError as error:
        if isinstance(error, SaveError):
            raise
        cause = error.strerror or type(error).__name__
        raise SaveError(f"could not write {writing}: {cause}; {path} holds the newest") from None


def finish(run: Run) -> None:
    """Wait for the save in flight; if it failed, raise its SaveError on every rank."""
    plan = run.saver
    failure = plan.writer.wait() if plan is not None and plan.writer is not None else None
    if distributed.any_rank(failure is not None, run.device):
        raise failure or SaveError("another rank could not write the checkpoint; see its message")


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


class Staging:
    """CPU copies of a checkpoint's state for a background write, in buffers kept from one
    save to the next (as torch.distributed.checkpoint's staging keeps them).

    Each tensor is copied into a buffer of its shape, strides and dtype, allocated on first
    use (`allocate`: page-locked where CUDA is available, so the copy engine fills it
    directly) and reused by later saves: the n-th tensor of a kind in a state takes that
    kind's n-th buffer. The copies are queued without waiting (`non_blocking`) and each
    device is waited for once, after the last: one synchronisation a save, not one a tensor.
    Views alike of one tensor (a tied embedding) share their copy, as they share memory.

    The buffers of a save are overwritten by the next: stage only after the previous write
    is done (`BackgroundWriter.wait`), as `save_file` and `save_sharded` do.
    """

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffers: dict[tuple[Any, ...], list[torch.Tensor]] = {}

    @torch.no_grad()
    def stage(self, state: Any) -> Any:
        """`state` with every tensor copied into a CPU buffer (and every dict, list and tuple
        rebuilt), complete when this returns."""
        devices: set[torch.device] = set()
        staged = self._copy(state, {}, {}, devices)
        for device in devices:  # the one wait for all the copies queued on it
            torch.cuda.current_stream(device).synchronize()
        return staged

    def allocate(self, like: torch.Tensor) -> torch.Tensor:
        """A new CPU buffer for tensors like `like` (staging allocates nowhere else)."""
        buffer = torch.empty_like(like, device="cpu")  # `like`'s strides where it is dense
        return buffer.pin_memory() if self.pin and like.is_cuda else buffer

    def _copy(self, value: Any, memo: dict[Any, Any], used: dict[Any, int], devices: Any) -> Any:
        if isinstance(value, dict):
            return {key: self._copy(item, memo, used, devices) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._copy(item, memo, used, devices) for item in value]
            return items if isinstance(value, list) else tuple(items)
        if not isinstance(value, torch.Tensor):
            return value
        same = (
            value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
            value.stride(), value.dtype, value.device,
        )  # fmt: skip
        if same not in memo:
            memo[same] = self._staged(value.detach(), used, devices)
        return memo[same]

    def _staged(self, tensor: torch.Tensor, used: dict[Any, int], devices: Any) -> torch.Tensor:
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
            return tensor.to("cpu", copy=True)  # a tensor subclass or a sparse one: as it was
        kind = (tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device.type)
        pool = self._buffers.setdefault(kind, [])
        index = used[kind] = used.get(kind, -1) + 1
        if index == len(pool):
            pool.append(self.allocate(tensor))
        queued = tensor.is_cuda and self.pin
        if queued:
            devices.add(tensor.device)
        return pool[index].copy_(tensor, non_blocking=queued)


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
