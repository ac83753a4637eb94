"""Ranks forked from a test, as torchrun starts them (gloo on the CPU): `ranks(world, job,
*args)` runs `job(*args)` on each and returns their results by rank. Forked, not spawned: a
rank starts with the test's state (its registry, its patched functions) and in a fraction of
a second; each ends with `os._exit`, so no interpreter teardown runs after gloo.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import traceback
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, world: int, port: int, results, job, args) -> None:
    """One torchrun rank (gloo on the CPU): `job(*args)`, its result sent back."""
    try:
        torch.set_num_threads(1)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))  # fmt: skip
        results.put({"rank": rank, **job(*args)})
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})
    finally:
        results.close()
        results.join_thread()  # the result is sent before the process ends
        os._exit(0)  # no interpreter teardown after gloo in a forked child


def ranks(world: int, job, *args) -> list[dict[str, Any]]:
    """`job(*args)` on `world` ranks forked from here, as torchrun starts them: their
    results, by rank."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_rank, args=(rank, world, port, results, job, args))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    found: dict[int, dict[str, Any]] = {}
    try:
        for _ in range(world):
            item = results.get(timeout=120)
            found[item["rank"]] = item
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    for item in found.values():
        assert "error" not in item, item["error"]
    return [found[rank] for rank in range(world)]
