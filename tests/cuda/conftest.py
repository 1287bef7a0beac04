"""The CUDA tier: every test here takes the `device` fixture, CUDA by default, skipped where there is none.
`SHARDFORGE_TEST_DEVICE=cpu` runs the same tests on the CPU (how the tier is kept working on machines
without a GPU: no test here is CUDA-only code that nothing runs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
NO_CUDA = "no CUDA device (SHARDFORGE_TEST_DEVICE=cpu runs this tier on the CPU)"


@pytest.fixture
def device() -> torch.device:
    device = torch.device(os.environ.get("SHARDFORGE_TEST_DEVICE", "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    return device


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.cuda)
