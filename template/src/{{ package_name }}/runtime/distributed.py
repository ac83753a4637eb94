"""torchrun / DDP plumbing: who am I, which device is mine, and reductions across ranks.

Launched with `torchrun`, the environment holds RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE; without it, everything here degrades to a single process and the
reductions do nothing.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import accelerator


@dataclass(frozen=True)
class Context:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def enabled(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def is_main(self) -> bool:
        """Rank 0 alone logs, shows progress and writes checkpoints."""
        return self.rank == 0


TIMEOUT_VARIABLE = "DIST_TIMEOUT_MINUTES"


def collective_timeout() -> datetime.timedelta | None:
    """How long a rank waits in one collective before the job fails (NCCL's watchdog, gloo's
    wait): DIST_TIMEOUT_MINUTES when set, else torch's default (10 minutes for NCCL, 30 for
    gloo). Raise it when one rank does long work while the others wait (a large save)."""
    text = os.environ.get(TIMEOUT_VARIABLE)
    if text is None:
        return None
    try:
        minutes = float(text)
    except ValueError:
        minutes = -1.0
    if not 0 < minutes < float("inf"):
        raise ValueError(f"{TIMEOUT_VARIABLE} must be a number of minutes > 0, got {text!r}")
    return datetime.timedelta(minutes=minutes)


def setup(device_name: str) -> Context:
    """Join the torchrun process group if there is one: NCCL on CUDA, gloo on CPU.

    Each rank drives one GPU of this node: see `local_gpu` for which.
    """
    if "RANK" not in os.environ:
        return Context(0, 1, 0, 1, accelerator.resolve_device(device_name))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    wants_cuda = device_name in ("auto", "cuda") or device_name.startswith("cuda:")
    if wants_cuda and torch.cuda.is_available():
        device = torch.device(
            "cuda", local_gpu(local_rank, local_world_size, torch.cuda.device_count())
        )
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=collective_timeout())
    elif device_name in ("auto", "cpu"):
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=collective_timeout())
    else:
        raise ValueError(
            f"--device {device_name} is not available for a torchrun run "
            "(DDP here supports CUDA with NCCL and CPU with gloo)"
        )
    return Context(rank, world_size, local_rank, local_world_size, device)


def local_gpu(local_rank: int, local_world_size: int, visible: int) -> int:
    """The CUDA ordinal this rank drives, given how many GPUs this process sees.

    - every rank sees every GPU of the node (torchrun on a whole node): GPU number LOCAL_RANK;
    - each rank sees exactly one GPU (SLURM with `--gpus-per-task=1`, or one
      CUDA_VISIBLE_DEVICES per task): that GPU, cuda:0;
    - anything else (say 4 ranks on a node and 2 visible GPUs) has no right answer: raise a
      ValueError that says so, rather than fail later with "invalid device ordinal".
    """
    if visible >= local_world_size:
        return local_rank
    if visible == 1:
        return 0
    raise ValueError(
        f"LOCAL_RANK {local_rank} of {local_world_size} ranks on this node, but this process "
        f"sees {visible} GPU(s); start one process per visible GPU (--nproc_per_node={visible}) "
        "or give each task exactly one GPU (SLURM: --gpus-per-task=1)"
    )


# Process groups left by `cleanup`, freed only when the interpreter exits (see there).
_RETIRED: list[Any] = []


def cleanup() -> None:
    """Leave the process group; its object is kept alive until the process exits.

    A DDP model still holds the group when training returns. If the model's C++ reducer
    dropped the last reference, the gloo destructor would run with the GIL held and wait for
    gloo's worker thread, which may itself be waiting for the GIL to free the last barrier's
    tensor: both wait forever, a rank hung at exit (more often on a busy machine). Kept here,
    the group is freed last, by Python, whose destructor for it releases the GIL first.
    """
    if dist.is_available() and dist.is_initialized():
        _RETIRED.append(dist.group.WORLD)
        dist.destroy_process_group()


def exit_process(code: int, *, always: bool = False) -> None:
    """End an entry point run as a script with `code`; after a process group (or `always`),
    without interpreter finalization.

    The group `cleanup` kept alive is freed at interpreter exit, where gloo's threads may
    still hold its tensors: a rank can then abort ("terminate called without an active
    exception", SIGABRT, exit 134) after its run was saved, and its launcher fails the job.
    Everything is written by then (checkpoints fsynced, metrics and trackers closed), so
    such a process flushes its output and leaves with `os._exit`, which runs no destructors.
    `torchrun`'s own threads can abort its finalization the same way after a signal: the
    launcher passes `always`.
    """
    if not (_RETIRED or always):
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def barrier() -> None:
    """Wait until every rank gets here (a no-op in a single process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def enabled() -> bool:
    """Whether this process is one rank of a process group (torchrun)."""
    return dist.is_available() and dist.is_initialized()


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce `tensor` in place across ranks (a no-op in a single process); returns it."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def gather_objects(value: Any) -> list[Any]:
    """Every rank's `value` (a state dict: its tensors copied to the CPU first), by rank; a
    one-element list in a single process. A collective: every rank must call it."""
    value = _on_cpu(value)
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, value)
    return found


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _on_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(item) for item in value)
    return value


def broadcast_buffers(model: nn.Module) -> None:
    """Copy rank 0's buffers (BatchNorm running statistics) to every rank.

    DDP syncs buffers at the start of each training forward, so after the last forward of an
    epoch every rank holds statistics of its own last batch. Evaluating with those would give
    each rank a slightly different model; this makes evaluation and the saved state agree.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if `flag` is true on any rank (a no-op without torchrun)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    return bool(all_reduce(torch.tensor(float(flag), device=device), op="max"))


class HostAgreement:
    """Flags of the host that every rank must act on at the same step (a stop request,
    --save-every-minutes' "time is up"), agreed without waiting for the device.

    Under torchrun each call starts a max all-reduce of this rank's flags, asynchronously, on
    a CPU buffer of a gloo group of its own (a CPU collective is no device sync; an NCCL
    run's default group has no CPU backend), and returns the verdict of the previous call,
    started a step earlier and by then done on every rank: the ranks act on a flag one step
    after one of them raised it, all at the same step, and the step never waits for the GPU.
    A verdict read at every step on the device instead (Megatron's signal handler and its
    --exit-duration-in-mins do that) would stop the host from queueing the next step while
    the device works. In one process the flags are the verdict at once. `tag` travels with
    the flags: the caller tells by it a verdict that something since made stale.
    """

    def __init__(self, size: int) -> None:
        self.buffer = torch.zeros(size)  # host memory: reading it waits for no device work
        self.group: Any = None
        self._work: Any = None
        self._tag: Any = None

    def exchange(
        self, flags: Sequence[bool], tag: Any = None
    ) -> tuple[tuple[bool, ...], Any] | None:
        """Start agreeing on `flags`; (the verdict, the tag) of the previous call, None at
        the first. In one process: `flags` and `tag` themselves."""
        if not enabled():
            return tuple(flags), tag
        verdict = self.finish()
        if self.group is None:  # every rank's first call: the same point of every rank's run
            self.group = dist.new_group(backend="gloo", timeout=collective_timeout())
        self.buffer.copy_(torch.tensor(flags, dtype=self.buffer.dtype))
        self._work = dist.all_reduce(
            self.buffer, op=dist.ReduceOp.MAX, group=self.group, async_op=True
        )
        self._tag = tag
        return verdict

    def finish(self) -> tuple[tuple[bool, ...], Any] | None:
        """Wait for the agreement in flight (every rank started it); its verdict and tag, or
        None when none is in flight."""
        if self._work is None:
            return None
        self._work.wait()
        self._work = None
        return tuple(value > 0 for value in self.buffer.tolist()), self._tag
