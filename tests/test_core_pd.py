"""The prefill-to-decode transfer as a cross-group switch (`splash.core.pd`): every needed block arrives
once, from a rank that holds it, with the bytes the runtime's tensors hold."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
import torch

from splash.cli import main
from splash.core.layouts import LAYOUTS, Layout
from splash.core.model_config import ConfigError
from splash.core.pd import Group, PageMove, StateMove, blind_bytes, local_page, plan_pd
from splash.core.presets import PRESETS
from splash.core.stores import request_stores, state_share

SIZES = [(2, 2), (2, 1), (1, 2), (2, 4), (4, 2)]
PAIRS = list(itertools.product(LAYOUTS, LAYOUTS))
HYBRID = PRESETS["tiny-hybrid"]  # pages (its MLA layer) and KDA state (8 heads)
P, S = 16, 5 * 16 + 3  # 6 pages, the last partly filled


def needed_pages(g: Group, n: int) -> set[tuple[int, int]]:
    """(page, rank) pairs the group holds (`Layout.page_ranks`, apart from the planner's masks)."""
    return {(j, r) for j in range(n) for r in g.layout.page_ranks(j, g.owner, g.ranks)}


def needed_heads(cfg, g: Group) -> set[tuple[str, int, int]]:
    out = set()
    for s in request_stores(cfg):
        for r in range(g.ranks):
            out |= {(s.name, h, r) for h in state_share(s, g.layout, r, g.ranks, g.owner) or ()}
    return out


def heads_of(moves) -> list[tuple[str, int, int, int]]:
    return [(m.store, h, m.src, m.dst) for m in moves for h in range(m.h0, m.h1)]


def check(cfg, src: Group, dst: Group, fill: bool) -> None:
    m = plan_pd(cfg, src, dst, S, P, fill=fill)
    n = -(-S // P)
    assert m.num_pages == n
    have, need = needed_pages(src, n), needed_pages(dst, n)
    # pages: each link move from a holder to a needer; link + fill cover every needed (page, rank) once
    assert all((p.page, p.src) in have and (p.page, p.dst) in need for p in m.pages)
    got = Counter((p.page, p.dst) for p in (*m.pages, *m.fill_pages))
    assert set(got) == need and set(got.values()) == {1}
    linked = {(p.page, p.dst) for p in m.pages}
    assert all((p.page, p.src) in linked and p.src != p.dst for p in m.fill_pages)  # fill copies what arrived
    # state: the same per (store, head)
    s_have, s_need = needed_heads(cfg, src), needed_heads(cfg, dst)
    assert all((st, h, s) in s_have and (st, h, d) in s_need for st, h, s, d in heads_of(m.states))
    got_h = Counter((st, h, d) for st, h, _, d in heads_of((*m.states, *m.fill_states)))
    assert set(got_h) == s_need and set(got_h.values()) <= {1}
    linked_h = {(st, h, d) for st, h, _, d in heads_of(m.states)}
    assert all((st, h, s) in linked_h for st, h, s, _ in heads_of(m.fill_states))
    # bytes: each block once over the link with fill; every needer's copy without
    state_once = sum(m.head_bytes[s.name] * s.head_count for s in request_stores(cfg))
    if fill:
        assert m.link_bytes == n * m.page_bytes + state_once
        assert set(Counter(p.page for p in m.pages).values()) == {1}  # each page over the link once
        assert set(Counter((st, h) for st, h, _, _ in heads_of(m.states)).values()) <= {1}
        assert blind_bytes(cfg, src, dst, S, P) >= m.link_bytes
    else:
        assert not m.fill_pages and not m.fill_states and m.fill_bytes == 0
        assert m.link_bytes == len(need) * m.page_bytes + sum(m.head_bytes[st] for st, _, _ in s_need)
    everything = len(need) * m.page_bytes + sum(m.head_bytes[st] for st, _, _ in s_need)
    assert m.link_bytes + m.fill_bytes == everything  # whatever the route, every needer ends with its copy
    assert sum(m.send) == m.link_bytes and sum(m.recv) == m.link_bytes + m.fill_bytes
    assert sum(m.fill_send) == m.fill_bytes and sum(m.link_recv) == m.link_bytes
    assert m.send == tuple(sum(m.move_bytes(x) for x in (*m.pages, *m.states) if x.src == r)
                           for r in range(src.ranks))


@pytest.mark.parametrize("tp,td", SIZES)
def test_every_needed_block_arrives_once_from_a_holder(tp, td):
    for a, b in PAIRS:
        for fill in (True, False):
            check(HYBRID, Group(a, tp), Group(b, td), fill)
    for a, b in PAIRS:  # owners other than rank 0, and a DSA model's indexer keys with the pages
        check(PRESETS["tiny-dsa"], Group(a, tp, tp - 1), Group(b, td, td - 1), True)


def test_state_moves_are_head_range_intersections():
    m = plan_pd(HYBRID, Group(Layout.TP, 2), Group(Layout.TP, 4), S, P)
    assert [(x.h0, x.h1, x.src, x.dst) for x in m.states if x.store == "kda_state"] == [
        (0, 2, 0, 0), (2, 4, 0, 1), (4, 6, 1, 2), (6, 8, 1, 3)]
    m = plan_pd(HYBRID, Group(Layout.DOP, 4), Group(Layout.TP, 2), S, P)
    assert [(x.h0, x.h1, x.src, x.dst) for x in m.states if x.store == "kda_conv"] == [
        (0, 2, 0, 0), (2, 4, 1, 0), (4, 6, 2, 1), (6, 8, 3, 1)]
    m = plan_pd(HYBRID, Group(Layout.TP, 2), Group(Layout.DP, 2, 1), S, P)  # gathered on the owner
    assert {(x.h0, x.h1, x.src, x.dst) for x in m.states} == {(0, 4, 0, 1), (4, 8, 1, 1)}
    assert not m.fill_states


def test_replicas_spread_and_fill_inside_the_decode_group():
    m = plan_pd(HYBRID, Group(Layout.TP, 2), Group(Layout.CP, 2), 8 * P, P)
    assert [(p.page, p.src, p.dst) for p in m.pages] == [(j, j % 2, j % 2) for j in range(8)]
    # CP's replicated state: each head crosses once, to its head-slice's rank, then filled to the other
    assert {(x.h0, x.h1, x.src, x.dst) for x in m.fill_states} == {(0, 4, 0, 1), (4, 8, 1, 0)}
    assert "fill moves copy" in m.note
    m = plan_pd(HYBRID, Group(Layout.DP, 2), Group(Layout.TP, 4), 8 * P, P)
    assert [p.dst for p in m.pages] == [j % 4 for j in range(8)] and {p.src for p in m.pages} == {0}
    assert len(m.fill_pages) == 8 * 3 and m.fill_bytes == 8 * 3 * m.page_bytes
    off = plan_pd(HYBRID, Group(Layout.DP, 2), Group(Layout.TP, 4), 8 * P, P, fill=False)
    assert off.link_bytes == 4 * 8 * m.page_bytes + m.link_bytes - 8 * m.page_bytes
    assert off.note.startswith("fill off") and "own copy over the link" in off.note
    send = plan_pd(HYBRID, Group(Layout.TP, 2), Group(Layout.DP, 1), 8 * P, P).send
    assert send[0] == send[1] > 0  # the replicas share the sending


def test_blind_baseline():
    n = -(-S // P)
    cfg = PRESETS["tiny"]
    pb = plan_pd(cfg, Group("dp", 1), Group("dp", 1), S, P).page_bytes
    # TP T=2 -> TP T=4: both prefill ranks send every page to all four decode ranks
    assert blind_bytes(cfg, Group("tp", 2), Group("tp", 4), S, P) == 2 * 4 * n * pb
    # CP T=2 -> DP T=1: each rank's own pages, once: the blind transfer is already minimal
    assert blind_bytes(cfg, Group("cp", 2), Group("dp", 1), S, P) == n * pb
    # DP -> CP T=2: the owner sends everything to both decode ranks
    assert blind_bytes(cfg, Group("dp", 2, 1), Group("cp", 2), S, P) == 2 * n * pb


def test_local_page_matches_the_ranks_page_lists():
    for lay in LAYOUTS:
        for T in (1, 2, 4):
            lists: dict[int, list[int]] = {}
            for j in range(13):
                for r in lay.page_ranks(j, 0, T):
                    lists.setdefault(r, []).append(j)
            for pages in lists.values():
                assert [local_page(lay, T, j) for j in pages] == list(range(len(pages)))
    with pytest.raises(ConfigError):
        local_page(Layout.CP, 2, -1)


def test_bad_groups_are_refused():
    with pytest.raises(ConfigError, match="owner rank 2"):
        Group(Layout.DP, 2, 2)
    with pytest.raises(ConfigError, match="cannot be split evenly"):
        plan_pd(HYBRID, Group(Layout.TP, 3), Group(Layout.DP, 1), S, P)
    with pytest.raises(ConfigError, match="page size"):
        plan_pd(HYBRID, Group(Layout.TP, 2), Group(Layout.DP, 1), S, 0)


# ---- bytes: the runtime's tensors --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny", "tiny-dsa", "tiny-hybrid"])
@pytest.mark.parametrize("fmt", ["float64", "fp8_ds_mla"])
@pytest.mark.parametrize("mtp", [False, True])
def test_bytes_equal_the_runtime_pools(name, fmt, mtp):
    from splash.disagg.transfer import KVTransfer
    from splash.kv.pool import KVPool
    from splash.kv.state import StatePool

    cfg = PRESETS[name]
    if mtp:
        cfg = cfg.replace(num_nextn_predict_layers=1).with_draft(True)
    pool = KVPool.for_model(cfg, 3, P, torch.float64, kv_cache_dtype=fmt)
    state = StatePool.for_model(cfg, 2, torch.float64)
    m = plan_pd(cfg, Group("dp", 1), Group("dp", 1), S, P, kv_format=fmt, dtype="float64")
    assert m.page_bytes == sum(t[:, 0].numel() * t.element_size() for t in pool.tensors())
    if state is None:
        assert m.head_bytes == {}
    else:
        per_slot = {"kda_state": 0, "kda_conv": 0}
        for i in state.layers:
            rec, conv = state.layer(i)
            per_slot["kda_state"] += rec[0].numel() * rec.element_size()
            per_slot["kda_conv"] += conv[0].numel() * conv.element_size()
        assert {k: v * cfg.linear_num_heads for k, v in m.head_bytes.items()} == per_slot
    # the runtime's count of a request's transfer (KVTransfer.request_bytes) is the manifest's
    xfer = object.__new__(KVTransfer)
    xfer.pool, xfer.state = pool, state
    assert xfer.request_bytes(m.num_pages, state is not None) == m.link_bytes


def test_bf16_state_dtypes():
    from splash.kv.state import StatePool

    state = StatePool.for_model(HYBRID, 1, torch.bfloat16)
    m = plan_pd(HYBRID, Group("dp", 1), Group("dp", 1), S, P, dtype="bf16")
    rec, conv = state.layer(state.layers[0])
    L, H = len(state.layers), HYBRID.linear_num_heads
    assert m.head_bytes == {"kda_state": L * rec[0].numel() * rec.element_size() // H,  # float32
                            "kda_conv": L * conv[0].numel() * conv.element_size() // H}  # bf16


# ---- the command ------------------------------------------------------------------------------------------
def test_plan_pd_json(capsys):
    argv = ["plan", "pd", "--model", "tiny-hybrid", "--prefill-layout", "tp", "--prefill-tp", "2",
            "--decode-layout", "cp", "--decode-tp", "4", "--context", str(S), "--page-size", str(P),
            "--dtype", "float64", "--json", "--moves"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    m = plan_pd(HYBRID, Group("tp", 2), Group("cp", 4), S, P, dtype="float64")
    assert d["link_bytes"] == m.link_bytes and d["fill_bytes"] == m.fill_bytes > 0
    assert d["send"] == list(m.send) and d["recv"] == list(m.recv)
    assert d["blind_bytes"] == blind_bytes(HYBRID, Group("tp", 2), Group("cp", 4), S, P, dtype="float64")
    assert d["blind_ratio"] == pytest.approx(d["blind_bytes"] / d["link_bytes"])
    assert [PageMove(*x) for x in d["moves"]["pages"]] == list(m.pages)
    assert [StateMove(*x) for x in d["moves"]["fill_states"]] == list(m.fill_states)
    assert main(argv[:-2] + ["--no-fill", "--json"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["fill_bytes"] == 0 and off["link_bytes"] == d["link_bytes"] + d["fill_bytes"]
    assert main(argv[:-2]) == 0  # the table
    out = capsys.readouterr().out
    assert "prefill 1" in out and "decode 3" in out and "layout-blind" in out
    assert main(["plan", "pd", "--model", "deepseek-v3.2", "--kv-cache-dtype", "fp8", "--context", "1000",
                 "--json"]) == 0
    v32 = json.loads(capsys.readouterr().out)
    assert v32["page_bytes"] == 788 * 61 * 64 and v32["pages"] == 16  # the paper's page size by default


def test_registration_starts_over_when_mooncake_holds_an_overlapping_region():
    """A pool reallocated by a switch can land on memory Mooncake still holds (code -7, overlapped): the
    refresh unregisters everything and registers the pools afresh once, rather than failing the
    requests; a second failure is an error naming the code."""
    from splash.disagg.transfer import KVTransfer, TransferError

    class Engine:
        def __init__(self, refuse: int) -> None:
            self.held: dict[int, int] = {}
            self.refuse = refuse  # overlapped answers still to give

        def register_memory(self, addr: int, n: int) -> int:
            if self.refuse and addr not in self.held:
                self.refuse -= 1
                return -7
            self.held[addr] = n
            return 0

        def unregister_memory(self, addr: int) -> int:
            return 0 if self.held.pop(addr, None) is not None else -3

    a, b = torch.zeros(64), torch.zeros(32)
    xfer = object.__new__(KVTransfer)
    xfer.engine, xfer._registered = Engine(refuse=1), {a.data_ptr(): 256}
    xfer.engine.held[a.data_ptr()] = 256
    xfer._tensors = lambda: ([a, b], ["latent", "index_k"], [], [])
    xfer.refresh()
    assert xfer._registered == xfer.engine.held == {a.data_ptr(): 256, b.data_ptr(): 128}
    xfer.engine.refuse, xfer._registered = 5, {}
    xfer.engine.held.clear()
    with pytest.raises(TransferError, match="code -7"):
        xfer.refresh()
