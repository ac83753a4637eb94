"""The generated package's floor plan (issue 52): your files and the commands at the top, the
template's machinery in sub-packages named for their concern, and imports that only go down.

Checked on the matrix renders (both tasks), by reading the code (`ast`), not by running it,
except where the question is what running it imports.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT
from import_graph import import_cycles, import_graph, module_name
from matrix import MATRIX

NAMES = sorted(MATRIX)
USER_FILES = {"config", "data", "model", "extensions"}
# Besides your files: the registry, the seven techniques, and each task's commands.
SHARED_TOP = {"slots", "utils", "train", "evaluate", "export", "benchmark", "profiling", "tune"}
SHARED_TOP |= {"sweep", "serve"}
TASK_TOP = {"image": {"predict"}, "lm": {"generate", "prepare"}}
SUBPACKAGES = {"settings", "checkpointing", "runtime", "training", "observability", "benchmarks"}
SUBPACKAGES |= {"serving"}
WING = {"image": "vision", "lm": "language"}
MAX_TOP = 16  # the LM's: four files of yours, slots, utils and ten commands
TECHNIQUES = [
    "Seeding and determinism",
    "Anomaly detection",
    "DataLoader workers",
    "pin_memory + non_blocking",
    "torch.compile",
    "Evaluation without autograd",
    "Gradient clipping",
]
# Template names a template module may take from a user's file: only the user's own `Config`
# (the settings class they extend). Everything else comes from the template's own modules,
# and model.py, data.py and extensions.py are read through the slot registry (slots.py) only.
FROM_USER_FILES = {"config": {"Config"}, "data": set(), "model": set(), "extensions": set()}


def package_of(project: Path) -> Path:
    (init,) = (project / "src").glob("*/__init__.py")
    return init.parent


def task_of(name: str) -> str:
    return MATRIX[name].get("task", "image")


@pytest.mark.parametrize("name", NAMES)
def test_the_package_top_holds_your_files_the_registry_utils_and_commands(rendered, name):
    package, task = package_of(rendered[name]), task_of(name)
    top = {path.stem for path in package.glob("*.py")} - {"__init__"}
    assert len(top) <= MAX_TOP, sorted(top)
    assert top == USER_FILES | SHARED_TOP | TASK_TOP[task], sorted(top)
    for command in top - USER_FILES - {"slots", "utils"}:
        text = (package / f"{command}.py").read_text()
        assert 'if __name__ == "__main__":' in text, f"{command}.py at the top runs nothing"
    folders = {path.parent.name for path in package.glob("*/__init__.py")}
    assert folders == SUBPACKAGES | {WING[task]}, sorted(folders)


@pytest.mark.parametrize("name", ["py310-mit-cnn", "py312-bsd-lm"])
def test_utils_holds_the_seven_techniques_and_nothing_else(rendered, name):
    text = (package_of(rendered[name]) / "utils.py").read_text()
    headings = re.findall(r"^# -{20,}\n# (.+)\n# -{20,}$", text, re.M)
    numbered = [f"{n}. {title}" for n, title in enumerate(TECHNIQUES, 1)]
    assert len(headings) == 7, headings
    assert all(h.startswith(t) for h, t in zip(headings, numbered, strict=True)), headings


def test_no_template_file_ends_in_jinja_without_jinja_in_it():
    plain = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "template").rglob("*.jinja")
        if not re.search(r"\{\{|\{%|\{#", path.read_text())
    ]
    assert not plain, f"rename these without .jinja: copier copies them as they are: {plain}"


def imports_of(package: Path, path: Path) -> list[tuple[str, list[str]]]:
    """(absolute module, names) of each `from ... import` in `path`, deferred ones included."""
    here = module_name(package, path)
    if path.name != "__init__.py":
        here = here.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, [alias.name for alias in node.names]))
    return found


@pytest.mark.parametrize("name", NAMES)
def test_no_template_module_takes_a_template_name_through_a_user_file(rendered, name):
    package = package_of(rendered[name])
    root = package.name
    wrong = []
    for path in sorted(package.rglob("*.py")):
        if path.parent == package and path.stem in USER_FILES:
            continue  # your own files may import each other
        for module, names in imports_of(package, path):
            if module == root:  # from <package> import model
                wrong += [f"{path.name}: {n}" for n in names if n in USER_FILES]
            for user_file, allowed in FROM_USER_FILES.items():
                if module == f"{root}.{user_file}":
                    wrong += [f"{path.name}: {user_file}.{n}" for n in names if n not in allowed]
    assert not wrong, wrong


LOADED = """
import sys
from {package} import slots
slots.load()
print(" ".join(sorted(name for name in sys.modules if name.startswith("{package}."))))
"""


@pytest.mark.parametrize("name", ["py310-mit-cnn", "py312-bsd-lm"])
def test_the_registry_loads_only_its_own_task_s_modules(rendered, name):
    package, task = package_of(rendered[name]), task_of(name)
    other = WING["lm" if task == "image" else "image"]
    result = subprocess.run(
        [sys.executable, "-c", LOADED.format(package=package.name)],
        cwd=package.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    loaded = set(result.stdout.split())
    assert f"{package.name}.training.schedules" in loaded  # the template's own registrations
    assert f"{package.name}.model" in loaded  # and yours
    assert not {m for m in loaded if m.startswith(f"{package.name}.{other}")}, sorted(loaded)


def test_the_cycle_finder_sees_deferred_and_importlib_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from .sub import b\n")
    (package / "sub" / "b.py").write_text(
        "import importlib\nNAMES_MODULES = ('c',)\n"
        "def g(name):\n    importlib.import_module(f'{__package__.rpartition(\".\")[0]}.{name}')\n"
    )
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"
    )
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"}
    assert import_cycles(graph) == []  # the TYPE_CHECKING import never runs
    (package / "c.py").write_text("import importlib\nimportlib.import_module(f'{__package__}.a')\n")
    assert import_cycles(import_graph(package)) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
