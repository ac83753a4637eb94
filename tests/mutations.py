"""What the two mutation test modules share: a render to plant bugs in, one run of
tests/mutation_runner.py over a list of jobs, and what counts as a caught bug."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from helpers import ROOT

PACKAGE = "mutpkg"


def render_to_mutate(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """The template's working tree rendered with default answers and package `mutpkg`."""
    copier = pytest.importorskip("copier")
    destination = tmp_path_factory.mktemp(name) / "project"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a dirty working tree is rendered on purpose
        copier.run_copy(
            src_path=str(ROOT),
            dst_path=destination,
            defaults=True,
            vcs_ref="HEAD",
            data={"package_name": PACKAGE},
            unsafe=False,
            quiet=True,
        )
    return destination


def run_jobs(
    project: Path, jobs: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """Run the jobs (see tests/mutation_runner.py) and return its results by job name."""
    workdir = tmp_path_factory.mktemp("mutation-runs")
    (workdir / "jobs.json").write_text(json.dumps(jobs))
    subprocess.run(
        [sys.executable, str(ROOT / "tests" / "mutation_runner.py"), str(project),
         str(workdir / "jobs.json"), str(workdir / "results.json")],
        check=True,
        timeout=1800,
    )  # fmt: skip
    results: dict[str, dict[str, Any]] = json.loads((workdir / "results.json").read_text())
    return results


def caught(result: dict[str, Any]) -> bool:
    """Exit code 1 with a failed test: the bug was caught. 2 (a collection error) would mean the
    bug broke the import rather than the behaviour, and 5 that -k selected nothing."""
    return result["code"] == 1 and " failed" in result["output"]
