"""The parts of the training loop that `train.train()` strings together, one function each.

`Run` (training/run.py) holds one run: the parts `train.build_run` makes and where the run
stands. Then:
`next_batches` (the step's data: a new epoch's order where one begins), `train_step` (one
optimizer step: micro-batches, accumulation, clipping, the health check, the update),
`log_progress` (the periodic train record) and `end_interval` (every --eval-every steps:
evaluate, the validation record, and its checkpoint through the run's `Checkpointer`:
checkpointing/checkpointer.py, which makes every save). Each takes the `Run` and changes only
what its name says; a test can call one alone.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.profiler import record_function
from tqdm import tqdm

from .. import slots, utils
from ..runtime import accelerator, distributed, exits, parallel
from ..runtime.stopping import StopSignal
from . import muon
from .batches import labels_of, loss_of, transform_batch
from .metrics import MetricsWriter, add_totals, extra_means, peak_memory, summarize
from .run import Run
from .task import blow_up_error, evaluate, step_is_finite

if TYPE_CHECKING:
    from ..checkpointing.checkpointer import Checkpointer


@dataclass
class Guard:
    """What the non-finite guard keeps on the device between reads (one process): whether a
    step since the run began was non-finite, and that first step's number, loss and norm.
    Once `bad` is set every update is skipped on the device; `check_health` reads it."""

    bad: torch.Tensor
    step: torch.Tensor
    loss: torch.Tensor
    norm: torch.Tensor


def next_batches(run: Run, step: int, batches: Iterator[Any] | None) -> Iterator[Any]:
    """The batches optimizer step `step` (from 0) reads from: the epoch's iterator, or at an
    epoch's start (and where a run starts or resumes) a new one in that epoch's order. The
    epoch is only this: where the sampler reshuffles."""
    epoch, index = run.position(step)
    if batches is not None and index > 0:
        return batches
    run.sampler.set_epoch(epoch)  # a new order every epoch, the same on resume
    # Skip the steps a resumed epoch already did without loading their batches.
    run.sampler.start = index * run.samples_per_step
    return iter(run.train_loader)


def begin_interval(run: Run) -> None:
    """Before the steps up to the next validation: training mode, fresh meters and peaks."""
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    run.model.train()
    run.meter.reset()


def progress_bar(run: Run) -> tqdm[Any]:
    return tqdm(
        total=run.total_steps,
        initial=run.global_step,
        leave=False,
        desc="steps",
        dynamic_ncols=True,
        disable=not (run.ctx.is_main and run.config.log.progress),
    )


def train_step(run: Run, batches: Iterator[Any], stop: StopSignal) -> tuple[torch.Tensor, bool]:
    """One optimizer step: `--grad-accum-steps` micro-batches forward and backward, clipping,
    the health check, the update. Returns (the summed micro-batch losses, still on the
    device: no host sync; whether every rank agreed to stop after this step)."""
    config, device, meter = run.config, run.device, run.meter
    model, raw_model, optimizer, scaler = run.model, run.raw_model, run.optimizer, run.scaler
    precision, accum = config.speed.precision, config.optim.grad_accum_steps
    step_losses = []
    micro_batches = []  # kept for one step only: the blow-up diagnosis re-runs them
    for micro in range(accum):
        with record_function("data"):
            waited = time.perf_counter()
            inputs, targets = utils.to_device(next(batches), device)
            meter.data_time += time.perf_counter() - waited
        # --batch-transform (mixup, cutmix, yours): on the device, seeded by step and micro.
        inputs, targets = transform_batch(run, inputs, targets, run.global_step, micro)
        micro_batches.append((inputs, targets))
        # DDP all-reduces (FSDP reduce-scatters) gradients during backward; until the last
        # micro-batch of the step there is nothing worth reducing.
        no_sync = run.ctx.enabled and micro < accum - 1
        with (
            parallel.no_sync(model) if no_sync else contextlib.nullcontext(),
            utils.anomaly_detection(config.log.detect_anomaly),
        ):
            with record_function("forward"), accelerator.autocast(device, precision):
                logits, labels = run.task.outputs(model, inputs, targets)
                loss = loss_of(run, logits, labels, inputs)
            with record_function("backward"):
                # Average over micro-batches: the gradient of one big batch.
                scaler.scale(loss / accum if accum > 1 else loss).backward()
        step_losses.append(loss.detach())
        labels = labels_of(labels, logits)  # soft targets: the largest share's class
        meter.add_batch(step_losses[-1], logits, labels)
        if run_metrics := slots.load().train_metrics:  # none registered: nothing to do
            with torch.no_grad():
                slots.batch_metrics(run_metrics, logits.detach().float(), labels, meter.extra)

    with record_function("optimizer"):
        grad_norm = utils.clip_gradients(
            raw_model.parameters(),
            config.optim.grad_clip,
            scaler=scaler,
            optimizer=optimizer,
        )
    # The health flag: the loss and the norm share one flag (one kernel). Under fp16 an inf
    # gradient is routine (GradScaler skips that step), so only the loss counts there. It is
    # not read here: a non-finite step (and every one after it) is skipped on the device,
    # and `check_health` stops the run at the next log step. Under torchrun the ranks agree
    # on it on the device first (one more tiny all-reduce, no read), so all skip together;
    # with --detect-anomaly it is read here, and a blow-up stops BEFORE the update.
    with record_function("sync"):
        step_loss = step_losses[0] if accum == 1 else torch.stack(step_losses).sum()
        healthy = step_is_finite(step_loss, grad_norm, scaler)
        if run.ctx.enabled:
            healthy = distributed.all_reduce((~healthy).float(), op="max") == 0
        skip = None
        if not config.log.detect_anomaly:
            skip = _record(run, healthy, step_loss / accum, grad_norm)
        elif not bool(healthy):  # every rank got here: the verdict was all-reduced
            kept = _kept(run)
            raise blow_up_error(
                run.task, raw_model, micro_batches, precision, device, step_loss / accum,
                grad_norm, run.global_step + 1, kept, partial(loss_of, run),
            )  # fmt: skip
        stop_now = _agree(run, stop)
    with record_function("optimizer"):
        _update(run, skip)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        run.scheduler.step()
    run.global_step += 1
    meter.add_step(grad_norm)
    run.batches = micro_batches
    slots.run_callbacks("after_step", run)
    run.batches = []
    return step_loss, stop_now


def _agree(run: Run, stop: StopSignal) -> bool:
    """Whether every rank stops after this step; hands --save-every-minutes' agreed "time is
    up" to the run's checkpointer (`Checkpointer.due` acts on it).

    A rank that stopped alone would leave the others waiting forever in the next collective,
    so under torchrun the ranks agree on both requests on the host, one step late
    (distributed.HostAgreement: no device sync): a stop or a timed save comes one step after
    a rank asked for it, on every rank at the same step. In one process, at once. (The
    checkpointer waits for the agreement in flight when it closes.)
    """
    if run.agreement is None:
        run.agreement = distributed.HostAgreement(2)
    clock = run.checkpointer  # None for a step taken alone (a test): no timed saves
    late = run.ctx.enabled and clock is not None and clock.late()
    asked = (stop.signum is not None, late)
    verdict = run.agreement.exchange(asked, clock.saves if clock is not None else 0)
    if verdict is None:  # torchrun's first step: nothing agreed yet
        return False
    (stop_all, late_all), asked_after = verdict
    if run.ctx.enabled and clock is not None:
        clock.agree_late(late_all, asked_after)
    return stop_all


def _record(
    run: Run, healthy: torch.Tensor, loss: torch.Tensor, grad_norm: torch.Tensor
) -> torch.Tensor:
    """Keep the step's health on the device (no read): the first non-finite step's number,
    loss and norm, and the flag that skips this update and every later one. Returns it."""
    guard = run.guard
    if guard is None:
        zero = torch.zeros((), device=run.device)  # made on the device: no copy
        guard = run.guard = Guard(zero.bool(), zero.long(), zero, zero)
    first = ~healthy & ~guard.bad
    guard.step = torch.where(first, run.global_step + 1, guard.step)
    guard.loss = torch.where(first, loss.detach().float(), guard.loss)
    guard.norm = torch.where(first, grad_norm.detach().float(), guard.norm)
    guard.bad = guard.bad | ~healthy
    return guard.bad


def _update(run: Run, skip: torch.Tensor | None) -> None:
    """`scaler.step(optimizer)`, skipped on the device where `skip` is set: nothing of the
    step reaches the weights or the optimizer's state (moments, step counts). Under fp16 the
    flag joins GradScaler's found-inf flag; a fused optimizer (the template's AdamW, on CUDA
    and the CPU) and MuonAdamW take it as GradScaler's found_inf, which their kernels honour;
    any other steps and is put back where the flag is set (a transient copy of its weights
    and state, every step: register a fused optimizer to avoid it)."""
    optimizer, scaler = run.optimizer, run.scaler
    if skip is None:
        scaler.step(optimizer)
    elif scaler.is_enabled():  # clip_gradients unscaled: the flags exist, one per device
        state = scaler._per_optimizer_states[id(optimizer)]
        for found in state["found_inf_per_device"].values():
            found.copy_(torch.maximum(found, skip.to(found.device, found.dtype)))
        scaler.step(optimizer)
    elif muon.takes_found_inf(optimizer):
        optimizer.found_inf = skip.float()  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
    else:
        muon.step_unless(optimizer, skip)


def check_health(run: Run) -> None:
    """The guard's one read, at a log step, a validation and before any save: a step since
    the last read that was non-finite stops the run here, before anything is logged, saved
    or evaluated, with the line the step's own check gives: its number, loss and norm, and
    the diagnosis of its batches (read again: the weights are still those before it, since
    its update and every later one were skipped)."""
    guard = run.guard
    if guard is None or not bool(guard.bad):
        return
    step = int(guard.step)
    raise blow_up_error(
        run.task, run.raw_model, _batches_of(run, step), run.config.speed.precision,
        run.device, guard.loss, guard.norm, step, _kept(run), partial(loss_of, run),
    )  # fmt: skip


def _kept(run: Run) -> str:
    """The checkpoints a blow-up leaves, once the good one in flight is written (a failed
    write is reported when the checkpointer closes, at the run's end)."""
    if run.checkpointer is not None:
        run.checkpointer.wait_for_write()
    return exits.kept(run.last_path, run.best_path)


def _batches_of(run: Run, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches of optimizer step `step` (counted from 1), read again in the run's
    order: the same samples (random augmentation draws anew; --batch-transform the same)."""
    epoch, index = run.position(step - 1)
    run.sampler.set_epoch(epoch)
    run.sampler.start = index * run.samples_per_step
    batches = iter(run.train_loader)
    accum = run.config.optim.grad_accum_steps
    moved = [utils.to_device(next(batches), run.device) for _ in range(accum)]
    return [transform_batch(run, x, y, step - 1, micro) for micro, (x, y) in enumerate(moved)]


def log_progress(run: Run, writer: MetricsWriter, bar: tqdm[Any]) -> None:
    """The periodic `train` record: the interval's meters, read and reset."""
    check_health(run)
    totals = run.meter.read()  # all-reduce + the interval's one extra sync
    add_totals(run.epoch_totals, totals)
    record = {
        "kind": "train",
        "epoch": run.epoch_of(run.global_step),
        "step": run.global_step,
        **summarize(totals),
        "lr": run.optimizer.param_groups[0]["lr"],
        **peak_memory(run.device),
    }
    record.update(run.utilization.record(record["samples_per_s"] / run.ctx.world_size))
    record.update(run.task.metrics(record))
    writer.write(record)
    bar.set_postfix(loss=f"{record['loss']:.4f}", acc=f"{record['acc']:.3f}")
    run.meter.reset()


def end_interval(run: Run, writer: MetricsWriter, checkpointer: Checkpointer) -> None:
    """The validation every --eval-every steps (and at the budget's end): evaluate, write the
    `epoch` record (named so since records had one per epoch: a validation's), save last.pt
    through `checkpointer` (and best.pt when the task's `best_by` figure improved: val_acc
    for images, val_bpb for a language model), then start the next interval."""
    check_health(run)
    add_totals(run.epoch_totals, run.meter.read())
    distributed.broadcast_buffers(run.raw_model)
    # The uncompiled model: the compiled graph was traced in training mode, and inference
    # mode plus the last, smaller validation batch would cost two more compilations (per
    # rank, different ones with uneven shards).
    with parallel.gathered(run.raw_model):  # FSDP: full weights, uneven shards are fine
        val = evaluate(
            validation_model(run), run.val_loader, run.device, run.config.speed.precision,
            run.task,
        )  # fmt: skip
    train_metrics = summarize(run.epoch_totals)
    epoch = run.epoch_of(run.global_step)
    result = run.result = {
        "kind": "epoch",
        "epoch": epoch,
        "global_step": run.global_step,
        "train_loss": train_metrics["loss"],
        "train_acc": train_metrics["acc"],
        **val,
        "lr": run.optimizer.param_groups[0]["lr"],
        "grad_norm": train_metrics["grad_norm"],
        "skipped_steps": train_metrics["skipped_steps"],
        "samples_per_s": train_metrics["samples_per_s"],
        "data_wait": train_metrics["data_wait"],
        **run.task.metrics(train_metrics, "train_"),
        **extra_means(run.epoch_totals, "train_"),
        **peak_memory(run.device),
    }
    slots.run_callbacks("after_validation", run)
    writer.write({**result, "step": run.global_step})
    improved = improves(run, val)
    result[f"best_{run.task.best_by[0]}"] = run.best
    run.log(
        f"step {run.global_step}/{run.total_steps} (epoch {epoch})  train loss "
        f"{result['train_loss']:.4f} acc {result['train_acc']:.3f} | val loss "
        f"{val['val_loss']:.4f} acc {val['val_acc']:.3f} | lr {result['lr']:.2e} | "
        f"{result['samples_per_s']:.0f} {run.task.unit}/s, data wait "
        f"{100 * result['data_wait']:.0f}%"
    )
    run.validated_step, run.epoch_totals = run.global_step, {}  # the next interval's
    epochs_done, steps_done = run.position(run.global_step)
    checkpointer.save(
        epochs_done, steps_done * run.samples_per_step, {}, improved=improved,
        val_loss=val["val_loss"],
    )  # fmt: skip
    if improved:
        best = {"kind": "best", "step": run.global_step, "epoch": epoch}
        writer.write({**best, run.task.best_by[0]: run.best, "path": str(run.best_path)})
    begin_interval(run)


def improves(run: Run, val: dict[str, float]) -> bool:
    """Whether this validation beats the best so far by the task's `best_by` figure (a first
    finite one always does), and if so, keep it as the best."""
    name, higher = run.task.best_by
    value = val[name]
    if not math.isfinite(value):
        return False
    if run.best is not None and not (value > run.best if higher else value < run.best):
        return False
    run.best = value
    return True


def validation_model(run: Run) -> nn.Module:
    """What validation evaluates: the last `@slots.validation_model` that gives one (the EMA
    with --ema-decay), else the unwrapped trained model."""
    chosen = run.raw_model
    for pick in slots.load().validation_models:
        chosen = pick(run) or chosen
    return chosen
