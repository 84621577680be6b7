"""What `--layout auto` does on rank 0: price the live batch, ask the Policy, record its verdict.

`AutoLayout` is the policy half of the `SwitchController` (splash/switch/controller.py), which mixes it
in and owns the state it reads: the allocators (`alloc`), the scheduler (`sched`), the memory check
(`fitting`, the planner's own, run dry), the distinct KV each layout holds (`distinct_tokens`) and the
decision log. `_decide` returns the layout to switch to, or None; the controller plans and commits.
The step clock behind the online correction and the regret guard is splash/switch/feedback.py.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from splash.core.costmodel import Batch, step_cost
from splash.core.layouts import Layout
from splash.core.model_config import dtype_bytes, dtype_name
from splash.core.pd_cost import PDDest
from splash.core.policy import PolicyConfig, choose, evaluate
from splash.core.sizes import AttentionSizes
from splash.core.theta import Theta
from splash.kv.allocator import balanced_owners
from splash.step.plan import LAYOUTS, StepPlan

log = logging.getLogger("splash.switch")

GAP = 4  # steps between two evaluations triggered by requests joining or leaving
RECHECK = 16  # steps between two evaluations of an unchanged batch (its contexts grow)


@dataclass
class LayoutDecision:
    """One evaluation of the Policy on the live batch (kept for the timeline and logs)."""

    step: int
    current: str
    chosen: str
    switch: bool
    reason: str
    times_s: dict[str, float]  # predicted step time per layout (Eq 10 on the prior theta)
    feasible: list[str]  # known to fit: the current layout and the faster candidates that passed the
    #                      memory check (one priced slower than the current layout is not checked)
    batch: int
    rows: int
    corrected_s: dict[str, float] = field(default_factory=dict)  # times_s x the correction in force
    observed_s: dict[str, float | None] = field(default_factory=dict)  # recent measured pace on such
    #                                      steps (None: not run on such steps recently)
    correction: dict[str, dict[str, Any]] = field(default_factory=dict)  # per layout Estimate.to_dict()
    kind: str = ""  # the step kind the correction is keyed by ("decode B=3-4")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class AutoLayout:
    """The Policy's side of the switch controller (see the module docstring)."""

    alloc: Any
    sched: Any
    engine: Any
    cfg: Any
    world: int
    theta: Any
    sizes: Any
    policy_cfg: Any
    feedback: Any
    kv_dtype: str  # the pool's element format (the core's name)
    steps_since_switch: int
    _last_eval: tuple[Any, int] | None
    decisions: Any
    # and, from the controller: distinct_tokens(dst), fitting(dsts, live, rows), _projected(seq)

    def _init_policy(self, dtype: Any, margin: float, min_dwell: int) -> None:
        dt = dtype_name(dtype)
        self.sizes = AttentionSizes(self.cfg, dt, self.kv_dtype)
        P = self.alloc.page_size
        d = self.theta.to_dict()
        d.update(act_bytes=dtype_bytes(dt))  # activations exchanged in the engine's own dtype
        self.theta = Theta.from_dict(d)
        # Memory feasibility is the switch planner's check on the engine's real pages (`fits`, run dry),
        # the one memory check: the Policy only prices the candidates that pass it.
        self.policy_cfg = PolicyConfig(margin=margin, min_dwell=min_dwell, page_size=P, check_memory=False)

    def _init_feedback(self, margin: float) -> None:
        from splash.switch.feedback import StepFeedback

        dev = getattr(getattr(self.engine.runner, "local", self.engine.runner), "device", None)
        sync = None
        if getattr(dev, "type", None) == "cuda":
            def sync() -> None:
                torch.cuda.synchronize(dev)
        self.feedback = StepFeedback(self.sizes, self.theta, self.policy_cfg.page_size, LAYOUTS, margin,
                                     self._batch, sync)

    def _batch(self, plan: StepPlan, live: list[Any]) -> Any:
        """The Policy's x: every sequence holding pages, s_i including this step's rows, q_i, owners,
        and the KV each will reach."""
        rows = {s.req_id: s.num_new for s in plan.seqs}
        contexts = [seq.num_computed + rows.get(seq.seq_id, 0) for seq in live]
        q = [rows.get(seq.seq_id, 0) for seq in live]
        if self.alloc.core_layout.owned:
            owners = [seq.owner for seq in live]
        else:  # owners by the planner's rule, on contexts and with room everywhere (a price, not a plan)
            owners, _, _ = balanced_owners(contexts, [[0] * self.world] * len(live), [0] * self.world,
                                           list(range(len(live))))
        # Each request's KV at its own limit (prompt + max_tokens): the steady-state fit (Eq 6) of a
        # layout must hold the batch as it grows, as the planner's own Eq 6 check will demand.
        reserved = [max(c, self._projected(seq)) for c, seq in zip(contexts, live)]
        return Batch.make(contexts, q, owners, ranks=self.world, reserved=reserved)

    def _decide(self, plan: StepPlan, live: list[Any]) -> str | None:
        """Evaluate the Policy on the live batch. The Policy prices each candidate (Eq 10) and applies
        its margin and dwell; memory feasibility is the engine's own page accounting (`fitting`, exactly
        what the planner will check), asked only of the candidates priced faster than the current
        layout: no other could be chosen, and the planner's dry run costs more than the pricing. While no
        other layout's distinct KV holds the batch at its limits (`roomy`: a rollout's tail until it has
        narrowed) there is nothing to weigh, and nothing is priced or logged."""
        cur = self.alloc.layout
        if not live:
            return None
        queued = bool(self.sched.waiting)
        cands = list(LAYOUTS)
        if queued:  # requests wait for KV: never trade admission capacity for a faster step
            here = self.distinct_tokens(cur)
            cands = [lay for lay in LAYOUTS if lay == cur or self.distinct_tokens(lay) >= here]
            if cands == [cur]:
                return None  # no other layout admits as much: nothing to weigh
        if not self._due(plan.step, (cur, queued, tuple(seq.seq_id for seq in live))):
            return None
        rows = {s.req_id: s.num_new for s in plan.seqs}
        if not self.roomy([lay for lay in cands if lay != cur], live, rows):
            return None  # no other layout can hold the batch at its limits: nothing to weigh
        fb = self.feedback
        batch = fb.batch(plan, live) if fb is not None else self._batch(plan, live)
        kind, est = fb.estimates(plan, plan.step) if fb is not None else (None, {})
        blocked = fb.blocked(kind, plan.step) if fb is not None else []
        here = Layout.parse(cur)
        corr = {Layout.parse(lay): (e.factor, e.uncertainty) for lay, e in est.items()}
        priced = dataclasses.replace(self.policy_cfg, layouts=tuple(Layout.parse(lay) for lay in cands))
        dest, finishing = pd_dest(getattr(self, "engine", None), live, rows)
        evals = evaluate(self.sizes, self.theta, batch, here, priced, corr or None, pd=dest,
                         finishing=finishing)
        faster = [lay for lay in cands if lay != cur and lay not in blocked
                  and evals[Layout.parse(lay)].time < evals[here].time]
        fit = set(self.fitting(faster, live, rows))
        ok = [lay for lay in cands if lay == cur or lay in fit]
        cfg = dataclasses.replace(self.policy_cfg, layouts=tuple(Layout.parse(lay) for lay in ok))
        # While the regret guard judges the last switch, only a forced move may leave (dwell not reached).
        dwell = 0 if fb is not None and fb.guard.holding else self.steps_since_switch
        d = choose(evals, here, dwell, cfg)
        if d.switch and est and est[cur].source != "measured" and d.evals[here].fits:
            # Measure before leaping: until the current layout has run a few steps of this kind, its
            # pace here is a guess too, and the guard would have nothing to compare the switch with.
            d = dataclasses.replace(d, layout=here, switch=False, reason=f"{d.reason}; but {cur} has not run "
                                    f"steps like this one ({kind.label}) yet: measuring it first")
            self._last_eval = None  # look again next step
        chosen = d.layout.label.lower()
        if fb is not None:
            # (the step alone: what the step clock measures; a transfer is priced on top, never corrected)
            fb.note_prices(plan, live, {lay.label.lower(): e.cost.total for lay, e in evals.items()})
        reason = d.reason
        queue = [lay for lay in LAYOUTS if lay not in cands]
        if queue:
            reason += f" (the queue rules out {','.join(queue)})"
        memory = [lay for lay in faster if lay not in fit]
        if memory:
            reason += f" (memory rules out {','.join(memory)})"
        if blocked:
            reason += f" ({','.join(blocked)} blocked after a switch back)"
        rec = self._record(plan, live, batch, cur, chosen, d.switch, reason,
                           sorted(lay.label.lower() for lay in d.feasible), kind, est)
        if log.isEnabledFor(logging.DEBUG) or d.switch:
            msg = " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in rec.corrected_s.items())
            (log.info if d.switch else log.debug)("step %d: layout %s -> %s (%s); predicted (corrected) %s; "
                                                  "B=%d rows=%d", plan.step, cur, chosen, reason, msg,
                                                  batch.size, batch.n_rows)
        return chosen if d.switch and chosen != cur else None

    def _due(self, step: int, key: tuple[Any, ...]) -> bool:
        """Whether to weigh the batch this step. The verdict only moves when the batch does: when the
        queue empties or fills, a dwell ends, requests join or leave (at most every `GAP` steps: in a
        narrowing tail they leave nearly every step), or every `RECHECK` steps as contexts grow - not
        every step, where pricing and checking the layouts would cost a few percent of a CPU step."""
        last = self._last_eval
        gap = step - last[1] if last is not None else 0
        if (last is None or last[0][:2] != key[:2] or self.steps_since_switch == self.policy_cfg.min_dwell
                or gap >= RECHECK or (last[0] != key and gap >= GAP)):
            self._last_eval = (key, step)
            return True
        return False

    def _record(self, plan: StepPlan, live: list[Any], batch: Any, cur: str, chosen: str, switch: bool,
                reason: str, feasible: list[str], kind: Any, est: dict[str, Any]) -> LayoutDecision:
        """A LayoutDecision with every layout's predicted, corrected and observed step time."""
        fb = self.feedback
        if fb is not None:
            times = {lay: fb.price(lay, plan, live) for lay in LAYOUTS}
        else:
            times = {lay: step_cost(Layout.parse(lay), self.sizes, batch, self.theta,
                                    self.policy_cfg.page_size).total for lay in LAYOUTS}
        corrected = {lay: times[lay] * (est[lay].factor if lay in est else 1.0) for lay in LAYOUTS}
        observed = ({lay: fb.correction.observed_s(lay, kind, times[lay], plan.step) for lay in LAYOUTS}
                    if fb is not None else {})
        rec = LayoutDecision(plan.step, cur, chosen, switch, reason, times, feasible, batch.size,
                             batch.n_rows, corrected, observed, {lay: e.to_dict() for lay, e in est.items()},
                             kind.label if kind is not None else "")
        self.decisions.append(rec)
        return rec

    def _record_back(self, plan: StepPlan, live: list[Any], back: Any) -> None:
        """The guard's switch back, in the decision log like the Policy's verdicts."""
        fb = self.feedback
        batch = fb.batch(plan, live)
        kind, est = fb.estimates(plan, plan.step)
        rec = self._record(plan, live, batch, back.dst, back.src, True, f"switch back: {back.reason}",
                           [back.src], kind, est)
        log.info("step %d: %s; observed %s", plan.step, rec.reason,
                 " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in rec.observed_s.items() if v is not None))


def pd_dest(engine: Any, live: list[Any], rows: dict[Any, int]) -> tuple[PDDest | None, list[bool] | None]:
    """A prefill server's decode group (the one it last sent to: its layout and size) and which live
    requests finish their prompt this step (their KV crosses the link after it), so each layout is
    priced for time to first token (issue 47). (None, None) on any other engine, or before the first
    transfer, when the decode group is not known yet."""
    pd = getattr(engine, "pd", None)
    mode = getattr(getattr(engine, "config", None), "disaggregation_mode", "null")
    if pd is None or mode != "prefill" or pd.last_dest is None:
        return None, None
    layout, ranks = pd.last_dest
    n = [len(seq.prompt_token_ids) for seq in live]
    finishing = [s.num_computed < p <= s.num_computed + rows.get(s.seq_id, 0) for s, p in zip(live, n)]
    return PDDest(layout, int(ranks)), finishing
