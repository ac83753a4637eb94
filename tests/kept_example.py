"""The kept example's user: their edits to a v0.2.0 project, and how they run it.

tests/test_update_kept_example.py updates this project to the working tree by following the
CHANGELOG's Upgrade notes (tests/upgrade_notes.py); what is here is what the user knows: their
own edits (made where 0.2.0 told users to make them), and, for a note that moves their code to
an extension point, how they rewrite their lines against the signature the note gives.
"""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

from helpers import ROOT, git, git_init_commit, render, run
from upgrade_notes import Step, conflicted_files, parse_steps

RELEASE = "0.2.0"
PACKAGE = "edited_project"
SRC = f"src/{PACKAGE}"
# `<<<<<<<` blocks per file that `copier update --defaults` leaves in the kept example, and in
# the project with two changed defaults only: config.py and data.py were rewritten in this
# release (their template halves moved to config_base.py and data_sources.py, issue 28), each
# conflicts in one block where the user edited it; train.py in its imports and epoch end;
# model.py in its docstring and where the user's `build_model` ladder meets the template's
# registrations (0.4.0: the template's models registered with @slots.model, issue 52).
CONFLICT_BLOCKS = {
    f"{SRC}/config.py": 1,
    f"{SRC}/data.py": 1,
    f"{SRC}/model.py": 2,
    f"{SRC}/train.py": 2,
}
DEFAULTS_CONFLICT_BLOCKS = {f"{SRC}/config.py": 1}

USER_README = """# Edited project

Our classifier for parity images. Results: see `runs/`. Contact: the team.
"""

USER_MODEL_DOC = (
    '''"""Our models: the template's CNN and MLP, and our residual MLP (`--model resmlp`)."""'''
)

USER_RESMLP = '''
class ResMLP(nn.Module):
    """Our residual MLP: `depth` residual blocks over flattened inputs."""

    def __init__(self, in_features: int, num_classes: int, width: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Sequential(nn.Flatten(), nn.Linear(in_features, width))
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
            for _ in range(depth)
        )
        self.out = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def mean_confidence(model: nn.Module, loader: Any, device: torch.device) -> float:
    """Our metric: the mean top-1 softmax probability over `loader`."""
    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, _ in loader:
            probs = model(inputs.to(device)).float().softmax(dim=1)
            total += probs.max(dim=1).values.sum().item()
            count += inputs.shape[0]
    return total / max(count, 1)


'''

USER_DATA_SOURCE = '''

def make_parity(samples: int, image_size: int, seed: int) -> TensorDataset:
    """Our data source: images whose class is the parity of their bright pixels."""
    generator = torch.Generator().manual_seed(seed)
    inputs = (torch.rand(samples, 3, image_size, image_size, generator=generator) > 0.5).float()
    targets = inputs[:, 0].sum(dim=(1, 2)).long() % 2
    return TensorDataset(inputs, targets)
'''

PARITY_BRANCH = (
    '    if config.data.data_dir == "parity":\n'
    "        size = config.data.image_size\n"
    "        train = make_parity(config.data.train_samples, size, seed=1)\n"
    "        val = make_parity(config.data.val_samples, size, seed=2)\n"
    "        return train, val, DataInfo(3, size, 2, in_memory=True)\n"
)

USER_METRIC = (
    '            val["val_confidence"] = mean_confidence(raw_model, val_loader, device)  # ours\n'
)

USER_TEST = f'''"""Our tests, written against v{RELEASE}."""

import torch

from {PACKAGE}.config import Config
from {PACKAGE}.data import build_datasets
from {PACKAGE}.model import build_model


def test_resmlp_has_the_depth_we_ask_for():
    model = build_model(
        "resmlp", in_channels=3, image_size=8, num_classes=2, width=16, dropout=0.0, depth=3
    )
    assert len(model.blocks) == 3
    assert model(torch.zeros(2, 3, 8, 8)).shape == (2, 2)


def test_our_defaults():
    config = Config()
    assert (config.optim.epochs, config.optim.lr, config.model.depth) == (7, 1e-3, 3)


def test_the_parity_source():
    train, _, info = build_datasets(Config().replace(data_dir="parity", image_size=8))
    assert info.num_classes == 2 and len(train) == Config().data.train_samples
'''


def edit(path: Path, pattern: str, replacement: str) -> None:
    """A regex edit that must match exactly once: a drifted release fails loudly here."""
    text, count = re.subn(pattern, replacement, path.read_text(), flags=re.M)
    assert count == 1, f"{pattern!r} matched {count} times in {path}"
    path.write_text(text)


def change_defaults(project: Path) -> None:
    """What a user does first: their own defaults, in the fields 0.2.0 put them in."""
    config = project / SRC / "config.py"
    edit(config, r"(epochs: int = field\(default=)5\b", r"\g<1>7")
    edit(config, r"(lr: float = field\(default=)3e-3\b", r"\g<1>1e-3")


def make_user_edits(project: Path) -> None:
    package = project / SRC
    model = package / "model.py"
    text, count = re.subn(r'\A""".*?"""', lambda _: USER_MODEL_DOC, model.read_text(), flags=re.S)
    assert count == 1
    model.write_text(text)
    edit(model, r"^(import torch\n)", r"from typing import Any\n\n\1")
    edit(model, r"^(?=def build_model\()", USER_RESMLP.lstrip("\n"))
    edit(
        model,
        r"dropout: float\n\) -> nn\.Module:",
        "dropout: float, depth: int = 2\n) -> nn.Module:",
    )
    edit(
        model,
        r"^(?=    raise ValueError\(f\"unknown model)",
        '    if name == "resmlp":\n'
        "        features = in_channels * image_size * image_size\n"
        "        return ResMLP(features, num_classes, 8 * width, depth)\n",
    )
    edit(
        model,
        r"^(        dropout=config\.model\.dropout,\n)",
        r"\1        depth=config.model.depth,\n",
    )
    change_defaults(project)
    config = package / "config.py"
    edit(config, r'(model: Literal\["cnn", "mlp")\]', r'\1, "resmlp"]')
    edit(
        config,
        r"^(    dropout: float = field\(.*\n)",
        r'\1    depth: int = field(default=3, metadata={"help": "residual blocks (resmlp)"})\n',
    )
    data = package / "data.py"
    edit(data, r"^(?=def build_datasets\()", USER_DATA_SOURCE.lstrip("\n") + "\n\n")
    edit(data, r"^(?=    if config\.data\.data_dir is None:\n)", PARITY_BRANCH)
    train = package / "train.py"
    edit(train, r"^(from \.metrics import .*\n)", r"\1from .model import mean_confidence\n")
    edit(train, r"^(                val = evaluate\(raw_model, .*\n)", r"\1" + USER_METRIC)
    (project / "README.md").write_text(USER_README)
    (project / "tests" / "test_our_model.py").write_text(USER_TEST)


def replace_return(path: Path, name: str, body: str) -> list[str]:
    """Put `body` in place of the final `return` of function `name` in `path`; returns the
    function's parameter names (the user writes their lines against them)."""
    text = path.read_text()
    found = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{path.name} has no def {name}"
    last = found[0].body[-1]
    assert isinstance(last, ast.Return), f"{name}'s skeleton ends with its return"
    lines = text.splitlines(keepends=True)
    indent = " " * last.col_offset
    lines[last.lineno - 1 : last.end_lineno] = [textwrap.indent(body, indent)]
    path.write_text("".join(lines))
    return [a.arg for a in found[0].args.args]


def add_imports(path: Path, *lines: str) -> None:
    """Our imports, after the file's last top-level import, each unless it is there."""
    text = path.read_text()
    missing = "".join(f"{line}\n" for line in lines if line not in text)
    last = [n for n in ast.parse(text).body if isinstance(n, ast.Import | ast.ImportFrom)][-1]
    parts = text.splitlines(keepends=True)
    path.write_text("".join(parts[: last.end_lineno]) + missing + "".join(parts[last.end_lineno :]))


def move_our_metric(project: Path, path: Path, step: Step) -> None:
    """Our metric, the mean top-1 probability, as the extension point's per-batch sum: the
    note gives the place and the parameters, we know the metric."""
    text = path.read_text()
    params = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)]
    (func,) = [n for n in params if n.name == "extra_metrics"]
    logits, _ = [a.arg for a in func.args.args]  # our metric needs the logits alone
    body = f'return {{"confidence": {logits}.float().softmax(dim=1).max(dim=1).values.sum()}}\n'
    replace_return(path, "extra_metrics", body)


def move_our_defaults(project: Path, path: Path, step: Step) -> None:
    """Our two defaults, as the arguments of their group in `Config`'s group line."""
    group_line(path, "optim", "lambda: OptimConfig(epochs=7, lr=1e-3)")


def move_our_config(project: Path, path: Path, step: Step) -> None:
    """Our defaults, and our `depth` field and `resmlp` choice in a subclass of the model
    group (so model.py keeps reading `config.model.depth`), as the note's prose says."""
    move_our_defaults(project, path, step)
    group_line(path, "model", "MyModelConfig")
    add_imports(path, "from typing import Literal")
    text = path.read_text()
    at = text.index("@dataclass\nclass Config(")
    path.write_text(text[:at] + MY_MODEL_CONFIG + "\n\n" + text[at:])


MY_MODEL_CONFIG = """@dataclass
class MyModelConfig(ModelConfig):
    model: Literal["cnn", "mlp", "resmlp"] = field(  # type: ignore[assignment]
        default="cnn", metadata={"help": "model architecture"}
    )
    depth: int = field(default=3, metadata={"help": "residual blocks (resmlp)"})
"""


def group_line(path: Path, group: str, factory: str) -> None:
    """`group: Type = field(default_factory=...)` in `Config` gets `factory`."""
    text, count = re.subn(
        rf"^(    {group}: )\w+( = field\(default_factory=)[^\n]*\)$",
        rf"\1{factory.removeprefix('lambda: ').split('(')[0]}\2{factory})",
        path.read_text(),
        flags=re.M,
    )
    assert count == 1, f"no `{group}: ... = field(default_factory=...)` line in {path}"
    path.write_text(text)


def move_our_source(project: Path, path: Path, step: Step) -> None:
    """Our parity source, as a source of the registry: `make_parity`, and a function that
    answers for `--data-dir parity` and None otherwise."""
    shown = [n for n in ast.parse(step.code).body if isinstance(n, ast.FunctionDef)]
    (param,) = [a.arg for a in shown[0].args.args] if shown else ["config"]  # a source's one
    add_imports(
        path,
        "from typing import Any",
        "import torch",
        "from torch.utils.data import TensorDataset",
        "from .config import Config",
    )
    ours = USER_DATA_SOURCE + "\n\n" + f"def parity_source({param}: Config) -> Any:\n"
    ours += PARITY_BRANCH.replace("config.", f"{param}.") + "    return None\n"
    text = path.read_text()
    text, count = re.subn(r"^(SOURCES: [^=]+= )\[\]", r"\1[parity_source]", text, flags=re.M)
    assert count == 1, f"no empty `SOURCES` list in {path}"
    lines = text.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("SOURCES"))
    while at and lines[at - 1].startswith("#"):  # above the comment that introduces it
        at -= 1
    path.write_text("".join(lines[:at]) + ours.lstrip("\n") + "\n\n" + "".join(lines[at:]))


NOUNS = ("config defaults and fields", "Config"), ("data sources", "SOURCES")
METRICS = ("per-epoch metrics", "extra_metrics")
# What each user does for a Move note, by its (noun, name): the kept example's user...
MOVERS = {NOUNS[0]: move_our_config, NOUNS[1]: move_our_source, METRICS: move_our_metric}
# ...and the user who changed two defaults and nothing else.
DEFAULTS_MOVERS = {NOUNS[0]: move_our_defaults}


# --------------------------------------------------------------------------------------------
def rendered_release(history: Path, dest: Path) -> Path:
    project = render(dest, {"project_name": "edited-project"}, src=history, vcs_ref=f"v{RELEASE}")
    git_init_commit(project, f"rendered from v{RELEASE}")
    return project


def commit_all(project: Path, message: str) -> None:
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", message)


ENV_SRC = "PYTHONPATH"
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
SMALL = ["--train-samples", "64", "--val-samples", "32", "--batch-size", "16", "--image-size", "8"]
OURS = ["--model", "resmlp", "--data-dir", "parity", *SMALL]


def train(project: Path, *flags: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", f"{PACKAGE}.train", *flags]
    return run(cmd, project, env={ENV_SRC: str(project / "src")}, check=check)


def clone(kept: Path, dest: Path) -> Path:
    """A copy of the kept example, its ignored run folder (the 0.2.0 checkpoint) included."""
    run(["git", "clone", "-q", kept, dest], kept.parent)
    shutil.copytree(kept / "runs", dest / "runs")
    return dest


def notes_after_release(project: Path) -> list[Step]:
    """The steps of every note newer than the release the project was on (its last commit)."""
    answers = yaml.safe_load(git(project, "show", "HEAD:.copier-answers.yml"))
    assert answers["_commit"] == f"v{RELEASE}"
    return parse_steps((ROOT / "CHANGELOG.md").read_text(), RELEASE)


def copier(project: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "copier", "update", *args], project, check=check)


def resolved(project: Path) -> None:
    """No marker left; `git add` (the docs' next step) clears the unmerged state, and the
    docs' check, `git diff --check`, passes on what would be committed."""
    assert conflicted_files(project) == {}
    git(project, "add", "-A")
    assert git(project, "diff", "--name-only", "--diff-filter=U") == ""
    git(project, "diff", "--cached", "--check")


def imports_every_module(project: Path, then: str = "") -> None:
    """Every module of the package imports (then `then` runs, in the same process)."""
    modules = sorted(p.stem for p in (project / SRC).glob("*.py") if p.stem != "__init__")
    code = "; ".join([*(f"import {PACKAGE}.{m}" for m in modules), *filter(None, [then])])
    run([sys.executable, "-c", code], project, env={ENV_SRC: str(project / "src")})


# --------------------------------------------------------------------------------------------
# docs/updating.md's commands, as the page writes them
# --------------------------------------------------------------------------------------------

DOC = ROOT / "docs" / "updating.md"


def doc_commands(heading: str) -> list[str]:
    """The commands of the first ```bash block under `heading` in docs/updating.md, comments
    dropped: the tests run what the page shows, so a changed page changes what they run."""
    text = DOC.read_text()
    section = text[text.index(f"\n{heading}\n") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"no bash block under {heading}"
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block[1].splitlines()]
    return [line for line in lines if line]


def run_doc(project: Path, command: str, *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """A command of the page, in `project`: `copier` and `python` are this environment's."""
    words = shlex.split(command)
    if words[0] in ("copier", "python"):
        words = [sys.executable, *(["-m", "copier"] if words[0] == "copier" else []), *words[1:]]
    return run(words, project, env={ENV_SRC: str(project / "src")}, check=check)


def user_lines_lost(project: Path) -> list[str]:
    """Lines the user added (their last commit) that are neither in their file (conflict
    blocks included) nor in a `.rej` file that the page's reject check lists."""
    rejects = set(git(project, "ls-files", "--others", "*.rej").split())
    lost, name = [], ""
    for line in git(project, "diff", "-U0", "HEAD~1", "HEAD").splitlines():
        if line.startswith("+++ b/"):
            name = line[6:]
        elif line.startswith("+") and not line.startswith("+++") and line[1:].strip():
            path = project / name
            here = path.read_text().splitlines() if path.is_file() else []
            rej = project / f"{name}.rej"
            in_rej = f"{name}.rej" in rejects and line in rej.read_text().splitlines()
            if line[1:] not in here and not in_rej:
                lost.append(f"{name}: {line[1:].strip()}")
    return lost


def snapshot(project: Path) -> dict[str, bytes]:
    """Every file of the project, .git and ignored ones included."""
    return {str(p.relative_to(project)): p.read_bytes() for p in project.rglob("*") if p.is_file()}
