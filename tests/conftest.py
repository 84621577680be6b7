"""Test options: `--cuda` runs the tests marked `cuda` (parity on the GPUs); without it they are skipped,
so CI stays CPU-only."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cuda", action="store_true", default=False,
                     help="run tests marked `cuda` (needs a CUDA device)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--cuda"):
        import torch

        if torch.cuda.is_available():
            return
        reason = "--cuda given but torch sees no CUDA device"
    else:
        reason = "needs a CUDA device: run with --cuda"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
