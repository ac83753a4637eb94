"""A project with the edits real users make, rendered from the last release and updated to the
working tree, as the most careful templates test their updates.

The kept example of user edits (below, applied to a render of v0.1.0): a rewritten model.py
with an extra architecture and a new `build_model` argument passed by train.py (as v0.1.0's
docstring advised), a custom data source in data.py, changed config defaults and a new field,
a rewritten README and a test of their own. After `copier update`: conflicts only where the
CHANGELOG's Upgrade notes say, resolved as they say; every module imports; training runs; the
user's tests and a few of the template's pass.

When a template change makes this fail, either keep the change compatible with these edits, or
add an Upgrade note and teach `resolve_as_the_upgrade_notes_say` what the note tells users.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from helpers import ROOT, copy_template_repo, git, git_init_commit, render, run
from test_release import release_revision

pytestmark = [pytest.mark.update, pytest.mark.slow]

RELEASE = "0.1.0"
PACKAGE = "edited_project"
# Files where these edits and the template's changes since RELEASE touch the same lines.
EXPECTED_CONFLICTS = {
    "src/edited_project/config.py",  # grouped dataclasses (issue 14) meet the user's edits
    "src/edited_project/data.py",  # the template's grouped reads next to the user's source
    "src/edited_project/model.py",
    "src/edited_project/train.py",
}

USER_README = """# Edited project

Our classifier for parity images. Results: see `runs/`. Contact: the team.
"""

USER_MODEL_DOC = (
    '''"""Our models: the template's CNN and MLP, and our residual MLP (`--model resmlp`)."""'''
)

USER_RESMLP = '''
class ResMLP(nn.Module):
    """Our residual MLP: `depth` residual blocks over flattened inputs."""

    def __init__(self, in_features: int, num_classes: int, width: int, depth: int):
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


'''

USER_DATA_SOURCE = '''

def make_parity(samples: int, image_size: int, seed: int) -> TensorDataset:
    """Our data source: images whose class is the parity of their bright pixels."""
    generator = torch.Generator().manual_seed(seed)
    inputs = (torch.rand(samples, 3, image_size, image_size, generator=generator) > 0.5).float()
    targets = inputs[:, 0].sum(dim=(1, 2)).long() % 2
    return TensorDataset(inputs, targets)
'''

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
    assert (config.epochs, config.depth) == (7, 3)


def test_the_parity_source():
    train, _, info = build_datasets(Config(data_dir="parity", image_size=8))
    assert info.num_classes == 2 and len(train) == Config().train_samples
'''


def edit(path: Path, pattern: str, replacement: str) -> None:
    """A regex edit that must match exactly once: a drifted release fails loudly here."""
    text, count = re.subn(pattern, replacement, path.read_text(), flags=re.M)
    assert count == 1, f"{pattern!r} matched {count} times in {path}"
    path.write_text(text)


def make_user_edits(project: Path) -> None:
    package = project / "src" / PACKAGE
    model = package / "model.py"
    text, count = re.subn(r'\A""".*?"""', lambda _: USER_MODEL_DOC, model.read_text(), flags=re.S)
    assert count == 1
    model.write_text(text)
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
    config = package / "config.py"
    edit(config, r'"model": \("cnn", "mlp"\)', '"model": ("cnn", "mlp", "resmlp")')
    edit(config, r"(epochs: int = field\(default=)5\b", r"\g<1>7")
    edit(
        config,
        r"^(    dropout: float = field\(.*\n)",
        r'\1    depth: int = field(default=3, metadata={"help": "residual blocks (resmlp)"})\n',
    )
    edit(
        package / "train.py",
        r"^(            dropout=config\.dropout,\n)",
        r"\1            depth=config.depth,\n",
    )
    data = package / "data.py"
    edit(data, r"^(?=def build_datasets\()", USER_DATA_SOURCE.lstrip("\n") + "\n\n")
    edit(
        data,
        r"^(    if config\.data_dir is None:\n)",
        '    if config.data_dir == "parity":\n'
        "        train = make_parity(config.train_samples, config.image_size, seed=1)\n"
        "        val = make_parity(config.val_samples, config.image_size, seed=2)\n"
        "        return train, val, DataInfo(3, config.image_size, 2, in_memory=True)\n"
        r"\1",
    )
    (project / "README.md").write_text(USER_README)
    (project / "tests" / "test_our_model.py").write_text(USER_TEST)


BOTH_SIDES = re.compile(r"<<<<<<< [^\n]*\n(.*?)=======\n(.*?)>>>>>>> [^\n]*\n", re.S)


def take(path: Path, side: int) -> None:
    """Resolve every conflict in `path` with one side: 1 before updating (ours), 2 after."""
    path.write_text(BOTH_SIDES.sub(lambda m: m[side], path.read_text()))


# The Upgrade note's table (config through tyro): each field by its group; `depth` is ours.
GROUPS = {"model": "model", "width": "model", "dropout": "model", "depth": "model"}
GROUPS |= dict.fromkeys(
    [
        "data_dir",
        "val_fraction",
        "image_size",
        "num_classes",
        "train_samples",
        "val_samples",
        "synthetic_noise",
        "num_workers",
    ],
    "data",
)
GROUPS |= dict.fromkeys(
    [
        "epochs",
        "batch_size",
        "lr",
        "weight_decay",
        "warmup_steps",
        "grad_accum_steps",
        "grad_clip",
        "max_steps_per_epoch",
    ],
    "optim",
)
GROUPS |= dict.fromkeys(["run_dir", "resume", "device", "seed", "deterministic"], "run")
GROUPS |= dict.fromkeys(
    ["precision", "compile", "compile_mode", "compile_backend", "tf32", "cudnn_benchmark"], "speed"
)
GROUPS |= dict.fromkeys(
    ["detect_anomaly", "log_every", "progress", "tracker", "experiment", "tracker_uri"], "log"
)
FLAT_READ = re.compile(r"\b(config|Config\(\))\.(" + "|".join(GROUPS) + r")\b(?!\.)")


def regroup(path: Path) -> None:
    """`config.width` -> `config.model.width`, as the Upgrade note says for the user's files."""
    path.write_text(FLAT_READ.sub(lambda m: f"{m[1]}.{GROUPS[m[2]]}.{m[2]}", path.read_text()))


def resolve_as_the_upgrade_notes_say(project: Path) -> None:
    """What CHANGELOG.md's Upgrade notes tell this user to do."""
    package = project / "src" / PACKAGE
    take(package / "train.py", 2)  # the template's train.py: it calls build_model_for
    take(package / "model.py", 1)  # our model.py
    # data.py: the template's side, with our data source put back in front of its branches.
    data = package / "data.py"
    take(data, 2)
    if "def make_parity(" not in data.read_text():
        edit(data, r"^(?=def build_datasets\()", USER_DATA_SOURCE.lstrip("\n") + "\n\n")
    edit(
        data,
        r"^(    if config\.data\.data_dir is None:\n)",
        '    if config.data_dir == "parity":\n'
        "        train = make_parity(config.train_samples, config.image_size, seed=1)\n"
        "        val = make_parity(config.val_samples, config.image_size, seed=2)\n"
        "        return train, val, DataInfo(3, config.image_size, 2, in_memory=True)\n"
        r"\1",
    )
    # config.py: the template's grouped dataclasses, with our choice, default and field put
    # back where they now belong.
    config = package / "config.py"
    take(config, 2)
    edit(config, r'(model: Literal\["cnn", "mlp")\]', r'\1, "resmlp"]')
    edit(config, r"(epochs: int = field\(default=)5\b", r"\g<1>7")
    edit(
        config,
        r"^(    dropout: float = field\(.*\n)",
        r'\1    depth: int = field(default=3, metadata={"help": "residual blocks (resmlp)"})\n',
    )
    model = package / "model.py"
    text = model.read_text()
    if "def build_model_for(" not in text:  # the note: add it, passing our own argument
        text += (
            "\n\ndef build_model_for(config, info):\n    return build_model(\n"
            "        config.model, in_channels=info.in_channels, image_size=info.image_size,\n"
            "        num_classes=info.num_classes, width=config.width, dropout=config.dropout,\n"
            "    )\n"
        )
    model.write_text(text)
    # Fields are read through their group now: in our model.py, data.py and test.
    for path in (model, data, project / "tests" / "test_our_model.py"):
        regroup(path)
    # ...and pass the argument we added to build_model, which train.py no longer passes.
    text, count = re.subn(
        r"dropout=config\.model\.dropout,(\s*)\)",
        r"dropout=config.model.dropout, depth=config.model.depth,\1)",
        model.read_text(),
    )
    assert count == 1, "build_model_for's call of build_model not found"
    model.write_text(text)
    test = project / "tests" / "test_our_model.py"
    edit(
        test,
        r'Config\(data_dir="parity", image_size=8\)',
        'Config().replace(data_dir="parity", image_size=8)',
    )


def test_a_project_with_real_edits_updates_from_the_last_release(tmp_path):
    history = tmp_path / "history"
    run(["git", "clone", "-q", "--no-checkout", ROOT, history], tmp_path)
    for tag in git(history, "tag", "--list").split():
        git(history, "tag", "-d", tag)
    release = git(ROOT, "rev-parse", f"{release_revision(RELEASE)}^{{commit}}")
    git(history, "tag", f"v{RELEASE}", release)
    current = copy_template_repo(tmp_path / "current")  # the working tree as the next release
    git(history, "fetch", "-q", str(current), "main")
    git(history, "tag", "v99.0.0", "FETCH_HEAD")

    project = render(
        tmp_path / "project", {"project_name": "edited-project"}, src=history, vcs_ref=f"v{RELEASE}"
    )
    git_init_commit(project, f"rendered from v{RELEASE}")
    make_user_edits(project)
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "our edits")
    env = {"PYTHONPATH": str(project / "src")}
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
    run([*pytest_cmd, "tests/test_our_model.py"], project, env=env)  # the edits work on v0.1.0

    result = run([sys.executable, "-m", "copier", "update", "--defaults"], project)
    conflicted = set(git(project, "diff", "--name-only", "--diff-filter=U").split())
    assert conflicted == EXPECTED_CONFLICTS, (
        f"conflicts {sorted(conflicted)}, expected {sorted(EXPECTED_CONFLICTS)}: a template "
        "change meets these user edits (see this module's docstring)\n" + result.stdout
    )
    assert (project / "README.md").read_text() == USER_README
    assert (project / "docs" / "template.md").is_file()

    resolve_as_the_upgrade_notes_say(project)
    train = [sys.executable, "-m", f"{PACKAGE}.train", "--model", "resmlp", "--data-dir", "parity"]
    small = ["--epochs", "1", "--train-samples", "64", "--val-samples", "32", "--batch-size", "16"]
    train += [*small, "--image-size", "8", "--run-dir", str(tmp_path / "run")]

    # Had they kept their model.py without build_model_for: one line naming it, exit code 2.
    model = project / "src" / PACKAGE / "model.py"
    resolved = model.read_text()
    model.write_text(resolved.split("\ndef build_model_for(")[0])
    refused = run(train, project, env=env, check=False)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()], refused.stderr
    assert "has no build_model_for(config, info)" in refused.stderr
    model.write_text(resolved)

    assert not BOTH_SIDES.search("".join(p.read_text() for p in project.rglob("*.py")))
    modules = sorted(p.stem for p in (project / "src" / PACKAGE).glob("*.py"))
    imports = "; ".join(f"import {PACKAGE}.{m}" for m in modules if m != "__init__")
    run([sys.executable, "-c", imports], project, env=env)  # every relative import resolves
    run(train, project, env=env)
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    selected = ["tests/test_our_model.py", "tests/test_config.py", "tests/test_smoke.py"]
    run([*pytest_cmd, "-m", "not gpu and not slow", *selected], project, env=env)
