"""Metrics: running sums that stay on the device, and a writer for metrics.jsonl/TensorBoard.

Reading a device tensor (`.item()`, `.tolist()`, `float()`) waits for the device to finish
all queued work. `Meter` therefore only adds on the device and reads everything in one
transfer when a log line is due.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from . import distributed
from .config import ConfigError


class Meter:
    """Sums of loss, correct predictions, samples and gradient norms over a log interval.

    Under fp16 a step whose gradients overflowed is skipped by the GradScaler; its norm is
    inf or NaN. Such steps are counted (`skipped_steps`) and left out of the mean norm, which
    averages the finite norms only.
    """

    def __init__(self, device: torch.device, world_size: int = 1):
        self.device = device
        self.world_size = world_size
        self.reset()

    def reset(self) -> None:
        self.loss = torch.zeros((), device=self.device)
        self.correct = torch.zeros((), device=self.device)
        self.grad_norm = torch.zeros((), device=self.device)
        self.finite_steps = torch.zeros((), device=self.device)
        self.batches = 0  # host counters: known without asking the device
        self.samples = 0
        self.steps = 0
        self.data_time = 0.0
        self.started = time.perf_counter()

    def add_batch(self, loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        self.loss += loss.detach()
        self.correct += (logits.argmax(1) == targets).sum()  # argmax records no graph
        self.batches += 1
        self.samples += targets.shape[0]

    def add_step(self, grad_norm: torch.Tensor) -> None:
        norm = grad_norm.detach().float()
        finite = torch.isfinite(norm)  # on the device: no sync
        self.grad_norm += torch.where(finite, norm, torch.zeros_like(norm))
        self.finite_steps += finite
        self.steps += 1

    def read(self) -> dict[str, float]:
        """Sum over ranks and read once: the only host sync of a log interval."""
        elapsed = time.perf_counter() - self.started
        values = torch.stack(
            [
                self.loss.float(),
                self.correct.float(),
                self.grad_norm.float(),
                self.finite_steps.float(),
                torch.tensor(float(self.batches), device=self.device),
                torch.tensor(float(self.samples), device=self.device),
                torch.tensor(self.data_time, device=self.device),
            ]
        )
        loss, correct, grad_norm, finite, batches, samples, data_time = distributed.all_reduce(
            values
        ).tolist()
        # Every rank holds the same (all-reduced) gradient norm and skips the same steps;
        # data time is averaged.
        return {
            "loss_sum": loss,
            "correct": correct,
            "grad_norm_sum": grad_norm / self.world_size,
            "finite_steps": round(finite / self.world_size),
            "batches": batches,
            "samples": samples,
            "steps": self.steps,
            "data_time": data_time / self.world_size,
            "elapsed": elapsed,
        }


def summarize(totals: dict[str, float]) -> dict[str, float]:
    """Turn summed counters (from `Meter.read`, possibly added up) into reported metrics."""
    batches, samples = max(totals["batches"], 1), max(totals["samples"], 1)
    finite = totals.get("finite_steps", totals["steps"])
    elapsed = max(totals["elapsed"], 1e-9)
    return {
        "loss": totals["loss_sum"] / batches,
        "acc": totals["correct"] / samples,
        # The mean over steps with a finite norm (None-like NaN when there were none);
        # totals from before `finite_steps` existed count every step as finite.
        "grad_norm": (totals["grad_norm_sum"] / finite if finite else math.nan),
        "skipped_steps": totals["steps"] - finite,
        "samples_per_s": totals["samples"] / elapsed,
        "data_wait": totals["data_time"] / elapsed,
    }


def add_totals(into: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    for key, value in more.items():
        into[key] = into.get(key, 0.0) + value
    return into


class MetricsWriter:
    """Append one JSON object per line to run_dir/metrics.jsonl (and TensorBoard, if asked).

    Only rank 0 writes: build it with `enabled=False` on the other ranks. The file is opened
    in append mode, so a resumed run continues the same file.
    """

    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool = False):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._file = None
        self._tensorboard: Any = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1, encoding="utf-8")
        if tensorboard:
            try:  # imported only when asked for: the project runs without tensorboard installed
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError(
                    "--tensorboard needs the tensorboard package: pip install "
                    "tensorboard, or pass --no-tensorboard"
                ) from None
            self._tensorboard = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        self._file.write(json.dumps(clean) + "\n")
        if self._tensorboard is not None:
            kind, step = record.get("kind", "train"), record.get("step", 0)
            for key, value in record.items():
                if key not in ("kind", "step", "epoch", "global_step") and isinstance(
                    value, (int, float)
                ):
                    self._tensorboard.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
