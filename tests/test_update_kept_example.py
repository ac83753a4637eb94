"""The kept example: a project with the edits real users make, rendered from the last release
(v0.2.0), trained once, then updated to the working tree by following the CHANGELOG's Upgrade
notes literally (tests/upgrade_notes.py parses and executes them; no resolution is written
here).

The user's edits, made where 0.2.0 told users to make them: their own architecture in
`model.py` (`ResMLP`, `--model resmlp`) with a `build_model` argument passed by
`build_model_for`, a custom data source in `data.py` (`--data-dir parity`), changed defaults
(`epochs`, `lr`) and a new field (`depth`) in `config.py`, a per-epoch metric in `train.py`
(0.2.0's place for it: the end-of-epoch record), their own test, a rewritten README.

After `copier update --defaults` and the notes: no conflict markers; every module imports; the
project trains with its own flags and resumes its 0.2.0 checkpoint; the whole generated fast
suite passes, its own tests included. A second project with changed default values only (two
of the first's edits) updates with the conflict the notes name and passes the test files that
read its defaults. The conflict blocks per file are in
CONFLICT_BLOCKS (and each test's output).

When a template change makes this fail, keep it compatible with these edits or add an Upgrade
note in the form docs/updating.md gives ("Follow the Upgrade notes").
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, copy_template_repo, git, run
from kept_example import (
    CONFLICT_BLOCKS,
    DEFAULTS_CONFLICT_BLOCKS,
    DEFAULTS_MOVERS,
    ENV_SRC,
    MOVERS,
    OURS,
    PACKAGE,
    PYTEST,
    RELEASE,
    SMALL,
    SRC,
    USER_README,
    change_defaults,
    clone,
    commit_all,
    copier,
    doc_commands,
    imports_every_module,
    make_user_edits,
    notes_after_release,
    rendered_release,
    resolved,
    run_doc,
    snapshot,
    train,
    user_lines_lost,
)
from test_release import release_revision
from upgrade_notes import follow

pytestmark = [pytest.mark.update, pytest.mark.slow]


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This repository's history with two tags only: the release and the working tree."""
    base = tmp_path_factory.mktemp("kept")
    history = base / "history"
    run(["git", "clone", "-q", "--no-checkout", ROOT, history], base)
    for tag in git(history, "tag", "--list").split():
        git(history, "tag", "-d", tag)
    release = git(ROOT, "rev-parse", f"{release_revision(RELEASE)}^{{commit}}")
    git(history, "tag", f"v{RELEASE}", release)
    current = copy_template_repo(base / "current")
    git(history, "fetch", "-q", str(current), "main")
    git(history, "tag", "v99.0.0", "FETCH_HEAD")
    return history


@pytest.fixture(scope="module")
def kept(history: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kept example on 0.2.0, committed, with one epoch trained into runs/ours (ignored)."""
    project = rendered_release(history, tmp_path_factory.mktemp("kept") / "project")
    make_user_edits(project)
    commit_all(project, "our edits")
    train(project, *OURS, "--epochs", "1", "--run-dir", "runs/ours")
    assert (project / "runs/ours/checkpoints/last.pt").is_file()
    assert git(project, "status", "--porcelain") == ""  # runs/ is ignored: copier may update
    return project


def test_the_kept_example_updates_by_following_the_notes(kept, tmp_path):
    """docs/updating.md's Update block as the page writes it, then its Resolve checks, then
    the notes followed literally; then the project trains with its own flags, resumes its
    0.2.0 checkpoint and passes its own tests and a selection of the template's.
    Conflict blocks (CONFLICT_BLOCKS): config.py 1, data.py 1 (both rewritten by 0.3.0),
    train.py 2 (the user's import, the end of an epoch), model.py 2 (its docstring, and the
    template's registrations where the user's ladder stood); none elsewhere."""
    project = clone(kept, tmp_path / "project")
    status, update, unmerged, rejects = doc_commands("## Update")
    assert update == "copier update --defaults"
    assert run_doc(project, status).stdout == ""
    run_doc(project, update)
    assert run_doc(project, unmerged).stdout.split() == sorted(CONFLICT_BLOCKS)
    assert run_doc(project, rejects).stdout == ""
    assert user_lines_lost(project) == []  # every line of theirs is in a file, maybe a block
    markers, check, grep = doc_commands("## Resolve a conflict")
    assert run_doc(project, markers).stdout.split() == sorted(CONFLICT_BLOCKS)
    assert run_doc(project, check, check=False).returncode != 0
    found = run_doc(project, grep, check=False).stdout.splitlines()
    assert sorted({line.split(":")[0].removeprefix("./") for line in found}) == sorted(
        CONFLICT_BLOCKS
    )

    blocks = follow(project, PACKAGE, "image", notes_after_release(project), MOVERS)
    print(f"conflict blocks per file: {blocks}")
    assert blocks == CONFLICT_BLOCKS, f"conflict blocks per file: {blocks}"
    resolved(project)
    assert (project / "README.md").read_text() == USER_README
    imports_every_module(project)

    resumed = train(project, *OURS, "--epochs", "2", "--run-dir", "runs/ours", "--resume", "auto")
    assert "resumed from " in resumed.stderr + resumed.stdout, resumed.stderr
    records = [json.loads(line) for line in (project / "runs/ours/metrics.jsonl").open()]
    epochs = [r for r in records if r.get("kind") == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2], epochs
    assert 0.0 < epochs[-1].get("val_confidence", -1) <= 1.0, f"our metric is lost: {epochs}"
    # The Review block's test command: the whole fast suite, ours and the template's tests.
    *_, suite = doc_commands("## Review what changed")
    assert suite == 'python -m pytest -m "not gpu"'
    # Its own test file and the template's that read its edits (model, data source, config
    # defaults, the slots): the whole suite of the same template code runs in the renders of
    # tests/test_user_install.py and tests/test_matrix.py.
    reading = "tests/test_our_model.py tests/test_model.py tests/test_data.py tests/test_smoke.py"
    reading += " tests/test_config.py tests/test_slots.py"
    run_doc(project, f'{suite} -m "not gpu and not slow" -q -p no:cacheprovider -x {reading}')


def test_conflict_rej_on_the_kept_example_is_found_by_the_documented_checks(kept, tmp_path):
    """`--conflict rej` puts the template's lines in train.py and the user's in a `.rej`:
    the page's reject check lists it (no line of theirs is anywhere else), and its Abort
    block brings back exactly the committed project, the ignored checkpoint included."""
    project = clone(kept, tmp_path / "project")
    before = snapshot(project)
    _, update, unmerged, rejects = doc_commands("## Update")
    run_doc(project, f"{update} --conflict rej")
    assert run_doc(project, unmerged).stdout == ""  # nothing unmerged: markers checks are blind
    listed = run_doc(project, rejects).stdout.split()
    assert listed == [f"{name}.rej" for name in sorted(CONFLICT_BLOCKS)]
    assert user_lines_lost(project) == []  # each line not in its file is in a listed .rej
    assert "mean_confidence" not in (project / SRC / "train.py").read_text()  # reverted there
    dry_run, reset, clean = doc_commands("## Abort and retry")
    assert f"Would remove {listed[0]}" in run_doc(project, dry_run).stdout.splitlines()
    run_doc(project, reset)
    run_doc(project, clean)
    after = snapshot(project)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert [name for name in changed if not name.startswith(".git/")] == []


def test_pretend_on_the_kept_example_changes_nothing(kept, tmp_path):
    """`--pretend` names the release it would update to and writes nothing, .git included."""
    project = clone(kept, tmp_path / "project")
    before = snapshot(project)
    _, update, *_ = doc_commands("## Update")
    result = run_doc(project, f"{update} --pretend")
    assert "99.0.0" in result.stdout + result.stderr
    assert snapshot(project) == before


def questioned(name: str, spec: object) -> bool:
    """Whether copier.yml's entry `name` is a question copier asks (not a setting, not a
    hidden `when: false` list)."""
    return not name.startswith("_") and not (isinstance(spec, dict) and spec.get("when") is False)


def test_skip_answered_and_a_changed_answer_on_the_kept_example(kept, tmp_path):
    """Without `--defaults` copier asks every question again (the page says so): with no
    terminal it stops at the first, writing nothing, though no question was added since 0.2.0.
    With `--skip-answered` it asks only new ones (none) and, with `-d tracker=mlflow`, the
    tracker default changes (in the template's settings/groups.py), every user line stays, and the
    conflicts are the default update's."""
    project = clone(kept, tmp_path / "project")
    released = subprocess.run(
        ["git", "show", f"{release_revision(RELEASE)}:copier.yml"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    asked_then, asked_now = (
        {name for name, spec in yaml.safe_load(text).items() if questioned(name, spec)}
        for text in (released, (ROOT / "copier.yml").read_text())
    )
    assert asked_now == asked_then, "a question was added: this test's premise is gone"

    def update(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "copier", "update", *args]
        return subprocess.run(
            cmd, cwd=project, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
        )

    asked = update()
    assert asked.returncode != 0 and "Interactive session required" in asked.stderr
    assert git(project, "status", "--porcelain") == ""
    assert update("--skip-answered", "-d", "tracker=mlflow").returncode == 0
    _, _, unmerged, rejects = doc_commands("## Update")
    assert run_doc(project, unmerged).stdout.split() == sorted(CONFLICT_BLOCKS)
    assert run_doc(project, rejects).stdout == ""
    assert user_lines_lost(project) == []  # the user's config edits: in config.py's block
    config_base = (project / SRC / "settings/groups.py").read_text()
    assert re.search(r"tracker: Literal\[[^]]*\] = field\(\s*default=\"mlflow\"", config_base)
    answers = (project / ".copier-answers.yml").read_text()
    assert "tracker: mlflow" in answers and "_commit: v99.0.0" in answers


def test_a_project_with_changed_defaults_only_updates_by_the_notes(kept, tmp_path):
    """Changed default values only (epochs, lr): config.py conflicts in one block (this release
    rewrote it), which the notes resolve with the user's two defaults put in `Config`; they are
    in effect, and the tests that read defaults pass with them. Then, as the interface table
    says, a model.py that registers no model and has no build_model_for stops training with
    one line."""
    project = tmp_path / "defaults"
    run(["git", "clone", "-q", kept, project], tmp_path)
    git(project, "reset", "-q", "--hard", "HEAD~1")  # the 0.2.0 render, before the edits
    change_defaults(project)
    commit_all(project, "our defaults")
    copier(project, "--defaults")
    blocks = follow(project, PACKAGE, "image", notes_after_release(project), DEFAULTS_MOVERS)
    print(f"conflict blocks per file: {blocks}")
    assert blocks == DEFAULTS_CONFLICT_BLOCKS, f"conflict blocks per file: {blocks}"
    resolved(project)
    ours = f"from {PACKAGE}.config import Config; c = Config().optim; assert (c.epochs, c.lr) == "
    imports_every_module(project, then=ours + "(7, 1e-3), c")  # the user's defaults are kept
    # A model.py that registers nothing and has no build_model_for (rewritten as against
    # v0.1.0, which called build_model): one line, exit 2.
    model = project / SRC / "model.py"
    text = model.read_text()
    assert "@slots.model(" in text and "def build_model_for(" not in text  # 0.4.0's, merged
    model.write_text(text.split("\ndef _fp32_adamw_bytes(")[0])  # the classes only
    refused = train(project, *SMALL, "--run-dir", str(tmp_path / "refused"), check=False)
    assert refused.returncode == 2, refused.stderr
    # argparse's usage line, then the one line that says what is wrong
    assert "register yours with @slots.model" in refused.stderr.strip().splitlines()[-1]
    git(project, "checkout", "--", str(model))
    # The files that read the defaults: the edited example above runs the whole fast suite on
    # a project with these two changed defaults among its edits.
    env = {ENV_SRC: str(project / "src")}
    files = ["tests/test_config.py", "tests/test_smoke.py"]
    run([*PYTEST, "-m", "not gpu and not slow", *files], project, env=env)
