"""`python -m <package>.benchmarks`, the same as `python -m <package>.benchmark`."""

import sys

from .cli import main

sys.exit(main())
