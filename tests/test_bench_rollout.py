"""`splash bench rollout`'s analysis, without ranks: the workload, the phase split of a timeline, the
per-phase oracle bound (ungated and gated by KV capacity) and the policy-evidence log."""

from __future__ import annotations

import pytest

from splash.bench.phases import analyse, bucket, lines, split
from splash.bench.rollout import QUICK, Workload, changes
from splash.switch.auto import LayoutDecision


def timeline(wide: list[float], tail: list[tuple[float, int, int]]) -> list[dict]:
    """Steps: `wide` step times with requests waiting; `tail` (step time, batch, live KV tokens)."""
    out, t = [], 0.0
    for dt in wide:
        t += dt
        out.append({"t": t, "running": 8, "waiting": 5, "tokens": 8, "kv_tokens": 900})
    for dt, b, kv in tail:
        t += dt
        out.append({"t": t, "running": b, "waiting": 0, "tokens": b, "kv_tokens": kv})
    return out


def run(tl: list[dict], distinct: int) -> dict:
    return {"timeline": tl, "makespan_s": tl[-1]["t"], "kv_distinct_tokens": distinct}


def test_workload_is_deterministic_and_heavy_tailed():
    p1, o1 = Workload().sample(320)
    p2, o2 = Workload().sample(320)
    assert p1 == p2 and o1 == o2, "every layout must run the same requests"
    assert len(p1) == Workload().requests and max(o1) == Workload().output_max
    assert sorted(o1)[len(o1) // 2] < max(o1) / 10, "most outputs short, a few long: the batch narrows"
    assert all(4 <= len(p) <= Workload().prompt_max for p in p1)
    assert QUICK.requests < Workload().requests and QUICK.longest < Workload().longest
    # decode-heavy by default: more tokens generated than prompted, no output below the Pareto scale
    assert sum(o1) > sum(map(len, p1)) and min(o1) >= Workload().output_scale


def test_workload_shape_flags_and_their_errors():
    from splash.core.model_config import ConfigError

    short = Workload(output_scale=3.0, output_max=192)
    _, o = short.sample(320)
    assert max(o) == 192 and min(o) >= 3 and sorted(o)[len(o) // 2] < sorted(Workload().sample(320)[1])[80]
    for bad in ({"output_scale": 0.0}, {"output_alpha": -1.0}, {"prompt_max": 3}, {"output_max": 1}):
        with pytest.raises(ConfigError):
            Workload(**bad)


def test_split_wide_and_tail():
    ph = split(timeline([0.1] * 3, [(0.05, 4, 100), (0.02, 1, 50)]))
    assert ph["wide_steps"] == 3 and ph["wide_s"] == pytest.approx(0.3)
    assert ph["tail_steps"] == 2 and ph["tail_s"] == pytest.approx(0.07)
    assert [b for b, _, _ in ph["tail"]] == [bucket(4), bucket(1)]
    assert split([])["wide_steps"] == 0


def test_oracle_takes_the_best_wide_phase_and_the_fastest_tail():
    # "big": fast wide phase (more capacity) but slow narrow steps; "small": the reverse.
    tail_big = [(0.05, 2, 200)] * 10
    tail_small = [(0.02, 2, 200)] * 10
    runs = {"big": run(timeline([0.1] * 3, tail_big), 3000),
            "small": run(timeline([0.1] * 8, tail_small), 1000)}
    ph = analyse(runs)
    o = ph["oracle"]
    assert o["wide_layout"] == "big" and o["makespan_s"] == pytest.approx(0.3 + 10 * 0.02)
    assert o["best_fixed"] == "big" and o["vs_best_fixed"] == pytest.approx(0.8 / 0.5)
    assert ph["fastest_tail"] == {"B=2": "small"}
    assert ph["runs"]["big"]["tail_step_ms"]["B=2"] == pytest.approx(50.0)
    # Gated: while the batch holds more KV than "small" can, only "big" may run it.
    runs["big"] = run(timeline([0.1] * 3, [(0.05, 2, 2000)] * 5 + tail_big[:5]), 3000)
    g = analyse(runs)["oracle_gated"]
    assert g["makespan_s"] == pytest.approx(0.3 + 5 * 0.05 + 5 * 0.02)
    for x in runs["big"]["timeline"]:  # the requests' KV at their limits gates, when recorded
        x["kv_final_tokens"] = 2000
    assert analyse(runs)["oracle_gated"]["makespan_s"] == pytest.approx(0.3 + 10 * 0.05)
    text = "\n".join(lines(analyse(runs)))
    assert "oracle per-phase bound" in text and "gated by memory" in text


def test_auto_run_is_analysed_but_not_an_oracle_candidate():
    runs = {"dp": run(timeline([0.1] * 2, [(0.03, 1, 10)] * 4), 1000),
            "auto": run(timeline([0.01], [(0.001, 1, 10)] * 4), 1000)}
    ph = analyse(runs)
    assert ph["oracle"]["wide_layout"] == "dp" and "auto" in ph["runs"]
    assert ph["fastest_tail"] == {"B=1": "dp"}


def test_changes_keep_only_moves_of_the_verdict():
    def dec(step: int, cur: str, chosen: str, feasible: list[str], times: dict[str, float]) -> LayoutDecision:
        return LayoutDecision(step, cur, chosen, cur != chosen, "why", times, feasible, 4, 4)

    t1 = {"tp": 0.05, "dp": 0.04, "cp": 0.06, "dop": 0.045}
    log = changes([dec(1, "dop", "dop", ["dop"], t1), dec(2, "dop", "dop", ["dop"], t1),
                   dec(3, "dop", "dp", ["dop", "dp"], t1), dec(4, "dp", "dp", ["dop", "dp"], t1)])
    assert [d["step"] for d in log] == [1, 3, 4]
    assert log[1]["switch"] and log[1]["predicted_ms"]["dp"] == pytest.approx(40.0)


def test_run_order_is_a_permutation_and_varies_who_runs_before_whom():
    from splash.bench.rollout import RUNS, run_order

    runs = list(RUNS)
    orders = [run_order(runs, rep) for rep in range(4)]
    assert all(sorted(o) == sorted(runs) for o in orders)
    assert len({o[0] for o in orders}) == 4, "a different layout starts each repeat"
    before_auto = {o[o.index("auto") - 1] for o in orders if o.index("auto")}
    assert len(before_auto) >= 2, "auto must not always follow the same layout"
    # Two runs alternate who goes first (rotating each repeat by one would undo the reversal).
    pairs = [run_order(["dop", "auto"], rep) for rep in range(4)]
    assert sum(o[0] == "auto" for o in pairs) == 2, pairs


def test_gated_oracle_stays_in_its_layout_where_no_layout_holds_the_batch():
    """A tail step whose batch, at its limits, outgrows every layout (the running one will preempt) is
    priced in the layout that ran it, never in a faster layout that could not take the batch over."""
    big_tail = [(0.05, 2, 5000)] * 4 + [(0.05, 2, 200)] * 6  # 5000 tokens: more than any capacity
    runs = {"big": run(timeline([0.1] * 3, big_tail), 3000),
            "small": run(timeline([0.1] * 8, [(0.02, 2, 200)] * 10), 1000)}
    g = analyse(runs)["oracle_gated"]
    assert g["wide_layout"] == "big" and g["makespan_s"] == pytest.approx(0.3 + 4 * 0.05 + 6 * 0.02)
    assert analyse(runs)["oracle"]["makespan_s"] == pytest.approx(0.3 + 10 * 0.02)  # ungated: no gate


def test_a_run_alone_prices_its_own_tail_at_what_it_took():
    """Skewed step times (one stall among quick steps): the oracle built from one fixed run, which can
    only keep that run's layout, must come out at that run's makespan, not below it."""
    tail = [(0.01, 2, 100)] * 5 + [(0.06, 2, 100)] + [(0.02, 1, 50)] * 4
    runs = {"dop": run(timeline([0.1] * 3, tail), 3000)}
    ph = analyse(runs)
    for o in (ph["oracle"], ph["oracle_gated"]):
        assert o["makespan_s"] == pytest.approx(runs["dop"]["makespan_s"])
        assert o["vs_best_fixed"] == pytest.approx(1.0)
    assert ph["runs"]["dop"]["tail_step_ms"]["B=2"] == pytest.approx(1e3 * 0.11 / 6)


def test_oracle_chooses_by_every_repeat_and_pays_this_repeats_price():
    """x has the fast wide phase; x and y cost the same per tail step, and each is lucky in one repeat.
    Choosing by a repeat's own runs alone, the oracle runs x's wide phase and y's lucky tail: 1.2x the
    best fixed run for two layouts of equal cost. Choosing by the pooled evidence (a tie: stay), it is
    the best fixed run; a layout faster in every repeat is still chosen, at this repeat's price."""
    from splash.bench.phases import pooled_times

    def rep(x: float, y: float) -> dict:
        return {"x": run(timeline([0.1] * 3, [(x, 2, 100)] * 10), 3000),
                "y": run(timeline([0.1] * 8, [(y, 2, 100)] * 10), 3000)}

    def both(reps: list[dict]) -> dict:
        return pooled_times({k: [r[k] for r in reps] for k in ("x", "y")})

    reps = [rep(0.03, 0.02), rep(0.02, 0.03)]
    pooled = both(reps)
    assert pooled["x"][bucket(2)] == pytest.approx(0.025) == pooled["y"][bucket(2)]
    assert analyse(reps[0])["oracle_gated"]["vs_best_fixed"] == pytest.approx(0.6 / 0.5)  # y's luck
    for r in reps:
        assert analyse(r, pooled)["oracle_gated"]["vs_best_fixed"] == pytest.approx(1.0)
    reps = [rep(0.03, 0.02), rep(0.03, 0.025)]
    g = analyse(reps[1], both(reps))["oracle_gated"]
    assert g["wide_layout"] == "x" and g["makespan_s"] == pytest.approx(0.3 + 10 * 0.025)
    # A pooled choice that loses in this repeat (y: 0.0225 pooled, 0.03 here) is not taken: staying is.
    reps = [rep(0.03, 0.015), rep(0.028, 0.03)]
    assert analyse(reps[1], both(reps))["oracle_gated"]["makespan_s"] == pytest.approx(0.3 + 10 * 0.028)
