"""Session fixtures: a git identity for the commits tests make, and the matrix renders."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

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
    """Every matrix entry rendered once, into build/matrix/<name> (wiped first)."""
    shutil.rmtree(MATRIX_DIR, ignore_errors=True)
    MATRIX_DIR.mkdir(parents=True)
    return {name: render(MATRIX_DIR / name, answers) for name, answers in MATRIX.items()}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the mutation tests' kill rates, so CI's log shows them."""
    for line in KILL_RATES:
        terminalreporter.write_line(line)
