"""`copier update` end to end, offline, in temporary git repositories.

A copy of this template repository plays the published template: tagged `v1.0.0`, a project is
rendered from it and committed, the user edits the project, the template changes and is tagged
`v1.1.0`, and the project is updated. The user's edits must survive, the template change must
arrive, and a real conflict must be visible, never silently resolved.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import copier
import pytest
import yaml
from copier.errors import UserMessageError

from helpers import ROOT, copy_template_repo, git, git_init_commit, render, run

pytestmark = pytest.mark.update

PACKAGE = "upd_project"
TEMPLATE_UTILS = "template/src/{{ package_name }}/utils.py"

USER_LAYER = '''

class ScaleShift(nn.Module):
    """The user's own layer: a learned per-feature affine map."""

    def __init__(self, features: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(features))
        self.shift = nn.Parameter(torch.zeros(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift

'''

USER_TEST = f'''"""The user's test of their own layer."""

import torch

from {PACKAGE}.config import Config
from {PACKAGE}.model import ScaleShift


def test_scale_shift_starts_as_identity():
    x = torch.randn(4, 3)
    assert torch.equal(ScaleShift(3)(x), x)


def test_user_changed_the_default_epochs():
    assert Config().optim.epochs == 7
'''

# A changed default, where config.py keeps them: an argument in its group's line of `Config`.
OPTIM_LINE = r"(optim: OptimConfig = field\(default_factory=)OptimConfig\)"
OUR_EPOCHS = r"\1lambda: OptimConfig(epochs=7))"

TEMPLATE_ADDITION = '''

def template_release() -> str:
    """The template release this file came from (added in v1.1.0)."""
    return "1.1.0"
'''


def edit(path: Path, pattern: str, replacement: str) -> None:
    """Apply a regex edit that must match exactly once (so a drifted file fails loudly)."""
    text, count = re.subn(pattern, replacement, path.read_text(), flags=re.M)
    assert count == 1, f"{pattern!r} matched {count} times in {path}"
    path.write_text(text)


def commit_all(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)


def update(project: Path, **kwargs: Any) -> None:
    copier.run_update(
        str(project), defaults=True, overwrite=True, unsafe=False, quiet=True, **kwargs
    )


def conflict_markers(project: Path) -> list[str]:
    return [
        str(path.relative_to(project))
        for path in project.rglob("*")
        if path.is_file() and ".git" not in path.parts and "<<<<<<<" in path.read_text("utf-8")
    ]


@pytest.fixture
def template_v1(tmp_path: Path) -> Path:
    repo = copy_template_repo(tmp_path / "template")
    git(repo, "tag", "v1.0.0")
    return repo


@pytest.fixture
def project(template_v1: Path, tmp_path: Path) -> Path:
    project = render(
        tmp_path / "project", {"project_name": "upd-project"}, src=template_v1, vcs_ref="v1.0.0"
    )
    git_init_commit(project, "rendered from the template v1.0.0")
    return project


def release_v11(repo: Path, path: str, pattern: str, replacement: str) -> None:
    edit(repo / path, pattern, replacement)
    commit_all(repo, "template change")
    git(repo, "tag", "v1.1.0")


def check_update_step(project: Path) -> str:
    """Run the generated CI workflow's template-update step as CI would, return its output."""
    workflow = yaml.safe_load((project / ".github/workflows/ci.yml").read_text())
    (step,) = [
        s
        for s in workflow["jobs"]["template-update"]["steps"]
        if "check-update" in s.get("run", "")
    ]
    bin_dir = str(Path(sys.executable).parent)  # where this environment's `copier` lives
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"]}
    result = subprocess.run(
        ["bash", "-eo", "pipefail", "-c", step["run"]],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_copier_under_test_is_the_one_expected():
    """The `update` and `tests` nox sessions rerun these tests on copier.yml's minimum copier,
    installed apart and put first on PYTHONPATH: prove that it, not the newer one, ran."""
    expected = os.environ.get("EXPECT_COPIER_VERSION")
    if not expected:
        pytest.skip("EXPECT_COPIER_VERSION not set: the environment's copier runs")
    assert copier.__version__ == expected
    cli = run([sys.executable, "-m", "copier", "--version"], ROOT)
    assert expected in cli.stdout + cli.stderr


def test_the_minimum_copier_version_is_the_same_everywhere():
    """copier.yml's _min_copier_version, the nox session that tests it, and every pin shown to
    users or installed by CI name the same version (the oldest with `copier check-update`)."""
    minimum = yaml.safe_load((ROOT / "copier.yml").read_text())["_min_copier_version"]
    major, minor = minimum.split(".")[:2]
    assert (int(major), int(minor)) >= (9, 13), "copier check-update needs copier 9.13.0"
    pin = f"copier>={major}.{minor},<{int(major) + 1}"
    assert f'MIN_COPIER = "{minimum}"' in (ROOT / "noxfile.py").read_text()
    places = [
        ROOT / "nox_env.py",  # the shared environment's copier (noxfile.py's env session)
        ROOT / "README.md",
        ROOT / "docs" / "updating.md",
        ROOT
        / "template"
        / "{% if github_actions %}.github{% endif %}"
        / "workflows"
        / "ci.yml.jinja",
    ]
    problems = []
    for place in places:
        text = place.read_text()
        pins = re.findall(r"copier>=[0-9.]+,<[0-9]+", text)
        if not pins or set(pins) != {pin}:
            problems.append(f"{place.relative_to(ROOT)}: {pins or 'no copier pin'}, want {pin}")
    assert not problems, "\n".join(problems)


def test_user_edits_survive_and_the_template_change_arrives(template_v1, project):
    package = project / "src" / PACKAGE
    edit(package / "model.py", r"^(?=def _fp32_adamw_bytes\()", USER_LAYER.lstrip("\n"))
    edit(package / "config.py", OPTIM_LINE, OUR_EPOCHS)
    (project / "tests" / "test_user_layer.py").write_text(USER_TEST)
    commit_all(project, "user edits: a layer, a default, a test")
    assert "up to date" in check_update_step(project)

    release_v11(template_v1, TEMPLATE_UTILS, r"\Z", TEMPLATE_ADDITION)
    assert "Template update available" in check_update_step(project)
    update(project)

    assert "class ScaleShift(nn.Module):" in (package / "model.py").read_text()
    assert "lambda: OptimConfig(epochs=7)" in (package / "config.py").read_text()
    assert (project / "tests" / "test_user_layer.py").read_text() == USER_TEST
    assert 'return "1.1.0"' in (package / "utils.py").read_text()
    assert conflict_markers(project) == []
    assert not list(project.rglob("*.rej"))
    answers = yaml.safe_load((project / ".copier-answers.yml").read_text())
    assert answers["_commit"] == "v1.1.0"
    assert "up to date" in check_update_step(project)
    # The user's tests and the template's tests of the changed file, against the merged code.
    utils_tests = sorted(str(p.relative_to(project)) for p in project.glob("tests/test_utils*.py"))
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    selected = ["-m", "not gpu and not slow", "tests/test_user_layer.py", *utils_tests]
    run([*pytest, *selected], project, env={"PYTHONPATH": str(project / "src")})


def test_a_real_conflict_is_marked_inline_and_fails_the_check(template_v1, project):
    utils = project / "src" / PACKAGE / "utils.py"
    first_line = utils.read_text().splitlines()[0]
    edit(utils, r"\A.*$", '"""USER: my own summary of the utilities.')
    commit_all(project, "user rewrites the utils summary line")
    release_v11(template_v1, TEMPLATE_UTILS, r"\A.*$", '"""TEMPLATE: a new summary line.')

    update(project, conflict="inline")

    text = utils.read_text()
    assert conflict_markers(project) == [f"src/{PACKAGE}/utils.py"]
    assert "USER: my own summary" in text and "TEMPLATE: a new summary line" in text
    assert first_line not in text.split(">>>>>>>")[-1]  # the old line is not silently kept
    check = subprocess.run(["git", "diff", "--check"], cwd=project, capture_output=True, text=True)
    assert check.returncode != 0 and "conflict marker" in check.stdout


def test_conflict_rej_is_silent_to_every_check_but_the_one_the_docs_add(template_v1, project):
    """`--conflict rej` (docs/updating.md offers it) puts the template's line in the file, the
    user's change only in a `.rej` file, nothing unmerged, exit 0: a silent revert that the
    markers checks cannot see, so the docs' Update block lists untracked `*.rej` files. That
    command, read from the page, must name the reject, and print nothing once it is applied and
    deleted."""
    doc = (ROOT / "docs" / "updating.md").read_text()
    (check,) = set(re.findall(r"^(git ls-files --others '\*\.rej')\s", doc, re.M))
    utils = project / "src" / PACKAGE / "utils.py"
    edit(utils, r"\A.*$", '"""USER: my own summary of the utilities.')
    commit_all(project, "user rewrites the utils summary line")
    release_v11(template_v1, TEMPLATE_UTILS, r"\A.*$", '"""TEMPLATE: a new summary line.')

    result = copier_cli(project, "update", "--defaults", "--conflict", "rej")

    assert result.returncode == 0, result.stderr
    assert utils.read_text().startswith('"""TEMPLATE: a new summary')  # the user's line: gone
    assert git_lines(project, "diff", "--name-only", "--diff-filter=U") == []
    assert run(["git", "diff", "--check"], project, check=False).returncode == 0
    assert conflict_markers(project) == []
    rejects = run(shlex.split(check), project).stdout.split()
    assert rejects == [f"src/{PACKAGE}/utils.py.rej"]
    assert '+"""USER: my own summary' in (project / rejects[0]).read_text()
    edit(utils, r"\A.*$", '"""USER: my own summary of the utilities.')  # as the docs say
    (project / rejects[0]).unlink()
    assert run(shlex.split(check), project).stdout == ""


def test_a_dirty_project_is_refused(template_v1, project):
    model = project / "src" / PACKAGE / "model.py"
    model.write_text(model.read_text() + "\n# not committed yet\n")
    release_v11(template_v1, TEMPLATE_UTILS, r"\Z", TEMPLATE_ADDITION)

    with pytest.raises(UserMessageError, match="dirty; cannot continue") as excinfo:
        update(project)
    assert "\n" not in str(excinfo.value)
    cli = subprocess.run(
        [sys.executable, "-m", "copier", "update", "--defaults", str(project)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert cli.returncode != 0
    assert cli.stderr.strip().splitlines()[-1].startswith("Destination repository is dirty")
    assert "Traceback" not in cli.stderr
    assert model.read_text().endswith("# not committed yet\n")
    assert "template_release" not in (project / "src" / PACKAGE / "utils.py").read_text()


# How many of the repository's own latest commits that render the history test replays.
HISTORY_DEPTH = 5
HISTORY_CANDIDATES = 12


def skipped_on_update() -> list[str]:
    """Files copier writes once and never updates (`_skip_if_exists`): README.md."""
    skipped = yaml.safe_load((ROOT / "copier.yml").read_text())["_skip_if_exists"]
    assert skipped == ["README.md"], "a new skipped file needs its own docs and update test"
    return skipped


def files_without_commit(project: Path) -> dict[str, bytes]:
    """Every file's bytes, with the answers file's `_commit` line left out."""
    files = {}
    for path in sorted(project.rglob("*")):
        if path.is_file() and ".git" not in path.relative_to(project).parts:
            data = path.read_bytes()
            if path.name == ".copier-answers.yml":
                data = re.sub(rb"(?m)^_commit:.*\n", b"", data)
            files[str(path.relative_to(project))] = data
    return files


def test_update_from_earlier_commits_equals_a_fresh_copy(tmp_path):
    """For this repository's latest commits that render, updating a project made from them to
    the current working tree gives exactly the files of a fresh copy of the working tree."""
    history = tmp_path / "history"
    run(["git", "clone", "-q", "--no-checkout", ROOT, history], tmp_path)
    for tag in git(history, "tag", "--list").split():
        git(history, "tag", "-d", tag)  # our own version tags below must be the only ones
    commits = git(history, "log", "--format=%H", f"-n{HISTORY_CANDIDATES}", "HEAD").split()
    for age, commit in enumerate(commits):
        git(history, "tag", f"v0.0.{len(commits) - age}", commit)
    # The target: the working tree, as one more commit (the same content `vcs_ref=HEAD` renders).
    current = copy_template_repo(tmp_path / "current")
    git(history, "fetch", "-q", str(current), "main")
    git(history, "tag", "v1.0.0", "FETCH_HEAD")

    answers = {"project_name": "history-project"}
    fresh = files_without_commit(render(tmp_path / "fresh", answers, src=history, vcs_ref="v1.0.0"))
    replayed = []
    for age, commit in enumerate(commits):
        if len(replayed) == HISTORY_DEPTH:
            break
        old = tmp_path / f"old-{age}"
        try:
            render(old, answers, src=history, vcs_ref=f"v0.0.{len(commits) - age}")
        except Exception:  # a commit from before the template rendered (or mid-refactor)
            continue
        git_init_commit(old, f"rendered from {commit}")
        update(old, vcs_ref="v1.0.0", conflict="inline")
        updated = files_without_commit(old)
        assert sorted(updated) == sorted(fresh), f"file list differs after update from {commit}"
        for name in skipped_on_update():  # the user's once copied: kept as they were
            updated[name] = fresh[name]
        differing = [name for name in fresh if updated[name] != fresh[name]]
        assert not differing, f"update from {commit[:10]} differs from a fresh copy: {differing}"
        replayed.append(commit)
    assert replayed, "no earlier commit of this repository renders"
    print(f"updates from {len(replayed)} commits equal a fresh copy: {[c[:10] for c in replayed]}")


# --------------------------------------------------------------------------------------------
# The commands docs/updating.md gives, run as a user runs them (the copier CLI, then git).
# --------------------------------------------------------------------------------------------

USER_README = "# upd-project\n\nOur own README: what this project is for, results, contacts.\n"
TEMPLATE_CLIP_TEST = "template/tests/test_utils_clip.py.jinja"


def copier_cli(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "copier", *args], project, check=False)


def git_lines(project: Path, *args: str) -> list[str]:
    return git(project, *args).splitlines()


def tree(project: Path) -> dict[str, bytes]:
    """Every file outside .git, ignored ones included, with its bytes."""
    return {
        str(p.relative_to(project)): p.read_bytes()
        for p in sorted(project.rglob("*"))
        if p.is_file() and ".git" not in p.relative_to(project).parts
    }


def test_conflicts_renames_and_the_readme_behave_as_the_docs_say(template_v1, project):
    """A release that changes the template's README and reference page, renames a test file
    the user edited and changes a line the user changed: the user's README is left alone, the
    conflict is found by `git diff --diff-filter=U` (copier says nothing, exit 0), the renamed
    file's lines are in HEAD, and `git reset --hard` + `git clean -fd` undo it all."""
    package = project / "src" / PACKAGE
    (project / "README.md").write_text(USER_README)
    edit(package / "utils.py", r"\A.*$", '"""USER: my own summary of the utilities.')
    clip_test = project / "tests" / "test_utils_clip.py"
    clip_test.write_text(clip_test.read_text() + "\n\n# USER: a case of our own\n")
    commit_all(project, "user edits")
    (project / "runs" / "default").mkdir(parents=True)
    (project / "runs" / "default" / "metrics.jsonl").write_text("{}\n")  # ignored by git
    before = tree(project)

    edit(template_v1 / "template/README.md.jinja", r"rewrite it\.", "make it yours.")
    edit(template_v1 / "template/docs/template.md.jinja", r"^## Quick start$", "## First steps")
    edit(template_v1 / TEMPLATE_UTILS, r"\A.*$", '"""TEMPLATE: a new summary line.')
    git(template_v1, "mv", TEMPLATE_CLIP_TEST, "template/tests/test_clipping.py.jinja")
    commit_all(template_v1, "template: new texts, a rename, a changed line")
    git(template_v1, "tag", "v1.1.0")

    result = copier_cli(project, "update", "--defaults")
    assert result.returncode == 0, result.stderr
    assert "conflict" not in (result.stdout + result.stderr).lower()  # copier says nothing
    assert git_lines(project, "diff", "--name-only", "--diff-filter=U") == [
        f"src/{PACKAGE}/utils.py"
    ]
    assert (project / "README.md").read_text() == USER_README  # never touched
    assert "## First steps" in (project / "docs" / "template.md").read_text()  # updated
    deleted = git_lines(project, "diff", "--name-only", "--diff-filter=D", "HEAD")
    assert deleted == ["tests/test_utils_clip.py"]
    assert "# USER: a case of our own" in git(project, "show", "HEAD:tests/test_utils_clip.py")
    assert (project / "tests" / "test_clipping.py").is_file()

    # The recovery the docs no longer give fails on unmerged files; the one they give works.
    old_way = run(["git", "checkout", "--", "."], project, check=False)
    assert old_way.returncode != 0 and "unmerged" in old_way.stderr
    assert git_lines(project, "clean", "-nd") == ["Would remove tests/test_clipping.py"]
    git(project, "reset", "--hard")
    git(project, "clean", "-fd")
    assert tree(project) == before  # runs/ (ignored) kept, every tracked file as committed
    assert git(project, "status", "--porcelain") == ""


def test_a_hand_edited_answer_is_recovered_as_the_docs_say(template_v1, project):
    answers = project / ".copier-answers.yml"
    edit(answers, r"^package_name: .*$", "package_name: class")
    commit_all(project, "hand-edit the answers file")
    release_v11(template_v1, TEMPLATE_UTILS, r"\Z", TEMPLATE_ADDITION)

    assert copier_cli(project, "update", "--defaults").returncode != 0
    forced = copier_cli(project, "update", "--defaults", "-d", f"package_name={PACKAGE}")
    assert forced.returncode != 0  # -d does not get past a bad recorded answer
    assert git(project, "status", "--porcelain") == ""  # and nothing was written

    assert git_lines(project, "log", "--oneline", "--", ".copier-answers.yml")
    git(project, "checkout", "HEAD~1", "--", ".copier-answers.yml")
    git(project, "commit", "-q", "-m", "Restore the answers copier recorded")
    result = copier_cli(project, "update", "--defaults")
    assert result.returncode == 0, result.stderr
    assert 'return "1.1.0"' in (project / "src" / PACKAGE / "utils.py").read_text()
    assert f"package_name: {PACKAGE}" in answers.read_text()


BOTH_SIDES = r"<<<<<<< [^\n]*\n(.*?)=======\n.*?>>>>>>> [^\n]*\n"


def test_the_package_is_renamed_as_the_docs_say(template_v1, project):
    """Update to the newest release first; then git mv, fix the imports, commit, and
    `copier update --vcs-ref=:current: -d package_name=...`: the user's edits and own tests
    move with the package, and every conflict's `before updating` side is the user's file."""
    old, new = project / "src" / PACKAGE, project / "src" / "renamed_pkg"
    edit(old / "model.py", r"^(?=def _fp32_adamw_bytes\()", USER_LAYER.lstrip("\n"))
    edit(old / "config.py", OPTIM_LINE, OUR_EPOCHS)
    (project / "tests" / "test_user_layer.py").write_text(USER_TEST)
    commit_all(project, "user edits")
    release_v11(template_v1, TEMPLATE_UTILS, r"\Z", TEMPLATE_ADDITION)
    assert copier_cli(project, "update", "--defaults").returncode == 0
    commit_all(project, "Update from the template")

    git(project, "mv", f"src/{PACKAGE}", "src/renamed_pkg")
    for name in git_lines(project, "grep", "-l", PACKAGE, "--", "src", "tests", "README.md"):
        path = project / name
        path.write_text(path.read_text().replace(PACKAGE, "renamed_pkg"))
    git(project, "commit", "-q", "-am", "Rename the package to renamed_pkg")
    result = copier_cli(
        project, "update", "--defaults", "--vcs-ref=:current:", "-d", "package_name=renamed_pkg"
    )
    assert result.returncode == 0, result.stderr

    conflicted = git_lines(project, "diff", "--name-only", "--diff-filter=U")
    assert set(conflicted) <= {"src/renamed_pkg/model.py", "src/renamed_pkg/config.py"}
    for name in conflicted:  # the docs: keep the `before updating` side (the user's version)
        path = project / name
        ours = re.sub(BOTH_SIDES, r"\1", path.read_text(), flags=re.S)
        path.write_text(ours)
        assert "=======" not in path.read_text()
    assert not old.exists()
    assert "class ScaleShift(nn.Module):" in (new / "model.py").read_text()
    assert 'return "1.1.0"' in (new / "utils.py").read_text()
    assert yaml.safe_load((project / ".copier-answers.yml").read_text())["_commit"] == "v1.1.0"
    grep = run(["git", "grep", "-l", PACKAGE, "--", "."], project, check=False)
    assert grep.stdout.split() == [], "the old name is left in these files"
    run_tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    env = {"PYTHONPATH": str(project / "src")}
    run([*run_tests, "tests/test_user_layer.py", "tests/test_utils_clip.py"], project, env=env)
