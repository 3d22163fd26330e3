"""Shared fixtures: the real default model, prepared once per machine (slow tests only); and the
`gpu` marker.

Every test runs on the CPU, also on a machine with a GPU: the exactness tests rest on the CPU's
batch-invariant float32 kernels, and the two-rank tests need two devices. The settings, daemon flags
and commands the tests build name `device: cpu` (tests/test_cpu_pin.py checks that they do). A test
that needs the GPU is marked `gpu`, names cuda itself, and is skipped where torch sees no GPU.
"""

from __future__ import annotations

import pytest
import torch

from tpserve.prepare import prepare

NO_GPU = pytest.mark.skip(reason="marked gpu: torch sees no CUDA GPU here")


def pytest_collection_modifyitems(config, items) -> None:
    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(NO_GPU)


@pytest.fixture(scope="session")
def default_model() -> str:
    return str(prepare(progress=False))
