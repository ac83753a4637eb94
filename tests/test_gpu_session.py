"""Both `nox -s gpu` sessions on a CPU machine: they skip without a GPU, FAIL when a GPU is
there but torch cannot use it (a fake `nvidia-smi` on PATH plays the GPU; torch here is the
CPU wheel), and the project's runs the interpreter that runs nox, not PATH's `python`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT, run
from matrix import SLOW_RENDER

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or Path("/dev/nvidia0").exists(),
    reason="simulates GPU machines on a machine without one",
)
NO_CUDA = "no CUDA device: GPU checks skipped"
BROKEN = "this machine has a GPU (nvidia-smi at"


@pytest.fixture(scope="module")
def project(rendered) -> Path:
    return rendered[SLOW_RENDER]  # the session's matrix renders: no render of its own


def _bin(folder: Path, name: str, script: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return folder


def _nox(cwd: Path, *extra_path: Path, hide: str = "", tmp: Path | None = None) -> tuple[int, str]:
    # The interpreter running these tests has torch and nox; PATH keeps it reachable too.
    path = [*map(str, extra_path), str(Path(sys.executable).parent), os.environ["PATH"]]
    env = {"PATH": os.pathsep.join(path)}
    if hide and tmp:  # a module made unimportable in every python the session starts
        (tmp / "hide").mkdir()
        (tmp / "hide" / "sitecustomize.py").write_text(
            f"import sys\nsys.modules[{hide!r}] = None\n"
        )
        env["PYTHONPATH"] = str(tmp / "hide")
    result = run(
        [sys.executable, "-m", "nox", "--no-venv", "-s", "gpu"],
        cwd,
        check=False,
        env=env,
        timeout=600,
    )
    return result.returncode, result.stdout + result.stderr


def test_the_project_session_skips_without_a_gpu_and_ignores_the_python_on_path(project, tmp_path):
    """Under --no-venv the session ran PATH's `python`: here a broken one comes first."""
    wrong = _bin(tmp_path / "wrong", "python", "echo 'not this python' >&2; exit 7")
    code, output = _nox(project, wrong)
    assert code == 0, output
    assert NO_CUDA in output and "not this python" not in output


def test_the_project_session_fails_on_a_gpu_machine_whose_torch_has_no_cuda(project, tmp_path):
    fake = _bin(tmp_path / "gpu", "nvidia-smi", "echo 550.54.15")
    code, output = _nox(project, fake)
    assert code != 0, output
    assert BROKEN in output and "CPU-only build" in output
    assert NO_CUDA not in output


def test_the_template_session_fails_on_a_gpu_machine_whose_torch_has_no_cuda(tmp_path):
    fake = _bin(tmp_path / "gpu", "nvidia-smi", "echo 550.54.15")
    code, output = _nox(ROOT, fake)
    assert code != 0, output
    assert BROKEN in output and "CPU-only build" in output
    assert "-m copier copy" not in output  # it stopped before rendering anything


@pytest.mark.parametrize("where", ["project", "template"])
def test_no_venv_names_a_missing_dependency_before_running_anything(project, tmp_path, where):
    """tyro (imported at startup by config_parsing.py) went unchecked: the session started."""
    code, output = _nox(project if where == "project" else ROOT, hide="tyro", tmp=tmp_path)
    assert code != 0, output
    assert "lacks: tyro" in output and "--no-venv uses the python running nox" in output
    assert NO_CUDA not in output and "-m copier copy" not in output
