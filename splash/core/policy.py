"""The scheduling policy pi(x; theta) of §4.2: feasibility (Eq 6, Eq 5), argmin (Eq 8), hysteresis.

Every step the runtime passes the live batch x (contexts s_i, query rows q_i, owners). A layout is
feasible when its steady state fits every rank (Eq 6: M0 + W(l) + K(l,x) + A(l,x) + R <= H) and,
unless it is the current layout, when the switch into it fits too (Eq 5: max(M(a), M(b)) +
Delta_layer + R <= H, one layer in transit). The fastest feasible layout l* is adopted only when it
beats the current one by a relative margin and the current layout has run `min_dwell` steps -
unless the current layout no longer fits, which forces the move at once.
`corrections` (optional, from the runtime's `correction.StepCorrection`) multiply each layout's
prediction by what its measured steps say, and a layout known only by its prior must lead by its
`uncertainty` on top of the margin (it is ranked by its time x (1 + uncertainty)).
`decide` is a pure function; `Policy` only carries (current layout, steps since the last switch).
A prefill group of a disaggregated deployment passes `pd` (its decode group, `pd_cost.PDDest`): each
layout is then priced for time to first token, the step plus its finishing requests' transfer over the
link (`pd_cost.ttft_price`); without it nothing changes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splash.core.capacity import model_pool_tokens
from splash.core.costmodel import Batch, StepCost, step_cost
from splash.core.law import Crossover
from splash.core.layouts import (
    DEFAULT_PAGE_SIZE,
    LAYOUTS,
    Layout,
    kv_pages_per_rank,
    kv_tokens_per_rank,
    state_requests_per_rank,
)
from splash.core.model_config import ConfigError
from splash.core.pd_cost import PDDest, transfer_seconds
from splash.core.sizes import AttentionSizes
from splash.core.switch_time import switch_time
from splash.core.theta import Theta
from splash.core.transfer import kv_transfer_tokens, switch_layer_bytes, weight_transfer_bytes


@dataclass(frozen=True)
class PolicyConfig:
    margin: float = 0.05  # l* must be at least this fraction faster than the current layout
    min_dwell: int = 8  # steps to stay in a layout before a voluntary switch
    layouts: tuple[Layout, ...] = LAYOUTS  # the candidates
    page_size: int | None = DEFAULT_PAGE_SIZE  # KV page size (None: count tokens exactly)
    # False: the caller has already left out the candidates that do not fit (an engine runs the switch
    # planner's own Eq 5/6 check dry on its real pages), so the Policy prices them and judges no memory.
    check_memory: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.margin < 1:
            raise ConfigError(f"switching margin must be in [0, 1), got {self.margin}")
        if self.min_dwell < 0:
            raise ConfigError(f"minimum dwell must be >= 0 steps, got {self.min_dwell}")
        if not self.layouts:
            raise ConfigError("the policy needs at least one candidate layout")


@dataclass(frozen=True)
class LayoutEval:
    """One candidate layout on the live batch: predicted time and memory (NaN memory, 0 pool tokens and
    fits=True where the caller judged memory itself: `PolicyConfig.check_memory=False`)."""

    layout: Layout
    cost: StepCost
    memory_bytes: float  # busiest rank, steady state (Eq 6 left-hand side)
    fits: bool  # Eq 6
    switch_peak_bytes: float  # busiest rank during the switch from the current layout (Eq 5)
    switch_fits: bool  # Eq 5 (True for the current layout)
    switch_exposed_s: float  # Eq 7 estimate of the switch from the current layout
    kv_pool_tokens: int  # KV tokens one rank could hold in this layout with the batch's weights
    factor: float = 1.0  # online correction: measured / predicted (1: the prior as is)
    uncertainty: float = 0.0  # extra lead a switch into this layout must show
    transfer_s: float = 0.0  # a prefill group's: its finishing requests' transfer to the decode group

    @property
    def time(self) -> float:
        """The step time the policy believes: the prediction times the correction (plus the transfer)."""
        return self.cost.total * self.factor + self.transfer_s

    @property
    def predicted(self) -> float:
        """Eq 10 on theta alone (plus the transfer)."""
        return self.cost.total + self.transfer_s

    def score(self, current: Layout | None) -> float:
        """What the argmin ranks: the time, made pessimistic by the uncertainty unless already running."""
        return self.time if self.layout is current else self.time * (1 + self.uncertainty)

    @property
    def feasible(self) -> bool:
        return self.fits and self.switch_fits

    def to_dict(self) -> dict[str, Any]:
        return {"step_s": self.time, "predicted_s": self.predicted, "factor": self.factor,
                "uncertainty": self.uncertainty, "memory_gib": self.memory_bytes / 2**30, "fits": self.fits,
                "switch_peak_gib": self.switch_peak_bytes / 2**30, "switch_fits": self.switch_fits,
                "switch_exposed_s": self.switch_exposed_s, "kv_pool_tokens_per_rank": self.kv_pool_tokens,
                "feasible": self.feasible, "transfer_s": self.transfer_s}


@dataclass(frozen=True)
class Decision:
    layout: Layout  # the layout to run this step
    switch: bool  # layout differs from the current one
    reason: str
    best: Layout | None  # argmin over the feasible set (None when nothing fits)
    evals: dict[Layout, LayoutEval] = field(repr=False)

    @property
    def times(self) -> dict[Layout, float]:
        return {lay: e.time for lay, e in self.evals.items()}

    @property
    def feasible(self) -> frozenset[Layout]:
        return frozenset(lay for lay, e in self.evals.items() if e.feasible)

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout.label, "switch": self.switch, "reason": self.reason,
                "best": self.best.label if self.best else None,
                "feasible": [lay.label for lay in LAYOUTS if lay in self.feasible],
                "layouts": {lay.label: e.to_dict() for lay, e in self.evals.items()}}


def activation_bytes(layout: Layout, sizes: AttentionSizes, batch: Batch, ranks: int,
                     act_bytes: float) -> np.ndarray:
    """A_r: one layer's attention workspace per rank (rows x (hidden in/out + q and o latents))."""
    c = sizes.cfg
    heads = sizes.heads / ranks if layout.sharded else sizes.heads
    if layout is Layout.DP:
        rows = np.bincount(batch.owners, weights=batch.rows, minlength=ranks)
    else:
        rows = np.full(ranks, float(batch.n_rows))
    if layout is Layout.DOP:  # owners also hold all heads of their own rows after the exchange
        owned = np.bincount(batch.owners, weights=batch.rows, minlength=ranks)
        rows_heads = rows * heads + owned * sizes.heads
    else:
        rows_heads = rows * heads
    return (rows * 2 * c.hidden_size + rows_heads * (2 * c.kv_lora_rank + c.qk_rope_head_dim)) * act_bytes


def resident_bytes(layout: Layout, sizes: AttentionSizes, batch: Batch, ranks: int,
                   page_size: int | None, reserved: bool = True) -> np.ndarray:
    """M_r(l) = M0 + W_r(l) + K_r(l, x): what each rank keeps resident in `layout`.

    `reserved=True` counts each request's reservation (the steady state of Eq 6); False counts the
    context written so far (what a switch moves now, Eq 5).
    """
    tokens = batch.kv_tokens if reserved else batch.contexts
    if page_size:
        kv = kv_pages_per_rank(layout, tokens, batch.owners, ranks, page_size) * page_size
    else:
        kv = kv_tokens_per_rank(layout, tokens, batch.owners, ranks)
    w = np.array([sizes.attention_weight_bytes(layout.sharded, ranks, r) for r in range(ranks)])
    out = sizes.fixed_bytes_per_rank(ranks) + w + kv * sizes.k
    if sizes.z:  # a hybrid's per-request KDA states, the share each rank holds (SPEC §10)
        out = out + state_requests_per_rank(layout, batch.owners, ranks) * sizes.z
    return out


def evaluate(sizes: AttentionSizes, theta: Theta, batch: Batch, current: Layout | None,
             config: PolicyConfig = PolicyConfig(),
             corrections: Mapping[Layout, tuple[float, float]] | None = None, *, pd: PDDest | None = None,
             finishing: Sequence[bool] | None = None) -> dict[Layout, LayoutEval]:
    """Time, steady-state fit (Eq 6) and switch fit (Eq 5) of every candidate on the live batch.

    `current=None` evaluates a fresh start (no switch, so Eq 5 does not apply). `corrections`: per
    layout (factor, uncertainty) from measured steps (absent: (1, 0), the prior as is). `pd`: this is a
    prefill group sending to that decode group: each time includes the transfer of the requests whose
    prompts finish this step (`finishing`, one flag per request; None: all of them).
    """
    T, P = theta.ranks, config.page_size
    sizes.cfg.check_ranks(T)
    H, R = theta.memory_bytes, theta.reserve_bytes
    out: dict[Layout, LayoutEval] = {}

    def link(lay: Layout) -> float:
        return 0.0 if pd is None else transfer_seconds(sizes, theta, lay, batch, pd, P or DEFAULT_PAGE_SIZE,
                                                          finishing)

    if not config.check_memory:  # the caller judged memory: price only (an engine does this per decision)
        for lay in config.layouts:
            f, u = (corrections or {}).get(lay, (1.0, 0.0))
            out[lay] = LayoutEval(lay, step_cost(lay, sizes, batch, theta, P), math.nan, True, math.nan, True,
                                  math.nan, 0, float(f), float(u), link(lay))
        return out
    now_cur = resident_bytes(current, sizes, batch, T, P, False) if current is not None else None
    for lay in config.layouts:
        cost = step_cost(lay, sizes, batch, theta, P)
        m = resident_bytes(lay, sizes, batch, T, P)
        steady = m + activation_bytes(lay, sizes, batch, T, theta.act_bytes) + R
        fits = bool((steady <= H).all())
        if current is None or lay is current:
            peak, sw_fits, exposed = float(steady.max(initial=0)), True, 0.0
        else:
            if sizes.cfg.is_hybrid:  # KDA layers move their own projections and per-request states
                w2, kv2 = switch_layer_bytes(sizes, current, lay, batch.contexts, batch.owners, None, T, P)
                now = resident_bytes(lay, sizes, batch, T, P, False)
                peak_r = np.maximum(now_cur, now) + (w2 + kv2).max(axis=0) + R  # the largest layer
                exposed, _ = switch_time(w2, kv2, cost, theta)
            else:
                w = weight_transfer_bytes(sizes, current, lay, T)
                kv_tok, _ = kv_transfer_tokens(current, lay, batch.contexts, batch.owners, None, T, P)
                now = resident_bytes(lay, sizes, batch, T, P, False)
                peak_r = np.maximum(now_cur, now) + w + kv_tok * sizes.kv_token_layer + R  # the largest layer
                exposed, _ = switch_time(w, np.outer(sizes.kv_layer_bytes, kv_tok), cost, theta)
            peak, sw_fits = float(peak_r.max(initial=0)), bool((peak_r <= H).all())
        pool = model_pool_tokens(lay, sizes, H, T, R, requests=batch.size)
        f, u = (corrections or {}).get(lay, (1.0, 0.0))
        out[lay] = LayoutEval(lay, cost, float(steady.max(initial=0)), fits, peak, sw_fits, exposed, pool,
                              float(f), float(u), link(lay))
    return out


def decide(sizes: AttentionSizes, theta: Theta, batch: Batch, current: Layout | str | None,
           steps_since_switch: int, config: PolicyConfig = PolicyConfig(),
           corrections: Mapping[Layout, tuple[float, float]] | None = None, *, pd: PDDest | None = None,
           finishing: Sequence[bool] | None = None) -> Decision:
    """pi(x; theta): the layout to run this step, and why. Pure: no state is kept.

    `current=None` asks which layout to start in: the fastest layout that fits, no hysteresis.
    `corrections`: see `evaluate`; a candidate's lead is measured on its score (time x (1 +
    uncertainty)), so an unmeasured layout must beat the current one by margin and uncertainty.
    `pd`, `finishing`: a prefill group's time to first token (see `evaluate`).
    """
    current = None if current is None else Layout.parse(current)
    evals = evaluate(sizes, theta, batch, current, config, corrections, pd=pd, finishing=finishing)
    return choose(evals, current, steps_since_switch, config)


def choose(evals: Mapping[Layout, LayoutEval], current: Layout | None, steps_since_switch: int,
           config: PolicyConfig = PolicyConfig()) -> Decision:
    """`decide` on candidates already evaluated (`evals` holds every layout of `config.layouts`): an
    engine prices more layouts than it checks for memory, and passes the ones that fit."""
    evals = {lay: evals[lay] for lay in config.layouts}
    feasible = [lay for lay in config.layouts if evals[lay].feasible]
    if not feasible:
        why = "no candidate layout fits this batch; stay and let admission shed load"
        if current is None:
            fallback = min(config.layouts, key=lambda lay: evals[lay].memory_bytes)
            return Decision(fallback, False, f"no candidate layout fits this batch "
                            f"({fallback.label} needs the least memory)", None, evals)
        return Decision(current, False, why, None, evals)
    best = min(feasible, key=lambda lay: evals[lay].score(current))
    if current is None:
        return Decision(best, False, f"{best.label} is the fastest layout that fits", best, evals)
    cur_eval = evals.get(current)
    if cur_eval is None or not cur_eval.fits:
        why = "current layout is not a candidate" if cur_eval is None else "current layout no longer fits"
        why = f"{why}; forced to fastest feasible {best.label}"
        return Decision(best, best is not current, why, best, evals)
    if best is current:
        quick = min(feasible, key=lambda lay: evals[lay].time)
        if quick is not current:  # faster on paper, but not by enough to cover what is not measured
            lead = 1 - evals[quick].time / cur_eval.time if cur_eval.time > 0 else 0.0
            return Decision(current, False, f"{quick.label} leads by {lead:.1%} but is unmeasured here "
                            f"(+{evals[quick].uncertainty:.0%}): {current.label} stays", best, evals)
        return Decision(current, False, f"{current.label} is the fastest feasible layout", best, evals)
    t_best, t_cur = evals[best].score(current), cur_eval.time
    lead = 1 - t_best / t_cur if t_cur > 0 else 0.0
    unsure = f" (its time +{evals[best].uncertainty:.0%} unmeasured)" if evals[best].uncertainty else ""
    if steps_since_switch < config.min_dwell:
        return Decision(current, False, f"{best.label} leads by {lead:.1%} but dwell "
                        f"{steps_since_switch}/{config.min_dwell} steps not reached", best, evals)
    if lead < config.margin:
        return Decision(current, False, f"{best.label} leads by {lead:.1%}{unsure} < margin "
                        f"{config.margin:.1%}", best, evals)
    return Decision(best, True, f"{best.label} leads {current.label} by {lead:.1%}{unsure} >= margin "
                    f"{config.margin:.1%}", best, evals)


class Policy:
    """Stateful wrapper the scheduler calls once per step: remembers the layout and its dwell."""

    def __init__(self, sizes: AttentionSizes, theta: Theta, config: PolicyConfig = PolicyConfig(),
                 initial: Layout | str = Layout.TP, pd: PDDest | None = None) -> None:
        self.sizes, self.theta, self.config, self.pd = sizes, theta, config, pd
        self.current = Layout.parse(initial)
        self.steps_since_switch = 0
        self.switches = 0

    def step(self, batch: Batch, steps: int = 1, finishing: Sequence[bool] | None = None) -> Decision:
        """Decide for the next `steps` steps (a simulator may stride several decode steps at once);
        `finishing`: a prefill group's requests whose prompts finish (see `evaluate`)."""
        d = decide(self.sizes, self.theta, batch, self.current, self.steps_since_switch, self.config,
                   pd=self.pd, finishing=finishing)
        if d.switch:
            self.current = d.layout
            self.steps_since_switch = steps
            self.switches += 1
        else:
            self.steps_since_switch += steps
        return d


# ---- where the fastest layout changes with context (`splash plan crossovers --model`) -----------------
def fastest_layout(sizes: AttentionSizes, theta: Theta, batch: Batch, layouts: tuple[Layout, ...] = LAYOUTS,
                   page_size: int | None = DEFAULT_PAGE_SIZE, check_memory: bool = True) -> Layout | None:
    """The fastest layout of Eq 10 for `batch` among those that fit (Eq 6; all when not `check_memory`),
    None when none fits: the argmin of Eq 8 for a fresh start."""
    cfg = PolicyConfig(0.0, 0, layouts, page_size, check_memory)
    evals = evaluate(sizes, theta, batch, None, cfg)
    fit = [lay for lay in layouts if evals[lay].fits]
    return min(fit, key=lambda lay: evals[lay].time) if fit else None


def crossovers(sizes: AttentionSizes, theta: Theta, batch: int, rows: int = 1, lo: int = 1024,
               hi: int = 512 * 1024, points: int = 192, page_size: int | None = DEFAULT_PAGE_SIZE,
               check_memory: bool = True) -> tuple[list[Crossover], int | None]:
    """Every change of the fastest (fitting) layout of Eq 10 as the context s of `batch` equal requests
    grows over [lo, hi] tokens (`rows` query rows each), to the token; and the first s at which no layout
    fits (None: all of the range fits one). A geometric grid finds the changes, bisection places them.
    "capacity": the faster layout stopped fitting there; "speed": the curves crossed."""
    if not 1 <= lo < hi:
        raise ConfigError(f"scan range must satisfy 1 <= lo < hi, got [{lo}, {hi}]")
    if batch < 1 or not 1 <= rows <= lo:
        raise ConfigError(f"need batch >= 1 and 1 <= query rows <= the shortest context, got {batch}, {rows}")
    T = theta.ranks

    def best(s: int) -> Layout | None:
        b = Batch.balanced(batch, s, rows, T)
        return fastest_layout(sizes, theta, b, LAYOUTS, page_size, check_memory)

    def fits(lay: Layout, s: int) -> bool:
        b = Batch.balanced(batch, s, rows, T)
        ev = evaluate(sizes, theta, b, None, PolicyConfig(0.0, 0, (lay,), page_size, check_memory))
        return ev[lay].fits

    grid = sorted({int(round(v)) for v in np.geomspace(lo, hi, points)})
    out: list[Crossover] = []
    a, at = best(grid[0]), grid[0]
    if a is None:
        return out, grid[0]
    for g in grid[1:]:
        while best(g) is not a:
            x0, x1 = at, g  # best(x0) is a, best(x1) is not: bisect to the first token that changes
            while x1 - x0 > 1:
                mid = (x0 + x1) // 2
                if best(mid) is a:
                    x0 = mid
                else:
                    x1 = mid
            b = best(x1)
            if b is None:
                return out, x1
            out.append(Crossover(float(x1), a, b, "speed" if fits(a, x1) else "capacity"))
            a, at = b, x1
        at = g
    return out, None
