"""Printing, describing the machine, and the chart."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
from pathlib import Path
from typing import Any

import torch

from .. import utils


def print_section(section: dict[str, Any]) -> None:
    print(f"\n{section['id']}. {section['title']}")
    if section["status"] != "measured":
        print(f"   {section['status']}: {section['reason']}")
        return
    table = section["table"]
    lines = [table["columns"], *table["rows"]]
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(table["columns"]))]
    for index, line in enumerate(lines):
        cells = (str(cell).ljust(width) for cell, width in zip(line, widths, strict=True))
        print(("   " + "  ".join(cells)).rstrip())
        if index == 0:
            print("   " + "  ".join("-" * width for width in widths))
    for note in section.get("notes", []):
        print(f"   note: {note}")


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def describe_machine(device: torch.device, quick: bool) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "cpu": cpu_model(),
        "cpus_available": utils.available_cpus(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "quick": quick,
        "load_average_at_start": load_average(),
    }


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): how busy the machine was."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_note(load: float | None, cpus: int) -> str | None:
    if load is None or load < 0.5 * cpus:
        return None
    return (
        f"note: load average {load:.1f} on {cpus} CPUs: other programs compete for the CPU, "
        "so timings are noisy (compare the IQRs before trusting a ratio); multi-threaded "
        "kernels suffer most, as their threads wait for each other"
    )


def write_chart(report: dict[str, Any], path: Path) -> str:
    """A PNG with the worker sweep and every on/off ratio; a note when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install matplotlib, or the 'plot' extra)"
    sections = {s["id"]: s for s in report["sections"] if s["status"] == "measured"}
    ratios: dict[str, float] = {}
    if 3 in sections:
        ratios["compiled / eager"] = 1 / sections[3]["speedup"]
    if 2 in sections:
        ratios["pinned / pageable (copy + step)"] = 1 / sections[2]["step"]["speedup"]
    if 4 in sections:
        for name in ("no_grad", "grad enabled"):
            mode = sections[4]["modes"][name]
            ratios[f"{name} / inference_mode"] = mode["vs_inference_mode"]["ratio"]
    if 5 in sections:
        ratios.update({f"{name} on / off": value for name, value in sections[5]["ratios"].items()})
    if 6 in sections:
        ratios["train loop / bare loop"] = sections[6]["ratio"]
    if 9 in sections:
        ratios["step during a background save / without"] = sections[9]["ratio"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    if 1 in sections:
        sweep = sections[1]["sweep"]
        left.bar(
            [str(r["workers"]) for r in sweep],
            [r["samples_per_s"] for r in sweep],
            yerr=[r["iqr_samples_per_s"] / 2 for r in sweep],
            capsize=4,
        )
        left.set_xlabel("DataLoader workers")
        left.set_ylabel("samples/s (bar: median, whisker: IQR)")
        left.set_title("1. workers, on-disk images")
    right.barh(list(ratios), list(ratios.values()))
    right.axvline(1.0, color="black", linewidth=1)
    right.set_xlabel("time ratio, median of interleaved rounds (below 1: faster than the baseline)")
    right.set_title("time ratios measured in this run")
    figure.suptitle(f"{report['machine']['device_name']} ({report['machine']['date']})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return f"chart: {path}"
