"""Can torch use a GPU here, and if not, why: `python -m <package>.runtime.cuda_check`.

Prints one line: the torch version and its CUDA build, then the GPUs (count, name, compute
capability, memory), the driver and bf16 support. Exit codes:

- 0: CUDA works, or this machine has no NVIDIA GPU at all (the line then starts with
  "no CUDA device: GPU checks skipped", and GPU checks skip);
- 1: a GPU is visible to the system (`nvidia-smi` on PATH or `/dev/nvidia0`) but torch sees
  no CUDA device. The line says the likely cause: a CPU-only torch wheel, CUDA_VISIBLE_DEVICES
  hiding the GPUs, or a driver too old for (or not loaded for) torch's CUDA.

Without this distinction, a GPU machine whose environment cannot use its GPU would report
"no GPU, skipped" and pass. The GPU test suite (tests/gpu/conftest.py) and both `nox -s gpu`
sessions use it. It imports only the standard library and torch, so it also runs by path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch

NO_CUDA = "no CUDA device: GPU checks skipped"


def gpu_evidence() -> str | None:
    """What shows that this machine has an NVIDIA GPU, or None if nothing does."""
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        return f"nvidia-smi at {smi}"
    if os.path.exists("/dev/nvidia0"):
        return "/dev/nvidia0 exists"
    return None


def driver_version() -> str | None:
    """The NVIDIA driver version that `nvidia-smi` reports, or None without an answer."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        answer = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = answer.stdout.strip().splitlines()
    return lines[0].strip() if answer.returncode == 0 and lines else None


def why_unusable() -> str:
    """The likely reason torch sees no CUDA device on a machine that has a GPU."""
    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch "
            "in this environment (see pytorch.org/get-started)"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.split(",")[0].strip() in ("", "-1", "NoDevFiles"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU from this process"
    driver = driver_version()
    return (
        f"torch {torch.__version__} was built for CUDA {torch.version.cuda} but cannot use the "
        f"GPU (driver {driver or 'not answering'}): the driver may be too old for that CUDA "
        "or not loaded; check `nvidia-smi`"
    )


def status() -> tuple[int, str]:
    """(exit code, one-line report): see the module docstring."""
    build = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        count = torch.cuda.device_count()
        bf16 = "yes" if torch.cuda.is_bf16_supported(including_emulation=False) else "no"
        return 0, (
            f"{build}; {count} x {props.name} (sm_{props.major}{props.minor}, "
            f"{props.total_memory / 2**30:.0f} GiB); driver {driver_version() or 'unknown'}; "
            f"bf16 {bf16}"
        )
    evidence = gpu_evidence()
    if evidence is None:
        return 0, f"{NO_CUDA} ({build})"
    return 1, (
        f"error: this machine has a GPU ({evidence}) but torch sees no CUDA device: "
        f"{why_unusable()}"
    )


def main() -> int:
    code, line = status()
    print(line, file=sys.stderr if code else sys.stdout, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
