"""The render matrix: every rendered project installs, passes its CPU suite and trains.

Each project is pip-installed (editable, no dependencies: the one shared environment already
has torch and the rest) under its own distribution and package name, so all of them coexist.
The `slow` tests run in one render only (see matrix.SLOW_RENDER) and, for slow tests only
another render has, there too (matrix.SLOW_FILES); renders whose answers change no code path
another render runs only their answer-specific files (matrix.PARTIAL_SUITES).
"""

from __future__ import annotations

import math
import re
import sys

import pytest

from helpers import check_project, pip_install_editable, run, run_project_suite
from matrix import MATRIX, PARTIAL_SUITES, SLOW_FILES, SLOW_RENDER, package_name

pytestmark = pytest.mark.matrix


@pytest.mark.parametrize("name", list(MATRIX))
def test_installs_and_passes_its_cpu_suite(rendered, name):
    python_version = MATRIX[name]["python_version"]
    check_project(
        rendered[name],
        slow=name == SLOW_RENDER,
        python_version=python_version,
        tests=PARTIAL_SUITES.get(name, []),
    )
    if name in SLOW_FILES:  # the slow tests only this render has
        run_project_suite(rendered[name], *SLOW_FILES[name], markers="not gpu and slow")


@pytest.mark.parametrize("name", list(MATRIX))
def test_trains_one_epoch(rendered, name, tmp_path):
    # Installed by the previous test; installing again is cheap and keeps this one standalone.
    pip_install_editable(rendered[name], python_version=MATRIX[name]["python_version"])
    package = package_name(MATRIX[name])
    small = ["--train-samples", "1024", "--val-samples", "256"]  # one epoch, in seconds
    command = [sys.executable, "-m", f"{package}.train", "--epochs", "1", *small]
    # Run from a scratch folder, not the project: the installed package must be what imports.
    # A tracker answer logs for real, on this machine: W&B offline, MLflow in a local store.
    local = {"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'ml.db'}"}
    result = run([*command, "--run-dir", tmp_path / "run"], tmp_path, env=local)
    output = result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"loss\W{1,3}(-?\d+\.\d+(?:e-?\d+)?)", output, re.I)]
    assert losses, f"no loss printed:\n{output[-2000:]}"
    assert all(math.isfinite(loss) for loss in losses)
