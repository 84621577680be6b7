"""Batch-1 decode fast paths on CPU (docs/performance.md "Batch 1"): one bf16 row's products as `mv`,
the MoE's chosen experts one by one. Both against the paths they replace, to bf16 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_fast_paths import TINY, _moe

from splash.model import gemm
from splash.model.moe import MoE

pytestmark = pytest.mark.timeout(120)


def test_one_half_row_goes_through_mv_and_matches_linear() -> None:
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 64, generator=g), torch.randn(1, 64, generator=g)
    for dt in (torch.bfloat16, torch.float16):
        got = gemm.linear(x.to(dt), w.to(dt))
        assert got.shape == (1, 96) and got.dtype == dt
        assert torch.allclose(got.float(), F.linear(x.to(dt), w.to(dt)).float(), rtol=2e-2, atol=2e-2)
    assert not gemm.gemv(x) and not gemm.gemv(x.double())  # float32 / float64 keep F.linear
    assert torch.equal(gemm.linear(x.double(), w.double()), F.linear(x.double(), w.double()))


@pytest.mark.parametrize("world", [1, 2])
def test_one_row_moe_matches_the_routed_paths(world: int, monkeypatch) -> None:
    moe = _moe(torch.bfloat16, rank=world - 1, world=world)
    ran = []
    real = MoE._one_row
    monkeypatch.setattr(MoE, "_one_row", lambda self, *a: ran.append(1) or real(self, *a))
    for seed in range(6):
        x = torch.randn(1, TINY.hidden_size, generator=torch.Generator().manual_seed(seed)).bfloat16()
        fast = moe(x)
        gemm.set_gemv(False)
        try:
            ref = moe(x)  # the grouped GEMM over the routed rows
        finally:
            gemm.set_gemv(True)
        assert torch.allclose(fast.float(), ref.float(), rtol=2e-2, atol=2e-2), (fast - ref).abs().max()
    assert len(ran) == 6
