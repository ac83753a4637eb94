"""Which checkpoint a run resumes from: `--resume PATH`, or for `--resume auto` the newest
complete one of the run dir (last.pt, last.dcp, the step checkpoints of `--keep-last`).

Its own module so that checkpointing/checkpoint.py (reading and writing one file) and
checkpointing/steps.py (writing them during a run) both stay free of import cycles.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ..runtime import console
from . import checkpoint
from . import sharded as sharded_checkpoint
from .checkpoint import REQUIRED_KEYS, CheckpointError

STEP_NAME = re.compile(r"step-(\d+)(\.pt|\.dcp)")


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    """`--resume auto` means run_dir's newest complete checkpoint if there is one (else a
    fresh start): last.pt, the folder last.dcp of an FSDP run, or a step checkpoint
    (`newest`: a partial newest one is skipped with a line)."""
    if resume is None:
        return None
    if resume == "auto":
        folder = run_dir / "checkpoints"
        refuse_unreadable_last(folder / "last.pt")
        found = newest(folder)
        if found is None:
            refuse_best_without_last(folder)
        return found
    path = Path(resume)
    if not (path.is_file() or (path / "train_state.pt").is_file()):
        raise CheckpointError(
            f"--resume {path}: no such checkpoint file (or sharded checkpoint folder)"
        )
    return path


def saved_precision(resume: str | None, run_dir: Path) -> str | None:
    """The precision the checkpoint `--resume` names was trained at (its config record, read
    through a memory map), or None: no resume, or one that does not say (the checkpointer's
    `load` then says what is wrong with it)."""
    try:
        path = resolve_resume(resume, run_dir)
        if path is None:
            return None
        state = torch.load(
            sharded_checkpoint.state_file(path), map_location="cpu", weights_only=True, mmap=True
        )
        precision = checkpoint.flat_record(state["config"]).get("precision")
    except Exception:  # unreadable, or no config record: `load` says so, in its place
        return None
    return precision if precision in ("fp32", "bf16", "fp16") else None


def refuse_unreadable_last(last: Path) -> None:
    """`--resume auto` must not start over (replacing it) when last.pt is a link to a missing
    file (checkpoints on an unmounted volume) or a folder."""
    if last.is_symlink() and not last.exists():
        raise CheckpointError(
            f"--resume auto: {last} is a link to {os.readlink(last)}, which does not exist "
            "(an unmounted volume?); mount it, or remove the link to start over"
        )
    if last.exists() and not last.is_file():
        raise CheckpointError(
            f"--resume auto: {last} is not a file (a folder?); move it away to start over, "
            "or pass --resume with a checkpoint file"
        )


def refuse_best_without_last(folder: Path) -> None:
    """`--resume auto` with a best checkpoint but no last one (deleted, or only the best model
    copied in) must not start fresh: the new run's first best would overwrite it."""
    best = next((p for p in (folder / "best.pt", folder / "best.dcp") if p.exists()), None)
    if best is not None:
        raise CheckpointError(
            f"--resume auto: {folder} holds {best.name} but no last checkpoint, and a fresh "
            f"run would overwrite it; continue from it with --resume {best}, or start over "
            "with a new --run-dir"
        )


def step_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """The step checkpoints in `folder`, oldest first: (step, path)."""
    found = []
    for path in folder.glob("step-*"):
        name = STEP_NAME.fullmatch(path.name)
        if name is not None:
            found.append((int(name[1]), path))
    return sorted(found)


def newest(folder: Path) -> Path | None:
    """--resume auto's checkpoint in `folder`: the newest of last.pt, last.dcp and the step
    checkpoints that is complete. A newer one that is partial or unreadable is skipped with a
    line naming it; when none is readable, the newest (whose load then says what is wrong)."""
    found: list[tuple[int, Path]] = []
    seen = set()
    names = [folder / "last.pt", folder / "last.dcp"]
    names += [path for _, path in reversed(step_checkpoints(folder))]
    for path in names:
        marker = sharded_checkpoint.state_file(path) if path.is_dir() else path
        if not path.exists():
            continue
        stat = (marker if marker.exists() else path).stat()
        if (stat.st_dev, stat.st_ino) in seen:  # last.pt: a hard link to a step checkpoint
            continue
        seen.add((stat.st_dev, stat.st_ino))
        if marker.is_file() or path.name.startswith("step-"):
            found.append((stat.st_mtime_ns, path))
    found.sort(key=lambda item: -item[0])  # stable: last.* before a step file of its time
    if len(found) < 2:
        return found[0][1] if found else None
    for _, path in found:
        problem = unreadable(path)
        if problem is None:
            return path
        if int(os.environ.get("RANK", "0")) == 0:
            console.log(f"--resume auto: skipping {path}: {problem}; trying an older checkpoint")
    return found[0][1]


def unreadable(path: Path) -> str | None:
    """Why checkpoint `path` cannot be resumed from (partial, corrupt, not ours), else None;
    reads the training state's structure, not every tensor (a memory map)."""
    state_path = sharded_checkpoint.state_file(path)
    if path.is_dir() and not (state_path.is_file() and (path / ".metadata").is_file()):
        return "incomplete (a sharded checkpoint without its train_state.pt or .metadata)"
    try:
        state = torch.load(state_path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # a truncated zip, a foreign pickle: one answer
        return f"cannot be read ({checkpoint._load_failure(error)})"
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED_KEYS):
        return "lacks training state"
    return None
