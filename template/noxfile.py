#!/usr/bin/env -S uv run --script
# /// script
# dependencies = ["nox>=2025.2.9"]
# ///
"""Task runner for this project: `nox -s tests`, `nox -s gpu`, `nox -s lint`, `nox -s typecheck`.

`nox` alone runs tests, lint and typecheck. Each session installs the project into its own
virtual environment, made with uv when uv is installed (much faster) and virtualenv + pip
otherwise. The development tools come from pyproject.toml's dependency groups.

Which torch: TORCH_BACKEND picks the wheel (default `auto`). Under uv that is uv's
`--torch-backend` (auto: the CUDA build that matches this machine's driver, the CPU build
without a GPU); under pip, `auto` takes PyTorch's CPU index on Linux without `nvidia-smi`
and PyPI's wheel otherwise, and `cpu`, `cu128`... name a PyTorch index. TORCH_BACKEND=none
leaves torch to the package index you configured (a mirror, a wheel folder).

On a GPU machine without a package index (common on clusters), run the checks in the current
interpreter, which already has torch and this project's test dependencies (the project itself
need not be installed: src/ goes on PYTHONPATH):

    nox --no-venv -s gpu        # same as --force-venv-backend none

Set TORCH_SPEC (for example "torch==2.6.0") to pin the torch that sessions install.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nox

nox.needs_version = ">=2025.2.9"  # nox.project.dependency_groups
nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "uv|virtualenv"

TORCH = os.environ.get("TORCH_SPEC", "torch")
TORCH_BACKEND = os.environ.get("TORCH_BACKEND", "auto")
PYTORCH_INDEX = "https://download.pytorch.org/whl/"
PYPROJECT = nox.project.load_toml("pyproject.toml")
NO_CUDA = "no CUDA device: GPU checks skipped"


def _uses_current_interpreter(session: nox.Session) -> bool:
    return session.venv_backend == "none"


def _groups(*names: str) -> tuple[str, ...]:
    """The requirements of pyproject.toml's dependency groups (any pip or uv can install)."""
    return nox.project.dependency_groups(PYPROJECT, *names)


def _torch_source(session: nox.Session) -> tuple[list[str], dict[str, str]]:
    """Installer arguments and environment that choose the torch wheel (see TORCH_BACKEND)."""
    if TORCH_BACKEND == "none":
        return [], {}
    if session.venv_backend == "uv":
        return [], {"UV_TORCH_BACKEND": TORCH_BACKEND}
    backend = TORCH_BACKEND
    if backend == "auto":  # PyPI's Linux wheel is the CUDA build: gigabytes a CPU never uses
        no_gpu = sys.platform == "linux" and shutil.which("nvidia-smi") is None
        backend = "cpu" if no_gpu else ""
    return (["--index-url", PYTORCH_INDEX + backend] if backend else []), {}


def _install(session: nox.Session, *groups: str) -> None:
    """Install torch, the project and the named dependency groups, unless running in --no-venv
    mode (then the interpreter's packages are used as they are: offline machines cannot
    install)."""
    if _uses_current_interpreter(session):
        return
    args, env = _torch_source(session)
    session.install(TORCH, *args, env=env)
    session.install("-e", ".", *_groups(*groups), env=env)


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
    _install(session, "test")
    pytest_args = session.posargs or ["-m", "not gpu"]
    session.run("python", "-m", "pytest", *pytest_args, env=_env(session))


@nox.session
def gpu(session: nox.Session) -> None:
    """GPU tests, then a quick benchmark and a profiler trace; skips cleanly without CUDA."""
    _install(session, "test")
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
        session.install(*_groups("lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over src/ and tests/ with the settings in pyproject.toml's [tool.mypy]."""
    _install(session, "typecheck")
    session.run("python", "-m", "mypy", *session.posargs)


if __name__ == "__main__":  # `./noxfile.py -s lint` or `uv run noxfile.py` work too
    nox.main()
