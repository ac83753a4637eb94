"""What the matrix asks of one render (tests/test_matrix.py, tests/test_matrix_slow.py): it
installs, its CPU suite passes, and it trains one epoch from outside its own folder. One render
(matrix.USER_DEFAULTS_RENDER) is the user's: rendered from the last release and made theirs in
their files, as the docs invite (config.py's defaults changed, model.py's architectures
replaced, a metric and a researcher's registrations in extensions.py), then updated to the
working tree (tests/kept_research.py); the LM render gets a model of the user's own.

The slow render has a module of its own so that pytest-xdist, which keeps a module on one
worker, runs its long suite beside the other renders instead of after them.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

from helpers import check_project, pip_install_editable, run, run_project_suite
from matrix import (
    MATRIX,
    PARTIAL_SUITES,
    SLOW_FILES,
    SLOW_RENDER,
    USER_DEFAULTS_RENDER,
    USER_LM_RENDER,
    package_name,
)

GROUP_CLASS = re.compile(r"^class (\w+Config)\b[^\n]*\n(.*?)(?=^\S|\Z)", re.M | re.S)


def change_defaults(
    project: Path, defaults: dict[str, str], base: str = "settings/groups.py"
) -> None:
    """Set defaults as config.py's docstring tells a user to: as arguments of their group's
    line in `Config`, `optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))`
    (the group of each field read from the template's `base`, settings/groups.py; 0.3.0's was
    config_base.py), beside the defaults already changed there."""
    (config,) = project.glob("src/*/config.py")
    base_text = (config.parent / base).read_text()
    by_group: dict[str, list[str]] = {}
    for name, value in defaults.items():
        owners = [
            g
            for g, body in GROUP_CLASS.findall(base_text)
            if g != "BaseConfig" and f"\n    {name}: " in f"\n{body}"  # the groups' holder
        ]
        assert len(owners) == 1, f"{config}: the default of {name} is in no one group: {owners}"
        by_group.setdefault(owners[0], []).append(f"{name}={value}")
    text = config.read_text()
    for group, arguments in by_group.items():
        exploded = "".join(f"            {argument},\n" for argument in arguments)
        changed = rf"^(    \w+: {group} = field\(\n        default_factory=lambda: {group}\(\n)"
        text, count = re.subn(changed, rf"\g<1>{exploded}", text, flags=re.M)
        if count == 0:  # the group's defaults as the template wrote them
            line = rf"^(    \w+: {group} = field\()default_factory={group}\)$"
            new = f"\\1\n        default_factory=lambda: {group}(\n{exploded}        )\n    )"
            text, count = re.subn(line, new, text, flags=re.M)
        assert count == 1, f"{config}: no `{group}` line in Config where a user changes defaults"
    config.write_text(text)


# ---- A user's own model and metric (issue 35): the generated tests hold for any model ----
# USER_DEFAULTS_RENDER's suite runs after a user added models of their own to model.py (other
# parameter names: stem, blocks, head, embed, out; BatchNorm and GroupNorm; another width
# rule), registered with @slots.model as the docs teach (`usernet` with no memory bound, and
# `mixer`), made `usernet` the default in config.py, unregistered the template's `cnn` and
# `mlp`, and added a metric in extensions.py. The
# whole fast suite runs: no generated test may assume the default model's names, shapes,
# memory bound or learning speed. The edit to model.py is one string transformation,
# `make_model_yours`.

USER_MODEL = """


class Block(nn.Module):
    \"\"\"A residual block: two convolutions, a BatchNorm and a GroupNorm, a skip.\"\"\"

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.norm1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.norm2 = nn.GroupNorm(1, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(x + self.norm2(self.conv2(y)))


class TinyResNet(nn.Module):
    \"\"\"A user's convolutional net: a stem, residual blocks, a head.\"\"\"

    def __init__(self, in_channels: int, num_classes: int, width: int, dropout: float) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU())
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.drop(x.mean(dim=(2, 3))))


class Mixer(nn.Module):
    \"\"\"A user's fully connected net: other names, a LayerNorm, no BatchNorm.\"\"\"

    def __init__(self, in_features: int, num_classes: int, width: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Linear(in_features, width)
        self.norm = nn.LayerNorm(width)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.norm(self.embed(x.flatten(1))))))


@slots.model("usernet", help="a user's residual net (no memory bound)")
def build_usernet(config: Config, info: DataInfo) -> nn.Module:
    return TinyResNet(info.in_channels, info.num_classes, config.model.width, config.model.dropout)


@slots.model("mixer", help="a user's fully connected net", memory=lambda config: 2**20)
def build_mixer(config: Config, info: DataInfo) -> nn.Module:
    pixels = info.in_channels * info.image_size * info.image_size
    return Mixer(pixels, info.num_classes, 2 * config.model.width, config.model.dropout)
"""

USER_METRIC = """
def extra_metrics(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    \"\"\"A user's metric: top-2 hits, summed over the batch.\"\"\"
    hits = logits.topk(min(2, logits.shape[1]), 1).indices == targets[:, None]
    return {"top2": hits.any(1).sum()}
"""


# ---- A researcher's registrations (issue 52, item 7's Done-when) ----
# USER_DEFAULTS_RENDER's extensions.py ends with what a researcher registers, in user files
# only (their 0.3.0 workarounds moved into these slots, tests/kept_research.py): a focal loss
# for training driven by a flag of its own (config.py's `focal_gamma`), AdamW with a
# head/backbone split at a rate of its own flag (`head_lr_mult`), a one-cycle schedule and a
# batch transform, both made the defaults, a balanced accuracy over the whole validation set,
# and per-class counts kept per rank in every checkpoint, with a line per epoch. The whole fast
# suite then runs: the template's tests that need the template's defaults set them themselves.
USER_SETTINGS = """
    focal_gamma: float = field(default=2.0, metadata={"help": "focal loss exponent"})
    head_lr_mult: float = field(default=10.0, metadata={"help": "the head's rate over --lr"})
"""

USER_RESEARCH = """

@slots.training_loss
def focal(logits: torch.Tensor, targets: torch.Tensor, step: Any) -> torch.Tensor:
    \"\"\"Focal loss, -(1 - p)^gamma log p of the label (--focal-gamma), for training steps.\"\"\"
    log_p = torch.log_softmax(logits.float(), 1)
    if targets.dim() == 2:  # class probabilities: a transform's soft targets
        return -(targets * (1 - log_p.exp()) ** step.config.focal_gamma * log_p).sum(1).mean()
    picked = log_p.gather(1, targets[:, None]).squeeze(1)
    return -((1 - picked.exp()) ** step.config.focal_gamma * picked).mean()


@slots.optimizer
def head_and_backbone(config: Any, model: torch.nn.Module, device: torch.device) -> Any:
    \"\"\"AdamW with the last layer at --head-lr-mult x --lr and the rest at --lr.\"\"\"
    named = list(model.named_parameters())
    last = named[-1][0].rpartition(".")[0]
    head = [p for n, p in named if n.rpartition(".")[0] == last]
    body = [p for n, p in named if n.rpartition(".")[0] != last]
    lr = config.optim.lr
    groups = [{"params": body, "lr": lr}, {"params": head, "lr": lr * config.head_lr_mult}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=lr, weight_decay=config.optim.weight_decay
    )


@slots.schedule("onecycle")
def one_cycle(step: int, total: int, config: Any) -> float:
    \"\"\"Up to --lr over the first 30% of the steps, then down to nothing, both cosine.\"\"\"
    peak = max(1, int(0.3 * total))
    if step < peak:
        return 0.5 * (1 - math.cos(math.pi * (step + 1) / peak))
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - peak) / max(1, total - peak))))


@slots.batch_transform("jitter")
def jitter(config: Any, inputs: torch.Tensor, targets: torch.Tensor, draw: Any) -> Any:
    \"\"\"Each training image shifted in brightness by up to 0.1, drawn per batch.\"\"\"
    shift = torch.rand(
        inputs.shape[0], 1, 1, 1, generator=draw.generator(inputs.device), device=inputs.device
    )
    return inputs + (0.2 * shift - 0.1).to(inputs.dtype), targets


def balanced(totals: dict[str, torch.Tensor]) -> dict[str, float]:
    \"\"\"The mean over classes of each class's recall (classes never seen left out).\"\"\"
    confusion = totals["confusion"]
    seen = confusion.sum(1) > 0
    recall = confusion.diagonal()[seen] / confusion.sum(1)[seen]
    return {"balanced_acc": float(recall.mean()) if seen.any() else 0.0}


@slots.set_metric(balanced)
def confusion(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    k = logits.shape[1]
    counts = torch.bincount(targets * k + logits.argmax(1), minlength=k * k)
    return {"confusion": counts.view(k, k).float()}


class ClassCounts:
    \"\"\"How many training samples of each class this rank has seen.\"\"\"

    def __init__(self, classes: int) -> None:
        self.counts = torch.zeros(classes, dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        return {"counts": self.counts.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts = state["counts"].clone()


@slots.state("class_counts", per_rank=True)
def class_counts(run: Any) -> ClassCounts:
    return ClassCounts(run.info.num_classes)


@slots.callback("after_step")
def count_classes(run: Any) -> None:
    counts = run.states["class_counts"]
    for _, targets in run.batches:
        labels = targets.argmax(1) if targets.dim() == 2 else targets
        counts.counts += torch.bincount(labels.cpu(), minlength=len(counts.counts))


@slots.callback("after_validation")
def a_line_per_epoch(run: Any) -> None:
    seen = run.states["class_counts"].counts
    run.log(f"seen per class so far: {seen.tolist()}")
"""
RESEARCH_DEFAULTS = {"lr_schedule": '"onecycle"', "batch_transform": '"jitter"'}
# The template's flags that the registrations above make moot: each is refused in one line.
MOOT_FLAGS = [
    ["--smoothing", "0.1"],  # the focal loss replaces the smoothed cross-entropy
    ["--backbone-lr-factor", "0.1"],  # the optimizer splits its own groups
    ["--matrix-optimizer", "muon"],  # the optimizer is the user's
]

MOOT_CHECK = """
import sys
from {package}.config import parse_config

for flags in {flags!r}:
    try:
        parse_config(flags)
    except SystemExit as stop:
        assert stop.code == 2, (flags, stop.code)
    else:
        raise AssertionError(f"{{flags}} was accepted beside the registrations that drop it")
    print("--", flush=True)
"""


def moot_flags_are_refused(project: Path, package: str) -> None:
    """Each of MOOT_FLAGS, given to the researcher's project, exits 2 with one error line that
    names the flag and the registration it is moot beside."""
    code = MOOT_CHECK.format(package=package, flags=MOOT_FLAGS)
    result = run([sys.executable, "-c", code], project)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == len(MOOT_FLAGS), result.stderr
    for flags, line in zip(MOOT_FLAGS, errors, strict=True):
        assert flags[0] in line and "@slots." in line, (flags, line)


def make_model_yours(text: str, user_model: str = USER_MODEL) -> str:
    """model.py with the user's classes and registrations after the template's (its imports
    give them `slots`, `Config` and `DataInfo`)."""
    assert "from . import slots" in text, "model.py: no registry import for the user's models"
    return text.rstrip("\n") + user_model


def add_a_metric(text: str) -> str:
    """extensions.py with `extra_metrics` returning a metric instead of none."""
    start = text.find("\ndef extra_metrics(")
    end = text.find("\n    return {}\n", start)
    assert 0 <= start < end, "extensions.py: no `extra_metrics` returning {} to replace"
    return text[:start] + USER_METRIC + text[end + len("\n    return {}\n") :]


USER_LM_MODEL = """


class UserGRU(nn.Module):
    \"\"\"A user's own language model: an embedding, a GRU, a head (no cache, no FLOPs count,
    no hidden nn.Linear for Muon).\"\"\"

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.out = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        return self.out(hidden)


@slots.model("usergru", help="a user's GRU (no memory bound)")
def build_usergru(config: Config, info: DataInfo) -> nn.Module:
    return UserGRU(info.num_classes, config.model.width)
"""


def make_the_language_model_yours(project: Path) -> dict[Path, str]:
    """A language-model render with the user's GRU added to model.py and made the default in
    config.py; returns the two files as they were, to put back."""
    (model,) = project.glob("src/*/model.py")
    (config,) = project.glob("src/*/config.py")
    before = {model: model.read_text(), config: config.read_text()}
    model.write_text(make_model_yours(before[model], USER_LM_MODEL))
    change_defaults(project, {"model": '"usergru"'})
    return before


TEMPLATE_MODELS = re.compile(r'^@slots\.model\("(cnn|mlp)".*\)\n', re.M)


def without_the_template_models(text: str) -> str:
    """model.py with the template's `cnn` and `mlp` no longer registered, as a user who
    replaced them leaves it (their classes stay: a user's own code may still use them)."""
    text, count = TEMPLATE_MODELS.subn("", text)
    assert count == 2, "model.py: the template's cnn and mlp registrations were not found"
    return text


def installs_and_passes_its_cpu_suite(project: Path, name: str) -> None:
    tests = list(PARTIAL_SUITES.get(name, []))
    if name == USER_DEFAULTS_RENDER:  # the researcher's 0.3.0 project, updated (kept_research)
        from kept_research import kept_and_updated, move_to_the_slots, workarounds_still_work

        project = kept_and_updated(project.parent / f"{name}-kept", MATRIX[name])
        workarounds_still_work(project, package_name(MATRIX[name]))
        move_to_the_slots(project)
    as_made = make_the_language_model_yours(project) if name == USER_LM_RENDER else {}
    check_project(project, slow=False, python_version=MATRIX[name]["python_version"], tests=tests)
    if name == USER_DEFAULTS_RENDER:
        moot_flags_are_refused(project, package_name(MATRIX[name]))
    for path, text in as_made.items():  # the slow files and the epoch: the render as made
        path.write_text(text)
    if name == SLOW_RENDER:  # the whole suite's slow tests
        run_project_suite(project, markers="not gpu and slow")
    if name in SLOW_FILES:  # the slow tests only this render has
        run_project_suite(project, *SLOW_FILES[name], markers="not gpu and slow")


def trains_one_epoch(project: Path, name: str, tmp_path: Path) -> None:
    # Installed by the suite's check; installing again is cheap and keeps this one standalone.
    pip_install_editable(project, python_version=MATRIX[name]["python_version"])
    package = package_name(MATRIX[name])
    small = ["--train-samples", "1024", "--val-samples", "256"]  # one epoch, in seconds
    command = [sys.executable, "-m", f"{package}.train", "--epochs", "1", *small]
    # Run from a scratch folder, not the project: the installed package must be what imports.
    # A tracker answer logs for real, on this machine: W&B offline, MLflow in a local store.
    local = {"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'ml.db'}"}
    result = run([*command, "--run-dir", tmp_path / "run"], tmp_path, env=local)
    output = result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"loss\W{1,3}(-?\d+\.\d+(?:e-?\d+)?)", output, re.I)]
    assert losses, f"no loss printed:\n{output[-2000:]}"
    assert all(math.isfinite(loss) for loss in losses)
