"""One way to install torch for every environment the template makes (issue 56).

The rule lives in the generated projects' noxfile (template/noxfile.py: `torch_source`,
`install_torch`, `pip_config_for_uv`); this repository's noxfile (through nox_env.py) executes
it from there and the user-install test calls it, so the template's `env` session, the
environment that tests/test_user_install.py builds as the generated README says, a generated
project's nox sessions and its CI (which runs those sessions) take torch the same way. Where
PyTorch's index cannot be reached, each falls back to the configured package indexes with one
line: tested for real below, with PyTorch's index made unreachable through a proxy that refuses
every connection, while the configured indexes and PyPI are reached directly.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from nox.command import CommandFailed

from helpers import ROOT, render, run
from test_tooling import load_module

NOXFILE = load_module(ROOT / "noxfile.py", "template_repo_noxfile_torch")
RULE = NOXFILE.TORCH_RULE
PROJECT_NOXFILE = ROOT / "template" / "noxfile.py"
TORCH = f"torch=={importlib.metadata.version('torch')}"
# The words of the one fallback line.
FELL_BACK = re.compile(r"torch from PyTorch's index failed .* configured package indexes")


def _section(text: str) -> str:
    start = text.index("# ---- Which torch, and from where: the one rule")
    return text[start : text.index("# ---- End of the torch rule", start)]


def test_the_rule_is_the_generated_noxfiles_own_code() -> None:
    """This repository's environments run the generated noxfile's functions, not a copy."""
    for name in ("torch_source", "install_torch", "pip_config_for_uv"):
        assert getattr(RULE, name).__code__.co_filename == str(PROJECT_NOXFILE), name
    assert "def install_torch" in _section(PROJECT_NOXFILE.read_text())


def test_nothing_else_chooses_torchs_source() -> None:
    """No file of the template keeps a rule of its own: PyTorch's index, uv's torch backend and
    TORCH_BACKEND's meaning appear only in the rule (the generated CI's pip-only job is the
    README's own pip line, which is the user's command, not an environment the template makes).
    """
    rule = _section(PROJECT_NOXFILE.read_text())
    own = re.compile(r"UV_TORCH_BACKEND|--torch-backend|PYTORCH_INDEX|download\.pytorch\.org")
    checked = [
        ROOT / "noxfile.py",
        ROOT / "nox_env.py",
        ROOT / ".ci" / "run",
        *sorted((ROOT / "tests").glob("*.py")),
    ]
    checked += [*sorted((ROOT / "template").rglob("*.py")), PROJECT_NOXFILE]
    for path in checked:
        if path == Path(__file__):
            continue
        text = path.read_text()
        if path == PROJECT_NOXFILE:
            text = text.replace(rule, "")
        if path.suffix == ".py":  # what the code does, not what its module docstring says
            text = text.replace(ast.get_docstring(ast.parse(text), clean=False) or "", "")
        assert not own.search(text), f"{path.relative_to(ROOT)} chooses torch's source itself"
    assert "TORCH_BACKEND" not in (ROOT / ".ci" / "run").read_text().replace(
        "TORCH_BACKEND's default", ""
    ), ".ci/run sets nothing a newcomer would not set"
    workflows = ROOT / "template" / "{% if github_actions %}.github{% endif %}" / "workflows"
    text = (workflows / "ci.yml.jinja").read_text()
    assert "TORCH_BACKEND:" not in text, "the generated CI takes torch as its developers do"
    assert "TORCH_BACKEND" not in str(yaml.safe_load((ROOT / ".github/workflows/ci.yml").open()))


TORCH_CASES = [
    # backend, installer, nvidia-smi found, expected (arguments, environment)
    ("auto", "uv", False, ([], {"UV_TORCH_BACKEND": "auto"})),
    ("cu128", "uv", True, ([], {"UV_TORCH_BACKEND": "cu128"})),
    ("auto", "virtualenv", False, (["--index-url", "https://download.pytorch.org/whl/cpu"], {})),
    ("auto", "virtualenv", True, ([], {})),  # PyPI's Linux wheel is the CUDA one
    ("cu128", "virtualenv", False, (["--index-url", "https://download.pytorch.org/whl/cu128"], {})),
    ("none", "uv", False, ([], {})),  # the configured indexes decide (a mirror, a wheel folder)
    ("none", "virtualenv", False, ([], {})),
]


@pytest.mark.parametrize(("backend", "installer", "has_gpu", "expected"), TORCH_CASES)
def test_the_torch_wheel_is_chosen_on_purpose(
    monkeypatch: pytest.MonkeyPatch, backend: str, installer: str, has_gpu: bool, expected: Any
) -> None:
    """uv's torch backend under uv, PyTorch's CPU index for pip on a Linux machine without a
    GPU, and nothing at all with TORCH_BACKEND=none."""
    monkeypatch.setattr(RULE, "TORCH_BACKEND", backend)
    monkeypatch.setattr(RULE.sys, "platform", "linux")
    found = "/usr/bin/nvidia-smi" if has_gpu else None
    monkeypatch.setattr(RULE.shutil, "which", lambda name: found)
    assert RULE.torch_source(installer) == expected


PIP_CONFIG = """\
:env:.find-links='/opt/wheels'
global.constraint='/etc/pip/constraints.txt'
global.extra-index-url='file:///mirror/a/simple file:///mirror/b/simple'
global.find-links='/opt/wheels'
global.timeout='60'
"""


def test_uv_gets_the_wheel_sources_pip_is_configured_with(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_run(*args: Any, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args, 0, stdout=PIP_CONFIG, stderr="")

    monkeypatch.setattr(RULE.subprocess, "run", fake_run)
    assert RULE.pip_config_for_uv() == [
        "--find-links", "/opt/wheels",
        "--constraint", "/etc/pip/constraints.txt",
        "--extra-index-url", "file:///mirror/a/simple",
        "--extra-index-url", "file:///mirror/b/simple",
        "--index-strategy", "unsafe-best-match",
    ]  # fmt: skip


class _Session(SimpleNamespace):
    """What the noxfiles ask of a nox session; PyTorch's index is unreachable."""

    def __init__(self, bin_dir: Path, venv_backend: str = "uv") -> None:
        super().__init__(venv_backend=venv_backend, bin=str(bin_dir), posargs=[])
        self.installs: list[tuple[tuple[str, ...], dict[str, str] | None]] = []
        self.warnings: list[str] = []

    def install(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.installs.append((args, env))
        if env or any("download.pytorch.org" in arg for arg in args):
            raise CommandFailed("Failed to fetch: https://download.pytorch.org/whl/cpu/torch/")

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def run(self, *args: Any, **kwargs: Any) -> None:
        pass


@pytest.mark.parametrize("venv_backend", ["uv", "virtualenv"])
@pytest.mark.parametrize("backend", ["auto", "cpu"])
def test_the_template_environment_falls_back_only_under_auto(
    venv_backend: str, backend: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The `env` session (every template session runs in it): behind a proxy or a mirror the
    newcomer's first command failed at the torch install under the default, `auto`."""
    monkeypatch.setattr(RULE, "TORCH_BACKEND", backend)
    monkeypatch.setattr(RULE.shutil, "which", lambda name: None)  # no nvidia-smi
    monkeypatch.setattr(NOXFILE.Env, "run_env", {})
    session = _Session(tmp_path / "bin", venv_backend)
    if backend != "auto":  # chosen on purpose: its failure is the answer
        with pytest.raises(CommandFailed):
            NOXFILE.env.func(session)
        assert session.warnings == []
        return
    NOXFILE.env.func(session)  # nox's decorator keeps the function as `.func`
    (first, _), (second, no_env), (packages, _) = session.installs
    assert first[0] == second[0] == NOXFILE.TORCH and "copier>=9.13,<10" in packages
    assert not no_env and not any("download.pytorch.org" in arg for arg in second)
    (line,) = session.warnings
    assert FELL_BACK.search(line) and "TORCH_BACKEND=none" in line


def _unreachable_pytorch_index() -> dict[str, str]:
    """Proxy settings under which PyTorch's index cannot be reached: every proxied connection
    goes to a closed port on this machine, and the hosts that pip is configured with, and
    PyPI's, are reached directly."""
    hosts = {"pypi.org", "files.pythonhosted.org"}
    args = RULE.pip_config_for_uv()
    for flag, value in zip(args[::2], args[1::2], strict=True):
        if flag.endswith("url"):
            hosts.add(urlsplit(value).hostname or "")
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens there
    return {
        **{name: closed for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy")},
        **{name: ",".join(sorted(h for h in hosts if h)) for name in ("NO_PROXY", "no_proxy")},
        "ALL_PROXY": "",
        "all_proxy": "",
    }


@pytest.fixture(scope="module")
def project() -> Path:
    folder = ROOT / "build" / "torch-install" / os.environ.get("PYTEST_XDIST_WORKER", "")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return render(folder / "project", {"project_name": "torch-install"})


def test_a_generated_projects_sessions_fall_back_for_real(project: Path) -> None:
    """`nox -s typecheck --install-only` in a fresh render, with PyTorch's index unreachable:
    one line says so, and the session's environment gets torch from the configured indexes
    (uv is handed pip's configuration, so it is the same wheel pip would take)."""
    env = {**_unreachable_pytorch_index(), "TORCH_SPEC": TORCH, "TORCH_BACKEND": "auto"}
    result = run([sys.executable, "-m", "nox", "-s", "typecheck", "--install-only"], project,
                 env=env, timeout=900)  # fmt: skip
    said = result.stdout + result.stderr
    assert len(FELL_BACK.findall(said)) == 1, said[-4000:]
    python = project / ".nox" / "typecheck" / "bin" / "python"
    version = run([python, "-c", "import torch; print(torch.__version__)"], project).stdout
    assert version.strip() == TORCH.split("==")[1]


def test_the_user_install_environment_falls_back_for_real(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The environment tests/test_user_install.py builds as a generated README says."""
    user_install: ModuleType = load_module(
        ROOT / "tests" / "test_user_install.py", "user_install_torch"
    )
    for name, value in _unreachable_pytorch_index().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(user_install.TORCH_RULE, "TORCH_BACKEND", "auto")
    env = user_install.UserEnv(tmp_path)
    (line,) = env.said
    assert FELL_BACK.search(line) and env.install_env == {}
    version = run([env.python, "-c", "import torch; print(torch.__version__)"], tmp_path)
    assert version.stdout.strip() == TORCH.split("==")[1]
