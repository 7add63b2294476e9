"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

# Test tensors are small, so a second intra-op thread costs more in synchronisation than it gains; on a shared
# 2-core machine it made a nano XCiT forward ~20x slower (2.2 s vs 0.09 s at 128 px).
torch.set_num_threads(1)


def _shared_data_dir() -> Path:
    # CI clones the repository with `shared/` beside it; SSL_XCIT_SHARED_DATA overrides for other layouts.
    override = os.environ.get("SSL_XCIT_SHARED_DATA")
    return Path(override) if override else REPO_ROOT.parent / "shared" / "data"


# `timeout` in pyproject.toml bounds every default-suite test; the opt-in slow ones train for minutes.
SLOW_TEST_TIMEOUT_S = 3600


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real photos and ground truth in ``../shared/data``; tests that need them skip when it is absent."""
    path = _shared_data_dir()
    if not path.is_dir():
        pytest.skip(f"shared data not found at {path} (set SSL_XCIT_SHARED_DATA)")
    return path


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # Generated datasets and feature caches go to a per-session temporary folder, never to the user's home.
    monkeypatch.setenv("SSL_XCIT_CACHE", str(tmp_path_factory.getbasetemp() / "ssl_xcit_cache"))
    # File modes are tested with and without owner-only files; the caller's own setting must not leak in.
    monkeypatch.delenv("SSL_XCIT_PRIVATE", raising=False)
    yield
