"""The Upgrade notes' format (docs/updating.md, "Follow the Upgrade notes") and the
follower that executes it (tests/upgrade_notes.py), on made-up notes and on CHANGELOG.md's.

The kept example (test_update_kept_example.py) follows the real notes on a real update; these
tests are the fast part: every step of the notes newer than the last release parses, each form
does what its words say, a bullet that looks like a step but is in no form fails, and on a
project rendered from the working tree (where everything the notes add is already there)
following them changes nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import ROOT, render
from test_release import load_release_notes, previous_release
from upgrade_notes import NoteError, Step, bullets, follow, parse_bullet, parse_steps

pytestmark = pytest.mark.update

CHANGELOG = (ROOT / "CHANGELOG.md").read_text()
HERE = "made-up notes"


def steps_of(notes: str) -> list[Step]:
    found = [parse_bullet(prose, code, HERE) for _, prose, code in bullets(notes)]
    return [step for step in found if step is not None]


def notes(*items: str) -> str:
    return "### Upgrade notes (issue 0)\n\n" + "".join(f"- {item}\n" for item in items)


def test_every_step_of_the_unreleased_notes_parses():
    """The unreleased notes parse; and so does every note since the first release, which
    together use every kind of step (a new release may bring few of them)."""
    version, _ = previous_release(CHANGELOG)
    parse_steps(CHANGELOG, version)
    steps = parse_steps(CHANGELOG, "0.1.0")
    kinds = {step.kind for step in steps}
    assert {"resolve", "add", "remove", "replace"} <= kinds, kinds
    for step in steps:  # paths are the project's, with the package as <package>
        for key in ("path", "source"):
            if step.fields.get(key):
                assert re.fullmatch(r"(src/<package>|tests)/[\w/*.]+", step.fields[key]), step


def test_a_bullet_that_starts_like_a_step_must_be_one():
    with pytest.raises(NoteError, match="matches no form"):
        steps_of(notes("If `src/<package>/model.py` conflicts: keep yours."))
    with pytest.raises(NoteError, match="matches no form"):
        steps_of(notes("Add `depth` to `src/<package>/config.py`."))
    with pytest.raises(NoteError, match="no ```python block"):
        steps_of(notes("Add to `src/<package>/a.py`, at the end, unless it is there:"))
    with pytest.raises(NoteError, match="task prefix before no step"):
        steps_of(notes("In an image project, nothing changes."))
    assert steps_of(notes("If you rewrote `data.py`, copy it.", "Image folders are RGB.")) == []


OURS, THEIRS, END = "<" * 7 + " before updating\n", "=" * 7 + "\n", ">" * 7 + " after updating\n"
CONFLICTED = (  # built, so this file holds no line a conflict check would flag
    f'a = 1\n{OURS}x = "ours"\n{THEIRS}x = "theirs"\n{END}'
    f'{OURS}y = "ours"\n{THEIRS}y = "theirs, with ModelConfig"\n{END}'
)


@pytest.mark.parametrize(
    ("rules", "expected"),
    [
        (["keep your side"], 'a = 1\nx = "ours"\ny = "ours"\n'),
        (["take the template's side"], 'a = 1\nx = "theirs"\ny = "theirs, with ModelConfig"\n'),
        (
            ["keep both sides, yours first"],
            'a = 1\nx = "ours"\nx = "theirs"\ny = "ours"\ny = "theirs, with ModelConfig"\n',
        ),
        (
            [
                "keep your side",
                "where the template's side has `ModelConfig`: take the template's side",
            ],
            'a = 1\nx = "ours"\ny = "theirs, with ModelConfig"\n',
        ),
    ],
)
def test_resolve_steps_pick_the_sides_they_name(tmp_path, rules, expected):
    (tmp_path / "src/pkg").mkdir(parents=True)
    (tmp_path / "src/pkg/a.py").write_text(CONFLICTED)
    items = [
        f"If `src/<package>/a.py` conflicts{' ' if r.startswith('where') else ': '}{r}."
        for r in rules
    ]
    blocks = follow(tmp_path, "pkg", "image", steps_of(notes(*items)))
    assert blocks == {"src/pkg/a.py": 2}
    assert (tmp_path / "src/pkg/a.py").read_text() == expected


def test_a_conflict_no_note_resolves_and_two_ways_are_errors(tmp_path):
    (tmp_path / "a.py").write_text(CONFLICTED)
    (tmp_path / "b.py").write_text("")
    with pytest.raises(NoteError, match=r"no Upgrade note says how to resolve .* a\.py"):
        follow(tmp_path, "pkg", "image", steps_of(notes("If `b.py` conflicts: keep your side.")))
    twice = notes(
        "If `a.py` conflicts: keep your side.", "If `a.py` conflicts: take the template's side."
    )
    with pytest.raises(NoteError, match=r"resolve a\.py two ways"):
        follow(tmp_path, "pkg", "image", steps_of(twice))


MODULE = '''\
"""A user's module."""

from dataclasses import dataclass, field

from .config_parsing import (
    build_parser,
    load_toml,
    parse_config,
    set_leaves,
)


@dataclass
class RunConfig:
    seed: int = 0


def build_model() -> int:
    return 1
'''


def add(where: str, code: str, task: str = "") -> str:
    prefix = f"In {task} project, add" if task else "Add"
    block = "\n  ```python\n" + "".join(f"  {line}\n" for line in code.splitlines()) + "  ```"
    return f"{prefix} to `src/<package>/m.py`, {where}, unless it is there:{block}"


def test_add_steps_insert_where_they_say_and_only_what_is_missing(tmp_path):
    module = tmp_path / "src/pkg/m.py"
    module.parent.mkdir(parents=True)
    module.write_text(MODULE)
    steps = steps_of(
        notes(
            add("to its imports", "from pathlib import Path\nfrom dataclasses import field"),
            add("at the end of `class RunConfig`", "seed: int = 1\ndeep: bool = False"),
            add("before `def build_model`", "WIDTH = 8"),
            add("after `class RunConfig`", "def helper() -> int:\n    return 2"),
            add(
                "at the end",
                "def build_model() -> int:\n    return 3\n\n\ndef tail() -> None:\n    pass",
            ),
            add("at the end", "LM = True", task="a language-model"),
            "In `src/<package>/m.py`, remove `load_toml` and `parse_config` from the "
            "`from .config_parsing import` statement, if there.",
            "In `src/<package>/m.py` and `src/<package>/*.py`, replace `return 1` with `return 0`.",
        )
    )
    follow(tmp_path, "pkg", "image", steps)
    text = module.read_text()
    assert text == (
        '"""A user\'s module."""\n\nfrom dataclasses import dataclass, field\n\n'
        "from .config_parsing import build_parser, set_leaves\nfrom pathlib import Path\n\n\n"
        "@dataclass\nclass RunConfig:\n    seed: int = 0\n    deep: bool = False\n\n\n"
        "def helper() -> int:\n    return 2\n\n\nWIDTH = 8\n\n\n"
        "def build_model() -> int:\n    return 0\n\n\ndef tail() -> None:\n    pass\n"
    )
    follow(tmp_path, "pkg", "image", steps)  # a second time: nothing more to do
    assert module.read_text() == text


def test_add_and_move_fail_on_what_is_not_there(tmp_path):
    (tmp_path / "m.py").write_text(MODULE)
    missing = notes(add("after `def nowhere`", "X = 1").replace("src/<package>/", ""))
    with pytest.raises(NoteError, match=r"`def nowhere` is not in m\.py"):
        follow(tmp_path, "pkg", "image", steps_of(missing))
    gone = notes(add("at the end", "X = 1").replace("src/<package>/m.py", "gone.py"))
    with pytest.raises(NoteError, match=r"gone\.py does not exist"):
        follow(tmp_path, "pkg", "image", steps_of(gone))


def test_a_move_step_adds_the_skeleton_and_hands_the_body_to_the_user(tmp_path):
    skeleton = "def extras(model, loader) -> dict:\n    return {}"
    block = "\n  ```python\n" + "".join(f"  {line}\n" for line in skeleton.splitlines()) + "  ```"
    move = f"Move your own metrics from `train.py` into `extras` in `hooks.py`:{block}"
    seen = []

    def user(project: Path, path: Path, step: Step) -> None:
        seen.append(step.fields["noun"])
        path.write_text(path.read_text().replace("return {}", 'return {"mine": 1.0}'))

    follow(tmp_path, "pkg", "image", steps_of(notes(move)), {("own metrics", "extras"): user})
    assert seen == ["own metrics"]
    assert (
        'def extras(model, loader) -> dict:\n    return {"mine": 1.0}\n'
        in (tmp_path / "hooks.py").read_text()
    )


@pytest.mark.parametrize("task", ["image", "lm"])
def test_following_the_notes_on_a_render_of_the_working_tree_changes_nothing(tmp_path, task):
    """Everything the notes add is in the template already, under the names they use: on an
    up-to-date project every step is a no-op (a step that adds code the template lacks, or
    replaces text in its tests, would change it)."""
    project = render(tmp_path / "p", {"project_name": "noted", "task": task})
    files = {p: p.read_bytes() for p in project.rglob("*.py")}
    version, _ = previous_release(CHANGELOG)
    resolve_free = [s for s in parse_steps(CHANGELOG, version) if s.kind not in ("resolve", "move")]
    follow(project, "noted", task, resolve_free)
    changed = [str(p.relative_to(project)) for p, data in files.items() if p.read_bytes() != data]
    assert changed == []


def test_every_release_section_has_its_version_date_and_upgrade_notes():
    """Not only the newest (test_release): each `## [X.Y.Z] - date` section carries its own
    Upgrade notes, so a user several releases behind finds every release's steps; the first
    release, which nothing updates to, has a date."""
    release_notes = load_release_notes()
    versions = [v for v in release_notes.sections(CHANGELOG) if v != "Unreleased"]
    assert len(versions) >= 2, versions
    for version in versions[:-1]:
        assert "### Upgrade notes" in release_notes.release_section(CHANGELOG, version)
    with pytest.raises(ValueError, match="no '### Upgrade notes'"):
        release_notes.release_section(CHANGELOG, versions[-1])  # the first: dated, no notes
    assert next(iter(release_notes.sections(CHANGELOG))) == "Unreleased"
