"""Session fixtures: a git identity for the commits tests make, and the matrix renders.

Under pytest-xdist (`nox -s tests` runs `-n 2 --dist loadfile`: CI has two cores, and most of
the suite waits on subprocesses) every test module runs whole on one worker, so a module's
fixtures (a render, a mutation run) are built once; each worker renders the matrix into its own
folder, build/matrix/<worker>, so two workers never write the same files.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import GIT_IDENTITY, KILL_RATES, MATRIX_DIR, render
from matrix import MATRIX


@pytest.fixture(scope="session", autouse=True)
def _git_identity() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in GIT_IDENTITY.items():
            patch.setenv(name, value)
        yield


@pytest.fixture(scope="session")
def rendered() -> dict[str, Path]:
    """Every matrix entry rendered once, into build/matrix/[<xdist worker>/]<name> (wiped
    first)."""
    folder = MATRIX_DIR / os.environ.get("PYTEST_XDIST_WORKER", "")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return {name: render(folder / name, answers) for name, answers in MATRIX.items()}


# The longest modules first, so two xdist workers finish together (a module runs whole on one
# worker; `nox -s tests` passes --no-loadscope-reorder so this order is kept). Seconds on the
# CI machine, roughly (its log's slowest tests): the slow render ~320, the README install
# (test_user_install) ~300, the other renders ~350, the kept example ~230, the package
# mutations ~200 (306 before the mutation runner forked from a warmed, frozen parent), the
# update tests ~150, docs ~110, utils mutations ~30. test_lm_mutations (~150, from 232) comes
# early among the rest.
LONGEST_FIRST = [
    "test_matrix_slow",
    "test_package_mutations",
    "test_user_install",
    "test_matrix",
    "test_update",
    "test_utils_mutations",
    "test_docs",
    "test_update_kept_example",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        module = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
        return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a module is kept


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On an xdist worker: hand the kill rates to the controller, which prints the summary."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["kill_rates"] = list(KILL_RATES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """On the xdist controller: collect a finished worker's kill rates."""
    KILL_RATES.extend(getattr(node, "workeroutput", {}).get("kill_rates", []))


# Seconds per module on each worker ("main" without xdist), in the order they ran.
MODULE_SECONDS: dict[str, dict[str, float]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add a test's setup, call and teardown time to its module's, under its worker."""
    node = getattr(report, "node", None)  # on the xdist controller: the worker that ran it
    worker = getattr(getattr(node, "gateway", None), "id", "main")
    module = report.nodeid.split("::")[0].rsplit("/", 1)[-1]
    modules = MODULE_SECONDS.setdefault(worker, {})
    modules[module] = modules.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the mutation tests' kill rates and each worker's modules, so CI's log shows them
    (a worker that ends long before the other is time LONGEST_FIRST could win back)."""
    for line in KILL_RATES:
        terminalreporter.write_line(line)
    for worker, modules in sorted(MODULE_SECONDS.items()):
        ran = ", ".join(f"{name} {seconds:.0f}" for name, seconds in modules.items())
        terminalreporter.write_line(f"{worker}: {sum(modules.values()):.0f} s: {ran}")
