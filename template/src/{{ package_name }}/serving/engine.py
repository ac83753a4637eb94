"""The one thread that runs the model: every torch call of the server happens on it, so
requests arriving together never run the model at the same time from two threads.

Two kinds of work reach it from the event loop:

- streams (the language model): a generator that does one token's work per step
  (generate.decode). Up to `max_active` run interleaved, one step of each in turn, so a long
  answer does not hold back a short one; the rest wait in arrival order. A stream whose client
  went away is closed before its next step. Its items go to the event loop one by one
  (`stream`, for server-sent events) or all at its end (`whole`, for one JSON body).
- batched items (images): up to `max_batch` of those waiting go through `batch_fn` together:
  with `batch_wait` 0 (serve's default) the ones that queued while the model ran, so one
  client never waits and many form batches by themselves; above 0, the first waits up to
  `batch_wait` seconds for others.

`keep_freed_memory()` (serve calls it first) makes glibc's allocator keep the memory a forward
pass frees for the next one, instead of handing it back to the system and faulting it in again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator
from dataclasses import dataclass, field
from typing import Any

# glibc's mallopt parameters (malloc.h) and the size both are raised to
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_BYTES = 2**30


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory in the process for reuse (up to 1 GiB blocks
    from its heap, none trimmed back to the system), where by default a large block is a fresh
    mmap that the next forward pass faults in page by page, and a thread's heap is trimmed
    after each request. Measured on a 2-core AMD EPYC (torch 2.13 CPU), batch-1 inference of a
    small CNN at 224 pixels: 12-15 ms against 18-24 ms, and no longer slower on a worker thread
    than on the main one. The price: the process keeps its peak memory. True where it applied
    (Linux with glibc); elsewhere nothing changes."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...): its allocator stays as it is
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)
    )


@dataclass
class Stream:
    steps: Generator[Any, None, Any]
    deliver: Callable[[str, Any], None]  # ("item" | "done" | "error", value), on any thread
    cancelled: bool = False
    kept: list[Any] | None = None  # whole(): the items, delivered once with the end


@dataclass
class Item:
    value: Any
    deliver: Callable[[str, Any], None]
    at: float = field(default_factory=time.monotonic)


class Worker:
    """The model's thread; `stop()` ends it after the work it holds."""

    def __init__(
        self,
        *,
        max_active: int = 1,
        max_batch: int = 1,
        batch_wait: float = 0.0,
        batch_fn: Callable[[list[Any]], list[Any]] | None = None,
    ):
        self.max_active, self.max_batch, self.batch_wait = max_active, max_batch, batch_wait
        self.batch_fn = batch_fn
        self.waiting: collections.deque[Stream] = collections.deque()
        self.active: list[Stream] = []
        self.items: collections.deque[Item] = collections.deque()
        self.batches = 0  # forward passes over batched items (the metrics show them)
        self.seconds = 0.0  # time spent running the model (steps and batches)
        self.cancelled = 0  # streams closed before their end (their client went away)
        self.stopping = False
        self.condition = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="model-worker", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        with self.condition:
            self.stopping = True
            self.condition.notify()
        self.thread.join()

    def busy(self) -> int:
        """Streams running or waiting."""
        with self.condition:
            return len(self.active) + len(self.waiting)

    async def stream(self, steps: Generator[Any, None, Any]) -> AsyncIterator[tuple[str, Any]]:
        """The steps' items as ("item", value), then ("done", returned) or ("error", exc);
        leaving the loop early (a client gone) closes the generator on the worker."""
        queue, job = self._job(steps)
        try:
            while True:
                kind, value = await queue.get()
                yield kind, value
                if kind != "item":
                    return
        finally:
            job.cancelled = True
            with self.condition:
                self.condition.notify()

    async def whole(self, steps: Generator[Any, None, Any]) -> tuple[list[Any], Any]:
        """(the steps' items, what they returned), handed over once at the end: an answer
        nobody reads piece by piece costs the event loop one wake-up, not one per token (each
        of which holds the model's thread on the interpreter lock while the loop runs).
        Cancelling the caller (a client gone) closes the generator on the worker."""
        queue, job = self._job(steps, keep=True)
        try:
            kind, value = await queue.get()
        finally:
            job.cancelled = True
            with self.condition:
                self.condition.notify()
        if kind == "error":
            raise value
        return value

    def _job(
        self, steps: Generator[Any, None, Any], keep: bool = False
    ) -> tuple[asyncio.Queue[Any], Stream]:
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        job = Stream(steps, _deliverer(queue), kept=[] if keep else None)
        with self.condition:
            self.waiting.append(job)
            self.condition.notify()
        return queue, job

    async def submit(self, value: Any) -> Any:
        """`batch_fn`'s result for `value`, computed in a batch with what arrives meanwhile."""
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        with self.condition:
            self.items.append(Item(value, _deliverer(queue)))
            self.condition.notify()
        kind, result = await queue.get()
        if kind == "error":
            raise result
        return result

    def _run(self) -> None:
        while True:
            with self.condition:
                while not (self.stopping or self.waiting or self.active or self.items):
                    self.condition.wait()
                if self.stopping and not (self.waiting or self.active or self.items):
                    return
                self.active = [job for job in self.active if not self._dropped(job)]
                self.waiting = collections.deque(j for j in self.waiting if not self._dropped(j))
                while self.waiting and len(self.active) < self.max_active:
                    job = self.waiting.popleft()
                    if not self._dropped(job):
                        self.active.append(job)
                batch = self._gather() if self.items else []
                active = list(self.active)
            started = time.perf_counter()
            if batch:
                self._run_batch(batch)
            for job in active:
                self._step(job)
            self.seconds += time.perf_counter() - started

    def _dropped(self, job: Stream) -> bool:
        if job.cancelled:
            job.steps.close()  # runs the generator's cleanup; no more tokens for it
            self.cancelled += 1
        return job.cancelled

    def _gather(self) -> list[Item]:
        """Up to max_batch items, once the first has waited batch_wait (or the batch is full);
        called holding the condition."""
        while len(self.items) < self.max_batch and not self.stopping:
            left = self.items[0].at + self.batch_wait - time.monotonic()
            if left <= 0:
                break
            self.condition.wait(left)
        count = min(self.max_batch, len(self.items))
        return [self.items.popleft() for _ in range(count)]

    def _run_batch(self, batch: list[Item]) -> None:
        assert self.batch_fn is not None
        try:
            results = self.batch_fn([item.value for item in batch])
        except Exception as error:  # reported to each request, the worker goes on
            for item in batch:
                item.deliver("error", error)
            return
        self.batches += 1
        for item, result in zip(batch, results, strict=True):
            item.deliver("done", result)

    def _step(self, job: Stream) -> None:
        if job.cancelled:
            return
        try:
            item = next(job.steps)
            if job.kept is None:
                job.deliver("item", item)
            else:
                job.kept.append(item)
            return
        except StopIteration as finished:
            job.deliver("done", finished.value if job.kept is None else (job.kept, finished.value))
        except Exception as error:
            job.deliver("error", error)
        with self.condition:
            self.active.remove(job)


def _deliverer(queue: asyncio.Queue[Any]) -> Callable[[str, Any], None]:
    """Hands (kind, value) from the worker thread to `queue` on the caller's event loop."""
    loop = asyncio.get_running_loop()

    def deliver(kind: str, value: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

    return deliver
