"""The template repository's shared environment, for noxfile.py: what it installs (torch by
the generated projects' own rule, the tools at the versions the renders pin, the renders'
dependencies and extras) and how the sessions run its interpreter. noxfile.py's `env` session
builds it and sets `Env`; every other session runs in it through `run_python`."""

from __future__ import annotations

import ast
import os
import re
import types
from pathlib import Path
from typing import Any

import nox

ROOT = Path(__file__).resolve().parent
BUILD = ROOT / "build"
TORCH = os.environ.get("TORCH_SPEC", "torch==2.13.0")
# The generated projects' noxfile: plain Python, and the owner of the torch install rule.
PROJECT_NOXFILE = ROOT / "template" / "noxfile.py"


def torch_rule() -> types.ModuleType:
    """The torch install rule of the generated projects' noxfile, executed from that file, so
    this repository's environments take torch exactly as a generated project's sessions and
    CI do (TORCH_BACKEND, the source it names, the fallback and its line, uv handed pip's
    configuration). Only that noxfile's imports and its section headed "Which torch, and from
    where" run: importing the file whole would register its sessions over these."""
    text = PROJECT_NOXFILE.read_text()
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "Which torch, and from where" in line)
    end = next(i for i, line in enumerate(lines) if "End of the torch rule" in line)
    tree = ast.parse(text, str(PROJECT_NOXFILE))
    tree.body = [
        node
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom)) or start < node.lineno <= end
    ]
    module = types.ModuleType("torch_rule", f"The torch install rule of {PROJECT_NOXFILE}.")
    module.__file__ = str(PROJECT_NOXFILE)
    exec(compile(tree, str(PROJECT_NOXFILE), "exec"), module.__dict__)
    return module


TORCH_RULE = torch_rule()


def pinned(tool: str) -> str:
    """The one pin of a development tool: the generated projects' dependency groups."""
    text = (ROOT / "template" / "pyproject.toml.jinja").read_text()
    found = re.search(rf'"({re.escape(tool)}==[^"]+)"', text)
    assert found, f"template/pyproject.toml.jinja pins no {tool}"
    return found[1]


ENV_PACKAGES = [
    "copier>=9.13,<10",  # the lower bound is noxfile.py's MIN_COPIER's minor version
    "pytest>=8",
    "pytest-xdist>=3.6",  # the tests session runs on two workers
    pinned("ruff"),  # the renders are linted and type-checked with the versions they pin
    pinned("mypy"),
    "nox",  # the docs tests run the generated projects' own nox sessions with --no-venv
    "setuptools>=77",  # rendered projects are installed with --no-build-isolation
    "pip",  # the tests pip-install the renders; a uv-made environment has no pip of its own
    # The generated projects' own dependencies, so they install with --no-deps.
    "numpy>=1.24",
    "tqdm>=4.60",
    "pillow>=9",
    "tyro>=1.0,<2",
    # The trackers (--tracker) and sweeps: extras of the generated projects, installed here
    # once so each render's suite reads every tracker back through its real library.
    "tensorboard>=2.14",
    "mlflow-skinny>=2.16",
    "sqlalchemy>=2",
    "alembic>=1.13",
    "wandb>=0.20",
    "optuna>=3.6",
    # The language model's Hugging Face formats (extra `hf`) and its parity tests.
    "tokenizers>=0.20",
    "safetensors>=0.4",
    "transformers>=4.40",
    # Parquet and `datasets` folders (extra `data`): the language model's `prepare` and the
    # image projects' --data-dir read them, their tests write them.
    "pyarrow>=15",
    "datasets>=2.19",
    "webdataset>=0.2",  # the image projects' tests write shards with it
    # ONNX export (extra `onnx`): both tasks' export --format onnx and its ONNX Runtime tests.
    "onnx>=1.16",
    "onnxruntime>=1.18",
    "onnxscript>=0.2",
    # Downstream tasks (extra `eval` of a language model): evaluate --tasks and its tests.
    "lm-eval[hf]>=0.4",  # [hf]: accelerate, for lm-eval's Hugging Face backend (the tests')
    # The HTTP server (extra `serve`) and its tests: the official OpenAI client against it.
    "fastapi>=0.115",
    "uvicorn>=0.30",
    "python-multipart>=0.0.9",
    "openai>=1.40",
    # The browser tests of serve's page (the renders' group `browser`; .ci/run installs a
    # Chromium and sets REQUIRE_BROWSER=1 so that they cannot skip there).
    "playwright>=1.45",
    "mkdocs-material>=9.5",  # the docs session and tests/test_docs.py build the site
]
# What `nox --no-venv -s gpu` imports (README, GPU checks): copier renders, nox runs each
# render's session, pytest its GPU tests; the rest are the generated projects' dependencies.
NO_VENV_MODULES = ["torch", "copier", "pytest", "nox", "tyro", "tqdm", "numpy", "PIL", "tokenizers"]


class Env:
    """Where the shared environment's interpreter is; set by the `env` session, which every
    other session requires, so it has run (once per nox invocation) before they start."""

    python = "python"
    run_env: dict[str, str] = {}  # noqa: RUF012 - one process-wide setting, never mutated


def require_modules(session: nox.Session, modules: list[str]) -> None:
    missing = session.run(
        Env.python,
        "-c",
        "import importlib.util as u, sys; "
        "print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))",
        *modules,
        silent=True,
        external=True,
    )
    if str(missing).strip():
        session.error(
            f"--no-venv uses the python running nox ({Env.python}), which lacks: "
            f"{str(missing).strip()}; "
            "install them there (offline: pip install --no-index --find-links <wheel folder>)"
        )


def run_python(session: nox.Session, *args: str | Path, **kwargs: Any) -> Any:
    """Run `python ...` (the shared environment's, or PATH's under --no-venv)."""
    env = {**Env.run_env, **kwargs.pop("env", {})}
    return session.run(Env.python, *map(str, args), env=env, external=True, **kwargs)
