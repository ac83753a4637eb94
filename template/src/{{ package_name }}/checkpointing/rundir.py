"""The run directory belongs to one run: a lock, a write probe, and no silent overwrite.

`claim` is called once, by rank 0, before any work:

- it creates `<run-dir>/checkpoints` and proves it can write there (a full or read-only disk
  is one line at the start, not a traceback after an epoch of training);
- it takes an exclusive `flock` on `<run-dir>/.lock` for the life of the process, so a second
  run on the same directory stops at once, naming the pid and host that hold it (the kernel
  releases the lock when the holder exits, also after `kill -9`); a lock left held by a
  process that outlived its run (`stale`: the holder's pid is dead on this host, or it was an
  earlier attempt of this torchrun job or of this requeued SLURM job) is taken over, so an
  elastic restart or a requeue can resume; on a file system that keeps no locks (flock says
  ENOLCK, ENOSYS or EOPNOTSUPP: Lustre without `flock`, some FUSE and NFS mounts) the run goes
  on with one warning line;
- it refuses a directory that already holds checkpoints unless the run resumes (`--resume`),
  so a repeated command never replaces a finished run;
- it removes temporary files that a killed save left behind.

`trim_metrics` cuts `metrics.jsonl` back to the step a run resumes from, so steps redone after
a crash are not recorded twice.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import IO

import torch

from ..runtime import distributed
from ..runtime.console import log
from . import sharded as sharded_checkpoint

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock, the run dir is not locked
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".lock"
# flock's answers: only these mean that another process holds the lock ...
HELD_ERRNOS = (errno.EWOULDBLOCK, errno.EAGAIN)
# ... and these that the file system keeps no locks: the run goes on, with one warning line.
NO_LOCKS_ERRNOS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP)


class RunDirError(RuntimeError):
    """The run directory cannot be used by this run (locked, not writable, holds a run)."""


def claim(run_dir: Path, resume: str | None) -> IO[str] | None:
    """Lock `run_dir` for this process and check it can be used; returns the open lock file.

    Keep the returned file open for the whole run (closing it releases the lock).
    """
    checkpoints = run_dir / "checkpoints"
    try:
        checkpoints.mkdir(parents=True, exist_ok=True)
        lock: IO[str] = open(run_dir / LOCK_NAME, "a+", encoding="utf-8")  # noqa: SIM115
    except OSError as error:
        raise RunDirError(f"--run-dir {run_dir} cannot be used: {_reason(error)}") from None
    if fcntl is not None:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in HELD_ERRNOS:
                lock = _held(run_dir, lock)
            elif error.errno in NO_LOCKS_ERRNOS:  # Lustre without flock, FUSE, NFS sans lockd
                log(
                    f"warning: --run-dir {run_dir} is on a file system without locks "
                    f"({_reason(error)}): a second run on it would not be refused"
                )
            else:
                lock.close()
                raise RunDirError(
                    f"--run-dir {run_dir} cannot be locked: {_reason(error)}"
                ) from None
    try:
        lock.seek(0)
        lock.truncate()
        lock.write(holder_line())
        lock.flush()
        _probe(checkpoints)
    except OSError as error:
        lock.close()
        raise RunDirError(f"--run-dir {run_dir} is not writable: {_reason(error)}") from None
    sharded_checkpoint.recover(checkpoints)  # a folder swap that a crash interrupted
    saved = sorted(p.name for p in (*checkpoints.glob("*.pt"), *checkpoints.glob("*.dcp")))
    if saved and resume is None:
        lock.close()
        raise RunDirError(
            f"--run-dir {run_dir} already holds a run ({', '.join(saved)}); continue it with "
            "--resume auto, or start over with a new --run-dir (or delete "
            f"{checkpoints} first)"
        )
    for orphan in checkpoints.glob(".*.tmp"):  # left by a save that was killed
        if orphan.is_dir():
            shutil.rmtree(orphan, ignore_errors=True)  # a sharded checkpoint's folder
        else:
            orphan.unlink(missing_ok=True)
    return lock


def _held(run_dir: Path, lock: IO[str]) -> IO[str]:
    """The lock is held: refuse, or take it over from a holder that is gone (`stale`)."""
    lock.seek(0)
    holder = lock.read().strip() or "an unknown process"
    lock.close()
    why = stale(holder)
    if why is None:
        raise RunDirError(
            f"--run-dir {run_dir} is in use by another run ({holder}); wait for it to "
            "finish or choose another --run-dir"
        ) from None
    return _take_over(run_dir, holder, why)


def holder_line() -> str:
    """Who holds the lock: pid and host, and under torchrun its job id and restart count."""
    line = f"pid {os.getpid()} on host {socket.gethostname()}"
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if job:
        line += f", torchrun job {job} restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    slurm_job = os.environ.get("SLURM_JOB_ID")
    if slurm_job:  # SLURM counts requeues in SLURM_RESTART_COUNT (unset before the first)
        line += f", slurm job {slurm_job} restart {os.environ.get('SLURM_RESTART_COUNT', 0)}"
    return line + "\n"


def stale(holder: str) -> str | None:
    """Why a held lock is left over from a run that is gone (None: it may be alive).

    The flock is the kernel's and ends with its holder, but a process forked while the lock
    was held (a DataLoader worker, until it notices its parent died) keeps it, and so can a
    network file system for a dead client. Taken over: a holder whose pid is dead on this
    host, or an earlier attempt of this torchrun job (same job id, lower restart count:
    torchrun restarts a group only after its processes have exited or been killed), or an
    earlier allocation of this SLURM job (same job id, lower SLURM_RESTART_COUNT: a requeued
    job starts torchrun at restart 0 again, but SLURM requeues a job only after ending it; its
    first node may be dead and its lock still held by the network file system).
    """
    pattern = (
        r"pid (\d+) on host (\S+?)(?:, torchrun job (\S+) restart (\d+))?"
        r"(?:, slurm job (\S+) restart (\d+))?"
    )
    found = re.fullmatch(pattern, holder)
    if found is None:
        return None
    pid, host, job, restart, slurm_job, slurm_restart = found.groups()
    if host == socket.gethostname() and not _alive(int(pid)):
        return f"pid {pid} is no longer running on {host}"
    for kind, theirs, their_try, ours, attempt in (
        ("torchrun", job, restart, "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"),
        ("slurm", slurm_job, slurm_restart, "SLURM_JOB_ID", "SLURM_RESTART_COUNT"),
    ):
        now = int(os.environ.get(attempt, 0))
        if theirs is not None and theirs == os.environ.get(ours) and int(their_try) < now:
            return f"restart {now} of {kind} job {theirs} replaces restart {their_try}"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def _take_over(run_dir: Path, holder: str, why: str) -> IO[str]:
    """Put a new lock file, locked by this process, in place of a stale one.

    The stale holder keeps its lock on the old file, which no one opens any more. Of two
    processes taking over at once, the one whose file is not in place at the end refuses.
    """
    path = run_dir / LOCK_NAME
    fresh_path = run_dir / f"{LOCK_NAME}.{os.getpid()}.tmp"
    fresh = open(fresh_path, "w+", encoding="utf-8")  # noqa: SIM115 - held open
    try:
        fcntl.flock(fresh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        fresh.write(holder_line())
        fresh.flush()
        os.replace(fresh_path, path)
        if os.stat(path).st_ino != os.fstat(fresh.fileno()).st_ino:
            raise OSError(errno.EBUSY, "another process took the lock over first")
    except OSError as error:
        fresh.close()
        fresh_path.unlink(missing_ok=True)
        reason = _reason(error)
        raise RunDirError(
            f"--run-dir {run_dir}: could not take over the stale lock of {holder}: {reason}"
        ) from None
    log(f"took over the run-dir lock of {holder} ({why})")
    return fresh


def claim_on_rank_zero(
    run_dir: Path, resume: str | None, is_main: bool, device: torch.device
) -> IO[str] | None:
    """`claim` on rank 0; every rank learns the verdict, so all stop together on a refusal."""
    lock, error = None, None
    if is_main:
        try:
            lock = claim(run_dir, resume)
        except RunDirError as refused:
            error = refused
    if distributed.any_rank(error is not None, device):
        raise error or RunDirError(f"rank 0 refused --run-dir {run_dir}; see its message")
    return lock


def _probe(folder: Path) -> None:
    """Write, flush and delete a small file: fails now if saving would fail later."""
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe.", suffix=".tmp") as file:
        file.write(b"\0" * 4096)
        file.flush()
        os.fsync(file.fileno())


def _reason(error: OSError) -> str:
    what = error.strerror or type(error).__name__
    return f"{what} ({error.filename})" if error.filename else what


def trim_metrics(path: Path, step: int) -> int:
    """Drop the records after `step` (and any torn last line) from `path`; returns how many.

    Rewritten through a temporary file and a rename, like a checkpoint.
    """
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            keep = int(record.get("step", 0)) <= step
        except (ValueError, TypeError, AttributeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped
