"""The development tooling of the template and of every render: one ruff pin everywhere, the
hygiene hooks, dependency groups the nox sessions can install, the torch wheel chosen on
purpose, and a hardened generated CI workflow."""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import sys
import warnings
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import nox
import pytest
import yaml

from helpers import ROOT, run
from matrix import MATRIX

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

NAMES = list(MATRIX)
WITH_ACTIONS = [name for name in NAMES if MATRIX[name]["github_actions"]]
HYGIENE_HOOKS = {
    "check-added-large-files",
    "check-merge-conflict",
    "check-yaml",
    "check-toml",
    "end-of-file-fixer",
    "trailing-whitespace",
}


def pyproject(project: Path) -> dict[str, Any]:
    return tomllib.loads((project / "pyproject.toml").read_text())


def pin(requirements: list[Any], tool: str) -> str:
    (found,) = [r for r in requirements if isinstance(r, str) and r.startswith(f"{tool}==")]
    return found.split("==")[1]


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():  # both noxfiles register sessions named `lint`, `gpu`...
        warnings.simplefilter("ignore", FutureWarning)
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def root_noxfile() -> ModuleType:
    return load_module(ROOT / "noxfile.py", "template_repo_noxfile")


def project_noxfile(project: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.chdir(project)  # it reads ./pyproject.toml, as nox runs it from there
    return load_module(project / "noxfile.py", "project_noxfile")


@pytest.mark.parametrize("name", NAMES)
def test_ruff_is_pinned_once_and_the_same_everywhere(rendered, root_noxfile, name):
    project = rendered[name]
    groups = pyproject(project)["dependency-groups"]
    ruff, mypy = pin(groups["lint"], "ruff"), pin(groups["typecheck"], "mypy")
    config = yaml.safe_load((project / ".pre-commit-config.yaml").read_text())
    revs = {repo["repo"].rsplit("/", 1)[-1]: repo["rev"] for repo in config["repos"]}
    assert revs["ruff-pre-commit"] == f"v{ruff}", "pre-commit's ruff differs from the lint group"
    # The template repository lints and type-checks the renders with the same versions.
    assert f"ruff=={ruff}" in root_noxfile.ENV_PACKAGES
    assert f"mypy=={mypy}" in root_noxfile.ENV_PACKAGES


@pytest.mark.parametrize("name", NAMES)
def test_pre_commit_runs_the_hygiene_hooks(rendered, name):
    config = yaml.safe_load((rendered[name] / ".pre-commit-config.yaml").read_text())
    hook_ids = {hook["id"] for repo in config["repos"] for hook in repo["hooks"]}
    assert hook_ids >= HYGIENE_HOOKS | {"ruff-check", "ruff-format"}
    assert all(re.fullmatch(r"v\d+\.\d+\.\d+", repo["rev"]) for repo in config["repos"])


def _install_calls(noxfile: Path) -> set[str]:
    """Group names the noxfile installs: `_install(session, "x")` and `_groups("x")`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(noxfile.read_text())):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("_install", "_groups"):
            names |= {str(a.value) for a in node.args if isinstance(a, ast.Constant)}
    return names


@pytest.mark.parametrize("name", NAMES)
def test_nox_sessions_install_dependency_groups_that_exist(rendered, name):
    data = pyproject(rendered[name])
    used = _install_calls(rendered[name] / "noxfile.py")
    assert {"test", "lint", "typecheck"} <= used
    for group in used | {"dev"}:  # `uv sync` installs `dev`
        assert nox.project.dependency_groups(data, group), group
    # pip older than 25.1 cannot install groups: the test extra stays, with the same pins.
    assert data["project"]["optional-dependencies"]["test"] == data["dependency-groups"]["test"]


@pytest.mark.parametrize("name", NAMES)
def test_the_tests_session_installs_the_chosen_trackers_extra(rendered, monkeypatch, name):
    """`nox -s tests` in a project made with tracker=mlflow installs `.[mlflow]`, so MLflow's
    test runs there instead of skipping; with tracker=none, no tracker's package."""
    module = project_noxfile(rendered[name], monkeypatch)
    installed: list[tuple[str, ...]] = []
    session = SimpleNamespace(
        venv_backend="virtualenv",
        posargs=["--collect-only"],
        install=lambda *args, **kwargs: installed.append(args),
        run=lambda *args, **kwargs: None,
        warn=print,
    )
    module.tests.func(session)  # nox's decorator keeps the function as `.func`
    (project,) = [args for args in installed if args[:1] == ("-e",)]
    tracker = MATRIX[name]["tracker"]
    # And the server's extra with Playwright, so serve's tests and its page's run, not skip.
    optional = pyproject(rendered[name])["project"]["optional-dependencies"]
    extras = ([tracker] if tracker != "none" else []) + (["serve"] if "serve" in optional else [])
    assert project[1] == (f".[{','.join(extras)}]" if extras else ".")
    assert any(arg.startswith("playwright") for arg in project), project


@pytest.mark.parametrize("name", WITH_ACTIONS)
def test_generated_workflow_is_hardened(rendered, name):
    project, answers = rendered[name], MATRIX[name]
    workflow = yaml.safe_load((project / ".github" / "workflows" / "ci.yml").read_text())
    assert workflow["permissions"] == {"contents": "read"}
    assert "github.ref" in workflow["concurrency"]["group"]
    assert workflow["concurrency"]["cancel-in-progress"] is True
    for job_name, job in workflow["jobs"].items():
        assert job.get("timeout-minutes"), f"{job_name} has no timeout"
        checkout = [s for s in job["steps"] if s.get("uses", "").startswith("actions/checkout")]
        assert checkout and checkout[0]["with"]["persist-credentials"] is False, job_name

    tests = workflow["jobs"]["tests"]
    assert tests["strategy"]["matrix"]["python"] == [answers["python_version"], "3.13"]
    (uv,) = [s for s in tests["steps"] if s.get("uses", "").startswith("astral-sh/setup-uv")]
    assert uv["with"]["enable-cache"] is True
    assert "TORCH_BACKEND" not in tests["env"], "torch comes as it does for its developers"
    # The sessions a developer runs with a bare `nox`: nothing else, nothing fewer.
    (command,) = [s["run"] for s in tests["steps"] if "nox" in s.get("run", "")]
    sessions = command.split(" -s ", 1)[1].split()
    tree = ast.parse((project / "noxfile.py").read_text())
    (defaults,) = [
        ast.literal_eval(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "nox.options.sessions"
    ]
    assert sessions == defaults


def test_generated_lint_session_builds_its_environment_with_uv(rendered, tmp_path):
    """`nox -s lint` in a fresh render: a uv environment with the pinned ruff of the lint
    group (a few seconds with uv's cache; only ruff is installed, no torch)."""
    if importlib.util.find_spec("uv") is None and shutil.which("uv") is None:
        pytest.skip("uv is not installed")
    project = shutil.copytree(rendered[NAMES[0]], tmp_path / "project")
    # Whether ruff then finds problems is the lint session's business (tests/test_docs.py and
    # the template's own lint session run it): this test is about the environment.
    result = run([sys.executable, "-m", "nox", "-s", "lint"], project, check=False)
    assert "Creating virtual environment (uv)" in result.stdout + result.stderr, result.stderr
    ruff = pin(pyproject(project)["dependency-groups"]["lint"], "ruff")
    version = run([project / ".nox" / "lint" / "bin" / "ruff", "--version"], project).stdout
    assert version.split() == ["ruff", ruff]


CONFLICT_MARKER = re.compile(r"^(<<<<<<< |=======$|>>>>>>> )", re.M)


@pytest.mark.parametrize("name", NAMES)
def test_every_render_passes_the_hygiene_hooks(rendered, name):
    """What the hooks check, done here (they are fetched from GitHub, which tests cannot
    reach): a fresh project must not fail its own first commit."""
    project = rendered[name]
    config = yaml.safe_load((project / ".pre-commit-config.yaml").read_text())
    (large,) = [
        h for r in config["repos"] for h in r["hooks"] if h["id"] == "check-added-large-files"
    ]
    max_kb = int(large["args"][0].split("=")[1])
    for path in sorted(p for p in project.rglob("*") if p.is_file() and ".git" not in p.parts):
        relative, data = path.relative_to(project).as_posix(), path.read_bytes()
        assert len(data) <= max_kb * 1024, f"{relative} is over {max_kb} KB"
        text = data.decode()
        assert not text or (text.endswith("\n") and not text.endswith("\n\n")), relative
        assert not re.search(r"[ \t]+$", text, re.M), f"{relative}: trailing whitespace"
        assert not CONFLICT_MARKER.search(text), f"{relative}: a conflict marker"
        if path.suffix in (".yml", ".yaml"):
            list(yaml.safe_load_all(text))
        if path.suffix == ".toml":
            tomllib.loads(text)
