"""The extension slots: the named places where your code plugs into training.

This module is the template's (`copier update` refreshes it); your registrations live in your
own files, model.py and extensions.py, which a release never rewrites. You register, the
template looks up; a slot nobody filled runs the template's default, so an empty (or deleted)
extensions.py trains exactly as the template does. The slots, in extensions.py:

    from . import slots

    @slots.loss                      # (logits, targets) -> mean loss; default: cross-entropy
    def smoothed(logits, targets):
        return torch.nn.functional.cross_entropy(logits, targets, label_smoothing=0.1)

    @slots.training_loss             # training steps only (validation: the loss above);
    def penalised(logits, targets, step):  # step.config, .inputs, .model, .step
        l1 = sum(p.abs().sum() for p in step.model.parameters())
        return torch.nn.functional.cross_entropy(logits, targets) + 1e-6 * l1

    @slots.batch_transform("noisy")  # --batch-transform noisy: each training batch on the
    def noisy(config, inputs, targets, draw):  # device (validation's stay as loaded)
        noise = torch.randn(inputs.shape, generator=draw.generator(inputs.device),
                            device=inputs.device)  # draw: seeded by (seed, step, micro, rank)
        return inputs + 0.1 * noise, targets

    @slots.optimizer                 # (config, model, device) -> Optimizer; default: AdamW
    def sgd(config, model, device):
        return torch.optim.SGD(slots.param_groups(model, config.optim.weight_decay),
                               lr=config.optim.lr, momentum=0.9, nesterov=True)

    @slots.schedule("halves")        # --lr-schedule halves: (step, total_steps, config) -> factor
    def halves(step, total, config):
        return 0.5 ** (step // max(1, total // 4))

    @slots.train_metric              # per batch, each metric's SUM over the batch's samples
    def confident(logits, targets):  #   -> `confident` in train records, `train_confident`
        return {"confident": (logits.softmax(1).amax(1) > 0.9).sum()}

    @slots.val_metric                # the same on validation batches -> `val_<name>`
    def top5(logits, targets):
        return {"top5": (logits.topk(5, 1).indices == targets[:, None]).any(1).sum()}

    @slots.set_metric(balanced)      # a metric of the whole validation set, not a mean per
    def confusion(logits, targets):  #   sample: tensors of any fixed shape, summed over the
        k = logits.shape[1]          #   batches and ranks, then `balanced(totals)` -> `val_...`
        hits = torch.bincount(targets * k + logits.argmax(1), minlength=k * k)
        return {"confusion": hits.view(k, k)}

    @slots.callback("after_step")    # after_step, after_validation, before_save, after_resume
    def note(run):                   #   each gets the loop's `Run` (training/run.py); after a
        ...                          #   step, run.batches holds its micro-batches on the device

    @slots.state("my_counter")       # (run) -> an object with state_dict()/load_state_dict():
    def counter(run):                #   saved in every checkpoint, restored on resume; the
        return MyCounter()           #   run holds it as run.states["my_counter"]

    @slots.validation_model          # (run) -> the model validation evaluates, or None
    def averaged(run):
        return run.states["my_average"].module

and in model.py, a model that `--model resnet` chooses (its settings are a config group of
yours, config.py's `Config`, so they are flags and TOML keys):

    @slots.model("resnet", help="a small ResNet", memory=resnet_bytes)
    def build_resnet(config, info):
        return ResNet(info.in_channels, info.num_classes, depth=config.resnet.depth)

The template's own options are built on the same slots (the EMA of the weights, `--ema-decay`,
the schedules of `--lr-schedule`, and an image project's `--batch-transform mixup|cutmix`), in
training/ema.py, training/schedules.py and vision/mixing.py; training/batches.py applies the
batch transform and the training loss.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from torch import nn

if TYPE_CHECKING:
    from .training.run import Run


F = TypeVar("F", bound=Callable[..., Any])
POINTS = ("after_step", "after_validation", "before_save", "after_resume")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass(frozen=True)
class ModelSpec:
    """A model `--model NAME` chooses: `build(config, info)` returns it on the CPU; `memory
    (config)` is a rough lower bound on a run's bytes (None: the memory check is skipped)."""

    name: str
    build: Callable[..., nn.Module]
    help: str = ""
    memory: Callable[..., int] | None = None


@dataclass(frozen=True)
class SetMetric:
    """A validation metric of the whole set: `update(logits, targets)` returns tensors of
    fixed shapes (a confusion matrix's counts), summed over every batch and rank; `finish
    (totals)` turns those totals into the metrics reported as `val_<name>`."""

    update: Callable[..., dict[str, torch.Tensor]]
    finish: Callable[[dict[str, torch.Tensor]], dict[str, float]]


@dataclass
class Registry:
    """Everything registered, by slot. `None` or empty: the template's default."""

    models: dict[str, ModelSpec] = field(default_factory=dict)
    schedules: dict[str, Callable[..., float]] = field(default_factory=dict)
    loss: Callable[..., torch.Tensor] | None = None
    training_loss: Callable[..., torch.Tensor] | None = None
    batch_transforms: dict[str, Callable[..., tuple[Any, Any]]] = field(default_factory=dict)
    optimizer: Callable[..., torch.optim.Optimizer] | None = None
    train_metrics: list[Callable[..., dict[str, torch.Tensor]]] = field(default_factory=list)
    val_metrics: list[Callable[..., dict[str, torch.Tensor]]] = field(default_factory=list)
    set_metrics: list[SetMetric] = field(default_factory=list)
    callbacks: dict[str, list[Callable[..., Any]]] = field(
        default_factory=lambda: {point: [] for point in POINTS}
    )
    states: dict[str, Callable[..., Stateful | None]] = field(default_factory=dict)
    per_rank_states: set[str] = field(default_factory=set)  # of `states`: each rank's own
    validation_models: list[Callable[..., nn.Module | None]] = field(default_factory=list)


REGISTRY = Registry()


def model(
    name: str, *, help: str = "", memory: Callable[..., int] | None = None
) -> Callable[[F], F]:
    """Register `build(config, info) -> nn.Module` as the model `--model NAME` chooses."""

    def register(build: F) -> F:
        REGISTRY.models[name] = ModelSpec(name, build, help, memory)
        return build

    return register


def schedule(name: str) -> Callable[[F], F]:
    """Register `factor(step, total_steps, config) -> float` as `--lr-schedule NAME`: the
    learning rate at optimizer step `step` is `--lr` times the factor, after the linear
    warm-up of `--warmup-steps` that the template puts before every schedule."""

    def register(factor: F) -> F:
        REGISTRY.schedules[name] = factor
        return factor

    return register


def loss(fn: F) -> F:
    """Register `loss(logits, targets) -> scalar` (the batch mean) for training and validation."""
    REGISTRY.loss = fn
    return fn


def training_loss(fn: F) -> F:
    """Register `loss(logits, targets, step) -> scalar` (the batch mean) for training steps
    only: `step` (training/batches.py's `LossInputs`) holds the run's `config`, the batch's
    `inputs` (after any --batch-transform), the `model` the step runs and the `step`'s number.
    Validation keeps `@slots.loss`, or the default cross-entropy."""
    REGISTRY.training_loss = fn
    return fn


def batch_transform(name: str) -> Callable[[F], F]:
    """Register `transform(config, inputs, targets, draw) -> (inputs, targets)` as
    `--batch-transform NAME`: each training micro-batch, on the device after loading, goes
    through it (validation's never do). `draw` (training/batches.py's `Draw`) gives its
    randomness seeded by (--seed, step, micro-batch, rank), so a resumed run draws the same;
    targets may come back as (N, C) class probabilities, which the default loss takes."""

    def register(transform: F) -> F:
        REGISTRY.batch_transforms[name] = transform
        return transform

    return register


def optimizer(fn: F) -> F:
    """Register `build(config, model, device) -> Optimizer` in place of AdamW."""
    REGISTRY.optimizer = fn
    return fn


def train_metric(fn: F) -> F:
    """Register `metric(logits, targets) -> {name: sum over the batch}` for training batches
    (called without gradients on the detached logits; only when something is registered)."""
    REGISTRY.train_metrics.append(fn)
    return fn


def val_metric(fn: F) -> F:
    """Register `metric(logits, targets) -> {name: sum over the batch}` for validation."""
    REGISTRY.val_metrics.append(fn)
    return fn


def set_metric(finish: Callable[[dict[str, torch.Tensor]], dict[str, float]]) -> Callable[[F], F]:
    """Register `update(logits, targets) -> {name: tensor of a fixed shape}` for validation,
    whose totals over the whole set (all batches, all ranks; in float32, exact for counts up
    to 2**24) `finish(totals) -> {name: float}` makes into `val_<name>`: a balanced accuracy,
    a macro F1, anything a mean per sample cannot give. `training` and `evaluate` both run it."""

    def register(update: F) -> F:
        REGISTRY.set_metrics.append(SetMetric(update, finish))
        return update

    return register


def callback(point: str) -> Callable[[F], F]:
    """Register `fn(run)` to be called at `point` (one of POINTS)."""
    if point not in POINTS:
        raise ValueError(f"no callback point {point!r}; choose from {', '.join(POINTS)}")

    def register(fn: F) -> F:
        REGISTRY.callbacks[point].append(fn)
        return fn

    return register


def state(name: str, *, per_rank: bool = False) -> Callable[[F], F]:
    """Register `factory(run) -> Stateful | None`, made once per run: its `state_dict()` rides
    in every checkpoint under `name` and is loaded back on resume (None: nothing to keep).
    Under torchrun rank 0's is saved, for a state every rank holds alike; `per_rank=True`
    saves every rank's (what each rank saw of its own data) and gives each rank its own back
    on resume; on another number of ranks they start afresh, and one line says so."""

    def register(factory: F) -> F:
        REGISTRY.states[name] = factory
        if per_rank:
            REGISTRY.per_rank_states.add(name)
        else:
            REGISTRY.per_rank_states.discard(name)
        return factory

    return register


def validation_model(fn: F) -> F:
    """Register `fn(run) -> nn.Module | None`: the model validation evaluates instead of the
    trained one (an average of the weights); the last registration that returns one wins."""
    REGISTRY.validation_models.append(fn)
    return fn


def load() -> Registry:
    """The registry, filled: importing the package (its __init__.py) imported the template's
    own registrations and your files (model.py, extensions.py, data.py) before any module of
    it ran. This module imports none of them, so the registry is a leaf of the import graph."""
    return REGISTRY


def user_attr(module: str, name: str, default: Any = None) -> Any:
    """`name` from the user's file `module` (one of USER_MODULES), `default` where the file
    or the name does not exist: the template's other reads of your files (data.py's
    `build_datasets`, model.py's `build_model_for`, extensions.py's `extra_metrics`)."""
    from . import USER_MODULES

    assert module in USER_MODULES, module
    found = sys.modules.get(f"{__package__}.{module}")
    return default if found is None else getattr(found, name, default)


def val_metrics() -> list[Callable[..., dict[str, torch.Tensor]]]:
    """The registered validation metrics, then extensions.py's `extra_metrics` if it has one
    (the hook before the slots; looked up at each call, so a test may patch it)."""
    legacy = user_attr("extensions", "extra_metrics")
    return [*load().val_metrics, *([legacy] if legacy is not None else [])]


def run_callbacks(point: str, run: Run) -> None:
    for fn in load().callbacks[point]:
        fn(run)


def batch_metrics(
    metrics: list[Callable[..., dict[str, torch.Tensor]]],
    logits: torch.Tensor,
    targets: torch.Tensor,
    into: dict[str, torch.Tensor],
) -> None:
    """Add each registered metric's per-batch sums into `into` (float, on logits' device)."""
    for metric in metrics:
        for name, value in metric(logits, targets).items():
            value = torch.as_tensor(value, device=logits.device).float()
            into[name] = into[name] + value if name in into else value


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: weight decay on weight matrices and conv kernels (2-D and more), none on
    biases, norms and embeddings (a tied output layer is the embedding). Each group's `decay`
    key says which it is, so a resume can set this run's --weight-decay on the right one.

    Measured on the language model's default run (docs/language-model.md): 0.009 nats lower
    validation loss than decay on everything, on each of two seeds.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for param in model.parameters():  # each tied tensor once
        (decay if param.ndim >= 2 and id(param) not in embeddings else rest).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay, "decay": True},
        {"params": rest, "weight_decay": 0.0, "decay": False},
    ]
