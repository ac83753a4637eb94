"""Hyperparameter sweeps with Optuna: `python -m <package>.sweep --space sweep.toml`.

Each trial is a real `train()` run in its own run dir (<out>/trial-NNNN), reported to Optuna
after every epoch so that unpromising trials are pruned. The study lives in an Optuna storage:
a SQLite file by default, so an interrupted sweep resumes when the same command runs again,
or any database URL (postgresql://...), so workers on several machines share one study. Start
the command several times, on one machine or many (slurm/sweep.sbatch), and workers share the
trials; the sweep stops when `trials` of them are complete or pruned.

The search space is a TOML file (see sweep.toml):

    [sweep]                     # every key optional; flags override them
    study = "demo"
    metric = "val_acc"          # val_acc is maximised, val_loss and val_bpb (LM) minimised
    trials = 8                  # in total, over all workers
    [fixed]                     # Config values every trial shares
    epochs = 3
    [space]
    lr = { low = 1e-4, high = 1e-2, log = true }   # a float range
    width = { low = 16, high = 64, step = 16 }     # integers when low and high are
    model = ["cnn", "mlp"]                         # one of these

At the end it prints the trials ranked, writes the best trial's settings to <out>/best.toml
(`train --config <out>/best.toml` trains with them) and, with matplotlib installed, plots the
optimisation history to <out>/history.png. Needs the `sweep` extra (optuna). Exit codes: 0
done, 2 bad input, 128+N stopped by signal N (the trial saved its checkpoint; run the same
command to resume it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from .checkpointing.checkpoint import CheckpointError
from .checkpointing.resume import resolve_resume
from .config import Config
from .runtime import exits, files
from .runtime.stopping import Interrupted
from .settings.base import ConfigError
from .settings.parsing import leaf_fields, load_toml, read_toml, to_toml
from .train import train
from .training.data_sources import DataError
from .training.task import task_for

# val_bpb (validation bits per byte) is reported by the language model only.
DIRECTIONS: dict[str, Any] = {"val_acc": "maximize", "val_loss": "minimize", "val_bpb": "minimize"}
# Config fields every trial gets from the sweep: a value in [fixed] or [space] would be ignored.
PER_TRIAL = frozenset({"run_dir", "resume"})


@dataclasses.dataclass
class Spec:
    """A sweep: where its study lives, what it optimises, and over which values."""

    study: str = "sweep"
    metric: str = "val_acc"
    trials: int = 8
    out: str = "runs/sweep"
    storage: str | None = None  # default: sqlite:///<out>/optuna.db
    fixed: dict[str, Any] = dataclasses.field(default_factory=dict)
    space: dict[str, Any] = dataclasses.field(default_factory=dict)


def load_spec(path: Path, overrides: dict[str, Any]) -> Spec:
    """Read and check a search-space file; every problem is one ValueError line."""
    data = read_toml(path, "search space")
    unknown = set(data) - {"sweep", "fixed", "space"}
    if unknown:
        raise ValueError(f"search space {path}: unknown table(s) {sorted(unknown)}")
    for table, value in data.items():
        if not isinstance(value, dict):
            raise ValueError(f"search space {path}: [{table}] must be a table, got {value!r}")
    names = {f.name for f in dataclasses.fields(Spec)} - {"fixed", "space"}
    settings = {k.replace("-", "_"): v for k, v in data.get("sweep", {}).items()}
    if set(settings) - names:
        raise ValueError(
            f"search space {path}: unknown [sweep] key(s) {sorted(set(settings) - names)}"
        )
    settings.update({k: v for k, v in overrides.items() if v is not None})
    spec = Spec(**settings, fixed=data.get("fixed", {}), space=data.get("space", {}))
    language_model = task_for(Config()).name == "lm"
    metrics = [m for m in DIRECTIONS if language_model or m != "val_bpb"]
    if spec.metric == "val_bpb" and not language_model:
        raise ValueError(
            "metric val_bpb (bits per byte) is reported by language models only; "
            "use val_acc or val_loss"
        )
    _check_settings(spec, path)
    if spec.metric not in metrics:
        raise ValueError(f"metric must be one of {', '.join(metrics)}, got {spec.metric!r}")
    if spec.trials < 1:
        raise ValueError(f"trials must be >= 1, got {spec.trials}")
    if not spec.space:
        raise ValueError(f"search space {path} has no [space] entries")
    fields = leaf_fields(Config)  # flat names: `lr`, not `optim.lr`
    for key in [*spec.fixed, *spec.space]:
        if key.replace("-", "_") not in fields:
            raise ValueError(f"search space {path}: {key!r} is not a Config field")
    owned = sorted(k for k in [*spec.fixed, *spec.space] if k.replace("-", "_") in PER_TRIAL)
    if owned:
        raise ValueError(
            f"search space {path}: {', '.join(owned)} cannot be set: the sweep sets "
            f"{' and '.join(sorted(PER_TRIAL))} per trial (use --out for where trials go)"
        )
    for key, domain in spec.space.items():
        _check_domain(key, domain)
    base = {k.replace("-", "_"): v for k, v in spec.fixed.items()}
    Config.from_flat(base).validate()  # fixed values that can never work fail now
    for key, domain in spec.space.items():  # and so do choices and bounds that cannot
        for value in domain if isinstance(domain, list) else (domain["low"], domain["high"]):
            try:
                Config.from_flat({**base, key.replace("-", "_"): value}).validate()
            except (TypeError, ValueError) as error:
                raise ValueError(f"search space {path}: space.{key} = {value!r}: {error}") from None
    return spec


def _check_settings(spec: Spec, path: Path) -> None:
    """The [sweep] values' types, and --out a folder (or absent), before any trial runs."""
    for name, kind in (("trials", int), ("study", str), ("metric", str), ("out", str)):
        value = getattr(spec, name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(
                f"search space {path}: {name} must be {'an integer' if kind is int else 'text'}"
                f", got {value!r}"
            )
    if spec.storage is not None and not isinstance(spec.storage, str):
        raise ValueError(f"search space {path}: storage must be a URL, got {spec.storage!r}")
    if not spec.out.strip():
        raise ValueError("--out is empty; name a folder for the sweep's results")
    out = Path(spec.out)
    existing = next(folder for folder in (out, *out.parents) if folder.exists())
    if not existing.is_dir():
        where = "" if existing == out else f" lies under {existing}, which"
        raise ValueError(f"--out {spec.out}{where} is a file; name a folder for the results")


def _check_domain(key: str, domain: Any) -> None:
    """A list of choices, or a range Optuna accepts: checked here, not in every trial."""
    if isinstance(domain, list) and domain:
        return
    keys = {"low", "high", "log", "step"}
    ranged = isinstance(domain, dict) and {"low", "high"} <= domain.keys() <= keys
    numbers = ranged and all(
        isinstance(domain[end], int | float) and not isinstance(domain[end], bool)
        for end in domain.keys() - {"log"}
    )
    if not numbers or domain["low"] >= domain["high"]:
        raise ValueError(
            f"space.{key} must be a non-empty list of choices or a table of low and high with "
            f"low < high (optional log = true, step = ...), got {domain!r}"
        )
    log, step = domain.get("log", False), domain.get("step")
    if not isinstance(log, bool):
        raise ValueError(f"space.{key}: log must be true or false, got {log!r}")
    if step is not None and step <= 0:
        raise ValueError(f"space.{key}: step must be > 0, got {step!r}")
    if log and domain["low"] <= 0:
        raise ValueError(f"space.{key}: log = true needs low > 0, got low = {domain['low']!r}")
    integers = isinstance(domain["low"], int) and isinstance(domain["high"], int)
    if log and step is not None and not (integers and step == 1 and isinstance(step, int)):
        raise ValueError(f"space.{key}: log = true and step = {step!r} cannot be combined")


def suggest(trial: Any, key: str, domain: Any) -> Any:
    """Draw one value of `key` from its domain (a list of choices, or a range)."""
    if isinstance(domain, list):
        return trial.suggest_categorical(key, domain)
    low, high = domain["low"], domain["high"]
    log = bool(domain.get("log", False))
    if isinstance(low, int) and isinstance(high, int) and not isinstance(domain.get("step"), float):
        return trial.suggest_int(key, low, high, step=domain.get("step", 1), log=log)
    return trial.suggest_float(key, float(low), float(high), step=domain.get("step"), log=log)


def _retry_stale_trials() -> dict[str, Any]:
    """The storage's argument that retries a dead worker's trial: a worker killed outright
    (SIGKILL, a lost node) stops its heartbeat, and after the grace period its trial is marked
    failed and queued again with the same values (and user_attrs: it resumes its run dir)."""
    import optuna

    try:  # Optuna 4.9 renamed the callback and the argument that takes it
        from optuna.storages import RetryHeartbeatStaleTrialCallback as Retry

        argument = "heartbeat_stale_trial_callback"
    except ImportError:
        from optuna.storages import RetryFailedTrialCallback as Retry

        argument = "failed_trial_callback"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return {argument: Retry(max_retry=3)}


class _AfterStop(logging.Filter):
    """Drops Optuna's log lines once a trial stopped on a signal: its "Trial N failed" warning
    carries the `Interrupted` traceback, and the sweep's own stop line says what happened."""

    stopped = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.stopped


def check_same_space(study: Any, spec: Spec) -> None:
    """A study resumed with another [space] would mix two sweeps' trials (and Optuna fails
    a trial whose choices changed): refused. A new study records its space. [fixed] may
    change (a resumed trial run shorter, say)."""
    mine = json.dumps(spec.space, sort_keys=True, default=str)
    saved = study.user_attrs.get("space")
    if saved is None and not study.trials:
        study.set_user_attr("space", mine)
    elif saved is not None and saved != mine:  # None with trials: a study from before this check
        raise ValueError(
            f"study {spec.study!r} in {spec.out} was run with another [space]; "
            "use another --out (or --study), or the search space it was started with"
        )


def run_sweep(spec: Spec) -> Any:
    """Run trials until the study has `spec.trials` complete or pruned ones; return it."""
    import optuna
    from optuna.storages import RDBStorage
    from optuna.trial import TrialState

    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    url = spec.storage or f"sqlite:///{out / 'optuna.db'}"
    retry = _retry_stale_trials()

    def connect() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage = RDBStorage(
                url,
                heartbeat_interval=30,
                grace_period=120,
                **retry,
                # SQLite: workers wait for each other's writes instead of failing on a lock.
                engine_kwargs=dict(connect_args=dict(timeout=60))
                if url.startswith("sqlite")
                else None,
            )
        return optuna.create_study(
            study_name=spec.study,
            storage=storage,
            direction=DIRECTIONS[spec.metric],
            load_if_exists=True,
            pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1),
        )

    # Workers started together race to create a new database's tables: the losers retry
    # once the winner is done.
    for attempt in range(5):
        try:
            study = connect()
            break
        except Exception as error:
            if attempt == 4 or type(error).__module__.split(".")[0] not in (
                "sqlalchemy",
                "alembic",
            ):
                raise
            time.sleep(1 + attempt)
    check_same_space(study, spec)
    done = (TrialState.COMPLETE, TrialState.PRUNED)
    fixed = {k.replace("-", "_"): v for k, v in spec.fixed.items()}

    def objective(trial: Any) -> float:
        params = {k.replace("-", "_"): suggest(trial, k, d) for k, d in spec.space.items()}
        # A trial that continues an interrupted or failed one (queued again with the same
        # values, and the same user attributes) reuses its run dir, and resumes there.
        run_dir = trial.user_attrs.get("run_dir") or str(out / f"trial-{trial.number:04d}")
        trial.set_user_attr("run_dir", run_dir)
        saved = resolve_resume("auto", Path(run_dir)) is not None  # last.pt or last.dcp
        config = Config.from_flat(
            {**fixed, **params, "run_dir": run_dir, "resume": "auto" if saved else None}
        )
        config.validate()

        every = getattr(config.optim, "eval_every", None)

        def on_epoch(metrics: dict[str, Any]) -> None:
            # After each validation, numbered by epoch (by default one an epoch) or, with
            # --eval-every, by interval: Optuna keeps one value per number.
            at = metrics["epoch"] if not every else math.ceil(metrics["global_step"] / every)
            trial.report(metrics[spec.metric], at)
            if trial.should_prune():
                raise optuna.TrialPruned(f"pruned after {'validation' if every else 'epoch'} {at}")

        try:
            result = train(config, on_epoch=on_epoch)
        except Interrupted:
            # Saved: queue the same values, so the next worker resumes this run dir.
            study.enqueue_trial(trial.params, user_attrs={"run_dir": run_dir})
            after_stop.stopped = True
            raise
        return float(result[spec.metric])

    left = spec.trials - len(study.get_trials(deepcopy=False, states=done))
    after_stop, trial_log = _AfterStop(), logging.getLogger("optuna.study._optimize")
    if left > 0:
        trial_log.addFilter(after_stop)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.optimize(
                    objective,
                    n_trials=left,  # a cap per worker; the callback stops all workers at the total
                    callbacks=[optuna.study.MaxTrialsCallback(spec.trials, states=done)],
                    catch=(ValueError,),  # a drawn value Config refuses fails that trial only
                )
        finally:
            trial_log.removeFilter(after_stop)
    return study


def ranked(study: Any, metric: str) -> list[Any]:
    """Finished trials, best first (then pruned ones, by their last reported value)."""
    from optuna.trial import TrialState

    sign = -1.0 if DIRECTIONS[metric] == "maximize" else 1.0

    def key(trial: Any) -> tuple[int, float]:
        value = trial.value
        if value is None and trial.intermediate_values:
            value = trial.intermediate_values[max(trial.intermediate_values)]
        return (trial.state != TrialState.COMPLETE, sign * value if value is not None else math.inf)

    states = (TrialState.COMPLETE, TrialState.PRUNED)
    return sorted(study.get_trials(deepcopy=False, states=states), key=key)


def table(trials: list[Any], metric: str) -> str:
    lines = [f"{'rank':>4}  {'trial':>5}  {'state':<8}  {metric:>9}  params"]
    for rank, trial in enumerate(trials, 1):
        value = "-" if trial.value is None else f"{trial.value:.4f}"
        params = " ".join(f"{k}={_short(v)}" for k, v in trial.params.items())
        lines.append(f"{rank:>4}  {trial.number:>5}  {trial.state.name:<8}  {value:>9}  {params}")
    return "\n".join(lines)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def write_best(spec: Spec, trial: Any, path: Path) -> None:
    """The best trial's settings as a config file `train --config` reads."""
    values = {**{k.replace("-", "_"): v for k, v in spec.fixed.items()}, **trial.params}
    lines = [
        f"# Best trial {trial.number} of study {spec.study!r}: {spec.metric} = {trial.value}",
        f"# python -m {__package__}.train --config {path} --run-dir runs/best",
    ]
    files.write_atomically(path, "\n".join(lines) + "\n" + to_toml(values, Config), "--out")
    # What train --config will do: fail here, not later.
    Config.from_flat(load_toml(path, Config), f"{path}: ").validate()


def plot(study: Any, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        from optuna.visualization.matplotlib import plot_optimization_history
    except ImportError:
        return "no plot: matplotlib is not installed (the 'plot' extra)"
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        axes = plot_optimization_history(study)
    axes.figure.savefig(path, dpi=120, bbox_inches="tight")
    return f"optimisation history: {path}"


def main(argv: list[str] | None = None) -> int:
    parser = exits.Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--space", type=Path, default=Path("sweep.toml"), help="search space TOML")
    parser.add_argument("--study", help="study name (default: [sweep] study)")
    parser.add_argument("--storage", help="Optuna storage URL (default: sqlite in --out)")
    parser.add_argument("--trials", type=int, help="trials in total, over all workers")
    parser.add_argument("--out", help="folder for trial run dirs, best.toml and the plot")
    args = parser.parse_args(argv)
    try:
        import optuna
    except ImportError:
        print("error: sweeps need optuna: pip install -e '.[sweep]'", file=sys.stderr)
        return 2
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    overrides = {k: getattr(args, k) for k in ("study", "storage", "trials", "out")}
    try:
        spec = load_spec(args.space, overrides)
        study = run_sweep(spec)
    except (ConfigError, DataError, CheckpointError, ValueError) as error:
        print(f"error: {str(error).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    except Interrupted as stopped:
        print(f"{stopped}; run the same sweep command to resume the study", file=sys.stderr)
        return stopped.exit_code
    except Exception as error:  # storage errors (bad URL, unreachable database)
        if type(error).__module__.split(".")[0] not in ("optuna", "sqlalchemy"):
            raise
        where = args.storage or "the sweep's storage"
        print(f"error: {where}: {error}".splitlines()[0], file=sys.stderr)
        return 2
    trials = ranked(study, spec.metric)
    print(table(trials, spec.metric))
    try:
        best = study.best_trial
    except ValueError:
        print("no trial completed: nothing to write", file=sys.stderr)
        return 1
    out = Path(spec.out)
    write_best(spec, best, out / "best.toml")
    print(f"best trial {best.number}: {spec.metric} {best.value:.4f} -> {out / 'best.toml'}")
    print(plot(study, out / "history.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
