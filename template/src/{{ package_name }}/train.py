"""Train a model: `python -m <package>.train --help`.

`train()` reads as the run's outline: build the run, resume it, then for each epoch its
steps, the periodic log, evaluation and the checkpoint. The same code runs on a laptop CPU
and across GPUs and nodes:

    python -m <package>.train --epochs 3
    torchrun --standalone --nproc_per_node=4 -m <package>.train --precision bf16
    python -m <package>.train --resume auto          # after a preemption (SIGTERM)

Each part is one named function of one screen: `build_run` (processes, devices, data, model,
optimizer, schedule, scaler), `resume`, and in loop.py `train_step` (micro-batches,
accumulation, clipping, the health check), `log_progress`, `end_epoch`, `save_checkpoint`.
They share one plain record, `loop.Run`, instead of the methods of a Trainer class (as in
torchtitan's `Trainer.train_step`): what a function reads and changes is in its arguments, a
test can run one step alone, and there is no class to subclass. To change a part (the model,
loss, optimizer, schedule, a metric, a callback, extra state), register yours in model.py or
extensions.py (slots.py): this file stays the template's (docs/template.md, "Where to change
what").

Every step labels its phases with `record_function` ("data", "forward", "backward",
"optimizer", and "sync" for the step's one host sync), so a profiler trace shows where the
time goes. Exit codes: 0 done, 1 training blew up (a non-finite loss, weight or statistic;
nothing non-finite is ever saved), 2 bad input (flags, data, checkpoint, a run dir in use or
holding another run), 74 a checkpoint could not be written (disk full, read-only), 128+N
stopped by signal N after saving. docs/reliability.md lists every fault and how to recover.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from . import (
    checkpoint,
    checkpoint_state,
    distributed,
    finetune,
    parallel,
    resume_choice,
    rundir,
    sharded_checkpoint,
    slots,
    step_checkpoints,
    utils,
)
from .checkpoint import Interrupted
from .config import Config, ConfigError, parse_config
from .data_sources import DataInfo, ResumableSampler, shard
from .loop import (
    Run,
    begin_epoch,
    end_epoch,
    log_progress,
    progress_bar,
    save_checkpoint,
    train_step,
)
from .metrics import Meter, MetricsWriter, run_record
from .mfu import Utilization
from .task import Task, build_model_for, check_precision, evaluate, loss_function, task_for

__all__ = ["build_model_for", "build_run", "evaluate", "main", "resume", "train"]


def train(
    config: Config,
    *,
    on_step: Callable[[int], None] | None = None,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the training described by `config` and return the final metrics.

    `on_step(global_step)` is called after every optimizer step (a profiler's `step`, a
    timer); `on_epoch(metrics)` after each epoch's checkpoint is saved, with that epoch's
    metrics (a sweep reports val_acc there, and may raise to prune the run). Raises
    ConfigError, DataError or CheckpointError for bad input, `utils.NonFiniteLossError` when
    the loss blows up, and `checkpoint.Interrupted` after saving on a stop signal,
    `rundir.RunDirError` for a run dir it cannot own, and `checkpoint.SaveError` when a
    checkpoint cannot be written.
    """
    with contextlib.ExitStack() as cleanup:
        run = build_run(config, cleanup)
        cleanup.callback(step_checkpoints.close, run)  # a background write is never cut off
        resumed = resume(run)
        writer = MetricsWriter(
            Path(config.run.run_dir),
            enabled=run.ctx.is_main,
            tracker=config.log.tracker,
            experiment=config.log.experiment,
            tracker_uri=config.log.tracker_uri,
            resuming=resumed,
        )
        cleanup.callback(writer.close)
        stop = cleanup.enter_context(checkpoint.StopSignal())
        distributed.barrier()  # the first line of metrics.jsonl: every rank takes stop signals
        writer.write({**run.record, "step": run.global_step})
        run.log(run.header)

        for epoch in range(run.epoch, config.optim.epochs):
            first_step, batches = begin_epoch(run, epoch)
            bar = progress_bar(run, epoch, first_step)
            for step_in_epoch in range(first_step, run.steps_per_epoch):
                _, stop_now = train_step(run, batches, stop)
                if on_step is not None:
                    on_step(run.global_step)
                bar.update()
                # A signal that arrived during this step stops right here in a single process;
                # under DDP the ranks stop where the all-reduced flag told all of them to.
                stop_now = stop_now or (stop.signum is not None and not run.ctx.enabled)
                save_now = step_checkpoints.due(run, step_in_epoch)  # --save-every
                if run.global_step % config.log.log_every == 0 or stop_now or save_now:
                    log_progress(run, writer, epoch, bar)
                if stop_now or save_now:
                    done = (step_in_epoch + 1) * run.samples_per_step
                    save_checkpoint(
                        run, epoch, done, run.epoch_totals, improved=False, val_loss=0.0
                    )
                # A signal during a step checkpoint's save stops on it: no step, no save more.
                if stop_now or (save_now and step_checkpoints.stopping(run, stop)):
                    step_checkpoints.finish(run)  # written before the line says it is
                    bar.close()
                    last = run.last_path if run.ctx.is_main else None
                    raise Interrupted(stop.signum or signal.SIGTERM, run.global_step, last)
            bar.close()
            end_epoch(run, writer, epoch)
            if on_epoch is not None:
                on_epoch(dict(run.result))
            run.skip_samples = 0
            # A signal during validation or the epoch's save stops on that checkpoint.
            if epoch + 1 < config.optim.epochs and step_checkpoints.stopping(run, stop):
                last = run.last_path if run.ctx.is_main else None
                raise Interrupted(stop.signum or signal.SIGTERM, run.global_step, last)

        step_checkpoints.finish(run)  # the last checkpoint's background write
        # Rank 0 may still be writing the last checkpoint: a rank that tears the process
        # group down meanwhile can leave the shutdown of the connections hanging.
        distributed.barrier()
        result = run.result
        result.pop("kind", None)
        result.setdefault("global_step", run.global_step)
        return result


def build_run(config: Config, cleanup: contextlib.ExitStack) -> Run:
    """Processes, devices and seeds, the run dir, data, model, optimizer, schedule, scaler."""
    # The same seed on every rank: the same initial model, and rank 0's RNG state (the one
    # checkpoints save) is every rank's. The sampler still gives each rank its data.
    generator = utils.seed_everything(config.run.seed, config.run.deterministic)
    try:
        ctx = distributed.setup(config.run.device)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    cleanup.callback(distributed.cleanup)
    device = ctx.device
    check_precision(config.speed.precision, device)
    # cuDNN times candidate kernels once per input shape and keeps the fastest: a win for
    # fixed shapes, but the choice is not repeatable, so never in deterministic mode.
    torch.backends.cudnn.benchmark = config.speed.cudnn_benchmark and not config.run.deterministic
    utils.set_tf32(config.speed.tf32)  # only CUDA kernels on Ampere or newer read it
    log = rundir.log if ctx.is_main else _silent
    # Before any work: lock the run dir, prove it is writable, refuse to overwrite a run.
    lock = rundir.claim_on_rank_zero(
        Path(config.run.run_dir), config.run.resume, ctx.is_main, device
    )
    if lock is not None:
        cleanup.callback(lock.close)
    task = task_for(config)  # what differs per task: data, outputs, metrics, FLOPs
    parts = _build_data(config, ctx, task, generator, log)
    sampler, train_loader, val_loader, info, workers, steps_per_epoch = parts
    cleanup.callback(utils.close_workers, train_loader, val_loader)  # even on an error
    raw_model, model, compile_on, utilization = _build_model(config, task, info, ctx, log)
    optimizer = build_optimizer(config, raw_model, device)
    scheduler = build_scheduler(config, optimizer, config.optim.epochs * steps_per_epoch)
    scaler = utils.make_grad_scaler(device, config.speed.precision)  # enabled for fp16 only
    samples = len(train_loader.dataset)  # type: ignore[arg-type]  # a Dataset need not be Sized
    convs = [p for p in raw_model.parameters() if p.dim() == 4]  # --channels-last's
    header = (
        f"training on {device} x{ctx.world_size} | {samples} samples, "
        f"{steps_per_epoch} steps/epoch | workers {workers} | {config.speed.precision} | "
        f"compile {'on' if compile_on else 'off'}"
        + (" | channels-last" if config.speed.channels_last and convs else "")
        + (" | FSDP2" if parallel.is_sharded(raw_model) else "")
    )
    run = Run(
        config=config, ctx=ctx, task=task, raw_model=raw_model, model=model,
        optimizer=optimizer, scheduler=scheduler, scaler=scaler, sampler=sampler,
        train_loader=train_loader, val_loader=val_loader, meter=Meter(device, ctx.world_size),
        utilization=utilization, steps_per_epoch=steps_per_epoch, header=header,
        record={**run_record(config.flat(), device, ctx.world_size), **task.record()}, log=log,
        loss_fn=loss_function(),
    )  # fmt: skip
    # Each `@slots.state` (the EMA, yours) made once, from the built run; None: kept off.
    made = {name: factory(run) for name, factory in slots.load().states.items()}
    run.states = {name: part for name, part in made.items() if part is not None}
    return run


def _build_data(
    config: Config,
    ctx: distributed.Context,
    task: Task,
    generator: torch.Generator,
    log: Callable[[str], None],
) -> tuple[ResumableSampler, DataLoader[Any], DataLoader[Any], DataInfo, int, int]:
    """(sampler, train loader, val loader, info, workers, optimizer steps per epoch)."""
    train_set, val_set, info = task.datasets(config)
    device, batch_size = ctx.device, config.optim.batch_size
    workers = utils.resolve_num_workers(
        config.data.num_workers, ctx.local_world_size, in_memory=info.in_memory
    )
    if config.data.num_workers == "auto" and not info.in_memory:  # measured once, then cached
        workers, rates, cached = utils.auto_num_workers(
            train_set,
            batch_size=batch_size,
            dataset_id=str(config.data.data_dir),
            world_size=ctx.local_world_size,
            device=device,
        )
        log(f"--num-workers auto: {workers} ({'cached' if cached else 'measured'}: {rates})")
    sampler = ResumableSampler(
        train_set, num_replicas=ctx.world_size, rank=ctx.rank, seed=config.run.seed
    )
    train_loader = utils.build_dataloader(
        train_set,
        batch_size=batch_size,
        train=True,
        num_workers=workers,
        generator=generator,
        sampler=sampler,
        device=device,
    )
    # A generator of its own: otherwise creating the loader's iterator would draw from the
    # global RNG, and evaluation would shift the dropout masks of later epochs.
    val_loader = utils.build_dataloader(
        shard(val_set, ctx.rank, ctx.world_size),
        batch_size=batch_size,
        train=False,
        num_workers=workers,
        device=device,
        generator=torch.Generator().manual_seed(config.run.seed),
    )
    accum = config.optim.grad_accum_steps
    steps_per_epoch = len(train_loader) // accum
    if config.optim.max_steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, config.optim.max_steps_per_epoch)
    if steps_per_epoch < 1:
        raise ConfigError(
            f"{len(sampler)} training samples per rank are fewer than one step of "
            f"--batch-size {batch_size} x --grad-accum-steps {accum}; lower them"
        )
    return sampler, train_loader, val_loader, info, workers, steps_per_epoch


def _build_model(
    config: Config,
    task: Task,
    info: DataInfo,
    ctx: distributed.Context,
    log: Callable[[str], None],
) -> tuple[nn.Module, nn.Module, bool, Utilization]:
    """(the model on the device, the model the step runs: compiled and wrapped or not, whether
    compiled, the MFU calculator)."""
    device = ctx.device
    raw_model = build_model_for(config, info).to(device)
    finetune.init_from(raw_model, config, log)  # --init-from, --freeze: before wrapping
    # FLOPs counted once (on a meta copy of the model, before FSDP adds its hooks), peaks
    # measured once: two divisions per log line (mfu.py).
    utilization = task.utilization(raw_model, config, info, device, ctx.is_main)
    if utilization.reason:
        log(f"no MFU in metrics.jsonl: {utilization.reason}")
    if utilization.warning:
        log(utilization.warning)
    # Compile after .to(device); "auto" compiles only on CUDA, where it pays off quickly.
    compile_on = config.speed.compile == "on" or (
        config.speed.compile == "auto" and device.type == "cuda"
    )
    compiled = utils.maybe_compile(
        raw_model, compile_on, config.speed.compile_mode, config.speed.compile_backend
    )
    # Under torchrun: DDP around it, or FSDP2 sharding it in place (parallel.py).
    model = parallel.wrap(
        compiled,
        config.speed.parallel,
        device=device,
        precision=config.speed.precision,
        activation_checkpointing=config.speed.activation_checkpointing,
    )
    return raw_model, model, compile_on, utilization


def build_optimizer(
    config: Config, model: nn.Module, device: torch.device
) -> torch.optim.Optimizer:
    """The `@slots.optimizer` registered, else AdamW with weight decay on matrices only
    (`slots.param_groups`); fused, it updates every parameter in a few kernels instead of
    several each."""
    custom = slots.load().optimizer
    if custom is not None:
        optimizer: torch.optim.Optimizer = custom(config, model, device)
        return optimizer
    return torch.optim.AdamW(
        slots.param_groups(model, config.optim.weight_decay),
        lr=config.optim.lr,
        weight_decay=config.optim.weight_decay,
        fused=device.type == "cuda",
    )


def build_scheduler(
    config: Config, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """`--lr-schedule`'s factor (schedules.py, or one registered with `@slots.schedule`) times
    --lr at each optimizer step, for a run of `total_steps`."""
    factor = slots.load().schedules[config.optim.lr_schedule]
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, partial(_scheduled, factor=factor, total=total_steps, config=config)
    )


def _scheduled(step: int, *, factor: Callable[..., float], total: int, config: Config) -> float:
    return float(factor(step, total, config))


def resume(run: Run) -> bool:
    """Continue from --resume's checkpoint, if any: every part checkpoint_state.py lists
    (weights, optimizer, schedule, scaler, RNG, where the run stood, each `@slots.state`).
    Returns whether it resumed."""
    config, device = run.config, run.device
    run_dir = Path(config.run.run_dir)
    resume_path = resume_choice.resolve_resume(config.run.resume, run_dir)
    if config.run.resume == "auto" and resume_path is None:
        run.log(f"--resume auto: no checkpoint in {run.last_path.parent}, starting fresh")
        if run.ctx.is_main:  # a run killed before its first save: its steps are redone
            rundir.trim_metrics(run_dir / "metrics.jsonl", 0)
    if resume_path is None:
        return False
    state = checkpoint.load_checkpoint(
        sharded_checkpoint.state_file(resume_path), device, run.sampler.total_size
    )
    checkpoint.check_compatible(state, config.flat(), resume_path)
    run.task.check_resume(state, config, resume_path, run.log)  # the LM's corpus
    checkpoint_state.restore(run, state, resume_path)  # every part of checkpoint_state.py
    if run.ctx.is_main:  # steps after the checkpoint will be redone: not recorded twice
        rundir.trim_metrics(run_dir / "metrics.jsonl", run.global_step)
    run.log(f"resumed from {resume_path}: epoch {run.epoch + 1}, step {run.global_step}")
    slots.run_callbacks("after_resume", run)
    return True


def _silent(*args: object, **kwargs: object) -> None:
    """Logging on ranks other than 0."""


def main(argv: list[str] | None = None) -> int:
    """Console entry point: parse flags, train, and turn known failures into one line and
    the exit code documented in docs/reliability.md."""
    config, _ = parse_config(argv, description="Train the model.")
    return rundir.exit_code(lambda: train(config))


if __name__ == "__main__":
    distributed.exit_process(main())  # after torchrun's process group, with no finalizing
