"""The shared absorbed-MLA kernel: causal-by-position attention, LSE merge, page gathering, KV pool."""

from __future__ import annotations

import math

import pytest
import torch

from splash.attention.kernel import attend, gather_keys, key_slots, merge
from splash.core.presets import PRESETS
from splash.kv.pool import KVPool

torch.set_num_threads(1)
DT = torch.float64


def _naive(q_lat, q_pe, keys, key_pos, q_pos, scale):
    """Row by row, head by head, straight from the definition."""
    n, h, d_c = q_lat.shape
    out = torch.zeros(n, h, d_c, dtype=DT)
    lse = torch.full((n, h), -math.inf, dtype=DT)
    for i in range(n):
        vis = [j for j in range(keys.shape[0]) if key_pos[j] <= q_pos[i]]
        if not vis:
            continue
        k = keys[vis]
        for hh in range(h):
            s = scale * (k[:, :d_c] @ q_lat[i, hh] + k[:, d_c:] @ q_pe[i, hh])
            lse[i, hh] = torch.logsumexp(s, 0)
            out[i, hh] = torch.softmax(s, 0) @ k[:, :d_c]
    return out, lse


def _case(n=5, h=3, d_c=8, d_r=4, m=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_lat = torch.randn(n, h, d_c, generator=g, dtype=DT)
    q_pe = torch.randn(n, h, d_r, generator=g, dtype=DT)
    keys = torch.randn(m, d_c + d_r, generator=g, dtype=DT)
    return q_lat, q_pe, keys


def test_attend_matches_definition_with_causal_positions_and_empty_rows():
    q_lat, q_pe, keys = _case()
    key_pos = torch.tensor([0, 1, 2, 3, 4, 5, 8, 9, 10, 12, 13])  # a rank's shard: gaps allowed
    q_pos = torch.tensor([-1, 2, 7, 9, 13])  # the first row sees nothing
    out, lse = attend(q_lat, q_pe, keys, key_pos, q_pos, 0.3)
    want_out, want_lse = _naive(q_lat, q_pe, keys, key_pos, q_pos, 0.3)
    assert torch.allclose(out, want_out, rtol=0, atol=1e-13)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert torch.allclose(lse[1:], want_lse[1:], rtol=0, atol=1e-13)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool(torch.all(lse[0] == -math.inf))
    e_out, e_lse = attend(q_lat, q_pe, keys[:0], key_pos[:0], q_pos, 0.3)  # no keys at all
    assert not e_out.any() and bool(torch.all(e_lse == -math.inf))


def test_merge_of_disjoint_shards_is_exact():
    q_lat, q_pe, keys = _case(m=17, seed=1)
    key_pos = torch.arange(17)
    q_pos = torch.tensor([3, 8, 16, 16, 0])
    full, _ = attend(q_lat, q_pe, keys, key_pos, q_pos, 0.2)
    shards = [torch.tensor([j for j in range(17) if (j // 4) % 3 == r]) for r in range(3)]  # CP-like
    parts = [attend(q_lat, q_pe, keys[s], key_pos[s], q_pos, 0.2) for s in shards]
    merged = merge([p[0] for p in parts], [p[1] for p in parts])
    assert torch.allclose(merged, full, rtol=0, atol=1e-13)


def test_key_slots_follow_page_tables():
    P = 4
    pages = torch.tensor([7, -1, 2, 5])  # global page 1 held elsewhere
    slots, pos = key_slots(pages, ctx_len=14, page_size=P)
    assert pos.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13]
    assert slots.tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    layer = torch.arange(8 * P * 3, dtype=DT).view(8, P, 3)
    keys, kpos = gather_keys(layer, pages, 14, P)
    assert torch.equal(kpos, pos) and torch.equal(keys, layer.view(-1, 3)[slots])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_attend_takes_softmax_in_float32(dtype):
    q_lat, q_pe, keys = _case(seed=2)
    pos, q_pos = torch.arange(11), torch.tensor([2, 4, 6, 8, 10])
    out, lse = attend(q_lat.to(dtype), q_pe.to(dtype), keys.to(dtype), pos, q_pos, 0.3)
    want, _ = _naive(q_lat, q_pe, keys, pos, q_pos, 0.3)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert (out.double() - want).abs().max().item() < (0.05 if dtype == torch.bfloat16 else 1e-5)


def test_pool_sizing_and_writes():
    cfg = PRESETS["tiny"]
    per_page = KVPool.bytes_per_page(cfg, 16, torch.float32)
    assert per_page == cfg.num_hidden_layers * 16 * cfg.latent_dim * 4
    pool = KVPool.from_budget(cfg, 10 * per_page + per_page // 2, page_size=16)
    assert pool.num_pages == 10 and pool.num_tokens == 160 and pool.nbytes == 10 * per_page
    rows = torch.randn(3, cfg.latent_dim)
    pool.write(2, torch.tensor([0, 17, 159]), rows)
    assert torch.equal(pool.layer(2)[1, 1], rows[1]) and torch.equal(pool.flat_layer(2)[159], rows[2])
    moved = pool.read_pages(torch.tensor([1]))
    pool.write_pages(torch.tensor([4]), moved)
    assert torch.equal(pool.layer(2)[4, 1], rows[1])
    from splash.core.model_config import ConfigError

    with pytest.raises(ConfigError, match="memory-per-rank"):
        KVPool.from_budget(cfg, per_page - 1, page_size=16)
