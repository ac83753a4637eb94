"""The render matrix: every rendered project installs, passes its CPU suite and trains.

Each project is pip-installed (editable, no dependencies: the one shared environment already
has torch and the rest) under its own distribution and package name, so all of them coexist.
The `slow` tests run in one render only (matrix.SLOW_RENDER, tests/test_matrix_slow.py) and,
for slow tests only another render has, there too (matrix.SLOW_FILES). Renders whose code is
that of a default render of tests/test_user_install.py (which runs the whole fast suite where
the README installs it) run only their answer-specific files (matrix.PARTIAL_SUITES).
"""

from __future__ import annotations

import pytest

from matrix import MATRIX, SLOW_RENDER
from matrix_checks import installs_and_passes_its_cpu_suite, trains_one_epoch

pytestmark = pytest.mark.matrix
NAMES = [name for name in MATRIX if name != SLOW_RENDER]


@pytest.mark.parametrize("name", NAMES)
def test_installs_and_passes_its_cpu_suite(rendered, name):
    installs_and_passes_its_cpu_suite(rendered[name], name)


@pytest.mark.parametrize("name", NAMES)
def test_trains_one_epoch(rendered, name, tmp_path):
    trains_one_epoch(rendered[name], name, tmp_path)
