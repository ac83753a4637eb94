"""A deliberately broken template makes the matrix fail: its checks can catch a bad template.

Each test copies the template repository into a temporary git repo, plants one bug, renders it
and applies the same check the matrix applies (install, then the project's CPU suite).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import check_project, copy_template_repo, render

PACKAGE_DIR = "template/src/{{ package_name }}"


@pytest.fixture
def broken_repo(tmp_path):
    repo = copy_template_repo(tmp_path / "template-repo")
    yield repo
    # The broken project was pip-installed by check_project: take it out of the environment.
    subprocess.run(
        [sys.executable, "-m", "pip", "uninstall", "--quiet", "--yes", "broken-project"],
        check=False,
        capture_output=True,
    )


def _commit(repo, message: str) -> None:
    subprocess.run(["git", "commit", "-qam", message], cwd=repo, check=True)


def test_a_syntax_error_in_a_rendered_module_fails_the_matrix(broken_repo, tmp_path):
    model = broken_repo / PACKAGE_DIR / "utils.py"
    model.write_text(model.read_text() + "\ndef broken(:\n    pass\n")
    _commit(broken_repo, "plant a syntax error")
    project = render(tmp_path / "project", {"project_name": "broken-project"}, src=broken_repo)
    with pytest.raises(pytest.fail.Exception, match="SyntaxError"):
        check_project(project, slow=False)


def test_a_jinja_error_in_a_template_file_fails_the_render(broken_repo, tmp_path):
    pyproject = broken_repo / "template" / "pyproject.toml.jinja"
    pyproject.write_text(pyproject.read_text() + "\n{% if license %}\n")  # no endif
    _commit(broken_repo, "plant an unclosed Jinja block")
    with pytest.raises(Exception, match="endif"):
        render(tmp_path / "project", {"project_name": "broken-project"}, src=broken_repo)
