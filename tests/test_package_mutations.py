"""The generated suite catches realistic bugs in every module of the generated package.

Each mutation plants one bug of the kind that slips through review (a metric reduced over the
wrong thing, best.pt overwritten by a worse model, a schedule that never steps, clipping after
the optimizer step, handlers "restored" to the default, ...) into one module of a rendered
project, and runs the few generated tests that should catch it. Each must fail. The runs share
one torch import: tests/mutation_runner.py forks a child per mutation, two at a time.

Every edit must match its module exactly once: after a change to the package, a stale target
fails here with "mutation target not found: <module>: <text>" instead of silently testing
nothing. Retarget it at the new code (keep the bug the same) rather than deleting it. The
bugs themselves are listed in tests/package_mutation_table.py, package_mutation_checkpoints.py
and package_mutation_images.py.
(`test_utils_mutations.py` does the same for `utils.py`.) The unmutated project passes these
tests: the render matrix runs the whole generated suite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mutations import PACKAGE, Mutation, assert_caught, render_to_mutate, run_mutations
from package_mutation_checkpoints import CHECKPOINTS
from package_mutation_images import IMAGES_AND_OUTSIDERS
from package_mutation_table import TRAINING

MUTATIONS = [*TRAINING, *CHECKPOINTS, *IMAGES_AND_OUTSIDERS]


@pytest.fixture(scope="module")
def rendered_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_to_mutate(tmp_path_factory, "package-mutations")


@pytest.fixture(scope="module")
def outcomes(
    request: pytest.FixtureRequest,
    rendered_project: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict[str, Any]]:
    """Run every selected mutation once (tests/mutation_runner.py, two at a time)."""
    return run_mutations(
        request, rendered_project, MUTATIONS, tmp_path_factory, "package mutations"
    )


def test_every_mutation_names_a_generated_test_file_and_a_unique_name(
    rendered_project: Path,
) -> None:
    files = {path.name for path in (rendered_project / "tests").glob("test_*.py")}
    assert {mutation.tests for mutation in MUTATIONS} <= files
    assert len({mutation.name for mutation in MUTATIONS}) == len(MUTATIONS)
    modules = {mutation.module for mutation in MUTATIONS}
    package = {path.name for path in (rendered_project / "src" / PACKAGE).glob("*.py")}
    # Every module of the package but utils.py (test_utils_mutations.py) and __init__.py.
    assert package - {"utils.py", "__init__.py"} <= modules


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_a_planted_bug_fails_the_generated_tests(
    outcomes: dict[str, dict[str, Any]], mutation: Mutation
) -> None:
    assert_caught(outcomes, mutation)
