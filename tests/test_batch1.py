"""Batch-1 decode fast paths on CPU (docs/performance.md "Batch 1"): a few bf16 rows' products through
the native kernel (csrc/gemv.c) or `mv`, the MoE's chosen experts one by one. Each against the path it
replaces, to bf16 rounding."""

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


@pytest.mark.skipif(gemm._lib.get() is None, reason="no C compiler")
def test_native_few_rows_match_torch_to_bf16_rounding() -> None:
    """csrc/gemv.c against torch's products in float64 (odd sizes: masked tails, a partial block of
    weight rows; strided rows and heads as the model passes them), off under set_native(False)."""
    g = torch.Generator().manual_seed(1)
    for m, n, k in ((1, 37, 70), (2, 96, 64), (3, 5, 33), (4, 130, 257)):
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(m, k + 7, generator=g).bfloat16()[:, :k]  # rows k + 7 apart
        got = gemm.few_rows(x, w)
        ref = F.linear(x.double(), w.double())
        assert got is not None and got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert torch.allclose(got.double(), ref, rtol=1e-2, atol=1e-2), (got.double() - ref).abs().max()
        assert torch.equal(gemm.linear(x.contiguous(), w), got)
    assert gemm.few_rows(torch.randn(5, 64).bfloat16(), torch.randn(8, 64).bfloat16()) is None  # 5 rows
    assert gemm.few_rows(torch.randn(1, 64), torch.randn(8, 64)) is None  # float32: torch
    for h, a, b in ((16, 128, 512), (3, 40, 130)):
        q = torch.randn(h, 1, a, generator=g).bfloat16().transpose(0, 1)  # [1, h, a], heads a apart
        w = torch.randn(h, a, b, generator=g).bfloat16()
        got = gemm.heads(q, w)
        ref = torch.bmm(q.double().transpose(0, 1), w.double()).transpose(0, 1)
        assert got.shape == (1, h, b) and torch.allclose(got.double(), ref, rtol=1e-2, atol=2e-2)
    gemm.set_native(False)
    try:
        assert gemm.few_rows(torch.randn(1, 64).bfloat16(), torch.randn(8, 64).bfloat16()) is None
    finally:
        gemm.set_native(True)
