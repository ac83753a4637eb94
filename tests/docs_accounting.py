"""The docs check's accounting (tests/test_docs.py): each command shown in the docs is
accounted for by exactly one rule (run here, run by CI or the generated suite, marked for
hardware, or a problem), then what was queued runs. Reading the pages is docs_collect.py's,
the drivers and rewriting docs_runner.py's.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from docs_collect import (
    ALLOWED_REASONS,
    CHEAP_PROJECT_SESSIONS,
    COVERED_BY_PROJECT_TESTS,
    NEEDS_HARDWARE,
    PACKAGE,
    Command,
    _session_args,
    normalise,
)
from docs_runner import (
    Runner,
    check_nox,
    covered_by_project_tests,
    env_prefix,
    nox_command,
    output_promised,
    parse_only,
    rewrite,
    run_by_the_lm_render,
    runs_alone,
    start_driver,
    touches_tracked_files_only,
)

# The language-model project's own page: its commands run in a `task: lm` render.
LM_PAGE = "template/docs/language-model.md.jinja"


@dataclass
class Accounting:
    """What the check knows while it accounts for each command, and what it found."""

    project: Path
    lm_project: Path
    template_repo: Path
    tmp_path: Path
    by_ci: set[str]  # commands CI, a noxfile or the generated workflow runs
    sessions: tuple[set[str], set[str], set[str]]  # the template's, CI's, the project's
    parsers: dict[Path, Any]
    problems: list[str] = field(default_factory=list)
    checked: list[Command] = field(default_factory=list)
    module_steps: list[tuple[Command, dict, Path]] = field(default_factory=list)
    later: list[tuple[Command, Runner, list[str], dict[str, str]]] = field(default_factory=list)
    already_run: set[str] = field(default_factory=set)  # run once, whichever page shows it
    runners: dict[int, Runner] = field(default_factory=dict)

    def runner(self, index: int, base: Path, page: Any) -> Runner:
        """One copy of the project per page, made when the page first needs it."""
        if index not in self.runners:
            self.runners[index] = Runner(base, self.tmp_path / f"page{index}", page)
        return self.runners[index]


def account(acc: Accounting, command: Command, page: Any, page_index: int, base: Path) -> None:
    """Account for one command by exactly one rule: checked, queued to run, or a problem."""
    try:
        words = shlex.split(command.text, comments=True)
    except ValueError as error:
        acc.problems.append(f"{command.where()}: not valid shell ({error})")
        return
    env, words = env_prefix(words)
    if account_hardware(acc, command, words, base):
        return
    program = words[0] if words else ""
    if program == "cd":
        acc.checked.append(command)
        return
    if program == "nox":
        account_nox(acc, command, words, env, page, page_index, base)
        return
    if program in ("pip", "ruff", "mkdocs", "pytest") or words[:3] in (
        ["python", "-m", "pip"],
        ["python", "-m", "pytest"],
    ):
        account_run_by_ci(acc, command, words, page, base)
        return
    module = words[2] if program == "python" and words[1:2] == ["-m"] else ""
    args = words[3:]
    if program == "torchrun":
        module, args = "torch.distributed.run", words[1:]
    if module in COVERED_BY_PROJECT_TESTS:
        problem = covered_by_project_tests(command, module, args, base)
        if problem:
            acc.problems.append(problem)
        else:
            acc.checked.append(command)
        return
    # The same command on another page gives the same result: run it once. Not for
    # commands whose result depends on earlier ones (resume, git) or whose promised
    # output must be checked.
    key = " ".join([str(base), *map(str, env.items()), *rewrite(words, acc.template_repo)])
    repeatable = "--resume" in words or program == "git" or command.output
    if key in acc.already_run and not repeatable:
        acc.checked.append(command)
        return
    acc.already_run.add(key)
    runner = acc.runner(page_index, base, page)
    if module.startswith(PACKAGE + "."):
        acc.module_steps.append((command, runner.module_step(module, words[3:]), base))
    elif program == "python" and words[1:2] and words[1] in page.files:
        acc.module_steps.append((command, runner.script_step(words[1], words[2:]), base))
    elif program in ("python", "grep", "ps", "copier", "torchrun", "git"):
        acc.later.append((command, runner, rewrite(words, acc.template_repo), env))
    else:
        acc.problems.append(
            f"{command.where()}: no rule says how `{program}` is checked; "
            "add one to tests/test_docs.py or drop the command"
        )
        return
    acc.checked.append(command)


def account_hardware(acc: Accounting, command: Command, words: list[str], base: Path) -> bool:
    """A command marked `# not run in CI`, or one that needs a GPU or cluster: parsed only,
    or a problem. True when the command is accounted for here."""
    hardware = bool(NEEDS_HARDWARE.search(command.text))
    if command.reason is not None:
        if command.reason not in ALLOWED_REASONS:
            acc.problems.append(
                f"{command.where()}: marker reason must be one of "
                f"{ALLOWED_REASONS}, got {command.reason!r}"
            )
        elif not hardware:
            acc.problems.append(
                f"{command.where()}: marked 'not run in CI' but needs no "
                "GPU or cluster: it must be run"
            )
        else:
            acc.problems += parse_only(command, words, acc.parsers[base])
            acc.checked.append(command)
        return True
    if hardware:
        acc.problems.append(
            f"{command.where()}: needs a GPU or cluster; end it with "
            "`# not run in CI: needs a GPU` (or a cluster)"
        )
    return hardware


def account_nox(
    acc: Accounting,
    command: Command,
    words: list[str],
    env: dict[str, str],
    page: Any,
    page_index: int,
    base: Path,
) -> None:
    """`nox -s S`: a session CI runs; the project's cheap sessions are executed too."""
    problem = check_nox(command, words, *acc.sessions)
    if problem:
        acc.problems.append(problem)
        return
    # The project's sessions that are cheap are executed too, with --no-venv.
    cheap = sorted(set(_session_args(words)) & CHEAP_PROJECT_SESSIONS)
    if page.name in ("README.md", "CONTRIBUTING.md"):
        cheap = []  # the template repository's pages: their sessions are CI's
    if cheap and " ".join(cheap) not in acc.already_run:
        acc.already_run.add(" ".join(cheap))
        nox = [*nox_command(), "--no-venv", "-s", *cheap]
        acc.later.append((command, acc.runner(page_index, base, page), nox, env))
    acc.checked.append(command)


def account_run_by_ci(
    acc: Accounting, command: Command, words: list[str], page: Any, base: Path
) -> None:
    """pip, pytest, ruff, mkdocs: CI (or the LM render of the matrix) runs the same command."""
    if page.name == LM_PAGE and words[:3] == ["python", "-m", "pytest"]:
        problem = run_by_the_lm_render(command, words[3:], base)
        if problem:
            acc.problems.append(problem)
        else:
            acc.checked.append(command)
    elif normalise(command.text) not in acc.by_ci:
        acc.problems.append(
            f"{command.where()}: neither CI nor a noxfile runs this "
            "command; run it there, or change the docs"
        )
    else:
        acc.checked.append(command)


def execute(acc: Accounting) -> list[tuple[float, str]]:
    """Run what was queued; returns (seconds, where) per command, adding problems to `acc`.

    Module commands, and `python FILE.py` of a file the page writes, run in one worker
    process, in page order. Meanwhile (two cores, two
    streams) the shell commands that cannot see what module commands write run: copier and
    git (they touch only tracked files), and commands that name no run output, each in a
    copy of its own. The rest run after the worker, since they may read its output
    (metrics, checkpoints); nothing a module command needs comes from a shell command.
    The language model's driver starts when the first one is done: two streams, two cores.
    """
    project, later, timings = acc.project, acc.later, []
    drivers = [
        (steps, start_driver(base, [step for _, step, _ in steps]) if base == project else None)
        for base in (project, acc.lm_project)
        for steps in [[item for item in acc.module_steps if item[2] == base]]
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
                        acc.problems.append(f"{command.where()}: {problem}")
            continue
        timings.append(run_shell_command(acc, item))
    return timings


def run_shell_command(
    acc: Accounting, item: tuple[Command, Runner, list[str], dict[str, str]]
) -> tuple[float, str]:
    """One queued shell command, in the page's project or a copy of it."""
    command, runner, words, env = item
    cwd = runner.project
    if runs_alone(item) and not touches_tracked_files_only(words):
        cwd = runner.isolated()
    if words[:4] == [sys.executable, "-m", "copier", "copy"]:
        cwd = runner.workspace / "scratch"  # not over the example project
        cwd.mkdir(exist_ok=True)
    started = time.perf_counter()
    result = runner.shell(words, cwd, env)
    seconds = time.perf_counter() - started
    code = result.returncode
    if words[0] == "grep" and code == 1:
        code = 0  # no match is an answer, not a failure
    problem = output_promised(command, code, result.stdout + result.stderr)
    if problem:
        acc.problems.append(f"{command.where()}: {problem}")
    return seconds, command.where()


def inline_problems(pages: list[Any], checked: list[Command]) -> list[str]:
    """Inline commands in prose must repeat a command of a checked block."""
    known = {" ".join(c.text.split()) for c in checked}
    problems = []
    for page in pages:
        for command in page.inline:
            text = " ".join(command.text.split())
            if not any(k == text or k.startswith(text + " ") for k in known):
                problems.append(
                    f"{page.name}: inline command `{command.text}` is shown nowhere "
                    "in a checked block; show it in a ```bash block"
                )
    return problems
