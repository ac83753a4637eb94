"""Stop signals: SIGTERM, SIGINT, SIGHUP, SIGUSR1 end a run cleanly, never half-way.

In training, `StopSignal` turns the first one into a flag that the run's checkpointer reads
at the next step boundary (checkpointing/checkpointer.py): it saves and raises `Interrupted`
(exit 128 + N). Everywhere else (start-up,
evaluation, `tune`), `stop_signals_raise` turns one into `Stopped`, which the entry point's
`exits.exit_code` ends with one line and 128 + N; a start-up pass over DataLoader workers
holds it until the batch in flight has arrived (`stops_between_batches`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# The signals that mean "save and stop": SIGHUP when the terminal or ssh session goes away,
# SIGUSR1 what SLURM's --signal sends by convention. Windows has neither.
STOP_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")
    if hasattr(signal, name)
)


class Interrupted(Exception):
    """Training stopped on a signal after saving a checkpoint; `--resume auto` continues."""

    def __init__(self, signum: int, step: int, path: Path | None):
        name = signal.Signals(signum).name
        saved = f"checkpoint saved to {path}" if path is not None else "rank 0 saved the checkpoint"
        super().__init__(
            f"stopped by {name} at step {step}; {saved}; continue with "
            "--resume auto and the same --run-dir"
        )
        self.signum = signum
        self.exit_code = 128 + signum  # the shell's convention for "ended by a signal"


class StopSignal:
    """Context manager: the first stop signal sets `signum`; the loop checks it per step.

    Cluster schedulers send SIGTERM (or the signal asked for with `--signal`) some time before
    they kill a job, often to the whole process group, and torchrun forwards it as well, so a
    rank commonly gets it twice. Saving from inside the handler could catch the loop half-way
    through an optimizer step; a flag read at the step boundary saves a consistent state
    instead. Later signals are ignored, so none can abort the save; `kill -9` still ends the
    run at once, and the last completed checkpoint survives it.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        # signal.signal only works in the main thread (e.g. not when a benchmark runs train()
        # in a thread); there the run simply cannot be stopped this way.
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum


class Stopped(BaseException):
    """A stop signal outside training's own handling (start-up, evaluation, `tune`)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """While inside, a stop signal that nothing else handles raises `Stopped` (SIGINT too,
    in place of KeyboardInterrupt); training's own handler (`StopSignal`) takes over while
    it runs and gives this one back after."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
                previous[signum] = signal.signal(signum, _raise_stopped)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def stops_between_batches() -> Iterator[Callable[[], None]]:
    """While inside, a stop signal is held until the caller's next `check()` (between
    batches), which raises `Stopped`; one still held at the end is raised on leaving.

    A start-up pass over DataLoader workers (the normalisation pass, `--num-workers auto`)
    could be stopped by `Stopped` from the signal handler half-way through receiving a batch:
    a worker hands its tensors over a socket (torch's file-descriptor sharing), and when the
    main process dropped the socket mid-transfer, the worker printed a ConnectionResetError
    traceback after the one stop line. At a batch boundary no transfer is in flight.
    """
    stop = StopSignal()

    def check() -> None:
        if stop.signum is not None:
            raise Stopped(stop.signum)

    with stop:
        yield check
    check()
