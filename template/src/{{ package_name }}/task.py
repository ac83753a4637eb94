"""What differs between training tasks, behind one small interface, so train.py is one loop.

A `Task` says how to build the datasets, how a batch becomes `(logits, targets)` for the
loss, which extra metrics a log line gets, and how many FLOPs one sample costs. Everything
else (the loop, checkpoints, faults, metrics, profiling) is shared. The image classifier's
logits are (N, C) for N labels. A language model's (B, T, V) logits are flattened to
(B*T, V) for B*T next-token targets, so cross-entropy, accuracy and the metrics count tokens
there: for that task a "sample" in metrics.jsonl is a token.

This module also holds the pieces of a training step that follow from that interface
(`cross_entropy`, `evaluate`, the diagnosis of a blown-up step) and where the template builds
the datasets and the model from what your files register (slots.py).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from . import data_sources, distributed, images, mfu, parallel, slots, utils
from .config import Config, ConfigError
from .data_sources import DataInfo, Datasets


class Task:
    """The image classifier: `(image, label)` batches, one class per image."""

    name = "image"
    unit = "samples"  # what the shared `samples_per_s` counts

    def __init__(self) -> None:
        self.normalize: images.Normalize | None = None  # set by datasets(); None: as loaded
        self.dataset_record: dict[str, Any] = {}

    def datasets(self, config: Config) -> tuple[Dataset[Any], Dataset[Any], DataInfo]:
        """(train, validation, info) from data.py, the training images augmented (--augment)
        and the per-channel normalisation measured on them (images.py)."""
        train, val, info = build_datasets(config)
        train, self.dataset_record = images.prepare(config, train, info, self)
        return train, val, info

    def outputs(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `model` on a normalised batch: (N, C) logits and the N class indices."""
        if self.normalize is not None:
            if self.normalize.mean.device != inputs.device:
                self.normalize = self.normalize.to(inputs.device)
            inputs = self.normalize(inputs)
        return model(inputs), targets

    def record(self) -> dict[str, Any]:
        """What the run record (metrics.jsonl, every checkpoint) keeps of the data: class
        names, input shape, normalisation, augmentation; evaluate/predict/export read it."""
        return {"dataset": self.dataset_record} if self.dataset_record else {}

    def check_resume(
        self, state: dict[str, Any], config: Config, path: Path, log: Callable[[str], None]
    ) -> None:
        """Refuse (CheckpointError) a checkpoint whose data this run cannot continue; the
        classifier has nothing beyond check_compatible's settings (the LM checks its corpus)."""

    def metrics(self, record: dict[str, Any], prefix: str = "") -> dict[str, float]:
        """Metrics derived from a log line's `loss` and `samples_per_s`, named with `prefix`
        ("train_", "val_"); the classifier has none beyond loss and accuracy."""
        return {}

    def utilization(
        self, model: nn.Module, config: Config, info: DataInfo, device: torch.device, on: bool
    ) -> mfu.Utilization:
        """FLOPs per sample counted on the meta device from the dataset's shape (mfu.py)."""
        return mfu.Utilization.for_run(model, config, info, device, on)


def task_for(config: Config) -> Task:
    """The task this project trains: the language model where the project has `text.py`
    (the template's `task: lm` renders it), the image classifier otherwise."""
    name = f"{__package__}.text"
    try:
        text = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:  # text.py exists but an import inside it failed
            raise
        return Task()
    task: Task = text.LanguageModelTask()
    return task


def build_datasets(config: Config) -> Datasets:
    """(train, validation, info): data.py's `build_datasets` where yours has one, else the
    first of data.py's `SOURCES` and then the template's (data_sources.py) that takes it."""
    custom = slots.user_attr("data", "build_datasets")
    if custom is not None:
        result: Datasets = custom(config)
        return result
    sources = [*slots.user_attr("data", "SOURCES", []), *data_sources.SOURCES]
    return data_sources.first_source(config, sources)


def build_model_for(config: Config, info: DataInfo) -> nn.Module:
    """The model `--model` names, for the dataset's shapes: one registered with
    `@slots.model` (model.py, extensions.py), else the built-in ones of model.py's
    `build_model_for(config, info)`. Template code builds every model here."""
    spec = slots.load().models.get(config.model.model)
    builder = spec.build if spec is not None else slots.user_attr("model", "build_model_for")
    if builder is None:
        raise ConfigError(
            f"--model {config.model.model}: no model is registered under that name "
            "(@slots.model in model.py) and model.py has no build_model_for(config, info) for "
            "the built-in ones (the template's CHANGELOG, Upgrade notes)"
        )
    model = builder(config, info)
    if config.speed.channels_last:
        # NHWC for every 4-D weight; a convolution given one runs in NHWC, converting its
        # input once, and its output stays NHWC for the next. Other weights (5-D ones of 3-D
        # convolutions included) are unchanged.
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 4:
                    param.data = param.data.contiguous(memory_format=torch.channels_last)
    return model


def loss_function() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss training and validation use: the `@slots.loss` registered, else
    `cross_entropy`. (logits, targets) -> the batch's mean loss."""
    return slots.load().loss or cross_entropy


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """`F.cross_entropy` for class indices, safe under `--deterministic` on GPUs.

    The CUDA NLLLoss kernels for (N, C) logits reduce in one block and raise no determinism
    alert; only the spatial one, for (N, C, H, W) logits (`nll_loss2d`, per-pixel
    classification), accumulates with atomics and raises once
    `torch.use_deterministic_algorithms(True)` is on (aten/src/ATen/native/cuda/Loss.cu and
    NLLLoss2d.cu). There alone the same value is computed as log_softmax + gather, whose
    backward is deterministic; everywhere else the fused op is faster.
    """
    if logits.dim() > 2 and logits.is_cuda and torch.are_deterministic_algorithms_enabled():
        return gather_cross_entropy(logits, targets, reduction)
    return F.cross_entropy(logits, targets, reduction=reduction)


def step_is_finite(
    loss: torch.Tensor, grad_norm: torch.Tensor, scaler: torch.amp.GradScaler
) -> torch.Tensor:
    """The step's health flag (a device tensor; reading it is the step's one host sync).

    fp32 and bf16: the loss AND the gradient norm must be finite, since a finite loss can come
    with an inf gradient that the optimizer would write into every weight. fp16: the loss
    only; an inf gradient there is a routine overflow that GradScaler skips (and the metrics
    count as `skipped_steps`). loss + norm is finite exactly when both are: one kernel fewer.
    """
    return torch.isfinite(loss if scaler.is_enabled() else loss + grad_norm)


def gather_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy without NLLLoss, in float32 also under autocast; logits (N, C, ...)."""
    picked = logits.float().log_softmax(dim=1).gather(1, targets.unsqueeze(1))
    return -(picked.sum() if reduction == "sum" else picked.mean())


def evaluate(
    model: nn.Module, loader: Any, device: torch.device, precision: str, task: Task | None = None
) -> dict[str, float]:
    """Mean loss and accuracy over `loader`, summed across ranks (each holds a shard), plus
    the task's own metrics (`val_bpb` for a language model) and the user's (extensions.py)."""
    task = task or Task()
    loss_fn, metric_fns = loss_function(), slots.val_metrics()
    with utils.evaluation_mode(model):
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device)
        extra: dict[str, torch.Tensor] = {}  # the validation metrics' sums, by name
        count = 0
        for batch in loader:
            inputs, targets = utils.to_device(tuple(batch), device)
            with utils.autocast(device, precision):
                logits, targets = task.outputs(model, inputs, targets)
            # In float32: bf16/fp16 logits outside autocast would give a quantised sum.
            loss_sum += summed_loss(loss_fn, logits.float(), targets)
            correct += (logits.argmax(1) == targets).sum()
            count += targets.shape[0]
            slots.batch_metrics(metric_fns, logits.float(), targets, extra)
        names = sorted(extra)
        sums = [loss_sum, correct, torch.tensor(float(count), device=device)]
        totals = torch.stack([*sums, *(extra[name] for name in names)])
        loss, right, seen, *extra_sums = distributed.all_reduce(totals).tolist()
    result = {"val_loss": loss / max(seen, 1), "val_acc": right / max(seen, 1)}
    for name, total in zip(names, extra_sums, strict=True):
        if f"val_{name}" in result:
            raise ConfigError(
                f"a validation metric (slots.val_metric, extensions.py) returns {name!r}, the "
                f"template's own val_{name}: rename yours"
            )
        result[f"val_{name}"] = total / max(seen, 1)
    return {**result, **task.metrics({"loss": result["val_loss"]}, "val_")}


def summed_loss(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """A batch's summed loss: cross-entropy's own sum, a registered loss's mean times N."""
    if loss_fn is cross_entropy:
        return cross_entropy(logits, targets, reduction="sum")
    return loss_fn(logits, targets) * targets.shape[0]


def blow_up_error(
    task: Task,
    model: nn.Module,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    precision: str,
    device: torch.device,
    loss: torch.Tensor,
    grad_norm: torch.Tensor,
    step: int,
    kept: str,
) -> utils.NonFiniteLossError:
    """Re-run the bad step's batches eagerly under anomaly detection and describe the failure.

    The optimizer has not stepped, so the weights are those that produced the bad value.
    The unwrapped model is used: forward hooks need eager mode, and DDP would wait for ranks
    that are not re-running anything.
    """
    loss_value, norm_value = float(loss), float(grad_norm)

    def rerun() -> None:
        for inputs, targets in micro_batches:
            with utils.autocast(device, precision):
                rerun_loss = loss_function()(*task.outputs(model, inputs, targets))
            rerun_loss.backward()

    if parallel.is_sharded(model):
        # FSDP2's forward and backward are collectives: anomaly mode raising mid-backward on
        # the one rank whose data made the NaN would leave the others in a reduce-scatter.
        finding = (
            "not re-run to find the layer under FSDP2 (every re-run op would be a collective "
            "all ranks must join); rerun with --parallel ddp to locate it"
        )
    else:
        finding = utils.diagnose_nonfinite(model, rerun)
    distributed.barrier()  # leave together: see the barrier at the end of train()
    what = "loss" if not math.isfinite(loss_value) else "gradient norm"
    return utils.NonFiniteLossError(
        f"non-finite {what} at step {step} (loss {loss_value}, grad norm {norm_value}): "
        f"{finding}; {kept}; lower --lr, set --grad-clip, or check the data",
        step=step,
        value=loss_value,
    )


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse a precision `device` cannot run (ConfigError)."""
    # including_emulation=False: a pre-Ampere GPU only emulates bf16 (slowly), which the
    # default of is_bf16_supported() counts as support.
    if (
        precision == "bf16"
        and device.type == "cuda"
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        raise ConfigError("--precision bf16: this GPU has no bfloat16 support; use fp16")
    if precision == "fp16" and device.type == "mps":
        raise ConfigError("--precision fp16 needs a GradScaler, which MPS lacks; use bf16")


def validation_precision(config: Config, device: torch.device, log: Callable[[str], None]) -> str:
    """Set TF32 as training did and return the precision its validation ran at, so evaluate
    gives training's numbers; fp32 (said through `log`) where `device` cannot run that one."""
    utils.set_tf32(config.speed.tf32)
    precision = config.speed.precision
    try:
        check_precision(precision, device)
    except ConfigError as error:
        log(f"note: trained at {precision}, evaluated at fp32 here ({error})")
        return "fp32"
    return precision
