"""Keep the documentation honest: every page exists, and no command in it went unrun.

Reading the pages (step 1 below) lives in tests/docs_collect.py, running them (the drivers, the
per-page project copies, the rewriting of commands) in tests/docs_runner.py, accounting for
each command by one rule in tests/docs_accounting.py; this file checks.

How "every command shown in the docs was run by a test or by CI" is enforced
----------------------------------------------------------------------------
1. Collect. Every command shown is collected from docs/*.md, README.md, CONTRIBUTING.md and
   the README of a freshly rendered project (template/README.md.jinja with default answers, so
   the package is `my_torch_project`, the name the docs use) and of its docs/template.md, the
   template's reference page in the project, and the docs/language-model.md of a `task: lm` render,
   whose commands run in that render (a `python -m pytest` line there counts as run when the
   render matrix runs that selection in its LM render and it selects a test):
   - each line of a ```bash, ```sh or ```shell block (continuation lines joined, comments
     skipped) and each `$ ` line of a ```console block, whose following lines are the output
     the page promises;
   - inline code in the "Command to confirm" column of troubleshooting tables.
   A fenced block with `title="path"` is a file (a config, a batch script), not commands: it
   is written into the example project, so the commands after it can use it. A fence without
   a language, or with another language that contains a command line, fails: commands cannot
   hide from this test. Inline commands in prose must repeat a checked block command.
2. Account for each command by exactly one rule, or fail naming the page and the command:
   - EXECUTED HERE, in document order, in a copy of the rendered project:
     `python -m my_torch_project.<module>` (in one worker process that imports torch once,
     with SHRINK flags appended that only make the data small: the flags the page shows are
     all parsed and used; `python FILE.py` of a file the page writes, a title block, runs
     there too, in page order, so the commands after it can read what it makes),
     `copier copy/update/check-update` (the template source rewritten
     to a one-commit copy of this checkout, with `--defaults` so it cannot wait for input),
     `nox --no-venv -s <session>` for the project's cheap sessions, `git` (`git commit` with
     `--allow-empty`: the page's update, here to the same commit, may have changed nothing),
     `grep`, `ps`, `python -c`. Each must exit 0, except a ```console command whose promised
     output is checked and found. Commands that cannot see each other's output run side by side.
   - RUN BY THE GENERATED SUITE (which the render matrix runs in CI): the benchmark (minutes)
     and single-node `torchrun`, when a test of the rendered project runs the same module with
     every flag the page shows.
   - RUN BY CI: `nox -s S` for the template (S must be a session of ./noxfile.py that .ci/run
     runs), `pip install ...`, `python -m pytest ...`, `ruff ...`, `mkdocs ...` (the same
     command, or the same install, appears in .ci/run, a noxfile or the generated CI workflow).
   - MARKED: a command that needs hardware CI does not have ends with
     `# not run in CI: needs a GPU|cluster|SLURM cluster`. Such commands (multi-node torchrun,
     sbatch, srun, nvidia-smi, `--device cuda`) MUST carry the marker, the marker is refused on
     any other command, and their arguments are still parsed by torchrun's and the project's
     real argument parsers, so a renamed flag fails here too.
3. Not vacuous: every page named in issue 8 must show at least one checked command, and the
   total must not drop below a floor.

Python snippets on the pages are run by tests/test_docs_snippets.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from docs_accounting import LM_PAGE, Accounting, account, execute, inline_problems
from docs_collect import (
    Page,
    ci_commands,
    nox_invocations,
    nox_sessions,
    parse_page,
)
from docs_runner import (
    project_parser,
)
from helpers import ROOT, copy_template_repo, render

DOCS = ROOT / "docs"
# The pages issue 8 asks for; each must exist and be in mkdocs.yml's nav.
REQUIRED_PAGES = [
    "index.md",
    "getting-started.md",
    "questions.md",
    "techniques.md",
    "training.md",
    "profiling.md",
    "benchmarks.md",
    "gpu.md",
    "updating.md",
    "troubleshooting.md",
]
# Pages whose subject is running things: each must show at least one checked command.
PAGES_WITH_COMMANDS = [
    "getting-started.md",
    "training.md",
    "reliability.md",
    "profiling.md",
    "gpu.md",
    "updating.md",
    "troubleshooting.md",
]
MIN_COMMANDS = 30

# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def template_repo(tmp_path_factory) -> Path:
    """The working tree as a one-commit repo: `copier update` needs the commit a project was
    rendered from to exist, which a render of uncommitted changes does not give."""
    return copy_template_repo(tmp_path_factory.mktemp("template"))


@pytest.fixture(scope="module")
def project(tmp_path_factory, template_repo) -> Path:
    return render(tmp_path_factory.mktemp("docs") / "my-torch-project", src=template_repo)


@pytest.fixture(scope="module")
def lm_project(tmp_path_factory, template_repo) -> Path:
    """A language-model render: its own page (LM_PAGE) runs there."""
    return render(
        tmp_path_factory.mktemp("docs-lm") / "my-lm-project", {"task": "lm"}, src=template_repo
    )


@pytest.fixture(scope="module")
def pages(project, lm_project) -> list[Page]:
    sources = sorted(DOCS.glob("*.md"))
    found = [parse_page(f"docs/{path.name}", path.read_text()) for path in sources]
    for name in ("README.md", "CONTRIBUTING.md"):  # the template repository's own pages
        if (ROOT / name).exists():
            found.append(parse_page(name, (ROOT / name).read_text()))
    found.append(parse_page("template/README.md.jinja", (project / "README.md").read_text()))
    guide = project / "docs" / "template.md"  # the template's reference page in the project
    found.append(parse_page("template/docs/template.md.jinja", guide.read_text()))
    found.append(parse_page(LM_PAGE, (lm_project / "docs" / "language-model.md").read_text()))
    return found


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def _nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_exists_and_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config.get("strict") is True, "mkdocs.yml must build in strict mode"
    nav = _nav_pages(config["nav"])
    missing = [page for page in REQUIRED_PAGES if not (DOCS / page).is_file()]
    assert not missing, f"pages missing from docs/: {missing}"
    absent = [page for page in REQUIRED_PAGES if page not in nav]
    assert not absent, f"pages missing from the mkdocs.yml nav: {absent}"
    orphans = sorted(p.name for p in DOCS.glob("*.md") if p.name not in nav)
    assert not orphans, f"docs/ pages not in the nav (unreachable): {orphans}"


def test_the_collector_finds_what_it_should():
    """The extraction itself, on a sample, so a broken parser cannot make the real test
    pass by finding nothing."""
    sample = "\n".join(
        [
            "| Symptom | Command to confirm |",
            "|---|---|",
            "| x | `grep -rn foo src/` |",
            "",
            "```bash",
            "# a comment",
            "pip install a \\",
            "  b",
            "nox -s gpu  # not run in CI: needs a GPU",
            "```",
            "",
            "```console",
            "$ python -m pkg.train --epochs -1",
            "error: bad",
            "```",
            "",
            '```toml title="c.toml"',
            "epochs = 1",
            "```",
            "",
            "```",
            "nox -s tests",
            "```",
            "",
            "```text",
            "python -m pkg.train",
            "```",
            "",
            "Run `copier update` now.",
        ]
    )
    page = parse_page("sample.md", sample)
    assert [c.text for c in page.commands] == [
        "grep -rn foo src/",
        "pip install a b",
        "nox -s gpu",
        "python -m pkg.train --epochs -1",
    ]
    assert page.commands[2].reason == "needs a GPU"
    assert page.commands[3].output == ["error: bad"]
    assert page.files == {"c.toml": "epochs = 1\n"}
    assert [c.text for c in page.inline] == ["copier update"]
    assert len(page.problems) == 1 and "without a language" in page.problems[0]
    assert nox_invocations("set -e\nnox -s tests lint -- -x\npython -m nox\n") == [
        ["tests", "lint"],
        [],
    ]


def test_every_command_in_the_docs_was_run(project, lm_project, pages, template_repo, tmp_path):
    commands = [command for page in pages for command in page.commands]
    assert len(commands) >= MIN_COMMANDS, f"only {len(commands)} commands found in the docs"
    template_sessions, template_defaults = nox_sessions(ROOT / "noxfile.py")
    project_sessions, _ = nox_sessions(ROOT / "template" / "noxfile.py")
    ci_run = ROOT / ".ci" / "run"
    ci_sessions: set[str] = set()
    for call in nox_invocations(ci_run.read_text()) if ci_run.exists() else []:
        ci_sessions |= set(call or template_defaults)
    acc = Accounting(
        project, lm_project, template_repo, tmp_path, ci_commands(project),
        (template_sessions, ci_sessions, project_sessions),
        {project: project_parser(project), lm_project: project_parser(lm_project)},
        problems=[problem for page in pages for problem in page.problems],
    )  # fmt: skip
    for name in PAGES_WITH_COMMANDS:
        if not any(c.page == f"docs/{name}" for c in commands):
            acc.problems.append(f"docs/{name}: shows no command, so nothing on it is checked")
    for page_index, page in enumerate(pages):
        base = lm_project if page.name == LM_PAGE else project  # the project the page is in
        for command in page.commands:
            account(acc, command, page, page_index, base)
    timings = execute(acc)
    acc.problems += inline_problems(pages, acc.checked)
    for seconds, where in sorted(timings, reverse=True)[:10]:
        print(f"{seconds:6.1f} s  {where}")  # shown with -s or on failure: where the time goes
    assert not acc.problems, "\n\n".join(acc.problems)


def test_the_site_builds_in_strict_mode(tmp_path):
    """What `nox -s docs` does: a dead link, a missing anchor or a page outside the nav fails."""
    pytest.importorskip("material", reason="mkdocs-material is not installed here")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "troubleshooting" / "index.html").is_file()


def test_every_copier_question_is_documented_with_its_default_and_choices():
    """docs/questions.md against copier.yml: a new question, choice or default must reach it."""
    questions = {
        name: spec
        for name, spec in yaml.safe_load((ROOT / "copier.yml").read_text()).items()
        if not name.startswith("_") and isinstance(spec, dict) and spec.get("when") is not False
    }
    assert len(questions) >= 10, sorted(questions)
    rows = {
        match[1]: match[0]
        for match in re.finditer(r"^\| `(\w+)` \|.*$", (DOCS / "questions.md").read_text(), re.M)
    }
    problems = []
    for name, spec in questions.items():
        row = rows.get(name)
        if row is None:
            problems.append(f"{name}: no row in docs/questions.md")
            continue
        choices = spec.get("choices") or []
        for choice in choices.values() if isinstance(choices, dict) else choices:
            if f"`{choice}`" not in row:
                problems.append(f"{name}: choice {choice!r} not in its row")
        default = spec.get("default")
        if spec.get("type") == "bool":
            if ("yes" if default else "no") not in row:
                problems.append(f"{name}: default {default} not in its row")
        elif isinstance(default, str) and "{{" not in default and default not in row:
            problems.append(f"{name}: default {default!r} not in its row")
    assert not problems, "\n".join(problems)
