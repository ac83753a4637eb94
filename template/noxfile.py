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
leaves torch to the package index you configured (a mirror, a wheel folder); `auto` falls
back to it, with one line, where PyTorch's index cannot be reached. uv does not read pip's
configuration, so the sessions hand it pip's configured wheel folders, indexes and constraints.

On a GPU machine without a package index (common on clusters), run the checks in the current
interpreter, which already has torch and this project's test dependencies (the project itself
need not be installed: src/ goes on PYTHONPATH):

    python -m nox --no-venv -s gpu        # --no-venv is short for --force-venv-backend none

Set TORCH_SPEC (for example "torch==2.6.0") to pin the torch that sessions install.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import nox
from nox.command import CommandFailed

nox.needs_version = ">=2025.2.9"  # nox.project.dependency_groups
nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "uv|virtualenv"

PYPROJECT = nox.project.load_toml("pyproject.toml")
NO_CUDA = "no CUDA device: GPU checks skipped"


def _uses_current_interpreter(session: nox.Session) -> bool:
    return session.venv_backend == "none"


def _python(session: nox.Session) -> str:
    """The session's interpreter; under --no-venv the one running nox (sys.executable), not
    whatever `python` comes first on PATH, which may be another environment without torch."""
    return sys.executable if _uses_current_interpreter(session) else "python"


# What the GPU session imports under --no-venv: the project's dependencies and pytest (and a
# language model's tokenizers, where pyproject.toml lists it).
NO_VENV_MODULES = ["torch", "pytest", "tyro", "tqdm", "numpy", "PIL"] + [
    name
    for name in ("tokenizers",)
    if any(dep.startswith(name) for dep in PYPROJECT.get("project", {}).get("dependencies", []))
]


def _require_modules(session: nox.Session) -> None:
    """Under --no-venv, fail with one line naming every module the interpreter lacks."""
    if not _uses_current_interpreter(session):
        return
    find = (
        "import importlib.util as u, sys; print(*(m for m in sys.argv[1:] if not u.find_spec(m)))"
    )
    missing = str(
        session.run(sys.executable, "-c", find, *NO_VENV_MODULES, silent=True, external=True)
    ).strip()
    if missing:
        session.error(
            f"--no-venv uses the python running nox ({sys.executable}), which lacks: {missing}; "
            "install them there (offline: pip install --no-index --find-links <wheel folder>)"
        )


def _groups(*names: str) -> tuple[str, ...]:
    """The requirements of pyproject.toml's dependency groups (any pip or uv can install)."""
    return nox.project.dependency_groups(PYPROJECT, *names)


# ---- Which torch, and from where: the one rule -------------------------------------------
# The template's own noxfile and its tests execute this section's names from this file, so a
# project's sessions, its CI and the template's environments all take torch the same way.

TORCH = os.environ.get("TORCH_SPEC", "torch")
TORCH_BACKEND = os.environ.get("TORCH_BACKEND", "auto")
PYTORCH_INDEX = "https://download.pytorch.org/whl/"
FELL_BACK = (
    "torch from PyTorch's index failed (output above; unreachable from here?): "
    "installing it from the configured package indexes, as TORCH_BACKEND=none does"
)
PIP_TO_UV = {
    "find-links": "--find-links",
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "constraint": "--constraint",
}


def torch_source(venv_backend: str) -> tuple[list[str], dict[str, str]]:
    """Installer arguments and environment that choose the torch wheel (see TORCH_BACKEND)
    for an environment made by `venv_backend` (nox's name: "uv", "virtualenv", ...)."""
    if TORCH_BACKEND == "none":
        return [], {}
    if venv_backend == "uv":
        return [], {"UV_TORCH_BACKEND": TORCH_BACKEND}
    backend = TORCH_BACKEND
    if backend == "auto":  # PyPI's Linux wheel is the CUDA build: gigabytes a CPU never uses
        no_gpu = sys.platform == "linux" and shutil.which("nvidia-smi") is None
        backend = "cpu" if no_gpu else ""
    return (["--index-url", PYTORCH_INDEX + backend] if backend else []), {}


def install_torch(
    install: Callable[..., object],
    warn: Callable[[str], object],
    venv_backend: str,
    *extra: str,
    spec: str = TORCH,
) -> dict[str, str]:
    """Install torch (`spec`) from TORCH_BACKEND's source with `install(*args, env=...)`,
    which raises nox's CommandFailed when the installer fails (a nox session's `install`
    does); returns the installer environment that worked.

    Under the default, `auto`, a machine that reaches its package indexes but not PyTorch's
    own (a proxy, a mirror) gets torch from the configured indexes, as `none` does, and
    `warn` says so in one line; a backend named on purpose (`cpu`, `cu128`) fails instead.
    """
    args, env = torch_source(venv_backend)
    try:
        install(spec, *args, *extra, env=env)
    except CommandFailed:
        if TORCH_BACKEND != "auto" or not (args or env):
            raise
        warn(FELL_BACK)
        install(spec, *extra, env={})
        return {}
    return env


def pip_config_for_uv() -> list[str]:
    """pip's configured wheel folders, indexes and constraints (`pip config list`: files and
    PIP_* variables) as uv arguments, so uv installs what pip would have: uv does not read
    pip's configuration, and a machine configured for a mirror would otherwise fetch from
    PyPI (where torch for Linux is the CUDA build)."""
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):  # no pip next to nox: nothing configured
        return []
    args: list[str] = []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        flag = PIP_TO_UV.get(key.rsplit(".", 1)[-1])
        if flag is None:
            continue
        for item in value.strip().strip("'\"").split():
            if item not in args:
                args += [flag, item]
    if "--index-url" in args or "--extra-index-url" in args:
        # pip takes the best version from all its indexes; uv only trusts the first that has
        # the package unless told otherwise.
        args += ["--index-strategy", "unsafe-best-match"]
    return args


# ---- End of the torch rule -----------------------------------------------------------------


def _uv_args(session: nox.Session) -> list[str]:
    """What uv needs to install what pip would (nothing under pip, which reads its own)."""
    return pip_config_for_uv() if session.venv_backend == "uv" else []


def _install(session: nox.Session, *groups: str, extras: tuple[str, ...] = ()) -> None:
    """Install torch, the project (with `extras`) and the named dependency groups, unless
    running in --no-venv mode (then the interpreter's packages are used as they are: offline
    machines cannot install)."""
    if _uses_current_interpreter(session):
        return
    uv_args = _uv_args(session)
    env = install_torch(session.install, session.warn, session.venv_backend, *uv_args)
    project = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", project, *_groups(*groups), *uv_args, env=env)


def _tracker_extra() -> tuple[str, ...]:
    """The extra of the tracker this project was made with (`tracker` in .copier-answers.yml),
    so that `nox -s tests` runs that tracker's tests instead of skipping them."""
    answers = Path(".copier-answers.yml")
    text = answers.read_text() if answers.is_file() else ""
    match = re.search(r"^tracker:\s*['\"]?([\w-]+)", text, re.M)
    extras = PYPROJECT["project"].get("optional-dependencies", {})
    return (match[1],) if match and match[1] in extras else ()


def _tests_extras() -> tuple[str, ...]:
    """What `nox -s tests` installs the project with: the tracker's extra, and `serve` (the
    server's tests and its page's run instead of skipping; the page's take the `browser` group,
    Playwright, and a Chromium: tests/test_serve_page.py)."""
    extras = PYPROJECT["project"].get("optional-dependencies", {})
    return _tracker_extra() + tuple(name for name in ("serve",) if name in extras)


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
    """CPU test suite (`nox -s tests -- -m 'not slow'` passes arguments on to pytest); the
    chosen tracker's extra and the server's are installed with it, and Playwright."""
    _install(session, "test", "browser", extras=_tests_extras())
    pytest_args = session.posargs or ["-m", "not gpu"]
    session.run(_python(session), "-m", "pytest", *pytest_args, env=_env(session), external=True)


@nox.session
def gpu(session: nox.Session) -> None:
    """Every GPU path once, then a summary table; skips without a GPU, FAILS with one that
    torch cannot use (`nox -s gpu -- -k ddp` passes arguments on to the GPU tests)."""
    _install(session, "test")
    _require_modules(session)
    python, package, env = _python(session), _package(), _env(session)
    # One line: torch, its CUDA, the GPUs, the driver; exit 1 if a GPU is there but unusable.
    report = str(
        session.run(
            python, "-m", f"{package}.runtime.cuda_check", env=env, silent=True, external=True
        )
    ).strip()
    session.log(report)
    if report.startswith(NO_CUDA):
        return
    low = "bf16" if "bf16 yes" in report else "fp16"
    steps = _gpu_steps(package, device="cuda", low=low, ranks="gpu", shrink={"train": GPU_SIZES})
    steps["GPU test suite"] += session.posargs
    _run_steps(session, report, python, steps, env, notes=_multi_rank_notes(report))


def _multi_rank_notes(report: str) -> list[str]:
    """What the summary says when the checks' torchrun jobs start one rank (one GPU): they pass
    there without comparing ranks, so it names what only two or more GPUs check."""
    found = re.search(r"; (\d+) x ", report)
    if found is None or int(found.group(1)) >= 2:
        return []
    return [
        "not checked with one GPU (each torchrun job starts one rank): DDP replicas staying "
        "identical, FSDP shards resharded 2 -> 1, the ranks agreeing on a stop or a failed "
        "save; run `nox -s gpu` on a host with two or more GPUs for those"
    ]


@nox.session(default=False)
def gpu_rehearsal(session: nox.Session) -> None:
    """`nox -s gpu`'s commands on CPU, sizes shrunk: every flag combination the GPU session
    runs is parsed and trained here, so only what needs CUDA is left for the GPU machine."""
    _install(session, "test")
    _require_modules(session)
    python, package, env = _python(session), _package(), _env(session)
    steps = _gpu_steps(package, device="cpu", low="bf16", ranks="2", shrink=REHEARSAL_SHRINK)
    _run_steps(session, "CPU rehearsal (device cpu, sizes shrunk)", python, steps, env)


# Where the GPU session's steps write; each session starts it afresh (`_run_steps`).
GPU_CHECK_RUNS = Path("runs", "gpu-check")
# The data of the GPU session's training runs (also read by the profiler, tune, benchmark).
GPU_SIZES = ["--epochs", "1", "--max-steps-per-epoch", "30", "--train-samples", "4096",
             "--val-samples", "500"]  # fmt: skip
# The rehearsal's flags, added per command: the same steps on CPU with tiny data and a
# narrow model (a CPU without native bf16 emulates it: the language model's benchmark
# took 88 s at its default width, 20 s at 16), and the compile backend aot_eager
# (Dynamo's capture and AOT autograd, every compile flag parsed and applied, no C++
# built: inductor on CPU is what the generated suite's slow tests run). The GPU tests
# are collected, not run, so an import or fixture error shows without a GPU.
REHEARSAL_SHRINK = {
    "train": ["--epochs", "1", "--max-steps-per-epoch", "2", "--train-samples", "64",
              "--val-samples", "32", "--batch-size", "16", "--num-workers", "0",
              "--width", "16", "--compile-backend", "aot_eager"],
    "tests": ["tests/gpu", "--collect-only", "-q"],
    "profiling": ["--profile-wait", "0", "--profile-warmup", "1", "--profile-steps", "1"],
    "tune": ["--steps", "2", "--rounds", "2"],
    "benchmark": ["--min-run-time", "0.01", "--loop-steps", "2"],
    "generate": ["--max-new-tokens", "8"],
}  # fmt: skip


def _gpu_steps(
    package: str, *, device: str, low: str, ranks: str, shrink: dict[str, list[str]]
) -> dict[str, list[str]]:
    """The GPU session's commands (python's arguments), shared with its CPU rehearsal, which
    adds `shrink[kind]` to each (`train`: every command that trains or measures training).

    `--tracker none`: the checks measure training, not a tracker; the project's default
    tracker may lack its package, or upload runs where a key is set.
    """
    out = GPU_CHECK_RUNS
    small = ["--device", device, *shrink.get("train", []), "--progress", "false",
             "--tracker", "none"]  # fmt: skip
    train = ["-m", f"{package}.train", *small]
    steps = {
        "GPU test suite": ["-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider",
                           *shrink.get("tests", [])],
        "compile default": [*train, "--compile", "on", "--run-dir", str(out / "compile-default")],
        "compile reduce-overhead": [*train, "--compile", "on", "--compile-mode",
                                    "reduce-overhead", "--run-dir", str(out / "reduce-overhead")],
        "deterministic + compile": [*train, "--compile", "on", "--deterministic",
                                    "--run-dir", str(out / "deterministic")],
        "torchrun DDP fp16 + accum 2": ["-m", "torch.distributed.run", "--standalone",
                                        f"--nproc_per_node={ranks}", *train, "--precision", "fp16",
                                        "--grad-accum-steps", "2", "--run-dir", str(out / "ddp")],
        "profiler": ["-m", f"{package}.profiling", *small, *shrink.get("profiling", []),
                     "--out", str(out / "profile")],
        "tune --quick": ["-m", f"{package}.tune", "--quick", *small, *shrink.get("tune", []),
                         "--out", str(out / "tuned.toml")],
        f"benchmark --quick {low}": ["-m", f"{package}.benchmark", "--quick", *small,
                                     "--precision", low, *shrink.get("benchmark", []),
                                     "--out", str(out / "bench")],
    }  # fmt: skip
    if Path("src", package, "generate.py").is_file():  # a language model: sample from a run
        checkpoint = out / "compile-default" / "checkpoints" / "last.pt"
        steps["generate"] = ["-m", f"{package}.generate", "--checkpoint", str(checkpoint),
                             "--device", device, *shrink.get("generate", [])]  # fmt: skip
    return steps


def _run_steps(
    session: nox.Session,
    report: str,
    python: str,
    steps: dict[str, list[str]],
    env: dict[str, str],
    notes: Sequence[str] = (),
) -> None:
    """Run every step (a failure does not stop the next), print the summary, fail if any did.

    The previous session's runs are removed first: the training steps write fixed run
    folders (which the run-dir guard would refuse without --resume), and `generate` must
    sample from this session's checkpoint, never a stale one.
    """
    if GPU_CHECK_RUNS.exists():
        session.log(f"removing the previous GPU checks' runs: {GPU_CHECK_RUNS}")
        shutil.rmtree(GPU_CHECK_RUNS)
    results = [_timed(session, name, [python, *args], env) for name, args in steps.items()]
    session.log("\n".join([_summary(report, results), *notes]))
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
        session.install(*_groups("lint"), *_uv_args(session))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over src/ and tests/ with the settings in pyproject.toml's [tool.mypy]."""
    _install(session, "typecheck")
    session.run(_python(session), "-m", "mypy", *session.posargs, external=True)


if __name__ == "__main__":  # `./noxfile.py -s lint` or `uv run noxfile.py` work too
    nox.main()
