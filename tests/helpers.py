"""Helpers for the template's own tests: render, run a command, make temporary git repos.

Every render goes through copier's Python API with `unsafe=False`, so a template feature that
needs `--trust` fails here first. Rendering `vcs_ref="HEAD"` of the repository includes the
working tree's uncommitted changes (copier commits them into its temporary clone), so the tests
check what a developer is about to commit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import copier
import pytest

ROOT = Path(__file__).resolve().parents[1]
# Matrix renders live at a fixed place (not a pytest temp dir) because they are pip-installed
# in editable mode: the install must keep pointing at an existing folder after the run.
MATRIX_DIR = ROOT / "build" / "matrix"

# Commits made by the tests (temporary template repos, rendered projects) need an identity,
# and CI machines often have none configured.
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "copier-pytorch tests",
    "GIT_AUTHOR_EMAIL": "tests@example.com",
    "GIT_COMMITTER_NAME": "copier-pytorch tests",
    "GIT_COMMITTER_EMAIL": "tests@example.com",
}


def render(
    dest: Path, answers: dict[str, Any] | None = None, *, src: Path = ROOT, vcs_ref: str = "HEAD"
) -> Path:
    """Render the template non-interactively; unanswered questions take their defaults."""
    copier.run_copy(
        str(src),
        str(dest),
        data=dict(answers or {}),
        vcs_ref=vcs_ref,
        defaults=True,
        unsafe=False,
        quiet=True,
    )
    return dest


def run(
    cmd: Sequence[str | Path],
    cwd: Path,
    *,
    check: bool = True,
    env: dict[str, str] | None = None,
    timeout: float = 900,
) -> subprocess.CompletedProcess[str]:
    """Run a command and return its result; on an unexpected exit code, fail with its output."""
    result = subprocess.run(
        [str(part) for part in cmd],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and result.returncode != 0:
        pytest.fail(
            f"`{' '.join(map(str, cmd))}` in {cwd} exited {result.returncode}\n"
            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}",
            pytrace=False,
        )
    return result


def git(cwd: Path, *args: str) -> str:
    return run(["git", *args], cwd).stdout.strip()


def git_init_commit(path: Path, message: str = "initial") -> None:
    """Make `path` a git repository with everything in it committed."""
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", message)


def copy_template_repo(dest: Path) -> Path:
    """Copy the template repository's working tree (what `git` would see, uncommitted changes
    and new files included, ignored files left out) into `dest` as a fresh one-commit repo."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not copied
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    git_init_commit(dest, "template")
    return dest


def pip_install_editable(project: Path, *, python_version: str | None = None) -> None:
    """Install a rendered project into the running environment, without touching its
    dependencies (they are already there: torch is installed once, for every render).

    A render for a newer minimum Python than the running one is installed anyway: only that
    Python exists here, and the answer changes nothing but metadata and lint settings.
    """
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    if python_version and tuple(map(int, python_version.split("."))) > sys.version_info[:2]:
        pip.append("--ignore-requires-python")
    run([*pip, "-e", project], project)


def run_project_suite(
    project: Path, *args: str, markers: str = "not gpu and not slow", check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run a rendered project's own pytest suite in a subprocess, from the project's folder.
    A hang still ends: 30 minutes, twice what the whole slow suite takes beside the other
    worker on CI's two cores."""
    return run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", markers, *args],
        project,
        check=check,
        timeout=1800,
    )


def check_project(
    project: Path, *, slow: bool, python_version: str | None = None, tests: Sequence[str] = ()
) -> None:
    """What the matrix asks of a rendered project: it installs and its CPU suite (or the named
    test files of it) passes."""
    pip_install_editable(project, python_version=python_version)
    markers = "not gpu" if slow else "not gpu and not slow"
    run_project_suite(project, *tests, markers=markers)


# Lines for the end of the pytest run ("N/M planted bugs caught"), from the mutation tests.
KILL_RATES: list[str] = []
