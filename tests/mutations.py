"""What the mutation test modules share: a render to plant bugs in, one run of
tests/mutation_runner.py over a list of jobs, and what counts as a caught bug."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from helpers import KILL_RATES, ROOT

PACKAGE = "mutpkg"


class Mutation(NamedTuple):
    name: str
    module: str  # file under src/<package>/
    edits: tuple[tuple[str, str], ...]  # (old, new), applied in order
    tests: str  # the generated test file that must catch it
    select: str | None = None  # a -k expression: only the tests that should catch it
    timeout: int = 240


def bug(name: str, module: str, old: str, new: str, tests: str, select: str | None = None):
    """A one-edit mutation."""
    return Mutation(name, module, ((old, new),), tests, select)


def missing_targets(source: str, mutation: Mutation) -> str | None:
    for old, new in mutation.edits:
        count = source.count(old)
        if count != 1:
            what = "not found" if count == 0 else f"found {count} times, not once"
            return f"mutation target {what}: {mutation.module}: {old!r}"
        source = source.replace(old, new)
    return None


def run_mutations(
    request: pytest.FixtureRequest,
    project: Path,
    mutations: list[Mutation],
    tmp_path_factory: pytest.TempPathFactory,
    label: str,
) -> dict[str, dict[str, Any]]:
    """Run every mutation this pytest session selected (one runner, two at a time); record
    the kill rate under `label` for the summary."""
    selected = {
        item.callspec.params["mutation"].name
        for item in request.session.items
        if hasattr(item, "callspec") and "mutation" in item.callspec.params
    }
    source_dir = project / "src" / PACKAGE
    results: dict[str, dict[str, Any]] = {}
    jobs = []
    for mutation in mutations:
        if mutation.name not in selected:
            continue
        module = source_dir / mutation.module
        problem = (
            f"mutation target not found: {mutation.module}: no such module"
            if not module.is_file()
            else missing_targets(module.read_text(encoding="utf-8"), mutation)
        )
        if problem:
            results[mutation.name] = {"code": -1, "problem": problem, "output": ""}
            continue
        job = mutation._asdict()
        job["tests"] = [f"tests/{mutation.tests}"]
        jobs.append(job)
    results.update(run_jobs(project, jobs, tmp_path_factory))
    hits = sum(caught(result) for result in results.values())
    KILL_RATES.append(
        f"{label}: {hits}/{len(results)} planted bugs caught by the generated "
        f"suite ({100 * hits / max(len(results), 1):.0f}%)"
    )
    return results


def render_to_mutate(
    tmp_path_factory: pytest.TempPathFactory, name: str, answers: dict[str, Any] | None = None
) -> Path:
    """The template's working tree rendered with default answers (but `answers`) and package
    `mutpkg`."""
    copier = pytest.importorskip("copier")
    destination = tmp_path_factory.mktemp(name) / "project"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a dirty working tree is rendered on purpose
        copier.run_copy(
            src_path=str(ROOT),
            dst_path=destination,
            defaults=True,
            vcs_ref="HEAD",
            data={**(answers or {}), "package_name": PACKAGE},
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


def assert_caught(outcomes: dict[str, dict[str, Any]], mutation: Mutation) -> None:
    """The mutation was planted and a generated test failed on it."""
    result = outcomes[mutation.name]
    assert not result.get("problem"), f"{mutation.name}: {result['problem']}"
    assert caught(result), (
        f"{mutation.name} survived: `pytest tests/{mutation.tests} -k '{mutation.select}'` "
        f"exited {result['code']}\n{result['output'][-4000:]}"
    )
