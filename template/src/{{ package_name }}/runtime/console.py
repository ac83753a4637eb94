"""Lines for the terminal that a closed stdout or stderr (`... | head -1`) cannot turn into
a crash: rank 0's `log` (through tqdm, so a progress bar stays intact), `safe_print`, and
`quiet_closed_stdout` for the interpreter's last flush."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from tqdm import tqdm


def log(message: str) -> None:
    """Rank 0's log line; a closed stdout (`... | head -1`) must not stop the run."""
    with contextlib.suppress(BrokenPipeError, ValueError):
        tqdm.write(message)


def safe_print(*args: Any, **kwargs: Any) -> None:
    """`print` that a closed stdout or stderr (`... | head -1`) cannot turn into a crash."""
    with contextlib.suppress(BrokenPipeError, ValueError):
        print(*args, **kwargs)


def quiet_closed_stdout() -> None:
    """Point a closed stdout at /dev/null, so the interpreter's final flush stays quiet."""
    try:
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
