"""The speculation-depth policy (splash/core/spec_depth.py, DepthPolicy in splash/engine/spec.py).

Pricing: seconds per emitted token at depth k is the verify step's Eq-10 time over the expected tokens
of the geometric acceptance model; a step bound by reading weights (a narrow tail) prefers depth K, a
step bound by per-row work (a wide batch) depth 0. The runtime policy learns acceptance per request and
measured/predicted step times per (batch bucket, depth), explores a depth the prior misjudges, and keeps
the layout policy's margin and dwell. An engine with `--speculative-policy auto` turns speculation off
when the measured steps say it loses.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from splash.core.layouts import Layout
from splash.core.presets import PRESETS
from splash.core.prior import default_theta
from splash.core.sizes import AttentionSizes
from splash.core.spec_depth import (
    DepthConfig,
    acceptance_rate,
    choose_depth,
    expected_tokens,
    price_depths,
    prices,
)
from splash.engine.spec import DepthPolicy

CFG = PRESETS["small"]
SIZES = AttentionSizes(CFG, "fp32", "fp32")


def theta(**kw):
    th = default_theta(1, SIZES, "cpu")
    return dataclasses.replace(th, **kw)


def test_expected_tokens_and_acceptance():
    assert expected_tokens(0.5, 0) == 1 and expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(1.0, 4) == 5
    assert acceptance_rate(0, 0, 0.4) == pytest.approx(0.4)  # no data: the prior
    assert acceptance_rate(30, 10, 0.4) == pytest.approx(31.6 / 44)  # data outweighs it


def test_weight_bound_steps_speculate_and_row_bound_steps_do_not():
    cfg = DepthConfig(3)
    # reading weights dominates (a big per-step cost, rows nearly free): depth K at good acceptance
    heavy = theta(t0=0.05, t_experts=0.05, t_row=1e-6)
    p = price_depths(SIZES, heavy, Layout("tp"), [300], [0.7], cfg)
    assert min(p, key=p.get) == 3 and p[3] < 0.6 * p[0]
    # every row costs as much as the step's fixed part: speculation only adds rows
    rows = theta(t0=1e-4, t_experts=1e-4, expert_frac=1.0, t_row=0.01)
    p = price_depths(SIZES, rows, Layout("tp"), [300] * 64, [0.7] * 64, cfg)
    assert min(p, key=p.get) == 0
    # no acceptance, no gain, whatever the step
    p = price_depths(SIZES, heavy, Layout("tp"), [300], [0.0], cfg)
    assert min(p, key=p.get) == 0
    # an MTP chain costs a layer's share per draft: pricier than free n-gram drafts
    mtp = price_depths(SIZES, heavy, Layout("tp"), [300], [0.7], dataclasses.replace(cfg, draft_layers=1))
    assert mtp[3] > price_depths(SIZES, heavy, Layout("tp"), [300], [0.7], cfg)[3]


def test_margin_and_dwell():
    cfg = DepthConfig(3, margin=0.1, min_dwell=4)
    prices = {0: 1.0, 1: 0.95, 2: 0.85, 3: 0.9}
    assert choose_depth(prices, 0, 10, cfg) == 2  # 15% cheaper: beyond the margin
    assert choose_depth(prices, 0, 2, cfg) == 0  # not yet dwelt long enough
    assert choose_depth({0: 1.0, 1: 0.95}, 0, 10, cfg) == 0  # inside the margin


def seqs(n: int, accepted: int = 0, rejected: int = 0, ctx: int = 300):
    return [SimpleNamespace(num_computed=ctx, recent_accepted=accepted, recent_rejected=rejected)
            for _ in range(n)]


def test_policy_learns_the_step_times_and_acceptance():
    """A prior that thinks verify rows are free meets steps where they are not (wide batch) and
    steps where they are (one request): the measured ratios turn depth 3 off at 64 and keep it at 1."""
    th = theta(t0=0.02, t_experts=0.02, t_row=1e-6)
    pol = DepthPolicy(SIZES, th, DepthConfig(3, margin=0.05, min_dwell=2))
    wide, narrow = seqs(64, accepted=60, rejected=40), seqs(1, accepted=60, rejected=40)
    assert pol.decide(wide, 0, "tp") == 3  # the prior: depth 3 at ~0.6 acceptance
    # what the machine really takes: wide steps 10 ms + 2 ms per row (row-bound), narrow 50 ms + 2 ms
    for _ in range(48):
        k = pol.decide(wide, 0, "tp")
        pol.observe([300 + k + 1] * 64, [k + 1] * 64, 0.01 + 0.002 * 64 * (k + 1), "tp")
    assert pol.k == 0 and pol.changes >= 1
    for _ in range(48):
        k = pol.decide(narrow, 0, "tp")
        pol.observe([300 + k + 1], [k + 1], 0.05 + 0.002 * (k + 1), "tp")
    assert pol.k == 3
    # requests that never accept: off even in the narrow tail
    for _ in range(24):
        pol.decide(seqs(1, accepted=0, rejected=50), 0, "tp")
    assert pol.k == 0


def test_engine_turns_speculation_off_when_it_loses():
    """A real engine (tiny) whose drafts never match: the proposer offers, at every step, tokens that
    differ from the greedy text (known from a run without speculation), so acceptance is 0 whatever the
    timings, and the policy turns the depth to 0 and keeps it there but for a retry. (The tiny model's
    own greedy text repeats, so real n-gram drafts are accepted a quarter of the time: not a losing case
    on every machine.)"""
    from splash.engine.build import build_engine
    from splash.engine.sampling import SamplingParams

    prompt = list(range(3, 120))
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = build_engine(model="tiny", dtype="float32", num_kv_pages=64, device="cpu")
    try:
        plain.add_request("0", prompt_token_ids=prompt, params=params)
        greedy = None
        while plain.has_unfinished():
            for o in plain.step():
                greedy = o.outputs[0].token_ids if o.finished else greedy
    finally:
        plain.shutdown()
    eng = build_engine(model="tiny", dtype="float32", num_kv_pages=64, speculative_algorithm="NGRAM",
                       speculative_num_draft_tokens=4, min_dwell_steps=2, device="cpu")
    try:
        assert eng.depth is not None and eng.depth.k == 3
        vocab = eng.vocab_size

        def wrong(seq, room):  # the next greedy token + 1: the first draft is always rejected
            n = len(seq.output_token_ids)
            cap = min(eng._draft_room(seq), room, len(greedy) - n)
            return [(greedy[n] + 1) % vocab] * cap if cap > 0 else []

        eng.scheduler.proposer = wrong
        eng.add_request("0", prompt_token_ids=prompt, params=params)
        out = None
        depths = []
        while eng.has_unfinished():
            for o in eng.step():
                out = o.outputs[0].token_ids if o.finished else out
            depths.append(eng.depth.k)
        stats = eng.stats()
    finally:
        eng.shutdown()
    assert out == greedy  # (drafts never change a token)
    assert stats["speculative_policy"] == "auto"
    assert stats["spec_accepted_tokens"] == 0 < stats["spec_draft_tokens"]
    assert stats["spec_depth_changes"] >= 1 and 0 in depths
    after = depths[depths.index(0):]  # off, bar a retry once the rejections have faded (DepthPolicy.FADE)
    assert sum(k == 0 for k in after) >= 0.75 * len(after), depths


def test_speculation_must_beat_depth_zero_by_the_gain():
    """A depth that merely ties with no speculation is left (after the dwell), even inside the margin."""
    cfg = DepthConfig(3, margin=0.05, min_dwell=2, gain=0.1)
    assert choose_depth({0: 1.0, 1: 0.97, 2: 0.95, 3: 0.93}, 3, 10, cfg) == 0
    assert choose_depth({0: 1.0, 1: 0.97, 2: 0.95, 3: 0.93}, 3, 1, cfg) == 3  # (the dwell first)
    assert choose_depth({0: 1.0, 1: 0.97, 2: 0.95, 3: 0.8}, 0, 10, cfg) == 3


def test_acceptance_follows_the_recent_verifies():
    """A request drafted badly at first and well after: its estimate follows its last verifies, and the
    engine-wide rate a new request starts from forgets a warm-up's rejections."""
    pol = DepthPolicy(SIZES, theta(), DepthConfig(3))
    rec = SimpleNamespace(spec_rejected=0, recent_accepted=0.0, recent_rejected=0.0)
    for _ in range(10):
        pol.verified(rec, 3, 0)
    early = acceptance_rate(rec.recent_accepted, rec.recent_rejected, pol.prior)
    for _ in range(15):
        pol.verified(rec, 3, 3)
    late = acceptance_rate(rec.recent_accepted, rec.recent_rejected, pol.prior)
    assert early < 0.2 and late > 0.85 and rec.spec_rejected == 10  # (lifetime: 45 / 55, 0.82)
    for _ in range(100):
        pol.verified(SimpleNamespace(spec_rejected=0, recent_accepted=0.0, recent_rejected=0.0), 3, 3)
    assert pol.rejected < 2  # the first ten rejections weigh 0.98^100 each


def test_own_step_times_price_the_depths_whatever_theta_says():
    """The prior thinks a row nearly free; the machine's steps cost 1 ms + 0.5 ms a row (row-bound at 64
    requests). Once a bucket has steps at two depths its line prices it (and the nearest depth with other
    rows is run to get one), depth 0 is probed, and the policy settles at 0: its own times decide."""
    th = theta(t0=0.02, t_experts=0.02, t_row=1e-7)
    pol = DepthPolicy(SIZES, th, DepthConfig(3, margin=0.05, min_dwell=2))
    wide = seqs(64, accepted=8, rejected=2)
    run = []
    for _ in range(80):
        k = pol.decide(wide, 0, "tp")
        run.append(k)
        pol.observe([300 + k + 1] * 64, [k + 1] * 64, 0.001 + 0.0005 * 64 * (k + 1), "tp")
    fixed, per_row = pol.line(6)
    assert fixed == pytest.approx(0.001, rel=1e-6) and per_row == pytest.approx(0.0005, rel=1e-6)
    assert 0 in run[:40] and set(run[-20:]) == {0}


def test_a_mixed_step_is_priced_as_the_batch_it_builds():
    """Four requests decode while sixty prefill: their verify rows would take the place of prefill rows of
    a batch that decodes at depth 0, so the depth is the wide batch's, not the four's."""
    th = theta(t0=0.02, t_experts=0.02, t_row=1e-6)
    pol = DepthPolicy(SIZES, th, DepthConfig(3, margin=0.05, min_dwell=2))
    for B in (4, 64):  # the machine: 20 ms + 1 ms a row
        for k in (0, 3):
            for _ in range(3):
                pol.observe([300 + k + 1] * B, [k + 1] * B, 0.02 + 0.001 * B * (k + 1), "tp")
    few = seqs(4, accepted=8, rejected=2)
    assert [pol.decide(few, 0, "tp") for _ in range(12)][-1] == 3
    assert [pol.decide(few, 60, "tp") for _ in range(12)][-1] == 0


def test_no_probe_where_no_depth_could_pay():
    """At a batch acceptance where even free drafts could not beat depth 0 by the gain, no depth is
    worth running to learn its step time; above it, it is."""
    from splash.core.spec_depth import could_pay

    assert not could_pay([0.0, 0.05], 3, 0.1)  # 1 + a + a^2 + a^3 <= 1.06 < 1 / 0.9
    assert could_pay([0.3, 0.2], 3, 0.1)
    assert not could_pay([], 3, 0.1)


def test_a_new_bucket_is_priced_by_the_line_of_the_others():
    """Steps of 16 requests at depths 0 and 3 (16 and 64 rows) on a machine where a row costs 0.5 ms: a
    first batch of 64 is priced off that pooled line (row-bound: depth 0) rather than by a prior that
    thinks rows nearly free (depth 3)."""
    th = theta(t0=0.02, t_experts=0.02, t_row=1e-7)
    wide = seqs(64, accepted=8, rejected=2)
    pol = DepthPolicy(SIZES, th, DepthConfig(3, margin=0.05, min_dwell=2))
    acc = [acceptance_rate(8, 2, pol.prior)] * 64
    by_prior = prices(pol._times("tp", 64, 300), acc)
    assert min(by_prior, key=by_prior.get) > 0  # the prior alone would speculate
    for k in (0, 3):
        for _ in range(3):
            pol.observe([300 + k + 1] * 16, [k + 1] * 16, 0.001 + 0.0005 * 16 * (k + 1), "tp")
    assert pol.line(None) == pytest.approx((0.001, 0.0005), rel=1e-6)
    assert pol.measured_times(6, 64) is None  # (no line of its own yet)
    assert [pol.decide(wide, 0, "tp") for _ in range(12)][-1] == 0


def test_a_depth_turned_off_by_early_rejections_is_tried_again():
    """One request whose first verifies were all rejected (a prompt's first tokens draft worst), then
    drafted well, on a machine where its rows are nearly free: depth 0 follows the rejections, and no
    verify runs there, so nothing new would be measured; the counts fade at each decision (FADE), the
    depth is tried again, meets the good drafts and stays up."""
    th = theta(t0=0.02, t_experts=0.02, t_row=1e-7)
    pol = DepthPolicy(SIZES, th, DepthConfig(3, margin=0.05, min_dwell=2))
    rec = SimpleNamespace(spec_rejected=0, recent_accepted=0.0, recent_rejected=0.0, num_computed=300)
    ks = []
    for step in range(400):
        k = pol.decide([rec], 0, "tp")
        ks.append(k)
        pol.observe([300 + k + 1], [k + 1], 0.05 + 1e-4 * (k + 1), "tp")
        if k:
            pol.verified(rec, k, 0 if step < 12 else k)  # rejected at first, accepted after
    off = ks.index(0)
    assert off <= 16 and ks[-1] == 3  # off after the rejections, speculating at full depth again
    assert sum(k == 0 for k in ks[-100:]) <= 8  # (at most a depth-0 probe late on)
