"""The default (unbudgeted) KV pool: a share of free memory, less what a live switch will need."""

from __future__ import annotations

import pytest
import torch

from splash.core.model_config import ConfigError
from splash.core.presets import PRESETS
from splash.kv.pool import KVPool
from splash.runtime_spec import RuntimeSpec
from splash.worker import sizing

CFG = PRESETS["tiny"]
PER_PAGE = KVPool.bytes_per_page(CFG, 16, torch.float32)


def pages(memory_per_rank=None, num_kv_pages=None, max_num_seqs=64, max_model_len=4096, device="cpu",
          keep_free=0) -> int:
    spec = RuntimeSpec.for_tests(CFG, dtype=torch.float32, page_size=16, memory_per_rank=memory_per_rank,
                                 num_kv_pages=num_kv_pages, max_num_seqs=max_num_seqs,
                                 max_model_len=max_model_len)
    return sizing.kv_pages(spec, torch.device(device), 0, 0, keep_free=keep_free)


@pytest.mark.parametrize("keep_free", [0, 10 * PER_PAGE + 7])
def test_cuda_default_pool_takes_85_percent_less_what_switches_need(monkeypatch, keep_free: int) -> None:
    free = 1000 * PER_PAGE
    monkeypatch.setattr(sizing, "available_bytes", lambda device: free)
    n = pages(device="cuda", keep_free=keep_free)
    assert n == (int(free * 0.85) - keep_free) // PER_PAGE
    assert free - n * PER_PAGE >= keep_free + int(free * 0.15)  # the replicas and the workspace fit


def test_cpu_default_pool_takes_the_replicas_from_free_memory_not_from_its_128_mib_cap(monkeypatch) -> None:
    """The 128 MiB CPU cap is a convenience, not memory: replicas come out of what is free."""
    monkeypatch.setattr(sizing, "available_bytes", lambda device: 10 * 2**30)
    assert pages(keep_free=200 * 2**20) == pages() == 128 * 2**20 // PER_PAGE
    monkeypatch.setattr(sizing, "available_bytes", lambda device: 2**30)  # 0.2 x 1 GiB = 205 MiB
    assert pages(keep_free=150 * 2**20) == (int(0.2 * 2**30) - 150 * 2**20) // PER_PAGE


def test_no_room_at_all_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(sizing, "available_bytes", lambda device: 100 * PER_PAGE)
    with pytest.raises(ConfigError, match="projection replicas live switching needs.*--memory-per-rank"):
        pages(device="cuda", keep_free=100 * PER_PAGE)


def test_keep_free_does_not_touch_an_explicit_budget_or_count() -> None:
    assert pages(num_kv_pages=7, keep_free=10**9) == 7
    assert pages(memory_per_rank=100 * PER_PAGE, keep_free=10**9) == 100


def test_a_small_demand_still_gets_what_it_asks() -> None:
    """want (max_num_seqs x max_model_len) below the cap: the pool is exactly that."""
    assert pages(max_num_seqs=2, max_model_len=64, keep_free=PER_PAGE) == 2 * 4
