"""What serve's one hand-over of a non-streamed answer buys (serving.engine.Worker.whole):
benchmark section 13 of a language-model project with a third contender, a server whose
non-streamed answers come from the model's thread token by token, as they did before
(Answer.whole reading Answer.pieces). The three (direct calls, the server, the per-token
server) are timed in the same interleaved rounds; the load levels are skipped.

From the root of a language-model project generated with the default package name:

    OMP_NUM_THREADS=2 PYTHONPATH=src python docs/scripts/handover.py SECONDS

SECONDS is the benchmark's --min-run-time (each contender's time per round is a share of it).
"""

from __future__ import annotations

import sys
from typing import Any

from my_torch_project.benchmarks import cli, serving


def per_token_app(lm: Any, max_active: int, max_body_bytes: int) -> Any:
    """serve's app, its non-streamed answers read piece by piece (in the server's process)."""
    from my_torch_project.serving import language

    async def whole(self: Any, steps: Any) -> Any:
        text, finished = [], None
        async for piece, done in self.pieces(steps):
            text.append(piece)
            finished = done or finished
        return "".join(text), finished

    language.Answer.whole = whole  # type: ignore[method-assign]
    return serving._language_app(lm, max_active, max_body_bytes)


def main() -> int:
    real = serving._work

    def with_per_token(*args: Any) -> dict[str, Any]:
        work = real(*args)
        app = work["apps"]["server"]
        request = work["contenders"]["server"][1]
        work["apps"] = {"server": app, "per-token": (per_token_app, *app[1:])}
        work["contenders"] = {
            "server": ("server", request),
            "per-token hand-over": ("per-token", request),
        }
        return work

    serving._work = with_per_token
    serving.CLIENTS = ()
    seconds = sys.argv[1] if len(sys.argv) > 1 else "6"
    flags = ["--device", "cpu", "--sections", "13", "--no-progress", "--min-run-time", seconds]
    return cli.main([*flags, "--out", "runs/handover"])


if __name__ == "__main__":
    sys.exit(main())
