"""Collecting the commands and snippets the docs show, and the commands CI and the noxfiles
run: the half of tests/test_docs.py that reads pages (its docstring says what is collected
and how each command is accounted for)."""

from __future__ import annotations

import ast
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from helpers import ROOT

PACKAGE = "my_torch_project"  # the default answers' package name, used throughout the docs

MARKER = re.compile(r"\s+#\s*not run in CI:\s*(?P<reason>.+)$")
ALLOWED_REASONS = ("needs a GPU", "needs a cluster", "needs a SLURM cluster")
NEEDS_HARDWARE = re.compile(
    r"^(sbatch|srun|nvidia-smi|scontrol)\b|--device[ =]cuda|--nnodes|--rdzv|pytest -m gpu\b"
)
SHELL_LANGS = {"bash", "sh", "shell"}
PROGRAMS = {
    "cd",
    "copier",
    "git",
    "grep",
    "mkdocs",
    "nox",
    "nvidia-smi",
    "pip",
    "pre-commit",
    "ps",
    "pytest",
    "python",
    "ruff",
    "sbatch",
    "scontrol",
    "srun",
    "torchrun",
}
COMMANDY = re.compile(r"^\s*(\$ )?(?:[A-Z_]+=\S+\s+)*(" + "|".join(sorted(PROGRAMS)) + r")(\s|$)")

# Appended to executed training-like commands: they only shrink the data and cap the steps
# (argparse keeps the last value), so each run takes a second instead of minutes.
SHRINK = [
    "--train-samples",
    "64",
    "--val-samples",
    "32",
    "--batch-size",
    "16",
    "--max-steps-per-epoch",
    "2",
]
PROFILE_SHRINK = ["--profile-wait", "0", "--profile-warmup", "1", "--profile-steps", "1"]
# A full (not --quick) tune also tries compile on a CPU: dynamo's eager backend traces the
# step as inductor's does, without tens of seconds of C++ compilation per trial.
TUNE_SHRINK = ["--steps", "2", "--rounds", "2", "--compile-backend", "eager"]
# The LM grid on a sliver of each token budget, one candidate; the compressor comparison on a
# few windows (the LM page's commands).
LM_GRID_SHRINK = ["--scale", "0.0005", "--rounds", "1", "--seconds", "0.05", "--val-windows", "8"]
LM_GRID_SHRINK += ["--only", "w64-d4-s128-b32-lr3e-3-drop0.1"]
SHRINK_BY_MODULE = {
    "train": SHRINK,
    "profiling": [*SHRINK, *PROFILE_SHRINK],
    "tune": [*SHRINK, *TUNE_SHRINK],
    "grid": LM_GRID_SHRINK,
    "compress": ["--max-windows", "8"],
}
# Too slow to run here (minutes); a test of the generated project must run it with the same flags.
# (single-node torchrun starts three torch processes: the generated suite runs it already).
# `serve` runs until stopped: a generated test starts it and stops it (SIGTERM).
COVERED_BY_PROJECT_TESTS = {f"{PACKAGE}.benchmark", f"{PACKAGE}.serve", "torch.distributed.run"}
# Project nox sessions cheap enough to execute here with --no-venv (the `tests` session is the
# project's whole suite, which the render matrix runs: tests/test_matrix.py).
CHEAP_PROJECT_SESSIONS = {"gpu", "lint"}
# Project sessions that the template's `gpu` session (which .ci/run runs) runs in every GPU
# render when there is no CUDA device, as CI has none.
RUN_BY_TEMPLATE_GPU = {"gpu_rehearsal"}


@dataclass
class Command:
    page: str
    line: int
    text: str  # without the marker
    reason: str | None = None  # the `# not run in CI:` reason
    output: list[str] = field(default_factory=list)  # promised output (console blocks)

    def where(self) -> str:
        return f"{self.page}:{self.line}: `{self.text}`"


@dataclass
class Snippet:
    page: str
    line: int  # the line of the opening fence
    code: str
    reason: str | None = None  # `# not run in CI:` on its first line: traced, not run

    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass
class Page:
    name: str
    commands: list[Command] = field(default_factory=list)
    snippets: list[Snippet] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # title -> content
    inline: list[Command] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Collecting
# --------------------------------------------------------------------------------------------

FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<info>.*)$")


def parse_page(name: str, text: str) -> Page:
    page = Page(name)
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            _table_commands(page, lines, i)
            i += 1
            continue
        fence, info, start = match["fence"], match["info"].strip(), i + 1
        i += 1
        body: list[tuple[int, str]] = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append((i + 1, lines[i]))
            i += 1
        i += 1
        lang = info.split()[0].lower() if info else ""
        title = re.search(r'title="([^"]+)"', info)
        if title:
            page.files[title[1]] = "\n".join(line for _, line in body) + "\n"
        elif lang in SHELL_LANGS:
            page.commands += _shell_commands(name, body)
        elif lang == "console":
            page.commands += _console_commands(name, body)
        elif not lang:
            page.problems.append(f"{name}:{start}: a fence without a language; say what it holds")
        elif lang == "python":
            code = "\n".join(line for _, line in body) + "\n"
            first = code.lstrip().splitlines()[0] if code.strip() else ""
            marker = re.match(r"^#\s*not run in CI:\s*(?P<reason>.+)$", first)
            page.snippets.append(Snippet(name, start, code, marker["reason"] if marker else None))
        else:
            for number, line in body:
                if lang not in ("python", "toml", "yaml", "text") and COMMANDY.match(line):
                    page.problems.append(
                        f"{name}:{number}: a command in a ```{lang} block; use ```bash"
                    )
    for match in re.finditer(r"(?<!`)`([^`\n]+)`(?!`)", _prose(text)):
        words = match[1].split()
        if len(words) > 1 and (
            words[0] in ("nox", "copier", "torchrun", "sbatch")
            or match[1].startswith(("python -m ", "pip install"))
        ):
            page.inline.append(Command(name, 0, match[1]))
    return page


def _prose(text: str) -> str:
    """The page without fenced blocks and without table rows."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced and not line.lstrip().startswith("|"):
            kept.append(line)
    return "\n".join(kept)


def _split_marker(text: str) -> tuple[str, str | None]:
    match = MARKER.search(text)
    if not match:
        return text.strip(), None
    return text[: match.start()].strip(), match["reason"].strip()


def _shell_commands(page: str, body: list[tuple[int, str]]) -> list[Command]:
    commands: list[Command] = []
    pending, first = "", 0
    for number, line in body:
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            first = number
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        text, reason = _split_marker(pending + stripped)
        pending = ""
        commands += [Command(page, first, part, reason) for part in text.split(" && ")]
    return commands


def _console_commands(page: str, body: list[tuple[int, str]]) -> list[Command]:
    commands: list[Command] = []
    for number, line in body:
        if line.startswith("$ "):
            text, reason = _split_marker(line[2:])
            commands.append(Command(page, number, text, reason))
        elif commands and line.strip():
            commands[-1].output.append(line.strip())
    return commands


def _table_commands(page: Page, lines: list[str], index: int) -> None:
    """Inline commands in the "Command to confirm" column of a table whose header is here."""
    header = lines[index]
    if not header.lstrip().startswith("|") or "Command to confirm" not in header:
        return
    column = [cell.strip() for cell in header.strip().strip("|").split("|")].index(
        "Command to confirm"
    )
    for number in range(index + 2, len(lines)):
        row = lines[number]
        if not row.lstrip().startswith("|"):
            break
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
        spans = re.findall(r"`([^`]+)`", cells[column]) if column < len(cells) else []
        found = [s for s in spans if COMMANDY.match(s)]
        if not found:
            page.problems.append(f"{page.name}:{number + 1}: no command in 'Command to confirm'")
        for span in found:
            text, reason = _split_marker(span)
            page.commands.append(Command(page.name, number + 1, text, reason))


# --------------------------------------------------------------------------------------------
# What CI runs
# --------------------------------------------------------------------------------------------


def nox_sessions(noxfile: Path) -> tuple[set[str], list[str]]:
    """Session names defined in a noxfile, and its default sessions (nox.options.sessions)."""
    if not noxfile.exists():
        return set(), []
    tree = ast.parse(noxfile.read_text())
    names: set[str] = set()
    defaults: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for deco in node.decorator_list:
                target = deco.func if isinstance(deco, ast.Call) else deco
                if ast.unparse(target) in ("nox.session", "session"):
                    name = node.name
                    if isinstance(deco, ast.Call):
                        for kw in deco.keywords:
                            if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                                name = str(kw.value.value)
                    names.add(name)
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and ast.unparse(node.targets[0]) == "nox.options.sessions"
        ):
            defaults = [ast.literal_eval(elt) for elt in node.value.elts]  # type: ignore[attr-defined]
    return names, defaults


def nox_invocations(script: str) -> list[list[str]]:
    """The session lists of every `nox` call in a shell script ([] for a bare `nox`)."""
    calls = []
    for line in script.splitlines():
        line = line.split("#", 1)[0]
        for part in re.split(r"&&|\|\||;", line):
            words = shlex.split(part) if part.strip() else []
            words = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
            if (
                words[:1] == ["nox"]
                or words[:3] == [sys.executable, "-m", "nox"]
                or (len(words) > 2 and words[1:3] == ["-m", "nox"])
            ):
                calls.append(_session_args(words))
    return calls


def _session_args(words: list[str]) -> list[str]:
    sessions, taking = [], False
    for word in words:
        if word == "--":
            break
        if word in ("-s", "--session", "--sessions", "-e"):
            taking = True
            continue
        if word.startswith("-"):
            taking = False
            continue
        if taking:
            sessions.append(word)
    return sessions


def ci_commands(project: Path) -> set[str]:
    """Commands (normalised) that CI or a noxfile runs: .ci/run lines, the generated
    workflow's `run:` lines, and every noxfile's `session.run`/`session.install` calls."""
    found: set[str] = set()
    ci_run = ROOT / ".ci" / "run"
    if ci_run.exists():
        for line in ci_run.read_text().splitlines():
            for part in re.split(r"&&|\|\||;", line.split(" #", 1)[0]):
                if part.strip():
                    found.add(normalise(part))
    workflows = project / ".github" / "workflows"
    for workflow in sorted(workflows.glob("*.yml")) if workflows.exists() else []:
        for job in (yaml.safe_load(workflow.read_text()) or {}).get("jobs", {}).values():
            for step in job.get("steps", []):
                for line in str(step.get("run", "")).splitlines():
                    for part in re.split(r"&&|\|\||;", line):
                        if part.strip():
                            found.add(normalise(part))
    for noxfile in (ROOT / "noxfile.py", ROOT / "template" / "noxfile.py"):
        if not noxfile.exists():
            continue
        for node in ast.walk(ast.parse(noxfile.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in (
                "session.run",
                "session.install",
            ):
                args = [a.value for a in node.args if isinstance(a, ast.Constant)]
                if len(args) != len(node.args):
                    continue  # built from variables: not a literal command
                prefix = ["pip", "install"] if ast.unparse(node.func) == "session.install" else []
                found.add(normalise(shlex.join([*prefix, *map(str, args)])))
    return found


def normalise(command: str) -> str:
    """Compare commands as CI writes them: `python -m pip` is `pip`, version pins and quotes
    do not matter, whitespace collapses."""
    try:
        words = shlex.split(command)
    except ValueError:  # a fragment of a multi-line shell construct
        words = command.split()
    if words[:3] in (["python", "-m", "pip"], ["python3", "-m", "pip"]):
        words = ["pip", *words[3:]]
    if words[:2] == ["pip", "install"]:
        words = [
            "pip",
            "install",
            *(
                re.split(r"[<>=~!;]", w)[0]
                for w in words[2:]
                if w not in ("--upgrade", "-U", "--quiet", "-q")
            ),
        ]
    return " ".join(words)
