"""Metrics: running sums that stay on the device, a writer for metrics.jsonl and a tracker.

Reading a device tensor (`.item()`, `.tolist()`, `float()`) waits for the device to finish
all queued work. `Meter` therefore only adds on the device and reads everything in one
transfer when a log line is due.
"""

from __future__ import annotations

import json
import math
import platform
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from ..checkpointing.checkpoint import SaveError
from ..observability import trackers
from ..runtime import distributed
from ..settings.base import ConfigError


class SetTotals:
    """The totals of the set-level validation metrics (slots.set_metric) over the batches
    seen, on the device; `flat()` for the one all-reduce with the other sums, `finish` on
    what came back."""

    def __init__(self, metrics: list[Any]):
        self.metrics = metrics
        self.sums: list[dict[str, torch.Tensor]] = [{} for _ in metrics]

    def add(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        for metric, sums in zip(self.metrics, self.sums, strict=True):
            for name, value in metric.update(logits, targets).items():
                value = torch.as_tensor(value, device=logits.device).float()
                if name in sums and sums[name].shape != value.shape:
                    raise ConfigError(
                        f"the set metric {metric.update.__name__} (slots.set_metric) returned "
                        f"{name!r} of shape {tuple(value.shape)} after "
                        f"{tuple(sums[name].shape)}: each of its values needs a fixed shape"
                    )
                sums[name] = sums[name] + value if name in sums else value

    def flat(self) -> list[torch.Tensor]:
        return [sums[name].reshape(-1) for sums in self.sums for name in sorted(sums)]

    def finish(self, reduced: torch.Tensor) -> dict[str, float]:
        """Each metric's `finish` on its totals, read from `reduced` (`flat()`, all-reduced)."""
        found: dict[str, float] = {}
        at = 0
        for metric, sums in zip(self.metrics, self.sums, strict=True):
            totals = {}
            for name in sorted(sums):
                size = sums[name].numel()
                totals[name] = reduced[at : at + size].view(sums[name].shape).cpu()
                at += size
            found.update({name: float(value) for name, value in metric.finish(totals).items()})
        return found


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
        self.extra: dict[str, torch.Tensor] = {}  # `@slots.train_metric` sums, by name
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
        """Sum over ranks and read once: the only host sync of a log interval.

        The device's sums come back in one read. The host's counts stay on the host in a
        single process; under torchrun they travel with the sums (one copy, not one each).
        """
        elapsed = time.perf_counter() - self.started
        sums = [self.loss, self.correct, self.grad_norm, self.finite_steps]
        sums += [self.extra[name] for name in sorted(self.extra)]
        values = torch.stack([value.float() for value in sums])
        host = [float(self.batches), float(self.samples), self.data_time]
        if distributed.enabled():
            counts = torch.tensor(host, pin_memory=self.device.type == "cuda")
            values = torch.cat([values, counts.to(self.device, non_blocking=True)])
            read = distributed.all_reduce(values).tolist()
        else:
            read = values.tolist() + host
        loss, correct, grad_norm, finite, *rest = read
        *extra, batches, samples, data_time = rest
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
            **{EXTRA + name: total for name, total in zip(sorted(self.extra), extra, strict=True)},
        }


EXTRA = "metric:"  # a registered training metric's sum in Meter.read's totals


def summarize(totals: dict[str, float]) -> dict[str, float]:
    """Turn summed counters (from `Meter.read`, possibly added up) into reported metrics: the
    template's, then each registered training metric's mean per sample, under its name."""
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
        **extra_means(totals),
    }


def extra_means(totals: dict[str, float], prefix: str = "") -> dict[str, float]:
    """Each registered training metric's mean per sample, by `prefix` + its name."""
    samples = max(totals["samples"], 1)
    found = {key[len(EXTRA) :]: value for key, value in totals.items() if key.startswith(EXTRA)}
    return {prefix + name: value / samples for name, value in found.items()}


def add_totals(into: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    for key, value in more.items():
        into[key] = into.get(key, 0.0) + value
    return into


class MetricsWriter:
    """Append one JSON object per line to run_dir/metrics.jsonl, and the same to a tracker.

    Only rank 0 writes: build it with `enabled=False` on the other ranks. The file is opened
    in append mode, so a resumed run continues the same file. `tracker` is a name from
    `trackers.TRACKERS`; one that cannot start raises ConfigError before anything is written.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        tracker: str = "none",
        experiment: str = "default",
        tracker_uri: str | None = None,
        resuming: bool = False,
    ):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._file = None
        self._tracker: trackers.Tracker | None = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._tracker = trackers.open_tracker(
                tracker, run_dir, experiment=experiment, uri=tracker_uri, resuming=resuming
            )
            self._file = self.path.open("a", buffering=1, encoding="utf-8")
        except trackers.TrackerError as error:
            self.close()
            raise ConfigError(str(error)) from None
        except OSError as error:  # metrics.jsonl a folder, a tracker folder it cannot open
            self.close()
            where = error.filename or self.path
            raise ConfigError(
                f"{where} cannot be written ({error.strerror or error}); move it aside or fix "
                f"its permissions, or choose another --run-dir"
            ) from None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        try:
            self._file.write(json.dumps(clean) + "\n")
            if self._tracker is not None:
                self._tracker.write(record)
        except OSError as error:  # a disk that filled, a tracker folder that became read-only
            where, why = error.filename or self.path, error.strerror or error
            message = f"{where} cannot be written ({why}); checkpoints are as last saved"
            raise SaveError(message) from None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tracker is not None:
            tracker, self._tracker = self._tracker, None
            tracker.close()


def run_record(config: dict[str, Any], device: torch.device, world_size: int) -> dict[str, Any]:
    """The "run" record: what ran (config, git commit, dirty flag) and where (environment).

    Written first to metrics.jsonl and the tracker on every start or resume, and saved in
    checkpoints, so two runs can be compared after the fact.
    """
    commit, dirty = _git_state(Path(__file__).resolve().parent)
    cuda = device.type == "cuda"
    return {
        "kind": "run",
        "git_commit": commit,
        "git_dirty": dirty,
        "python": platform.python_version(),
        "torch": str(torch.__version__),  # a str subclass that weights_only loading refuses
        "cuda": torch.version.cuda,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else platform.machine(),
        "world_size": world_size,
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),  # UTC
        "config": config,
    }


def _git_state(folder: Path) -> tuple[str | None, bool | None]:
    """The commit the code in `folder` is at, and whether tracked files differ from it.

    (None, None) outside a git checkout or without git: an installed wheel has no history.
    """

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, None if status is None else bool(status)


def peak_memory(device: torch.device) -> dict[str, float]:
    """The most memory the run's tensors held on a CUDA device so far, and the most the
    caching allocator reserved (what runs out first: freed blocks stay reserved, fragmented),
    in GiB; nothing elsewhere."""
    if device.type != "cuda":
        return {}
    return {
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
    }
