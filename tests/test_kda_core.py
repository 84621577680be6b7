"""The analytical core for hybrid MLA + KDA models (SPEC §10): where each request's KDA state lives in each
layout, what a switch moves of it, and what it costs in memory, capacity and time. Expected values are
closed forms from the config, checked against the core's set differences."""

from __future__ import annotations

import numpy as np
import pytest

from splash.core.capacity import footprint, model_capacity, model_pool_tokens, requests_at, state_slots
from splash.core.costmodel import Batch, kda_layer_loads, step_cost
from splash.core.hardware import theta_for
from splash.core.layouts import (
    DIRECTIONS,
    LAYOUTS,
    Layout,
    balanced_footprint,
    round_robin_owners,
    state_placement,
)
from splash.core.manifest import Request, switch_manifest
from splash.core.model_config import ModelConfig
from splash.core.presets import PRESETS
from splash.core.sizes import AttentionSizes, kv_bytes_per_token
from splash.core.stores import (
    request_state_bytes,
    request_stores,
    state_fraction,
    state_share,
    stores,
    token_stores,
)
from splash.core.switch_time import layer_transfer_times
from splash.core.transfer import state_transfer_requests, switch_layer_bytes

HYBRIDS = ("tiny-hybrid", "small-hybrid", "kimi-linear", "glm-5.3-flash")
TINY = PRESETS["tiny-hybrid"]


def layer_state(cfg: ModelConfig, model: float = 2, state: float = 4) -> float:
    """One request's state in one KDA layer, from the config: S [H, d, d] + conv [3*H*d, K-1]."""
    H, d, K = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel
    return H * d * d * state + 3 * H * d * (K - 1) * model


# ---- presets ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", HYBRIDS)
def test_presets_are_hybrids_that_split_over_ranks(name):
    cfg = PRESETS[name]
    assert cfg.is_hybrid and cfg.model_type == "kimi_linear" and not cfg.use_rope
    assert set(cfg.mla_layers) | set(cfg.kda_layers) == set(range(cfg.num_hidden_layers))
    for T in (1, 2, 4, 8):
        cfg.check_ranks(T)
    if name == "glm-5.3-flash":  # the paper: 45 layers, 11 MLA and 34 KDA, served at TP16
        assert (cfg.num_hidden_layers, len(cfg.mla_layers), len(cfg.kda_layers)) == (45, 11, 34)
        cfg.check_ranks(16)
    if name == "tiny-hybrid":
        assert cfg.kda_layers == (0, 1, 2) and cfg.mla_layers == (3,) and cfg.q_lora_rank is None


def test_kimi_linear_preset_matches_its_hub_config():
    """The hub's config.json (1-based layer lists in linear_attn_config) parses to the preset."""
    hub = {"model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
           "moe_intermediate_size": 1024, "num_hidden_layers": 27, "num_attention_heads": 32,
           "num_key_value_heads": 32, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
           "qk_rope_head_dim": 64, "v_head_dim": 128, "num_experts": 256, "num_experts_per_token": 8,
           "num_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.446,
           "linear_attn_config": {"kda_layers": [i for i in range(1, 28) if i % 4 and i != 27],
                                  "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "num_heads": 32,
                                  "head_dim": 128, "short_conv_kernel_size": 4}}
    got, want = ModelConfig.from_dict(hub), PRESETS["kimi-linear"]
    for f in ("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "q_lora_rank",
              "kda_layers", "linear_num_heads", "linear_head_dim", "linear_conv_kernel", "use_rope",
              "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace"):
        assert getattr(got, f) == getattr(want, f), f


# ---- stores and sizes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", HYBRIDS)
def test_only_mla_layers_hold_kv_and_the_state_is_per_request(name):
    cfg = PRESETS[name]
    n_mla = len(cfg.mla_layers)
    assert token_stores(cfg)[0].layers == cfg.mla_layers
    assert kv_bytes_per_token(cfg, "bf16") == n_mla * cfg.latent_dim * 2
    assert kv_bytes_per_token(cfg, "fp8") == n_mla * (cfg.kv_lora_rank + -(-cfg.kv_lora_rank // 128) * 4
                                                      + cfg.qk_rope_head_dim * 2)
    sizes = AttentionSizes(cfg)
    assert all(sizes.kv_token_bytes(i) == 0 for i in cfg.kda_layers)
    assert {s.name for s in request_stores(cfg)} == {"kda_state", "kda_conv"}
    assert sizes.state_layer_bytes == layer_state(cfg)
    assert sizes.z == request_state_bytes(cfg, "bf16") == len(cfg.kda_layers) * layer_state(cfg)
    # float64 models keep a float64 state; the recurrent state's dtype can be named
    assert request_state_bytes(cfg, "fp64") == len(cfg.kda_layers) * layer_state(cfg, 8, 8)
    assert AttentionSizes(cfg, state_dtype="bf16").state_layer_bytes == layer_state(cfg, 2, 2)
    assert AttentionSizes(cfg, "fp8").state_layer_bytes == layer_state(cfg)  # conv in bf16 activations


def test_dense_and_dsa_models_are_unaffected():
    for name in ("tiny", "tiny-dsa", "tiny-glm5", "deepseek-v3"):
        cfg = PRESETS[name]
        sizes = AttentionSizes(cfg)
        assert not request_stores(cfg) and sizes.z == 0
        assert stores(cfg)[0].layers == tuple(range(cfg.num_hidden_layers))
        assert sizes.w_a == sizes.w_layer * cfg.num_hidden_layers
        m = switch_manifest(sizes, Layout.TP, Layout.CP, [100, 37], 2, 16)
        assert all(lm.kind == "mla" and lm.state is None for lm in m.layers)
        assert m.state.total_bytes == 0


def test_kda_projections_shard_like_mla():
    cfg = PRESETS["kimi-linear"]
    sizes = AttentionSizes(cfg)
    H, d, D, K = cfg.linear_num_heads, cfg.linear_head_dim, cfg.hidden_size, cfg.linear_conv_kernel
    per_layer = (4 * H * d * D + 3 * H * d * K + 2 * H * d * d + H * d + H + H * D) * 2
    assert sizes.w_layer_kda == per_layer
    assert sizes.w_a == len(cfg.mla_layers) * sizes.w_layer + len(cfg.kda_layers) * per_layer
    for T in (2, 4):
        mine = [sizes.attention_weight_bytes(True, T, r) for r in range(T)]
        assert sum(mine) == pytest.approx(sizes.w_a)
        m = switch_manifest(sizes, Layout.TP, Layout.DP, [], T)  # Eq 9: gather the other 1 - 1/T
        assert m.kda_weights.primitive == "all-gather"
        assert m.kda_weights.recv_bytes == pytest.approx([per_layer * (T - 1) / T] * T)
        assert switch_manifest(sizes, Layout.DP, Layout.DOP, [], T).kda_weights.total_bytes == 0


# ---- placement ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [2, 4])
def test_placement_rule_per_layout(T):
    assert {lay: state_placement(lay) for lay in LAYOUTS} == {
        Layout.TP: "head-sharded", Layout.DOP: "head-sharded", Layout.DP: "owner", Layout.CP: "replicated"}
    for st in request_stores(TINY):
        H = st.head_count
        for lay in LAYOUTS:
            for owner in range(T):
                held = [state_share(st, lay, r, T, owner) for r in range(T)]
                heads = [h for x in held if x is not None for h in x]
                g = [state_fraction(lay, r, T, owner) for r in range(T)]
                assert [0 if x is None else len(x) / H for x in held] == pytest.approx(g)
                if lay.sharded:  # disjoint slices that make the whole state once
                    assert sorted(heads) == list(range(H)) and sum(g) == pytest.approx(1)
                elif lay is Layout.DP:  # whole, on the owner only
                    assert held[owner] == range(H) and sum(g) == 1 and len(heads) == H
                else:  # CP: whole on every rank, counted T times
                    assert all(x == range(H) for x in held) and sum(g) == T


# ---- switches: the 12 directions from set differences --------------------------------------------------
def expected_state(src: Layout, dst: Layout, owners: list[int], T: int, zl: float):
    """(received bytes per rank, primitive) of one KDA layer's states, in closed form."""
    B = len(owners)
    n = np.bincount(owners, minlength=T)
    pa, pb = state_placement(src), state_placement(dst)
    if pa == pb == "head-sharded":
        return np.zeros(T), "keep"
    if pa == "owner" and pb == "head-sharded":  # scatter each owner's heads to their holders
        return (B - n) * zl / T, "all-to-all"
    if pa == "head-sharded" and pb == "owner":  # gather the other heads to the owner
        return n * zl * (T - 1) / T, "all-to-all"
    if pb == "replicated":  # everyone gets what it lacks
        have = B * zl / T * np.ones(T) if pa == "head-sharded" else n * zl
        return B * zl - have, "all-gather"
    assert pa == "replicated"  # out of CP: keep what the destination places here, free the rest
    return np.zeros(T), "discard"


@pytest.mark.parametrize("T", [2, 4])
@pytest.mark.parametrize("src,dst", DIRECTIONS)
def test_twelve_directions_state_primitives_and_bytes(src, dst, T):
    sizes = AttentionSizes(TINY)
    zl = layer_state(TINY)
    contexts = [5, 70, 33, 128, 1, 64, 17]
    owners = round_robin_owners(len(contexts), T)
    m = switch_manifest(sizes, src, dst, contexts, T, page_size=16)
    recv, prim = expected_state(src, dst, owners, T, zl)
    st = m.state
    assert st.primitive == prim
    assert np.asarray(st.recv_bytes) == pytest.approx(recv)
    assert sum(st.send_bytes) == pytest.approx(sum(st.recv_bytes))  # sent == received
    moved = np.zeros(T)
    for mv in m.state_moves():
        assert mv.src != mv.dst
        assert mv.nbytes == pytest.approx((mv.stop - mv.start) * zl / TINY.linear_num_heads)
        moved[mv.dst] += mv.nbytes
    assert moved == pytest.approx(recv)
    freed = np.zeros(T)
    for f in m.state_frees():
        freed[f.rank] += f.nbytes
    assert freed == pytest.approx(st.freed_bytes)
    # what every rank holds after = before + received - freed: the destination's placement exactly
    g_a = np.array([sum(state_fraction(src, r, T, o) for o in owners) for r in range(T)])
    g_b = np.array([sum(state_fraction(dst, r, T, o) for o in owners) for r in range(T)])
    assert g_a * zl + np.asarray(st.recv_bytes) - freed == pytest.approx(g_b * zl)
    # the closed form the policy uses agrees with the set differences
    r_cf, f_cf = state_transfer_requests(src, dst, owners, None, T)
    assert r_cf * zl == pytest.approx(recv) and f_cf * zl == pytest.approx(freed)


@pytest.mark.parametrize("T", [2, 4])
def test_dp_owner_change_moves_states_between_owners(T):
    sizes = AttentionSizes(TINY)
    zl = layer_state(TINY)
    reqs = [Request(10, 0, 1), Request(20, 1, 1), Request(30, T - 1, 0)]
    m = switch_manifest(sizes, Layout.DP, Layout.DP, reqs, T, 16)
    want = np.zeros(T)
    for r in reqs:
        if r.owner_src != r.dst_owner:
            want[r.dst_owner] += zl
    assert m.state.primitive == "all-to-all"
    assert np.asarray(m.state.recv_bytes) == pytest.approx(want)
    assert {(mv.request, mv.src, mv.dst) for mv in m.state_moves()} == {
        (i, r.owner_src, r.dst_owner) for i, r in enumerate(reqs) if r.owner_src != r.dst_owner}
    assert switch_manifest(sizes, Layout.DP, Layout.DP, [5, 6], T).state.primitive == "keep"


@pytest.mark.parametrize("src,dst", DIRECTIONS)
def test_manifest_layers_and_totals_include_the_state(src, dst):
    T = 2
    sizes = AttentionSizes(TINY)
    m = switch_manifest(sizes, src, dst, [40, 90, 3], T, 16)
    assert [lm.kind for lm in m.layers] == [TINY.layer_kind(i) for i in range(TINY.num_hidden_layers)]
    for lm in m.layers:
        for st in (lm.weights, lm.kv) + ((lm.state,) if lm.state else ()):
            assert sum(st.send_bytes) == pytest.approx(sum(st.recv_bytes))
        if lm.kind == "kda":
            assert lm.kv.total_bytes == 0 and lm.state is m.state and lm.weights is m.kda_weights
    total = sum(lm.recv_bytes for lm in m.layers)
    assert m.recv_bytes_per_rank() == pytest.approx(total)
    assert m.in_transit_bytes() == pytest.approx(np.max([lm.recv_bytes for lm in m.layers], axis=0))
    w2, kv2 = switch_layer_bytes(sizes, src, dst, [40, 90, 3], [0, 1, 0], None, T, 16)
    assert (w2 + kv2).sum(axis=0) == pytest.approx(total)


# ---- memory: Eq 1's per-request term, capacity in requests -------------------------------------------------
@pytest.mark.parametrize("T", [2, 4])
def test_footprint_per_request_term(T):
    sizes = AttentionSizes(PRESETS["kimi-linear"])
    B, s = 2 * T, 4096
    for lay in LAYOUTS:
        f = footprint(lay, sizes, [s] * B, None, T, page_size=None)
        g = {"head-sharded": B / T, "owner": B / T, "replicated": B}[state_placement(lay)]
        kv = B * s * sizes.k * (1 if lay is Layout.TP else 1 / T)
        w = sizes.w_a / T if lay.sharded else sizes.w_a
        assert f == pytest.approx(w + kv + g * sizes.z)
        assert balanced_footprint(lay, sizes.w_a, sizes.k, B, s, T, z=sizes.z) == pytest.approx(f.max())
    f = footprint(Layout.DP, sizes, [10, 10, 10], [1, 1, 0], 2)  # unbalanced owners: whole states on owners
    assert f[1] - f[0] == pytest.approx(10 * sizes.k + sizes.z)


@pytest.mark.parametrize("T", [2, 4])
def test_capacity_in_requests_is_bounded_by_state_memory(T):
    sizes = AttentionSizes(PRESETS["kimi-linear"])
    M = 8 * 2**30
    caps = model_capacity(sizes, M, T, fixed=False, context=4096)
    for lay in LAYOUTS:
        free = M - sizes.attention_weight_bytes(lay.sharded, T)
        n = state_slots(lay, sizes, M, T, fixed=False)
        per_rank = sizes.z / T if lay.sharded else sizes.z
        on_rank = n / T if lay is Layout.DP else n  # DP: T owners, each holding whole states
        assert on_rank * per_rank <= free < (on_rank + 1) * per_rank + (per_rank if lay is Layout.DP else 0)
        assert caps[lay].requests == n
        assert requests_at(lay, sizes, M, T, 0, fixed=False) == pytest.approx(n, abs=T)
        assert caps[lay].requests_at_context <= n
        assert model_pool_tokens(lay, sizes, M, T, fixed=False, requests=16) < caps[lay].tokens
    # a state is 1/T of a request per rank when sharded: TP/DOP hold T times the requests CP does
    assert caps[Layout.DOP].requests >= T * caps[Layout.CP].requests


# ---- cost model ---------------------------------------------------------------------------------------
def test_kda_layers_cost_constant_in_context_with_each_layouts_share():
    cfg = PRESETS["kimi-linear"]
    sizes = AttentionSizes(cfg)
    T = 4
    for lay in LAYOUTS:
        short = kda_layer_loads(lay, sizes, Batch.balanced(8, 1024, 1, T), T, 2.0)
        long = kda_layer_loads(lay, sizes, Batch.balanced(8, 65536, 1, T), T, 2.0)
        for f in ("f_proj", "w_read", "f_att", "kv_read", "slices"):
            assert np.array_equal(getattr(short, f), getattr(long, f)), (lay, f)
    whole = kda_layer_loads(Layout.CP, sizes, Batch.balanced(8, 1024, 1, T), T, 2.0)
    tp = kda_layer_loads(Layout.TP, sizes, Batch.balanced(8, 1024, 1, T), T, 2.0)
    dp = kda_layer_loads(Layout.DP, sizes, Batch.balanced(8, 1024, 1, T), T, 2.0)
    dop = kda_layer_loads(Layout.DOP, sizes, Batch.balanced(8, 1024, 1, T), T, 2.0)
    assert tp.f_att == pytest.approx(whole.f_att / T) and dop.f_att == pytest.approx(tp.f_att)
    assert dp.f_att == pytest.approx(whole.f_att / T)  # 2 of 8 rows on each owner, all heads
    assert whole.collectives == 0 and whole.comm_bytes == 0  # CP: redundant, nothing to exchange
    H, d = cfg.linear_num_heads, cfg.linear_head_dim
    assert whole.f_att == pytest.approx([8 * H * 8 * d * d] * T)


def test_hybrid_step_grows_with_context_only_in_its_mla_layers():
    hybrid = AttentionSizes(PRESETS["kimi-linear"])
    pure = AttentionSizes(PRESETS["kimi-linear"].replace(kda_layers=None, name="kimi-mla"))
    T = 4
    th = theta_for("h200", T, hybrid)
    n_mla = len(hybrid.mla_layers)
    for lay in LAYOUTS:
        a, b = Batch.balanced(8, 4096, 1, T), Batch.balanced(8, 32768, 1, T)
        att = [step_cost(lay, m, x, th, 64).t_att for m in (hybrid, pure) for x in (a, b)]
        dh, dp = (att[1] - att[0]) * hybrid.layers, att[3] - att[2]
        assert dh == pytest.approx(n_mla * dp, rel=1e-9)


def test_exposed_switch_time_includes_state_bytes():
    sizes = AttentionSizes(PRESETS["kimi-linear"])
    T = 2
    th = theta_for("h200", T, sizes)
    owners = round_robin_owners(16, T)
    w2, kv2 = switch_layer_bytes(sizes, Layout.TP, Layout.CP, [512] * 16, owners, None, T, 64)
    kda = list(sizes.kda_layers)
    assert kv2[kda] == pytest.approx(16 * sizes.state_layer_bytes * (T - 1) / T)
    xfer = layer_transfer_times(w2, kv2, sizes.layers, th)
    no_state = kv2.copy()
    no_state[kda] = 0
    assert sum(xfer) > sum(layer_transfer_times(w2, no_state, sizes.layers, th))
