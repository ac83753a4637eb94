"""Sharded checkpoints of `--parallel fsdp` runs, through `torch.distributed.checkpoint` (DCP).

An FSDP rank holds only its shard of the model and the optimizer, so every rank writes its own
part, in parallel, into one folder (`checkpoints/last.dcp/`); no rank ever gathers the full
model. The folder holds DCP's files (one `.distcp` per rank and a `.metadata` index) and
`train_state.pt`: everything else a resume needs (step, epoch, sampler position, RNG, schedule,
config), in the format of a single-file checkpoint with empty `model` and `optimizer`, read
with `weights_only=True` by `checkpoint.load_checkpoint`.

- Loading builds the state dict for the CURRENT ranks and lets DCP fill it, so a checkpoint
  written by 2 ranks resumes on 1, on 4, or in a single process (resharding).
- Writing is atomic at the folder level: the ranks write into `.last.dcp.tmp/`; only when every
  rank has finished does rank 0 move the old folder aside (`.last.dcp.old`), move the new one
  into place and delete the old one. A crash at any point leaves one complete checkpoint:
  `recover` (called when a run claims its run dir) puts `.old` back if the new one never
  arrived.
- `python -m <package>.checkpointing.convert RUN/checkpoints/last.dcp OUT.pt` turns one into a
  single-file checkpoint that loads with `torch.load(..., weights_only=True)`.

DCP's `.metadata` file is a pickle (PyTorch's format): resume only from folders you wrote.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..runtime import distributed, parallel
from . import checkpoint
from .checkpoint import CheckpointError, SaveError

if TYPE_CHECKING:
    pass


SUFFIX = ".dcp"
STATE_NAME = "train_state.pt"


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Without torchrun DCP warns, on every call, that it assumes a single process: it does,
    on purpose (a resumed or converted checkpoint of N ranks), so the warning is noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def is_sharded_checkpoint(path: Path) -> bool:
    """A folder written by `save` (a finished one: its train state is written last)."""
    return path.is_dir() and (path / STATE_NAME).is_file()


def save(
    state: dict[str, Any],
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    best: Path | None,
    ctx: distributed.Context,
    device: torch.device,
) -> None:
    """Write model and optimizer shards from every rank, and `state` from rank 0, to `path`,
    then copy it to `best` unless that is None.

    Call on every rank (DCP's writes end in collectives). A failure on any rank raises
    SaveError on every rank, with `path` holding the previous checkpoint.
    """
    write(state, path, model, optimizer, is_main=ctx.is_main, device=device)
    if best is not None:
        copy(path, best, is_main=ctx.is_main, device=device)


def write(
    state: dict[str, Any],
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    is_main: bool,
    device: torch.device,
) -> None:
    """`save` without the copy to best."""
    import torch.distributed.checkpoint as dcp  # here, not at the top: see _together
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp = path.with_name(f".{path.name}.tmp")  # one name all ranks agree on
    try:
        _together(lambda: _fresh_folder(tmp) if is_main else None, path, device)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        shards = {"model": model_state, "optimizer": optimizer_state}
        with quiet_single_process():
            _together(lambda: dcp.save(shards, checkpoint_id=tmp), path, device)
        _together(lambda: _finish(state, tmp, path) if is_main else None, path, device)
    except SaveError:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


class AsyncWrites:
    """What an FSDP run's background saves keep from one save to the next: DCP's stager,
    whose CPU buffers (page-locked where CUDA is) are reused, and under torchrun a gloo
    group of their own: DCP's collectives then run on the writer's thread while training's
    run on the default group (one group used by two threads at once would mix them up), and
    `async_save` needs a CPU backend, which an NCCL run's default group lacks."""

    def __init__(self, distributed: bool, device: torch.device) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = device.type == "cuda"  # pinned buffers and queued copies are for CUDA's
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                use_non_blocking_copy=cuda,
            )
        )  # fmt: skip
        self.group = dist.new_group(backend="gloo") if distributed else None
        if not distributed:  # DCP's warning comes from the writer's thread (see above)
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)


def write_async(
    state: dict[str, Any],
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    writes: AsyncWrites,
    *,
    is_main: bool,
    device: torch.device,
) -> Callable[[], None]:
    """`write`, in two halves. This one, on every rank: a fresh temporary folder, then the
    shards staged into CPU memory and handed to DCP's `async_save`. The half it returns, for
    a writer thread: wait for every rank's shards, then (rank 0) write `state` (already in
    CPU memory) and swap the folder into `path`; a failure there is a SaveError, with `path`
    holding the previous checkpoint and the temporary folder removed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp = path.with_name(f".{path.name}.tmp")
    _together(lambda: _fresh_folder(tmp) if is_main else None, path, device)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    shards = {"model": model_state, "optimizer": optimizer_state}
    upload = dcp.async_save(
        shards, checkpoint_id=tmp, process_group=writes.group, async_stager=writes.stager
    )
    written: Future[Any] = upload if isinstance(upload, Future) else upload.upload_completion

    def finish() -> None:
        try:
            written.result()  # every rank's shards and the index: DCP's save ends together
            if is_main:
                _finish(state, tmp, path)
        except BaseException as error:
            if is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise _save_error(error, path) from None

    return finish


def _save_error(error: BaseException, path: Path) -> BaseException:
    """A failed write of `path` as one SaveError; anything else (a bug) as it is."""
    from torch.distributed.checkpoint import CheckpointException

    if isinstance(error, SaveError):
        return error
    if not isinstance(error, (OSError, CheckpointException)) and (
        checkpoint.write_failure(error) is None
    ):
        return error
    # `path` (last.dcp) or, with --keep-last, the step checkpoints beside it.
    survivors = [p for p in path.parent.glob(f"*{SUFFIX}") if is_sharded_checkpoint(p)]
    kept = "the previous checkpoint is untouched" if survivors else "no checkpoint survives"
    return SaveError(f"could not write {path}: {_first_line(error)}; {kept}")


def state_file(path: Path) -> Path:
    """The file with the training state: the checkpoint itself, or a sharded one's state."""
    return path / STATE_NAME if path.is_dir() else path


def load_model_and_optimizer(
    path: Path, state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Load model and optimizer from the checkpoint at `path` (`state` is its training state).

    A sharded folder is loaded into the state dict of the model as sharded NOW, by any
    number of ranks; a single file into an unsharded model (as before FSDP existed).
    """
    if path.is_dir():
        load_shards(path, model, optimizer)
    elif parallel.is_sharded(model):
        raise CheckpointError(
            f"--resume {path}: a single-file checkpoint does not load into an FSDP-sharded "
            "model; resume it with --parallel ddp (or in one process with --parallel fsdp, "
            "which then writes a sharded checkpoint)"
        )
    else:
        checkpoint.load_state_into(model, state["model"], "model", path)
        saved = checkpoint.regrouped(state["optimizer"], model, optimizer)  # v0.2.0's one group
        saved = checkpoint.with_own_kernels(saved, optimizer)
        checkpoint.load_state_into(optimizer, saved, "optimizer", path)


def load_shards(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the shards of `path` into `model` and `optimizer`, as they are sharded NOW."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    try:
        saved_groups = _saved_param_groups(path)
        # v0.2.0 wrote one group; DCP loads only the keys asked for, so ask for that one group's
        # (its moments are keyed by parameter name: they fit whatever the groups are now).
        one_group = len(saved_groups) == 1 and len(optimizer_state["param_groups"]) > 1
        target: Any = (
            {"state": optimizer_state["state"], "param_groups": [dict.fromkeys(saved_groups[0])]}
            if one_group
            else optimizer_state
        )
        with quiet_single_process():
            dcp.load({"model": model_state, "optimizer": target}, checkpoint_id=path)
        if one_group:
            optimizer_state = {
                "state": target["state"],
                "param_groups": _regrouped(target["param_groups"][0], optimizer_state),
            }
        optimizer_state = checkpoint.with_own_kernels(optimizer_state, optimizer)
        set_state_dict(
            model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state
        )
    except (CheckpointException, RuntimeError, ValueError, KeyError, OSError) as error:
        raise CheckpointError(
            f"checkpoint {path}: the saved model or optimizer does not fit this run "
            f"({_first_line(error)})"
        ) from None


def _saved_param_groups(path: Path) -> list[list[str]]:
    """The keys of each optimizer param group in the checkpoint's metadata, in group order."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    groups: dict[int, list[str]] = {}
    for key in metadata.state_dict_metadata:
        parts = key.split(".", 3)  # optimizer.param_groups.<n>.<key>
        if parts[:2] == ["optimizer", "param_groups"] and len(parts) == 4:
            groups.setdefault(int(parts[2]), []).append(parts[3])
    return [groups[number] for number in sorted(groups)]


def _regrouped(saved: dict[str, Any], current: dict[str, Any]) -> list[dict[str, Any]]:
    """This run's groups (their parameters, weight decay and `decay` flag) with the saved
    group's other settings, as checkpoint.regrouped does for a single file."""
    hyper = {key: value for key, value in saved.items() if key != "params"}
    return [
        {**hyper, "weight_decay": group["weight_decay"], "decay": group.get("decay", True),
         "params": group["params"]}
        for group in current["param_groups"]
    ]  # fmt: skip


def copy(source: Path, target: Path, *, is_main: bool, device: torch.device) -> None:
    """Copy a finished checkpoint folder (best.dcp), atomically like `save`."""

    def run() -> None:
        if is_main:
            copy_folder(source, target)

    _together(run, target, device, f"; {source} holds this epoch's checkpoint")


def copy_folder(source: Path, target: Path) -> None:
    """Copy folder `source` to `target` (one process), swapped in whole as `_replace` does."""
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    _replace(tmp, target)


def recover(folder: Path) -> None:
    """Finish or undo a swap that a crash interrupted (see the module docstring)."""
    for old in folder.glob(f".*{SUFFIX}.old"):
        current = old.with_name(old.name[1 : -len(".old")])
        if current.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, current)


def _fresh_folder(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
    tmp.mkdir(parents=True)


def _finish(state: dict[str, Any], tmp: Path, path: Path) -> None:
    checkpoint.save_checkpoint(state, tmp / STATE_NAME)  # last: it marks the folder complete
    _replace(tmp, path)


def _replace(tmp: Path, path: Path) -> None:
    """Put folder `tmp` at `path`; at every moment one of them, or `.old`, is complete."""
    old = path.with_name(f".{path.name}.old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _together(run: Callable[[], Any], path: Path, device: torch.device, note: str = "") -> None:
    """Run one phase of a save; if it failed on any rank, raise SaveError on every rank."""
    # torch.distributed.checkpoint is imported where it is used, never at this module's top:
    # it took 2.8 of the 3 s every entry point (train, evaluate, ...) spent importing.
    from torch.distributed.checkpoint import CheckpointException

    failure: BaseException | None = None
    try:
        run()
    except (OSError, CheckpointException, RuntimeError) as error:
        if isinstance(error, RuntimeError) and checkpoint.write_failure(error) is None:
            raise  # not a write that failed (torch.save's zip writer wraps those)
        failure = error
    flag = torch.tensor(float(failure is not None), device=device)
    if distributed.all_reduce(flag, op="max").item():  # every rank learns every verdict
        if failure is None:
            raise SaveError(f"another rank could not write {path}; see its message")
        cause = _first_line(failure)
        kept = "the previous checkpoint is untouched" if path.exists() else "no checkpoint survives"
        raise SaveError(f"could not write {path}: {cause}; {kept}{note}")


def _first_line(error: BaseException) -> str:
    """DCP gathers the failures of all ranks into one long message: the first cause."""
    written = checkpoint.write_failure(error)
    if written is not None and written.strerror:
        return written.strerror
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if "Error:" in line and "CheckpointException" not in line:
            return line
    return lines[0] if lines else type(error).__name__
