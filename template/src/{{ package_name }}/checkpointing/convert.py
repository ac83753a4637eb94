"""Turn a sharded checkpoint folder into one file: `python -m <package>.checkpointing.convert`.

    python -m <package>.checkpointing.convert runs/default/checkpoints/last.dcp model.pt

The output has the format of a single-file checkpoint (`last.pt`): the full, unsharded model
(loads into the model `--model` builds with `load_state_dict`), the optimizer (its state keyed
by parameter number, as `optimizer.state_dict()` gives it) and the training state, read with
`torch.load(..., weights_only=True)` (see checkpointing/checkpoint.py). Use it for inference and
sampling,
to share weights, or to resume with `--resume model.pt --parallel ddp`. It runs in one process
and needs the memory of the full model and optimizer: it is meant for models that fit one
machine's memory. It never replaces a file. Exit codes: 0 written, 2 the folder is not a
sharded checkpoint (or the output exists or is not writable), 74 the file could not be
written (disk full).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ..runtime import console, exits
from . import checkpoint
from . import sharded as sharded_checkpoint
from .checkpoint import CheckpointError


def convert(source: Path, target: Path) -> dict[str, Any]:
    """Write the single-file checkpoint of sharded folder `source` to `target`; return it."""
    if not sharded_checkpoint.is_sharded_checkpoint(source):
        raise CheckpointError(
            f"{source} is not a sharded checkpoint folder (one written by a --parallel fsdp "
            f"run holds {sharded_checkpoint.STATE_NAME} and .metadata)"
        )
    state = checkpoint.load_checkpoint(source / sharded_checkpoint.STATE_NAME)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as scratch:
        whole = Path(scratch) / "whole.pt"
        try:  # DCP's own reader, in one process: every shard into full tensors
            with sharded_checkpoint.quiet_single_process():
                dcp_to_torch_save(source, whole)
        except (Exception, CheckpointException) as error:  # a truncated or foreign folder
            written = checkpoint.write_failure(error)
            if written is not None and written.errno in exits.WRITE_ERRNOS:  # a full disk
                cause = written.strerror
                raise checkpoint.SaveError(f"could not write {target}: {cause}") from None
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise CheckpointError(f"{source} could not be read ({first})") from None
        shards = torch.load(whole, map_location="cpu", weights_only=True)
    state["model"] = shards["model"]
    state["optimizer"] = numbered(shards["optimizer"])
    checkpoint.save_checkpoint(state, target)
    return state


def numbered(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter names (DCP's) keyed by number instead.

    `optimizer.state_dict()` numbers the parameters in the order of its param groups, and
    `get_state_dict` lists the names in that same order, so position k has number k.
    """
    number: dict[str, int] = {}
    groups = []
    for group in optimizer_state["param_groups"]:
        params = [number.setdefault(name, len(number)) for name in group["params"]]
        groups.append({**group, "params": params})
    state = {number[name]: value for name, value in optimizer_state["state"].items()}
    return {"state": state, "param_groups": groups}


def main(argv: list[str] | None = None) -> int:
    parser = exits.Parser(
        prog=f"python -m {__package__}.convert",
        description="Write a sharded (--parallel fsdp) checkpoint folder as one file that "
        "torch.load(..., weights_only=True) reads.",
    )
    parser.add_argument("source", type=Path, help="the folder, e.g. RUN/checkpoints/last.dcp")
    parser.add_argument("target", type=Path, help="the file to write, e.g. model.pt")
    args = parser.parse_args(argv)

    def run() -> None:
        if not args.target.parent.is_dir():
            raise CheckpointError(f"{args.target.parent} does not exist; create it first")
        if args.target.is_dir():
            raise CheckpointError(f"{args.target} is a folder; name the file to write")
        if args.target.exists() or args.target.is_symlink():
            raise CheckpointError(
                f"{args.target} already exists and is kept; delete it or name another file"
            )
        state = convert(args.source, args.target)
        console.safe_print(
            f"wrote {args.target}: step {state['step']}, "
            f"{sum(t.numel() for t in state['model'].values()):,} model values"
        )

    return exits.exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
