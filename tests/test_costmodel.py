"""Cost model: theta JSON, Eq 10 loads per layout, Eq 7, and the illustrative law's crossovers."""

import json

import numpy as np
import pytest

from splash.core.costmodel import Batch, step_cost, step_costs
from splash.core.hardware import PROFILES, theta_for
from splash.core.law import alpha, crossovers, fastest, latency, tau
from splash.core.layouts import LAYOUTS, Layout
from splash.core.model_config import ConfigError
from splash.core.presets import PRESETS
from splash.core.sizes import AttentionSizes
from splash.core.switch_time import exposed_switch_time, switch_time
from splash.core.theta import Theta


def _theta(**kw):
    base = dict(ranks=4, memory_bytes=8e9, flops_proj=1e12, flops_att=1e12, bw_weights=1e11, bw_kv=1e11,
                link_bw=1e10, latency=1e-5)
    base.update(kw)
    return Theta(**base)


def test_theta_json_round_trip(tmp_path):
    th = _theta(eta={"dop": 0.25}, t0=1e-3)
    path = tmp_path / "theta.json"
    th.save(path)
    back = Theta.load(path)
    assert back == th and back.eta["DOP"] == 0.25 and back.eta["CP"] == 0.5
    d = json.loads(path.read_text())
    d["bogus"] = 1
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="unknown field"):
        Theta.load(path)
    path.write_text("not json")
    with pytest.raises(ConfigError, match="not a theta JSON"):
        Theta.load(path)
    with pytest.raises(ConfigError, match="no theta file"):
        Theta.load(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="link_bw"):
        _theta(link_bw=0)
    with pytest.raises(ConfigError, match="eta"):
        _theta(eta={"TP": 2})


def test_exposed_switch_time_eq7():
    assert exposed_switch_time([], []) == 0
    assert exposed_switch_time([3.0], []) == 3.0
    # layer 1 fully exposed; later layers hide behind the previous layer's compute
    assert exposed_switch_time([2, 2, 5, 1], [3, 3, 3, 3]) == pytest.approx(2 + 0 + 2 + 0)
    with pytest.raises(ConfigError):
        exposed_switch_time([1, 1, 1], [1])


def test_switch_time_blocking_vs_overlapped():
    sizes = AttentionSizes(PRESETS["tiny"])
    th = _theta()
    cost = step_cost(Layout.DP, sizes, Batch.balanced(4, 64, 1, 4), th)
    w = np.array([1e6] * 4)
    exposed, blocking = switch_time(w, np.zeros(4), cost, th)
    per_layer = 1e6 / th.link_bw + th.latency
    assert blocking == pytest.approx(per_layer * sizes.layers)
    assert exposed == pytest.approx(per_layer + (sizes.layers - 1) * max(0, per_layer - cost.per_layer))
    assert switch_time(np.zeros(4), np.zeros(4), cost, th) == (0.0, 0.0)


def test_eq10_loads_follow_the_ownership_model():
    sizes = AttentionSizes(PRESETS["deepseek-v3"])
    th = _theta(ranks=8, bw_kv=1e9, flops_att=1e20, flops_proj=1e20, bw_weights=1e20, link_bw=1e20, latency=0)
    s = 10_000
    batch = Batch.balanced(16, s, 1, 8)
    c = step_costs(sizes, batch, th)
    kv = sizes.kv_token_layer * s / th.bw_kv  # one history read
    # KV-read bound: TP reads all B histories, DP/DOP ceil(B/T), CP B/T (Table 2's KV-read column)
    assert c[Layout.TP].t_att == pytest.approx(16 * kv)
    assert c[Layout.DP].t_att == pytest.approx(2 * kv)
    assert c[Layout.DOP].t_att == pytest.approx(2 * kv)
    assert c[Layout.CP].t_att == pytest.approx(2 * kv, rel=1e-3)
    # weight-read bound: sharded layouts read W/T
    th2 = _theta(ranks=8, bw_weights=1e9, flops_proj=1e20, flops_att=1e20, bw_kv=1e20, link_bw=1e20)
    c2 = step_costs(sizes, batch, th2)
    assert c2[Layout.DP].t_proj == pytest.approx(sizes.w_layer / 1e9)
    assert c2[Layout.TP].t_proj == pytest.approx(sizes.w_layer / 8 / 1e9)


def test_eq10_structure_and_single_rank():
    sizes = AttentionSizes(PRESETS["tiny"])
    th = _theta(ranks=1, t0=0.5)
    c = step_costs(sizes, Batch.balanced(3, 100, 1, 1), th)
    for lay in LAYOUTS:
        assert c[lay].comm == 0 and c[lay].delta == 0
        assert c[lay].total == pytest.approx(0.5 + sizes.layers * (c[lay].t_proj + c[lay].t_att))
    th4 = _theta(eta={"CP": 1.0})
    cp = step_cost(Layout.CP, sizes, Batch.balanced(4, 100, 1, 4), th4)
    assert cp.exposed_comm == pytest.approx(max(0.0, cp.comm - cp.t_att))
    assert cp.per_layer == pytest.approx(cp.t_proj + cp.t_att + cp.delta + cp.exposed_comm)


def test_dop_exchange_tracks_rows_not_context():
    sizes = AttentionSizes(PRESETS["deepseek-v3"])
    th = _theta(ranks=8)
    short = step_cost(Layout.DOP, sizes, Batch.balanced(8, 1000, 1, 8), th)
    long = step_cost(Layout.DOP, sizes, Batch.balanced(8, 100_000, 1, 8), th)
    assert short.comm == long.comm
    more_rows = step_cost(Layout.DOP, sizes, Batch.balanced(8, 1000, 4, 8), th)
    assert more_rows.comm == pytest.approx(4 * short.comm)


def test_dop_exchange_is_charged_per_rank():
    """Eq 10's R is what one rank's link carries: Eq 4's group total summed over the ranks' receives,
    the busiest rank's share priced (1/T of it when rows are balanced, more for a rank owning more)."""
    from splash.core.costmodel import eq4_bytes, eq4_rank_bytes

    c = PRESETS["deepseek-v3"]
    H, d_c, d_r, T, b = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim, 8, 2
    for rows_r in ([4] * 8, [7, 1, 0, 0, 3, 5, 2, 6]):
        n = sum(rows_r)
        each = [eq4_rank_bytes(np.array([x]), n, H, d_c, d_r, T, b) for x in rows_r]
        assert sum(each) == pytest.approx(eq4_bytes(n, H, d_c, d_r, T, b))
        assert eq4_rank_bytes(np.array(rows_r), n, H, d_c, d_r, T, b) == pytest.approx(max(each))
    assert eq4_rank_bytes(np.array([4] * 8), 32, H, d_c, d_r, T, b) == pytest.approx(
        eq4_bytes(32, H, d_c, d_r, T, b) / T)
    # and the step's R: DOP's exchange at 1/T of the total beside TP's all-reduce
    sizes = AttentionSizes(c)
    th = _theta(ranks=T)
    batch = Batch.balanced(T, 1000, 4, T)
    dop, tp = step_cost(Layout.DOP, sizes, batch, th), step_cost(Layout.TP, sizes, batch, th)
    r = dop.comm * th.link_bw_of(Layout.DOP) - tp.comm * th.link_bw_of(Layout.TP)  # (bytes, one layer)
    assert r == pytest.approx(eq4_bytes(batch.n_rows, H, d_c, d_r, T, th.act_bytes) / T, rel=1e-6)


def test_batch_validation():
    with pytest.raises(ConfigError):
        Batch.make([5], [6])
    with pytest.raises(ConfigError):
        Batch.make([5, 6], None, [0, 3], ranks=2)
    with pytest.raises(ConfigError):
        Batch.make([5], 1, None, 1, reserved=[4])


def test_illustrative_law_values():
    assert float(tau(Layout.TP, 1)) == pytest.approx(0.40 + 0.25 + 0.15 - 0.0625)
    a = 0.05 * 10 + 1.2 * 10 / 18
    assert float(tau(Layout.DOP, 10)) == pytest.approx(0.45 + a + max(0, 4.8 - 0.35 * a))
    assert float(tau(Layout.CP, 200)) == pytest.approx(2.55 + 10)
    for sc in ("dcu", "h200", "b200"):
        assert float(latency(Layout.TP, 1024, sc)) == pytest.approx(1.0)
    assert alpha("dcu") == 1.0
    with pytest.raises(ConfigError):
        alpha("tpu")


@pytest.mark.parametrize("scenario,expect", [
    ("b200", [18.1, 123.0, 253.4]), ("h200", [8.8, 59.8, 123.3]), ("dcu", [14.1, 95.7, 197.1])])
def test_crossovers_reproduce_the_papers_circles(scenario, expect):
    cs = crossovers(scenario)
    assert [c.at_k for c in cs] == expect
    pairs = [(Layout.TP, Layout.DP), (Layout.DP, Layout.CP), (Layout.CP, Layout.DOP)]
    assert [(c.src, c.dst) for c in cs] == pairs
    for c in cs:  # a true root: both layouts equally fast there
        a, b = latency(c.src, c.tokens, scenario), latency(c.dst, c.tokens, scenario)
        assert float(a) == pytest.approx(float(b))


def test_capacity_limits_mask_the_fastest_layout():
    lim = {Layout.TP: 5 * 1024.0, Layout.DP: 1e9, Layout.CP: 1e9, Layout.DOP: 1e9}
    cs = crossovers("dcu", limits=lim)
    assert cs[0].cause == "capacity" and cs[0].tokens == 5 * 1024 and cs[0].dst is Layout.DP
    none = fastest(np.array([1e10]), "dcu", lim)
    assert none[0] == -1


def test_profiles_give_valid_theta():
    sizes = AttentionSizes(PRESETS["deepseek-v3"], "fp8")
    for name in PROFILES:
        th = theta_for(name, 8, sizes)
        assert th.ranks == 8 and th.memory_bytes > 0 and th.t_experts > 0
    with pytest.raises(ConfigError, match="unknown hardware"):
        theta_for("tpu", 8)
