"""ONNX export checked against ONNX Runtime: the `--format onnx` of both tasks' `export`.

The model goes through `torch.onnx.export(..., dynamo=True)` with the dynamic axes the caller
names, is serialized in memory, and those bytes are loaded by ONNX Runtime (CPU) and run on
every sample input. Its outputs must equal the eager model's within `atol + rtol * |eager|`
elementwise, and be finite (a NaN anywhere refuses the file); only then is the file written,
whole (`files.write_atomically`), so a failed export leaves an earlier file as it was.

onnx, onnxruntime and onnxscript come with the project's `onnx` extra and are imported here
only, when an ONNX export runs: without them the package and its other commands work.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..settings.base import ConfigError
from . import console, files

MISSING = 'ONNX export needs the onnx extra: pip install -e ".[onnx]"'


class ParityError(RuntimeError):
    """ONNX Runtime's outputs differ from the eager model's beyond the tolerance, or are NaN."""


def onnxruntime() -> Any:
    """The onnxruntime module, after checking the exporter's own needs (onnx, onnxscript)."""
    try:
        for name in ("onnx", "onnxscript"):
            importlib.import_module(name)
        return importlib.import_module("onnxruntime")
    except ImportError:
        raise ConfigError(MISSING) from None


@contextlib.contextmanager
def quiet_exporter() -> Iterator[None]:
    """The exporter's warnings about itself (torchvision ops it skips, its deprecations) kept
    off stderr, where a refusal is one line."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        logger.setLevel(level)


def to_onnx(
    model: nn.Module, example: tuple[torch.Tensor, ...], dynamic: Sequence[dict[int, Any]]
) -> bytes:
    """The ONNX model's bytes: the dynamo exporter, `dynamic` the shapes of each input."""
    names = [f"input{i}" for i in range(len(example))]
    with quiet_exporter():
        program = torch.onnx.export(
            model,
            example,
            dynamo=True,
            dynamic_shapes=tuple(dynamic),
            input_names=names if len(names) > 1 else ["input"],
            output_names=["logits"],
            verbose=False,
        )
    if program is None:  # only the TorchScript exporter (dynamo=False) returns None
        raise ParityError("torch.onnx.export returned no program")
    return bytes(program.model_proto.SerializeToString())


@torch.inference_mode()
def max_difference(
    data: bytes, model: nn.Module, samples: Sequence[torch.Tensor], rtol: float, atol: float
) -> tuple[float, float]:
    """(largest absolute difference, largest excess over `atol + rtol * |eager|`) of ONNX
    Runtime's outputs from the eager model's over every sample; both NaN where a NaN is."""
    ort = onnxruntime()
    session = _ort_call(lambda: ort.InferenceSession(data, providers=["CPUExecutionProvider"]))
    name = session.get_inputs()[0].name
    diffs, excesses = [], []
    for sample in samples:
        expected = model(sample).float()
        shape = "x".join(map(str, sample.shape))
        output = _ort_call(partial(session.run, None, {name: sample.numpy()}), shape)[0]
        got = torch.from_numpy(output).float()
        if got.shape != expected.shape:
            raise ParityError(
                f"ONNX Runtime gave shape {tuple(got.shape)}, eager gave {tuple(expected.shape)}"
            )
        diff = (got - expected).abs()
        diffs.append(diff.max())
        excesses.append((diff - atol - rtol * expected.abs()).max())
    # torch's max keeps a NaN (Python's max(0.0, nan) is 0.0): a NaN output fails the check.
    return float(torch.stack(diffs).max()), float(torch.stack(excesses).max())


def _ort_call(call: Callable[[], Any], shape: str = "") -> Any:
    """`call()`; a program ONNX Runtime cannot load, or run on a `shape` input (an axis the
    exporter fixed, say), is a ParityError: one line, like a mismatch."""
    try:
        return call()
    except Exception as error:  # onnxruntime's own exception types, not importable here
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        where = f"run the exported program on a {shape} input" if shape else "load the program"
        raise ParityError(f"ONNX Runtime could not {where} ({first})") from None


def export_onnx(
    model: nn.Module,
    example: torch.Tensor,
    dynamic: dict[int, Any],
    samples: Sequence[torch.Tensor],
    out: Path,
    tolerance: float,
) -> float:
    """Export `model` (eval mode, CPU) on `example`, check ONNX Runtime on `samples` within
    `tolerance` (absolute and relative), write `out` atomically; the max abs difference."""
    onnxruntime()  # before the export's seconds: a missing extra is one line at once
    model.eval()
    data = to_onnx(model, (example,), [dynamic])
    diff, excess = max_difference(data, model, samples, tolerance, tolerance)
    shapes = ", ".join("x".join(map(str, s.shape)) for s in samples)
    console.safe_print(f"parity: ONNX Runtime vs eager, max abs difference {diff:.3g} on {shapes}")
    if not excess <= 0:  # NaN fails too
        raise ParityError(
            f"ONNX Runtime's outputs differ from the eager model's by {diff:.3g} "
            f"(> {tolerance:g} absolute + relative); {out} was not written"
        )
    files.write_atomically(out, data, "--out")
    return diff
