"""Checkpoints: full training state, written atomically, read back with `weights_only=True`.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts, so it loads with
`torch.load(..., weights_only=True)`, which cannot run code hidden in a file (plain pickle
can). The model is saved unwrapped (no `_orig_mod.` or `module.` prefixes), so the file loads
into the model `--model` builds (task.build_model_for) for inference.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
REQUIRED_KEYS = (
    "format",
    "model",
    "optimizer",
    "scheduler",
    "scaler",
    "rng",
    "epoch",
    "samples_in_epoch",
    "step",
    "config",
)
# Config fields that decide the shapes in the state dict: a mismatch is a clear error up front.
MODEL_FIELDS = (
    *("model", "width", "image_size", "num_classes", "data_dir"),
    # The language model's (not an image config's); the activation shapes no tensor, but the
    # same weights under the other GELU are another function.
    *("depth", "heads", "seq_len", "position", "activation"),
    # --model llama's (language/llama.py): the epsilon and the rotary base shape no tensor
    # either, but change the function.
    *("kv_heads", "mlp_width", "tie_head", "qkv_bias", "norm_eps", "rope_base"),
)
# Settings whose change a resume cannot follow beside the model's: the optimizer's state
# (AdamW's moments, Muon's momentum) means nothing to the other optimizer.
RESUME_FIELDS = (*MODEL_FIELDS, "matrix_optimizer", "lora_rank", "lora_alpha", "lora_targets")
# What a checkpoint saved before a model-shaping setting existed was trained with.
BEFORE_THE_SETTING = {
    "position": "learned",
    "activation": "gelu",
    "tokenizer": "bytes",
    "matrix_optimizer": "adamw",
    "tie_head": True,
    "qkv_bias": False,
    "norm_eps": 1e-5,
    "rope_base": 10000.0,
    "lora_rank": 0,
    "lora_alpha": 16.0,
    "lora_targets": "auto",
}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not fit this run."""


class SaveError(OSError):
    """A checkpoint could not be written (full disk, read-only or vanished folder).

    The message names the cause and the checkpoint that survives; the exit code is
    `exits.EXIT_IO_ERROR`.
    """


def save_checkpoint(state: dict[str, Any], path: Path, previous: Path | None = None) -> None:
    """Write `state` to `path` atomically: a crash mid-write never leaves a half-written file.

    torch.save goes to a temporary file in the same folder (never the system temp folder: on a
    cluster /tmp is node-local, another file system, where the rename fails with EXDEV or is no
    longer atomic), is flushed to disk, and then replaces `path` in one `os.replace`; the
    folder is flushed too, so the rename survives a power cut. If the disk refuses (ENOSPC,
    EROFS, ...) or the rename does (EXDEV, EACCES), the temporary file is removed, `path`
    keeps its previous content, and SaveError says so, naming both paths (or `previous`, the
    file that holds the previous checkpoint when `path` is a new name: a step checkpoint).
    """
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(handle, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        _replace(tmp, path)
    except BaseException as error:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        failed = write_failure(error)
        if failed is not None:
            raise SaveError(_save_failure(path, failed, previous)) from None
        raise


def write_failure(error: BaseException) -> OSError | None:
    """The OSError behind `error`, if a failed write caused it: torch.save's zip writer turns
    a write that fails (a full disk, a file-size limit) into a RuntimeError whose context is
    the OSError."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class RenameError(OSError):
    """`os.replace(tmp, path)` failed; the message names both paths."""


def _replace(tmp: str, path: Path) -> None:
    """`os.replace`, then fsync of the folder: the new directory entry reaches the disk."""
    try:
        os.replace(tmp, path)
    except OSError as error:
        cause = error.strerror or str(error) or type(error).__name__
        raise RenameError(error.errno, f"{cause} (renaming {tmp} to {path})") from None
    fsync_folder(path.parent)


def fsync_folder(folder: Path) -> None:
    """Flush a folder's entries (renames, new files) to disk; a no-op where folders cannot be
    opened (Windows) or flushed (some network file systems)."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def copy_checkpoint(source: Path, target: Path) -> None:
    """Copy a finished checkpoint file atomically (used for best.pt)."""
    tmp = None
    try:
        handle, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        os.close(handle)
        shutil.copyfile(source, tmp)
        with open(tmp, "rb+") as file:
            os.fsync(file.fileno())
        _replace(tmp, target)
    except BaseException as error:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise SaveError(
                f"{_save_failure(target, error)}; {source} holds this epoch's checkpoint"
            ) from None
        raise


def _save_failure(path: Path, error: OSError, previous: Path | None = None) -> str:
    cause = error.strerror or str(error) or type(error).__name__
    previous = previous or path
    kept = (
        f"{previous} still holds the previous checkpoint"
        if previous.is_file()
        else f"no checkpoint survives at {previous}"
    )
    return f"could not write {path}: {cause}; the partial file was removed and {kept}"


def first_nonfinite(model: torch.nn.Module) -> str | None:
    """The name of the first parameter or buffer holding a NaN or Inf, else None.

    Buffers matter: BatchNorm's running statistics can blow up while the loss of the step
    that poisoned them (computed with batch statistics) is still finite. Under FSDP each
    rank checks its own shard (`to_local`); the caller combines the verdicts of all ranks.
    """
    tensors = [
        (name, tensor.to_local() if hasattr(tensor, "to_local") else tensor)
        for name, tensor in (*model.named_parameters(), *model.named_buffers())
    ]
    return _first_nonfinite(tensors)


def _first_nonfinite(tensors: list[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating tensor holding a NaN or Inf (one sync for all)."""
    tensors = [(n, t) for n, t in tensors if t.is_floating_point() or t.is_complex()]
    if not tensors:
        return None
    finite = torch.stack([torch.isfinite(t.detach()).all() for _, t in tensors]).tolist()
    return next((name for (name, _), ok in zip(tensors, finite, strict=True) if not ok), None)


def check_weights(weights: Any, path: Path) -> None:
    """Refuse a model that is not a table of named tensors, or holds a NaN or Inf (training's
    health check never saves one: the file is corrupt or crafted)."""
    if not isinstance(weights, dict) or not all(
        isinstance(name, str) and isinstance(value, torch.Tensor) for name, value in weights.items()
    ):
        raise CheckpointError(f"checkpoint {path}: 'model' must be a table of named tensors")
    bad = _first_nonfinite(list(weights.items()))
    if bad is not None:
        raise CheckpointError(
            f"checkpoint {path} holds non-finite weights ({bad}), which training never saves: "
            "the file is corrupt or was altered; use another checkpoint"
        )


def read_model(path: Path, map_location: torch.device | str = "cpu") -> dict[str, Any]:
    """A checkpoint file for inference (evaluate, predict, export, generate, compress) with
    finite weights, a config table and this format, else CheckpointError naming the file."""
    state = _torch_load(path, map_location, "cannot be read ({})")
    if not isinstance(state, dict) or not {"model", "config"} <= state.keys():
        raise CheckpointError(f"checkpoint {path} holds no 'model' and 'config'")
    check_format(state, path)
    if not isinstance(state["config"], dict):
        raise CheckpointError(f"checkpoint {path}: its 'config' is not a table of settings")
    state["model"] = averaged_weights(state) or state["model"]
    check_weights(state["model"], path)
    return state


def averaged_weights(state: dict[str, Any]) -> dict[str, Any] | None:
    """A run with --ema-decay validated (and chose best.pt by) its average of the weights
    (training/ema.py): inference uses the same weights, so its numbers are training's. None
    without."""
    states = state.get("states")
    average = states.get("ema") if isinstance(states, dict) else None
    if not isinstance(average, dict):
        return None
    return {k.removeprefix("module."): v for k, v in average.items() if k != "n_averaged"}


def _torch_load(path: Path, map_location: torch.device | str, problem: str) -> Any:
    """`torch.load` with `weights_only=True`; a corrupt, truncated or pickled-code file is
    CheckpointError: "checkpoint <path> " + `problem` with the reason in its `{}`."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # corrupt zip, truncated file, foreign pickle: all one answer
        reason = _load_failure(error)
        raise CheckpointError(f"checkpoint {path} " + problem.format(reason)) from None


def check_format(state: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint of another format (written by a newer version of this code)."""
    found = state.get("format", FORMAT_VERSION)  # absent: a hand-made weights-and-config file
    if found != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format {found!r}, this code reads format {FORMAT_VERSION} "
            "(a newer version of the project wrote it?); update the code or use another file"
        )


def checked_config(config: Any, path: Path) -> Any:
    """`config`, rebuilt from checkpoint `path`, validated as train validates flags (ranges,
    the memory bound) before a model is built from it; the compile backend and the optimizer
    (a registered @slots.optimizer refuses --matrix-optimizer muon) do not matter."""
    unused: dict[str, Any] = {"compile": "off", "compile_backend": "inductor"}
    if "matrix_optimizer" in config.flat():  # a config.py of yours may not have it
        unused["matrix_optimizer"] = "adamw"
    try:
        config.replace(**unused).validate()
    except ValueError as error:
        raise CheckpointError(f"checkpoint {path} holds an invalid config: {error}") from None
    return config


def load_checkpoint(
    path: Path,
    map_location: torch.device | str = "cpu",
    epoch_samples: int | None = None,
    *,
    flag: str = "--resume",
) -> dict[str, Any]:
    """Read a checkpoint with `weights_only=True`; anything wrong raises CheckpointError.
    `epoch_samples` (a resumed run's samples per epoch) bounds `samples_in_epoch`; `flag` is
    the flag that named the file, for the advice of a corrupt one."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    advice = "delete it to start over or pass" if flag == "--resume" else "pass"
    state = _torch_load(
        path,
        map_location,
        "is corrupt or not a checkpoint of this project ({}); "
        + f"{advice} {flag} with another file",
    )
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED_KEYS):
        raise CheckpointError(
            f"checkpoint {path} lacks training state (expected keys "
            f"{', '.join(REQUIRED_KEYS)}); was it saved by another program?"
        )
    check_format(state, path)
    problem = _malformed(state)
    if problem:
        raise CheckpointError(f"checkpoint {path} is malformed: {problem}; it cannot be used")
    done: int = state["samples_in_epoch"]
    if epoch_samples is not None and done > epoch_samples:  # the data shrank, not the file
        raise CheckpointError(
            f"checkpoint {path} stands {done} samples into its epoch, past the end of this "
            f"run's epoch of {epoch_samples} (fewer --train-samples or other data than it was "
            "saved with); resume on the data it was trained on, or start a new --run-dir"
        )
    check_weights(state["model"], path)
    return state


def _malformed(state: dict[str, Any]) -> str | None:
    """What is wrong with the fields of a loaded checkpoint, or None (a crafted file gets here)."""
    for key in ("epoch", "samples_in_epoch", "step"):
        value = state[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return f"'{key}' must be a non-negative integer, got {value!r}"
    validated = state.get("validated_step", 0)  # older checkpoints lack it
    if not isinstance(validated, int) or isinstance(validated, bool) or validated < 0:
        return f"'validated_step' must be a non-negative integer, got {validated!r}"
    for key in ("model", "optimizer", "scheduler", "scaler", "config", "rng"):
        if not isinstance(state[key], dict):
            return f"'{key}' must be a dict, got {type(state[key]).__name__}"
    for key in [key for key in state if str(key).startswith("best_val_")]:
        best = state[key]
        if best is None:  # no validation yet
            continue
        if not isinstance(best, (int, float)) or isinstance(best, bool) or not math.isfinite(best):
            return f"'{key}' must be a finite number or None, got {best!r}"
    for key in ("epoch_totals", "metrics"):
        if not isinstance(state.get(key, {}), dict):
            return f"'{key}' must be a dict"
    rng = state["rng"]
    python = rng.get("python")
    if not (isinstance(python, tuple) and len(python) == 3 and isinstance(python[1], tuple)):
        return "'rng.python' must be the 3-tuple of random.getstate()"
    if not isinstance(rng.get("torch"), torch.Tensor) or rng["torch"].dtype != torch.uint8:
        return "'rng.torch' must be a uint8 tensor (torch.get_rng_state())"
    return None


def _load_failure(error: Exception) -> str:
    """The informative part of a torch.load error, in a few words.

    A weights-only refusal comes wrapped in torch's advice to retry with weights_only=False
    (or to allow the global), which is exactly wrong for a file of unknown origin: only what
    the unpickler refused is kept, naming the global (`posix.system`) when there is one.
    """
    text = str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if "Weights only load failed" not in text and "WeightsUnpickler error:" not in text:
        return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    found = re.search(r"GLOBAL (\S+)", text)
    if found is not None:
        blocked = "whose module" in text and "is blocked" in text
        why = "it could run code" if blocked else "not a tensor, number or string"
        return f"refused by the weights-only loader: it holds the Python global {found[1]} ({why})"
    after = text.split("WeightsUnpickler error:", 1)[-1].replace("Weights only load failed.", "")
    torch_advice = ("weights_only", "Check the documentation", "Please file an issue")
    reasons = [
        line.strip()
        for line in after.splitlines()
        if line.strip() and not any(words in line for words in torch_advice)
    ]
    return f"refused by the weights-only loader: {reasons[0]}" if reasons else type(error).__name__


def check_compatible(state: dict[str, Any], config: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint whose model-shaping settings or optimizer differ from this run's."""
    # Flat names on both sides: this template records `Config.flat()`; a nested record
    # (`to_dict()`, written by hand or by a fork) compares the same way.
    saved, config = with_old_defaults(state["config"], config), flat_record(config)
    for name in RESUME_FIELDS:
        if name not in config:  # a setting this run lacks shapes nothing in it: a config of
            continue  # yours without it, or image_size in a language model's old checkpoint
        if saved.get(name) != config.get(name):
            flag = "--" + name.replace("_", "-")
            raise CheckpointError(
                f"checkpoint {path} was saved with {flag} {saved.get(name)} but this run has "
                f"{flag} {config.get(name)}; use the same setting or a new --run-dir"
            )
    if saved.get("freeze") and not config.get("freeze"):  # it would unfreeze the body silently
        raise CheckpointError(
            f"checkpoint {path} was trained with --freeze (the head only); repeat --freeze "
            f"--init-from {saved.get('init_from')} to continue it, or use a new --run-dir"
        )


def with_old_defaults(saved: dict[str, Any], leaves: Any) -> dict[str, Any]:
    """A saved config record, flat, with BEFORE_THE_SETTING filled in where it lacks a
    setting that `leaves` (this code's settings: names, a Config record or fields) has."""
    flat = flat_record(saved)
    for name, value in BEFORE_THE_SETTING.items():
        if name in leaves:
            flat.setdefault(name, value)
    return flat


def flat_record(values: dict[str, Any]) -> dict[str, Any]:
    """A config record with its group tables merged: {"model": {"width": 8}} -> {"width": 8}.

    A group named like a leaf (`model`, the table, holds `model`, the architecture) is told
    apart by its type: a table is a dict, a setting never is.
    """
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flat_record(value))
        else:
            flat[key] = value
    return flat


def regrouped(
    saved: dict[str, Any], model: Any, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """A one-group optimizer state (v0.2.0 and before: every parameter, in
    `model.parameters()` order) rearranged into `optimizer`'s groups (weight decay on matrices
    only), so those checkpoints resume with their moments on the same weights."""
    groups = optimizer.param_groups
    params = list(model.parameters())
    if len(saved["param_groups"]) != 1 or len(groups) == 1:
        return saved
    if len(saved["param_groups"][0]["params"]) != len(params):
        return saved  # does not fit: load_state_dict says so
    new_index = {id(p): i for i, p in enumerate(p for group in groups for p in group["params"])}
    old_index = saved["param_groups"][0]["params"]
    moved = {old: new_index[id(p)] for old, p in zip(old_index, params, strict=True)}
    hyper = {k: v for k, v in saved["param_groups"][0].items() if k != "params"}
    return {
        "state": {moved[old]: value for old, value in saved["state"].items()},
        "param_groups": [
            {**hyper, "weight_decay": group["weight_decay"], "decay": group.get("decay", True),
             "params": [new_index[id(p)] for p in group["params"]]}
            for group in groups
        ],
    }  # fmt: skip


KERNEL_FLAGS = ("fused", "foreach", "capturable")


def with_own_kernels(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Optimizer state `saved` with each param group's kernel flags (KERNEL_FLAGS) as
    `optimizer`'s groups have them: this run's kernels, not the saving machine's.

    `load_state_dict` places each `step` by the flags of the groups it is given: a CPU
    checkpoint resumed on CUDA would keep CPU steps under fused AdamW, which refuses
    tensors on mixed devices at the first step. The groups it sets keep these flags too.
    """
    groups = saved.get("param_groups")
    own = optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(own):
        return saved  # does not fit: load_state_dict says so
    if not all(isinstance(group, dict) for group in groups):
        return saved
    merged = [
        {**group, **{key: mine[key] for key in KERNEL_FLAGS if key in mine}}
        for group, mine in zip(groups, own, strict=True)
    ]
    return {**saved, "param_groups": merged}


def load_state_into(target: Any, state: dict[str, Any], what: str, path: Path) -> None:
    """`target.load_state_dict(state)` with a one-line error if the shapes do not fit."""
    try:
        target.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError) as error:
        first = str(error).strip().splitlines()[0]
        raise CheckpointError(
            f"checkpoint {path}: the saved {what} does not fit this run ({first})"
        ) from None
    if isinstance(target, torch.optim.Optimizer):
        match_parameter_layouts(target)


def match_parameter_layouts(optimizer: torch.optim.Optimizer) -> None:
    """Give each optimizer state tensor shaped like its parameter that parameter's strides.

    A loaded state keeps the strides it was saved with: a run resumed in the other memory
    layout (`--channels-last` on or off) would hold NCHW moments for NHWC weights, which
    CUDA's fused AdamW refuses ("must have same dtype, device, and layout").
    """
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if (
                isinstance(value, torch.Tensor)
                and value.shape == param.shape
                and value.stride() != param.stride()
            ):
                state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)
