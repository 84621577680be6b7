"""The prefill-to-decode link in theta and the policy, the 1P1D prefill simulator, `splash simulate pd`."""

import dataclasses
import json

import numpy as np
import pytest

from splash.cli import main
from splash.core.costmodel import Batch, step_cost
from splash.core.hardware import theta_for
from splash.core.layouts import Layout
from splash.core.model_config import ConfigError
from splash.core.pd import Group, plan_pd
from splash.core.pd_cost import PDDest, fit_link, transfer_loads, transfer_seconds, ttft_price
from splash.core.policy import PolicyConfig, decide, evaluate
from splash.core.presets import PRESETS
from splash.core.simulate_pd import PAPER_FIG10, PAPER_ORDER, MixedWorkload, mixed, prefill_run
from splash.core.sizes import AttentionSizes
from splash.core.theta import Theta

V3 = AttentionSizes(PRESETS["deepseek-v3"], "fp8", "bf16")
H200 = theta_for("h200", 8, V3)
TINY = AttentionSizes(PRESETS["tiny"])


def test_theta_link_terms_default_and_round_trip(tmp_path):
    assert H200.pd_link_bw == pytest.approx(50e9 * 0.7) and H200.pd_link_lat == pytest.approx(100e-6)
    path = tmp_path / "theta.json"
    H200.save(path)
    assert Theta.load(path) == H200
    old = {k: v for k, v in H200.to_dict().items() if not k.startswith("pd_")}  # a file from before
    th = Theta.from_dict(old)
    assert th.pd_link_bw is None and th.pd_bw == th.link_bw and th.pd_link_lat == 0.0
    with pytest.raises(ConfigError, match="pd_link_lat"):
        Theta.from_dict({**old, "pd_link_lat": -1})
    with pytest.raises(ConfigError, match="pd_link_bw"):
        Theta.from_dict({**old, "pd_link_bw": 0})


def test_transfer_bytes_are_the_manifests():
    b = Batch.make([5000, 3000, 64], [64, 64, 64], [0, 1, 1], 4)
    dest = PDDest(Layout.TP, 2)
    th = theta_for("h200", 4, V3)
    for lay in (Layout.TP, Layout.DP, Layout.CP, Layout.DOP):
        ld = transfer_loads(V3, lay, 4, b, dest, 64)
        want = sum(plan_pd(V3.cfg, Group(lay, 4, int(o) if lay.owned else 0), Group(Layout.TP, 2), int(s), 64,
                           kv_format=V3.kv_dtype, dtype=V3.dtype).link_bytes
                   for s, o in zip(b.contexts, b.owners))
        assert ld.link_bytes == want == int(ld.recv.sum())
        t = ld.seconds(th)  # the busiest rank-link of either side, latency per transfer it carries
        assert t == pytest.approx(max((ld.send / th.pd_bw + ld.sends * th.pd_link_lat).max(),
                                      (ld.recv / th.pd_bw + ld.recvs * th.pd_link_lat).max()))
        assert ttft_price(V3, th, lay, b, dest, 64) == pytest.approx(step_cost(lay, V3, b, th, 64).total + t)
    # only the finishing requests cross; none finishing costs nothing
    none = transfer_seconds(V3, th, Layout.DP, b, dest, 64, finishing=[False] * 3)
    assert none == 0.0
    # a DP-attention decode receives each request on its owner: the receiving end binds every prefill layout
    bal = Batch.balanced(8, 4096, 64, 4)
    same = {transfer_loads(V3, lay, 4, bal, PDDest(Layout.DP, 4), 64).recv.max() for lay in PAPER_ORDER}
    assert len(same) == 1


def test_link_term_changes_the_choice_where_it_should():
    """4 decoding requests on 8 ranks: DOP steps faster than CP, but a DOP owner sends a request's whole KV
    where CP spreads it over every rank; on a crawling link the policy prefers CP, on a fast one DOP."""
    b = Batch.make([32768] * 4, [1] * 4, [0, 1, 2, 3], 8)
    cfg = PolicyConfig(page_size=64, layouts=(Layout.DOP, Layout.CP))
    dest = PDDest(Layout.TP, 8)
    assert decide(V3, H200, b, None, 0, cfg).layout is Layout.DOP
    slow = dataclasses.replace(H200, pd_link_bw=1e6)
    send = {lay: transfer_loads(V3, lay, 8, b, dest, 64).send.max() for lay in cfg.layouts}
    assert send[Layout.CP] < send[Layout.DOP]
    d = decide(V3, slow, b, None, 0, cfg, pd=dest)
    assert d.layout is Layout.CP and d.evals[Layout.CP].transfer_s < d.evals[Layout.DOP].transfer_s
    fast = dataclasses.replace(H200, pd_link_bw=1e15, pd_link_lat=0.0)
    assert decide(V3, fast, b, None, 0, cfg, pd=dest).layout is Layout.DOP
    # without pd nothing changes: no transfer term, the step time alone
    ev = evaluate(V3, H200, b, None, cfg)
    assert all(e.transfer_s == 0 and e.time == e.cost.total for e in ev.values())


def test_fit_link_recovers_bandwidth_and_latency():
    x = np.array([1e6, 4e6, 16e6, 64e6])
    bw, lat = fit_link(x, 2e-4 + x / 3e10)
    assert bw == pytest.approx(3e10, rel=1e-6) and lat == pytest.approx(2e-4, rel=1e-6)
    with pytest.raises(ConfigError):
        fit_link([1e6, 1e6], [1.0, 2.0])


def test_prefill_run_sends_every_request_once():
    th = theta_for("cpu", 4, TINY)
    dest = PDDest(Layout.DP, 2)
    wl = MixedWorkload.make(5, 0.05, seed=1, inputs=(64, 300, 1000), batches=(1, 3, 6))
    runs = mixed(TINY, th, dest, wl, _cfg(512))
    for name, r in runs.items():
        assert r.ok and np.isfinite(r.ttft_s).all() and (r.ttft_s > 0).all(), name
        assert r.makespan_s == pytest.approx(float((r.ttft_s + wl.arrivals).max()))
        want = sum(plan_pd(TINY.cfg, Group(Layout.TP, 4), Group(Layout.DP, 2, 0), int(s), 16,
                           kv_format=TINY.kv_dtype, dtype=TINY.dtype).link_bytes for s in wl.prompts)
        assert r.link_bytes == want  # each request crosses once, whatever the layout
    assert runs["auto"].switches == len(runs["auto"].timeline) - 1
    # auto with one candidate is that fixed layout
    one = prefill_run(TINY, th, dest, wl.prompts, wl.arrivals, "auto", _cfg(512),
                      PolicyConfig(layouts=(Layout.CP,)))
    fixed = prefill_run(TINY, th, dest, wl.prompts, wl.arrivals, Layout.CP, _cfg(512))
    assert np.allclose(one.ttft_s, fixed.ttft_s)
    tiny_mem = theta_for("cpu", 4, TINY, memory_gib=0.001)
    r = prefill_run(TINY, tiny_mem, dest, wl.prompts, wl.arrivals, Layout.TP, _cfg(512))
    assert not r.ok and "never fits" in r.error


def _cfg(budget: int = 512):
    from splash.core.simulate_pd import PDSimConfig

    return PDSimConfig(token_budget=budget, page_size=16)


def test_paper_labels_are_table_6s_best():
    assert len(PAPER_FIG10) == 29  # the paper's 29 sampled positions; DOP leads at seven of them
    best = [PAPER_ORDER[int(np.argmax(v))] for *_, v in PAPER_FIG10]
    assert best.count(Layout.DOP) == 7
    assert [b.label for b in best[:7]] == ["TP", "DP", "DP", "CP", "CP", "CP", "DOP"]  # B = 16, 1K..256K


def test_simulate_pd_cli(capsys, tmp_path):
    png = tmp_path / "pd.png"
    assert main(["simulate", "pd", "--bursts", "2", "--mean-gap", "1", "--plot", str(png), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    pos = d["positions"]
    assert len(pos) == 29 and d["decode"] == {"layout": "DP", "ranks": 8, "fill": True}
    assert d["agreement"]["agree"] == sum(p["agree"] for p in pos) and d["agreement"]["positions"] == 29
    for p in pos:
        t = {k: v for k, v in p["ttft_s"].items() if v is not None}
        assert p["simulated"] == min(t, key=t.get)
        assert p["paper"] == max(p["paper_throughput_ktok_s"], key=p["paper_throughput_ktok_s"].get)
        assert p["agree"] == (p["simulated"] == p["paper"]) and bool(p["reason"]) != p["agree"]
    m = d["mixed"]
    assert set(m["runs"]) == {"TP", "CP", "DP", "DOP", "auto"} and m["best_fixed"] in m["runs"]
    assert m["mean_ttft_gain"] == pytest.approx(
        m["runs"][m["best_fixed"]]["mean_ttft_s"] / m["runs"]["auto"]["mean_ttft_s"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_request_waits_for_a_transfer_to_free_the_pool():
    """Room for one prompt: the second, arrived while the first's KV is still crossing a slow link, is
    admitted when that transfer ends (the run neither spins nor fails)."""
    from splash.core.simulate import kv_pool_tokens

    th = theta_for("cpu", 2, TINY)
    L = 1000
    spare = kv_pool_tokens(Layout.TP, TINY, th, 512) - 1.5 * L
    th = dataclasses.replace(th, memory_bytes=th.memory_bytes - spare * TINY.k, pd_link_bw=1e5)
    prompts, arrivals = np.array([L, L]), np.array([0.0, 0.01])
    r = prefill_run(TINY, th, PDDest(Layout.DP, 2), prompts, arrivals, Layout.TP, _cfg(512))
    crossing = plan_pd(TINY.cfg, Group(Layout.TP, 2), Group(Layout.DP, 2), L, 16, kv_format=TINY.kv_dtype,
                       dtype=TINY.dtype).link_bytes / 1e5  # one decode owner receives it all
    first_sent = r.ttft_s[0] + arrivals[0]
    assert r.ok and first_sent > crossing > 1.0
    assert r.ttft_s[1] + arrivals[1] >= first_sent + crossing  # prefilled only once the pool was free


def test_auto_on_a_prefill_server_prices_the_transfer_of_the_prompts_that_finish():
    """The engine's `auto` (switch/auto.py, `pd_dest`) hands the policy its decode group and which live
    requests finish their prompt this step; none before the first transfer or off a prefill."""
    from types import SimpleNamespace as NS

    from splash.switch.auto import pd_dest

    def seq(i: int, computed: int, prompt: int) -> NS:
        return NS(seq_id=i, num_computed=computed, prompt_token_ids=[0] * prompt)

    live = [seq(0, 0, 64), seq(1, 32, 64), seq(2, 64, 64)]  # (a new prompt, a chunk to go, decoding)
    rows = {0: 32, 1: 32, 2: 1}
    pd = NS(last_dest=None)
    me = NS(engine=NS(pd=pd, config=NS(disaggregation_mode="prefill")))
    assert pd_dest(me.engine, live, rows) == (None, None)  # (the decode group is not known yet)
    pd.last_dest = ("dp", 2)
    dest, finishing = pd_dest(me.engine, live, rows)
    assert dest == PDDest(Layout.parse("dp"), 2) and finishing == [False, True, False]
    me.engine.config.disaggregation_mode = "null"
    assert pd_dest(me.engine, live, rows) == (None, None)
    # and what it changes: the finishing requests' transfer is in each layout's time, only theirs
    b = Batch.make([32, 64], [32, 32], [0, 1], ranks=2)
    th = theta_for("h200", 2, TINY)
    cfg = PolicyConfig(check_memory=False, page_size=16)
    off = evaluate(TINY, th, b, Layout.parse("tp"), cfg)
    on = evaluate(TINY, th, b, Layout.parse("tp"), cfg, pd=dest, finishing=[False, True])
    none = evaluate(TINY, th, b, Layout.parse("tp"), cfg, pd=dest, finishing=[False, False])
    for lay in off:
        assert on[lay].transfer_s > 0 and on[lay].time == pytest.approx(off[lay].time + on[lay].transfer_s)
        assert none[lay].transfer_s == 0
