"""Train a model: `python -m <package>.train --help`.

One file, read top to bottom: set up processes and devices, data, model, optimizer, resume,
then the loop. The same code runs on a laptop CPU and across GPUs and nodes:

    python -m <package>.train --epochs 3
    torchrun --standalone --nproc_per_node=4 -m <package>.train --precision bf16
    python -m <package>.train --resume auto          # after a preemption (SIGTERM)

Every step labels its phases with `record_function` ("data", "forward", "backward",
"optimizer", and "sync" for the step's one host sync), so a profiler trace shows where the
time goes. Exit codes: 0 done, 1 training blew up (a non-finite loss, weight or statistic;
nothing non-finite is ever saved), 2 bad input (flags, data, checkpoint, a run dir in use or
holding another run), 74 a checkpoint could not be written (disk full, read-only), 128+N
stopped by signal N after saving. docs/reliability.md lists every fault and how to recover.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function
from tqdm import tqdm

from . import checkpoint, distributed, parallel, rundir, sharded_checkpoint, utils
from .checkpoint import Interrupted, SaveError
from .config import Config, ConfigError, parse_config
from .data import ResumableSampler, shard
from .metrics import Meter, MetricsWriter, add_totals, peak_memory, run_record, summarize
from .task import blow_up_error, build_model_for, cross_entropy, evaluate, task_for


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
        # ---- processes, device, seeds -------------------------------------------------------
        # The same seed on every rank: the same initial model, and rank 0's RNG state (the
        # one checkpoints save) is every rank's. The sampler still gives each rank its data.
        generator = utils.seed_everything(config.run.seed, config.run.deterministic)
        try:
            ctx = distributed.setup(config.run.device)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        cleanup.callback(distributed.cleanup)
        device = ctx.device
        _check_precision(config.speed.precision, device)
        # cuDNN times candidate kernels once per input shape and keeps the fastest: a win for
        # fixed shapes, but the choice is not repeatable, so never in deterministic mode.
        torch.backends.cudnn.benchmark = (
            config.speed.cudnn_benchmark and not config.run.deterministic
        )
        utils.set_tf32(config.speed.tf32)  # only CUDA kernels on Ampere or newer read it
        run_dir = Path(config.run.run_dir)
        # An FSDP run writes sharded checkpoint folders (sharded_checkpoint.py), others files.
        sharded = config.speed.parallel == "fsdp"
        suffix = sharded_checkpoint.SUFFIX if sharded else ".pt"
        last_path = run_dir / "checkpoints" / f"last{suffix}"
        best_path = run_dir / "checkpoints" / f"best{suffix}"
        log = rundir.log if ctx.is_main else _silent
        # Before any work: lock the run dir, prove it is writable, refuse to overwrite a run.
        lock = rundir.claim_on_rank_zero(run_dir, config.run.resume, ctx.is_main, device)
        if lock is not None:
            cleanup.callback(lock.close)

        # ---- data ---------------------------------------------------------------------------
        task = task_for(config)  # what differs per task: data, outputs, metrics, FLOPs
        train_set, val_set, info = task.datasets(config)
        workers = utils.resolve_num_workers(
            config.data.num_workers, ctx.local_world_size, in_memory=info.in_memory
        )
        if config.data.num_workers == "auto" and not info.in_memory:  # measured once, then cached
            workers, rates, cached = utils.auto_num_workers(
                train_set,
                batch_size=config.optim.batch_size,
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
            batch_size=config.optim.batch_size,
            train=True,
            num_workers=workers,
            generator=generator,
            sampler=sampler,
            device=device,
        )
        # A generator of its own: otherwise creating the loader's iterator would draw from
        # the global RNG, and evaluation would shift the dropout masks of later epochs.
        val_loader = utils.build_dataloader(
            shard(val_set, ctx.rank, ctx.world_size),
            batch_size=config.optim.batch_size,
            train=False,
            num_workers=workers,
            device=device,
            generator=torch.Generator().manual_seed(config.run.seed),
        )
        accum = config.optim.grad_accum_steps
        samples_per_step = accum * config.optim.batch_size  # per rank
        steps_per_epoch = len(train_loader) // accum
        if config.optim.max_steps_per_epoch is not None:
            steps_per_epoch = min(steps_per_epoch, config.optim.max_steps_per_epoch)
        if steps_per_epoch < 1:
            raise ConfigError(
                f"{len(sampler)} training samples per rank are fewer than one step of "
                f"--batch-size {config.optim.batch_size} x --grad-accum-steps {accum}; lower them"
            )

        # ---- model --------------------------------------------------------------------------
        raw_model = build_model_for(config, info).to(device)
        # FLOPs counted once (on a meta copy of the model, before FSDP adds its hooks), peaks
        # measured once: two divisions per log line (mfu.py).
        utilization = task.utilization(raw_model, config, info, device, ctx.is_main)
        if utilization.reason:
            log(f"no MFU in metrics.jsonl: {utilization.reason}")
        if utilization.warning:  # the start-up probe read far below the cached peak
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

        # ---- optimizer, schedule, gradient scaler -------------------------------------------
        # fused AdamW updates every parameter in a few kernels instead of several per tensor.
        optimizer = torch.optim.AdamW(
            raw_model.parameters(),
            lr=config.optim.lr,
            weight_decay=config.optim.weight_decay,
            fused=device.type == "cuda",
        )
        total_steps = config.optim.epochs * steps_per_epoch
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, partial(lr_factor, warmup=config.optim.warmup_steps, total=total_steps)
        )
        scaler = utils.make_grad_scaler(device, config.speed.precision)  # enabled for fp16 only

        # ---- resume -------------------------------------------------------------------------
        start_epoch, skip_samples, global_step, best_acc = 0, 0, 0, -1.0
        epoch_totals: dict[str, float] = {}
        result: dict[str, Any] = {}
        resume_path = checkpoint.resolve_resume(config.run.resume, run_dir)
        if config.run.resume == "auto" and resume_path is None:
            log(f"--resume auto: no checkpoint in {last_path.parent}, starting fresh")
        if resume_path is not None:
            state = checkpoint.load_checkpoint(
                sharded_checkpoint.state_file(resume_path), map_location=device
            )
            checkpoint.check_compatible(state, config.flat(), resume_path)
            # A sharded folder loads onto however many ranks this run has (resharding).
            sharded_checkpoint.load_model_and_optimizer(resume_path, state, raw_model, optimizer)
            for target, key in ((scheduler, "scheduler"), (scaler, "scaler")):
                checkpoint.load_state_into(target, state[key], key, resume_path)
            # The checkpoint says where in the schedule we are; this run's flags say what the
            # schedule is (as in nanoGPT): a resumed run honours a changed --lr or --epochs.
            scheduler.base_lrs = [config.optim.lr for _ in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] = config.optim.lr * scheduler.lr_lambdas[0](scheduler.last_epoch)
                group["weight_decay"] = config.optim.weight_decay
            checkpoint.restore_rng_state(state["rng"], device)
            start_epoch, skip_samples = state["epoch"], state["samples_in_epoch"]
            global_step, best_acc = state["step"], state.get("best_val_acc", -1.0)
            epoch_totals = dict(state.get("epoch_totals", {}))
            result = dict(state.get("metrics", {}))
            if ctx.is_main:  # steps after the checkpoint will be redone: not recorded twice
                rundir.trim_metrics(run_dir / "metrics.jsonl", global_step)
            log(f"resumed from {resume_path}: epoch {start_epoch + 1}, step {global_step}")

        def snapshot(epoch: int, samples_in_epoch: int, totals: dict[str, float]) -> dict:
            """Everything needed to continue exactly from here (model saved unwrapped; in a
            sharded checkpoint, model and optimizer are the shards beside this)."""
            return {
                "format": checkpoint.FORMAT_VERSION,
                "model": {} if sharded else raw_model.state_dict(),
                "optimizer": {} if sharded else optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "rng": checkpoint.capture_rng_state(device),
                "epoch": epoch,
                "samples_in_epoch": samples_in_epoch,
                "step": global_step,
                "best_val_acc": best_acc,
                "epoch_totals": totals,
                "metrics": result,
                "config": config.flat(),
                "run": run,
            }

        def save(epoch: int, samples: int, totals: dict, improved: bool, val_loss: float) -> None:
            """Write last.pt (and best.pt if `improved`), never a non-finite model.

            Every rank checks its weights and buffers and every rank learns the verdicts, so
            a refusal or a failed write stops all ranks together.
            """
            bad = checkpoint.first_nonfinite(raw_model)
            if bad is None and not math.isfinite(val_loss):
                bad = f"validation loss ({val_loss})"
            if rundir.any_rank(bad is not None, device):
                kept = rundir.kept(last_path, best_path)
                raise utils.NonFiniteLossError(
                    f"non-finite {bad or 'weights on another rank'} at step {global_step}, "
                    f"epoch {epoch + (samples > 0)}: not saved; {kept}; "
                    "lower --lr, set --grad-clip, or check the data",
                    step=global_step,
                )
            failure = None
            if sharded:  # every rank writes its shards; a failure raises on every rank
                state, best = snapshot(epoch, samples, totals), best_path if improved else None
                sharded_checkpoint.save(state, last_path, raw_model, optimizer, best, ctx, device)
            elif ctx.is_main:
                try:
                    checkpoint.save_checkpoint(snapshot(epoch, samples, totals), last_path)
                    if improved:
                        checkpoint.copy_checkpoint(last_path, best_path)
                except SaveError as error:
                    failure = error
            if rundir.any_rank(failure is not None, device):
                raise failure or SaveError("rank 0 could not write the checkpoint; see its message")

        run = run_record(config.flat(), device, ctx.world_size)
        writer = MetricsWriter(
            run_dir,
            enabled=ctx.is_main,
            tracker=config.log.tracker,
            experiment=config.log.experiment,
            tracker_uri=config.log.tracker_uri,
            resuming=resume_path is not None,
        )
        cleanup.callback(writer.close)
        stop = cleanup.enter_context(checkpoint.StopSignal())
        distributed.barrier()  # the first line of metrics.jsonl: every rank takes stop signals
        writer.write({**run, "step": global_step})
        meter = Meter(device, ctx.world_size)
        samples = len(train_set)  # type: ignore[arg-type]  # a Dataset need not be Sized
        convs = [p for p in raw_model.parameters() if p.dim() == 4]  # --channels-last's
        log(
            f"training on {device} x{ctx.world_size} | {samples} samples, "
            f"{steps_per_epoch} steps/epoch | workers {workers} | {config.speed.precision} | "
            f"compile {'on' if compile_on else 'off'}"
            + (" | channels-last" if config.speed.channels_last and convs else "")
            + (" | FSDP2" if parallel.is_sharded(raw_model) else "")
        )

        # ---- the loop -----------------------------------------------------------------------
        for epoch in range(start_epoch, config.optim.epochs):
            sampler.set_epoch(epoch)  # a new order every epoch, the same on resume
            first_step = skip_samples // samples_per_step if epoch == start_epoch else 0
            # Skip the steps a resumed epoch already did without loading their batches.
            sampler.start = first_step * samples_per_step
            batches = iter(train_loader)
            if epoch != start_epoch or first_step == 0:
                epoch_totals = {}
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            bar = tqdm(
                total=steps_per_epoch,
                initial=first_step,
                leave=False,
                desc=f"epoch {epoch + 1}/{config.optim.epochs}",
                dynamic_ncols=True,
                disable=not (ctx.is_main and config.log.progress),
            )
            model.train()
            meter.reset()
            for step_in_epoch in range(first_step, steps_per_epoch):
                step_losses = []
                micro_batches = []  # kept for one step only: the blow-up diagnosis re-runs them
                for micro in range(accum):
                    with record_function("data"):
                        waited = time.perf_counter()
                        inputs, targets = utils.to_device(next(batches), device)
                        meter.data_time += time.perf_counter() - waited
                    micro_batches.append((inputs, targets))
                    # DDP all-reduces (FSDP reduce-scatters) gradients during backward; until
                    # the last micro-batch of the step there is nothing worth reducing.
                    no_sync = ctx.enabled and micro < accum - 1
                    with (
                        parallel.no_sync(model) if no_sync else contextlib.nullcontext(),
                        utils.anomaly_detection(config.log.detect_anomaly),
                    ):
                        with (
                            record_function("forward"),
                            utils.autocast(device, config.speed.precision),
                        ):
                            logits, labels = task.outputs(model, inputs, targets)
                            loss = cross_entropy(logits, labels)
                        with record_function("backward"):
                            # Average over micro-batches: the gradient of one big batch.
                            scaler.scale(loss / accum if accum > 1 else loss).backward()
                    step_losses.append(loss.detach())
                    meter.add_batch(step_losses[-1], logits, labels)

                with record_function("optimizer"):
                    grad_norm = utils.clip_gradients(
                        raw_model.parameters(),
                        config.optim.grad_clip,
                        scaler=scaler,
                        optimizer=optimizer,
                    )
                # The one deliberate host sync per step: it lets the run stop BEFORE a NaN
                # reaches the weights. Loss and norm share one flag, so one read. Under fp16
                # an inf gradient is routine (GradScaler skips that step), so only the loss
                # counts there. Its own label: on a GPU the wait for the queued forward and
                # backward lands here, not in the phases around it.
                with record_function("sync"):
                    step_loss = step_losses[0] if accum == 1 else torch.stack(step_losses).sum()
                    # (loss + norm is finite exactly when both are: one kernel fewer.)
                    healthy = torch.isfinite(
                        step_loss if scaler.is_enabled() else step_loss + grad_norm
                    )
                    blew_up, stop_now = _agree(healthy, stop.signum is not None, ctx, device)
                if blew_up:  # every rank got here: the verdict was all-reduced
                    raise blow_up_error(
                        task,
                        raw_model,
                        micro_batches,
                        config.speed.precision,
                        device,
                        step_loss / accum,
                        grad_norm,
                        global_step + 1,
                        rundir.kept(last_path, best_path),
                    )
                with record_function("optimizer"):
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad(set_to_none=True)
                    scheduler.step()
                global_step += 1
                meter.add_step(grad_norm)
                if on_step is not None:
                    on_step(global_step)
                bar.update()
                # A signal that arrived during this step stops right here in a single process;
                # under DDP the ranks stop where the all-reduced flag told all of them to.
                stop_now = stop_now or (stop.signum is not None and not ctx.enabled)

                if global_step % config.log.log_every == 0 or stop_now:
                    totals = meter.read()  # all-reduce + the interval's one extra sync
                    add_totals(epoch_totals, totals)
                    record = {
                        "kind": "train",
                        "epoch": epoch + 1,
                        "step": global_step,
                        **summarize(totals),
                        "lr": optimizer.param_groups[0]["lr"],
                        **peak_memory(device),
                    }
                    record.update(utilization.record(record["samples_per_s"] / ctx.world_size))
                    record.update(task.metrics(record))
                    writer.write(record)
                    bar.set_postfix(loss=f"{record['loss']:.4f}", acc=f"{record['acc']:.3f}")
                    meter.reset()
                if stop_now:
                    done = (step_in_epoch + 1) * samples_per_step
                    save(epoch, done, epoch_totals, improved=False, val_loss=0.0)
                    bar.close()
                    raise Interrupted(
                        stop.signum or signal.SIGTERM,
                        global_step,
                        last_path if ctx.is_main else None,
                    )
            bar.close()

            # ---- end of epoch: evaluate, log, checkpoint ------------------------------------
            add_totals(epoch_totals, meter.read())
            distributed.broadcast_buffers(raw_model)
            # The uncompiled model: the compiled graph was traced in training mode, and
            # inference mode plus the last, smaller validation batch would cost two more
            # compilations (per rank, different ones with uneven shards).
            with parallel.gathered(raw_model):  # FSDP: full weights, uneven shards are fine
                val = evaluate(raw_model, val_loader, device, config.speed.precision, task)
            train_metrics = summarize(epoch_totals)
            result = {
                "kind": "epoch",
                "epoch": epoch + 1,
                "global_step": global_step,
                "train_loss": train_metrics["loss"],
                "train_acc": train_metrics["acc"],
                **val,
                "lr": optimizer.param_groups[0]["lr"],
                "grad_norm": train_metrics["grad_norm"],
                "skipped_steps": train_metrics["skipped_steps"],
                "samples_per_s": train_metrics["samples_per_s"],
                "data_wait": train_metrics["data_wait"],
                **task.metrics(train_metrics, "train_"),
                **peak_memory(device),
            }
            writer.write({**result, "step": global_step})
            improved = val["val_acc"] > best_acc
            best_acc = max(best_acc, val["val_acc"])
            result["best_val_acc"] = best_acc
            log(
                f"epoch {epoch + 1}/{config.optim.epochs}  train loss {result['train_loss']:.4f} "
                f"acc {result['train_acc']:.3f} | val loss {val['val_loss']:.4f} "
                f"acc {val['val_acc']:.3f} | lr {result['lr']:.2e} | "
                f"{result['samples_per_s']:.0f} {task.unit}/s, data wait "
                f"{100 * result['data_wait']:.0f}%"
            )
            save(epoch + 1, 0, {}, improved=improved, val_loss=val["val_loss"])
            if improved:
                best = {"kind": "best", "step": global_step, "epoch": epoch + 1}
                writer.write({**best, "val_acc": best_acc, "path": str(best_path)})
            if on_epoch is not None:
                on_epoch(dict(result))
            skip_samples = 0

        # Rank 0 may still be writing the last checkpoint: a rank that tears the process
        # group down meanwhile can leave the shutdown of the connections hanging.
        distributed.barrier()
        result.pop("kind", None)
        result.setdefault("global_step", global_step)
        return result


def lr_factor(step: int, *, warmup: int, total: int) -> float:
    """Linear warmup to the peak, then cosine decay to zero at `total` steps."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _agree(
    healthy: torch.Tensor, stop: bool, ctx: distributed.Context, device: torch.device
) -> tuple[bool, bool]:
    """Read the step's health flag; under DDP every rank must reach the same verdict.

    A rank that stopped alone would leave the others waiting forever in the next all-reduce,
    so the flag and the stop request travel together in one small all-reduce (max).
    """
    if not ctx.enabled:
        return not bool(healthy), stop
    flags = torch.stack([~healthy, torch.tensor(stop, device=device)]).float()
    blew_up, stop_all = distributed.all_reduce(flags, op="max").tolist()
    return blew_up > 0, stop_all > 0


def _check_precision(precision: str, device: torch.device) -> None:
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


def _silent(*args: object, **kwargs: object) -> None:
    """Logging on ranks other than 0."""


def main(argv: list[str] | None = None) -> int:
    """Console entry point: parse flags, train, and turn known failures into one line and
    the exit code documented in docs/reliability.md."""
    config, _ = parse_config(argv, description="Train the model.")
    return rundir.exit_code(lambda: train(config))


if __name__ == "__main__":
    sys.exit(main())
