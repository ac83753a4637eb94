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
# CI machine, roughly: the slow render ~400, package mutations ~400, the other renders ~250,
# the update tests ~250, docs ~120, utils mutations ~140, the kept example ~110. The README
# install (test_user_install: an image and an LM suite, then mypy, in an environment of their
# own) took 1067 s on a 2-core machine at load 12, 280 s of CPU: not yet timed on CI.
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


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the mutation tests' kill rates, so CI's log shows them."""
    for line in KILL_RATES:
        terminalreporter.write_line(line)
