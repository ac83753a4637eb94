"""How a checkpoint is written during a run: on a thread, from CPU copies, kept K deep.

checkpointing/checkpointer.py decides when to save and calls these; they know nothing of
the run.

- `--keep-last K` keeps the K newest checkpoints. With K > 1 each save is
  `checkpoints/step-<step>.pt` (a `.dcp` folder under FSDP), `last.pt` is a hard link to the
  newest (`link`, `link_folder`: no second copy on disk) and the step checkpoints beyond the
  K newest are deleted (`rotate`); with K = 1 (the default) a save replaces `last.pt`, as it
  always did. `best.pt` is apart.
- `--save-in-background` (on by default) writes checkpoints on a thread (`BackgroundWriter`).
  The training thread checks the weights first (nothing non-finite is saved), copies the
  state into CPU buffers (`Staging`: kept from one save to the next, page-locked where CUDA
  is, filled by copies queued together and waited for once) and goes on; the thread writes
  the copy as `checkpoint.save_checkpoint` always does (`write_file`): a temporary file,
  fsync, rename, fsync of the folder. Under FSDP every rank stages its shards and DCP's
  `async_save` writes them (sharded_checkpoint.write_async); the folder is complete only
  when its train state is in (`finish_folder`). At most one save is in flight: the next
  save, a stop signal and the end of training wait for it, and a write that failed raises
  its `SaveError` there (exit 74, the previous checkpoint kept), on every rank.
- `--resume auto` (`newest`) takes the newest complete checkpoint: when an older one exists,
  a newest one that is partial or unreadable is skipped with one line naming it
  (checkpointing/resume.py).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import checkpoint
from . import resume as resume_choice
from . import sharded as sharded_checkpoint
from .checkpoint import SaveError


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

    def join(self) -> None:
        """Wait for the write in flight, if any; its failure stays for `wait` to return."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wait(self) -> BaseException | None:
        """Wait for the write in flight, if any; its failure, or None."""
        self.join()
        failure, self._failure = self._failure, None
        return failure


def write_file(state: dict[str, Any], path: Path, last: Path, best: Path | None, keep: int) -> None:
    """Write `state` to `path` atomically, make `last` name it, copy it to `best`, rotate."""
    checkpoint.save_checkpoint(state, path, previous=last)
    if path != last:
        link(path, last)
    if best is not None:
        checkpoint.copy_checkpoint(last, best)
    if keep > 1:
        rotate(path.parent, keep, path)


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
    is done (`BackgroundWriter.wait`), as the checkpointer's saves do.
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
