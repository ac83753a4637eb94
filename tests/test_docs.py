"""Keep the documentation honest: every page exists, and no command in it went unrun.

Reading the pages (step 1 below) lives in tests/docs_collect.py, running them (the drivers, the
per-page project copies, the rewriting of commands) in tests/docs_runner.py; this file checks.

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
     all parsed and used), `copier copy/update/check-update` (the template source rewritten
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

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from docs_collect import (
    ALLOWED_REASONS,
    CHEAP_PROJECT_SESSIONS,
    COVERED_BY_PROJECT_TESTS,
    NEEDS_HARDWARE,
    PACKAGE,
    Command,
    Page,
    _session_args,
    ci_commands,
    normalise,
    nox_invocations,
    nox_sessions,
    parse_page,
)
from docs_runner import (
    Runner,
    check_nox,
    covered_by_project_tests,
    env_prefix,
    nox_command,
    output_promised,
    parse_only,
    project_parser,
    rewrite,
    run_by_the_lm_render,
    runs_alone,
    start_driver,
    touches_tracked_files_only,
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
# The language-model project's own page: its commands run in a render with `task: lm`.
LM_PAGE = "template/docs/language-model.md.jinja"

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
    problems = [problem for page in pages for problem in page.problems]
    commands = [command for page in pages for command in page.commands]
    assert len(commands) >= MIN_COMMANDS, f"only {len(commands)} commands found in the docs"
    for name in PAGES_WITH_COMMANDS:
        if not any(c.page == f"docs/{name}" for c in commands):
            problems.append(f"docs/{name}: shows no command, so nothing on it is checked")

    template_sessions, template_defaults = nox_sessions(ROOT / "noxfile.py")
    project_sessions, _ = nox_sessions(ROOT / "template" / "noxfile.py")
    ci_run = ROOT / ".ci" / "run"
    ci_sessions: set[str] = set()
    for call in nox_invocations(ci_run.read_text()) if ci_run.exists() else []:
        ci_sessions |= set(call or template_defaults)
    by_ci = ci_commands(project)
    parsers = {project: project_parser(project), lm_project: project_parser(lm_project)}

    checked: list[Command] = []
    timings: list[tuple[float, str]] = []
    # All pages of one project: one driver, one torch import.
    module_steps: list[tuple[Command, dict, Path]] = []
    later: list[tuple[Command, Runner, list[str], dict[str, str]]] = []
    already_run: set[str] = set()  # an identical command on another page is not rerun
    for page_index, page in enumerate(pages):
        runner: Runner | None = None
        base = lm_project if page.name == LM_PAGE else project  # the project the page is in
        for command in page.commands:
            try:
                words = shlex.split(command.text, comments=True)
            except ValueError as error:
                problems.append(f"{command.where()}: not valid shell ({error})")
                continue
            env, words = env_prefix(words)
            hardware = bool(NEEDS_HARDWARE.search(command.text))
            if command.reason is not None:
                if command.reason not in ALLOWED_REASONS:
                    problems.append(
                        f"{command.where()}: marker reason must be one of "
                        f"{ALLOWED_REASONS}, got {command.reason!r}"
                    )
                elif not hardware:
                    problems.append(
                        f"{command.where()}: marked 'not run in CI' but needs no "
                        "GPU or cluster: it must be run"
                    )
                else:
                    problems += parse_only(command, words, parsers[base])
                    checked.append(command)
                continue
            if hardware:
                problems.append(
                    f"{command.where()}: needs a GPU or cluster; end it with "
                    "`# not run in CI: needs a GPU` (or a cluster)"
                )
                continue
            program = words[0] if words else ""
            if program == "cd":
                checked.append(command)
                continue
            if program == "nox":
                problem = check_nox(
                    command, words, template_sessions, ci_sessions, project_sessions
                )
                if problem:
                    problems.append(problem)
                    continue
                # The project's sessions that are cheap are executed too, with --no-venv.
                cheap = sorted(set(_session_args(words)) & CHEAP_PROJECT_SESSIONS)
                if page.name in ("README.md", "CONTRIBUTING.md"):
                    cheap = []  # the template repository's pages: their sessions are CI's
                if cheap and " ".join(cheap) not in already_run:
                    already_run.add(" ".join(cheap))
                    runner = runner or Runner(base, tmp_path / f"page{page_index}", page)
                    nox = [*nox_command(), "--no-venv", "-s", *cheap]
                    later.append((command, runner, nox, env))
                checked.append(command)
                continue
            if program in ("pip", "ruff", "mkdocs", "pytest") or words[:3] in (
                ["python", "-m", "pip"],
                ["python", "-m", "pytest"],
            ):
                if page.name == LM_PAGE and words[:3] == ["python", "-m", "pytest"]:
                    problem = run_by_the_lm_render(command, words[3:], base)
                    if problem:
                        problems.append(problem)
                    else:
                        checked.append(command)
                elif normalise(command.text) not in by_ci:
                    problems.append(
                        f"{command.where()}: neither CI nor a noxfile runs this "
                        "command; run it there, or change the docs"
                    )
                else:
                    checked.append(command)
                continue
            module = words[2] if program == "python" and words[1:2] == ["-m"] else ""
            args = words[3:]
            if program == "torchrun":
                module, args = "torch.distributed.run", words[1:]
            if module in COVERED_BY_PROJECT_TESTS:
                problem = covered_by_project_tests(command, module, args, base)
                if problem:
                    problems.append(problem)
                else:
                    checked.append(command)
                continue
            # The same command on another page gives the same result: run it once. Not for
            # commands whose result depends on earlier ones (resume, git) or whose promised
            # output must be checked.
            key = " ".join([str(base), *map(str, env.items()), *rewrite(words, template_repo)])
            repeatable = "--resume" in words or program == "git" or command.output
            if key in already_run and not repeatable:
                checked.append(command)
                continue
            already_run.add(key)
            runner = runner or Runner(base, tmp_path / f"page{page_index}", page)
            if module.startswith(PACKAGE + "."):
                module_steps.append((command, runner.module_step(module, words[3:]), base))
            elif program in ("python", "grep", "ps", "copier", "torchrun", "git"):
                later.append((command, runner, rewrite(words, template_repo), env))
            else:
                problems.append(
                    f"{command.where()}: no rule says how `{program}` is checked; "
                    "add one to tests/test_docs.py or drop the command"
                )
                continue
            checked.append(command)

    # Module commands run in one worker process, in page order. Meanwhile (two cores, two
    # streams) the shell commands that cannot see what module commands write run: copier and
    # git (they touch only tracked files), and commands that name no run output, each in a
    # copy of its own. The rest run after the worker, since they may read its output
    # (metrics, checkpoints); nothing a module command needs comes from a shell command.
    # The language model's driver starts when the first one is done: two streams, two cores.
    drivers = [
        (steps, start_driver(base, [step for _, step, _ in steps]) if base == project else None)
        for base in (project, lm_project)
        for steps in [[item for item in module_steps if item[2] == base]]
    ]
    independent = [item for item in later if runs_alone(item)]
    for item in [*independent, None, *(i for i in later if not runs_alone(i))]:
        if item is None:
            for steps, driver in filter(lambda pair: pair[0], drivers):
                driver = driver or start_driver(steps[0][2], [step for _, step, _ in steps])
                output, errors = driver.communicate(timeout=900)
                assert driver.returncode == 0, f"docs driver crashed:\n{errors[-3000:]}"
                for (command, _, _), result in zip(steps, json.loads(output), strict=True):
                    timings.append((result["seconds"], command.where()))
                    problem = output_promised(command, result["code"], result["output"])
                    if problem:
                        problems.append(f"{command.where()}: {problem}")
            continue
        command, runner, words, env = item
        cwd = runner.project
        if runs_alone(item) and not touches_tracked_files_only(words):
            cwd = runner.isolated()
        if words[:4] == [sys.executable, "-m", "copier", "copy"]:
            cwd = runner.workspace / "scratch"  # not over the example project
            cwd.mkdir(exist_ok=True)
        started = time.perf_counter()
        result = runner.shell(words, cwd, env)
        timings.append((time.perf_counter() - started, command.where()))
        code = result.returncode
        if words[0] == "grep" and code == 1:
            code = 0  # no match is an answer, not a failure
        problem = output_promised(command, code, result.stdout + result.stderr)
        if problem:
            problems.append(f"{command.where()}: {problem}")

    inline_known = {" ".join(c.text.split()) for c in checked}
    for page in pages:
        for command in page.inline:
            text = " ".join(command.text.split())
            if not any(known == text or known.startswith(text + " ") for known in inline_known):
                problems.append(
                    f"{page.name}: inline command `{command.text}` is shown nowhere "
                    "in a checked block; show it in a ```bash block"
                )
    for seconds, where in sorted(timings, reverse=True)[:10]:
        print(f"{seconds:6.1f} s  {where}")  # shown with -s or on failure: where the time goes
    assert not problems, "\n\n".join(problems)


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
