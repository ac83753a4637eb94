"""Shared test fixtures: every test starts from a known RNG and compiler state."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_state():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(False)
    yield
    torch._dynamo.reset()
    torch.use_deterministic_algorithms(False)
