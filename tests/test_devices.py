"""NCCL's one-rank-per-device rule is checked before any rank starts, with what to change."""

from __future__ import annotations

import pytest
import torch

from splash.core.model_config import ConfigError
from splash.distributed import groups


def test_gloo_needs_no_device() -> None:
    groups.check_devices(8, "gloo")


@pytest.mark.parametrize("found", [0, 1, 3])
def test_more_ranks_than_cuda_devices_is_a_config_error(monkeypatch: pytest.MonkeyPatch, found: int) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: found)
    if found:
        groups.check_devices(found, "nccl")  # as many ranks as devices: fine
    with pytest.raises(ConfigError, match=rf"{found + 1} ranks on this node need {found + 1} CUDA devices.*"
                                          r"--device cpu"):
        groups.check_devices(found + 1, "nccl")


def test_torchrun_node_with_too_many_ranks_fails_before_joining(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match="2 ranks on this node need 2 CUDA devices"):
        groups.init_distributed(1, 2, "tcp://127.0.0.1:1", backend="nccl")


def test_engine_on_one_gpu_with_two_ranks_says_use_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """`splash generate --tp 2` on a one-GPU machine: a clear error before any rank is spawned."""
    from splash.engine.build import build_engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="2 ranks on this node need 2 CUDA devices"):
        build_engine("tiny", tp=2, layout="tp")
