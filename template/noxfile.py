"""Task runner for this project: `nox -s tests`, `nox -s gpu`, `nox -s lint`.

`nox` alone runs tests and lint. Each session installs the project into its own virtual
environment. On a GPU machine without a package index (common on clusters), run the checks in
the interpreter that runs nox, which must already have torch and this project's test
dependencies (the project itself need not be installed: src/ goes on PYTHONPATH):

    python -m nox --no-venv -s gpu        # --no-venv is short for --force-venv-backend none

Set TORCH_SPEC (for example "torch==2.6.0") to pin the torch that sessions install.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nox
from nox.command import CommandFailed

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

TORCH = os.environ.get("TORCH_SPEC", "torch")
NO_CUDA = "no CUDA device: GPU checks skipped"


def _uses_current_interpreter(session: nox.Session) -> bool:
    return session.venv_backend == "none"


def _python(session: nox.Session) -> str:
    """The session's interpreter; under --no-venv the one running nox (sys.executable), not
    whatever `python` comes first on PATH, which may be another environment without torch."""
    return sys.executable if _uses_current_interpreter(session) else "python"


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


@nox.session
def tests(session: nox.Session) -> None:
    """CPU test suite (`nox -s tests -- -m 'not slow'` passes arguments on to pytest)."""
    _install(session)
    pytest_args = session.posargs or ["-m", "not gpu"]
    session.run(_python(session), "-m", "pytest", *pytest_args, env=_env(session), external=True)


@nox.session
def gpu(session: nox.Session) -> None:
    """Every GPU path once, then a summary table; skips without a GPU, FAILS with one that
    torch cannot use (`nox -s gpu -- -k ddp` passes arguments on to the GPU tests)."""
    _install(session)
    python, package, env = _python(session), _package(), _env(session)
    # One line: torch, its CUDA, the GPUs, the driver; exit 1 if a GPU is there but unusable.
    report = str(
        session.run(python, "-m", f"{package}.cuda_check", env=env, silent=True, external=True)
    ).strip()
    session.log(report)
    if report.startswith(NO_CUDA):
        return
    low = "bf16" if "bf16 yes" in report else "fp16"
    out = Path("runs", "gpu-check")
    small = ["--device", "cuda", "--epochs", "1", "--max-steps-per-epoch", "30",
             "--train-samples", "4096", "--val-samples", "500", "--progress", "false"]  # fmt: skip
    train = ["-m", f"{package}.train", *small]
    steps = {
        "GPU test suite": ["-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", *session.posargs],
        "compile default": [*train, "--compile", "on", "--run-dir", str(out / "compile-default")],
        "compile reduce-overhead": [*train, "--compile", "on", "--compile-mode",
                                    "reduce-overhead", "--run-dir", str(out / "reduce-overhead")],
        "deterministic + compile": [*train, "--compile", "on", "--deterministic",
                                    "--run-dir", str(out / "deterministic")],
        "torchrun DDP fp16 + accum 2": ["-m", "torch.distributed.run", "--standalone",
                                        "--nproc_per_node=gpu", *train, "--precision", "fp16",
                                        "--grad-accum-steps", "2", "--run-dir", str(out / "ddp")],
        "profiler": ["-m", f"{package}.profiling", *small, "--out", str(out / "profile")],
        f"benchmark --quick {low}": ["-m", f"{package}.benchmark", "--quick", "--device",
                                     "cuda", "--precision", low, "--out", str(out / "bench")],
    }  # fmt: skip
    results = [_timed(session, name, [python, *args], env) for name, args in steps.items()]
    session.log(_summary(report, results))
    failed = [name for name, ok, _ in results if not ok]
    if failed:
        session.error(f"GPU checks failed: {', '.join(failed)} (output above)")


def _timed(
    session: nox.Session, name: str, command: list[str], env: dict[str, str]
) -> tuple[str, bool, float]:
    """Run one GPU check; a failure is recorded (and shown) but the next check still runs."""
    started = time.perf_counter()
    try:
        session.run(*command, env=env, external=True)
    except CommandFailed:
        return name, False, time.perf_counter() - started
    return name, True, time.perf_counter() - started


def _summary(report: str, results: list[tuple[str, bool, float]]) -> str:
    width = max(len(name) for name, _, _ in results)
    lines = [f"GPU checks on: {report}", f"{'check':<{width}}  result  seconds"]
    lines += [f"{n:<{width}}  {'ok' if ok else 'FAILED':<6}  {s:7.1f}" for n, ok, s in results]
    return "\n".join(lines)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and format check."""
    if not _uses_current_interpreter(session):
        session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
