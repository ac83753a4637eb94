"""Rendering checks: what each matrix render contains follows from its answers, and nothing of
Jinja is left behind."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, render
from import_graph import import_cycles, import_graph
from matrix import MATRIX, package_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

NAMES = list(MATRIX)

LICENSE_MARKERS = {
    "MIT": "MIT License",
    "Apache-2.0": "Apache License",
    "BSD-3-Clause": "Redistribution and use in source and binary forms",
}


def project_files(project: Path) -> list[Path]:
    return sorted(p for p in project.rglob("*") if p.is_file() and ".git" not in p.parts)


def pyproject(project: Path) -> dict:
    return tomllib.loads((project / "pyproject.toml").read_text())


def test_copier_yml_needs_no_trust():
    """Features that make copier demand --trust would make users run template code."""
    config = yaml.safe_load((ROOT / "copier.yml").read_text())
    assert not {"_tasks", "_migrations", "_jinja_extensions"} & set(config)


# Files whose string literals hold chat templates, Jinja the generated project renders at run
# time (language/chat.py's default, the chat tests' own): their string lines may hold it.
RUNTIME_JINJA = (
    "/language/chat.py",
    "tests/test_chat.py",
    "tests/test_hf_tokens.py",
    "docs/language-model.md",  # the walkthrough's tiny_llama.py
)
STRING_STARTS = ('"', "'", '("', 'f"', 'r"')


@pytest.mark.parametrize("name", NAMES)
def test_no_jinja_left_in_any_file(rendered, name):
    project = rendered[name]
    files = project_files(project)
    assert len(files) > 10, f"suspiciously few files rendered: {files}"
    for path in files:
        relative = path.relative_to(project).as_posix()
        assert not relative.endswith(".jinja"), relative
        assert "{{" not in relative and "{%" not in relative, relative
        lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
        if relative.startswith(".github/"):  # GitHub's own expressions: ${{ github.ref }}
            lines = [re.sub(r"\$\{\{ [\w.]+ \}\}", "", line) for line in lines]
        if relative.endswith(RUNTIME_JINJA):  # chat templates: Jinja the project renders
            lines = [line for line in lines if not line.lstrip().startswith(STRING_STARTS)]
        for number, line in enumerate(lines, 1):
            assert "{{" not in line and "{%" not in line, f"{relative}:{number}: {line.strip()}"


# The modules only one task's project holds (issue 35: a render holds only its own task's).
TASK_MODULES = {
    "image": {"vision/images.py", "vision/finetune.py", "vision/example_data.py", "predict.py",
              "vision/trained.py", "vision/trivial_augment.py", "vision/hub_models.py",
              "vision/decode.py", "vision/normalization.py", "benchmarks/workers.py",
              "benchmarks/augmentation.py", "benchmarks/decoding.py"},
    "lm": {"language/text.py", "generate.py", "language/compress.py", "language/grid.py",
           "language/tokenizer.py", "language/gpt2_format.py", "language/corpus.py",
           "language/llama.py", "language/hf_llama.py", "language/hf_folders.py",
           "language/neox_format.py", "benchmarks/generation.py"},
}  # fmt: skip
# The settings only one task's Config has (issue 52, item 9): each render offers its own.
TASK_SETTINGS = {
    "image": {"image_size", "num_classes", "synthetic_noise", "augment", "trivial_augment",
              "erase", "hf_model", "freeze", "smoothing", "backbone_lr_factor"},
    "lm": {"seq_len", "depth", "heads", "position", "activation", "tokenizer", "vocab_size",
           "text_field", "allow_corpus_change", "max_tokens", "kv_heads", "mlp_width",
           "tie_head", "qkv_bias", "norm_eps", "rope_base"},
}  # fmt: skip
# Benchmark sections by number (benchmarks/cli.py's SECTIONS): the other task's are not listed.
TASK_SECTIONS = {"image": {1, 11, 12}, "lm": {10}}


@pytest.mark.parametrize("name", NAMES)
def test_a_render_holds_only_its_own_task_s_modules(rendered, name):
    task = MATRIX[name].get("task", "image")
    (package,) = (rendered[name] / "src").glob("*/__init__.py")
    modules = {path.relative_to(package.parent).as_posix() for path in package.parent.rglob("*.py")}
    other = "lm" if task == "image" else "image"
    assert TASK_MODULES[task] <= modules and not TASK_MODULES[other] & modules
    sources = " ".join(path.read_text() for path in package.parent.rglob("*.py"))
    assert (task == "image") == ("ImageFolder" in sources), "image sources only in image renders"


def annotated_fields(path: Path) -> set[str]:
    """The names annotated in the classes of a module (a dataclass's fields and ClassVars)."""
    classes = [node for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)]
    return {
        item.target.id
        for node in classes
        for item in node.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    }


@pytest.mark.parametrize("name", NAMES)
def test_a_render_offers_only_its_own_task_s_settings_and_benchmark_sections(rendered, name):
    task = MATRIX[name].get("task", "image")
    other = "lm" if task == "image" else "image"
    (package,) = (rendered[name] / "src").glob("*/__init__.py")
    fields = annotated_fields(package.parent / "settings" / "groups.py")
    assert TASK_SETTINGS[task] <= fields and not TASK_SETTINGS[other] & fields, fields
    cli = ast.parse((package.parent / "benchmarks" / "cli.py").read_text())
    (sections,) = [
        node.value
        for node in cli.body
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "SECTIONS"
    ]
    assert isinstance(sections, ast.Dict)
    numbers = {ast.literal_eval(key) for key in sections.keys if key is not None}
    assert numbers == set(range(1, 14)) - TASK_SECTIONS[other], numbers


@pytest.mark.parametrize("name", NAMES)
def test_answers_file_records_the_answers(rendered, name):
    answers = yaml.safe_load((rendered[name] / ".copier-answers.yml").read_text())
    for question, value in MATRIX[name].items():
        assert answers[question] == value, question
    assert answers["package_name"] == package_name(MATRIX[name])
    assert Path(answers["_src_path"]).resolve() == ROOT
    assert answers["_commit"], "copier update needs the template commit"
    # Internal lists of the validator are not questions: they must not be stored.
    assert "python_keywords" not in answers and "reserved_module_names" not in answers


@pytest.mark.parametrize("name", NAMES)
def test_license_matches_the_answer(rendered, name):
    project, choice = rendered[name], MATRIX[name]["license"]
    license_file = project / "LICENSE"
    if choice == "none":
        assert not license_file.exists()
        assert "license" not in pyproject(project)["project"]
    else:
        assert LICENSE_MARKERS[choice] in license_file.read_text()
        assert pyproject(project)["project"]["license"] == choice


@pytest.mark.parametrize("name", NAMES)
def test_every_data_file_of_the_package_is_package_data(rendered, name):
    """A wheel holds the package's .py files and its package-data only: a file of another kind
    (serve's page.html) left off the list is missing from a project installed without -e."""
    project, package = rendered[name], package_name(MATRIX[name])
    folder = project / "src" / package
    files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    data = sorted(f for f in files if not f.endswith((".py", ".pyc")))
    assert data == sorted(pyproject(project)["tool"]["setuptools"]["package-data"][package])


@pytest.mark.parametrize("name", NAMES)
def test_workflow_only_when_chosen(rendered, name):
    project, answers = rendered[name], MATRIX[name]
    workflow = project / ".github" / "workflows" / "ci.yml"
    assert workflow.exists() == answers["github_actions"]
    assert (project / ".github").exists() == answers["github_actions"]
    if answers["github_actions"]:
        text = workflow.read_text()
        parsed = yaml.safe_load(text)
        assert parsed["jobs"], "a workflow without jobs"
        assert f'"{answers["python_version"]}"' in text
        assert "copier check-update" in text


@pytest.mark.parametrize("name", NAMES)
def test_tracker_packages_come_only_through_their_extras(rendered, name):
    project, tracker = rendered[name], MATRIX[name]["tracker"]
    data = pyproject(project)["project"]
    trackers = ("tensorboard", "mlflow", "wandb")
    assert not [d for d in data["dependencies"] if d.startswith(trackers)]
    assert any(dep.startswith("torch") for dep in data["dependencies"])
    extras = data["optional-dependencies"]
    assert extras["tensorboard"][0].startswith("tensorboard")
    assert extras["mlflow"][0].startswith("mlflow-skinny")
    assert extras["wandb"][0].startswith("wandb")
    config = (project / "src" / package_name(MATRIX[name]) / "settings/groups.py").read_text()
    assert f'default="{tracker}"' in config  # the answer is --tracker's default
    install = '".[test]"' if tracker == "none" else f'".[test,{tracker}]"'
    assert f"pip install -e {install}" in (project / "docs" / "template.md").read_text()


@pytest.mark.parametrize("name", NAMES)
def test_python_version_sets_requires_python_and_ruff_target(rendered, name):
    project, version = rendered[name], MATRIX[name]["python_version"]
    data = pyproject(project)
    assert data["project"]["requires-python"] == f">={version}"
    assert "target-version" not in data["tool"]["ruff"]  # ruff reads requires-python


@pytest.mark.parametrize("name", NAMES)
def test_package_folder_uses_the_package_name(rendered, name):
    package = rendered[name] / "src" / package_name(MATRIX[name])
    assert (package / "__init__.py").is_file()
    assert (package / "utils.py").is_file()
    assert (package / "py.typed").is_file()


def test_default_answers_derive_the_package_name(tmp_path):
    project = render(tmp_path / "demo", {"project_name": "Cool Model.v2"})
    answers = yaml.safe_load((project / ".copier-answers.yml").read_text())
    assert answers["package_name"] == "cool_model_v2"
    assert (project / "src" / "cool_model_v2" / "train.py").is_file()
    assert pyproject(project)["project"]["name"] == "cool-model.v2"


def test_matrix_gives_every_choice_each_of_its_values():
    """The matrix is only as good as its coverage: a new choice or value must be added to it."""
    config = yaml.safe_load((ROOT / "copier.yml").read_text())
    for question, spec in config.items():
        if question.startswith("_") or not isinstance(spec, dict):
            continue
        if spec.get("when") is False:  # never asked: a retired question read on update
            continue
        if spec.get("type") == "bool":
            values = {True, False}
        elif "choices" in spec:
            choices = spec["choices"]
            values = set(choices.values() if isinstance(choices, dict) else choices)
        else:
            continue
        used = {answers.get(question) for answers in MATRIX.values()}
        assert values <= used, f"matrix misses {question} = {sorted(map(str, values - used))}"


def package_modules(project: Path, name: str) -> dict[str, ast.Module]:
    """The generated package's modules by dotted name within it: "train", "benchmarks.cli";
    a package's `__init__.py` under the package's own name ("" for the top)."""
    package = project / "src" / package_name(MATRIX[name])
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = ast.parse(
            path.read_text()
        )
    return modules


@pytest.mark.parametrize("name", NAMES)
def test_no_function_of_the_package_is_longer_than_100_lines(rendered, name):
    """STYLE.md's limit, so that each part of the loop stays readable (and testable) alone."""
    long = [
        f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for module, tree in package_modules(rendered[name], name).items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > 100
    ]
    assert not long


@pytest.mark.parametrize("name", NAMES)
def test_the_package_import_graph_has_no_cycle(rendered, name):
    """No import cycle at run time, deferred and `importlib` imports included (issue 52): a
    module can be read, and imported, before the modules that build on it. config.py imports
    settings/parsing.py, never the reverse (issue 27); the slot registry is filled by the
    package's import (__init__.py), so no module that reads it imports your files, which
    import the settings."""
    package = rendered[name] / "src" / package_name(MATRIX[name])
    graph = import_graph(package)
    top = package.name
    assert graph[f"{top}.config"] >= {f"{top}.settings.parsing"}
    assert graph[f"{top}.train"] >= {f"{top}.training.loop", f"{top}.config"}
    cycles = [[m.removeprefix(f"{top}.") for m in group] for group in import_cycles(graph)]
    assert cycles == []
