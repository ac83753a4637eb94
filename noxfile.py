"""Task runner for the copier-pytorch template repository.

    nox -s demo      render a project with default answers into build/demo, train one epoch
    nox              the full suite CI runs (.ci/run): demo, tests (update tests included),
                     lint, typecheck, docs, gpu
    nox -s tests     the template's pytest suite: rendering, answers, render matrix, update
    nox -s update    only the `copier update` tests
    nox -s gpu       on a GPU machine: render, run the project's GPU checks (`nox -s gpu` in the
                     render: GPU suite, torchrun DDP, compile modes, profiler, tune, benchmark)
                     and a summary; without a GPU the same commands on CPU (`gpu_rehearsal`),
                     fails when a GPU is there but torch cannot use it
    nox -s lint      ruff over the template's own Python and over every rendered project
    nox -s typecheck mypy over the noxfile and tests/, then over every rendered project
    nox -s docs      build the documentation site with mkdocs --strict into build/site

torch is installed once: the hidden `env` session builds one virtual environment (.nox/env)
with torch, copier, pytest, ruff, mypy and the generated projects' dependencies, and every
other session runs in it. It is made with uv when uv is installed (`pip install uv`: several
times faster) and with virtualenv and pip otherwise. uv does not read pip's configuration, so
the wheel folders, indexes and constraints pip is configured with are handed to uv.
TORCH_SPEC overrides the torch requirement (default torch==2.13.0); TORCH_BACKEND chooses
the wheel as in the generated projects (`auto`: the CPU build on a machine without a GPU;
`none`: whatever the configured package indexes hold).

On a GPU machine with torch preinstalled and no package index, skip the environment and use the
interpreter running nox (it needs nox_env.py's NO_VENV_MODULES; see README, GPU checks):

    nox --no-venv -s gpu
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import nox
from nox.command import CommandFailed

# The shared environment (nox_env.py, beside this file): nox puts this folder on sys.path, the
# tests that load this file by path may not.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from nox_env import (
    BUILD,
    ENV_PACKAGES,
    NO_VENV_MODULES,
    ROOT,
    TORCH,
    TORCH_RULE,
    Env,
    require_modules,
    run_python,
)

NO_CUDA = "no CUDA device: GPU checks skipped"
# The generated projects' GPU probe, stand-alone (stdlib + torch), so it runs by path here.
CUDA_CHECK = ROOT / "template" / "src" / "{{ package_name }}" / "runtime/cuda_check.py"
PY_VERSION = "import sys; print('%d.%d' % sys.version_info[:2])"
# copier.yml's _min_copier_version: the `tests` session also runs the update tests on it.
MIN_COPIER = "9.13.0"
# The update tests of tests/test_update.py rerun on it: check-update (the generated CI's job),
# a merge, a conflict found and undone, the README left alone. The rest (history replay,
# rename, hand-edited answers, real edits from the last release) run on the newest copier only,
# to keep CI time small.
MIN_COPIER_TESTS = (
    "test_the_copier_under_test_is_the_one_expected or test_user_edits_survive "
    "or test_conflicts_renames_and_the_readme"
)

# What CI runs (.ci/run names them explicitly, as the README does): the demo too, so the
# README's first command is proven on every run.
nox.options.sessions = ["demo", "tests", "lint", "typecheck", "docs", "gpu"]
nox.options.error_on_missing_interpreters = True
nox.options.default_venv_backend = "uv|virtualenv"


def _load_matrix() -> tuple[dict[str, dict[str, Any]], Any, str, list[str]]:
    """The answer matrix lives with the tests (tests/matrix.py); load it by path."""
    spec = importlib.util.spec_from_file_location("matrix", ROOT / "tests" / "matrix.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MATRIX, module.package_name, module.SLOW_RENDER, module.GPU_RENDERS


MATRIX, package_name, SLOW_RENDER, GPU_RENDERS = _load_matrix()


@nox.session(reuse_venv=True, default=False)
def env(session: nox.Session) -> None:
    """Build the shared environment (run on demand by the other sessions)."""
    if session.venv_backend == "none":  # --no-venv: take the interpreter running nox as it is
        Env.python = sys.executable  # as the generated projects' sessions do (not PATH's python)
        require_modules(session, NO_VENV_MODULES)
        return
    # uv writes no bytecode unless asked (pip does), and under PYTHONDONTWRITEBYTECODE (set on
    # CI's machine) no process writes it: every one of the suite's hundreds of processes then
    # compiled torch's sources again, 3.5 s to import torch and 4.5 s more for torch._dynamo
    # (which any optimizer imports), against 1.3 s and 1.2 s from bytecode. uv compiles what
    # each install brings: torch's takes about 20 s, once.
    uv = session.venv_backend == "uv"
    uv_args = [*TORCH_RULE.pip_config_for_uv(), "--compile-bytecode"] if uv else []
    TORCH_RULE.install_torch(
        session.install, session.warn, session.venv_backend, *uv_args, spec=TORCH
    )
    session.install(*ENV_PACKAGES, *uv_args)
    Env.python = str(Path(session.bin) / "python")
    # Subprocesses (copier's, the rendered projects' suites) find this environment first.
    Env.run_env = {
        "PATH": os.pathsep.join([session.bin, os.environ.get("PATH", "")]),
        "VIRTUAL_ENV": str(Path(session.bin).parent),
    }


class Renders:
    """Where this nox run rendered each set of answers: the lint, typecheck and gpu sessions
    render the same matrix entries from the same working tree, so the second render of the
    same answers is a copy of the first (copier took seconds each, serially, on CI)."""

    pristine: dict[str, Path] = {}  # noqa: RUF012 - one process-wide cache
    folder: Path | None = None  # where the pristine copies are, removed when nox ends


def _render(session: nox.Session, dest: Path, answers: dict[str, Any]) -> Path:
    """Render the working tree (uncommitted changes included) with the given answers."""
    shutil.rmtree(dest, ignore_errors=True)
    key = repr(sorted(answers.items()))
    if key in Renders.pristine:
        session.log(f"{dest}: a copy of {Renders.pristine[key]}, the same answers rendered")
        shutil.copytree(Renders.pristine[key], dest, symlinks=True)
        return dest
    data = [f"--data={key}={value}" for key, value in answers.items()]
    run_python(session, "-m", "copier", "copy", "--quiet", "--defaults", "--vcs-ref", "HEAD",
         *data, ROOT, dest)  # fmt: skip
    # Kept as rendered (the sessions write into theirs: ruff's cache, runs, checkpoints).
    if Renders.folder is None:
        Renders.folder = Path(tempfile.mkdtemp(prefix="renders-", dir=BUILD))
        atexit.register(shutil.rmtree, Renders.folder, ignore_errors=True)
    pristine = Renders.folder / str(len(Renders.pristine)) / dest.name
    shutil.copytree(dest, pristine, symlinks=True)
    Renders.pristine[key] = pristine
    return dest


def _selected(session: nox.Session) -> dict[str, dict[str, Any]]:
    """Matrix entries named in the session's arguments (all of them when none are named)."""
    unknown = set(session.posargs) - set(MATRIX)
    if unknown:
        session.error(f"unknown matrix entries {sorted(unknown)}; choose from {list(MATRIX)}")
    return {name: a for name, a in MATRIX.items() if not session.posargs or name in session.posargs}


@nox.session(venv_backend="none", requires=["env"])
def demo(session: nox.Session) -> None:
    """Render a project with the default answers into build/demo and train it for one epoch."""
    project = _render(session, BUILD / "demo", {})
    (package,) = (init.parent.name for init in project.glob("src/*/__init__.py"))
    session.chdir(project)
    run_python(session, "-m", f"{package}.train", "--epochs", "1", env={"PYTHONPATH": "src"})
    session.log(f"rendered project: {project}")


@nox.session(venv_backend="none", requires=["env"])
def tests(session: nox.Session) -> None:
    """The template's pytest suite (`nox -s tests -- -k render` passes arguments to pytest)."""
    # Two workers: most of the suite waits on subprocesses (renders' suites, mutation runs,
    # copier), so two run side by side on CI's two cores. Each module runs whole on one worker
    # (its fixtures are built once); tests/conftest.py gives each worker its own renders.
    # The slowest tests in the log: CI time is a budget (under 20 minutes on 2 cores).
    parallel = ["-n", "2", "--dist", "loadfile", "--no-loadscope-reorder"]
    with contextlib.ExitStack() as stack:
        if not session.posargs:  # the whole suite: the update tests again, on the oldest copier
            stack.enter_context(_min_copier_beside(session))
        run_python(session, "-m", "pytest", *parallel, "--durations=15", *session.posargs,
             env=_torch_threads())  # fmt: skip


def _torch_threads() -> dict[str, str]:
    """OMP_NUM_THREADS for the suite: its two workers each run up to two torch processes at a
    time (a render's suite, two mutation children), so each gets a quarter of the CPUs. With
    torch's default of one thread per CPU, four processes on two CPUs spin-wait for each
    other's threads: a small training step took 3.7x as long (two forked processes, 2 threads
    each, against 1 each), and the package mutations 135 s instead of 89 s. A value the caller
    set is kept."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"OMP_NUM_THREADS": str(max(1, (cpus or 1) // 4))}


@nox.session(venv_backend="none", requires=["env"])
def update(session: nox.Session) -> None:
    """Only the `copier update` tests (also part of `tests`), then again on the oldest copier."""
    run_python(session, "-m", "pytest", "-m", "update", *session.posargs)
    _update_tests_on_min_copier(session)


def _update_tests_on_min_copier(session: nox.Session) -> None:
    """The fast update tests with copier==MIN_COPIER, installed once into build/ and put first
    on PYTHONPATH (so it shadows the environment's newer copier, dependencies included)."""
    for args, env in _min_copier_steps():
        run_python(session, *args, env=env)


def _min_copier_steps() -> list[tuple[list[str], dict[str, str]]]:
    """_update_tests_on_min_copier's commands (arguments of python) and their environments."""
    target = BUILD / f"copier-{MIN_COPIER}"
    steps: list[tuple[list[str], dict[str, str]]] = []
    if not (target / "copier" / "__init__.py").is_file():
        shutil.rmtree(target, ignore_errors=True)
        install = ["-m", "pip", "install", "--quiet", "--target", str(target)]
        steps.append(([*install, f"copier=={MIN_COPIER}"], {}))
    env = {"PYTHONPATH": str(target), "EXPECT_COPIER_VERSION": MIN_COPIER}
    # Only their module, and a temporary folder of its own: the suite may run beside them.
    pytest = ["-m", "pytest", "-p", "no:cacheprovider", "--basetemp", str(BUILD / "min-copier")]
    steps.append(([*pytest, "tests/test_update.py", "-k", MIN_COPIER_TESTS], env))
    return steps


@contextlib.contextmanager
def _min_copier_beside(session: nox.Session) -> Iterator[None]:
    """_update_tests_on_min_copier in processes of their own while the block runs (the suite's
    two workers), their output printed after it. Run after the suite, the install and three
    tests took a minute of CI in which one of its two cores had nothing to do."""
    codes: list[int] = []

    def steps(log: IO[str]) -> None:
        for args, env in _min_copier_steps():
            log.write(f"$ python {shlex.join(args)}\n")
            log.flush()
            done = subprocess.run([Env.python, *args], cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, env={**os.environ, **Env.run_env,
                                  **env}, check=False)  # fmt: skip
            codes.append(done.returncode)
            if done.returncode:
                return

    with tempfile.TemporaryFile("w+") as log:
        thread = threading.Thread(target=steps, args=(log,))
        thread.start()
        try:
            yield
        finally:
            thread.join()
            log.seek(0)
            session.log(f"the update tests on copier {MIN_COPIER}, beside the suite:\n{log.read()}")
    if any(codes) or not codes:
        session.error(f"the update tests failed on copier {MIN_COPIER} (output above)")


@nox.session(venv_backend="none", requires=["env"])
def gpu(session: nox.Session) -> None:
    """The one command a GPU machine runs: the project's GPU checks in a render, with a summary.

    Renders GPU_RENDERS, one per task (`-- <entry> ...` picks others, `-- all` every one),
    then runs each render's own `nox --no-venv -s gpu` in this interpreter: the GPU test
    suite, compiled training (default and reduce-overhead), deterministic + compile, torchrun
    DDP with fp16 and accumulation, the profiler and `benchmark --quick`, then that session's
    summary table.
    Without a GPU it rehearses: each render's `gpu_rehearsal` runs the same commands on CPU
    with small sizes (the GPU tests collected, not run) and the tracker libraries hidden, as
    on a GPU machine that has only the packages the README lists. With a GPU that torch
    cannot use it fails, saying why.
    """
    # Exit 1 when a GPU is there but torch cannot use it. run_path: running the file itself
    # would put its folder (utils.py, data.py, ...) first on sys.path, shadowing real modules.
    probe = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
    report = str(run_python(session, "-c", probe, CUDA_CHECK, silent=True)).strip()
    session.log(report)
    rehearse = report.startswith(NO_CUDA)
    if rehearse:
        session.log("no CUDA: rehearsing every GPU command on CPU instead (gpu_rehearsal)")
    if session.posargs == ["all"]:
        chosen = MATRIX
    else:
        chosen = _selected(session) if session.posargs else {n: MATRIX[n] for n in GPU_RENDERS}
    projects = {name: _render(session, BUILD / "gpu" / name, a) for name, a in chosen.items()}
    if rehearse:
        results = _rehearse(session, projects)
    else:
        results = {}
        for name, project in projects.items():
            session.chdir(project)
            try:  # the render's own session, in this interpreter (--no-venv: sys.executable)
                run_python(session, "-m", "nox", "--no-venv", "-s", "gpu")
                results[name] = "ok"
            except CommandFailed:
                results[name] = "FAILED"
    session.log("GPU checks per render: " + ", ".join(f"{n} {r}" for n, r in results.items()))
    if "FAILED" in results.values():
        failed = [name for name, result in results.items() if result != "ok"]
        session.error(f"GPU checks failed in: {', '.join(failed)} (summary tables above)")


def _rehearse(session: nox.Session, projects: dict[str, Path]) -> dict[str, str]:
    """Each render's `nox --no-venv -s gpu_rehearsal`, side by side, one torch thread each
    (most of each step is starting Python and importing torch, which one core serves); each
    log is printed when its run ends."""
    env = {**os.environ, **Env.run_env, "PYTHONPATH": str(_hidden_extras())}
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [Env.python, "-m", "nox", "--no-venv", "-s", "gpu_rehearsal"]
    with contextlib.ExitStack() as stack:
        running = {}
        for name, project in projects.items():
            log = stack.enter_context((project.parent / f"{name}.log").open("w+"))
            running[name] = (subprocess.Popen(command, cwd=project, env=env, stdout=log,
                                              stderr=subprocess.STDOUT), log)  # fmt: skip
        results = {}
        for name, (process, log) in running.items():
            code = process.wait()
            log.seek(0)
            session.log(f"{name}: `nox --no-venv -s gpu_rehearsal` said:\n{log.read()}")
            results[name] = "ok" if code == 0 else "FAILED"
    return results


# The generated projects' optional libraries, which the README's list for a GPU machine leaves
# out: the rehearsal hides them, so a GPU command that needs one fails here as it would there.
HIDDEN_EXTRAS = ["wandb", "mlflow", "tensorboard", "optuna"]


def _hidden_extras() -> Path:
    """A folder that, first on PYTHONPATH, makes each of HIDDEN_EXTRAS fail to import."""
    folder = BUILD / "gpu" / "hidden-extras"
    for name in HIDDEN_EXTRAS:
        (folder / name).mkdir(parents=True, exist_ok=True)
        message = f"{name} is hidden by the GPU rehearsal: the README does not list it"
        (folder / name / "__init__.py").write_text(f"raise ModuleNotFoundError({message!r})\n")
    return folder


@nox.session(venv_backend="none", requires=["env"])
def lint(session: nox.Session) -> None:
    """ruff over tests/, noxfile.py and the template's plain .py files, then every render."""
    folders = [ROOT] + [_render(session, BUILD / "lint" / n, a) for n, a in MATRIX.items()]
    # Every folder is checked before failing, so one run shows every problem.
    failed = [str(folder) for folder in folders if not _ruff_passes(session, folder)]
    if failed:
        session.error(f"ruff found problems in: {', '.join(failed)}")


@nox.session(venv_backend="none", requires=["env"])
def typecheck(session: nox.Session) -> None:
    """mypy over the noxfile and tests/, then over every render with the render's settings."""
    # Renders are checked for the running Python, as the matrix tests them. Analysing torch is
    # the slow part (about 55 s; a render's own code then takes seconds), and mypy uses one
    # core: the template's own files and the first render run side by side, then the first
    # render's cache (torch analysed) is copied so the other renders run two at a time.
    version = ["--python-version", run_python(session, "-c", PY_VERSION, silent=True).strip()]
    renders = [_render(session, BUILD / "typecheck" / n, a) for n, a in MATRIX.items()]
    caches = [BUILD / "mypy_cache" / str(lane) for lane in range(2)]
    for cache in caches:
        shutil.rmtree(cache, ignore_errors=True)
    first = _mypy_side_by_side(session, [(ROOT, caches[0], []), (renders[0], caches[1], version)])
    shutil.rmtree(caches[0])
    shutil.copytree(caches[1], caches[0])
    lanes = [(folder, caches[i % 2], version) for i, folder in enumerate(renders[1:])]
    failed = first
    for i in range(0, len(lanes), 2):
        failed += _mypy_side_by_side(session, lanes[i : i + 2])
    if failed:
        session.error(f"mypy found problems in: {', '.join(failed)}")


def _mypy_side_by_side(session: nox.Session, jobs: list[tuple[Path, Path, list[str]]]) -> list[str]:
    """mypy in each (folder, cache, arguments) at once, from inside the folder (its
    pyproject.toml holds its [tool.mypy] settings); each output is printed when all end.
    Returns the folders where mypy failed."""
    env = {**os.environ, **Env.run_env}
    with contextlib.ExitStack() as stack:
        running = []
        for folder, cache, args in jobs:
            log = stack.enter_context(tempfile.TemporaryFile("w+"))
            command = [Env.python, "-m", "mypy", "--cache-dir", str(cache), *args]
            process = subprocess.Popen(command, cwd=folder, env=env, stdout=log,
                                       stderr=subprocess.STDOUT)  # fmt: skip
            running.append((folder, process, log))
        failed = []
        for folder, process, log in running:
            code = process.wait()
            log.seek(0)
            session.log(f"mypy in {folder}:\n{log.read().rstrip()}")
            if code:
                failed.append(str(folder))
    return failed


@nox.session(venv_backend="none", requires=["env"])
def docs(session: nox.Session) -> None:
    """Build the documentation site strictly: a broken link, anchor or missing page fails."""
    session.chdir(ROOT)
    run_python(session, "-m", "mkdocs", "build", "--strict", "--site-dir", str(BUILD / "site"))
    session.log(f"site: {BUILD / 'site' / 'index.html'}")


def _ruff_passes(session: nox.Session, folder: Path) -> bool:
    # From inside the folder, so ruff uses that folder's pyproject.toml (a render's own rules).
    session.chdir(folder)
    passed = True
    for command in (["check", "."], ["format", "--check", "."]):
        try:
            run_python(session, "-m", "ruff", *command)
        except CommandFailed:
            passed = False
    return passed
