"""`torchrun` whose exit status says a signal stopped the job: 128 + N, one line, no traceback.

    python -m <package>.runtime.launch [torchrun's arguments] -m <package>.train [training flags]

torchrun (`torch.distributed.run`) turns SIGTERM, SIGINT, SIGHUP and SIGQUIT into a
`SignalException`, forwards the signal to the ranks (each saves and exits 128 + N), waits for
them, then re-raises it: torchrun exits 1 with a traceback, as if the job had crashed. This
runs torchrun (its own parser, minus abbreviated flags, and `run`) with the same arguments
and turns that exception alone into one line and 128 + N; a bad flag is one line and exit 2;
everything else (a rank that failed) ends as torchrun ends.
"""

from __future__ import annotations

import sys
from typing import NoReturn

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.run import get_args_parser, run

from . import distributed


@record  # as torchrun's own main: a failed rank's error file and summary
def torchrun(argv: list[str] | None) -> None:
    """torchrun's `main`, but an abbreviated flag (`--nproc-per-n 1`) is refused: argparse
    took it for `--nproc-per-node` or, worse, as the script's and started a default run."""
    parser = get_args_parser()
    parser.allow_abbrev = False

    def one_line(message: str) -> NoReturn:
        parser.exit(2, f"error: {message} (--help lists torchrun's flags)\n")

    parser.error = one_line  # type: ignore[method-assign]
    run(parser.parse_args(argv))


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
