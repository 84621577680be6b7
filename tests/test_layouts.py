"""Ownership model: Eq 1 for balanced and unbalanced batches, Table 2, longest balanced context."""

import math

import numpy as np
import pytest

from splash.core.capacity import footprint
from splash.core.layouts import (
    LAYOUTS,
    Layout,
    Ownership,
    Placement,
    balanced_footprint,
    busiest_rank_load,
    kv_pages_per_rank,
    kv_tokens_per_rank,
    longest_balanced_context,
)
from splash.core.model_config import ConfigError
from splash.core.presets import PRESETS
from splash.core.sizes import AttentionSizes


def test_layouts_are_placement_times_ownership():
    table = {(lay.placement, lay.ownership) for lay in LAYOUTS}
    assert len(table) == 4
    assert Layout.TP.placement is Placement.SHARDED and Layout.TP.ownership is Ownership.REPLICATED
    assert Layout.DP.placement is Placement.REPLICATED and Layout.DP.ownership is Ownership.OWNER
    assert Layout.CP.placement is Placement.REPLICATED and Layout.CP.ownership is Ownership.POSITION
    assert Layout.DOP.placement is Placement.SHARDED and Layout.DOP.ownership is Ownership.OWNER


def test_parse():
    assert Layout.parse("DP-attention") is Layout.DP
    assert Layout.parse("dop") is Layout.DOP
    with pytest.raises(ConfigError, match="TP, DP, CP, DOP"):
        Layout.parse("ep")


def _brute_tokens(layout, contexts, owners, T, P):
    """Walk every token position and place it by the layout's rule."""
    out = np.zeros(T, dtype=np.int64)
    for s, o in zip(contexts, owners):
        for pos in range(s):
            if layout is Layout.TP:
                out += 1
            elif layout in (Layout.DP, Layout.DOP):
                out[o] += 1
            else:
                out[(pos // P) % T] += 1
    return out


@pytest.mark.parametrize("seed", range(6))
def test_kv_tokens_and_pages_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    T = int(rng.choice([1, 2, 3, 4, 8]))
    P = int(rng.integers(1, 7))
    B = int(rng.integers(0, 9))
    ctx = rng.integers(0, 70, B)
    own = rng.integers(0, T, B)
    for lay in LAYOUTS:
        assert (kv_tokens_per_rank(lay, ctx, own, T, P) == _brute_tokens(lay, ctx, own, T, P)).all()
        pages = np.zeros(T, dtype=np.int64)
        for s, o in zip(ctx, own):
            for j in range(math.ceil(s / P)):
                if lay is Layout.TP:
                    pages += 1
                elif lay is Layout.CP:
                    pages[j % T] += 1
                else:
                    pages[o] += 1
        assert (kv_pages_per_rank(lay, ctx, own, T, P) == pages).all()


def test_eq1_balanced_is_a_special_case_of_the_general_footprint():
    sizes = AttentionSizes(PRESETS["deepseek-v3"])
    T, B, s = 8, 16, 4096
    for lay in LAYOUTS:
        general = footprint(lay, sizes, [s] * B, None, T, page_size=None)
        expect = balanced_footprint(lay, sizes.w_a, sizes.k, B, s, T)
        assert np.allclose(general, expect)
    # Eq 1 as printed
    assert balanced_footprint(Layout.TP, 100.0, 2.0, 4, 10, 2) == 100 / 2 + 4 * 2 * 10
    assert balanced_footprint(Layout.DOP, 100.0, 2.0, 4, 10, 2) == 100 / 2 + 4 * 2 * 10 / 2
    assert balanced_footprint(Layout.DP, 100.0, 2.0, 4, 10, 2) == 100 + 4 * 2 * 10 / 2
    assert balanced_footprint(Layout.CP, 100.0, 2.0, 4, 10, 2) == 100 + 4 * 2 * 10 / 2


def test_unbalanced_owner_footprint_loads_the_owner():
    sizes = AttentionSizes(PRESETS["tiny"])
    f = footprint(Layout.DOP, sizes, [100, 5, 7], [1, 1, 0], 2)
    assert f[1] - f[0] == pytest.approx((105 - 7) * sizes.k)


@pytest.mark.parametrize("B,T", [(16, 8), (5, 4), (3, 8), (32, 8)])
def test_table2_matches_brute_force_busiest_rank(B, T):
    own = [i % T for i in range(B)]
    s = 1000
    for lay in LAYOUTS:
        row = busiest_rank_load(lay, B, T)
        stored = kv_tokens_per_rank(lay, [s] * B, own, T, page_size=None).max() / s
        assert stored == pytest.approx(row["kv_stored"], rel=1e-3 if lay is Layout.CP else 1e-12)
        assert row["weights"] == (1 / T if lay.sharded else 1.0)
    assert busiest_rank_load(Layout.DP, B, T)["attention"] == math.ceil(B / T)
    assert busiest_rank_load(Layout.TP, B, T)["attention"] == B / T


def test_longest_balanced_context_matches_spec_formulas_and_fits_exactly():
    W, k, B, T, M = 24.0e9, 65536.0, 16, 8, 52.8e9
    assert longest_balanced_context(Layout.DOP, M, W, k, B, T) == pytest.approx((T * M - W) / (B * k))
    assert longest_balanced_context(Layout.DP, M, W, k, B, T) == pytest.approx(T * (M - W) / (B * k))
    assert longest_balanced_context(Layout.CP, M, W, k, B, T) == pytest.approx(T * (M - W) / (B * k))
    assert longest_balanced_context(Layout.TP, M, W, k, B, T) == pytest.approx((M - W / T) / (B * k))
    for lay in LAYOUTS:
        s = longest_balanced_context(lay, M, W, k, B, T)
        assert balanced_footprint(lay, W, k, B, s, T) == pytest.approx(M)
    assert longest_balanced_context(Layout.DP, 1.0, W, k, B, T) == 0.0


def test_bad_inputs():
    with pytest.raises(ConfigError):
        kv_tokens_per_rank(Layout.DP, [1, 2], [0, 5], 2)
    with pytest.raises(ConfigError):
        kv_tokens_per_rank(Layout.DP, [-1], [0], 2)
