"""The answer matrix, shared by the pytest suite and the noxfile (which loads this file by path).

Four renders give every choice question each of its values at least once, with values paired
up so that no render is a copy of another: three image classifiers (cnn, mlp) and one
language model. Only the Python running the tests exists on the
machine, so other `python_version` answers are rendered and tested on it: they only change
`requires-python`, ruff's target version and the CI workflow's Python.
"""

from __future__ import annotations

from typing import Any

MATRIX: dict[str, dict[str, Any]] = {
    "py310-mit-cnn": {
        "project_name": "matrix-py310",
        "python_version": "3.10",
        "license": "MIT",
        "task": "image",
        "model": "cnn",
        "github_actions": True,
        "tracker": "mlflow",
    },
    "py311-apache-mlp": {
        "project_name": "matrix-py311",
        "python_version": "3.11",
        "license": "Apache-2.0",
        "task": "image",
        "model": "mlp",
        "github_actions": False,
        "tracker": "tensorboard",
    },
    # The language model (no `model` question: it is asked for image projects only).
    "py312-bsd-lm": {
        "project_name": "matrix-py312",
        "python_version": "3.12",
        "license": "BSD-3-Clause",
        "task": "lm",
        "github_actions": True,
        "tracker": "wandb",
    },
    "py313-none-cnn": {
        "project_name": "matrix-py313",
        "python_version": "3.13",
        "license": "none",
        "task": "image",
        "model": "cnn",
        "github_actions": False,
        "tracker": "none",
    },
}

# The one render whose `slow` tests run too (inductor compilation, multi-process faults, the
# library tests of the trackers a render was not made with: minutes on a small CPU; once is
# enough to catch a break, the other renders skip them).
SLOW_RENDER = "py310-mit-cnn"

# Renders that run only the fast test files their answers can change. Every render here
# differs from a render of test_user_install.py (the default answers, image and LM, installed
# as the generated README says) only in metadata (Python, license, CI workflow), which changes
# no code path, and in the tracker, whose default is read by the config, the trackers' wiring
# and a first epoch (test_trains_one_epoch): those renders run the whole fast suite of the same
# code, so these run the files the tracker answer reaches. The slow render runs its `slow`
# tests besides (the whole suite's, tests/test_matrix_slow.py).
TRACKER_FILES = ["tests/test_trackers.py", "tests/test_config.py"]
PARTIAL_SUITES: dict[str, list[str]] = {
    "py310-mit-cnn": [*TRACKER_FILES, "tests/test_smoke.py"],
    "py313-none-cnn": [*TRACKER_FILES, "tests/test_smoke.py"],
}
# The language-model render runs its whole fast suite with a model of the user's own added to
# model.py and made the default in config.py (tests/matrix_checks.py), as USER_DEFAULTS_RENDER
# does for images: no generated test may assume the GPT unless it names `--model gpt`. Its
# slow files then run on the render as made.
USER_LM_RENDER = "py312-bsd-lm"

# Slow tests that only a render with other answers has: the language model's (it learns below
# a bigram; FSDP2 and resharding with the transformer on two ranks) run in the LM render too.
SLOW_FILES: dict[str, list[str]] = {
    "py312-bsd-lm": [
        "tests/test_language_model.py",
        "tests/test_parallel_processes.py",
        "tests/test_step_checkpoints.py",  # the LM's SIGKILL-and-resume test (issue 36)
    ],
}

# This render's suite runs after config.py's defaults were changed as a user changes them
# (tests/matrix_checks.py): defaults are the user's, so no generated test may hard-code one.
USER_DEFAULTS_RENDER = "py311-apache-mlp"
USER_DEFAULTS = {
    "model": '"usernet"',  # a model of the user's own (tests/matrix_checks.py)
    "seed": "7",
    "width": "48",
    "dropout": "0.2",
    "epochs": "8",
    "batch_size": "64",
    "lr": "1e-3",
    "weight_decay": "0.01",
    "warmup_steps": "100",
    "tf32": "False",
    "log_every": "10",
}

# `nox -s gpu` checks these renders by default: one per task.
GPU_RENDERS = [SLOW_RENDER, "py312-bsd-lm"]


def package_name(answers: dict[str, Any]) -> str:
    """The package name copier derives from the project name (no answer overrides it here)."""
    return str(answers.get("package_name") or answers["project_name"].replace("-", "_"))
