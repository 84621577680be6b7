"""Switch manifests: appendix A weight sizes, the 12-direction pattern, and a brute-force recount."""

import math

import numpy as np
import pytest

from splash.core.layouts import DIRECTIONS, LAYOUTS, Layout
from splash.core.manifest import (
    ALL_GATHER,
    ALL_TO_ALL,
    DISCARD,
    KVPages,
    switch_manifest,
    weights_report,
)
from splash.core.model_config import ConfigError
from splash.core.presets import PRESETS
from splash.core.sizes import MIB, AttentionSizes
from splash.core.transfer import kv_transfer_tokens

L = Layout


def test_appendix_a_deepseek_v3_bf16():
    rep = weights_report(AttentionSizes(PRESETS["deepseek-v3"], "bf16"), 8)
    assert rep["per_layer_mib"] == {"q_b": 72.0, "kv_b": 32.0, "o": 224.0, "total": 328.0}
    assert rep["receive_mib_per_rank"] == 287.0
    assert rep["receive_mib_group"] == 2296.0
    assert rep["layers"] == 61


def test_appendix_a_fp8_and_block_scales():
    plain = weights_report(AttentionSizes(PRESETS["deepseek-v3"], "fp8"), 8)
    assert plain["receive_mib_per_rank"] == 143.5
    scaled = weights_report(AttentionSizes(PRESETS["deepseek-v3"], "fp8", fp8_scales=True), 8)
    # 128x128 fp32 scales: q_b [24576 x 1536], kv_b [32768 x 512], o [7168 x 16384]
    scales = (24576 // 128 * 12 + 32768 // 128 * 4 + 56 * 16384 // 128) * 4
    assert scaled["per_layer_mib"]["total"] * MIB == pytest.approx(164 * MIB + scales)
    assert scaled["receive_mib_per_rank"] * MIB == pytest.approx(143.5 * MIB + scales * 7 / 8)


def test_no_q_lora_uses_full_q_projection():
    sizes = AttentionSizes(PRESETS["deepseek-v2-lite"])
    names = [p.name for p in sizes.projections]
    assert names == ["q", "kv_b", "o"]
    c = sizes.cfg
    assert sizes.layer_weight_bytes()["q"] == c.num_attention_heads * c.qk_head_dim * c.hidden_size * 2


SPEC_WEIGHTS = {(L.TP, L.DP), (L.TP, L.CP), (L.DOP, L.DP), (L.DOP, L.CP)}
SPEC_KV_GATHER = {(L.CP, L.TP), (L.DP, L.TP), (L.DOP, L.TP)}
SPEC_KV_A2A = {(L.CP, L.DP), (L.CP, L.DOP), (L.DP, L.CP), (L.DOP, L.CP)}


def test_twelve_directions_fall_out_of_the_model():
    sizes = AttentionSizes(PRESETS["deepseek-v3"])
    assert len(DIRECTIONS) == 12
    for a, b in DIRECTIONS:
        m = switch_manifest(sizes, a, b, [8192] * 16, 8)
        assert (m.weights.total_bytes > 0) == ((a, b) in SPEC_WEIGHTS)
        assert m.weights.primitive == (ALL_GATHER if (a, b) in SPEC_WEIGHTS else DISCARD)
        expect_kv = (ALL_GATHER if (a, b) in SPEC_KV_GATHER
                     else ALL_TO_ALL if (a, b) in SPEC_KV_A2A else DISCARD)
        assert m.kv.primitive == expect_kv, (a, b)
        assert (m.kv.total_bytes > 0) == (expect_kv != DISCARD)
        if (a, b) in SPEC_WEIGHTS:
            assert m.weights.bytes_per_rank == pytest.approx(sizes.w_layer * 7 / 8)


def test_kv_bytes_scale_linearly_in_b_times_s():
    sizes = AttentionSizes(PRESETS["deepseek-v3"])
    for a, b in SPEC_KV_GATHER | SPEC_KV_A2A:
        base = switch_manifest(sizes, a, b, [4096] * 8, 8).kv.total_bytes
        assert switch_manifest(sizes, a, b, [8192] * 8, 8).kv.total_bytes == pytest.approx(2 * base)
        assert switch_manifest(sizes, a, b, [4096] * 16, 8).kv.total_bytes == pytest.approx(2 * base)


# ---- independent brute force: blocks as Python sets, one rank at a time ---------------------------
def _held(layout, rank, T, H, requests, P):
    heads = set(range(H)) if layout in (L.DP, L.CP) else set(range(rank * H // T, (rank + 1) * H // T))
    pages = set()
    for i, (ctx, owner) in enumerate(requests):
        for j in range(math.ceil(ctx / P)):
            cp_mine = layout is L.CP and j % T == rank
            owner_mine = layout in (L.DP, L.DOP) and owner == rank
            if layout is L.TP or cp_mine or owner_mine:
                pages.add((i, j))
    return heads, pages


def _page_tokens(ctx, j, P):
    return min(P, ctx - j * P)


@pytest.mark.parametrize("seed", range(12))
def test_manifest_matches_brute_force_block_count(seed):
    rng = np.random.default_rng(100 + seed)
    sizes = AttentionSizes(PRESETS["tiny"])
    H = sizes.heads
    T = int(rng.choice([1, 2, 4, 8]))
    P = int(rng.integers(1, 9))
    B = int(rng.integers(0, 7))
    ctx = [int(x) for x in rng.integers(0, 50, B)]
    o_src = [int(x) for x in rng.integers(0, T, B)]
    o_dst = [int(x) for x in rng.integers(0, T, B)] if seed % 2 else o_src
    per_head = {p.name: sizes.slice_bytes(p, [0]) for p in sizes.projections}
    head_bytes = sum(per_head.values())
    for a, b in DIRECTIONS:
        m = switch_manifest(sizes, a, b, list(zip(ctx, o_src, o_dst)), T, P)
        for r in range(T):
            ha, pa = _held(a, r, T, H, list(zip(ctx, o_src)), P)
            hb, pb = _held(b, r, T, H, list(zip(ctx, o_dst)), P)
            w_need = len(hb - ha) * head_bytes
            w_free = len(ha - hb) * head_bytes
            kv_need = sum(_page_tokens(ctx[i], j, P) for i, j in pb - pa) * sizes.kv_token_layer
            kv_free = sum(_page_tokens(ctx[i], j, P) for i, j in pa - pb) * sizes.kv_token_layer
            assert m.weights.recv_bytes[r] == pytest.approx(w_need)
            assert m.weights.freed_bytes[r] == pytest.approx(w_free)
            assert m.kv.recv_bytes[r] == pytest.approx(kv_need)
            assert m.kv.freed_bytes[r] == pytest.approx(kv_free)
        # the fast closed form agrees
        rt, ft = kv_transfer_tokens(a, b, ctx, o_src, o_dst, T, P)
        assert np.allclose(rt * sizes.kv_token_layer, m.kv.recv_bytes)
        assert np.allclose(ft * sizes.kv_token_layer, m.kv.freed_bytes)


@pytest.mark.parametrize("seed", range(6))
def test_concrete_moves_turn_source_holdings_into_destination_holdings(seed):
    """Apply the listed moves and frees to each rank's source blocks: the result is the destination."""
    rng = np.random.default_rng(seed)
    sizes = AttentionSizes(PRESETS["tiny"])
    H, T, P = sizes.heads, int(rng.choice([2, 4, 8])), int(rng.integers(1, 6))
    B = int(rng.integers(1, 6))
    ctx = [int(x) for x in rng.integers(1, 40, B)]
    o_src = [int(x) for x in rng.integers(0, T, B)]
    o_dst = [int(x) for x in rng.integers(0, T, B)]
    for a, b in DIRECTIONS:
        m = switch_manifest(sizes, a, b, list(zip(ctx, o_src, o_dst)), T, P)
        state = {r: _held(a, r, T, H, list(zip(ctx, o_src)), P) for r in range(T)}
        src_state = {r: (set(h), set(p)) for r, (h, p) in state.items()}
        for mv in m.kv_moves():
            for j in mv.pages:
                assert (mv.request, j) in src_state[mv.src][1]  # the sender holds what it sends
                state[mv.dst][1].add((mv.request, j))
        for mv in m.weight_moves():
            assert set(range(mv.start, mv.stop)) <= src_state[mv.src][0]
            state[mv.dst][0].update(range(mv.start, mv.stop))
        for f in m.kv_frees():
            state[f.rank][1].difference_update((f.request, j) for j in f.pages)
        for f in m.weight_frees():
            state[f.rank][0].difference_update(range(f.start, f.stop))
        for r in range(T):
            assert state[r] == _held(b, r, T, H, list(zip(ctx, o_dst)), P), (a, b, r)


@pytest.mark.parametrize("seed", range(4))
def test_kv_pages_are_the_listed_moves_and_frees_row_by_row(seed):
    """The arrays the runtime planner checks are exactly kv_moves() / kv_frees(), page by page and in
    order (same grouping), so checking one checks the other."""
    rng = np.random.default_rng(100 + seed)
    sizes = AttentionSizes(PRESETS["tiny"])
    T, P, B = int(rng.choice([2, 4, 8])), int(rng.integers(1, 6)), int(rng.integers(0, 6))
    batch = [(int(rng.integers(0, 40)), int(rng.integers(0, T)), int(rng.integers(0, T))) for _ in range(B)]
    for a in LAYOUTS:
        for b in LAYOUTS:
            m = switch_manifest(sizes, a, b, batch, T, P)
            got, want = m.kv_pages(), KVPages.of(m.kv_moves(), m.kv_frees())
            for field in ("moves", "move_starts", "frees", "free_starts"):
                assert getattr(got, field).tolist() == getattr(want, field).tolist(), (a, b, field)


def test_owner_rebalance_within_one_layout_is_all_to_all():
    sizes = AttentionSizes(PRESETS["tiny"])
    m = switch_manifest(sizes, L.DP, L.DP, [(10, 0, 1)], 2, 4)
    assert m.kv.primitive == ALL_TO_ALL and m.weights.primitive == "keep"
    assert switch_manifest(sizes, L.DP, L.DP, [(10, 0, 0)], 2, 4).kv.primitive == "keep"


def test_manifest_layers_and_in_transit():
    sizes = AttentionSizes(PRESETS["tiny"])
    m = switch_manifest(sizes, L.DOP, L.CP, [64, 64], 2, 16)
    assert len(m.layers) == sizes.layers
    assert np.allclose(m.recv_bytes_per_rank(), m.in_transit_bytes() * sizes.layers)
    d = m.to_dict()
    assert d["from"] == "DOP" and d["to"] == "CP" and d["weights"]["primitive"] == ALL_GATHER


def test_invalid_inputs():
    sizes = AttentionSizes(PRESETS["tiny"])
    with pytest.raises(ConfigError, match="cannot be split"):
        switch_manifest(sizes, L.TP, L.DP, [1], 3)
    with pytest.raises(ConfigError, match="owner"):
        switch_manifest(sizes, L.TP, L.DP, [(5, 9)], 2)
    with pytest.raises(ConfigError, match="context"):
        switch_manifest(sizes, L.TP, L.DP, [-5], 2)
    with pytest.raises(ConfigError, match="page size"):
        switch_manifest(sizes, L.TP, L.DP, [5], 2, page_size=0)
    assert all(lay in LAYOUTS for lay in (L.TP, L.DP, L.CP, L.DOP))
