"""How every entry point ends: one line on stderr and a documented exit code.

`exit_code(run)` calls an entry point's work and turns each known way it can end into one
true line and a code (the README's table): 0 done; 1 training blew up (`NonFiniteLossError`:
nothing non-finite was saved); 2 bad input (a flag, the data, a checkpoint, a path, a run
dir in use); 74 (`EXIT_IO_ERROR`) an output could not be written and the previous one is
kept; 128+N stopped by signal N, after saving. `Parser` is argparse with the same one-line
errors and no abbreviated flags.
"""

from __future__ import annotations

import argparse
import errno
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from ..checkpointing.checkpoint import CheckpointError, SaveError
from ..checkpointing.rundir import RunDirError
from ..settings.base import ConfigError
from ..training.data_sources import DataError
from ..utils import NonFiniteLossError
from .console import quiet_closed_stdout, safe_print
from .files import PathError, WriteError
from .stopping import Interrupted, Stopped, stop_signals_raise

EXIT_IO_ERROR = 74  # EX_IOERR from sysexits.h: a checkpoint could not be written
# Errors of a disk that refuses writes: one line and EXIT_IO_ERROR, not a traceback.
WRITE_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EISDIR)


def exit_code(run: Callable[[], object], *, kept: str = "checkpoints are as last saved") -> int:
    """Call `run` and turn the known ways it can end into one line on stderr and an exit code.

    0 done (or `run`'s own int); 1 the training blew up (nothing non-finite was saved); 2 bad
    input: flags, data, a checkpoint, a path (`files.PathError`), or a run dir in use or
    holding another run; 74 a checkpoint (or the metrics file, or an output: `kept` says what
    survives) could not be written; 128+N stopped by signal N (after saving, in training).
    """
    try:
        with stop_signals_raise():
            result = run()
    except (ConfigError, DataError, CheckpointError, RunDirError, PathError) as error:
        safe_print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    except NonFiniteLossError as error:
        safe_print(f"error: {error}", file=sys.stderr)
        return 1
    except Interrupted as stopped:
        safe_print(stopped, file=sys.stderr)
        return stopped.exit_code
    except (Stopped, KeyboardInterrupt) as stopped:
        signum = stopped.signum if isinstance(stopped, Stopped) else signal.SIGINT
        safe_print(
            f"stopped by {signal.Signals(signum).name}; {kept} (files are written whole, "
            "then renamed: none is left half-written)",
            file=sys.stderr,
        )
        return 128 + signum
    except OSError as error:  # SaveError, WriteError, a full or read-only disk under metrics
        written = isinstance(error, (SaveError, WriteError))
        if not written and error.errno not in WRITE_ERRNOS:
            raise
        cause = error if written else f"{error}; {kept}"
        safe_print(f"error: {cause}", file=sys.stderr)
        return EXIT_IO_ERROR
    finally:
        quiet_closed_stdout()
    return result if type(result) is int else 0


def one_line(error: BaseException) -> str:
    """The message of `error`, minus the traceback a DataLoader worker wraps around it."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    marker = f"{type(error).__name__}: "
    last = lines[-1]
    return last.split(marker, 1)[1] if len(lines) > 1 and marker in last else lines[0]


def kept(last_path: Path, best_path: Path) -> str:
    """Which checkpoints a failed run leaves, as the end of its error line."""
    kept = [str(path) for path in (last_path, best_path) if path.exists()]
    if not kept:
        return "no checkpoint had been written yet"
    return f"{' and '.join(kept)} {'is' if len(kept) == 1 else 'are'} untouched"


class Parser(argparse.ArgumentParser):
    """argparse for every entry point: no abbreviated flags (`--batch-siz` would change
    meaning the day a second flag shares the prefix) and a bad flag is one line, exit 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (--help lists the flags)\n")
