"""Fresh projects in the environment their README sets up, which has no optional extra.

The matrix installs every render into the one shared environment, and that environment holds
every tracker and the sweep library, so a generated test that needs an extra without skipping,
or a mypy setting that needs one installed, passes there and fails for a user. A user follows
the generated README instead: the CPU build of torch, then its `pip install -e ".[test]"` line
(read from the rendered README here), and an editor or pre-commit runs mypy with the `dev`
dependency group. Here one image and one language-model render with the default answers (but
their names, so that both install side by side) are installed that way into a virtual
environment of their own; each runs its fast suite, then mypy with the `dev` group added.

The environment is made with uv when it is installed (`.ci/run` installs it: torch is linked
from uv's cache in seconds) and with venv and pip otherwise. torch is the version the shared
environment has, installed by the one rule every environment of the template uses
(`install_torch` in template/noxfile.py): TORCH_BACKEND's source, and where PyTorch's index
cannot be reached under the default `auto`, the configured package indexes with one line.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from nox.command import CommandFailed

from helpers import ROOT, render, run
from matrix import MATRIX, PARTIAL_SUITES
from test_tooling import load_module

pytestmark = pytest.mark.matrix
RENDERS = {"image": {"project_name": "user-image"}, "lm": {"project_name": "user-lm", "task": "lm"}}
README_INSTALL = re.compile(r'^pip install -e "(\.\[[^"\]]*\])"$', re.M)
NOXFILE = load_module(ROOT / "noxfile.py", "template_repo_noxfile_user_install")
TORCH_RULE = NOXFILE.TORCH_RULE
# The extras' libraries (trackers, sweeps, plots, export --format onnx) and the `browser`
# group's Playwright, none of which `.[test]` may bring.
EXTRAS = [*NOXFILE.HIDDEN_EXTRAS, "matplotlib", "onnxruntime", "playwright"]


class UserEnv:
    """A virtual environment and how to install into it."""

    def __init__(self, folder: Path) -> None:
        self.venv = folder / "venv"
        self.python = self.venv / "bin" / "python"
        self.said: list[str] = []  # what the torch rule said (its fallback line)
        self.install_env: dict[str, str] = {}  # the torch rule's choice, once torch is in
        uv = shutil.which("uv")
        self.backend = "uv" if uv else "virtualenv"
        if uv:
            run([uv, "venv", "--quiet", "--python", sys.executable, self.venv], folder)
            self.installer = [uv, "pip", "install", "--quiet", "--python", str(self.python)]
            # Bytecode written at install, as pip writes it (uv does not unless asked, and
            # CI's PYTHONDONTWRITEBYTECODE keeps the processes from writing it).
            self.installer += [*TORCH_RULE.pip_config_for_uv(), "--compile-bytecode"]
        else:  # pip reads its own configuration; 25.1 installs dependency groups
            run([sys.executable, "-m", "venv", self.venv], folder)
            self.installer = [str(self.python), "-m", "pip", "install", "--quiet"]
            self.install(["pip>=25.1"], folder)
        torch = f"torch=={importlib.metadata.version('torch')}"
        self.install_env = TORCH_RULE.install_torch(
            lambda *args, env: self.install(list(args), folder, env=env),
            self.said.append,
            self.backend,
            spec=torch,
        )
        # What the commands see: this environment first on PATH, not the shared one, and
        # nothing of the shared one on PYTHONPATH (an empty value is ignored).
        shared = str(Path(sys.executable).parent)
        path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p != shared]
        self.env = {
            "PATH": os.pathsep.join([str(self.venv / "bin"), *path]),
            "VIRTUAL_ENV": str(self.venv),
            "PYTHONPATH": "",
            # The README's environment has no Playwright: the page's browser tests skip there,
            # as they do for a user, even where .ci/run requires them (REQUIRE_BROWSER=1).
            "REQUIRE_BROWSER": "",
        }

    def install(self, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        """Install with this environment's installer; CommandFailed (as a nox session's
        `install` raises) when it fails, so the torch rule can fall back."""
        command = [*self.installer, *args]
        result = run(command, cwd, env=self.install_env if env is None else env,
                     check=False, timeout=1200)  # fmt: skip
        if result.returncode != 0:
            print(result.stdout[-3000:], result.stderr[-3000:], sep="\n")  # what pytest shows
            raise CommandFailed(f"`{' '.join(command)}` exited {result.returncode}")


@pytest.fixture(scope="module")
def user_env() -> tuple[UserEnv, dict[str, Path]]:
    """The renders, installed as their README says, in build/user-install/[<xdist worker>]."""
    folder = ROOT / "build" / "user-install" / os.environ.get("PYTEST_XDIST_WORKER", "")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    projects = {name: render(folder / name, answers) for name, answers in RENDERS.items()}
    env = UserEnv(folder)
    for project in projects.values():
        (extras,) = README_INSTALL.findall((project / "README.md").read_text())
        assert extras == ".[test]", "a default render's README installs no optional extra"
        env.install(["-e", extras], project)
    return env, projects


# Answers that change no code path another render runs (tests/matrix.py): metadata, and the
# tracker, whose files the partial renders run themselves.
NO_CODE_ANSWERS = {"project_name", "python_version", "license", "github_actions", "tracker"}


def test_each_partial_render_has_the_code_of_a_render_here() -> None:
    """The matrix runs only the tracker's files of PARTIAL_SUITES' renders because the fast
    suites here run the rest of the same code: each must match a render here in every answer
    that reaches code (with copier.yml's defaults for what a render here leaves out)."""
    questions = yaml.safe_load((ROOT / "copier.yml").read_text())
    defaults = {
        k: v["default"] for k, v in questions.items() if isinstance(v, dict) and "default" in v
    }
    ours = [{**defaults, **answers} for answers in RENDERS.values()]
    for name in PARTIAL_SUITES:
        code = {k: v for k, v in MATRIX[name].items() if k not in NO_CODE_ANSWERS}
        task = code.get("task", defaults["task"])
        asked = {k: v for k, v in code.items() if k != "model" or task == "image"}
        assert any(all(o[k] == v for k, v in asked.items()) for o in ours), name


def test_the_readme_install_brings_no_optional_extra(user_env: Any) -> None:
    """Otherwise the tests below would prove nothing: the extras' libraries are absent."""
    env, _ = user_env
    probe = "import importlib.util as u, sys; print([m for m in sys.argv[1:] if u.find_spec(m)])"
    found = run([env.python, "-c", probe, *EXTRAS], ROOT, env=env.env).stdout
    assert found.strip() == "[]", f"installed with .[test]: {found}"


@pytest.mark.parametrize("name", RENDERS)
def test_the_fast_suite_passes_without_the_extras(user_env: Any, name: str) -> None:
    env, projects = user_env
    pytest_args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu and not slow"]
    run([env.python, *pytest_args], projects[name], env=env.env, timeout=1800)


@pytest.mark.parametrize("name", RENDERS)
def test_mypy_passes_with_the_dev_group_alone(user_env: Any, name: str) -> None:
    """After the suites (tests run in file order): the `dev` group adds mypy and ruff."""
    env, projects = user_env
    env.install(["--group", "dev"], projects[name])
    cache = ["--cache-dir", str(projects[name].parent / "mypy_cache")]  # torch analysed once
    run([env.python, "-m", "mypy", *cache], projects[name], env=env.env)
