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


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """The measured matmul peak (mfu.py) is cached per session, not in the user's home."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield
