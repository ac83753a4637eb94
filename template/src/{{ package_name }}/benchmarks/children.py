"""The processes of benchmark section 13 (serving.py): the server and the direct calls each run
in a spawned process of their own, as `serve` runs, with serve's allocator setting
(`serving.engine.keep_freed_memory`) and the parent's torch threads. `start` starts them
together and says what each reported once ready; `call` asks the direct calls' process for
one call through its pipe."""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import threading
import time
from collections.abc import Callable
from typing import Any

import torch


def start(
    stack: contextlib.ExitStack, jobs: dict[str, tuple[Callable[..., None], tuple[Any, ...]]]
) -> dict[str, tuple[Any, Any]]:
    """Each job `(main, work)` as `main(work, torch threads, pipe)` in a spawned process, all
    started together; {name: (what it said once ready, its pipe)}. Each process stops when
    `stack` closes."""
    spawn = multiprocessing.get_context("spawn")
    started = {}
    for name, (main, work) in jobs.items():
        ours, theirs = spawn.Pipe()
        process = spawn.Process(
            target=main, args=(work, torch.get_num_threads(), theirs), daemon=True
        )
        process.start()
        stack.callback(_stop_child, process, ours)
        started[name] = (process, ours)
    return {name: (_ready(process, pipe), pipe) for name, (process, pipe) in started.items()}


def _ready(process: Any, pipe: Any) -> Any:
    if not pipe.poll(300):
        raise RuntimeError("a benchmark process did not start in 300 s")
    try:
        kind, value = pipe.recv()
    except EOFError:
        raise RuntimeError(f"a benchmark process ended (exit code {process.exitcode})") from None
    if kind != "ready":
        raise RuntimeError(f"a benchmark process failed: {value}")
    return value


def _stop_child(process: Any, pipe: Any) -> None:
    with contextlib.suppress(OSError):
        pipe.send("stop")
    process.join(timeout=60)
    if process.is_alive():
        process.terminate()
        process.join(timeout=10)


def _in_child(threads: int) -> None:
    """What each process of this section does first: serve's allocator setting, the parent's
    torch threads."""
    package = __package__.rpartition(".")[0]
    importlib.import_module(f"{package}.serving.engine").keep_freed_memory()
    torch.set_num_threads(threads)


def call(pipe: Any) -> Any:
    """One direct call, run in its process: what it returned."""
    pipe.send("call")
    kind, value = pipe.recv()
    if kind != "done":
        raise RuntimeError(f"the direct call failed: {value}")
    return value


def direct_in_child(work: tuple[Any, ...], threads: int, pipe: Any) -> None:
    """The direct calls' process: `factory(*arguments)` builds the call, which runs on a
    thread of its own (as serve's model thread) each time the parent asks, until it says
    stop."""
    try:
        _in_child(threads)
        factory, *arguments = work
        call = factory(*arguments)
    except Exception as error:  # said to the parent, which raises it in its section
        pipe.send(("error", f"{type(error).__name__}: {error}"))
        return

    def answer() -> None:
        with contextlib.suppress(EOFError, OSError):
            while pipe.recv() == "call":
                try:
                    pipe.send(("done", call()))
                except Exception as error:  # the parent raises it
                    pipe.send(("error", f"{type(error).__name__}: {error}"))

    pipe.send(("ready", None))
    thread = threading.Thread(target=answer, name="direct")
    thread.start()
    thread.join()


def serve_in_child(app: tuple[Any, ...], threads: int, pipe: Any) -> None:
    """The server's process: serve's allocator setting, the parent's torch threads, the app
    on uvicorn until the parent says stop (or goes away)."""
    import uvicorn

    try:
        _in_child(threads)
        factory, *arguments = app
        config = uvicorn.Config(
            factory(*arguments), host="127.0.0.1", port=0, log_level="warning", access_log=False
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, name="server", daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        pipe.send(("ready", server.servers[0].sockets[0].getsockname()[1]))
    except Exception as error:  # said to the parent, which raises it in its section
        pipe.send(("error", f"{type(error).__name__}: {error}"))
        return
    with contextlib.suppress(EOFError, OSError):
        pipe.recv()
    server.should_exit = True
    thread.join(timeout=60)
