"""Phases of a rollout timeline, and the per-phase oracle bound on what live switching could reach.

A rollout batch has two phases: *wide* while requests still wait for KV (admission is capacity-bound:
the layout with more distinct KV tokens runs more requests per step), then the *tail* once every
request is admitted (the batch only narrows; the layout with the fastest step at that batch size
wins). From the fixed layouts' own timelines this module measures each phase per layout and prices an
oracle that runs the wide phase in the layout that finished it soonest, then every tail step at the
fastest mean step time any fixed layout showed at that batch size. It ignores switch costs and the
memory that keeps a narrow-capacity layout out until the batch has shrunk, so it is an optimistic
upper bound: if it is below the target, no switching policy can reach the target on this run. The
gated bound admits a layout at a tail step only once the running requests, grown to their limits,
fit its distinct KV capacity (the condition auto's Eq 6 check imposes, less per-rank packing); at a
step where none does (the batch outgrows even the wide layout, which will preempt), it stays in the
layout that ran.
With several repeats, the oracle of a repeat chooses each tail step's layout by every repeat's evidence
(`pooled`: each layout's mean step time per batch size over all its runs) and pays what the chosen
layout took in this repeat. Choosing by this repeat's means alone takes the minimum of four noisy
estimates: a layout's lucky run would set the bound, which no policy could foresee (two layouts of equal
tail cost, each lucky in one repeat, put that oracle at 1.2x the best fixed run in the repeat where the
wide phase's layout was the unlucky one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 128), (129, 1 << 30))


def bucket(b: int) -> int:
    """Index of the batch-size bucket of `b` running requests."""
    return next(i for i, (lo, hi) in enumerate(BUCKETS) if lo <= max(b, 1) <= hi)


def label(i: int) -> str:
    lo, hi = BUCKETS[i]
    return f"B={lo}" if lo == hi else (f"B>={lo}" if hi >= 1 << 30 else f"B={lo}-{hi}")


def split(timeline: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Wide/tail durations, steps and tokens of one run, and its tail steps' (bucket, seconds, KV tokens
    the batch must hold)."""
    t = np.array([x["t"] for x in timeline], dtype=float)
    if not len(t):
        return {"wide_s": 0.0, "wide_steps": 0, "tail_s": 0.0, "tail_steps": 0, "tail": []}
    dt = np.diff(np.concatenate([[0.0], t]))
    waiting = [i for i, x in enumerate(timeline) if x["waiting"] > 0]
    n = waiting[-1] + 1 if waiting else 0  # the step that admitted the last request ends the wide phase
    wide = float(t[n - 1]) if n else 0.0
    # The KV a layout must hold to take the batch over: the running requests at their limits when the
    # timeline has it (what auto's Eq 6 demands), else what they hold now.
    kv = [int(x.get("kv_final_tokens", x.get("kv_tokens", 0))) for x in timeline]
    # A tail step decodes one token per running request, so its tokens are its batch size (the recorded
    # `running` is counted after the step, when finished requests have already left).
    tail = [(bucket(max(1, int(timeline[i]["tokens"]))), float(dt[i]), kv[i]) for i in range(n, len(t))]
    return {"wide_s": wide, "wide_steps": n, "tail_s": float(t[-1]) - wide, "tail_steps": len(t) - n,
            "wide_tokens": int(sum(x["tokens"] for x in timeline[:n])),
            "tail_tokens": int(sum(x["tokens"] for x in timeline[n:])), "tail": tail}


def step_times(tail: Sequence[tuple[int, float, int]]) -> dict[int, float]:
    """Mean tail step time per batch-size bucket (buckets with at least 3 steps). The mean, not the
    median: a makespan is a sum of steps, and step times are skewed (a stall here and there), so a
    run priced at its own medians came out up to 2% below its own makespan and the oracle beat even
    the runs it was built from; priced at its means, a run in its own layout costs what it took."""
    by: dict[int, list[float]] = {}
    for b, dt, _ in tail:
        by.setdefault(b, []).append(dt)
    return {b: float(np.mean(v)) for b, v in by.items() if len(v) >= 3}


def pooled_times(every: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, dict[int, float]]:
    """Each layout's mean tail step time per batch-size bucket over all its runs (its repeats)."""
    return {name: step_times([x for r in rs for x in split(r["timeline"])["tail"]])
            for name, rs in every.items()}


def analyse(runs: Mapping[str, Mapping[str, Any]],
            pooled: Mapping[str, Mapping[int, float]] | None = None) -> dict[str, Any]:
    """Per-run phases, per-layout tail step times by batch size, and the oracle bound over the fixed runs;
    `pooled` (`pooled_times` over every repeat): what the oracle chooses each tail step's layout by."""
    phases = {name: split(r["timeline"]) for name, r in runs.items()}
    fixed = [name for name in runs if name != "auto"]
    times = {name: step_times(phases[name]["tail"]) for name in runs}
    rank = pooled or times

    def score(lay: str, b: int) -> float:
        """What the oracle chooses a tail step's layout by: the pooled mean, else this run's."""
        return rank.get(lay, times[lay]).get(b, times[lay][b])
    fastest: dict[int, tuple[str, float]] = {}
    for name in fixed:
        for b, dt in times[name].items():
            if b not in fastest or dt < fastest[b][1]:
                fastest[b] = (name, dt)
    capacity = {name: int(runs[name].get("kv_distinct_tokens", 0)) for name in fixed}

    def bound(gated: bool) -> dict[str, Any] | None:
        """Each fixed run's wide phase + its tail steps at the fastest fixed layout for that batch size;
        `gated`: only among layouts whose distinct KV capacity holds the batch at that step (at its
        requests' limits where the timeline has them: no later preemption, as auto's Eq 6 demands)."""
        best = None
        for name in fixed:
            p, tail, own = phases[name], 0.0, 0.0
            for b, dt, kv in p["tail"]:
                own += times[name].get(b, dt)
                measured = [lay for lay in fixed if b in times[lay]]
                ok = [lay for lay in measured if kv <= capacity[lay]] if gated else measured
                # None passes the gate (the batch at its limits outgrows every layout: the run's own
                # layout will preempt): no switch is admissible, so the step runs as it did, priced like
                # its other steps (its own mean at this batch size). None measured: as it ran.
                if not ok:
                    tail += times[name].get(b, dt)
                    continue
                # Chosen by the evidence (a tie, to rounding: stay), paid at what it took here.
                chosen = min(ok, key=lambda lay: score(lay, b))
                if name in ok and score(name, b) <= score(chosen, b) * (1 + 1e-9):
                    chosen = name
                tail += times[chosen][b]
            tail = min(tail, own)  # never switching is a policy too (a pooled choice can lose here)
            total = p["wide_s"] + tail
            if best is None or total < best["makespan_s"]:
                best = {"makespan_s": total, "wide_layout": name, "wide_s": p["wide_s"], "tail_s": tail}
        if best is not None:
            top = min(fixed, key=lambda k: runs[k]["makespan_s"])
            best["best_fixed"] = top
            best["vs_best_fixed"] = runs[top]["makespan_s"] / best["makespan_s"]
        return best

    oracle, gated = bound(False), bound(True)
    out = {name: {k: v for k, v in p.items() if k != "tail"} for name, p in phases.items()}
    for name in runs:
        out[name]["tail_step_ms"] = {label(b): 1e3 * dt for b, dt in sorted(times[name].items())}
    return {"runs": out, "fastest_tail": {label(b): name for b, (name, _) in sorted(fastest.items())},
            "oracle": oracle, "oracle_gated": gated}


def lines(ph: Mapping[str, Any]) -> list[str]:
    """The phase table and the oracle line, for the benchmark's printed report."""
    runs = ph["runs"]
    names = (label(i) for i in range(len(BUCKETS)))
    cols = [b for b in names if any(b in r["tail_step_ms"] for r in runs.values())]
    out = [f"{'phase':>5} {'wide s':>7} {'steps':>5} {'tail s':>7} {'steps':>5} | tail step ms at "
           + " ".join(f"{c:>7}" for c in cols)]
    for name, r in runs.items():
        ms = r["tail_step_ms"]
        cells = " ".join(f"{ms[c]:>7.1f}" if c in ms else f"{'-':>7}" for c in cols)
        out.append(f"{name:>5} {r['wide_s']:>7.2f} {r['wide_steps']:>5} {r['tail_s']:>7.2f} "
                   f"{r['tail_steps']:>5} | {'':15}{cells}")
    o = ph.get("oracle")
    if o:
        fast = ", ".join(f"{b} {n}" for b, n in ph["fastest_tail"].items())
        out.append(f"oracle per-phase bound: {o['wide_layout']}'s wide phase ({o['wide_s']:.2f} s) + its "
                   f"tail at the fastest fixed layout per batch size ({o['tail_s']:.2f} s; {fast}) = "
                   f"{o['makespan_s']:.2f} s = {o['vs_best_fixed']:.2f}x best fixed ({o['best_fixed']}); "
                   "optimistic: no switch costs or memory gating")
    g = ph.get("oracle_gated")
    if g:
        out.append(f"  gated by memory (a layout only once the running requests, grown to their limits, fit "
                   "its distinct KV capacity): "
                   f"{g['makespan_s']:.2f} s = {g['vs_best_fixed']:.2f}x best fixed")
    return out
