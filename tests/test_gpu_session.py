"""Both `nox -s gpu` sessions on a CPU machine: they skip without a GPU, FAIL when a GPU is
there but torch cannot use it (a fake `nvidia-smi` on PATH plays the GPU; torch here is the
CPU wheel), and the project's runs the interpreter that runs nox, not PATH's `python`."""

from __future__ import annotations

import importlib.util
import os
import subprocess
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
    """tyro (imported at startup by settings/parsing.py) went unchecked: the session started."""
    code, output = _nox(project if where == "project" else ROOT, hide="tyro", tmp=tmp_path)
    assert code != 0, output
    assert "lacks: tyro" in output and "--no-venv uses the python running nox" in output
    assert NO_CUDA not in output and "-m copier copy" not in output


class _Session:
    """What `_run_steps` asks of a nox session: runs each command, records the log."""

    def __init__(self) -> None:
        self.logs: list[str] = []

    def log(self, message: str) -> None:
        self.logs.append(message)

    def run(self, *command: str, env: dict[str, str], external: bool) -> None:
        subprocess.run(command, check=True, env={**os.environ, **env})

    def error(self, message: str) -> None:
        raise AssertionError(message)


def _project_noxfile():
    spec = importlib.util.spec_from_file_location(
        "project_noxfile", ROOT / "template" / "noxfile.py"
    )
    noxfile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(noxfile)
    return noxfile


def test_a_one_gpu_summary_names_the_multi_rank_checks_it_could_not_run(tmp_path, monkeypatch):
    """With one GPU every torchrun check starts one rank and passes without comparing ranks
    (GPU finding 10): the summary says what was not checked."""
    noxfile = _project_noxfile()
    one = "torch 2.13.0, CUDA build 12.8; 1 x NVIDIA H200 (sm_90, 139 GiB); driver 570; bf16 yes"
    assert noxfile._multi_rank_notes(one.replace("; 1 x", "; 2 x")) == []
    assert noxfile._multi_rank_notes(one.replace("; 1 x", "; 8 x")) == []
    (note,) = noxfile._multi_rank_notes(one)
    assert "DDP replicas" in note and "two or more GPUs" in note
    monkeypatch.chdir(tmp_path)
    session = _Session()
    noxfile._run_steps(session, one, sys.executable, {"ok": ["-c", "pass"]}, {}, notes=[note])
    assert session.logs[-1].endswith(note) and "ok" in session.logs[-1]


def test_a_second_gpu_session_starts_from_fresh_run_folders(tmp_path, monkeypatch):
    """The steps write fixed run folders without --resume, so the second `nox -s gpu` in a
    project was refused by the run-dir guard at every training step, and `generate` passed on
    the first session's last.pt. Each session now removes the previous one's runs first."""
    noxfile = _project_noxfile()
    monkeypatch.chdir(tmp_path)
    stale = tmp_path / "runs" / "gpu-check" / "compile-default" / "checkpoints" / "last.pt"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"the previous session's checkpoint")
    check = "import pathlib, sys; sys.exit(pathlib.Path(sys.argv[1]).exists())"
    steps = {"no stale checkpoint": ["-c", check, str(stale)]}
    noxfile._run_steps(_Session(), "test", sys.executable, steps, {})
    assert not (tmp_path / "runs" / "gpu-check").exists()
