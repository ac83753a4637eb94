"""What a checkpoint holds, in one place: a list of parts, each saving and restoring itself.

Every stateful piece of a run (weights and optimizer, the schedule, the loss scaler, the random
generators, where the run stands, and each `@slots.state` of yours or the template's, such as
the EMA) is one `Part` with a `save` and a `load`. `snapshot` calls every save and `restore`
every load, so nothing can be saved without being restored; a test enumerates `PARTS` and
round-trips each. A checkpoint is a plain dict (checkpointing/checkpoint.py writes and reads it with
`weights_only=True`); the keys below are its layout, which older checkpoints share.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import slots
from ..runtime import distributed
from ..training import lora
from . import checkpoint
from . import sharded as sharded_checkpoint
from .checkpoint import CheckpointError

if TYPE_CHECKING:
    from ..training.run import Run


@dataclass(frozen=True)
class Position:
    """Where a snapshot is taken: the epoch to continue in, its samples done (per rank), and
    the epoch's metric totals so far."""

    epoch: int
    samples_in_epoch: int
    totals: dict[str, float]
    # Each `@slots.state(..., per_rank=True)`'s state dicts by rank, gathered from every rank
    # before the save (Checkpointer.save): rank 0 alone writes a single-file checkpoint.
    rank_states: dict[str, list[Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Part:
    """One stateful piece: `save(run, position)` gives its checkpoint keys, `load(run, state,
    path)` puts them back from the checkpoint's dict `state`."""

    name: str
    save: Callable[[Any, Position], dict[str, Any]]
    load: Callable[[Any, dict[str, Any], Path], None]


def _save_weights(run: Run, at: Position) -> dict[str, Any]:
    # A sharded checkpoint keeps model and optimizer as the shards beside this dict; a LoRA
    # run's keeps its adapters only (training/lora.py).
    return {
        "model": {} if run.sharded else lora.saved_weights(run.raw_model),
        "optimizer": {} if run.sharded else run.optimizer.state_dict(),
    }


def _load_weights(run: Run, state: dict[str, Any], path: Path) -> None:
    # A sharded folder loads onto however many ranks this run has (resharding); either loads
    # with this run's kernels, not the saving machine's (checkpoint.with_own_kernels). A LoRA
    # run's adapters go beside this run's base, once its fingerprint is the checkpoint's.
    state = lora.completed(run.raw_model, state, path)
    sharded_checkpoint.load_model_and_optimizer(path, state, run.raw_model, run.optimizer)
    if slots.load().optimizer is None:  # the template's AdamW: this run's --weight-decay
        set_weight_decay(run.optimizer, run.config.optim.weight_decay)


def set_weight_decay(optimizer: Any, weight_decay: float) -> None:
    """This run's --weight-decay on the groups `slots.param_groups` marks for decay (all of a
    one-group optimizer's)."""
    for group in optimizer.param_groups:
        group["weight_decay"] = weight_decay if group.get("decay", True) else 0.0


def _save_schedule(run: Run, at: Position) -> dict[str, Any]:
    return {"scheduler": run.scheduler.state_dict()}


def _load_schedule(run: Run, state: dict[str, Any], path: Path) -> None:
    scheduler = run.scheduler
    peaks = list(scheduler.base_lrs)  # as this run built its optimizer, from its flags
    checkpoint.load_state_into(scheduler, state["scheduler"], "scheduler", path)
    # The checkpoint says where in the schedule we are; this run's flags say what the
    # schedule is (as in nanoGPT): a resumed run honours a changed --lr or --epochs, and an
    # optimizer of yours keeps the peak rate it gives each group.
    scheduler.base_lrs = peaks
    for group, peak in zip(run.optimizer.param_groups, peaks, strict=True):
        group["lr"] = peak * scheduler.lr_lambdas[0](scheduler.last_epoch)


def _save_scaler(run: Run, at: Position) -> dict[str, Any]:
    return {"scaler": run.scaler.state_dict()}


def _load_scaler(run: Run, state: dict[str, Any], path: Path) -> None:
    if not state["scaler"] and run.scaler.is_enabled():  # trained at bf16 or fp32, fp16 now
        run.log(f"{path} was trained without fp16's loss scaling: the scale starts fresh")
        return
    checkpoint.load_state_into(run.scaler, state["scaler"], "scaler", path)


def _save_rng(run: Run, at: Position) -> dict[str, Any]:
    return {"rng": capture_rng_state(run.device)}


def _load_rng(run: Run, state: dict[str, Any], path: Path) -> None:
    restore_rng_state(state["rng"], run.device)


def _save_progress(run: Run, at: Position) -> dict[str, Any]:
    return {
        "epoch": at.epoch,
        "samples_in_epoch": at.samples_in_epoch,
        "step": run.global_step,
        "validated_step": run.validated_step,  # a step before a validation: not yet
        "epoch_totals": at.totals,
        "metrics": run.result,
        f"best_{run.task.best_by[0]}": run.best,  # None before the first validation
    }


def _load_progress(run: Run, state: dict[str, Any], path: Path) -> None:
    run.epoch, run.skip_samples = state["epoch"], state["samples_in_epoch"]
    run.global_step, run.best = state["step"], state.get(f"best_{run.task.best_by[0]}")
    run.validated_step = state.get("validated_step", 0)  # older: Checkpointer.load infers it
    run.epoch_totals = dict(state.get("epoch_totals", {}))
    run.result = dict(state.get("metrics", {}))


def _save_states(run: Run, at: Position) -> dict[str, Any]:
    saved = {name: part.state_dict() for name, part in run.states.items()}
    return {"states": saved | {name: {"per_rank": every} for name, every in at.rank_states.items()}}


def gather_rank_states(run: Run) -> dict[str, list[Any]]:
    """Every rank's state of each per-rank `@slots.state` (a collective: all ranks call it)."""
    per_rank = slots.load().per_rank_states
    return {
        name: distributed.gather_objects(part.state_dict())
        for name, part in run.states.items()
        if name in per_rank
    }


def _load_states(run: Run, state: dict[str, Any], path: Path) -> None:
    """Each `@slots.state` of this run from the checkpoint's; one it lacks starts afresh
    (it was switched on since), one only the checkpoint has is left out; both said once."""
    saved = state.get("states", {})
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {path} is malformed: 'states' is not a table")
    for name, part in run.states.items():
        if name not in saved:
            run.log(f"{path} holds no {name!r} state (off when it was saved): starting it fresh")
            continue
        own = _own_share(run, name, saved[name], path)
        if own is not None:
            checkpoint.load_state_into(part, own, f"{name!r} state", path)
    for name in sorted(set(saved) - set(run.states)):
        run.log(f"{path} holds a {name!r} state this run does not keep (off now): left out")


def _own_share(run: Run, name: str, saved: Any, path: Path) -> Any:
    """This rank's share of a per-rank state (each rank saved its own), None where the
    checkpoint was saved by another number of ranks; a state saved once is every rank's."""
    if not (isinstance(saved, dict) and set(saved) == {"per_rank"}):
        return saved
    every, world = saved["per_rank"], run.ctx.world_size
    if not isinstance(every, list):
        raise CheckpointError(f"checkpoint {path} is malformed: {name!r}'s states are not a list")
    if len(every) != world:
        run.log(
            f"{path} holds {name!r} states of {len(every)} ranks and this run has {world}: "
            f"starting {name!r} fresh on every rank"
        )
        return None
    return every[run.ctx.rank]


PARTS: list[Part] = [
    Part("weights", _save_weights, _load_weights),
    Part("schedule", _save_schedule, _load_schedule),
    Part("scaler", _save_scaler, _load_scaler),
    Part("rng", _save_rng, _load_rng),
    Part("progress", _save_progress, _load_progress),
    Part("states", _save_states, _load_states),
]


def snapshot(run: Run, at: Position) -> dict[str, Any]:
    """Everything needed to continue exactly from `at`: every part's keys, and what the run
    was (format, config, run record) for the readers."""
    state: dict[str, Any] = {"format": checkpoint.FORMAT_VERSION}
    for part in PARTS:
        state.update(part.save(run, at))
    extra: dict[str, Any] = getattr(run.task, "checkpoint_extra", dict)()  # the LM's tokenizer
    return {**state, **extra, "config": run.config.flat(), "run": run.record}


def restore(run: Run, state: dict[str, Any], path: Path) -> None:
    """Every part from checkpoint `state` (read from `path`), in PARTS' order: the random
    generators after everything that may draw from them."""
    for part in PARTS:
        part.load(run, state, path)


# ---- the random generators, as weights_only-safe types -----------------------------------


def capture_rng_state(device: torch.device) -> dict[str, Any]:
    """RNG states as weights_only-safe types (tensors, tuples, ints), to resume exactly."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(np.asarray(keys, np.int64)), pos, has_gauss, gauss)
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Inverse of `capture_rng_state`; a state the generators reject is a CheckpointError."""
    try:
        _restore_rng_state(state, device)
    except (TypeError, ValueError, RuntimeError, KeyError, OverflowError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise CheckpointError(f"checkpoint holds a malformed random state ({first})") from None


def _restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
