"""The CPU fast paths of the model compute the same numbers as the plain forms they replace.

- routed experts through torch._grouped_mm equal the per-expert loop bit for bit (float32, bf16; also
  expert-parallel on a rank holding half the experts);
- the precomputed rotary tables and the gather-multiply-add rotation equal transformers' rotary
  functions bit for bit (both styles, three dtypes, any positions);
- RMSNorm equals transformers' five-op float32 form bit for bit;
- ForwardContext.build's small-step (Python lists) and large-step (tensor ops) paths agree, holes in
  this rank's page table included;
- the batched single-rank layout (decode rows and equal prefill chunks attended in groups) equals the
  per-slice kernel to 1e-12 in float64, on mixed steps with pages the rank does not hold.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from test_layouts_dist import LAYER, P, build_plan, full_mla, inputs

import splash.attention.batched as batched_mod
import splash.worker.context as context_mod
from splash.attention.local import BatchedLocalLayout, LocalLayout
from splash.core.presets import PRESETS
from splash.model.layers import RMSNorm
from splash.model.moe import MoE
from splash.model.rope import Rotary
from splash.step.plan import SeqSlice
from splash.worker.context import build_context

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(120)
TINY = PRESETS["tiny"]


def _moe(dtype: torch.dtype, rank: int = 0, world: int = 1) -> MoE:
    g = torch.Generator().manual_seed(5)
    m = MoE(TINY, dtype, rank=rank, world=world, mode="ep" if world > 1 else "auto")
    for name, b in m.named_buffers():
        if b is not None and b.is_floating_point():
            b.copy_(torch.randn(b.shape, generator=g) * (0.02 if "bias" in name else 0.2))
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [1, 2])
def test_grouped_experts_equal_the_expert_loop(dtype: torch.dtype, world: int, monkeypatch) -> None:
    moe = _moe(dtype, rank=world - 1, world=world)
    assert moe._use_grouped(torch.zeros(1, dtype=dtype))
    batched = []
    real = MoE._batched
    monkeypatch.setattr(MoE, "_batched", lambda self, *a: batched.append(r := real(self, *a)) or r)
    for n in (1, 3, 16, 200):
        x = torch.randn(n, TINY.hidden_size, generator=torch.Generator().manual_seed(n)).to(dtype)
        moe.batched_experts = False
        fast = moe(x)  # grouped GEMM: bit for bit the loop
        moe.batched_experts = True
        padded = moe(x)  # batched over padded experts: the loop to rounding
        with monkeypatch.context() as m:
            m.setattr(MoE, "_use_grouped", lambda self, x: False)
            slow = moe(x)
        assert torch.equal(fast, slow), f"n={n}: max diff {(fast - slow).abs().max().item()}"
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert torch.allclose(padded, slow, rtol=tol, atol=tol), f"n={n}: {(padded - slow).abs().max()}"
    assert any(r is not None for r in batched)  # the padded path ran (balanced enough at some n)
    if world == 1:  # one row routes to k = 2 of 8 experts: the padded GEMM would read all 8 experts'
        #             weights for it, so the grouped GEMM (the routed experts' only) runs instead
        assert batched[0] is None


@pytest.mark.parametrize("interleave", [True, False])
def test_rotary_tables_match_transformers_bit_for_bit(interleave: bool) -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    cfg = dataclasses.replace(TINY, rope_interleave=interleave, qk_rope_head_dim=64,
                              rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 0.9,
                                            "mscale_all_dim": 0.7, "original_max_position_embeddings": 64})
    rot = Rotary(cfg)
    hf = apply_rotary_pos_emb_interleave if interleave else apply_rotary_pos_emb
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for n in (1, 7, 300):
            pos = torch.randint(0, 3000, (n,), generator=g)  # grows the table past its first block
            q = torch.randn(n, 4, 192, generator=g).to(dtype)[..., 128:]  # strided, as q_pe is
            k = torch.randn(n, 64, generator=g).to(dtype)
            t = rot.tables(pos)
            assert rot.tables(pos) is t  # memoised for the step's other layers
            freqs = pos[None, :, None].float() * rot.inv_freq
            emb = torch.cat((freqs, freqs), -1)
            cos = (emb.cos() * rot.attention_factor).to(dtype)
            sin = (emb.sin() * rot.attention_factor).to(dtype)
            qh, kh = hf(q.transpose(0, 1)[None], k[None, None], cos, sin)
            assert torch.equal(rot.apply(q, t), qh[0].transpose(0, 1))
            assert torch.equal(rot.apply(k, t), kh[0, 0])


def test_rmsnorm_matches_the_reference_form_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for d in (33, 64, 96, 256, 1536):
            norm = RMSNorm(d, 1e-6, dtype)
            norm.weight = torch.randn(d, generator=g).to(dtype)
            for n in (1, 5, 17, 300):
                x = (torch.randn(n, d, generator=g) * 3).to(dtype)
                h = x.to(torch.float32)
                h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
                assert torch.equal(norm(x), norm.weight * h.to(dtype)), (dtype, d, n)


def _plan(holes: bool) -> list[SeqSlice]:
    """Two-rank tables; with holes, rank 0 lacks every third page."""
    seqs, nxt = [], 0
    for i, (start, n) in enumerate([(0, 40), (17, 1), (5, 70), (33, 1), (0, 3), (63, 2)]):
        pages = []
        for j in range(-(-(start + n) // 4)):
            pages.append(-1 if holes and j % 3 == 2 else nxt)
            nxt += 1
        seqs.append(SeqSlice(i, start, n, 0, [pages, list(range(len(pages)))], True))
    return seqs


@pytest.mark.parametrize("holes", [False, True])
def test_context_build_paths_agree(holes: bool, monkeypatch) -> None:
    seqs = _plan(holes)
    small = build_context(seqs, kv=None, layout=LocalLayout(), page_size=4)
    monkeypatch.setattr(context_mod, "_PY_ROWS", 0)  # force the tensor path
    large = build_context(seqs, kv=None, layout=LocalLayout(), page_size=4)
    want_pos, want_rows, want_slots, row = [], [], [], 0
    for s in seqs:
        for p in range(s.start, s.end):
            page = s.pages[0][p // 4]
            want_pos.append(p)
            if page >= 0:
                want_rows.append(row)
                want_slots.append(page * 4 + p % 4)
            row += 1
    for ctx in (small, large):
        assert ctx.positions.tolist() == want_pos
        assert ctx.write_rows.tolist() == want_rows and ctx.write_slots.tolist() == want_slots
        assert ctx.all_held is not holes and ctx.max_end == max(s.end for s in seqs)
        row = 0
        for s, sc in zip(seqs, ctx.seqs):
            assert sc.pages.tolist() == s.pages[0] and sc.row_start == row and sc.end == s.end
            row += s.num_new


@pytest.mark.parametrize("path,budget", [("torch", None), ("torch", 1), ("native", None)])
@pytest.mark.parametrize("kind,rank", [("replicated", 0), ("owner", 1), ("position", 0)])
def test_batched_groups_equal_the_per_slice_kernel(kind: str, rank: int, path: str, budget: int | None,
                                                   monkeypatch) -> None:
    # decode rows (contexts 3 to 14: more than one length bucket), two pairs of equal prefill chunks, a
    # lone chunk; CP's position shards leave holes the groups compact away. budget=1: every group is cut
    # to single slices by the score budget, and chunk masks are added per head view instead of fused.
    # path "native": the C kernel over the paged cache (attention/native.py) instead of the groups; it
    # must read no slot that is not a key (they are NaN here).
    from splash.attention import native
    from splash.attention.kernels import Kernels
    from splash.config import KernelConfig

    # the absorbed kernels' groups (MHA: test_layouts_dist); the torch path: --enforce-eager
    kernels = Kernels(KernelConfig(attention_form="absorbed", enforce_eager=path != "native"))
    calls = []
    if path == "native":
        if native.library() is None:
            pytest.skip("no C compiler: the native kernel is unavailable")
        real = native.paged_attention
        monkeypatch.setattr(native, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    if budget is not None:
        monkeypatch.setattr(batched_mod, "_MAX_SCORES", budget)
        monkeypatch.setattr(batched_mod, "_MAX_BIAS", 0)
    groups = batched_mod.SliceBatches.__init__
    sizes: list[list[int]] = []

    def spy(self, ctx, idx, heads):
        groups(self, ctx, idx, heads)
        sizes.append(sorted(g.size for g in self.groups))

    monkeypatch.setattr(batched_mod.SliceBatches, "__init__", spy)
    case = [(0, 6, 0), (9, 1, 1), (5, 4, 1), (13, 1, 1), (2, 1, 1), (0, 6, 1), (3, 4, 1), (1, 3, 1)]
    q_in, latent_new, hist = inputs(case, seed=3)
    mla = full_mla()
    outs, pools = [], []
    for layout in (BatchedLocalLayout(kernels), LocalLayout(kernels)):
        seqs, pool = build_plan(case, hist, kind, 2, rank, seed=9)
        # Every slot that is not one of this step's keys is NaN (as a freed, poisoned page would be):
        # page padding, the tail of a slice's last page and pages the table does not name.
        flat = pool.flat_layer(LAYER)
        keep = torch.zeros(flat.shape[0], dtype=torch.bool)
        for s in seqs:
            for p in range(s.start + s.num_new):
                page = s.pages[rank][p // P]
                if page >= 0:
                    keep[page * P + p % P] = True
        flat[~keep] = float("nan")
        ctx = build_context(seqs, kv=pool, layout=layout, rank=rank, world=2, page_size=P)
        outs.append(layout.attention(LAYER, mla, q_in, latent_new, ctx))
        pools.append(pool.data)
    assert torch.isfinite(outs[0]).all() and torch.isfinite(outs[1]).all()
    assert (outs[0] - outs[1]).abs().max().item() < 1e-12
    assert torch.equal(pools[0].nan_to_num(), pools[1].nan_to_num())
    if path == "native":
        assert calls and not sizes  # the kernel ran, the torch groups did not
        return
    # decodes at contexts 14, 10 | 3 (> 2x apart), chunk pairs of 6 and 4 rows, the lone 3-row chunk
    assert sizes == ([[1] * 8] if budget == 1 else [[1, 1, 2, 2, 2]])


def test_fused_projections_equal_separate_ones() -> None:
    """q_a with kv_a, and gate with up, as one GEMM each: bit-identical outputs, weights keep their
    names and values (as views), and a replaced weight falls back to the separate GEMMs."""
    from splash.model import DeepseekForCausalLM

    g = torch.Generator().manual_seed(2)
    model = DeepseekForCausalLM(TINY, torch.float32)
    for _, b in model.named_buffers():
        if b is not None and b.is_floating_point():
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    x = torch.randn(16, TINY.hidden_size, generator=g)
    pos = torch.arange(16) * 3
    layer = model.layers[1]
    mla, shared, dense = layer.self_attn, layer.mlp.shared, model.layers[0].mlp
    want = (mla.prepare(x, pos), shared(x), dense(x))
    counts = model.weight_counts()
    model.fuse()
    assert mla._qkv_a is not None and shared._gate_up is not None and dense._gate_up is not None
    assert model.weight_counts() == counts
    got = (mla.prepare(x, pos), shared(x), dense(x))
    assert all(torch.equal(a, b) for a, b in zip(want[0], got[0]))
    assert torch.equal(want[1], got[1]) and torch.equal(want[2], got[2])
    dense.up_proj = dense.up_proj.clone() * 2  # replaced: the fused tensor is stale, so not used
    assert not torch.equal(dense(x), want[2])


def test_enforce_eager_turns_the_native_kernel_off(monkeypatch) -> None:
    """`--enforce-eager` / LLM(enforce_eager=True) mean plain torch ops, here and in spawned ranks (the
    config every rank builds from carries it; no process global)."""
    from splash.attention.kernels import Kernels
    from splash.attention.registry import make_layout
    from splash.commands.generate import add_engine_args, engine_config

    monkeypatch.delenv("SPLASH_NATIVE", raising=False)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["--enforce-eager"])).enforce_eager is True
    assert engine_config(p.parse_args([])).enforce_eager is False
    eager = engine_config(p.parse_args(["--enforce-eager"])).kernels
    q = torch.zeros(1, 1, 1)
    assert make_layout("tp", Kernels(eager)).kernels.kernel_for(q) == "torch"
    assert not Kernels(eager).supports(q)
