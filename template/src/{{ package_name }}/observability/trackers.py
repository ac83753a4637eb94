"""Experiment trackers (TensorBoard, MLflow, Weights & Biases) fed the records of metrics.jsonl.

`metrics.MetricsWriter` writes every record to metrics.jsonl and hands the same record to the
tracker chosen with `--tracker`. A record is a flat dict with a "kind":

    run    once per start (and per resume): config, git commit and dirty flag, environment
    train  every --log-every optimizer steps: loss, accuracy, lr, throughput, ...
    epoch  at the end of each epoch: validation metrics next to the epoch's train metrics
    best   when validation accuracy improves: the best checkpoint's path

A tracker is any object with `write(record)` and `close()`. Each library is imported only
here and only when chosen, so the project runs without any of them; each comes with the extra
of the same name (`pip install -e ".[mlflow]"`). Only rank 0 builds a tracker.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Protocol

TRACKERS = ("none", "tensorboard", "mlflow", "wandb")
# Keys that place a record (they become the step, not a metric).
POSITION = ("kind", "step", "epoch", "global_step")


class TrackerError(RuntimeError):
    """A tracker that cannot start: its package is missing, or its URI or login is bad."""


class Tracker(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


# What to try when a tracker cannot start, appended to its one-line error.
HINTS = {
    "wandb": " (log in with WANDB_API_KEY or `wandb login`, or set WANDB_MODE=offline to keep "
    "the run on disk; --tracker none turns tracking off)",
    "mlflow": " (check --tracker-uri or MLFLOW_TRACKING_URI; --tracker none turns tracking off)",
}


def open_tracker(
    name: str, run_dir: Path, *, experiment: str, uri: str | None, resuming: bool
) -> Tracker | None:
    """Start the named tracker, or raise TrackerError with one line saying why it cannot."""
    if name == "none":
        return None
    kinds: dict[str, Any] = {
        "tensorboard": TensorBoardTracker,
        "mlflow": MLflowTracker,
        "wandb": WandbTracker,
    }
    package = {"tensorboard": "tensorboard", "mlflow": "mlflow-skinny", "wandb": "wandb"}[name]
    try:
        return kinds[name](run_dir, experiment=experiment, uri=uri, resuming=resuming)
    except ImportError:
        raise TrackerError(
            f"--tracker {name} needs the {package} package: pip install -e '.[{name}]', "
            "or pass --tracker none"
        ) from None
    except TrackerError:
        raise
    except Exception as error:  # each library raises its own types; all mean "cannot start"
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise TrackerError(
            f"--tracker {name} could not start: {first}{HINTS.get(name, '')}"
        ) from None


def metrics_of(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers, named `<kind>/<key>` (train/loss, epoch/val_acc)."""
    kind = record.get("kind", "train")
    return {
        f"{kind}/{key}": float(value)
        for key, value in record.items()
        if key not in POSITION
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys: config = {"lr": 1} becomes "config.lr" = 1."""
    flat: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _saved_id(path: Path, resuming: bool) -> str | None:
    """The tracker run id a resumed run continues (written by the run it resumes)."""
    return (path.read_text().strip() or None) if resuming and path.is_file() else None


class TensorBoardTracker:
    """Scalars under <kind>/<key> in run_dir/tensorboard; the run record as a JSON text."""

    def __init__(self, run_dir: Path, *, experiment: str, uri: str | None, resuming: bool):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        if record.get("kind") == "run":
            text = json.dumps(record, indent=2, default=str)
            self.writer.add_text("run", f"```\n{text}\n```", step)
        elif record.get("kind") == "best":
            self.writer.add_text("best_checkpoint", str(record["path"]), step)
        for key, value in metrics_of(record).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class MLflowTracker:
    """One MLflow run per run dir: config as params, provenance as tags, metrics by step.

    `uri` is the tracking URI (a database URL such as sqlite:///mlflow.db, a server's http://
    address); without it MLflow reads MLFLOW_TRACKING_URI, else uses its own default.
    """

    def __init__(self, run_dir: Path, *, experiment: str, uri: str | None, resuming: bool):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.id_file = run_dir / "mlflow_run_id"
        run_id = _saved_id(self.id_file, resuming)
        self.resumed = run_id is not None
        if run_id is None:
            run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
            self.id_file.write_text(run_id + "\n")
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def write(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        kind, step = record.get("kind"), int(record.get("step", 0))
        if kind == "run":
            flat = flatten({k: v for k, v in record.items() if k not in POSITION})
            config = {k: v for k, v in flat.items() if k.startswith("config.")}
            rest = {k: v for k, v in flat.items() if not k.startswith("config.")}
            # Params cannot change once logged: a resumed run keeps its first ones.
            params = [] if self.resumed else [Param(k[7:], str(v)) for k, v in config.items()]
            tags = [RunTag(k, str(v)) for k, v in rest.items()]
            self.client.log_batch(self.run_id, params=params, tags=tags)
        elif kind == "best":
            self.client.set_tag(self.run_id, "best_checkpoint", str(record["path"]))
        millis = int(time.time() * 1000)
        metrics = [Metric(k, v, millis, step) for k, v in metrics_of(record).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbTracker:
    """A W&B run in run_dir/wandb: config and provenance in its config, metrics by step.

    W&B reads its settings from the environment: WANDB_MODE=offline writes the run to disk
    only (sync it later with `wandb sync`), WANDB_API_KEY logs in, WANDB_BASE_URL picks a
    server. `uri`, when given, is that server's address.
    """

    def __init__(self, run_dir: Path, *, experiment: str, uri: str | None, resuming: bool):
        import wandb

        self.id_file = run_dir / "wandb_run_id"
        run_id = _saved_id(self.id_file, resuming)
        settings = wandb.Settings(base_url=uri) if uri else None
        self.run = wandb.init(
            project=experiment,
            name=run_dir.name,
            dir=str(run_dir),
            id=run_id,
            resume="allow" if run_id else None,
            reinit="create_new",  # a sweep runs several in one process
            settings=settings,
        )
        self.id_file.write_text(self.run.id + "\n")

    def write(self, record: dict[str, Any]) -> None:
        kind, step = record.get("kind"), int(record.get("step", 0))
        if kind == "run":
            values = {k: v for k, v in record.items() if k not in POSITION}
            self.run.config.update(flatten(values), allow_val_change=True)
        elif kind == "best":
            self.run.summary["best_checkpoint"] = str(record["path"])
        metrics = metrics_of(record)
        if metrics:
            self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()
