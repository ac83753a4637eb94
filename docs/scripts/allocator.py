"""What `serve`'s allocator setting (serving.engine.keep_freed_memory) buys: batch-1 inference
of the project's default image model at 224 pixels, on a model thread as serve runs it, in two
processes side by side: one with glibc's default allocator, one with the setting. The parent
asks each in turn for a round of timed calls (interleaved rounds); it prints each side's median
per call and the per-round ratio kept / default (median and IQR).

From the root of an image project generated with the default package name:

    OMP_NUM_THREADS=2 PYTHONPATH=src python docs/scripts/allocator.py ROUNDS CALLS
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import threading
import time
from typing import Any

SIZE = 224


def child(keep: bool, pipe: Any) -> None:
    """Times CALLS batch-1 forward passes on a thread of its own each time the parent asks."""
    import my_torch_project  # noqa: F401  (the package's import registers the models)
    import torch
    from my_torch_project.config import parse_config
    from my_torch_project.serving.engine import keep_freed_memory
    from my_torch_project.training.data_sources import DataInfo
    from my_torch_project.training.task import build_model_for

    applied = keep_freed_memory() if keep else False
    config = parse_config(["--image-size", str(SIZE)])[0]
    torch.manual_seed(0)
    model = build_model_for(config, DataInfo(3, SIZE, 10, True)).eval()
    image = torch.rand(1, 3, SIZE, SIZE)
    pipe.send(applied)
    while (calls := pipe.recv()) is not None:
        times: list[float] = []

        def run(calls: int = calls, times: list[float] = times) -> None:
            with torch.inference_mode():
                for _ in range(calls):
                    began = time.perf_counter()
                    model(image)
                    times.append(time.perf_counter() - began)

        thread = threading.Thread(target=run, name="model-worker")
        thread.start()
        thread.join()
        pipe.send(statistics.median(times))


def main(rounds: int, calls: int) -> None:
    spawn = multiprocessing.get_context("spawn")
    pipes, processes = {}, []
    for name, keep in (("default", False), ("kept", True)):
        ours, theirs = spawn.Pipe()
        process = spawn.Process(target=child, args=(keep, theirs), daemon=True)
        process.start()
        processes.append(process)
        pipes[name] = ours
    print({name: f"setting applied: {pipe.recv()}" for name, pipe in pipes.items()})
    for pipe in pipes.values():  # a warm-up round each, not counted
        pipe.send(calls)
        pipe.recv()
    medians: dict[str, list[float]] = {name: [] for name in pipes}
    for _ in range(rounds):
        for name, pipe in pipes.items():
            pipe.send(calls)
            medians[name].append(pipe.recv())
    for pipe in pipes.values():
        pipe.send(None)
    for process in processes:
        process.join()
    for name, values in medians.items():
        print(
            f"{name:8s} median per call {1e3 * statistics.median(values):.2f} ms "
            f"(rounds {', '.join(f'{1e3 * v:.1f}' for v in values)})"
        )
    ratios = sorted(k / d for k, d in zip(medians["kept"], medians["default"], strict=True))
    quartiles = statistics.quantiles(ratios, n=4, method="inclusive")
    print(
        f"kept / default: {statistics.median(ratios):.2f} "
        f"(IQR {quartiles[0]:.2f}-{quartiles[2]:.2f}, {rounds} rounds of {calls} calls)"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
