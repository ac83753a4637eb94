"""The CHANGELOG's Upgrade notes as steps a machine follows, the way a user reads them.

docs/updating.md ("Follow the Upgrade notes") gives the format to users; in short, a
bullet of an `### Upgrade notes` subsection is a step when it starts with one of these forms
(after an optional `In an image project, ` or `In a language-model project, `), and prose
otherwise:

- If `PATH` conflicts: keep your side. | take the template's side. | keep both sides, yours first.
  (optionally `conflicts where your side has `TEXT`` / `where the template's side has `TEXT``)
- Add to `PATH`, WHERE, unless it is there: + a fenced python block under the bullet.
  WHERE: at the end | to its imports | before/after `def NAME`/`class NAME` |
  at the end of `class NAME`.
- In `PATH`, remove `a`, `b` and `c` from the `from MODULE import` statement, if there.
- In `PATH` [and `PATH`...], replace `OLD` with `NEW`.
- Move your NOUN from `PATH` into `NAME` in `PATH`: + the fenced skeleton of NAME.

`follow` applies them to a project after `copier update`: conflicts first (every conflicted
file needs a resolve step, one per file), then the other steps in the notes' order. A bullet
that starts like a step but does not parse, or a step that cannot be applied, raises
`NoteError` naming the bullet: a note that cannot be followed literally fails the test.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

CONFLICT = re.compile(
    r"^<<<<<<< before updating\n(.*?)^=======\n(.*?)^>>>>>>> after updating\n", re.M | re.S
)
TASK_PREFIX = re.compile(r"In (an image|a language-model) project, (\w)")
STEP_START = re.compile(r"(If `|Add |In `|Move )")
PATHS = r"`[^`]+`(?:(?:,| and|, and) `[^`]+`)*"
FORMS = {
    "resolve": re.compile(
        r"If `(?P<path>[^`]+)` conflicts(?: where (?P<who>your side|the template's side) has "
        r"`(?P<text>[^`]+)`)?: (?P<side>keep your side|take the template's side|keep both "
        r"sides, yours first)\."
    ),
    "add": re.compile(
        r"Add to `(?P<path>[^`]+)`, (?P<where>at the end of `class \w+`|at the end|to its "
        r"imports|(?:before|after) `(?:def|class) \w+`), unless (?:it is|they are) there:"
    ),
    "remove": re.compile(
        r"In `(?P<path>[^`]+)`, remove (?P<names>" + PATHS + r") from the `from "
        r"(?P<module>[\w.]+) import` statement, if there\."
    ),
    "replace": re.compile(
        r"In (?P<paths>" + PATHS + r"), replace `(?P<old>[^`]+)` with `(?P<new>[^`]*)`\."
    ),
    "move": re.compile(
        r"Move your (?P<noun>[\w -]+?) from `(?P<source>[^`]+)` into `(?P<function>\w+)` in "
        r"`(?P<path>[^`]+)`:"
    ),
}
SIDES = {"keep your side": 1, "take the template's side": 2, "keep both sides, yours first": 3}


class NoteError(Exception):
    """A note that cannot be followed literally (or a conflict no note resolves)."""


@dataclass
class Step:
    kind: str
    bullet: str  # the bullet's words, whitespace collapsed, for messages
    where: str  # the section and subsection it came from
    task: str | None  # "image", "lm" or None (both)
    fields: dict[str, str] = field(default_factory=dict)
    code: str = ""  # the fenced block under the bullet, dedented


# --------------------------------------------------------------------------------------------
# Reading the notes
# --------------------------------------------------------------------------------------------


def sections_after(changelog: str, version: str) -> list[tuple[str, str]]:
    """(heading, text) of every `## [...]` section newer than release `version`, oldest
    first, so `[Unreleased]` comes last."""
    parts = re.split(r"^(## \[[^\]]+\][^\n]*)\n", changelog, flags=re.M)
    found = list(zip(parts[1::2], parts[2::2], strict=True))
    names = [heading.split("[")[1].split("]")[0] for heading, _ in found]
    if version not in names:
        raise NoteError(f"CHANGELOG.md has no section for release {version}")
    return list(reversed(found[: names.index(version)]))


def bullets(section: str) -> list[tuple[str, str, str]]:
    """(subsection heading, bullet prose, fenced code) of each top-level bullet under an
    `### Upgrade notes` heading of `section`."""
    found = []
    for match in re.finditer(
        r"^(### Upgrade notes[^\n]*)\n(.*?)(?=^### |\Z)", section, re.M | re.S
    ):
        heading, body = match[1], match[2]
        for item in re.split(r"^- ", body, flags=re.M)[1:]:
            lines = item.splitlines()
            end = next((i for i, line in enumerate(lines[1:], 1) if _outside(line)), len(lines))
            text = "\n".join(lines[:end])
            prose, _, rest = text.partition("```python\n")
            code = textwrap.dedent(rest.split("```")[0]) if rest else ""
            found.append((heading, " ".join(prose.split()), code))
    return found


def _outside(line: str) -> bool:
    """A line that ends a bullet: a heading or unindented text after it."""
    return bool(line) and not line.startswith(" ")


def parse_steps(changelog: str, version: str) -> list[Step]:
    """The steps of every Upgrade note newer than `version`, in the order to follow them."""
    steps = []
    for heading, text in sections_after(changelog, version):
        for subsection, prose, code in bullets(text):
            step = parse_bullet(prose, code, f"{heading} / {subsection}")
            if step is not None:
                steps.append(step)
    return steps


def parse_bullet(prose: str, code: str, where: str) -> Step | None:
    """The step a bullet asks for; None for prose; NoteError for a step in no known form."""
    task = None
    prefix = TASK_PREFIX.match(prose)
    if prefix:
        task = "image" if prefix[1] == "an image" else "lm"
        prose = prose[prefix.end() - 1 :]
        prose = prose[0].upper() + prose[1:]
    if not STEP_START.match(prose):
        if prefix:
            raise NoteError(f"{where}: a task prefix before no step: {prose!r}")
        return None
    for kind, form in FORMS.items():
        match = form.match(prose)
        if match:
            if kind in ("add", "move") and not code:
                raise NoteError(f"{where}: no ```python block under: {prose!r}")
            return Step(kind, prose, where, task, match.groupdict(), code)
    raise NoteError(f"{where}: starts like a step but matches no form: {prose!r}")


# --------------------------------------------------------------------------------------------
# Following them
# --------------------------------------------------------------------------------------------

Mover = Callable[[Path, Path, Step], None]  # (project, the file with the skeleton, the step)


def follow(
    project: Path,
    package: str,
    task: str,
    steps: list[Step],
    movers: dict[tuple[str, str], Mover] | None = None,
) -> dict[str, int]:
    """Resolve the conflicts and apply the steps; returns the conflict blocks per file."""
    steps = [step for step in steps if step.task in (None, task)]
    for step in steps:  # `<package>` is the user's package in every path
        for key in ("path", "paths", "source", "old", "new"):
            if key in step.fields and step.fields[key] is not None:
                step.fields[key] = step.fields[key].replace("<package>", package)
    blocks = resolve_conflicts(project, [s for s in steps if s.kind == "resolve"])
    for step in steps:
        if step.kind == "add":
            add_code(project / step.fields["path"], step)
        elif step.kind == "remove":
            remove_import(project / step.fields["path"], step)
        elif step.kind == "replace":
            replace_text(project, step)
        elif step.kind == "move":
            move_code(project, step, movers or {})
    return blocks


def conflicted_files(project: Path) -> dict[str, int]:
    """{path: number of `<<<<<<<` blocks} over the project's text files."""
    found = {}
    for path in sorted(project.rglob("*")):
        if not path.is_file() or ".git" in path.relative_to(project).parts:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        count = len(re.findall(r"^<<<<<<< ", text, re.M))
        if count:
            found[str(path.relative_to(project))] = count
    return found


def resolve_conflicts(project: Path, steps: list[Step]) -> dict[str, int]:
    blocks = conflicted_files(project)
    for name in blocks:
        rules = [step for step in steps if step.fields["path"] == name]
        general = {SIDES[step.fields["side"]] for step in rules if not step.fields["who"]}
        if len(general) > 1:
            raise NoteError(f"the Upgrade notes resolve {name} two ways: {_bullets(rules)}")

        def pick(block: re.Match[str], rules: list[Step] = rules, name: str = name) -> str:
            for step in rules:
                who, text = step.fields["who"], step.fields["text"]
                side = block[1] if who == "your side" else block[2]
                if who is None or text in side:
                    choice = SIDES[step.fields["side"]]
                    return block[1] + block[2] if choice == 3 else block[choice]
            raise NoteError(
                f"no Upgrade note says how to resolve this conflict in {name}:\n{block[0]}"
            )

        path = project / name
        rules.sort(key=lambda step: step.fields["who"] is None)  # the selective ones first
        path.write_text(CONFLICT.sub(pick, path.read_text()))
        if re.search(r"^(<<<<<<<|>>>>>>>) ", path.read_text(), re.M):
            raise NoteError(f"{name}: a conflict block in a form the follower cannot read")
    return blocks


def _bullets(steps: list[Step]) -> str:
    return "; ".join(f"{s.where}: {s.bullet!r}" for s in steps)


def _defined(body: list[ast.stmt]) -> set[str]:
    """Names a statement list defines: defs, classes, assignments, imports."""
    names = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _start(node: ast.stmt) -> int:
    """The first line of a statement, its decorators included (1-based)."""
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno, *(d.lineno for d in decorators)])


def _named(
    body: list[ast.stmt], kind: str, name: str, step: Step
) -> ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef:
    wanted = ast.ClassDef if kind == "class" else ast.FunctionDef | ast.AsyncFunctionDef
    for node in body:
        if isinstance(node, wanted) and node.name == name:
            return node
    raise NoteError(f"{step.where}: `{kind} {name}` is not in {step.fields['path']}: {step.bullet}")


def add_code(path: Path, step: Step, text: str | None = None) -> None:
    """Insert the statements of the step's block that `path` lacks, where the step says."""
    if not path.is_file():
        raise NoteError(f"{step.where}: {path.name} does not exist: {step.bullet!r}")
    text = path.read_text() if text is None else text
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    where = step.fields["where"]
    body, indent = tree.body, ""
    if where.startswith("at the end of `class"):
        cls = _named(tree.body, "class", where.split()[-1].strip("`"), step)
        body, indent = cls.body, " " * (cls.col_offset + 4)
    have = _defined(body)
    block = ast.parse(step.code)
    code_lines = step.code.splitlines(keepends=True)
    wanted = []
    for node in block.body:
        names = _defined([node])
        if names and names <= have:
            continue  # it is there
        segment = "".join(code_lines[_start(node) - 1 : node.end_lineno])
        wanted.append((node, textwrap.indent(segment, indent)))
    if not wanted:
        return
    spaced = any(isinstance(n, ast.FunctionDef | ast.ClassDef) for n, _ in wanted)
    joined = ("\n\n" if spaced else "").join(segment for _, segment in wanted)
    if where == "at the end":
        new = text.rstrip("\n") + ("\n\n\n" if spaced else "\n") + joined
    elif where == "to its imports":
        imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        at = imports[-1].end_lineno if imports else 0
        new = "".join(lines[:at]) + joined + "".join(lines[at:])
    elif where.startswith("at the end of `class"):
        at = cls.end_lineno
        joined = ("\n" if spaced else "") + joined  # a method after a blank line
        new = "".join(lines[:at]) + joined + "".join(lines[at:])
    else:
        side, kind, name = where.replace("`", "").split()
        node = _named(tree.body, kind, name, step)
        if side == "before":
            at = _start(node) - 1
            new = "".join(lines[:at]) + joined + "\n\n" + "".join(lines[at:])
        else:
            at = node.end_lineno
            new = "".join(lines[:at]) + "\n\n" + joined + "".join(lines[at:])
    ast.parse(new)  # what a step writes still parses
    path.write_text(new)


def remove_import(path: Path, step: Step) -> None:
    """Drop names from a `from MODULE import ...` statement (all of it when none remain)."""
    names = set(re.findall(r"`(\w+)`", step.fields["names"]))
    text = path.read_text()
    for node in ast.parse(text).body:
        if (
            isinstance(node, ast.ImportFrom)
            and "." * node.level + (node.module or "") == (step.fields["module"])
        ):
            kept = [a for a in node.names if a.name not in names]
            if len(kept) == len(node.names):
                continue
            lines = text.splitlines(keepends=True)
            module = step.fields["module"]
            if not kept:
                statement = ""
            elif len(kept) <= 2:
                statement = f"from {module} import {', '.join(_alias(a) for a in kept)}\n"
            else:
                inner = "".join(f"    {_alias(a)},\n" for a in kept)
                statement = f"from {module} import (\n{inner})\n"
            at, end = node.lineno - 1, node.end_lineno
            text = "".join(lines[:at]) + statement + "".join(lines[end:])
            break
    path.write_text(text)


def _alias(alias: ast.alias) -> str:
    return alias.name + (f" as {alias.asname}" if alias.asname else "")


def replace_text(project: Path, step: Step) -> None:
    patterns = re.findall(r"`([^`]+)`", step.fields["paths"])
    paths = sorted({path for pattern in patterns for path in project.glob(pattern)})
    if not paths:
        raise NoteError(f"{step.where}: no file matches {patterns}: {step.bullet!r}")
    for path in paths:
        text = path.read_text()
        path.write_text(text.replace(step.fields["old"], step.fields["new"]))


def move_code(project: Path, step: Step, movers: dict[tuple[str, str], Mover]) -> None:
    """Add the extension point's skeleton (the file too, if missing), then let the user put
    their lines into it: what they wrote is theirs to know, where it goes is the note's."""
    key = (step.fields["noun"], step.fields["function"])
    path = project / step.fields["path"]
    if not path.is_file():
        path.write_text('"""Our own code."""\n')
    skeleton = Step("add", step.bullet, step.where, step.task, {"where": "at the end"}, step.code)
    skeleton.fields["path"] = step.fields["path"]
    add_code(path, skeleton)
    if key[1] not in _defined(ast.parse(path.read_text()).body):  # a def, class or name
        raise NoteError(f"{step.where}: its block defines no `{key[1]}`: {step.bullet!r}")
    if key in movers:
        movers[key](project, path, step)
