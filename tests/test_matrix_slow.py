"""The slow render of the matrix (matrix.SLOW_RENDER): the whole suite's `slow` tests, its
tracker's fast files, and one epoch. A module of its own, so pytest-xdist runs it beside the
others. (The whole fast suite of the same code runs in test_user_install.py's image render.)"""

from __future__ import annotations

import pytest

from matrix import SLOW_RENDER
from matrix_checks import installs_and_passes_its_cpu_suite, trains_one_epoch

pytestmark = pytest.mark.matrix


def test_the_slow_render_installs_and_passes_its_slow_tests(rendered):
    installs_and_passes_its_cpu_suite(rendered[SLOW_RENDER], SLOW_RENDER)


def test_the_slow_render_trains_one_epoch(rendered, tmp_path):
    trains_one_epoch(rendered[SLOW_RENDER], SLOW_RENDER, tmp_path)
