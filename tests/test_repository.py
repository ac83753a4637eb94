"""The template repository as a project others adopt: its license, its own CI and release
workflows, its pre-commit hooks.

The workflows cannot drift from .ci/run: ci.yml runs `bash .ci/run` and no other command, on
the oldest and newest Python the template offers, and .ci/run runs the README's test command;
release.yml's command that reads the CHANGELOG is run here exactly as the workflow writes it.
The pre-commit config is checked as the generated one is (tests/test_tooling.py): ruff at the
one pinned version, the hygiene hooks, and every tracked file passing them.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import ROOT
from test_tooling import CONFLICT_MARKER, HYGIENE_HOOKS, load_module

WORKFLOWS = ROOT / ".github" / "workflows"
# `uses: owner/name@<full commit sha>  # vX.Y.Z`: a tag can be moved, a commit cannot.
PINNED_ACTION = re.compile(r"^\s*- uses: [\w.-]+/[\w.-]+@[0-9a-f]{40}  # v\d+\.\d+\.\d+$")


def workflow(name: str) -> dict[Any, Any]:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True)  # YAML 1.1 reads the key `on` as a boolean
    return dict(data)


def run_lines(job: dict[str, Any]) -> list[str]:
    return [step["run"].strip() for step in job["steps"] if "run" in step]


def nox_sessions(command: str) -> list[str]:
    """`nox -s a b c` -> [a, b, c]."""
    words = shlex.split(command)
    assert words[:2] == ["nox", "-s"], command
    return words[2:]


def python_choices() -> list[str]:
    questions = yaml.safe_load((ROOT / "copier.yml").read_text())
    return sorted(
        questions["python_version"]["choices"], key=lambda v: tuple(map(int, v.split(".")))
    )


@pytest.mark.parametrize("name", ["ci.yml", "release.yml"])
def test_workflows_read_only_by_default_with_pinned_actions_and_time_limits(name):
    text = (WORKFLOWS / name).read_text()
    data = workflow(name)
    assert data["permissions"] == {"contents": "read"}, "least privilege at the top level"
    assert "${{ github.ref }}" in data["concurrency"]["group"]
    uses = [line for line in text.splitlines() if "uses:" in line]
    assert uses, name
    unpinned = [line.strip() for line in uses if not PINNED_ACTION.match(line)]
    assert not unpinned, f"{name}: pin every action to a commit, its tag in a comment: {unpinned}"
    for job_name, job in data["jobs"].items():
        assert job["timeout-minutes"] <= 60, job_name
        for step in job["steps"]:
            if "actions/checkout" in step.get("uses", ""):
                assert step["with"]["persist-credentials"] is False, "no token left in .git"


def test_ci_runs_ci_run_and_nothing_else_on_the_oldest_and_newest_python():
    data = workflow("ci.yml")
    assert {"push", "pull_request", "schedule", "workflow_dispatch"} <= set(data["on"])
    assert data["on"]["push"] == {"branches": ["**"]}, "a fork's branches are tested too"
    assert re.fullmatch(r"\d+ \d+ \* \* [0-6]", data["on"]["schedule"][0]["cron"]), "weekly"
    assert data["concurrency"]["cancel-in-progress"] is True
    (job,) = data["jobs"].values()
    assert run_lines(job) == ["bash .ci/run"], "CI runs .ci/run, so the two cannot drift"
    choices = python_choices()
    assert job["strategy"]["matrix"]["python"] == [choices[0], choices[-1]]
    # The README's command as written: TORCH_BACKEND's default, `auto`, takes the CPU build on
    # a runner without a GPU (tests/test_torch_install.py).
    assert "TORCH_BACKEND" not in job["env"]
    (checkout,) = [step for step in job["steps"] if "actions/checkout" in step.get("uses", "")]
    assert checkout["with"]["fetch-depth"] == 0, "the update and release tests read history"


def test_ci_run_runs_the_readme_test_command_docs_build_included():
    ci_run = [
        line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("nox")
    ]
    (command,) = ci_run
    readme = (ROOT / "README.md").read_text()
    full_suite = re.search(r"^(nox -s demo [^#\n]*?)\s+# the full test suite", readme, re.M)
    assert full_suite, "README's test command"
    noxfile = load_module(ROOT / "noxfile.py", "template_repo_noxfile_ci")
    sessions = nox_sessions(command)
    assert sessions == nox_sessions(full_suite[1]) == noxfile.nox.options.sessions
    assert {"tests", "lint", "typecheck", "docs"} <= set(sessions)


def test_release_runs_on_version_tags_and_only_it_may_write():
    data = workflow("release.yml")
    assert data["on"] == {"push": {"tags": ["v*"]}}
    (job,) = data["jobs"].values()
    assert job["permissions"] == {"contents": "write"}
    notes, create = run_lines(job)
    assert notes == 'python3 .ci/release_notes.py "$GITHUB_REF_NAME" > release-notes.md'
    assert 'gh release create "$GITHUB_REF_NAME" --verify-tag' in create
    assert "--notes-file release-notes.md" in create


def _release_step(tmp_path: Path, tag: str) -> subprocess.CompletedProcess[str]:
    """release.yml's notes step, as written there, for `tag` (in a folder whose .ci is ours)."""
    (job,) = workflow("release.yml")["jobs"].values()
    (tmp_path / ".ci").symlink_to(ROOT / ".ci")
    env = {"PATH": "/usr/bin:/bin", "GITHUB_REF_NAME": tag}
    return subprocess.run(
        ["bash", "-e", "-c", run_lines(job)[0]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_release_notes_step_gives_the_newest_sections_text_and_refuses_a_version_without_one(
    tmp_path,
):
    release_notes = load_module(ROOT / ".ci" / "release_notes.py", "release_notes")
    changelog = (ROOT / "CHANGELOG.md").read_text()
    version = release_notes.newest_release(changelog)
    (tmp_path / "ok").mkdir()
    made = _release_step(tmp_path / "ok", f"v{version}")
    assert made.returncode == 0, made.stderr
    notes = (tmp_path / "ok" / "release-notes.md").read_text()
    assert notes.startswith("### ") and "### Upgrade notes" in notes
    assert notes.strip() in changelog and f"## [{version}]" not in notes
    (tmp_path / "bad").mkdir()
    refused = _release_step(tmp_path / "bad", "v99.0.0")
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        "CHANGELOG.md has no '## [99.0.0] - YYYY-MM-DD' section; nothing released "
        "(docs/releasing.md)"
    )


def test_pre_commit_pins_the_ruff_everything_else_uses_and_runs_the_hygiene_hooks():
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    revs = {repo["repo"].rsplit("/", 1)[-1]: repo["rev"] for repo in config["repos"]}
    environment = load_module(ROOT / "nox_env.py", "template_repo_nox_env_pre_commit")
    ruff = environment.pinned("ruff").removeprefix("ruff==")  # the generated projects' lint pin
    assert revs["ruff-pre-commit"] == f"v{ruff}"
    generated = yaml.safe_load((ROOT / "template" / ".pre-commit-config.yaml").read_text())
    assert revs == {r["repo"].rsplit("/", 1)[-1]: r["rev"] for r in generated["repos"]}
    hook_ids = {hook["id"] for repo in config["repos"] for hook in repo["hooks"]}
    assert hook_ids >= HYGIENE_HOOKS | {"ruff-check", "ruff-format"}


def test_every_tracked_file_passes_the_hygiene_hooks():
    """What the hooks check (they are fetched from GitHub, which tests cannot reach), over the
    files git tracks plus the new ones it would add. Conflict markers count outside fenced
    blocks only: docs/updating.md shows what one looks like."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    paths = [ROOT / name for name in listed if (ROOT / name).is_file()]
    assert len(paths) > 100
    for path in paths:
        relative, data = path.relative_to(ROOT).as_posix(), path.read_bytes()
        assert len(data) <= 1000 * 1024, f"{relative} is over 1000 KB"
        text = data.decode()
        assert not text or (text.endswith("\n") and not text.endswith("\n\n")), relative
        assert not re.search(r"[ \t]+$", text, re.M), f"{relative}: trailing whitespace"
        prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
        assert not CONFLICT_MARKER.search(prose), f"{relative}: a conflict marker"
        if path.suffix in (".yml", ".yaml"):
            list(yaml.safe_load_all(text))


def test_the_repository_has_a_license_the_readme_names():
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT No Attribution\n")
    assert "Permission is hereby granted, free of charge" in license_text
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## License\n", 1)[1]
    assert "[MIT No Attribution license](LICENSE)" in section
    assert "`license` question" in section


def test_the_readme_s_table_of_questions_lists_every_question():
    """A question missing from the README's table (`task` was) is one a newcomer never hears
    of; a question copier no longer asks (`when: false`) is not listed."""
    questions = yaml.safe_load((ROOT / "copier.yml").read_text())
    asked = {
        name
        for name, spec in questions.items()
        if not name.startswith("_")
        and isinstance(spec, dict)
        and "type" in spec
        and spec.get("when") is not False
    }
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## The questions", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(\w+)`(?:, `(\w+)`)?", table, re.M))
    names = {name for pair in listed for name in pair if name}
    assert asked == names
