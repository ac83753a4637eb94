"""The researcher's project, kept from the last release (v0.3.0) and updated (issue 52, item 11).

matrix.USER_DEFAULTS_RENDER is not rendered fresh: it is a project rendered from v0.3.0 with the
matrix's answers, in which a researcher did what 0.3.0's docs allow, in user files only (issue
52 found this researcher): their own residual net and its defaults (config.py, model.py), a
focal loss with a flag of its own, AdamW with a head/backbone split at a rate of its own flag, a
one-cycle schedule, a balanced accuracy, per-class counts kept in checkpoints and a line per
epoch (extensions.py). 0.3.0's slots could not carry three of these without a workaround, which
the researcher wrote, in their own files, as such a user would (RESEARCH_030):

- the loss saw no config: a `@slots.state` factory, which sees the run, copies --focal-gamma
  into a module-level dict the loss reads;
- a validation metric was a mean per sample: the per-class hits and counts as two metrics, and
  an `after_validation` callback that writes their balanced accuracy into the epoch's record;
- no callback saw the batch, and a state was saved from rank 0 only: a training metric that
  counts the targets as a side effect.

`copier update` then takes the project to the working tree, and the CHANGELOG's notes since
0.3.0 are followed literally (tests/upgrade_notes.py): no conflict may arise. A short run shows
the workarounds still work on the new layout (the focal loss trains, the balanced accuracy is in
the record, the counts are in the checkpoint and resume). Then the researcher moves the three
workarounds into the slots made for them (`@slots.training_loss` with `step.config`,
`@slots.set_metric`, `@slots.state(per_rank=True)` with an `after_step` callback over
`run.batches`) and adds a batch transform: extensions.py's research becomes
matrix_checks.USER_RESEARCH, whose whole fast suite the matrix runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from helpers import ROOT, copy_template_repo, git, git_init_commit, render, run
from matrix import USER_DEFAULTS, package_name
from matrix_checks import USER_RESEARCH
from test_release import release_revision
from upgrade_notes import conflicted_files, follow, parse_steps

RELEASE = "0.3.0"

# The optimizer and the schedule, registered the same way in 0.3.0 and now: matrix_checks'.
SHARED_RESEARCH = USER_RESEARCH[
    USER_RESEARCH.index("@slots.optimizer\n") : USER_RESEARCH.index("@slots.batch_transform(")
].rstrip("\n")

# The researcher's extensions.py on 0.3.0. The model, optimizer, schedule and the line per epoch
# are as in matrix_checks.USER_RESEARCH (0.3.0's slots carried them); the loss, the balanced
# accuracy and the class counts are the workarounds above.
RESEARCH_030 = (
    '''

# The focal loss's --focal-gamma: 0.3.0's loss sees no config, so the state factory below, which
# sees the run, copies it here when the run starts.
FOCAL = {"gamma": 2.0}


@slots.state("focal_gamma")
def read_focal_gamma(run: Any) -> None:
    """Not a state (None: nothing saved): the one slot that sees the config before a step."""
    FOCAL["gamma"] = run.config.focal_gamma


@slots.loss
def focal(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Focal loss, -(1 - p)^gamma log p of the label (--focal-gamma)."""
    picked = torch.log_softmax(logits.float(), 1).gather(1, targets[:, None]).squeeze(1)
    return -((1 - picked.exp()) ** FOCAL["gamma"] * picked).mean()


'''
    + SHARED_RESEARCH
    + '''

# Balanced accuracy: 0.3.0 divides a validation metric's sums by the samples, so each class's
# hits and count become means, whose ratio is still the class's recall.
CLASSES = 10


@slots.val_metric
def per_class(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    hits = torch.bincount(targets[logits.argmax(1) == targets], minlength=CLASSES)
    seen = torch.bincount(targets, minlength=CLASSES)
    return {
        **{f"hits{c}": hits[c] for c in range(CLASSES)},
        **{f"seen{c}": seen[c] for c in range(CLASSES)},
    }


@slots.callback("after_validation")
def balanced_accuracy(run: Any) -> None:
    """The mean over the classes seen of their recall, into the epoch's record."""
    record = run.result
    seen = [c for c in range(CLASSES) if record[f"val_seen{c}"] > 0]
    recalls = [record[f"val_hits{c}"] / record[f"val_seen{c}"] for c in seen]
    record["val_balanced_acc"] = sum(recalls) / len(recalls) if recalls else 0.0


class ClassCounts:
    """How many training samples of each class the run has seen."""

    def __init__(self, classes: int) -> None:
        self.counts = torch.zeros(classes, dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        return {"counts": self.counts.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts = state["counts"].clone()


COUNTS = {"now": ClassCounts(CLASSES)}


@slots.state("class_counts")
def class_counts(run: Any) -> ClassCounts:
    COUNTS["now"] = ClassCounts(run.info.num_classes)
    return COUNTS["now"]


@slots.train_metric
def count_classes(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """No callback sees the batch: a training metric sees the targets, so it counts them."""
    counts = COUNTS["now"].counts
    counts += torch.bincount(targets.cpu(), minlength=len(counts))
    return {}


@slots.callback("after_validation")
def a_line_per_epoch(run: Any) -> None:
    seen = run.states["class_counts"].counts
    run.log(f"seen per class so far: {seen.tolist()}")
'''
)

SETTINGS_030 = """
    focal_gamma: float = field(default=2.0, metadata={"help": "focal loss exponent"})
    head_lr_mult: float = field(default=10.0, metadata={"help": "the head's rate over --lr"})
"""


def history(base: Path) -> Path:
    """This repository's history with two tags only: v0.3.0 and the working tree (v1.0.0)."""
    folder = base / "history"
    run(["git", "clone", "-q", "--no-checkout", ROOT, folder], base)
    for tag in git(folder, "tag", "--list").split():
        git(folder, "tag", "-d", tag)
    git(folder, "tag", f"v{RELEASE}", release_revision(RELEASE))
    current = copy_template_repo(base / "current")
    git(folder, "fetch", "-q", str(current), "main")
    git(folder, "tag", "v1.0.0", "FETCH_HEAD")
    return folder


def research_on_030(project: Path) -> None:
    """The researcher's edits, against 0.3.0's files: config.py's defaults (as its docstring
    shows) and fields, model.py's net registered with `@slots.model`, extensions.py's research
    and metric."""
    from matrix_checks import USER_MODEL, add_a_metric, change_defaults

    change_defaults(project, {**USER_DEFAULTS, "lr_schedule": '"onecycle"'}, "config_base.py")
    (config,) = project.glob("src/*/config.py")
    text = config.read_text()
    validate = "\n    def validate(self) -> None:\n"
    assert text.count(validate) == 1, f"{config}: no `validate` to add fields before"
    config.write_text(text.replace(validate, SETTINGS_030 + validate))
    (model,) = project.glob("src/*/model.py")
    text = model.read_text()
    imports = "from .config import Config\n"
    assert text.count(imports) == 1, f"{model}: no `from .config import Config` line"
    model.write_text(text.replace(imports, "from . import slots\n" + imports) + USER_MODEL)
    (extensions,) = project.glob("src/*/extensions.py")
    text = add_a_metric(extensions.read_text())
    header = "import math\nfrom typing import Any\n\nimport torch\n\nfrom . import slots\n"
    assert text.count("import torch\n") == 1, f"{extensions}: no `import torch` line"
    extensions.write_text(text.replace("import torch\n", header) + RESEARCH_030)


def kept_and_updated(dest: Path, answers: dict[str, object]) -> Path:
    """The researcher's v0.3.0 project, committed, updated to the working tree with no conflict,
    the notes since 0.3.0 followed; returns the project (its package: `package_name`)."""
    source = history(dest.parent)
    project = render(dest, answers, src=source, vcs_ref=f"v{RELEASE}")
    git_init_commit(project, f"rendered from v{RELEASE}")
    research_on_030(project)
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "our research")
    run([sys.executable, "-m", "copier", "update", "--defaults", "--conflict", "inline"], project)
    recorded = yaml.safe_load((project / ".copier-answers.yml").read_text())
    assert recorded["_commit"] == "v1.0.0", recorded
    assert conflicted_files(project) == {}, "the update conflicts with the researcher's edits"
    assert not list(project.rglob("*.rej")), "the update left .rej files"
    steps = parse_steps((ROOT / "CHANGELOG.md").read_text(), RELEASE)
    assert follow(project, package_name(answers), "image", steps) == {}
    return project


SHORT = ["--epochs", "1", "--train-samples", "128", "--val-samples", "64", "--batch-size", "32"]


def workarounds_still_work(project: Path, package: str) -> None:
    """A short run on the new layout with the 0.3.0 workarounds in place: the focal loss is the
    one trained (its --focal-gamma reached it), the balanced accuracy is in the epoch's record,
    and the counts of the training samples are in the checkpoint, resumed by a second epoch."""
    env = {"PYTHONPATH": str(project / "src")}
    train = [sys.executable, "-m", f"{package}.train", *SHORT, "--run-dir", "runs/kept"]
    run([*train, "--focal-gamma", "50"], project, env=env)
    records = [json.loads(line) for line in (project / "runs/kept/metrics.jsonl").open()]
    (epoch,) = [r for r in records if r.get("kind") == "epoch"]
    # Near chance (p about 0.1 of 10 classes), cross-entropy is about 2.3 and a focal loss with
    # gamma 2 about 1.9; gamma 50 weighs every sample with p above 0.05 by less than 0.08.
    assert epoch["train_loss"] < 1.0 and epoch["val_loss"] < 1.0, f"not the focal loss: {epoch}"
    assert 0.0 <= epoch["val_balanced_acc"] <= 1.0, epoch
    import torch

    saved = torch.load(project / "runs/kept/checkpoints/last.pt", weights_only=True)
    counts = saved["states"]["class_counts"]["counts"]
    assert int(counts.sum()) == 128, f"the counts of 128 training samples: {counts}"
    run([*train, "--epochs", "2", "--resume", "auto"], project, env=env)
    saved = torch.load(project / "runs/kept/checkpoints/last.pt", weights_only=True)
    assert int(saved["states"]["class_counts"]["counts"].sum()) == 256, "not resumed"


def move_to_the_slots(project: Path) -> None:
    """The researcher replaces the three workarounds by the slots made for them: extensions.py's
    research becomes matrix_checks.USER_RESEARCH (which adds a batch transform, made the default
    with the template's other defaults), and the unused template models go."""
    from matrix_checks import (
        RESEARCH_DEFAULTS,
        USER_RESEARCH,
        USER_SETTINGS,
        change_defaults,
        without_the_template_models,
    )

    (extensions,) = project.glob("src/*/extensions.py")
    text = extensions.read_text()
    assert text.count(RESEARCH_030) == 1, "the research is not where the researcher left it"
    extensions.write_text(text.replace(RESEARCH_030, USER_RESEARCH))
    assert SETTINGS_030 == USER_SETTINGS  # the flags stay as they were
    change_defaults(project, {"batch_transform": RESEARCH_DEFAULTS["batch_transform"]})
    (model,) = project.glob("src/*/model.py")
    model.write_text(without_the_template_models(model.read_text()))
