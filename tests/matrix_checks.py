"""What the matrix asks of one render (tests/test_matrix.py, tests/test_matrix_slow.py): it
installs, its CPU suite passes, and it trains one epoch from outside its own folder. One render
(matrix.USER_DEFAULTS_RENDER) has its config.py defaults changed first, as a user would.

The slow render has a module of its own so that pytest-xdist, which keeps a module on one
worker, runs its long suite beside the other renders instead of after them.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

from helpers import check_project, pip_install_editable, run, run_project_suite
from matrix import (
    MATRIX,
    PARTIAL_SUITES,
    SLOW_FILES,
    SLOW_RENDER,
    USER_DEFAULTS,
    USER_DEFAULTS_RENDER,
    package_name,
)

GROUP_CLASS = re.compile(r"^class (\w+Config)\b[^\n]*\n(.*?)(?=^\S|\Z)", re.M | re.S)


def change_defaults(project: Path, defaults: dict[str, str]) -> None:
    """Set defaults as config.py's docstring tells a user to: as arguments of their group's
    line in `Config`, `optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))`
    (the group of each field read from the template's config_base.py)."""
    (config,) = project.glob("src/*/config.py")
    base = config.with_name("config_base.py").read_text()
    by_group: dict[str, list[str]] = {}
    for name, value in defaults.items():
        owners = [g for g, body in GROUP_CLASS.findall(base) if f"\n    {name}: " in f"\n{body}"]
        assert len(owners) == 1, f"{config}: the default of {name} is in no one group: {owners}"
        by_group.setdefault(owners[0], []).append(f"{name}={value}")
    text = config.read_text()
    for group, arguments in by_group.items():
        line = rf"^(    \w+: {group} = field\()default_factory={group}\)$"
        exploded = "".join(f"            {argument},\n" for argument in arguments)
        new = f"\\1\n        default_factory=lambda: {group}(\n{exploded}        )\n    )"
        text, count = re.subn(line, new, text, flags=re.M)
        assert count == 1, f"{config}: no `{group}` line in Config where a user changes defaults"
    config.write_text(text)


def installs_and_passes_its_cpu_suite(project: Path, name: str) -> None:
    if name == USER_DEFAULTS_RENDER:
        change_defaults(project, USER_DEFAULTS)
    check_project(
        project,
        slow=name == SLOW_RENDER,
        python_version=MATRIX[name]["python_version"],
        tests=PARTIAL_SUITES.get(name, []),
    )
    if name in SLOW_FILES:  # the slow tests only this render has
        run_project_suite(project, *SLOW_FILES[name], markers="not gpu and slow")


def trains_one_epoch(project: Path, name: str, tmp_path: Path) -> None:
    # Installed by the suite's check; installing again is cheap and keeps this one standalone.
    pip_install_editable(project, python_version=MATRIX[name]["python_version"])
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
