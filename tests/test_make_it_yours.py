"""Making a project yours does not fight keeping it updated (issue 35).

A user renders the template, then, editing only the files that are theirs (model.py,
config.py, extensions.py), adds a ResNet chosen by `--model resnet` with its own `--depth` and
`--width-mult`, label-smoothed cross-entropy, SGD with Nesterov momentum and no weight decay on
norms and biases, the step schedule, an EMA used for validation, and a training metric. The
project trains; a run stopped mid-epoch and resumed ends bitwise where an uninterrupted one
does, EMA included; and `copier update` to a release that changes training/loop.py, train.py and
settings/base.py merges with no conflict.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import copy_template_repo, git, git_init_commit, render, run
from test_update import commit_all, conflict_markers, edit, update

pytestmark = pytest.mark.update
PACKAGE = "yours"
USER_FILES = {f"src/{PACKAGE}/{name}.py" for name in ("model", "config", "extensions", "data")}

SETTINGS = '''
@dataclass
class ResNetSettings:
    """Our ResNet's own settings: the flags --depth and --width-mult, TOML table [resnet]."""

    depth: int = field(default=2, metadata={"help": "residual blocks"})
    width_mult: float = field(default=1.0, metadata={"help": "channel multiplier"})


'''
RESNET = """

class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class ResNet(nn.Module):
    def __init__(self, in_channels: int, classes: int, depth: int, width: int):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, width, 3, padding=1)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def resnet_bytes(config: Config) -> int:
    width = max(4, round(16 * config.resnet.width_mult))
    return 16 * config.resnet.depth * 18 * width**2


@slots.model("resnet", help="a small ResNet", memory=resnet_bytes)
def build_resnet(config: Config, info: DataInfo) -> nn.Module:
    width = max(4, round(16 * config.resnet.width_mult))
    return ResNet(info.in_channels, info.num_classes, config.resnet.depth, width)
"""
EXTENSIONS = """

@slots.loss
def smoothed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits, targets, label_smoothing=0.1)


@slots.optimizer
def sgd(config: Any, model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    groups = slots.param_groups(model, config.optim.weight_decay)  # none on norms, biases
    return torch.optim.SGD(groups, lr=config.optim.lr, momentum=0.9, nesterov=True)


@slots.train_metric
def confident(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"confident": (logits.softmax(1).amax(1) > 0.2).sum()}
"""
# Trains uninterrupted, then stopped by SIGTERM mid-epoch 2 and resumed: the same end.
CHECK = """
import json, os, signal, sys
from pathlib import Path

import torch

from yours.checkpointing.checkpoint import load_checkpoint
from yours.runtime.stopping import Interrupted
from yours.config import parse_config
from yours.train import train

ARGS = sys.argv[1:]


def run(name, *extra, on_step=None):
    return train(parse_config([*ARGS, "--run-dir", name, *extra])[0], on_step=on_step)


def stop(step):
    if step == 6:
        os.kill(os.getpid(), signal.SIGTERM)


run("full")
try:
    run("cut", on_step=stop)
except Interrupted:
    pass
else:
    sys.exit("the run was not stopped")
run("cut", "--resume", "auto")
full, cut = (load_checkpoint(Path(n, "checkpoints", "last.pt")) for n in ("full", "cut"))
for key in ("model", "optimizer"):
    if key == "model":
        assert all(torch.equal(full[key][k], cut[key][k]) for k in full[key]), key
ema_full, ema_cut = full["states"]["ema"], cut["states"]["ema"]
assert all(torch.equal(ema_full[k], ema_cut[k]) for k in ema_full), "ema"
assert type(full["optimizer"]) is dict and "momentum_buffer" in str(full["optimizer"])
records = [json.loads(line) for line in Path("full/metrics.jsonl").read_text().splitlines()]
assert all("confident" in r for r in records if r["kind"] == "train")
assert all("train_confident" in r for r in records if r["kind"] == "epoch")
print("same")
"""
LM_SETTINGS = '''
@dataclass
class MlpLmSettings:
    """Our token MLP's own setting: the flag --hidden-mult, TOML table [mlp_lm]."""

    hidden_mult: int = field(default=2, metadata={"help": "hidden width / --width"})


'''
LM_MODEL = """

@slots.model("mlp-lm", help="a per-token MLP over embeddings")
def build_mlp_lm(config: Config, info: DataInfo) -> nn.Module:
    width, hidden = config.model.width, config.model.width * config.mlp_lm.hidden_mult
    return nn.Sequential(
        nn.Embedding(info.num_classes, width), nn.LayerNorm(width),
        nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, info.num_classes),
    )
"""
ARGS = [
    *("--model", "resnet", "--depth", "3", "--width-mult", "0.5", "--epochs", "2"),
    *("--train-samples", "128", "--val-samples", "32", "--batch-size", "32", "--image-size", "8"),
    *("--num-workers", "0", "--compile", "off", "--progress", "false", "--deterministic"),
    *("--device", "cpu", "--log-every", "2", "--tracker", "none"),
]


LM_ARGS = [
    *("--model", "mlp-lm", "--hidden-mult", "3", "--width", "16", "--seq-len", "16"),
    *("--epochs", "2", "--batch-size", "8", "--train-samples", "32", "--val-samples", "8"),
    *("--data-dir", "corpus", "--num-workers", "0", "--compile", "off", "--progress", "false"),
    *("--deterministic", "--device", "cpu", "--log-every", "2", "--tracker", "none"),
]
CHOSEN = {  # the checkpoint holds our model, built with our flag's value
    "image": lambda saved: sum(k.endswith("body.0.weight") for k in saved["model"]) == 3,
    "lm": lambda saved: saved["model"]["2.weight"].shape == (48, 16),
}


def make_it_yours(project: Path, task: str) -> None:
    package = project / "src" / PACKAGE
    edit(
        package / "config.py",
        r"^(?=@dataclass\nclass Config\(BaseConfig\):)",
        (SETTINGS if task == "image" else LM_SETTINGS).lstrip("\n"),
    )
    edit(
        package / "config.py",
        r"optim: OptimConfig = field\(default_factory=OptimConfig\)",
        "optim: OptimConfig = field(\n        default_factory=lambda: OptimConfig(\n"
        '            lr=0.05, weight_decay=5e-4, lr_schedule="step", ema_decay=0.9\n'
        "        )\n    )\n"
        + (
            "    resnet: ResNetSettings = field(default_factory=ResNetSettings)"
            if task == "image"
            else "    mlp_lm: MlpLmSettings = field(default_factory=MlpLmSettings)"
        ),
    )
    edit(
        package / "model.py",
        r"^from torch import nn\n",
        "from torch import nn\n\nfrom . import slots\n",
    )
    edit(package / "model.py", r"\Z", RESNET if task == "image" else LM_MODEL)
    edit(
        package / "extensions.py",
        r"^import torch\n",
        "from typing import Any\n\nimport torch\n\nfrom . import slots\n",
    )
    edit(package / "extensions.py", r"\Z", EXTENSIONS)


@pytest.mark.parametrize("task", ["image", "lm"])
def test_a_project_made_yours_in_your_files_trains_resumes_and_updates_cleanly(tmp_path, task):
    template = copy_template_repo(tmp_path / "template")
    git(template, "tag", "v1.0.0")
    answers = {"project_name": PACKAGE, "task": task}
    project = render(tmp_path / "p", answers, src=template, vcs_ref="v1.0.0")
    git_init_commit(project, "rendered")
    make_it_yours(project, task)
    changed = set(git(project, "diff", "--name-only").split())
    assert changed and changed <= USER_FILES, changed
    commit_all(project, "ours: a ResNet, a loss, SGD, a schedule, an EMA, a metric")

    work = tmp_path / "work"  # runs outside the project: it stays clean for the update
    work.mkdir()
    (work / "check.py").write_text(CHECK)
    (work / "corpus").mkdir()
    (work / "corpus" / "a.txt").write_text("a language model of our own. " * 30)
    args = ARGS if task == "image" else LM_ARGS
    done = run([sys.executable, "check.py", *args], work, env={"PYTHONPATH": str(project / "src")})
    assert "same" in done.stdout
    saved = torch.load(work / "full" / "checkpoints" / "last.pt", weights_only=True)
    assert CHOSEN[task](saved), sorted(saved["model"])[:8]  # our model, with our flag's value

    # The next release reshapes the template's loop, train() and a default.
    pkg = "template/src/{{ package_name }}"
    edit(template / pkg / "training/loop.py", r"^    run\.global_step \+= 1\n",
         "    run.global_step += 1  # counted once the update is applied\n")  # fmt: skip
    edit(template / pkg / "train.py.jinja", r"^(def build_run\()", "# Built once per run.\n\\1")
    edit(template / pkg / "settings/groups.py.jinja", r"default=50, metadata",
         "default=40, metadata")  # fmt: skip
    commit_all(template, "release 1.1.0")
    git(template, "tag", "v1.1.0")
    update(project)
    assert conflict_markers(project) == []
    assert not list(project.rglob("*.rej"))
    assert "counted once" in (project / "src" / PACKAGE / "training/loop.py").read_text()
    assert "@slots.model(" in (project / "src" / PACKAGE / "model.py").read_text()
    # And it still trains as ours.
    quick = [*args, "--epochs", "1", "--max-steps-per-epoch", "1", "--run-dir", "after"]
    done = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.train", *quick], cwd=work, text=True,
        capture_output=True, env={**__import__("os").environ, "PYTHONPATH": str(project / "src")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    records = (work / "after" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(records[0])["config"]["warmup_steps"] == 40  # the release's default
