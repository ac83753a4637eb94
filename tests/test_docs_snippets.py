"""Python snippets on the docs pages run, and the tests the techniques page names exist.

Python snippets (```python blocks on the pages in SNIPPET_PAGES, the techniques page) are run,
each in a fresh process forked from one that has imported torch and the rendered project's
package, with a scratch folder as its working directory: a snippet must be complete on its
own (its imports included) and exit without an exception. A snippet whose first line is
`# not run in CI: needs a GPU` is traced instead of run: it must compile, its imports must
succeed, and every dotted name it takes from an imported module (`torch.cuda.Stream`,
`F.cross_entropy`) must exist, so a renamed API fails here too. A ```python block with
`title="..."` is a file for the commands (tests/test_docs.py), not a snippet. The tests a page
names as `tests/<file>.py::<test>` must exist in the rendered project.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from docs_collect import ALLOWED_REASONS, Snippet, parse_page
from docs_runner import SNIPPET_DRIVER
from helpers import ROOT, render

DOCS = ROOT / "docs"
SNIPPET_PAGES = ["techniques.md"]
MIN_SNIPPETS = 14  # the techniques page: raw PyTorch and the template's call, per technique
SNIPPET_SECONDS = 120  # per snippet; a hung DataLoader worker must not hang CI


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A render of the working tree with default answers: the package the snippets import."""
    return render(tmp_path_factory.mktemp("snippets") / "my-torch-project")


def _snippets() -> list[Snippet]:
    found: list[Snippet] = []
    for name in SNIPPET_PAGES:
        found += parse_page(f"docs/{name}", (DOCS / name).read_text()).snippets
    return found


def test_the_snippet_collector_finds_what_it_should():
    sample = "\n".join(
        [
            "```python",
            "import torch",
            "```",
            "",
            "```python",
            "# not run in CI: needs a GPU",
            "torch.cuda.synchronize()",
            "```",
            "",
            '```python title="helper.py"',
            "print(1)",
            "```",
        ]
    )
    page = parse_page("sample.md", sample)
    assert [(s.line, s.reason) for s in page.snippets] == [(1, None), (5, "needs a GPU")]
    assert page.snippets[0].code == "import torch\n"
    assert page.files == {"helper.py": "print(1)\n"}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the snippet driver forks (POSIX only)")
def test_every_snippet_on_the_techniques_page_runs(project, tmp_path):
    snippets = _snippets()
    assert len(snippets) >= MIN_SNIPPETS, f"only {len(snippets)} snippets found"
    problems = [
        f"{s.where()}: marker reason must be one of {ALLOWED_REASONS}, got {s.reason!r}"
        for s in snippets
        if s.reason is not None and s.reason not in ALLOWED_REASONS
    ]
    # A broken marker would trace instead of run: a snippet that runs on CPU must not carry it.
    problems += [
        f"{s.where()}: marked 'not run in CI' but never touches CUDA: it must be run"
        for s in snippets
        if s.reason is not None and not re.search(r"cuda|\bgpu\b", s.code.split("\n", 1)[1])
    ]
    plan = tmp_path / "snippets.json"
    plan.write_text(
        json.dumps(
            [
                {
                    "name": s.where(),
                    "code": s.code,
                    "trace": s.reason is not None,
                    "cwd": str(tmp_path / f"snippet{index}"),
                    "limit": SNIPPET_SECONDS,
                }
                for index, s in enumerate(snippets)
            ]
        )
    )
    result = subprocess.run(
        [sys.executable, "-c", SNIPPET_DRIVER, str(plan)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(project / "src")},
        capture_output=True,
        text=True,
        timeout=SNIPPET_SECONDS * len(snippets),
    )
    assert result.returncode == 0, f"snippet driver crashed:\n{result.stderr[-3000:]}"
    for snippet, outcome in zip(snippets, json.loads(result.stdout), strict=True):
        print(f"{outcome['seconds']:6.1f} s  {snippet.where()}")
        if outcome["code"] != 0:
            how = "traced" if snippet.reason else "run"
            problems.append(
                f"{snippet.where()}: the snippet failed when {how} "
                f"(exit {outcome['code']}):\n{outcome['output']}"
            )
    assert not problems, "\n\n".join(problems)


def test_the_snippet_driver_fails_a_broken_snippet(project, tmp_path):
    """The runner itself: a raising snippet and a traced snippet naming a missing API fail,
    a traced one is not executed, and a good one passes."""
    if not hasattr(os, "fork"):
        pytest.skip("the snippet driver forks (POSIX only)")
    cases = {
        "good": ("import torch\nassert torch.ones(1).item() == 1\n", False, 0),
        "raises": ("import torch\nraise ValueError('broken')\n", False, 1),
        "traced, not run": ("import torch\ntorch.cuda.synchronize('cuda:99')\n", True, 0),
        "missing API": ("import torch\ntorch.cuda.no_such_function()\n", True, 1),
    }
    plan = tmp_path / "snippets.json"
    plan.write_text(
        json.dumps(
            [
                {
                    "name": name,
                    "code": code,
                    "trace": trace,
                    "cwd": str(tmp_path / str(i)),
                    "limit": 60,
                }
                for i, (name, (code, trace, _)) in enumerate(cases.items())
            ]
        )
    )
    result = subprocess.run(
        [sys.executable, "-c", SNIPPET_DRIVER, str(plan)],
        env={**os.environ, "PYTHONPATH": str(project / "src")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout)
    assert [o["code"] != 0 for o in outcomes] == [bool(c[2]) for c in cases.values()], outcomes
    assert "broken" in outcomes[1]["output"]
    assert "torch.cuda.no_such_function does not exist" in outcomes[3]["output"]


def test_the_tests_the_techniques_page_names_exist(project):
    """`tests/<file>.py::<test>` on the techniques page: a renamed test must not leave a
    dangling reference behind."""
    text = (DOCS / "techniques.md").read_text()
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text)
    assert len(named) >= 7, named  # at least one per technique
    missing = []
    for path, test in named:
        source = project / path
        if not source.is_file() or not re.search(rf"^def {test}\(", source.read_text(), re.M):
            missing.append(f"{path}::{test}")
    assert not missing, f"docs/techniques.md names tests the project does not have: {missing}"
