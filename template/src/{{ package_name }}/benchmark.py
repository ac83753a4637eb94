"""`python -m <package>.benchmark`: the benchmark's entry point; the code is in `benchmarks/`.

Kept so the command, the `<package>-benchmark` script and `from <package> import benchmark`
keep working. See `benchmarks/__init__.py` for what is measured.
"""

from __future__ import annotations

import sys

from .benchmarks.cli import SCHEMA_VERSION, SECTIONS, main
from .benchmarks.report import write_chart
from .observability.mfu import peak_tflops

__all__ = ["SCHEMA_VERSION", "SECTIONS", "main", "peak_tflops", "write_chart"]

if __name__ == "__main__":
    sys.exit(main())
