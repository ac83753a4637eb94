"""Your settings: the defaults you change and the fields you add. Every field is a flag.

The template's settings (every field of the groups run, data, model, optim, speed and log,
its default, its help text and its checks) live in settings/base.py, which template updates
change. This file is yours and a template release leaves it alone, so your lines here do not
conflict with the template's new fields and defaults:

- change a default in its group's line below, as the group's arguments:
  `optim: OptimConfig = field(default_factory=lambda: OptimConfig(epochs=10, lr=1e-3))`;
- add a setting as a field of `Config` (it is the flag `--label-smoothing` and the TOML key
  `label_smoothing`, read as `config.label_smoothing`):
  `label_smoothing: float = field(default=0.0, metadata={"help": "cross-entropy smoothing"})`,
  or a group of your own: a `@dataclass` of fields, added as a field like the template's;
- check your settings in `validate()`, after the template's checks.

Precedence: these defaults < `--config FILE.toml` < command-line flags (settings/parsing.py).
"""

from __future__ import annotations

from argparse import ArgumentParser, Namespace
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .settings import parsing as config_parsing
from .settings.base import (
    BaseConfig,
    ConfigError,
    DataConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    SpeedConfig,
)
from .settings.parsing import build_parser, leaf_fields

__all__ = ["Config", "ConfigError", "build_parser", "leaf_fields", "load_toml", "parse_config"]
__all__ += ["DataConfig", "LogConfig", "ModelConfig", "OptimConfig", "RunConfig", "SpeedConfig"]
__all__ += ["to_toml"]


@dataclass
class Config(BaseConfig):
    """Every setting of a run, by group. Code reads `config.optim.lr`; flags are `--lr`."""

    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def validate(self) -> None:
        """The template's checks (settings/base.py), then yours: raise ValueError in one line."""
        super().validate()


# settings/parsing.py's readers, for this module's Config (looked up at each call, so a test may
# swap in a subclass). settings/parsing.py never imports this module.
def parse_config(
    argv: list[str] | None = None,
    description: str | None = None,
    parser: ArgumentParser | None = None,
) -> tuple[Config, Namespace]:
    """Parse the command line into a validated Config. Bad input exits 2 with a short message."""
    return config_parsing.parse_config(argv, description, parser, cls=Config)


def load_toml(path: Path, cls: type | None = None) -> dict[str, Any]:
    """A TOML config file's values by flat name (config_parsing.load_toml)."""
    return config_parsing.load_toml(path, cls or Config)


def to_toml(values: Mapping[str, Any], cls: type | None = None) -> str:
    """Flat values as TOML text with a table per group (config_parsing.to_toml)."""
    return config_parsing.to_toml(values, cls or Config)
