"""Changing an answer on update, as docs/updating.md says: what it deletes, adds and changes.

The page's table ("What a changed answer adds and removes") is read here and each row is
checked against a real `copier update -d question=answer` of a default project in which the
user added a case to a template test and wrote a test file of their own: the edited template
test is deleted all the same (the page says so and how to keep it), the user's own file stays.
A file the user deleted stays deleted on update, while `benchmarks/` keeps updating.
"""

from __future__ import annotations

import re
from pathlib import Path

import copier
import pytest
import yaml

from helpers import ROOT, copy_template_repo, git, git_init_commit, render, run
from test_release import release_revision
from test_update import conflict_markers, files_without_commit, skipped_on_update, update
from upgrade_notes import follow, parse_steps

pytestmark = pytest.mark.update

PACKAGE = "my_torch_project"
DOC = ROOT / "docs" / "updating.md"
SECTION = "### What a changed answer adds and removes"


def table_rows() -> dict[str, dict[str, set[str]]]:
    """{`question=answer`: {"D": paths, "A": paths, "M": paths}} from the page's table."""
    text = DOC.read_text()
    section = text[text.index(SECTION) :]
    rows: dict[str, dict[str, set[str]]] = {}
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = line.split(" | ")
        found = re.fullmatch(r"\| `-d (\S+)`", cells[0])
        if not found:
            continue

        def paths(cell: str) -> set[str]:
            names = re.findall(r"`([^`]+)`", cell)
            return {n.replace("<package>", PACKAGE) for n in names if re.search(r"\.\w+$", n)}

        rows[found[1]] = {"D": paths(cells[1]), "A": paths(cells[2]), "M": paths(cells[3])}
    return rows


def status(project: Path) -> dict[str, set[str]]:
    """Deleted, added (untracked) and modified paths after an update."""
    found: dict[str, set[str]] = {"D": set(), "A": set(), "M": set()}
    listed = run(["git", "status", "--porcelain", "--untracked-files=all"], project).stdout
    for line in listed.splitlines():
        code, path = line[:2].strip(), line[3:]
        found["A" if code == "??" else code].add(path)
    return found


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = copy_template_repo(tmp_path_factory.mktemp("answers") / "template")
    git(repo, "tag", "v1.0.0")
    return repo


def test_the_table_has_the_three_answers():
    assert set(table_rows()) == {"task=lm", "tracker=mlflow", "model=mlp"}


@pytest.mark.parametrize("answer", ["task=lm", "tracker=mlflow", "model=mlp"])
def test_a_changed_answer_changes_the_files_the_table_names(template, tmp_path, answer):
    project = render(tmp_path / "project", src=template, vcs_ref="v1.0.0")
    train_test = project / "tests" / "test_train.py"
    train_test.write_text(train_test.read_text() + "\n\ndef test_a_case_of_mine():\n    pass\n")
    (project / "tests" / "test_mine.py").write_text("def test_mine():\n    pass\n")
    git_init_commit(project, "rendered, with the user's tests")
    question, value = answer.split("=")

    copier.run_update(
        str(project), data={question: value}, defaults=True, overwrite=True, quiet=True
    )

    expected = table_rows()[answer]
    found = status(project)
    found["M"].discard(".copier-answers.yml")
    assert found == expected, f"docs/updating.md's row for -d {answer} is out of date"
    assert (project / "tests" / "test_mine.py").is_file()  # the user's own file: never deleted
    if question == "task":  # the edited template test went; the page's command restores it
        git(project, "restore", "--source=HEAD", "tests/test_train.py")
        assert "test_a_case_of_mine" in train_test.read_text()


def test_a_deleted_template_file_stays_deleted_and_benchmarks_still_update(template, tmp_path):
    project = render(tmp_path / "project", src=template, vcs_ref="v1.0.0")
    git_init_commit(project, "rendered")
    git(project, "rm", "-q", f"src/{PACKAGE}/benchmark.py")
    git(project, "commit", "-q", "-m", "no benchmark script")
    package = template / "template" / "src" / "{{ package_name }}"
    for name in ("benchmark.py", "benchmarks/__init__.py.jinja"):
        path = package / name
        path.write_text("# a change of the next release\n" + path.read_text())
    git(template, "commit", "-q", "-am", "release v1.1.0")
    git(template, "tag", "v1.1.0")
    try:
        copier.run_update(str(project), defaults=True, overwrite=True, quiet=True)
    finally:
        git(template, "tag", "-d", "v1.1.0")
        git(template, "reset", "-q", "--hard", "v1.0.0")
    assert not (project / "src" / PACKAGE / "benchmark.py").exists()
    assert git(project, "diff", "--name-only", "--diff-filter=U") == ""
    init = project / "src" / PACKAGE / "benchmarks" / "__init__.py"
    assert init.read_text().startswith("# a change of the next release")


# The commit released as v0.1.0, the last with the yes/no `tensorboard` question.
RELEASE_V010 = "11c99402b04b441478610d7af8187603415a5cc1"


def _history(tmp_path: Path, version: str, revision: str) -> Path:
    """This repository's history with two tags only: release `version` at `revision`, and the
    working tree committed as v1.0.0 (copier renders tags)."""
    history = tmp_path / "history"
    run(["git", "clone", "-q", "--no-checkout", ROOT, history], tmp_path)
    for tag in git(history, "tag", "--list").split():
        git(history, "tag", "-d", tag)
    git(history, "tag", f"v{version}", revision)
    current = copy_template_repo(tmp_path / "current")
    git(history, "fetch", "-q", str(current), "main")
    git(history, "tag", "v1.0.0", "FETCH_HEAD")
    return history


def _follow_and_compare(tmp_path: Path, history: Path, project: Path, answers: dict[str, object],
                        task: str, version: str) -> None:  # fmt: skip
    """The notes since `version`, followed; then the project is exactly a fresh copy's files
    (the user's README aside), whose whole suite the render matrix runs."""
    package = str(answers["project_name"]).replace("-", "_")
    follow(project, package, task, parse_steps((ROOT / "CHANGELOG.md").read_text(), version))
    fresh = files_without_commit(render(tmp_path / "fresh", answers, src=history, vcs_ref="v1.0.0"))
    updated = files_without_commit(project)
    assert sorted(updated) == sorted(fresh)
    differing = [name for name in fresh if updated[name] != fresh[name]]
    assert set(differing) <= set(skipped_on_update()), differing  # README.md, if changed


def test_a_v010_project_updates_by_the_notes_to_a_fresh_copy(tmp_path):
    """`tracker` replaced the `tensorboard` question: updating a v0.1.0 project made with
    tensorboard=true keeps TensorBoard as its tracker, and the old answer leaves the file.
    Then every Upgrade note since 0.1.0 applies, oldest first as docs/updating.md says, and
    the project is exactly a fresh copy's files (the user's README aside), whose whole suite
    the render matrix runs. (A project with edits follows the notes from 0.2.0: the kept
    example.)"""
    history = _history(tmp_path, "0.1.0", RELEASE_V010)
    answers = {"project_name": "tb-project", "tensorboard": True}
    project = render(tmp_path / "project", answers, src=history, vcs_ref="v0.1.0")
    git_init_commit(project, "rendered from v0.1.0")

    update(project, vcs_ref="v1.0.0", conflict="inline")

    recorded = yaml.safe_load((project / ".copier-answers.yml").read_text())
    assert recorded["tracker"] == "tensorboard" and "tensorboard" not in recorded
    config = (project / "src" / "tb_project" / "settings/groups.py").read_text()
    tracker = 'tracker: Literal["none", "tensorboard", "mlflow", "wandb"] = field(\n'
    assert tracker + '        default="tensorboard"' in config
    assert conflict_markers(project) == []
    _follow_and_compare(tmp_path, history, project, answers, "image", "0.1.0")


@pytest.mark.parametrize("task", ["image", "lm"])
def test_a_v030_project_updates_by_the_notes_to_a_fresh_copy(tmp_path, task):
    """The newest release's path (0.3.0, the last before the restructure of issue 52), as the
    0.1.0 path above: a project of each task updates with no conflict, and after the notes
    since 0.3.0 it is exactly a fresh copy."""
    history = _history(tmp_path, "0.3.0", release_revision("0.3.0"))
    answers = {"project_name": f"kept-{task}", "task": task}
    project = render(tmp_path / "project", answers, src=history, vcs_ref="v0.3.0")
    git_init_commit(project, "rendered from v0.3.0")
    update(project, vcs_ref="v1.0.0", conflict="inline")
    assert conflict_markers(project) == []
    _follow_and_compare(tmp_path, history, project, answers, task, "0.3.0")
