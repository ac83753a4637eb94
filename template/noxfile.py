"""Task runner for this project: `nox -s tests`, `nox -s gpu`, `nox -s lint`.

`nox` alone runs tests and lint. Each session installs the project into its own virtual
environment. On a GPU machine without a package index (common on clusters), run the checks in
the current interpreter, which already has torch and this project's test dependencies (the
project itself need not be installed: src/ goes on PYTHONPATH):

    nox --no-venv -s gpu        # same as --force-venv-backend none

Set TORCH_SPEC (for example "torch==2.6.0") to pin the torch that sessions install.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

TORCH = os.environ.get("TORCH_SPEC", "torch")
NO_CUDA = "no CUDA device: GPU checks skipped"


def _uses_current_interpreter(session: nox.Session) -> bool:
    return session.venv_backend == "none"


def _install(session: nox.Session) -> None:
    """Install torch and the project with its test extra, unless running in --no-venv mode
    (then the interpreter's packages are used as they are: offline machines cannot install)."""
    if _uses_current_interpreter(session):
        return
    session.install(TORCH)
    session.install("-e", ".[test]")


def _env(session: nox.Session) -> dict[str, str]:
    """Without an install (--no-venv), the package is imported from src/."""
    if not _uses_current_interpreter(session):
        return {}
    paths = [str(Path("src").resolve()), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(filter(None, paths))}


def _package() -> str:
    """The import name of this project's package (the one folder in src/ with an __init__)."""
    packages = sorted(path.parent.name for path in Path("src").glob("*/__init__.py"))
    if len(packages) != 1:
        raise RuntimeError(f"expected exactly one package in src/, found {packages}")
    return packages[0]


def _has_cuda(session: nox.Session) -> bool:
    output = session.run(
        "python", "-c", "import torch; print(torch.cuda.is_available())", silent=True
    )
    return "True" in str(output)


@nox.session
def tests(session: nox.Session) -> None:
    """CPU test suite (`nox -s tests -- -m 'not slow'` passes arguments on to pytest)."""
    _install(session)
    pytest_args = session.posargs or ["-m", "not gpu"]
    session.run("python", "-m", "pytest", *pytest_args, env=_env(session))


@nox.session
def gpu(session: nox.Session) -> None:
    """GPU tests, then a quick benchmark and a profiler trace; skips cleanly without CUDA."""
    _install(session)
    if not _has_cuda(session):
        session.log(NO_CUDA)
        return
    package, env = _package(), _env(session)
    session.run("python", "-m", "pytest", "-m", "gpu", *session.posargs, env=env)
    session.run("python", "-m", f"{package}.benchmark", "--quick", env=env)
    session.run("python", "-m", f"{package}.profiling", env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and format check."""
    if not _uses_current_interpreter(session):
        session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
