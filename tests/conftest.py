"""Shared fixtures: the real default model, prepared once per machine (slow tests only)."""

from __future__ import annotations

import pytest

from tpserve.prepare import prepare


@pytest.fixture(scope="session")
def default_model() -> str:
    return str(prepare(progress=False))
