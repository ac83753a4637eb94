"""`torchrun` whose exit status says a signal stopped the job: 128 + N, one line, no traceback.

    python -m <package>.launch [torchrun's arguments] -m <package>.train [training flags]

torchrun (`torch.distributed.run`) turns SIGTERM, SIGINT, SIGHUP and SIGQUIT into a
`SignalException`, forwards the signal to the ranks (each saves and exits 128 + N), waits for
them, then re-raises it: torchrun exits 1 with a traceback, as if the job had crashed. This
runs torchrun's own `main` with the same arguments and turns that exception alone into one line
and 128 + N; everything else (a rank that failed, a bad argument) ends as torchrun ends.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.run import main as torchrun

from . import distributed


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun(argv)
    except SignalException as stopped:
        name = stopped.sigval.name
        print(
            f"torchrun stopped by {name}; the ranks' lines above say what they saved; continue "
            "with --resume auto and the same --run-dir",
            file=sys.stderr,
        )
        return 128 + int(stopped.sigval)
    return 0


if __name__ == "__main__":
    # torchrun's threads can abort interpreter finalization after a signal (SIGABRT,
    # "terminate called without an active exception"): the job is over, leave without it.
    distributed.exit_process(main(), always=True)
