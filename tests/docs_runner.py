"""Running the commands and snippets the docs show (tests/test_docs.py says which and why).

The driver runs `python -m <module>` steps in one process (torch imported once); `Runner`
gives each page its own copy of the rendered project; `rewrite` turns a page's command into
the one executed here; the snippet driver forks one child per ```python snippet. The tests
that use them, and the rules, are in tests/test_docs.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from docs_collect import (
    CHEAP_PROJECT_SESSIONS,
    PACKAGE,
    RUN_BY_TEMPLATE_GPU,
    SHRINK,
    SHRINK_BY_MODULE,
    Command,
    Page,
    _session_args,
)
from helpers import git_init_commit
from matrix import MATRIX, SLOW_FILES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TEMPLATE_SOURCES = (
    "gh:copier-pytorch/copier-pytorch",
    "https://github.com/copier-pytorch/copier-pytorch",
)


# Runs `python -m <module> args...` steps in one process, so torch is imported once. Each
# step gets fresh argv, its own cwd, captured output, and its signal handlers and dynamo
# state reset afterwards.
DRIVER = r"""
import contextlib, io, json, os, runpy, signal, sys, time, traceback
steps = json.loads(open(sys.argv[1]).read())
results = []
for step in steps:
    os.chdir(step["cwd"])
    start = time.perf_counter()
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    out = io.StringIO()
    code = 0
    sys.argv = [step.get("path") or step["module"], *step["args"]]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            if "path" in step:  # a script the page writes (a title="x.py" block)
                runpy.run_path(step["path"], run_name="__main__")
            else:
                runpy.run_module(step["module"], run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    for s, handler in saved.items():
        signal.signal(s, handler)
    try:
        import torch
        torch._dynamo.reset()
    except Exception:
        pass
    seconds = time.perf_counter() - start
    results.append({"code": code, "output": out.getvalue()[-4000:], "seconds": seconds})
json.dump(results, sys.__stdout__)
"""


def fake_image_folder(root: Path) -> None:
    """A tiny stand-in for a dataset the docs point --data-dir at: two classes of images."""
    from PIL import Image

    for label, colour in (("cat", (200, 40, 40)), ("dog", (40, 40, 200))):
        (root / label).mkdir(parents=True, exist_ok=True)
        for index in range(20):
            shade = tuple(min(255, c + 3 * index) for c in colour)
            Image.new("RGB", (8, 8), shade).save(root / label / f"{index:04}.png")


def fake_text_folder(root: Path) -> None:
    """A tiny stand-in for a language model's --data-dir: a few files of text."""
    root.mkdir(parents=True, exist_ok=True)
    for index in range(3):
        lines = [f"def f{index}_{n}(x):\n    return x * {n} + {index}\n" for n in range(200)]
        (root / f"part{index}.py").write_text("\n".join(lines))


class Runner:
    """Executes one page's commands in its own copy of the rendered project."""

    def __init__(self, base: Path, workspace: Path, page: Page):
        self.workspace = workspace
        self.copies = 0
        self.project = workspace / "my-torch-project"
        shutil.copytree(base, self.project, ignore=shutil.ignore_patterns("__pycache__"))
        for name, content in page.files.items():
            target = self.project / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
        git_init_commit(self.project)  # a clean tree, as `copier update` requires
        self.env = {**os.environ, "PYTHONPATH": str(self.project / "src")}
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env['PATH']}"
        self.made: list[str] = []  # folders an earlier example_data or prepare step writes

    def isolated(self) -> Path:
        """A fresh copy of the project, for a command that runs beside the others."""
        self.copies += 1
        target = self.workspace / f"isolated{self.copies}"
        outputs = {"runs", "profiles", "benchmarks", ".git"}  # at the top only: not the package
        root = str(self.project)
        shutil.copytree(
            self.project,
            target,
            ignore=lambda folder, names: outputs.intersection(names) if folder == root else (),
        )
        return target

    def module_step(self, module: str, args: list[str]) -> dict:
        short = module.rsplit(".", 1)[-1]
        language_model = (self.project / "src" / PACKAGE / "language/text.py").exists()
        if short == "example_data" and args:
            self.made.append(args[0].rstrip("/") + "/")
        if short == "prepare" and flag_value(args, "--out"):  # it writes only a new folder
            self.made.append(str(flag_value(args, "--out")).rstrip("/") + "/")
        data_dir = flag_value(args, "--data-dir")
        made = data_dir and any((data_dir + "/").startswith(m) for m in self.made)
        if data_dir and not made and not (self.project / data_dir).exists():
            (fake_text_folder if language_model else fake_image_folder)(self.project / data_dir)
        shrink = SHRINK_BY_MODULE.get(short, [])
        if language_model and short == "train":
            # A transformer's step is slower: one epoch, and windows of 64 tokens (the 256 of
            # an earlier configs/cpu-30min.toml took 30 s here in bf16, emulated).
            shrink = [*shrink, "--epochs", "1", "--seq-len", "64"]
            if budget_in_config(self.project, args):  # configs/cpu-30min.toml's 2,800 steps
                args = [*args, "--max-steps", "1", "--eval-every", "1"]
            if any(flag in args for flag in BUDGETS):
                # A step budget replaces --epochs (and --max-steps-per-epoch would not
                # shorten it): its own flags shrink instead.
                args = shrink_budget(args)
                shrink = [*SHRINK[:-2], "--seq-len", "64"]
        return {"cwd": str(self.project), "module": module, "args": [*args, *shrink]}

    def script_step(self, path: str, args: list[str]) -> dict:
        """`python FILE.py` of a file the page writes: a step of the driver, in page order,
        since the module commands after it may read what it writes (a model folder)."""
        return {"cwd": str(self.project), "module": path, "path": path, "args": args}

    def shell(self, words: list[str], cwd: Path, env: dict[str, str] | None = None):
        return subprocess.run(
            words,
            cwd=cwd,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=300,
        )


def flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def env_prefix(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, value = words[0].split("=", 1)
        env[key] = value
        words = words[1:]
    return env, words


def output_promised(command: Command, code: int, output: str) -> str | None:
    """None when the command did what the page says, else what went wrong."""
    flat = " ".join(output.split())
    missing = [line for line in command.output if " ".join(line.split()) not in flat]
    if missing:
        return f"exited {code}; promised output not found: {missing[0]!r}\n{output[-1500:]}"
    if code != 0 and not command.output:
        return f"exited {code}\n{output[-1500:]}"
    return None


def nox_command() -> list[str]:
    """nox from this environment, else the one on PATH (CI installs nox outside the session's
    environment, whose bin folder nox puts first on PATH, so --no-venv finds torch there)."""
    if importlib.util.find_spec("nox") is not None:
        return [sys.executable, "-m", "nox"]
    found = shutil.which("nox")
    assert found, "nox is neither importable here nor on PATH"
    return [found]


def start_driver(project: Path, steps: list[dict]) -> subprocess.Popen[str]:
    plan = project.parent / "driver-steps.json"
    plan.write_text(json.dumps(steps))
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(plan)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project / "src")},
        text=True,
    )


RUN_OUTPUTS = re.compile(r"runs/|metrics\.jsonl|checkpoints|profiles|benchmarks|--resume")


# A language model's step budget, shrunk to three steps validated every two (the last cut).
BUDGETS = {"--max-steps": "3", "--max-tokens": str(3 * 16 * 64), "--eval-every": "2"}


def budget_in_config(project: Path, args: list[str]) -> bool:
    """Whether the TOML file of `--config` sets a step budget (which flags then shrink)."""
    path = flag_value(args, "--config")
    if path is None or not (project / path).is_file():
        return False
    return any(
        key in tomllib.loads((project / path).read_text()) for key in ("max_steps", "max_tokens")
    )


def shrink_budget(args: list[str]) -> list[str]:
    """`args` with each budget flag's value replaced: the same flags, a few steps' worth."""
    return [BUDGETS.get(before, arg) for before, arg in zip(["", *args[:-1]], args, strict=True)]


def touches_tracked_files_only(words: list[str]) -> bool:
    return words[:3] == [sys.executable, "-m", "copier"] or words[:1] == ["git"]


def runs_alone(item: tuple[Command, Runner, list[str], dict[str, str]]) -> bool:
    command, _, words, _ = item
    return touches_tracked_files_only(words) or not RUN_OUTPUTS.search(command.text)


def rewrite(words: list[str], template_repo: Path) -> list[str]:
    """The command as it is executed here (see the module docstring)."""
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    if words[0] == "torchrun":
        shrink = SHRINK if any(w.endswith(".train") for w in words) else []
        return [sys.executable, "-m", "torch.distributed.run", *words[1:], *shrink]
    if words[:2] == ["git", "commit"]:
        # A page's commit follows its `copier update`, which here updates to the same commit
        # and so changes nothing: the commit must not fail for having nothing to commit.
        return [*words[:2], "--allow-empty", *words[2:]]
    if words[0] == "copier":
        words = [str(template_repo) if w in TEMPLATE_SOURCES else w for w in words]
        extra = [] if "--defaults" in words or words[1] == "check-update" else ["--defaults"]
        if words[1] in ("copy", "update") and not any(w.startswith("--vcs-ref") for w in words):
            extra += ["--vcs-ref", "HEAD"]
        return [sys.executable, "-m", "copier", words[1], *extra, *words[2:]]
    return words


def run_by_the_lm_render(command: Command, args: list[str], project: Path) -> str | None:
    """`python -m pytest [-m M] [-k K] [-s] tests/<file>.py` on the language model's page counts
    as run when the render matrix runs that selection in its LM render (the whole suite but
    `slow` tests, and matrix.SLOW_FILES with `slow`) and selects at least one test here."""
    markers, files = flag_value(args, "-m") or "", [a for a in args if a.startswith("tests/")]
    lm_renders = [name for name, answers in MATRIX.items() if answers.get("task") == "lm"]
    if "slow" in markers.replace("not slow", ""):
        slow_files = {file for name in lm_renders for file in SLOW_FILES.get(name, [])}
        if not files or not set(files) <= slow_files:
            return (
                f"{command.where()}: the render matrix does not run the slow tests of "
                f"{files or 'the whole suite'} in an LM render (matrix.SLOW_FILES)"
            )
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project / "src")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if collected.returncode != 0 or "::" not in collected.stdout:
        return f"{command.where()}: selects no test in the LM render:\n{collected.stdout[-1500:]}"
    return None


def covered_by_project_tests(
    command: Command, module: str, args: list[str], project: Path
) -> str | None:
    """A command too slow to run here (a benchmark takes minutes, torchrun three processes)
    counts as run when a test of the generated project, which the render matrix runs in CI,
    calls the same module with every flag the docs show (values such as paths may differ)."""
    name = module.rsplit(".", 1)[-1]
    flags = {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}
    for test in sorted((project / "tests").rglob("test_*.py")):
        source = test.read_text()
        if f"{name}.main(" not in source and module not in source:
            continue
        if all(re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", source) for flag in flags):
            return None
    return (
        f"{command.where()}: no test of the generated project runs {module} with "
        f"{sorted(flags)}; add one, or show flags that a test uses"
    )


def project_parser(project: Path):
    """The generated project's real training parser, for commands that are only parsed:
    `parse_args(argv)` parses and validates as `train` does (SystemExit when it refuses)."""
    sys.path.insert(0, str(project / "src"))
    try:
        from my_torch_project.config import parse_config  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(project / "src"))
    return SimpleNamespace(parse_args=lambda argv: parse_config(argv, description="train"))


def parse_only(command: Command, words: list[str], train_parser) -> list[str]:
    """Check a marked command's arguments with the real parsers (torchrun's and the project's)."""
    if words[:1] == ["srun"]:
        words = words[1:]
    module_args: list[str] | None = None
    launcher = words[:3] == ["python", "-m", f"{PACKAGE}.runtime.launch"]  # torchrun's arguments
    if words[:1] == ["torchrun"] or launcher:
        from torch.distributed.run import get_args_parser

        try:
            args = get_args_parser().parse_args(words[3:] if launcher else words[1:])
        except SystemExit:
            return [f"{command.where()}: torchrun does not accept these arguments"]
        if args.module and args.training_script == f"{PACKAGE}.train":
            module_args = args.training_script_args
    elif words[:3] == ["python", "-m", f"{PACKAGE}.train"]:
        module_args = words[3:]
    if module_args is not None:
        try:
            train_parser.parse_args(module_args)
        except SystemExit:
            return [f"{command.where()}: the training script rejects these flags"]
    return []


def check_nox(command, words, template_sessions, ci_sessions, project_sessions) -> str | None:
    sessions = _session_args(words)
    if not sessions:
        return f"{command.where()}: name the sessions (`nox -s NAME`) so they can be checked"
    for session in sessions:
        in_template = session in template_sessions and session in ci_sessions
        in_project = session in project_sessions and (
            session in CHEAP_PROJECT_SESSIONS
            or session == "tests"
            or (session in RUN_BY_TEMPLATE_GPU and "gpu" in ci_sessions)
        )
        if not (in_template or in_project):
            return (
                f"{command.where()}: session {session!r} is not a session that .ci/run runs "
                "(template) nor a session of the generated noxfile"
            )
    return None


# Imports torch and the project's package once, then forks one child per snippet: each child
# starts from that state (no RNG, determinism or anomaly setting left over by another snippet)
# and pays only for its own work. Nothing has run in the parent, so no thread pool is forked.
SNIPPET_DRIVER = r"""
import ast, json, os, signal, sys, time, traceback, types
import torch
import my_torch_project.utils

def dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None

def trace(code, name):
    tree = ast.parse(code, name)
    compile(tree, name, "exec")
    namespace = {"__name__": "__traced__"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            exec(compile(ast.Module([node], []), name, "exec"), namespace)
    for node in ast.walk(tree):
        chain = dotted(node) if isinstance(node, ast.Attribute) else None
        if chain and isinstance(namespace.get(chain[0]), types.ModuleType):
            value = namespace[chain[0]]
            for index, part in enumerate(chain[1:], 1):
                if not hasattr(value, part):
                    missing = ".".join(chain[: index + 1])
                    raise AttributeError(f"line {node.lineno}: {missing} does not exist")
                value = getattr(value, part)

snippets = json.load(open(sys.argv[1]))
results = []
for snippet in snippets:
    os.makedirs(snippet["cwd"], exist_ok=True)
    output = os.path.join(snippet["cwd"], "output.txt")
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(snippet["cwd"])
            fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            signal.alarm(snippet["limit"])
            if snippet["trace"]:
                trace(snippet["code"], snippet["name"])
            else:
                exec(compile(snippet["code"], snippet["name"], "exec"), {"__name__": "__main__"})
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    with open(output) as file:
        text = file.read()
    results.append({
        "code": os.waitstatus_to_exitcode(status),
        "output": text[-3000:],
        "seconds": time.perf_counter() - start,
    })
json.dump(results, sys.stdout)
"""
