"""pi(x; theta): argmin over the feasible set, Eq 6 / Eq 5 rejection, margin and dwell."""

import dataclasses
import functools

import pytest

from splash.core.costmodel import Batch
from splash.core.layouts import LAYOUTS, Layout
from splash.core.model_config import ConfigError
from splash.core.policy import Policy, PolicyConfig, decide, evaluate, resident_bytes
from splash.core.presets import PRESETS
from splash.core.sizes import GIB, AttentionSizes
from splash.core.theta import Theta

SIZES = AttentionSizes(PRESETS["tiny"])


def _theta(**kw):
    base = dict(ranks=4, memory_bytes=4 * GIB, flops_proj=1e11, flops_att=1e11, bw_weights=2e9, bw_kv=2e9,
                link_bw=1e9, latency=5e-5)
    base.update(kw)
    return Theta(**base)


def _crossover(theta, batch_size, a=Layout.TP, b=Layout.DP):
    """Scan contexts for the first where b beats a (computed, not assumed)."""
    prev = None
    for s in range(16, 20000, 16):
        ev = evaluate(SIZES, theta, Batch.balanced(batch_size, s, 1, theta.ranks), None)
        lead = ev[a].time / ev[b].time - 1
        if prev is not None and prev <= 0 < lead:
            return s
        prev = lead
    raise AssertionError("no crossover in range")


def test_argmin_over_feasible_layouts():
    th = _theta()
    d = decide(SIZES, th, Batch.balanced(8, 256, 1, 4), None, 0)
    assert d.layout == min(d.feasible, key=lambda lay: d.times[lay]) and d.best is d.layout
    assert set(d.to_dict()["layouts"]) == {"TP", "DP", "CP", "DOP"}


def test_hysteresis_near_a_crossover():
    th = _theta()
    s_star = _crossover(th, 8)
    lo, hi = s_star - 16, s_star + 16
    ev_lo = evaluate(SIZES, th, Batch.balanced(8, lo, 1, 4), None)
    ev_hi = evaluate(SIZES, th, Batch.balanced(8, hi, 1, 4), None)
    assert ev_lo[Layout.TP].time < ev_lo[Layout.DP].time and ev_hi[Layout.DP].time < ev_hi[Layout.TP].time
    cand = (Layout.TP, Layout.DP)
    # with no margin and no dwell the policy flaps at every step across the crossover
    flappy = Policy(SIZES, th, PolicyConfig(margin=0.0, min_dwell=0, layouts=cand), Layout.TP)
    for i in range(10):
        flappy.step(Batch.balanced(8, hi if i % 2 == 0 else lo, 1, 4))
    assert flappy.switches == 10
    # a margin larger than the lead near the crossover keeps the layout
    calm = Policy(SIZES, th, PolicyConfig(margin=0.05, min_dwell=0, layouts=cand), Layout.TP)
    for i in range(10):
        d = calm.step(Batch.balanced(8, hi if i % 2 == 0 else lo, 1, 4))
        assert not d.switch and "margin" in d.reason or d.best is Layout.TP
    assert calm.switches == 0 and calm.current is Layout.TP
    # far past the crossover the lead exceeds the margin and it switches once
    far = Batch.balanced(8, 8 * s_star, 1, 4)
    assert calm.step(far).switch and calm.current is Layout.DP


def test_minimum_dwell_delays_a_voluntary_switch():
    th = _theta()
    s_star = _crossover(th, 8)
    far = Batch.balanced(8, 8 * s_star, 1, 4)
    p = Policy(SIZES, th, PolicyConfig(margin=0.0, min_dwell=3, layouts=(Layout.TP, Layout.DP)), Layout.TP)
    reasons = [p.step(far) for _ in range(4)]
    assert [d.switch for d in reasons] == [False, False, False, True]
    assert "dwell" in reasons[0].reason


def test_infeasible_destination_is_rejected_even_when_fastest():
    th = _theta()
    for b, s in [(8, 64), (8, 4000), (2, 256), (32, 512), (4, 10000)]:
        batch = Batch.balanced(b, s, 1, 4)
        free = decide(SIZES, th, batch, None, 0)
        fast = free.layout
        need = {lay: e.memory_bytes for lay, e in free.evals.items()}
        roomier = [lay for lay in need if need[lay] < need[fast]]
        if roomier:
            break
    else:
        raise AssertionError("every batch tried had its fastest layout also the smallest")
    # a budget between the fastest layout's need and a smaller one's: the fastest no longer fits
    tight = dataclasses.replace(th, memory_bytes=(need[fast] + max(need[lay] for lay in roomier)) / 2)
    d = decide(SIZES, tight, batch, None, 0)
    assert fast not in d.feasible and not d.evals[fast].fits
    assert d.layout is not fast and d.layout in d.feasible
    assert d.times[fast] <= d.times[d.layout]  # it was rejected although it is faster


def test_switch_memory_eq5_rejects_a_destination_whose_steady_state_fits():
    th = _theta()
    batch = Batch.balanced(8, 2000, 1, 4)
    ev = evaluate(SIZES, th, batch, Layout.DP)
    assert ev[Layout.TP].switch_peak_bytes > ev[Layout.TP].memory_bytes  # pages in flight + both layouts
    budget = (ev[Layout.TP].memory_bytes + ev[Layout.TP].switch_peak_bytes) / 2
    assert budget > ev[Layout.DP].memory_bytes
    tight = dataclasses.replace(th, memory_bytes=budget)
    ev2 = evaluate(SIZES, tight, batch, Layout.DP)
    # steady state fits, the switch does not: TP is infeasible from DP
    assert ev2[Layout.TP].fits and not ev2[Layout.TP].switch_fits and not ev2[Layout.TP].feasible
    d = decide(SIZES, tight, batch, Layout.DP, 100, PolicyConfig(margin=0))
    assert d.layout is not Layout.TP and Layout.TP not in d.feasible


def test_forced_move_when_the_current_layout_stops_fitting():
    """Reservations grew past TP's room (Eq 6 fails) while the written KV can still move (Eq 5)."""
    th = _theta()
    batch = Batch.make([4000] * 8, 1, None, 4, reserved=[16000] * 8)
    need_tp = resident_bytes(Layout.TP, SIZES, batch, 4, 64).max()
    tight = dataclasses.replace(th, memory_bytes=need_tp * 0.9)
    d = decide(SIZES, tight, batch, Layout.TP, 0, PolicyConfig(min_dwell=100))
    assert not d.evals[Layout.TP].fits
    assert d.switch and d.layout is not Layout.TP and "no longer fits" in d.reason


def test_nothing_fits():
    th = _theta(memory_bytes=1e6)
    d = decide(SIZES, th, Batch.balanced(8, 4000, 1, 4), Layout.DP, 0)
    assert d.best is None and d.layout is Layout.DP and not d.switch and not d.feasible


def test_memory_left_to_the_caller_prices_every_candidate_given():
    """check_memory=False (an engine that ran the planner's dry check itself): the same starved theta
    rules nothing out, and the verdict is the pricing alone - the fastest candidate, as with room."""
    th = _theta(memory_bytes=1e6)
    batch = Batch.balanced(8, 4000, 1, 4)
    d = decide(SIZES, th, batch, Layout.DP, 0, PolicyConfig(check_memory=False))
    roomy = decide(SIZES, _theta(memory_bytes=1e18), batch, Layout.DP, 0)
    assert d.feasible == frozenset(LAYOUTS) and d.layout is roomy.layout and d.best is roomy.best


def test_config_validation():
    with pytest.raises(ConfigError):
        PolicyConfig(margin=1.5)
    with pytest.raises(ConfigError):
        PolicyConfig(min_dwell=-1)
    with pytest.raises(ConfigError):
        PolicyConfig(layouts=())


def test_engine_auto_weighs_admission_first_and_skips_unchanged_batches():
    """The engine's `_decide` (run on a stand-in controller): while requests wait and no layout holds
    more distinct KV than the current one it does not price anything; otherwise it prices the batch
    once and re-prices only when the running set changes (at most every GAP steps), the queue fills
    or empties, or RECHECK steps pass."""
    from types import SimpleNamespace

    from splash.switch.auto import GAP, RECHECK
    from splash.switch.controller import SwitchController

    priced = []
    distinct = {"tp": 1000, "dp": 900, "cp": 900, "dop": 2000}

    def batch(plan, live):
        priced.append(plan.step)
        return Batch.make([64] * len(live), 1, [s.owner for s in live], ranks=2)

    th = _theta(ranks=2, memory_bytes=1e18)
    ctl = SimpleNamespace(alloc=SimpleNamespace(layout="dop"), sched=SimpleNamespace(waiting=[object()]),
                          distinct_tokens=distinct.get, fitting=lambda dsts, live, rows=None: list(dsts),
                          roomy=lambda dsts, live, rows=None: list(dsts),
                          _batch=batch, sizes=SIZES, theta=th,
                          policy_cfg=PolicyConfig(page_size=16, min_dwell=0), steps_since_switch=5,
                          decisions=[], _last_eval=None, feedback=None)
    ctl._record = functools.partial(SwitchController._record, ctl)
    ctl._due = functools.partial(SwitchController._due, ctl)
    live = [SimpleNamespace(seq_id=i, owner=i % 2) for i in range(4)]

    def step(n, seqs=live):
        return SwitchController._decide(ctl, SimpleNamespace(step=n, seqs=[]), seqs)

    assert step(0) is None and priced == [], "queued in the largest-capacity layout: nothing to weigh"
    ctl.sched.waiting = []
    step(1)
    step(2)
    assert priced == [1] and len(ctl.decisions) == 1
    step(2, live[:3])  # a request left, but the batch was weighed a step ago
    step(1 + GAP, live[:3])  # ... and GAP steps after: the verdict may move
    step(RECHECK, live[:3])
    step(1 + GAP + RECHECK, live[:3])  # contexts grew for RECHECK steps
    assert priced == [1, 1 + GAP, 1 + GAP + RECHECK]
    rec = ctl.decisions[-1]
    assert set(rec.times_s) == {"tp", "dp", "cp", "dop"} and rec.chosen in rec.times_s
    # Queued again, but DP now admits as much as DOP: a tie keeps it a candidate, so the Policy runs.
    ctl.sched.waiting, distinct["dp"] = [object()], distinct["dop"]
    step(2 + GAP + RECHECK)  # (the queue filled: weighed at once)
    assert priced[-1] == 2 + GAP + RECHECK and ctl.decisions[-1].feasible in (["dop"], ["dop", "dp"])
    assert "cp" in ctl.decisions[-1].reason and "tp" in ctl.decisions[-1].reason
    # Everything admitted, but no other layout's distinct KV holds the batch at its limits (a rollout's
    # tail): the batch is due to be weighed, yet nothing is priced or logged.
    ctl.sched.waiting, ctl.roomy = [], lambda dsts, live, rows=None: []
    n, logged = len(priced), len(ctl.decisions)
    assert step(3 + GAP + RECHECK) is None and step(4 + 2 * GAP + RECHECK, live[:2]) is None
    assert len(priced) == n and len(ctl.decisions) == logged
