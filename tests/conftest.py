"""Test options: `--cuda` runs the tests marked `cuda` (parity on the GPUs); without it they are skipped,
so CI stays CPU-only."""

from __future__ import annotations

import os

import pytest

# Every engine the suite builds proves its KV books after each step and control operation
# (splash/kv/books.py): a bookkeeping error fails the step that makes it.
os.environ.setdefault("SPLASH_CHECK_BOOKS", "1")


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


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's in-process rank 0: the spawned ranks share the same 2 cores."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", params=[2, 4], ids=["T2", "T4"])
def group(request):
    """T = 2 and T = 4 gloo ranks, one per test module that asks (a module may define its own)."""
    from splash.engine.group import RankGroup

    g = RankGroup.start(request.param, device="cpu", timeout_s=60.0, threads=1)
    yield g
    g.close()
