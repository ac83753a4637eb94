"""The generated suite catches realistic bugs in every module of the generated package.

Each mutation plants one bug of the kind that slips through review (a metric reduced over the
wrong thing, best.pt overwritten by a worse model, a schedule that never steps, clipping after
the optimizer step, handlers "restored" to the default, ...) into one module of a rendered
project, and runs the few generated tests that should catch it. Each must fail. The runs share
one torch import: tests/mutation_runner.py forks a child per mutation, two at a time.

Every edit must match its module exactly once: after a change to the package, a stale target
fails here with "mutation target not found: <module>: <text>" instead of silently testing
nothing. Retarget it at the new code (keep the bug the same) rather than deleting it.
(`test_utils_mutations.py` does the same for `utils.py`.) The unmutated project passes these
tests: the render matrix runs the whole generated suite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mutations import PACKAGE, Mutation, assert_caught, bug, render_to_mutate, run_mutations

MUTATIONS = [
    # ---- train.py, loop.py: data order, evaluation, best checkpoint, schedule, clipping ----
    bug("data-order-same-every-epoch", "loop.py",
        "sampler.set_epoch(epoch)", "sampler.set_epoch(0)",
        "test_train.py", "data_order"),
    bug("sampler-ignores-the-seed", "train.py",
        "rank=ctx.rank, seed=config.run.seed", "rank=ctx.rank, seed=0",
        "test_train.py", "data_order"),
    bug("val-loss-mean-of-batch-means-over-samples", "task.py",
        'cross_entropy(logits.float(), targets, reduction="sum")',
        "cross_entropy(logits.float(), targets)",
        "test_train.py", "evaluate_equals"),
    bug("val-loss-summed-in-bf16", "task.py",
        'cross_entropy(logits.float(), targets, reduction="sum")',
        'cross_entropy(logits, targets, reduction="sum")',
        "test_gpu_paths.py", "float32"),
    bug("val-acc-compares-every-pair", "task.py",
        "correct += (logits.argmax(1) == targets).sum()",
        "correct += (logits.argmax(1) == targets[:, None]).sum()",
        "test_train.py", "evaluate_equals"),
    bug("best-pt-replaced-by-a-worse-model", "loop.py",
        'improved = val["val_acc"] > run.best_acc', "improved = True",
        "test_train.py", "best_pt"),
    bug("best-acc-forgets-the-best", "loop.py",
        'run.best_acc = max(run.best_acc, val["val_acc"])', 'run.best_acc = val["val_acc"]',
        "test_train.py", "best_pt"),
    bug("lr-schedule-never-steps", "loop.py",
        "run.scheduler.step()\n", "pass\n",
        "test_train.py", "learning_rate"),
    bug("exit-after-a-process-group-loses-buffered-output", "distributed.py",
        "    sys.stdout.flush()\n", "",
        "test_distributed.py", "exits_with_its_code"),
    bug("weight-decay-on-biases-and-norms", "loop.py",
        "param.ndim >= 2 and id(param) not in embeddings", "id(param) not in embeddings",
        "test_loop.py", "weight_decay"),
    bug("resumed-moments-on-the-wrong-weights", "checkpoint.py",
        '"state": {moved[old]: value', '"state": {old: value',
        "test_loop.py", "one_group"),
    bug("lr-warmup-starts-at-zero", "train.py",
        "return (step + 1) / (warmup + 1)", "return step / warmup",
        "test_train.py", "learning_rate"),
    bug("lr-cosine-over-half-a-period", "train.py",
        "0.5 * (1.0 + math.cos(math.pi * progress))", "math.cos(0.5 * math.pi * progress)",
        "test_train.py", "learning_rate"),
    Mutation("clipping-after-the-optimizer-step", "loop.py", (
        ("grad_norm = utils.clip_gradients(",
         "scaler.step(optimizer)\n        grad_norm = utils.clip_gradients("),
        ("scaler.step(optimizer)\n        scaler.update()", "scaler.update()"),
    ), "test_train.py", "clipping_to"),
    bug("clipping-threshold-ignored", "loop.py",
        "config.optim.grad_clip,\n", "None,\n",
        "test_train.py", "clipping_to"),
    bug("metrics-writer-never-closed", "train.py",
        "cleanup.callback(writer.close)", "cleanup.callback(lambda: None)",
        "test_trackers.py", "tensorboard_records_read_back"),
    Mutation("profiler-phase-labels-swapped", "loop.py", (
        ('record_function("forward")', 'record_function("@@")'),
        ('record_function("backward")', 'record_function("forward")'),
        ('record_function("@@")', 'record_function("backward")'),
    ), "test_profiling.py", "trace_holds"),
    bug("resume-offset-one-step-short", "train.py",
        "done = (step_in_epoch + 1) * run.samples_per_step",
        "done = step_in_epoch * run.samples_per_step",
        "test_train.py", "bitwise and 0"),
    bug("resume-repeats-the-done-steps", "loop.py",
        "sampler.start = first_step * run.samples_per_step", "sampler.start = 0",
        "test_train.py", "bitwise and 0"),
    bug("sigterm-ignored-in-one-process", "train.py",
        "stop_now = stop_now or (stop.signum is not None and not run.ctx.enabled)",
        "stop_now = stop_now",
        "test_train.py", "sigterm_via_main"),
    # ---- loop.py's train_step alone, against hand-computed values (test_loop.py) ---------------
    bug("accumulated-gradient-not-averaged", "loop.py",
        "scaler.scale(loss / accum if accum > 1 else loss)", "scaler.scale(loss)",
        "test_loop.py", "hand_computed"),
    bug("step-clips-no-parameters", "loop.py",
        "raw_model.parameters(),\n            config.optim.grad_clip,",
        "[],\n            config.optim.grad_clip,",
        "test_loop.py", "clips"),
    bug("health-check-ignored", "loop.py",
        "if blew_up:", "if False:",
        "test_loop.py", "non_finite"),
    bug("gradients-not-zeroed-after-the-step", "loop.py",
        "optimizer.zero_grad(set_to_none=True)", "pass",
        "test_loop.py", "hand_computed"),
    bug("stop-request-not-passed-to-the-agreement", "loop.py",
        "_agree(healthy, stop.signum is not None,", "_agree(healthy, False,",
        "test_loop.py", "stop_signal"),
    # ---- checkpoint.py: atomic files, safe loading, RNG, signal handling -----------------------
    bug("save-writes-in-place", "checkpoint.py",
        "torch.save(state, file)\n", "torch.save(state, path)\n            return\n",
        "test_checkpoint.py", "temporary_file or failed_save"),
    bug("failed-save-leaves-its-temporary-file", "checkpoint.py",
        "Path(tmp).unlink(missing_ok=True)\n        failed = write_failure(error)",
        "pass\n        failed = write_failure(error)",
        "test_checkpoint.py", "failed_save"),
    bug("a-write-failure-wrapped-by-torch-save-is-not-a-save-error", "checkpoint.py",
        "failed = write_failure(error)", "failed = error if isinstance(error, OSError) else None",
        "test_checkpoint.py", "inside_torch_save"),
    bug("load-runs-pickled-code", "checkpoint.py",
        "location, weights_only=True", "location, weights_only=False",
        "test_checkpoint.py", "pickled"),
    bug("torch-rng-not-restored", "checkpoint.py",
        'torch.set_rng_state(state["torch"])', "pass",
        "test_checkpoint.py", "rng_states"),
    bug("handlers-restored-to-the-default", "stopping.py",
        "self._previous.items():\n            signal.signal(signum, handler)",
        "self._previous.items():\n            signal.signal(signum, signal.SIG_DFL)",
        "test_checkpoint.py", "stop_signal"),
    bug("second-signal-replaces-the-first", "stopping.py",
        "        if self.signum is None:\n            self.signum = signum\n",
        "        self.signum = signum\n",
        "test_checkpoint.py", "stop_signal"),
    bug("buffers-not-checked-before-a-save", "checkpoint.py",
        "(*model.named_parameters(), *model.named_buffers())", "(*model.named_parameters(),)",
        "test_faults.py", "poisoned_tensor_at_the_end"),
    bug("checkpoint-nan-weights-read", "checkpoint.py",
        "    bad = _first_nonfinite(list(weights.items()))\n", "    bad = None\n",
        "test_inference.py", "crafted"),
    # ---- rundir.py: one run per run dir, leftovers cleaned -------------------------------------
    bug("a-signal-outside-training-exits-1", "rundir.py",
        "        return 128 + signum\n", "        return 1\n",
        "test_checkpoint.py", "outside_training"),
    bug("run-dir-not-locked", "rundir.py",
        "fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)", "pass",
        "test_faults.py", "in_use"),
    bug("a-live-run-s-lock-taken-over", "rundir.py",
        "if host == socket.gethostname() and not _alive(int(pid)):",
        "if host == socket.gethostname():",
        "test_faults.py", "stale_run_dir_lock"),
    bug("a-dead-run-s-lock-never-taken-over", "rundir.py",
        "why = stale(holder)", "why = None",
        "test_faults.py", "stale_run_dir_lock"),
    bug("launcher-exits-1-on-a-signal", "launch.py",
        "return 128 + int(stopped.sigval)", "return 1",
        "test_parallel_processes.py", "launcher"),
    bug("metrics-not-trimmed-on-resume", "rundir.py",
        'keep = int(record.get("step", 0)) <= step', "keep = True",
        "test_faults.py", "leftovers"),
    bug("rerun-overwrites-checkpoints", "rundir.py",
        "if saved and resume is None:", "if saved and resume == 'never':",
        "test_faults.py", "not_overwritten"),
    # ---- trackers.py, sweep.py: what a tracker receives, how a sweep ranks ------------------
    bug("tracker-metrics-lose-their-kind", "trackers.py",
        'f"{kind}/{key}": float(value)', 'f"{key}": float(value)',
        "test_trackers.py", "tensorboard_event_files"),
    bug("sweep-ranks-worst-first", "sweep.py",
        'sign = -1.0 if DIRECTIONS[metric] == "maximize" else 1.0', "sign = 1.0",
        "test_sweep.py", "ranked_best_first"),
    # ---- data.py: sampler state and shards -----------------------------------------------------
    bug("sampler-start-ignored", "data_sources.py",
        "itertools.islice(super().__iter__(), self.start, None)", "super().__iter__()",
        "test_data.py", "sampler_order"),
    bug("sampler-pads-unequal-shares", "data_sources.py",
        "drop_last=True,", "drop_last=False,",
        "test_data.py", "disjoint"),
    bug("evaluation-shards-overlap", "data_sources.py",
        "range(rank, len(dataset), world_size)", "range(0, len(dataset), world_size)",
        "test_data.py", "disjoint"),
    # ---- the user's files as shipped: data.py's registry, config.py's checks, extensions.py --
    bug("user-data-sources-ignored", "data.py",
        "[*SOURCES, *data_sources.SOURCES]", "data_sources.SOURCES",
        "test_data.py", "registered_source"),
    bug("config-skips-the-template-checks", "config.py",
        "super().validate()", "pass",
        "test_config.py", "bad_flags"),
    bug("user-metric-shadows-val-acc", "extensions.py",
        "    return {}", '    return {"acc": (logits.argmax(1) != targets).sum()}',
        "test_train.py", "evaluate_equals"),
    # ---- metrics.py: reductions and the log ----------------------------------------------------
    bug("train-acc-compares-every-pair", "metrics.py",
        "(logits.argmax(1) == targets).sum()", "(logits.argmax(1) == targets[:, None]).sum()",
        "test_metrics.py", "hand_made"),
    bug("train-loss-divided-by-samples", "metrics.py",
        '"loss": totals["loss_sum"] / batches', '"loss": totals["loss_sum"] / samples',
        "test_metrics.py", "summary_means"),
    bug("nan-written-as-nan", "metrics.py",
        "(None if isinstance(v, float) and not math.isfinite(v) else v)", "v",
        "test_metrics.py", "writer"),
    bug("tracker-never-closed", "metrics.py",
        "            tracker.close()\n", "            pass\n",
        "test_trackers.py", "tensorboard_records_read_back"),
    bug("shared-grad-norm-summed-over-ranks", "metrics.py",
        '"grad_norm_sum": grad_norm / self.world_size', '"grad_norm_sum": grad_norm',
        "test_distributed.py", "meter"),
    # ---- distributed.py: reductions across ranks -----------------------------------------------
    bug("all-reduce-sum-and-max-swapped", "distributed.py",
        'dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX',
        'dist.ReduceOp.MAX if op == "sum" else dist.ReduceOp.SUM',
        "test_distributed.py"),
    bug("buffers-not-broadcast", "distributed.py",
        "dist.broadcast(buffer, src=0)", "pass",
        "test_distributed.py", "broadcast"),
    # ---- parallel.py, sharded_checkpoint.py, checkpoint_convert.py: FSDP and DCP ---------------
    bug("fsdp-units-ignore-the-blocks", "parallel.py",
        "return list(blocks)", "return [model]",
        "test_parallel.py", "units_are"),
    bug("activation-checkpointing-does-nothing", "parallel.py",
        "partial(checkpoint, module.forward, use_reentrant=False)", "module.forward",
        "test_parallel.py", "activation_checkpointing"),
    bug("sharded-resume-drops-the-optimizer", "sharded_checkpoint.py",
        'dcp.load({"model": model_state, "optimizer": optimizer_state}',
        'dcp.load({"model": model_state}',
        "test_parallel.py", "continues_exactly"),
    bug("interrupted-swap-deletes-the-survivor", "sharded_checkpoint.py",
        "if current.exists():", "if True:",
        "test_parallel.py", "interrupted_folder_swap"),
    bug("converted-optimizer-numbered-by-state-order", "checkpoint_convert.py",
        'state = {number[name]: value for name, value in optimizer_state["state"].items()}',
        'state = dict(enumerate(optimizer_state["state"].values()))',
        "test_parallel.py", "numbered"),
    # ---- config.py: validation -----------------------------------------------------------------
    bug("zero-lr-accepted", "config_base.py",
        "if optim.lr <= 0:", "if optim.lr < 0:",
        "test_config.py", "bad_flags"),
    bug("dropout-of-one-accepted", "config_base.py",
        "if not 0 <= model.dropout < 1:", "if not 0 <= model.dropout <= 1:",
        "test_config.py", "bad_flags"),
    # ---- config_parsing.py: flags through tyro, TOML files ---------------------------------------
    bug("flags-get-their-group-prefix", "config_parsing.py",
        "config=(tyro.conf.OmitArgPrefixes,),", "config=(),",
        "test_config.py", "every_leaf_name"),
    bug("toml-key-under-the-wrong-table-accepted", "config_parsing.py",
        "if name not in leaves or (prefix and leaves[name][0][:-1] != prefix):",
        "if name not in leaves:",
        "test_config.py", "group_its_keys"),
    bug("old-boolean-value-ignored", "config_parsing.py",
        'out.append(name if _BOOL_WORDS[value.lower()] else f"--no-{name[2:]}")',
        "out.append(name)",
        "test_config.py", "boolean_flags_still"),
    bug("written-none-not-read-back", "config_parsing.py",
        "return '\"none\"'  # TOML has no null", "return '\"\"'  # TOML has no null",
        "test_config.py", "written_toml"),
    # ---- model.py: config and data shapes reach the model --------------------------------------
    bug("mlp-width-not-scaled", "model.py",
        "width=8 * width", "width=width",
        "test_smoke.py", "architecture"),
    bug("dropout-flag-ignored", "model.py",
        "dropout=config.model.dropout", "dropout=0.1",
        "test_smoke.py", "architecture"),
    bug("pooling-drops-odd-pixels", "model.py",
        "nn.MaxPool2d(2, ceil_mode=True)", "nn.MaxPool2d(2)",
        "test_smoke.py", "architecture"),
    # ---- GPU paths that a CPU can check (issue 12) ---------------------------------------------
    bug("gpu-probe-passes-a-gpu-torch-cannot-use", "cuda_check.py",
        "    return 1, (\n", "    return 0, (\n",
        "test_gpu_paths.py", "probe"),
    bug("rank-drives-a-gpu-it-cannot-see", "distributed.py",
        "    if visible == 1:\n        return 0", "    if visible == 1:\n        return local_rank",
        "test_gpu_paths.py", "local_gpu or sees_one_gpu"),
    bug("skipped-fp16-steps-averaged-as-zero", "metrics.py",
        "self.finite_steps += finite", "self.finite_steps += 1",
        "test_gpu_paths.py", "skipped"),
    bug("cuda-graphs-with-accumulation-accepted", "config_base.py",
        "if graphs and optim.grad_accum_steps > 1:", "if graphs and optim.grad_accum_steps > 99:",
        "test_config.py", "bad_flags"),
    # ---- profiling.py and benchmark.py: the arithmetic behind the reports ----------------------
    bug("profiled-steps-counted-once", "profiling.py",
        "steps += event.count", "steps += 1",
        "test_profiling.py", "phase_shares"),
    bug("iqr-from-the-median", "benchmarks/timing.py",
        '"iqr": q3 - q1', '"iqr": q3 - median',
        "test_benchmark.py", "statistics_helpers"),
    bug("optimizer-moments-keep-the-saved-layout", "checkpoint.py",
        "        match_parameter_layouts(target)", "        pass",
        "test_train.py", "channels_last"),
    bug("channels-last-flag-ignored", "task.py",
        "if config.speed.channels_last:", "if False:",
        "test_train.py", "channels_last"),
    bug("cpu-interval-not-a-difference", "benchmarks/loop_overhead.py",
        "now[1] - start[1]", "now[1]",
        "test_benchmark.py", "statistics_helpers"),
    bug("ratio-of-pooled-medians-not-rounds", "benchmarks/timing.py",
        "per_round = [a / b for a, b in zip(numerator, denominator, strict=True)]",
        "per_round = [statistics.median(numerator) / statistics.median(denominator)] * 2",
        "test_benchmark.py", "statistics_helpers"),
    bug("benchmark-entry-point-loses-the-chart", "benchmark.py",
        "from .benchmarks.report import write_chart",
        "from .benchmarks.report import print_section as write_chart",
        "test_benchmark.py", "chart"),
    # ---- mfu.py and tune.py: the peak MFU divides by, the choice tune makes -----------------
    bug("bf16-peak-whatever-the-precision", "mfu.py",
        "return peaks[precision], name", 'return peaks["bf16"], name',
        "test_benchmark.py", "per_precision"),
    bug("tune-chooses-within-noise", "tune.py",
        "if low > 1.0 and", 'if comparison["ratio"] > 1.0 and',
        "test_tune.py", "noise"),
    # ---- issue 29: bugs the suite missed --------------------------------------------------
    bug("health-check-reads-the-loss-only", "task.py",
        "return torch.isfinite(loss if scaler.is_enabled() else loss + grad_norm)",
        "return torch.isfinite(loss)",
        "test_faults.py", "inf_gradient"),
    bug("checkpoint-temp-file-in-the-system-temp-folder", "checkpoint.py",
        'tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")',
        'tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp")',
        "test_checkpoint.py", "beside"),
    bug("checkpoint-folder-not-flushed-after-the-rename", "checkpoint.py",
        "    fsync_folder(path.parent)\n", "",
        "test_checkpoint.py", "beside"),
    bug("gather-cross-entropy-over-the-last-dim", "task.py",
        "logits.float().log_softmax(dim=1)", "logits.float().log_softmax(dim=-1)",
        "test_train.py", "deterministic_loss"),
    bug("fsdp-reduces-gradients-in-bf16", "parallel.py",
        "reduce_dtype=torch.float32", "reduce_dtype=torch.bfloat16",
        "test_parallel.py", "reduces_gradients"),
    bug("matmul-peak-counts-n-cubed-flops", "mfu.py",
        "return 2 * size**3 / seconds / 1e12, size", "return size**3 / seconds / 1e12, size",
        "test_benchmark.py", "2_n_cubed"),
    # ---- from a folder of images to a shipped model (images, inference, evaluate, ...) ----
    bug("augmentation-epoch-not-shared-with-workers", "images.py",
        "self.epoch = torch.zeros(1, dtype=torch.int64).share_memory_()",
        "self.epoch = torch.zeros(1, dtype=torch.int64)",
        "test_images.py", "persistent_workers"),
    bug("inference-forgets-the-saved-mean", "inference.py",
        'mean = [float(v) for v in dataset.get("mean", [0.0] * info.in_channels)]',
        "mean = [0.0] * info.in_channels",
        "test_inference.py", "evaluate_on_val"),
    bug("evaluate-loss-summed-not-averaged", "evaluate.py",
        '"loss": float(loss_sum) / count,', '"loss": float(loss_sum),',
        "test_inference.py", "evaluate_on_val"),
    bug("predict-keeps-the-unreadable-and-drops-the-rest", "predict.py",
        "                if reasons[row]:\n", "                if not reasons[row]:\n",
        "test_inference.py", "predict_labels"),
    bug("export-leaves-its-temp-file-behind", "export.py",
        "        Path(tmp).unlink(missing_ok=True)\n", "        pass\n",
        "test_inference.py", "refuses_to_write"),
    bug("init-from-refuses-a-resized-head", "finetune.py",
        "skipped = [name for name in wrong if name.startswith(head)]", "skipped = []",
        "test_inference.py", "init_from_loads"),
    bug("example-data-writes-into-a-used-folder", "example_data.py",
        "if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):",
        "if False:",
        "test_inference.py", "more_bad_input"),
]  # fmt: skip


@pytest.fixture(scope="module")
def rendered_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_to_mutate(tmp_path_factory, "package-mutations")


@pytest.fixture(scope="module")
def outcomes(
    request: pytest.FixtureRequest,
    rendered_project: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict[str, Any]]:
    """Run every selected mutation once (tests/mutation_runner.py, two at a time)."""
    return run_mutations(
        request, rendered_project, MUTATIONS, tmp_path_factory, "package mutations"
    )


def test_every_mutation_names_a_generated_test_file_and_a_unique_name(
    rendered_project: Path,
) -> None:
    files = {path.name for path in (rendered_project / "tests").glob("test_*.py")}
    assert {mutation.tests for mutation in MUTATIONS} <= files
    assert len({mutation.name for mutation in MUTATIONS}) == len(MUTATIONS)
    modules = {mutation.module for mutation in MUTATIONS}
    package = {path.name for path in (rendered_project / "src" / PACKAGE).glob("*.py")}
    # Every module of the package but utils.py (test_utils_mutations.py) and __init__.py.
    assert package - {"utils.py", "__init__.py"} <= modules


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_a_planted_bug_fails_the_generated_tests(
    outcomes: dict[str, dict[str, Any]], mutation: Mutation
) -> None:
    assert_caught(outcomes, mutation)
