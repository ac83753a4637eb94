"""The seven everyday PyTorch techniques, done the way current PyTorch documents them.

1. Seeding and determinism        seed_everything, seed_worker, set_deterministic
2. Anomaly detection (debugging)  anomaly_detection, check_finite, diagnose_nonfinite
3. DataLoader workers             resolve_num_workers, build_dataloader, tune_num_workers,
                                  auto_num_workers (measured, cached)
4. pin_memory + non_blocking      build_dataloader (pins), to_device (non_blocking)
5. torch.compile                  maybe_compile, unwrap_model
6. Evaluation without autograd    evaluation_mode
7. Gradient clipping              clip_gradients

Nothing else lives here: device selection, mixed precision and synchronisation for timing
are in runtime/accelerator.py.

This file belongs to the template: `copier update` keeps improving it. Put project-specific
code in your own modules rather than editing it, so updates apply cleanly.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import json
import math
import os
import platform
import random
import re
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from .runtime.stopping import STOP_SIGNALS, stops_between_batches

__all__ = [
    "NonFiniteLossError",
    "anomaly_detection",
    "auto_num_workers",
    "available_cpus",
    "build_dataloader",
    "cache_dir",
    "check_finite",
    "clip_gradients",
    "close_workers",
    "diagnose_nonfinite",
    "evaluation_mode",
    "maybe_compile",
    "resolve_num_workers",
    "seed_everything",
    "seed_worker",
    "set_deterministic",
    "to_device",
    "tune_num_workers",
    "unwrap_model",
]

# --------------------------------------------------------------------------------------------
# 1. Seeding and determinism
# --------------------------------------------------------------------------------------------


def seed_everything(seed: int, deterministic: bool = False) -> torch.Generator:
    """Seed Python, NumPy (if installed) and torch, and return a seeded DataLoader generator.

    `torch.manual_seed` seeds every device, CUDA included. The returned generator drives the
    DataLoader's shuffling and its workers' base seeds, so data order does not depend on how
    much global randomness the model consumed first. Seed 0 is a valid seed.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)
    set_deterministic(deterministic)
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def set_deterministic(enabled: bool, *, warn_only: bool = False) -> None:
    """Turn bitwise-reproducible kernels on or off (they cost speed, so this is opt-in).

    An op without a deterministic implementation raises (or warns, with `warn_only`).
    cuBLAS needs CUBLAS_WORKSPACE_CONFIG set before CUDA is first used (torch <= 2.9;
    harmless later). cudnn.benchmark picks kernels by timing, which is not repeatable.
    """
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    # use_deterministic_algorithms imports torch's whole compiler stack (torch._inductor:
    # about 4 s of CPU in every command that starts): called only to turn the mode on or off.
    if enabled or torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.backends.cudnn.deterministic = enabled


def ignore_stop_signals() -> None:
    """In a DataLoader worker: leave stop signals to the main process, which saves and exits.

    A process-group signal (SLURM, Kubernetes, Ctrl-C) reaches the workers too; PyTorch's
    worker handler dies of it, and the main process would report a crashed worker instead of
    saving. Ignored here, a worker keeps serving batches until the main process shuts it down
    (and exits by itself if the main process is gone).
    """
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def seed_worker(worker_id: int) -> None:
    """DataLoader `worker_init_fn` from PyTorch's reproducibility notes.

    Each worker's torch seed is `base_seed + worker_id`, with `base_seed` drawn from the
    loader's generator. Current PyTorch also reseeds `random` and NumPy in each worker; this
    hook derives both from that torch seed explicitly, so random augmentations differ across
    workers and repeat across runs whatever the DataLoader does, and it is the one place to
    seed any other RNG the dataset uses.
    """
    del worker_id  # torch.initial_seed() already differs per worker
    # A signal to the process group is the main process's to handle (it saves and exits).
    # The worker started with stop signals blocked (SignalSafeLoader): ignored now, one that
    # arrived meanwhile is discarded when they are unblocked.
    ignore_stop_signals()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    worker_seed = torch.initial_seed() % 2**32
    random.seed(worker_seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(worker_seed)


# --------------------------------------------------------------------------------------------
# 2. Anomaly detection: a debug switch, plus a cheap check that is always on
# --------------------------------------------------------------------------------------------


class NonFiniteLossError(RuntimeError):
    """A loss (or gradient norm) came out NaN or Inf."""

    def __init__(self, message: str, *, step: int | None = None, value: float | None = None):
        super().__init__(message)
        self.step = step
        self.value = value


def anomaly_detection(enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
    """Context manager for autograd anomaly detection. Wrap the forward AND the backward.

    Anomaly mode records a traceback for every forward op, so when a backward function
    returns NaN the error names the op (e.g. `SqrtBackward0`) and the warning shows the
    forward line that created it. Wrapping only `backward()` raises too, but cannot show
    that forward traceback. It checks NaN only, not Inf (see `check_finite`), and slows every
    step, so it is off by default; `diagnose_nonfinite` turns it on for one batch instead.
    """
    if not enabled:
        return contextlib.nullcontext()
    # detect_anomaly switches the mode on when entered (set_detect_anomaly would switch it on
    # as soon as it is constructed) and restores the previous mode on exit.
    return torch.autograd.detect_anomaly(check_nan=True)


def check_finite(value: torch.Tensor, *, step: int | None = None, what: str = "loss") -> None:
    """Raise `NonFiniteLossError` if `value` holds a NaN or Inf.

    Anomaly mode ignores Inf, so this is the check that catches both. Reading the flag is a
    host sync: call it once per optimizer step (or less), not per op.
    """
    finite = torch.isfinite(value.detach())
    if bool(finite.all()):
        return
    number = float(value.detach().reshape(-1)[~finite.reshape(-1)][0])
    where = f" at step {step}" if step is not None else ""
    raise NonFiniteLossError(f"non-finite {what}{where}: {number}", step=step, value=number)


def _source_of(module: nn.Module) -> str:
    try:
        forward = type(module).forward
        path = inspect.getsourcefile(forward)
        line = inspect.getsourcelines(forward)[1]
    except (OSError, TypeError):
        return type(module).__qualname__
    with contextlib.suppress(ValueError):  # relpath fails across Windows drives
        path = os.path.relpath(path) if path else path
    return f"{path or '?'}:{line}"


def diagnose_nonfinite(model: nn.Module, step_fn: Callable[[], Any]) -> str:
    """Re-run one forward+backward (`step_fn`) to find where a NaN/Inf first appears.

    Call it on the batch whose loss was non-finite, before the optimizer steps. It watches
    every module's output during the forward (catches Inf, which anomaly mode does not) and
    runs under anomaly detection (names the backward op that made a NaN and the forward line
    that created it). Returns a one-line description; never raises for the anomaly itself.
    """
    findings: list[str] = []
    names = {module: name or type(model).__name__ for name, module in model.named_modules()}

    def first_bad(tensors: Any) -> bool:
        flat = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
        return any(
            isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all()
            for t in flat
        )

    def hook(module: nn.Module, inputs: Any, output: Any) -> None:
        if findings or not first_bad(output) or first_bad(inputs):
            return
        kind = type(module).__name__
        findings.append(
            f"forward: module '{names.get(module, kind)}' ({kind}, {_source_of(module)}) "
            "produced a non-finite output from finite inputs"
        )

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with anomaly_detection(True):
                    step_fn()
            except NonFiniteLossError:
                pass  # the step's own loss check; the hooks have recorded where the value went bad
            except RuntimeError as error:
                message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
                origin = _forward_origin(caught)
                kind = "backward" if "returned nan values" in message else "error"
                findings.append(f"{kind}: {message}" + (f" ({origin})" if origin else ""))
    finally:
        for handle in handles:
            handle.remove()
    if not findings:
        return "no op produced a NaN or Inf when the batch was re-run (the input data may hold one)"
    return "; ".join(findings)


_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


def _forward_origin(caught: Sequence[warnings.WarningMessage]) -> str:
    """The forward line behind an anomaly: the innermost frame outside torch, plus torch's own."""
    for warning in caught:
        text = str(warning.message)
        if "Traceback of forward call" not in text:
            continue
        lines = text.splitlines()
        frames = []
        for index, line in enumerate(lines):
            match = _FRAME.match(line)
            if match:
                following = lines[index + 1] if index + 1 < len(lines) else ""
                code = "" if _FRAME.match(following) else following.strip()
                frames.append((match["path"], match["line"], match["func"], code))
        if not frames:
            return ""
        torch_dir = os.path.dirname(torch.__file__) + os.sep
        user = [frame for frame in frames if not frame[0].startswith(torch_dir)]
        path, line, func, code = user[-1] if user else frames[-1]
        origin = f"forward call at {path}:{line} in {func}" + (f": {code}" if code else "")
        if user and frames[-1] is not user[-1]:
            inner = frames[-1]
            origin += f" (inside torch at {os.path.basename(inner[0])}:{inner[1]} in {inner[2]})"
        return origin
    return ""


# --------------------------------------------------------------------------------------------
# 3. DataLoader workers (build_dataloader also pins, technique 4)
# --------------------------------------------------------------------------------------------


def available_cpus() -> int:
    """CPUs this process may run on (respects taskset, cgroups via affinity, SLURM binding)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no sched_getaffinity
        return os.cpu_count() or 1


def resolve_num_workers(
    requested: int | str, world_size: int = 1, *, in_memory: bool = False
) -> int:
    """Turn `--num-workers` (an int or "auto") into a worker count for one rank.

    "auto" shares the CPUs this process may use among the `world_size` ranks on this node
    and leaves one per rank for the main process, which runs the training loop. A dataset
    that is already a tensor in memory (`in_memory=True`) gets 0: workers would only add
    inter-process copies. This is the guess; `auto_num_workers` measures (what training's
    `--num-workers auto` uses).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if isinstance(requested, str):
        if requested.strip().lower() == "auto":
            if in_memory:
                return 0
            return max(0, available_cpus() // world_size - 1)
        try:
            requested = int(requested)
        except ValueError:
            raise ValueError(
                f"num_workers must be a non-negative integer or 'auto', got {requested!r}"
            ) from None
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        raise ValueError(f"num_workers must be a non-negative integer or 'auto', got {requested!r}")
    return requested


def build_dataloader(
    dataset: Dataset[Any],
    *,
    batch_size: int,
    train: bool,
    num_workers: int,
    generator: torch.Generator | None = None,
    sampler: Sampler[Any] | None = None,
    device: torch.device | str | None = None,
    prefetch_factor: int = 2,
    persistent_workers: bool = True,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader[Any]:
    """Build a DataLoader with the settings that are right for training or for evaluation.

    - Training shuffles and drops the last partial batch (stable shapes for torch.compile, no
      BatchNorm batch of one); evaluation keeps order and every sample.
    - `persistent_workers` and `prefetch_factor` are only valid with workers, so they are
      only passed when `num_workers > 0` (PyTorch raises ValueError otherwise).
    - Batches are pinned by the loader's own thread when the target device is CUDA, so
      `to_device(..., non_blocking=True)` overlaps the copy with compute. Without an
      accelerator pinning only warns, so it is off.
    - `seed_worker` and the seeded `generator` make worker randomness reproducible.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    kwargs: dict[str, Any] = {}
    if num_workers > 0:
        kwargs["persistent_workers"] = persistent_workers
        kwargs["prefetch_factor"] = prefetch_factor
    return SignalSafeLoader(
        dataset,
        batch_size=batch_size,
        shuffle=train and sampler is None,
        sampler=sampler,
        drop_last=train,
        num_workers=num_workers,
        pin_memory=_pin_memory_for(device),
        worker_init_fn=seed_worker,
        generator=generator,
        collate_fn=collate_fn,
        **kwargs,
    )


class SignalSafeLoader(DataLoader[Any]):
    """A DataLoader whose workers start with the stop signals blocked.

    PyTorch's worker loop installs a SIGTERM handler that kills the worker before
    `worker_init_fn` (`seed_worker`) can ignore it: a process-group signal in that window, as
    an evaluation's workers start, killed one and the run exited 1 instead of saving. Blocked
    across the fork, the signal waits in the new worker until `seed_worker` ignores it.
    """

    def _get_iterator(self) -> Any:
        if self.num_workers == 0:
            return super()._get_iterator()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            return super()._get_iterator()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def close_workers(*loaders: DataLoader[Any]) -> None:
    """Stop the persistent worker processes of `loaders` now, whatever state they are in.

    Workers ignore stop signals (`ignore_stop_signals`), so the two ways PyTorch otherwise
    ends them both fail once an error has left a loader inside a reference cycle (a worker's
    exception re-raised in the main process makes one): the garbage collector closes the
    workers' queues before the loader's `__del__` can send them the final message, and at
    interpreter exit `multiprocessing` sends SIGTERM and joins them forever. Called when a
    run ends, however it ends, the shutdown works while the queues are still open.
    """
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)  # where persistent workers live
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            loader._iterator = None
            shutdown()


def tune_num_workers(
    dataset: Dataset[Any],
    *,
    batch_size: int,
    candidates: Iterable[int] | None = None,
    num_batches: int = 50,
    warmup_batches: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[int, dict[int, float]]:
    """Measure samples/s for each worker count and return the fastest and all results.

    The right worker count depends on how much CPU `__getitem__` costs and on this machine,
    so it is measured, not guessed. Worker start-up and the first prefetched batches are
    excluded (persistent workers pay them once per run); what is timed is the steady rate.
    """

    if candidates is None:
        cpus = available_cpus()
        candidates = sorted({0, *(n for n in (1, 2, 4, 8, 16, 32) if n <= cpus)})
    results: dict[int, float] = {}
    for workers in candidates:
        # A private generator: measuring must not consume the global RNG that seeds the run.
        loader = build_dataloader(
            dataset,
            batch_size=batch_size,
            train=True,
            num_workers=workers,
            device=device,
            generator=torch.Generator().manual_seed(0),
        )
        warmup = warmup_batches if warmup_batches is not None else max(1, 2 * workers)
        batches = _cycle(loader)
        try:  # a Ctrl-C waits for the batch in flight (stopping.stops_between_batches)
            with stops_between_batches() as check:
                for _ in range(warmup):
                    next(batches)
                    check()
                samples = 0
                start = time.perf_counter()
                for _ in range(num_batches):
                    samples += _batch_len(next(batches))
                    check()
                results[workers] = samples / (time.perf_counter() - start)
        finally:  # shut the workers down before the next candidate starts, or on an error
            close_workers(loader)
            del batches, loader
    if not results:
        raise ValueError("tune_num_workers needs at least one candidate")
    best = max(results, key=results.__getitem__)
    return best, results


def cache_dir() -> Path:
    """Where measurements are kept between runs: $XDG_CACHE_HOME/<package>, else
    ~/.cache/<package>. Delete it to measure again (after a hardware change, say)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / (__package__ or "torch-project").split(".")[0]


def auto_num_workers(
    dataset: Dataset[Any],
    *,
    batch_size: int,
    dataset_id: str,
    world_size: int = 1,
    in_memory: bool = False,
    device: torch.device | str | None = None,
    num_batches: int = 4,
    rounds: int = 3,
    cache: Path | None = None,
) -> tuple[int, dict[int, float], bool]:
    """`--num-workers auto`: the fastest worker count measured on this dataset, cached.

    Returns (workers, samples/s per candidate, whether it came from the cache). In-memory
    data gets 0 without measuring. Otherwise `tune_num_workers` times a few batches per
    candidate (0, 1, 2, 4, ... up to this rank's share of the CPUs) in `rounds` interleaved
    rounds, once per dataset
    (`dataset_id`, its length, the batch size) and machine (CPU model and count, ranks per
    node); the answer is kept in `cache` (default `cache_dir()`), so later runs start at
    once. A measurement that cannot run falls back to `resolve_num_workers("auto")`.
    """
    if in_memory:
        return 0, {}, False
    if os.path.exists(dataset_id):  # a folder: the same one from any working directory
        dataset_id = os.path.abspath(dataset_id)
    share = max(1, available_cpus() // world_size)
    candidates = sorted({0, *(n for n in (1, 2, 4, 8, 16, 32) if n <= share)})
    key = "|".join(
        [
            dataset_id,
            type(dataset).__name__,
            str(len(dataset)),  # type: ignore[arg-type]
            f"batch {batch_size}",
            cpu_name(),
            f"{available_cpus()} cpus",
            f"{world_size} ranks",
        ]
    )
    path = (cache if cache is not None else cache_dir()) / "num_workers.json"
    known: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads(path.read_text())
        known = loaded if isinstance(loaded, dict) else {}
    with contextlib.suppress(KeyError, ValueError, TypeError, AttributeError):
        found = known[key]
        rates = {int(k): float(v) for k, v in found["rates"].items()}
        return int(found["best"]), rates, True
    # Reading items may draw random numbers (augmentations in the main process, candidate
    # 0): the run's random streams must not depend on whether the answer was cached.
    python_state = random.getstate()
    numpy_random = sys.modules.get("numpy.random")
    numpy_state = numpy_random.get_state() if numpy_random is not None else None
    try:
        with torch.random.fork_rng(devices=[]):
            # Interleaved rounds in alternating order (a busy spell hits every count alike),
            # the median rate per count; the fewest workers within 3% of the fastest win.
            per_round: dict[int, list[float]] = {n: [] for n in candidates}
            for index in range(rounds):
                _, found = tune_num_workers(
                    dataset,
                    batch_size=batch_size,
                    candidates=candidates[:: -1 if index % 2 else 1],
                    num_batches=num_batches,
                    device=device,
                )
                for count, rate in found.items():
                    per_round[count].append(rate)
            rates = {n: sorted(r)[len(r) // 2] for n, r in per_round.items()}
            fastest = max(rates.values())
            best = min(n for n, rate in rates.items() if rate >= 0.97 * fastest)
    except Exception:  # a small or broken dataset: the guess, and training reports the fault
        return resolve_num_workers("auto", world_size), {}, False
    finally:
        random.setstate(python_state)
        if numpy_random is not None:
            numpy_random.set_state(numpy_state)
    known[key] = {"best": best, "rates": rates}
    try:  # atomically: ranks and runs on this machine share the file
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        scratch.write_text(json.dumps(known, indent=1) + "\n")
        scratch.replace(path)
    except OSError:
        pass  # a read-only home: measure again next time
    return best, rates, False


def cpu_name() -> str:
    """The CPU's model name (what cached measurements are keyed by)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cycle(loader: DataLoader[Any]) -> Iterator[Any]:
    for _ in itertools.count():
        yielded = False
        for batch in loader:
            yielded = True
            yield batch
        if not yielded:
            raise ValueError("the dataset is smaller than one batch; lower batch_size")


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, Mapping):
        return _batch_len(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)):
        return _batch_len(batch[0])
    raise TypeError(f"cannot tell the size of a batch of type {type(batch).__name__}")


# --------------------------------------------------------------------------------------------
# 4. pin_memory + non_blocking
# --------------------------------------------------------------------------------------------


def _pin_memory_for(device: torch.device | str | None) -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type in ("cuda", "xpu")


def to_device(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor in a (nested) tuple, list or dict to `device`, keeping the structure.

    Host-to-device copies use `non_blocking=True`: the copy is queued and the CPU moves on,
    which overlaps with compute when the source is pinned (the DataLoader pins it). Copies
    from an accelerator back to the host stay blocking: a non-blocking device-to-host copy
    can be read before it has landed.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=batch.device.type == "cpu")
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        if isinstance(batch, dict):
            copied = copy.copy(batch)  # keeps a dict subclass and its state (defaultdict)
            copied.update(moved)
            return copied
        try:
            return type(batch)(moved)  # type: ignore[call-arg]
        except TypeError:  # a read-only Mapping that cannot be built from a dict
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


# --------------------------------------------------------------------------------------------
# 5. torch.compile
# --------------------------------------------------------------------------------------------

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def maybe_compile(
    model: nn.Module,
    enabled: bool,
    mode: str = "default",
    backend: str | Callable[..., Any] = "inductor",
) -> nn.Module:
    """Return `torch.compile(model)` when enabled, else the model itself.

    Compile after moving the model to its device. Python control flow does not stop
    compilation: it becomes a graph break (only `fullgraph=True` refuses it), and a new input
    shape costs one recompile. "reduce-overhead" and "max-autotune" use CUDA graphs. The
    inductor backend needs a C++ compiler on CPU; "eager"/"aot_eager" need none (tests).
    A bad mode is refused even when compilation is off, so a typo fails on the first run.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if not enabled:
        return model
    if backend == "inductor":
        return torch.compile(model, mode=mode, backend=backend)  # type: ignore[return-value]
    return torch.compile(model, backend=backend)  # type: ignore[return-value]


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip torch.compile and DDP/DataParallel wrappers, in any order.

    Save checkpoints from the unwrapped module so they load into a plain model: no
    `_orig_mod.` or `module.` prefixes in the state dict.
    """
    while True:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod  # type: ignore[assignment]
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        else:
            return model


# --------------------------------------------------------------------------------------------
# 6. Evaluation without autograd
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[nn.Module]:
    """`model.eval()` + `torch.inference_mode()`, restoring each module's mode afterwards.

    `eval()` only switches Dropout and BatchNorm; autograd would still record the graph.
    `inference_mode` skips the graph, version counters and view tracking (cheaper than
    `no_grad`). Each submodule's own train/eval flag is restored, also when the body raises,
    so a frozen BatchNorm stays frozen.
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.inference_mode():
            yield model
    finally:
        for module, training in modes:
            module.training = training


# --------------------------------------------------------------------------------------------
# 7. Gradient clipping
# --------------------------------------------------------------------------------------------


def clip_gradients(
    parameters: Iterable[torch.Tensor],
    max_norm: float | None,
    *,
    scaler: torch.amp.GradScaler | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    error_if_nonfinite: bool = False,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Clip gradients to `max_norm` and return the PRE-clip total norm as a device tensor.

    Call after `backward()` and before `optimizer.step()`. Under fp16 AMP the gradients are
    scaled, so the scaler unscales them first (pass `scaler` and `optimizer`). The returned
    norm is the signal for choosing `max_norm`; it stays on the device (no host sync), so
    read it at log intervals. `max_norm=None` (or inf) only measures and leaves the gradients
    alone: clipping with `max_norm=inf` would turn a single inf gradient into NaN everywhere.

    Under fp16 an inf gradient is a routine overflow that `scaler.step` skips (and lowers the
    scale), so `error_if_nonfinite` only applies when no scaler is active.
    """
    params = [p for p in parameters if p.grad is not None]
    if scaler is not None and scaler.is_enabled():
        if optimizer is None:
            raise ValueError("clip_gradients needs the optimizer to unscale fp16 gradients")
        scaler.unscale_(optimizer)
        error_if_nonfinite = False
    if max_norm is None or max_norm == math.inf:
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in params if p.grad is not None],
            norm_type,
            error_if_nonfinite=error_if_nonfinite,
        )
    elif max_norm <= 0:
        raise ValueError(f"max_norm must be > 0 (or None to only measure), got {max_norm}")
    else:
        norm = torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
        )
    # FSDP's sharded gradients give a DTensor norm, already reduced over the ranks: the plain
    # tensor every rank holds is the one to combine with losses and to log.
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if full_tensor is not None else norm
