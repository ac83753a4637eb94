"""Task runner for this project: `nox -s tests`, `nox -s gpu`, `nox -s lint`.

On a GPU machine without a package index (common on clusters), run the checks in the current
environment, which already has torch: `nox --no-venv -s gpu`.
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

# pip takes whatever torch this spec allows; set TORCH_SPEC (e.g. "torch==2.13.0") to pin it.
TORCH = os.environ.get("TORCH_SPEC", "torch")


def _install(session: nox.Session) -> None:
    if session.venv_backend == "none":
        return  # --no-venv: use the interpreter's packages as they are
    session.install(TORCH)
    session.install("-e", ".[test]")


@nox.session
def tests(session: nox.Session) -> None:
    """CPU test suite (GPU tests skip themselves without CUDA)."""
    _install(session)
    session.run("python", "-m", "pytest", *(session.posargs or ["-m", "not gpu"]))


@nox.session
def gpu(session: nox.Session) -> None:
    """GPU test suite; says so and stops when no CUDA device is visible."""
    _install(session)
    has_cuda = session.run(
        "python", "-c", "import torch; print(torch.cuda.is_available())", silent=True
    )
    if "True" not in str(has_cuda):
        session.log("no CUDA device: GPU checks skipped")
        return
    session.run("python", "-m", "pytest", "-m", "gpu", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and format check."""
    if session.venv_backend != "none":
        session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
