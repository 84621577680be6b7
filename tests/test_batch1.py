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
        if m > gemm.native_rows():  # (one row only where the CPU lacks AVX512-BF16)
            assert gemm.few_rows(torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()) is None
            continue
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


@pytest.mark.parametrize("tp", [1, 2])
def test_native_decode_step_matches_enforce_eager(tp: int, monkeypatch) -> None:
    """A bf16 engine's batch-1 decode step (the native few-row products: csrc/gemv.c) against the same
    step under --enforce-eager (torch's ops), at T = 1 and T = 2 (TP shards): the same first token (the
    prefill's, many rows: torch's GEMMs in both) and the second token's top-5 logprobs to bf16 rounding."""
    from splash.engine.sampling import SamplingParams
    from splash.llm import LLM

    if gemm._lib.get() is None:
        pytest.skip("no C compiler")
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=5, ignore_eos=True)
    ran: list[int] = []
    real = gemm.few_rows
    monkeypatch.setattr(gemm, "few_rows", lambda x, w: (y := real(x, w)) is not None and ran.append(1) or y)
    got = {}
    try:
        for eager in (False, True):
            with LLM("tiny", dtype="bfloat16", tp=tp, enforce_eager=eager, num_kv_pages=64) as llm:
                got[eager] = llm.generate(prompt_token_ids=[list(range(3, 40))],
                                          sampling_params=params)[0].outputs[0]
            if tp == 1:  # (rank 0 runs here: the fast engine ran the kernel, the eager one did not)
                assert bool(ran) != eager
                ran.clear()
    finally:
        gemm.set_native(True)  # (the rule is the process's: the eager engine turned it off here)
    fast, ref = got[False], got[True]
    assert fast.token_ids[0] == ref.token_ids[0]
    common = set(fast.logprobs[1]) & set(ref.logprobs[1])
    assert len(common) >= 3
    for t in common:
        assert abs(fast.logprobs[1][t] - ref.logprobs[1][t]) < 0.1, (t, fast.logprobs[1], ref.logprobs[1])
