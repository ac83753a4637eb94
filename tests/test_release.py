"""Release checks: what an update cannot do for users must be in the CHANGELOG's Upgrade notes.

`copier update` deletes a file the template renamed or deleted, the user's lines with it (exit
0, no marker), and template-owned code that starts calling something new in a user-owned file
(model.py, data.py, config.py) breaks a project whose user rewrote that file. Neither shows up
as a conflict, so each must be named in the Upgrade notes of CHANGELOG.md's Unreleased section,
compared with the previous release (the newest `## [X.Y.Z]` section: tag `vX.Y.Z`, or else the
commit titled `Release vX.Y.Z`). The interface itself is written down in docs/updating.md.
That newest released section must carry its date and its Upgrade notes, as the release workflow
(.ci/release_notes.py) requires, and read as it did when released.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
from pathlib import Path
from types import ModuleType

import jinja2
import pytest

from helpers import ROOT

PACKAGE_DIR = "template/src/{{ package_name }}"
USER_MODULES = ("model", "data", "config", "extensions")  # the user's files template code calls
INTERFACE_DOC = ROOT / "docs" / "updating.md"


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)


def previous_release(changelog: str) -> tuple[str, str]:
    """(version, git revision) of the newest released section of the changelog."""
    found = re.search(r"^## \[(\d+\.\d+\.\d+[^\]]*)\]", changelog, re.M)
    assert found, "CHANGELOG.md has no released section (## [X.Y.Z] - date)"
    return found[1], release_revision(found[1])


def release_revision(version: str) -> str:
    """The git revision of release `version`: its tag, or the commit titled as its release."""
    if _git("rev-parse", "--verify", "--quiet", f"refs/tags/v{version}").returncode == 0:
        return f"v{version}"
    log = _git("log", "--format=%H", "--fixed-strings", f"--grep=Release v{version}:", "HEAD")
    commits = log.stdout.split()
    assert commits, (
        f"neither tag v{version} nor a commit titled 'Release v{version}:' is in this clone; "
        "fetch the history (git fetch --tags --unshallow)"
    )
    return commits[-1]


def upgrade_notes(changelog: str) -> str:
    """The text of the Unreleased section's `### Upgrade notes` subsections, all of them
    (`### Upgrade notes (issue 11)` counts too); empty when there is none."""
    unreleased = re.search(r"^## \[Unreleased\]\s*$(.*?)(?=^## \[|\Z)", changelog, re.M | re.S)
    assert unreleased, "CHANGELOG.md has no ## [Unreleased] section"
    notes = re.finditer(r"^### Upgrade notes[^\n]*$(.*?)(?=^### |\Z)", unreleased[1], re.M | re.S)
    return "\n".join(note[1] for note in notes)


def rendered_name(template_path: str) -> str:
    """template/src/{{ package_name }}/x.py.jinja -> src/<package>/x.py, as users see it."""
    name = template_path.removeprefix("template/").removesuffix(".jinja")
    name = name.replace("{{ package_name }}", "<package>")
    name = name.replace("{{ _copier_conf.answers_file }}", ".copier-answers.yml")
    return re.sub(r"\{%\s*if [^%]*%\}(.*?)\{%\s*endif\s*%\}", r"\1", name)


def gone_since(revision: str) -> list[str]:
    """Template files of `revision` that the working tree renamed or deleted."""
    result = _git("diff", "--name-status", "-M", "--diff-filter=DR", revision, "--", "template/")
    assert result.returncode == 0, result.stderr
    gone = []
    for line in result.stdout.splitlines():
        _status, old, *new = line.split("\t")
        if new and rendered_name(old) == rendered_name(new[0]):
            continue  # only the template's file name changed (a `.jinja` suffix dropped)
        gone.append(old)
    return sorted(gone)


def missing_from_notes(names: list[str], notes: str) -> list[str]:
    return [name for name in names if f"`{name}`" not in notes]


def interface_names(sources: dict[str, str]) -> dict[str, set[str]]:
    """What template-owned modules use from the user's modules: {module: {name, ...}}.

    `sources` maps file names in src/<package>/ to their text; the user's own modules are left
    out. Counts `from .model import x`, `m.x` or `getattr(m, "x")` after `from . import
    model as m`, and `slots.user_attr("model", "x")` (slots.py: how template code reads them).
    """
    used: dict[str, set[str]] = {module: set() for module in USER_MODULES}
    for filename, text in sources.items():
        if Path(filename).stem in USER_MODULES or not filename.endswith(".py"):
            continue
        tree = ast.parse(text)
        parts = Path(filename).parts
        depth = len(parts) - (parts[0] in TASKS)  # "image/training/task.py" imports `..model`
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            # a module in a sub-package reaches the user's files one level further up
            if isinstance(node, ast.ImportFrom) and node.level == depth:
                if node.module in USER_MODULES:
                    used[node.module] |= {alias.name for alias in node.names}
                elif node.module is None:
                    for alias in node.names:
                        if alias.name in USER_MODULES:
                            aliases[alias.asname or alias.name] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                used[aliases[node.value.id]].add(node.attr)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "getattr"
                and len(node.args) >= 2
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in aliases
                and isinstance(node.args[1], ast.Constant)
            ):
                used[aliases[node.args[0].id]].add(str(node.args[1].value))
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) in ("user_attr", "slots.user_attr")
                and len(node.args) >= 2
                and all(isinstance(arg, ast.Constant) for arg in node.args[:2])
                and node.args[0].value in used  # type: ignore[attr-defined]
            ):
                used[node.args[0].value].add(str(node.args[1].value))  # type: ignore[attr-defined]
    for module in used:
        used[module].discard("__file__")
    return used


TASKS = ("image", "lm")  # copier.yml's `task` choices: a package file may differ per task


def rendered_sources(files: dict[str, str]) -> dict[str, str]:
    """Template package files (name -> text, `.jinja` ones raw) as each task renders them:
    "<task>/<rendered name>" -> text, only the .py files a render of that task holds."""
    env = jinja2.Environment(keep_trailing_newline=True)
    answers = {"package_name": "pkg", "project_name": "p", "python_version": "3.11"}
    sources = {}
    for task in TASKS:
        for name, text in files.items():
            if name.endswith(".jinja"):
                name = name.removesuffix(".jinja")
                text = env.from_string(text).render(task=task, **answers)
            name = env.from_string(name).render(task=task)  # a file or folder named per task
            if name.endswith(".py") and "" not in name.split("/"):
                sources[f"{task}/{name}"] = text
    return sources


def sources_at(revision: str | None) -> dict[str, str]:
    """The template package's .py files as each task renders them, at a revision (None: the
    working tree), nested packages included."""
    if revision is None:
        base = ROOT / PACKAGE_DIR
        return rendered_sources(
            {
                str(p.relative_to(base)): p.read_text()
                for p in sorted(base.rglob("*"))
                if ".py" in p.name and p.is_file() and "__pycache__" not in p.parts
            }
        )
    listed = _git("ls-tree", "-r", "--name-only", revision, "--", PACKAGE_DIR + "/")
    files = {}
    for path in listed.stdout.splitlines():
        if ".py" in path.rpartition("/")[2]:
            files[path.removeprefix(PACKAGE_DIR + "/")] = _git("show", f"{revision}:{path}").stdout
    return rendered_sources(files)


# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def changelog() -> str:
    return (ROOT / "CHANGELOG.md").read_text()


def test_every_template_file_renamed_or_deleted_since_the_release_is_in_the_upgrade_notes(
    changelog,
):
    version, revision = previous_release(changelog)
    gone = [rendered_name(path) for path in gone_since(revision)]
    missing = missing_from_notes(gone, upgrade_notes(changelog))
    assert not missing, (
        f"copier update deletes these files of v{version} from users' projects, their edits "
        "included, with no conflict to see: name each, in backquotes, under '### Upgrade notes' "
        "of CHANGELOG.md's [Unreleased] section, saying where its content went (users recover "
        f"their lines with git show HEAD:<path>, docs/updating.md): {missing}"
    )


def test_every_new_call_into_user_files_is_in_the_upgrade_notes_and_the_interface_doc(
    changelog,
):
    version, revision = previous_release(changelog)
    before = interface_names(sources_at(revision))
    now = interface_names(sources_at(None))
    assert now["model"] and now["data"] and now["config"], now  # the parser finds the calls
    new = sorted(f"{m}.{name}" for m in USER_MODULES for name in now[m] - before[m])
    notes = upgrade_notes(changelog)
    missing = [name for name in new if f"`{name.split('.')[1]}`" not in notes]
    assert not missing, (
        f"template-owned code now uses these names from the user's files, which v{version} "
        "did not: a user who rewrote the file lacks them after updating. Name each (in "
        "backquotes, with what to add) under '### Upgrade notes' of CHANGELOG.md's "
        f"[Unreleased] section: {missing}"
    )
    doc = INTERFACE_DOC.read_text()
    undocumented = sorted(
        f"{m}.{name}" for m in USER_MODULES for name in now[m] if f"`{name}`" not in doc
    )
    assert not undocumented, (
        "template-owned code uses these names from the user's files, but docs/updating.md's "
        f"interface table does not list them: {undocumented}"
    )


def load_release_notes() -> ModuleType:
    """.ci/release_notes.py, which the release workflow runs on a pushed tag."""
    spec = importlib.util.spec_from_file_location(
        "release_notes", ROOT / ".ci" / "release_notes.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_newest_release_has_a_date_and_upgrade_notes(changelog):
    """What the release workflow refuses to publish fails here first (docs/releasing.md)."""
    release_notes = load_release_notes()
    version = release_notes.newest_release(changelog)
    assert "### Upgrade notes" in release_notes.release_section(changelog, version)
    # The check itself, on sections that lack each part.
    with pytest.raises(ValueError, match=r"section \[1.0.0\] has no date"):
        release_notes.release_section("## [1.0.0]\n\n### Upgrade notes\n\n- x\n", "1.0.0")
    with pytest.raises(ValueError, match=r"section \[1.0.0\] has no date"):
        release_notes.release_section(
            "## [1.0.0] - 2026-13-01\n\n### Upgrade notes\n- x\n", "1.0.0"
        )
    with pytest.raises(ValueError, match=r"has no '### Upgrade notes'"):
        release_notes.release_section("## [1.0.0] - 2026-01-01\n\n### Added\n\n- x\n", "1.0.0")
    with pytest.raises(ValueError, match=r"has no '### Upgrade notes'"):
        release_notes.release_section(
            "## [1.0.0] - 2026-01-01\n\n### Upgrade notes\n\n### Added\n\n- x\n", "1.0.0"
        )


def test_the_newest_release_section_reads_as_it_was_released(changelog):
    """A released section is what users of that tag read: a line merged into it later (a
    branch that wrote under the old Unreleased heading, say) belongs under [Unreleased]."""
    release_notes = load_release_notes()
    version, revision = previous_release(changelog)
    then = _git("show", f"{revision}:CHANGELOG.md")
    assert then.returncode == 0, then.stderr
    now_text = release_notes.sections(changelog)[version]
    then_text = release_notes.sections(then.stdout)[version]
    assert now_text == then_text, (
        f"CHANGELOG.md's [{version}] section changed since its release ({revision}): move new "
        "lines to the [Unreleased] section's lists"
    )


def test_the_release_checks_see_renames_calls_and_notes(tmp_path):
    """The checks' parts on made-up input, so an empty diff cannot pass them by accident."""
    assert rendered_name("template/src/{{ package_name }}/benchmark.py") == (
        "src/<package>/benchmark.py"
    )
    assert rendered_name(
        "template/{% if github_actions %}.github{% endif %}/workflows/ci.yml.jinja"
    ) == (".github/workflows/ci.yml")
    changelog = (
        "# Changelog\n\n## [Unreleased]\n\n### Fixed\n\n- `src/<package>/a.py` fixed\n\n"
        "### Upgrade notes\n\n- `src/<package>/b.py` moved to `c.py`\n\n### Added\n\n- `e.py`\n\n"
        "### Upgrade notes (issue 11)\n\n- `d.py` gone\n\n## [0.1.0] - 2026\n\n"
        "### Upgrade notes\n\n- `f.py` gone\n"
    )
    notes = upgrade_notes(changelog)
    assert missing_from_notes(["src/<package>/a.py", "src/<package>/b.py"], notes) == [
        "src/<package>/a.py"
    ]
    assert missing_from_notes(["d.py", "e.py", "f.py"], notes) == ["e.py", "f.py"]
    used = interface_names(
        {
            "train.py": "from . import model as m\nfrom .data import build_datasets\n"
            "m.build_model_for(1, 2)\ngetattr(m, 'extra', None)\n"
            "slots.user_attr('extensions', 'hook')\n",
            "model.py": "from .config import Config\n",
            "lm/training/loop.py": "from ..extensions import later\nfrom .extensions import no\n",
        }
    )
    assert used == {
        "model": {"build_model_for", "extra"},
        "data": {"build_datasets"},
        "config": set(),
        "extensions": {"hook", "later"},
    }


def test_the_users_files_hold_no_template_code_a_release_would_change() -> None:
    """A release that adds a config field, changes a default, or adds a data source or a metric must
    change only template-owned files (settings/base.py, training/data_sources.py, training/task.py),
    so that it never conflicts with a user's edits: config.py's `Config` declares only the groups
    (the lines where a user passes other defaults), data.py only `SOURCES` and `build_datasets`,
    extensions.py only `extra_metrics`; none of them depends on an answer but `task`, which a
    project keeps for life (a language model's data.py has no `build_datasets`: its corpus is the
    template's language/text.py)."""
    base = ROOT / PACKAGE_DIR
    files = {"config": "config.py", "data": "data.py.jinja", "extensions": "extensions.py"}
    for name in files.values():
        text = re.sub(r"\{%-? (if task [^%]*|else|endif) -?%\}", "", (base / name).read_text())
        assert "{{" not in text and "{%" not in text, f"{name} depends on an answer but task"
    sources = rendered_sources({name: (base / name).read_text() for name in files.values()})
    for task in TASKS:
        defined: dict[str, set[str]] = {}
        for module in files:
            defined[module] = set()
            for node in ast.parse(sources[f"{task}/{module}.py"]).body:
                if isinstance(node, ast.FunctionDef | ast.ClassDef):
                    defined[module].add(node.name)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    defined[module].add(node.target.id)
        readers = {"parse_config", "load_toml", "to_toml"}  # one-line hand-overs to config_parsing
        assert defined == {
            "config": {"Config", *readers},
            "data": {"SOURCES", "build_datasets"} if task == "image" else {"SOURCES"},
            "extensions": {"extra_metrics"},
        }, task
    config = next(
        node
        for node in ast.parse((base / files["config"]).read_text()).body
        if isinstance(node, ast.ClassDef) and node.name == "Config"
    )
    fields = [node for node in config.body if isinstance(node, ast.AnnAssign)]
    assert [ast.unparse(node.annotation) for node in fields] == [
        "RunConfig", "DataConfig", "ModelConfig", "OptimConfig", "SpeedConfig", "LogConfig"
    ]  # fmt: skip
    assert all("default_factory=" in ast.unparse(node) for node in fields)
