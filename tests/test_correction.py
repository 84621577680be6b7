"""The online correction and the regret guard, driven by synthetic step times (no wall clock).

`StepCorrection` (median measured/predicted per layout and kind of step, borrowed across buckets, the
machine-wide scale for an unmeasured layout), the policy pricing with it (an unmeasured layout must
lead by margin + uncertainty), `RegretGuard` (switch back when the destination runs slower than the
source would have, block, no flapping), the whole loop on a synthetic machine whose truth differs from
the prior, `--theta PROFILE` and the Prometheus series.
"""

from __future__ import annotations

import pytest

from splash.core.correction import CorrectionConfig, StepCorrection, StepKey, bucket, bucket_label, describe
from splash.core.costmodel import Batch, step_cost
from splash.core.layouts import Layout
from splash.core.model_config import ConfigError
from splash.core.policy import PolicyConfig, decide
from splash.core.presets import PRESETS
from splash.core.regret import RegretGuard, median_se
from splash.core.sizes import GIB, AttentionSizes
from splash.core.theta import Theta

SIZES = AttentionSizes(PRESETS["tiny"])
DEC1 = StepKey(0)  # decode, one request


def test_buckets_and_keys():
    assert [bucket(b) for b in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 0, 1, 2, 2, 3, 3, 4, 4, 5]
    assert bucket_label(0) == "B=1" and bucket_label(2) == "B=3-4" and bucket_label(4) == "B=9-16"
    assert StepKey.of([1, 1, 0]) == StepKey(1, "decode")  # a request without rows does not count
    assert StepKey.of([5, 1, 1]) == StepKey(2, "prefill") and StepKey.of([5, 1]).label == "prefill B=2"
    for rows in ([1], [1, 1, 1], [3], [1, 7, 1, 1, 1], [1] * 17, [2] * 9):  # a plan's slices: >= 1 row each
        assert StepKey.sized(len(rows), sum(rows)) == StepKey.of(rows), rows


def test_settled_answers_as_measured_does():
    """`settled` (O(1), asked every step) says whether `measured` would answer: min_samples fresh."""
    c = StepCorrection(CorrectionConfig(window=4, min_samples=2, stale_steps=10))
    assert not c.settled("tp", DEC1, 0)
    for step in range(0, 30, 3):
        assert c.settled("tp", DEC1, step) == (c.measured("tp", DEC1, step) is not None), step
        c.observe("tp", DEC1, 0.01, 0.01, step)
        assert c.settled("tp", DEC1, step) == (c.measured("tp", DEC1, step) is not None), step
    assert c.settled("tp", DEC1, 30) and not c.settled("tp", DEC1, 38) and not c.settled("dop", DEC1, 30)


def _clock():
    """A StepFeedback on a synthetic clock (every step 'takes' its price): (feedback, plan maker)."""
    from splash.step.plan import SeqSlice, StepPlan
    from splash.switch.feedback import StepFeedback

    fb = StepFeedback(SIZES, _theta(), None, ("tp", "dop"), 0.05,
                      lambda plan, live: Batch.make([64] * len(plan.seqs), 1, None, ranks=2),
                      config=CorrectionConfig(min_samples=3))
    fb.timer = lambda layout, key, predicted: predicted

    def plan(step: int, b: int = 4):
        return StepPlan(step, "dop", [1] * b, [SeqSlice(i, 63, 1, i % 2, [], True) for i in range(b)])
    return fb, plan


def test_step_clock_samples_a_settled_kind_once_in_stride_and_every_step_under_watch():
    """A kind of step the layout has not measured is sampled every step until it is (a verdict waits
    on it); then once in STRIDE steps; while the guard watches a switch, every step again."""
    from splash.switch.feedback import SAMPLE_GAP, STRIDE

    fb, plan = _clock()

    def run(steps, b, layout="dop"):
        sampled = []
        for step in steps:
            n = fb.correction.steps.get(layout, 0)
            fb.begin(plan(step, b), [], layout, switching=False)
            fb.end()
            if fb.correction.steps.get(layout, 0) > n:
                sampled.append(step)
        return sampled

    def strided(sampled):
        return sampled[:3] == list(range(sampled[0], sampled[0] + 3)) and \
            all(b - a == STRIDE for a, b in zip(sampled[2:], sampled[3:]))
    sampled = run(range(40), 4)
    assert sampled[0] == 0 and strided(sampled), sampled
    assert fb.correction.measured("dop", fb.key(plan(40)), 40).factor == pytest.approx(1.0)
    # A new kind (B=9-16): sampled from the first step its new shape may be priced (SAMPLE_GAP after the
    # last pricing), every step until measured, then once in STRIDE.
    sampled = run(range(40, 70), 9)
    assert sampled[0] <= 40 + SAMPLE_GAP and strided(sampled), sampled
    fb.guard.switched(70, "dop", "tp", voluntary=True)  # under watch: every step is a sample
    assert run(range(71, 75), 9, "tp") == [71, 72, 73, 74]


def test_median_of_recent_ratios_ignores_an_outlier():
    c = StepCorrection(CorrectionConfig(window=9, min_samples=3))
    for i, r in enumerate([1.2, 1.21, 1.19]):
        c.observe("tp", DEC1, 0.010, 0.010 * r, step=i)
    e = c.estimate("tp", DEC1, ["tp", "dop"])
    assert (e.source, e.uncertainty, e.samples) == ("measured", 0.0, 3) and e.factor == pytest.approx(1.2)
    c.observe("tp", DEC1, 0.010, 0.5, step=3)  # one step a neighbour's job stalled: 50x
    assert c.estimate("tp", DEC1, ["tp"]).factor == pytest.approx(1.2, rel=0.01)
    for i in range(4, 20):  # the machine moved: the window forgets the old pace
        c.observe("tp", DEC1, 0.010, 0.008, step=i)
    assert c.estimate("tp", DEC1, ["tp"]).factor == pytest.approx(0.8)
    c.observe("tp", DEC1, 0.0, 0.01, step=21)  # an unpriced step teaches nothing
    assert c.estimate("tp", DEC1, ["tp"]).factor == pytest.approx(0.8)


def test_borrowed_scale_prior_and_staleness():
    cfg = CorrectionConfig(min_samples=2, stale_steps=100, per_bucket=0.05, unmeasured=0.1)
    c = StepCorrection(cfg)
    lays = ["tp", "dop"]
    assert c.estimate("tp", DEC1, lays).source == "prior" and c.estimate("tp", DEC1, lays).factor == 1.0
    c.observe("dop", DEC1, 0.01, 0.02, step=0)
    assert c.estimate("dop", DEC1, lays).source == "prior", "one sample is not yet a measurement"
    c.observe("dop", DEC1, 0.01, 0.02, step=1)
    c.observe("tp", StepKey(0, "prefill"), 0.01, 0.04, step=1)
    c.observe("tp", StepKey(0, "prefill"), 0.01, 0.04, step=2)
    dop, tp = c.estimate("dop", StepKey(2), lays), c.estimate("tp", StepKey(2), lays)
    assert (dop.source, dop.factor, dop.uncertainty) == ("borrowed", pytest.approx(2.0), pytest.approx(0.10))
    # tp ran prefill steps only: on decode it keeps its prior's shape at the machine-wide scale
    assert (tp.source, tp.factor, tp.uncertainty) == ("scale", pytest.approx(2.0), 0.1)
    assert c.observed_s("dop", DEC1, 0.01) == pytest.approx(0.02) and c.observed_s("tp", DEC1, 0.01) is None
    assert c.estimate("dop", DEC1, lays, step=150).source == "prior", "samples 150 steps old are stale"
    s = c.summary()
    assert s["dop"]["ratio"] == pytest.approx(2.0) and s["tp"]["cells"]["prefill B=1"]["samples"] == 2
    assert "dop x2.00" in describe(s) and describe({}) == "no steps measured yet"
    with pytest.raises(ConfigError):
        CorrectionConfig(window=2, min_samples=3)


def test_relative_estimate_carries_a_layouts_difference_not_the_priors_batch_error():
    """The prior is off by a factor that changes with the batch size (0.5 at B=3-4, 0.8 at B=1) for
    every layout; TP ran 20% slower than DOP at B=3-4. At B=1, where only DOP ran, TP is priced 20%
    above DOP's factor there, not at its own B=3-4 factor."""
    c = StepCorrection(CorrectionConfig(min_samples=2, per_bucket=0.05))
    for step in range(2):
        c.observe("dop", StepKey(2), 0.01, 0.005, step)
        c.observe("tp", StepKey(2), 0.01, 0.006, step)
        c.observe("dop", DEC1, 0.01, 0.008, step + 10)
    e = c.estimate("tp", DEC1, ["tp", "dop"])
    assert (e.source, e.factor, e.uncertainty) == ("relative", pytest.approx(0.96), pytest.approx(0.10))
    assert c.own("tp", DEC1).factor == pytest.approx(0.6), "its absolute ratio would say 0.6"
    assert c.measured("tp", DEC1) is None and c.measured("dop", DEC1).factor == pytest.approx(0.8)


def _theta(**kw) -> Theta:
    base = dict(ranks=2, memory_bytes=4 * GIB, flops_proj=1e11, flops_att=1e11, bw_weights=2e9, bw_kv=2e9,
                link_bw=1e9, latency=2e-4, t0=0.013)  # TP leads DOP by ~10% at B=2
    base.update(kw)
    return Theta(**base)


def test_policy_asks_an_unmeasured_layout_for_margin_plus_uncertainty():
    th, batch = _theta(), Batch.balanced(2, 64, 1, 2)
    cfg = PolicyConfig(margin=0.05, min_dwell=0, layouts=(Layout.TP, Layout.DOP), page_size=None)
    plain = decide(SIZES, th, batch, Layout.DOP, 10, cfg)
    lead = 1 - plain.times[Layout.TP] / plain.times[Layout.DOP]
    assert plain.switch and plain.layout is Layout.TP and 0.05 < lead < 0.15, lead  # DOP: 3 collectives
    for u, why in ((lead - 0.02, "< margin"), (0.15, "DOP stays")):  # lead - u < margin either way
        d = decide(SIZES, th, batch, Layout.DOP, 10, cfg, {Layout.DOP: (1.0, 0.0), Layout.TP: (1.0, u)})
        assert not d.switch and "unmeasured" in d.reason and why in d.reason, d.reason
    measured_slow = {Layout.DOP: (1.0, 0.0), Layout.TP: (1.3, 0.0)}
    d = decide(SIZES, th, batch, Layout.DOP, 10, cfg, measured_slow)
    assert not d.switch and d.best is Layout.DOP
    assert d.evals[Layout.TP].time == pytest.approx(1.3 * d.evals[Layout.TP].predicted)
    assert d.to_dict()["layouts"]["TP"]["factor"] == 1.3
    # the current layout's own slowness counts too: measured 1.3x slower, DOP loses to TP's prior
    d = decide(SIZES, th, batch, Layout.DOP, 10, cfg, {Layout.DOP: (1.3, 0.0), Layout.TP: (1.0, 0.1)})
    assert d.switch and d.layout is Layout.TP


def test_guard_switches_back_blocks_and_counts():
    g = RegretGuard(margin=0.05, window=4, settle=1, block_steps=100)
    g.switched(10, "dop", "tp", voluntary=True)
    assert g.observe(11, "tp", 2, 0.02, 0.01) is None, "the settle step is not judged"
    verdicts = [g.observe(12 + i, "tp", 2, 0.012, 0.010) for i in range(4)]
    v = verdicts[-1]
    assert verdicts[:3] == [None] * 3 and v.switch_back and v.regret == pytest.approx(1.2) and v.samples == 4
    assert "slower" in v.reason and g.num_switch_backs == 1 and g.switch_backs == {("tp", "dop"): 1}
    assert g.blocked("tp", 2, 50) and not g.blocked("tp", 1, 50) and not g.blocked("tp", 2, 115)
    assert not g.blocked("dop", 2, 50)
    g.switched(16, "tp", "dop", voluntary=False)  # the switch back itself is not watched
    assert g.probation is None and g.observe(17, "dop", 2, 1.0, 0.001) is None


def test_guard_keeps_a_good_switch_and_ends_on_other_moves():
    g = RegretGuard(margin=0.05, window=3, settle=0, patience=5)
    g.switched(0, "dop", "tp", voluntary=True)
    for i in range(3):
        v = g.observe(1 + i, "tp", 0, 0.0104 if i else 0.02, 0.010)  # a noisy first step, then 4% slower
    assert v is not None and not v.switch_back and g.num_switch_backs == 0 and not g.blocked("tp", 0, 5)
    g.switched(10, "tp", "dp", voluntary=True)
    assert g.observe(11, "tp", 0, 1.0, 0.01) is None and g.probation is None, "layout changed: unjudged"
    g.switched(20, "dp", "tp", voluntary=True)
    out = [g.observe(21 + i, "tp", 0, 1.0, None if i else 0.01) for i in range(5)]  # 1 comparable step
    assert out[-1] is not None and not out[-1].switch_back and "only 1 step(s)" in out[-1].reason
    with pytest.raises(ConfigError):
        RegretGuard(window=4, patience=2)


def _probation(guard: RegretGuard, cycle: list[float], steps: int) -> list:
    """Feed a fresh probation (dop -> tp) `steps` comparable steps whose regrets repeat `cycle`."""
    guard.switched(0, "dop", "tp", voluntary=True)
    return [guard.observe(1 + i, "tp", 2, 0.01 * cycle[i % len(cycle)], 0.01) for i in range(steps)]


def test_guard_switches_back_only_beyond_the_noise_of_its_median():
    """Noisy steps (IQR 0.3 around a median regret of 1.2): at 8 samples 1.2 is within margin + 2
    standard errors, so the probation goes on; with more samples the standard error shrinks and the
    same slowdown is proven. A smaller one (1.1, IQR 0.2) is never proven: the switch is kept."""
    assert median_se([1.0] * 8) == 0.0 and median_se([1.3]) == 0.0 and median_se([]) != median_se([])
    assert median_se([0.6, 1.2, 1.2, 1.8] * 2) == pytest.approx(1.2533 * 0.3 / 1.349 / 8 ** 0.5)
    g = RegretGuard(margin=0.05, window=8, settle=0, z=2.0, max_samples=32, patience=64)
    out = _probation(g, [0.6, 1.2, 1.2, 1.8], 32)
    assert out[:8] == [None] * 8, "1.2 +- 0.12 (2 standard errors) at 8 samples: not yet proven"
    v = next(x for x in out if x is not None)
    assert v.switch_back and 8 < v.samples <= 32 and v.regret == pytest.approx(1.2)
    assert v.regret > 1.05 + 2 * v.se and "standard error" in v.reason and g.blocked("tp", 2, 40)
    g = RegretGuard(margin=0.05, window=8, settle=0, z=2.0, max_samples=32, patience=64)
    out = _probation(g, [0.7, 1.1, 1.1, 1.5], 32)
    v = out[-1]
    assert all(x is None for x in out[:-1]) and v is not None and v.samples == 32
    assert not v.switch_back and v.regret == pytest.approx(1.1) and "within the noise" in v.reason
    assert g.num_switch_backs == 0 and not g.blocked("tp", 2, 40)
    g = RegretGuard(margin=0.05, window=8, settle=0, z=2.0)  # the same tight slowdown: back at once
    out = _probation(g, [1.1], 8)
    assert out[-1] is not None and out[-1].switch_back and out[-1].samples == 8 and out[-1].se == 0.0
    # The source's reference pace is a median of a few steps too: its error (10%) is shared by every
    # regret and does not shrink with more destination steps, so the same tight 1.1 is not proven.
    g = RegretGuard(margin=0.05, window=8, settle=0, z=2.0, max_samples=32)
    g.switched(0, "dop", "tp", voluntary=True)
    out = [g.observe(1 + i, "tp", 2, 0.011, 0.01, counterfactual_se=0.1) for i in range(32)]
    assert out[:31] == [None] * 31 and not out[-1].switch_back and out[-1].se == pytest.approx(0.11)
    g = RegretGuard(margin=0.05, window=8, settle=0, z=0.0, max_samples=8)  # z = 0: the plain threshold
    assert _probation(g, [0.7, 1.1, 1.1, 1.5], 8)[-1].switch_back
    with pytest.raises(ConfigError):
        RegretGuard(z=-1.0)


def _loop(truth, steps: int = 120, unmeasured: float = 0.0):
    """The loop the engine runs at B=2, TP and DOP: decide, run a step, measure (`truth(step, layout)`:
    the machine's time over the prior's), feed the correction and the guard (its probation after a
    switch, its recheck after a switch back). Returns (switches, guard, correction, layout, key)."""
    th, batch = _theta(), Batch.balanced(2, 64, 1, 2)
    cfg = PolicyConfig(margin=0.05, min_dwell=4, layouts=(Layout.TP, Layout.DOP), page_size=None)
    corr = StepCorrection(CorrectionConfig(unmeasured=unmeasured))
    guard = RegretGuard(margin=0.05, window=4, block_steps=1000)
    key, cur, since, path, back = StepKey.of(batch.rows), "dop", 0, [], None
    for step in range(steps):
        est = corr.estimates(["tp", "dop"], key, step)
        layouts = tuple(Layout.parse(lay) for lay in ("tp", "dop")
                        if lay == cur or not guard.blocked(lay, key.bucket, step))
        dwell = 0 if guard.holding else since  # the guard judges first (as the engine does)
        d = decide(SIZES, th, batch, cur, dwell, PolicyConfig(cfg.margin, cfg.min_dwell, layouts, None),
                   {Layout.parse(k): (e.factor, e.uncertainty) for k, e in est.items()})
        dst = back.src if back is not None else (d.layout.label.lower() if d.switch else cur)
        if dst != cur:
            guard.switched(step, cur, dst, voluntary=back is None)
            path.append((step, cur, dst))
            cur, since, back = dst, 0, None
            continue  # the switching step is no sample
        since += 1
        pred = {lay: step_cost(Layout.parse(lay), SIZES, batch, th, None).total for lay in ("tp", "dop")}
        took = pred[cur] * truth(step, cur)
        corr.observe(cur, key, pred[cur], took, step)
        watched = guard.watching()
        ref = corr.measured(watched[1], key, step) if watched and watched[0] == cur else None
        v = guard.observe(step, cur, key.bucket, took, ref.factor * pred[watched[1]] if ref else None)
        back = v if v is not None and v.switch_back else None
    return path, guard, corr, cur, key


def test_loop_on_a_synthetic_machine_switches_back_once_and_stays():
    """The prior says TP is faster at B=2; on this synthetic machine TP truly runs 30% slower than the
    prior says and DOP as predicted. Auto tries TP once, goes back, and never flaps: the recheck finds
    DOP, back again, faster than TP was, so TP stays blocked."""
    path, guard, corr, cur, key = _loop(lambda step, lay: {"tp": 1.3, "dop": 1.0}[lay])
    assert [(a, b) for _, a, b in path] == [("dop", "tp"), ("tp", "dop")], path
    assert guard.num_switch_backs == 1 and cur == "dop"
    assert corr.estimate("tp", key, ["tp", "dop"]).factor == pytest.approx(1.3)
    assert guard.blocked("tp", key.bucket, 100) and not any(v.unblocked for v in guard.verdicts)


def test_loop_rechecks_a_switch_back_that_followed_the_machine_not_the_layout():
    """TP truly runs 20% faster than the prior says (which already has it faster than DOP), but the
    machine slows by 1.6x at the very step auto switches to TP (another tenant), and stays slow. Against
    DOP's pace from before, TP looks slower, so the guard switches back; DOP, back again, runs slower
    than TP did, so the recheck lifts TP's block, and auto returns to TP (now judged against DOP's slow
    pace: kept) and stays there."""
    slow_from: list[int] = []

    def truth(step: int, lay: str) -> float:
        if lay == "tp" and not slow_from:
            slow_from.append(step)
        return (0.8 if lay == "tp" else 1.0) * (1.6 if slow_from else 1.0)

    path, guard, corr, cur, key = _loop(truth, steps=160, unmeasured=0.0)
    assert [(a, b) for _, a, b in path] == [("dop", "tp"), ("tp", "dop"), ("dop", "tp")], path
    assert guard.num_switch_backs == 1 and cur == "tp"
    unblocked = [v for v in guard.verdicts if v.unblocked]
    th, batch = _theta(), Batch.balanced(2, 64, 1, 2)
    p_tp, p_dop = (step_cost(Layout.parse(lay), SIZES, batch, th, None).total for lay in ("tp", "dop"))
    assert len(unblocked) == 1 and unblocked[0].regret == pytest.approx(1.6 * p_dop / (1.6 * 0.8 * p_tp))
    assert "machine" in unblocked[0].reason and not guard.blocked("tp", key.bucket, 150)
    last = guard.verdicts[-1]  # the second try, against DOP's slow pace: TP's true lead, kept
    assert not last.switch_back and last.regret == pytest.approx(0.8 * p_tp / p_dop)


def test_recheck_keeps_the_block_when_the_source_is_faster_and_ends_on_other_moves():
    g = RegretGuard(margin=0.05, window=4, settle=1, block_steps=100)

    def back_then(ratios: list[float]) -> list:
        g.switched(0, "dop", "tp", voluntary=True)
        v = [g.observe(1 + i, "tp", 2, 0.012, 0.010) for i in range(5)][-1]
        assert v.switch_back and g.watching() == ("dop", "tp"), "next: DOP, against TP's pace"
        g.switched(7, "tp", "dop", voluntary=False)  # the switch back keeps its recheck
        assert g.watching() == ("dop", "tp") and g.recheck is not None
        return [g.observe(8 + i, "dop", 2, 0.012 * r, 0.012) for i, r in enumerate([9.9] + ratios)]

    out = back_then([0.8, 0.85, 0.8, 0.9])  # DOP runs faster than TP did: the switch back was right
    assert out == [None] * 5 and g.recheck is None and g.blocked("tp", 2, 50)
    out = back_then([1.0, 1.1, 1.2, 1.1])  # now the machine, not TP: lifted, once per pair
    assert out[-1] is not None and out[-1].unblocked and not out[-1].switch_back
    assert out[-1].to_dict()["unblocked"] and not g.blocked("tp", 2, 50) and ("tp", "dop") in g.rechecked
    g.switched(0, "dop", "tp", voluntary=True)
    [g.observe(1 + i, "tp", 2, 0.012, 0.010) for i in range(5)]
    assert g.recheck is None and g.blocked("tp", 2, 50), "a second switch back of the pair is final"
    g = RegretGuard(margin=0.05, window=4, settle=1, block_steps=100)
    g.switched(0, "dop", "tp", voluntary=True)
    [g.observe(1 + i, "tp", 2, 0.012, 0.010) for i in range(5)]
    g.switched(7, "tp", "dp", voluntary=True)  # anything but the switch back ends the recheck
    assert g.recheck is None and g.watching() == ("dp", "tp")


def test_theta_profile_names(tmp_path, monkeypatch):
    from splash.core.prior import is_profile_name, load_or_default_theta

    cfg = PRESETS["tiny"]
    th, src = load_or_default_theta("h200", 2, cfg, "fp32")
    assert th.source == "profile:h200" and "h200" in src and th.ranks == 2
    th, src = load_or_default_theta("CPU", 2, cfg, "fp32")
    assert th.source == "cpu-measured-default" and "cpu" in src
    assert load_or_default_theta("b200", 4, cfg)[0].source == "profile:b200"
    dcu = load_or_default_theta("dcu", 2, cfg)[0]
    assert dcu.source == "profile:dcu"
    with pytest.raises(ConfigError, match="neither a theta file nor a hardware profile.*h200"):
        load_or_default_theta("h100", 2, cfg)
    monkeypatch.chdir(tmp_path)
    dcu.save(tmp_path / "h200")  # a file of that name wins over the profile
    assert not is_profile_name("h200")
    assert load_or_default_theta("h200", 2, cfg)[0].source == "profile:dcu"


def test_switch_back_and_correction_metrics():
    from splash.server.switch_metrics import SwitchCollector

    col = SwitchCollector("m")
    col.stats = {"switches_total": {"dop->tp": 1, "tp->dop": 1}, "switch_backs_total": {"tp->dop": 1},
                 "theta_correction": {"tp": {"ratio": 1.3, "steps": 9, "cells": {}}}}
    fams = {f.name: f for f in col.collect()}
    backs = fams["splash:switch_backs"].samples
    assert [(s.labels["from"], s.labels["to"], s.value) for s in backs if s.name.endswith("_total")] == \
        [("tp", "dop", 1.0)]
    gauge = fams["splash:step_time_correction"].samples
    assert [(s.labels["layout"], s.value) for s in gauge] == [("tp", 1.3)]


def test_switch_exposed_histogram_counts_as_switches_come():
    """The controller keeps bucket counts (not every switch's time); the Prometheus histogram built
    from them is cumulative per `le` bound, +Inf counting all, with the sum of the times."""
    from splash.server.switch_metrics import SwitchCollector
    from splash.switch.controller import EXPOSED_BUCKETS, ExposedHistogram

    h = ExposedHistogram()
    for t in (0.0004, 0.001, 0.003, 20.0):
        h.add(t)
    col = SwitchCollector("m")
    col.stats = {"switch_exposed_seconds": h.to_dict()}
    fams = {f.name: f for f in col.collect()}
    le = {s.labels["le"]: s.value for s in fams["splash:switch_exposed_seconds"].samples
          if s.name.endswith("_bucket")}
    assert le["0.0005"] == 1 and le["0.001"] == 2 and le["0.0025"] == 2 and le["0.005"] == 3
    assert le[str(EXPOSED_BUCKETS[-1])] == 3 and le["+Inf"] == 4
    total = [s.value for s in fams["splash:switch_exposed_seconds"].samples if s.name.endswith("_sum")]
    assert total == [pytest.approx(20.0044)]
