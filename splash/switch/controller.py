"""Rank 0's switch controller: decides, plans and commits live layout switches inside the engine.

After the scheduler has planned a step in the running layout, the `SwitchController` (owned by the
LLMEngine) decides whether this step switches - a forced schedule (`--switch-schedule`, parsed in
splash/config.py), an explicit `request(dst)` (benchmarks), the regret guard's switch
back, or the analytical core's Policy (`--layout auto`) evaluated on the live batch - and if so asks
the `SwitchPlanner` for a plan over the real page allocators. A refusal is logged with its numbers and
the step runs as planned, in the current layout. A plan rewrites the step into the destination layout
(`SwitchPlan.restep`) and travels with it as `StepPlan(kind="switch", payload=plan)`; every rank runs
it (splash/switch/step.py; see docs/runtime.md "Switching"). After the step rank 0 commits: source
pages retired, the allocators' layout becomes the destination, each live sequence takes its new page
table and owner (`Scheduler.set_owner`), and the replicas' pages are withheld or given back
(splash/switch/replicas.py).

Memory feasibility has one definition, the planner's: `fits` runs `SwitchPlanner.check` (owners,
Eq 5, Eq 6, nothing allocated) on the live batch, exactly what the plan itself will check. Owners
follow one rule (`kv.allocator.balanced_owners`), here too when pricing a batch the Policy sees.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from splash.core.correction import describe
from splash.core.model_config import ConfigError
from splash.kv.allocator import request_capacity
from splash.runtime_spec import RuntimeSpec
from splash.step.plan import LAYOUTS, StepPlan
from splash.switch import LiveRequest, SwitchPlanner, SwitchRefusal
from splash.switch.auto import AutoLayout, LayoutDecision
from splash.switch.plan import MODES
from splash.switch.planner import SharedOutOfOrder
from splash.switch.replicas import ReplicaPages
from splash.switch.step import SwitchTiming

log = logging.getLogger("splash.switch")

EXPOSED_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ExposedHistogram:
    """Switches' exposed seconds, counted per bucket as they come: stats() runs after every step, so it
    copies a fixed-size list, not one entry per switch the server ever made."""

    def __init__(self) -> None:
        self.counts = [0] * (len(EXPOSED_BUCKETS) + 1)  # values <= each bound (not cumulative), then +Inf
        self.sum = 0.0

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(EXPOSED_BUCKETS, seconds)] += 1
        self.sum += seconds

    def to_dict(self) -> dict[str, Any]:
        return {"bounds": list(EXPOSED_BUCKETS), "counts": list(self.counts), "sum": self.sum}


# ---- rank 0: decisions, plans, commits ---------------------------------------------------------------
@dataclass
class SwitchEvent:
    """A switch that ran, or one that was refused (then `refused` holds the reason and message)."""

    step: int
    src: str
    dst: str
    cause: str  # "schedule" | "auto" | "request" | "guard" (a switch back, splash/core/regret.py)
    mode: str
    refused: str | None = None
    message: str = ""
    bytes_per_layer: float = 0.0  # weights + KV sent by all ranks, one layer
    layers: int = 0
    exposed_s: float = 0.0  # rank 0's time inside the executor
    total_s: float = 0.0
    plan_s: float = 0.0  # rank 0's planning time
    time: float = field(default_factory=time.time)  # wall clock when it was planned into a step
    ended: float = 0.0  # wall clock when that step had run on every rank (0: refused)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class SwitchController(AutoLayout):
    """Rank 0's side of live switching for one engine (see the module docstring)."""

    def __init__(self, engine: Any, spec: RuntimeSpec, *, weight_pages: Sequence[int] | None = None,
                 history: int = 100_000) -> None:
        """`engine`: its allocator and scheduler (and runner, for `auto`'s step clock); `spec`: the
        model, dtype and element format, the schedule, `auto` and its theta, margin, dwell and mode;
        `weight_pages`: pages per rank the projection replicas take in DP/CP (measured by the ranks
        under a memory budget: `RankFacts.replica_pages`; None: none withheld)."""
        c = spec.config
        self.engine = engine
        self.alloc = engine.allocator
        self.sched = engine.scheduler
        self.cfg = spec.model
        self.world = self.alloc.world
        self.mode = c.switch_mode
        self.schedule = deque((n, lay.value) for n, lay in spec.schedule)
        # the pool's element format (--kv-cache-dtype): what a page weighs in every plan and policy
        self.kv_dtype = spec.kv_format
        self.planner = SwitchPlanner(self.cfg, self.alloc, spec.dtype, self.kv_dtype)
        self.replicas = ReplicaPages(self.alloc, weight_pages, self.planner.page_bytes)
        self.auto = spec.auto
        self.policy_cfg = None
        self.theta, self.theta_source = spec.theta, spec.theta_source
        self.sizes = None
        if self.auto:
            self._init_policy(spec.dtype, c.switch_margin, c.min_dwell_steps)
        self.pending: Any = None  # the SwitchPlan travelling with the current step
        self._pending_event: SwitchEvent | None = None
        self._requested: tuple[str, str | None] | None = None
        self.deferred: str | None = None  # a switch waiting for PD requests' KV to arrive (decode side)
        self.steps_since_switch = 0
        self._last_eval: tuple[Any, int] | None = None  # (running set key, step) the Policy last priced
        self.events: deque[SwitchEvent] = deque(maxlen=history)
        # The last events as dicts, made once when each is logged: stats() runs after every step.
        self._recent_events: deque[dict[str, Any]] = deque(maxlen=64)
        self.decisions: deque[LayoutDecision] = deque(maxlen=history)
        self.switches: dict[tuple[str, str], int] = {}
        self.refusals = 0
        self.exposed = ExposedHistogram()  # every switch's exposed seconds on rank 0
        self.switch_backs: dict[tuple[str, str], int] = {}  # the regret guard's switches back, committed
        self._switch_back: Any = None  # a guard Verdict asking to go back at the next step
        self.feedback: Any = None  # StepFeedback (auto): the step clock behind the online correction
        if self.auto:
            self._init_feedback(c.switch_margin)

    @property
    def weight_pages(self) -> list[int]:
        """Pages per rank the projection replicas take in DP/CP (0 without a budget)."""
        return self.replicas.weight_pages

    @property
    def withheld(self) -> list[list[int]]:
        """The pages withheld from each rank's allocator for replicas now."""
        return self.replicas.withheld

    def capacity(self, dst: str) -> list[int]:
        """KV pages each rank can give requests in `dst` (the replicas' pages withheld in DP/CP)."""
        return self.replicas.capacity(dst)

    def distinct_tokens(self, dst: str) -> int:
        """Distinct KV tokens the group holds in `dst` (TP replicates: one rank's share)."""
        return self.replicas.distinct_tokens(dst)

    def stranded(self, dst: str, live: list[Any], need: tuple[int, int] | None = None) -> str | None:
        """Why `dst` could not serve some running or waiting request as far as the current layout can
        (its limit, prompt + max_tokens, or this layout's per-request reach if that is less): e.g. CP's
        position shards -> TP's one pool. None when no request loses reach. A switch must never strand
        a request: queued ones were accepted for the layout they arrived in. `need`: `_need(live)`."""
        seqs = [*live, *self.sched.waiting]
        if not seqs:
            return None
        need, seq = need or self._need(live)
        P = self.alloc.page_size
        cap = request_capacity(dst, self.capacity(dst), P)
        here = request_capacity(self.alloc.layout, self.capacity(self.alloc.layout), P)
        if cap >= min(need, here):  # (a limit beyond even this layout's reach: only losing reach counts)
            return None
        what = "running" if seq < len(live) else "waiting"
        rid = getattr(getattr(seqs[seq], "group", None), "request_id", seqs[seq].seq_id)
        return (f"{what} request {rid!r} reaches {need} tokens at its limit; one request holds at most {cap} "
                f"in {dst}")

    def _need(self, live: list[Any]) -> tuple[int, int]:
        """(tokens, index in live + waiting) of the request that reaches furthest at its limit."""
        return max(((self._projected(s), i) for i, s in enumerate([*live, *self.sched.waiting])),
                   default=(0, 0))

    def fits(self, dst: str, live: list[Any], rows: dict[int, int] | None = None) -> bool:
        """Whether a switch to `dst` would be planned now: no request loses reach (`stranded`) and the
        planner's own checks pass, run dry (`SwitchPlanner.check`: owners, Eq 5 during the switch, Eq 6
        for the batch grown to each request's limit, replica pages counted). `rows`: this step's new
        rows per request (their pages are new wherever a table does not cover them yet)."""
        return dst in self.fitting([dst], live, rows)

    def fitting(self, dsts: Sequence[str], live: list[Any], rows: dict[int, int] | None = None) -> list[str]:
        """The layouts of `dsts` that `fits`, the batch checked and laid out once for all of them (the
        Policy asks about every candidate each time it weighs the batch)."""
        need = self._need(live)
        dsts = [dst for dst in dsts if self.stranded(dst, live, need) is None]
        if not dsts:
            return []
        rows = rows or {}
        dsts = self.roomy(dsts, live, rows)
        if not dsts:
            return []
        reqs = self._live_requests(live, rows)
        try:
            cols = self.planner.columns(reqs)
        except SharedOutOfOrder:  # (no layout fits until those requests finish)
            return []
        return [dst for dst in dsts if self._plan_reqs(dst, reqs, self.mode, dry_run=True, cols=cols) is None]

    def roomy(self, dsts: Sequence[str], live: list[Any], rows: dict[int, int] | None = None) -> list[str]:
        """The layouts of `dsts` whose distinct KV pages (replicated KV: one rank's) hold the batch grown
        to its requests' limits: Eq 6 summed over ranks, whatever the owners. A necessary condition of
        the planner's per-rank check, and cheap: a layout it drops would be refused anyway, without the
        page tables copied and laid out (a narrowing tail has 2-3 such layouts for many steps)."""
        rows = rows or {}
        P = self.alloc.page_size
        pages = sum(-(-max(self._projected(s), s.num_computed + rows.get(s.seq_id, 0)) // P) for s in live)
        return [dst for dst in dsts if pages * P <= self.distinct_tokens(dst)]

    # ---- requests from outside (benchmarks, tests) ------------------------------------------------
    def request(self, dst: str, mode: str | None = None) -> None:
        """Switch to `dst` at the next step that runs (overrides the schedule and the policy once)."""
        dst = str(dst).lower()
        if dst not in LAYOUTS:
            raise ConfigError(f"unknown layout {dst!r}; choose one of {', '.join(LAYOUTS)}")
        if mode is not None and mode not in MODES:
            raise ConfigError(f"unknown switch mode {mode!r}; choose one of {', '.join(MODES)}")
        self._requested = (dst, mode)

    # ---- the engine's hooks ---------------------------------------------------------------------------
    def before_execute(self, st: Any) -> None:
        """Decide and plan this step's switch (if any); rewrites `st.plan` into the destination."""
        plan = st.plan
        cur = self.alloc.layout
        dst, cause, mode = None, "", self.mode
        while self.schedule and self.schedule[0][0] <= plan.step:
            _, lay = self.schedule.popleft()
            dst, cause = lay, "schedule"
        if self._requested is not None:
            (dst, m), cause = self._requested, "request"
            mode = m or mode
            self._requested = None
        back, self._switch_back = self._switch_back, None
        # The sequences holding pages (a fixed layout with nothing to switch needs none of this).
        live = ([s for s in self.sched.running if holds_pages(s.pages, s.owner)]
                if self.auto or dst is not None or back is not None else [])
        if cause == "" and back is not None and back.dst == cur and live:
            dst, cause = back.src, "guard"
            self._record_back(plan, live, back)
        if self.auto and cause == "":
            dst = self._decide(plan, live)
            cause = "auto"
        try:
            self._switch_to(st, dst, cause, mode, live)
        finally:
            if self.feedback is not None:
                self.feedback.begin(st.plan, live, self.alloc.layout, switching=self.pending is not None)

    def _switch_to(self, st: Any, dst: str | None, cause: str, mode: str, live: list[Any]) -> None:
        """Plan the switch into `dst` (None: none) and rewrite `st.plan` into it, or log the refusal."""
        plan = st.plan
        cur = self.alloc.layout
        if dst is None or dst == cur:
            self.deferred = None
            self.steps_since_switch += 1
            return
        if self.sched.parked or self.sched.draining:
            # A PD decode engine: the prefill side writes into the parked requests' pages as reserved in
            # this layout; the switch waits until they arrived (new reservations wait for it: pd.reserve).
            self.deferred = dst
            if cause == "schedule":
                self.schedule.appendleft((plan.step, dst))
            elif cause == "request":
                self._requested = (dst, mode)
            self.steps_since_switch += 1
            return
        self.deferred = None
        t0 = time.perf_counter()
        why = self.stranded(dst, live)
        if why is not None:
            sw: Any = SwitchRefusal(cur, dst, "request", why)
        else:
            # unreferenced cached pages are dropped, not moved (prefix.py's rule; no cache: a no-op);
            # shared ones move once, with their holders
            self.alloc.evict_all()
            sw = self._plan(dst, plan, live, mode)
        plan_s = time.perf_counter() - t0

        if isinstance(sw, SwitchRefusal):
            self.refusals += 1
            self._log_event(SwitchEvent(plan.step, cur, dst, cause, mode, refused=sw.reason,
                                        message=str(sw), plan_s=plan_s))
            log.warning("step %d: %s; staying in %s", plan.step, sw, cur)
            self.steps_since_switch = 0  # do not re-plan the same refused move every step
            return
        new = sw.restep(plan)
        st.plan = dataclasses.replace(new, kind="switch", payload=sw.for_ranks(), tables=sw.tables)
        self.pending = sw
        lay = sw.layers[0] if sw.layers else None
        per_layer = (sum(lay.weight_send_bytes) + sum(lay.kv_send_bytes)) if lay else 0.0
        self._pending_event = SwitchEvent(plan.step, cur, dst, cause, sw.mode, bytes_per_layer=per_layer,
                                          layers=sw.num_layers, plan_s=plan_s)

    def _plan(self, dst: str, plan: StepPlan, live: list[Any], mode: str) -> Any:
        """The planner's SwitchPlan (or refusal) for this step's live batch into `dst`."""
        return self._plan_reqs(dst, self._live_requests(live, {s.req_id: s.num_new for s in plan.seqs}), mode)

    def _live_requests(self, live: list[Any], rows: dict[int, int]) -> list[LiveRequest]:
        """The planner's view of the live sequences, this step's rows included."""
        return [LiveRequest(seq.seq_id, context=seq.num_computed, owner=seq.owner,
                            pages=[row[:] for row in seq.pages],
                            tokens=seq.num_computed + rows.get(seq.seq_id, 0),
                            projected=self._projected(seq), slot=seq.slot)
                for seq in live]

    def _plan_reqs(self, dst: str, reqs: list[LiveRequest], mode: str, dry_run: bool = False,
                   cols: Any = None) -> Any:
        """The planner's plan into `dst`; `dry_run`: its check only (its refusal, or None where it would
        plan); `cols`: `planner.columns(reqs)`, when already made."""
        self.planner.reserve = self.replicas.reserve(dst)
        # Leaving DP/CP gives the replicas' withheld pages back at commit: dst's Eq 6 has them.
        self.planner.returned = self.replicas.returned(dst)
        try:
            return (self.planner.check(dst, reqs, mode, cols) if dry_run
                    else self.planner.plan(dst, reqs, mode))
        except SharedOutOfOrder as e:
            return SwitchRefusal(self.alloc.layout, dst, "shared", str(e))
        finally:
            self.planner.reserve, self.planner.returned = [0] * self.world, [0] * self.world

    def _projected(self, seq: Any) -> int:
        """Expected final length: the request's own limit (prompt + max_tokens, capped by the context)."""
        p = seq.params
        ctx = self.sched.cfg.max_model_len
        limit = ctx if p.max_tokens is None else len(seq.prompt_token_ids) + p.max_tokens
        return max(seq.num_tokens, min(limit, ctx))

    def after_execute(self, st: Any) -> None:
        """The step ran on every rank: record its time (auto); commit the switch that travelled with it."""
        if self.feedback is not None:
            verdict = self.feedback.end()
            if verdict is not None:
                self._switch_back = verdict if verdict.switch_back else None
                (log.info if verdict.switch_back or verdict.unblocked else log.debug)(
                    "step %d: regret guard: %s", st.plan.step, verdict.reason)
        sw = self.pending
        if sw is None:
            return
        runner = getattr(self.engine.runner, "local", self.engine.runner)
        timing: SwitchTiming | None = getattr(runner, "last_switch", None)
        src = self.alloc.layout
        self.planner.commit(sw, freed=timing.freed if timing is not None else None)
        by_id = {seq.seq_id: seq for seq in self.sched.running}
        self.alloc.cache_moved({rid: by_id[rid].pages for rid in sw.tables if rid in by_id}, sw.tables)
        for rid, table in sw.tables.items():
            seq = by_id.get(rid)
            if seq is None:
                continue
            seq.pages = [pages[:] for pages in table]
            self.sched.set_owner(seq, sw.owners[rid])
        self.replicas.switched(src, sw.dst)
        self.pending = None  # committed (until here a failure leaves it pending: the engine is unsound)
        ev = self._pending_event
        self._pending_event = None
        if ev is not None:
            ev.ended = time.time()
            if timing is not None:
                ev.exposed_s, ev.total_s = timing.exposed_s, timing.total_s
            self._log_event(ev)
            self.exposed.add(ev.exposed_s)
        self.switches[(sw.src, sw.dst)] = self.switches.get((sw.src, sw.dst), 0) + 1
        self.steps_since_switch = 0
        cause = ev.cause if ev is not None else ""
        if cause == "guard":
            self.switch_backs[(sw.src, sw.dst)] = self.switch_backs.get((sw.src, sw.dst), 0) + 1
        if self.feedback is not None:
            self.feedback.guard.switched(st.plan.step, sw.src, sw.dst, voluntary=cause == "auto")
        log.info("step %d: switched %s -> %s (%s, %s): %.0f B/layer, exposed %.1f ms", st.plan.step, sw.src,
                 sw.dst, ev.cause if ev else "?", sw.mode, ev.bytes_per_layer if ev else 0,
                 (ev.exposed_s if ev else 0) * 1e3)

    def abort_pending(self) -> None:
        """The switching step failed before it ran everywhere: give back its destination pages."""
        sw, self.pending, self._pending_event = self.pending, None, None
        if sw is not None:
            try:
                self.planner.abort(sw)
            except RuntimeError as e:  # already committed/aborted: nothing left to undo
                log.warning("abort of switch plan %s: %s", sw.plan_id, e)

    # ---- introspection -----------------------------------------------------------------------------------
    def _log_event(self, ev: SwitchEvent) -> None:
        """A switch that ran (complete: its step has run) or was refused, kept for stats and logs."""
        self.events.append(ev)
        self._recent_events.append(ev.to_dict())

    def stats(self) -> dict[str, Any]:
        return {
            "layout_mode": "auto" if self.auto else "fixed",
            "switch_mode": self.mode,
            "switches_total": {f"{a}->{b}": n for (a, b), n in sorted(self.switches.items())},
            "num_switches": sum(self.switches.values()),
            "switch_refusals": self.refusals,
            "switch_exposed_seconds": self.exposed.to_dict(),
            "switch_events": list(self._recent_events),  # (bench serve marks them)
            "theta_source": self.theta_source if self.auto else None,
            "weight_pages_withheld": [len(w) for w in self.withheld],
            "num_switch_backs": sum(self.switch_backs.values()),
            "switch_backs_total": {f"{a}->{b}": n for (a, b), n in sorted(self.switch_backs.items())},
            "theta_correction": self.feedback.correction.summary() if self.feedback is not None else None,
            "regret_verdicts": ([v.to_dict() for v in self.feedback.guard.verdicts[-20:]]
                                if self.feedback is not None else []),
        }

    def close(self) -> None:
        """At shutdown: one log line saying which prior the policy ran on and how far the measured
        steps moved it."""
        if self.feedback is None:
            return
        log.info("layout policy: prior %s; online correction (measured / predicted): %s; %d switch back(s)",
                 self.theta.source or self.theta_source, describe(self.feedback.correction.summary()),
                 sum(self.switch_backs.values()))


def holds_pages(pages: list[list[int]], owner: int = 0) -> bool:
    """Whether a request's table (`pages[r][j]`, -1: not held) holds any page. Asked every step for every
    running request: the owner's row (DP/DOP: every page; TP/CP: page 0 on rank 0) is usually told by
    its first entry, before the other rows are scanned."""
    first = pages[owner] if 0 <= owner < len(pages) else None
    if first and first[0] >= 0:
        return True
    return any(row and (row[0] >= 0 or row[-1] >= 0 or max(row) >= 0) for row in pages)
